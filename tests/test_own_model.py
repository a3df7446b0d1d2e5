"""A team's own model through the trainer (train.run's model_fn): a GPT-2-style decoder, not our Llama, against
plain single-process training, across a resume on another world size, and the errors a plausible mistake gives."""

from __future__ import annotations

import copy
import math
import random
import re
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp_trainer import distributed, train
from fsdp_trainer.config import ConfigError, parse_args
from fsdp_trainer.data import build_dataloader, build_dataset
from fsdp_trainer.models import llama
from fsdp_trainer.optim import build_optimizer, build_scheduler, lr_at
from fsdp_trainer.tools.model_checks import (check_initializable, check_logits_once, check_own_model,
                                             check_token_embedding_once, check_units)

from helpers import TINY_FLAGS, run_forked, run_ranks, tiny_config
from test_parallelize import ARGS, AttentionBlock, Gate, TiedLM


class GPT2Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        # No bias on q, k, v: a key bias has a gradient of zero but for rounding, which AdamW would blow up into
        # updates that differ between any two ways of summing it.
        self.c_attn = nn.Linear(dim, 3 * dim, bias=False)
        self.c_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, c = x.shape
        qkv = self.c_attn(self.ln_1(x)).split(c, 2)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in qkv)
        x = x + self.c_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """Learned positions, LayerNorm with bias, GELU MLP, a head tied to the embedding, blocks in a ModuleDict of a
    ModuleList, a parameter outside any block and a buffer."""

    def __init__(self, vocab: int = 320, dim: int = 32, heads: int = 4, layers: int = 2, ctx: int = 32):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(ctx, dim)
        self.stack = nn.ModuleDict({"h": nn.ModuleList(GPT2Block(dim, heads) for _ in range(layers))})
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.wte.weight = self.lm_head.weight
        self.logit_scale = nn.Parameter(torch.ones(1))
        self.register_buffer("positions", torch.arange(ctx), persistent=False)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(self.positions[:tokens.shape[1]])
        for block in self.stack["h"]:
            x = block(x)
        return self.lm_head(self.ln_f(x)) * self.logit_scale


def gpt2_fn(cfg):
    """model_fn: built eagerly (the trainer seeded torch's RNG with train.seed); the tied head in the root's unit."""
    model = GPT2()
    return model, (GPT2Block,), []


def python_draw_at_build(cfg):
    """Worker: what a model_fn draws from Python's RNG (random masking, say) when the trainer builds it."""
    drawn = []

    def drawing_fn(cfg):
        drawn.append(random.random())
        return gpt2_fn(cfg)

    train.run(cfg, distributed.init(), model_fn=drawing_fn)
    return drawn[0]


@pytest.mark.slow
def test_python_s_rng_is_seeded_with_train_seed_as_torch_s_is(tmp_path):
    """Fresh processes draw what train.seed says, not what the operating system's entropy does: a team's model that
    draws from `random` trains the same run after run (and checkpoints carry its state on from there)."""
    cfg = tiny_config(train={"output_dir": str(tmp_path), "steps": 1, "seed": 7})
    assert run_ranks(python_draw_at_build, 1, cfg) == [random.Random(7).random()]


def train_gpt2(cfg, model_fn=gpt2_fn):
    """Worker: the trainer on GPT2; rank 0's history and full weights."""
    info = distributed.init()
    result = train.run(cfg, info, model_fn=model_fn)
    state = get_model_state_dict(result["model"], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"history": result["history"], "state": state if info.rank == 0 else None}


def reference(cfg, world_size: int, steps: int):
    """The first `steps` steps in one process, unsharded, each micro-batch the `world_size` ranks' together."""
    t = cfg.train
    torch.manual_seed(t.seed)
    model = GPT2()
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, t.steps)
    dataset = build_dataset(cfg.data, t.seq_len, 320)
    batches = iter(build_dataloader(dataset, num_workers=0, micro_batch_size=t.micro_batch_size * world_size,
                                    grad_accum_steps=t.grad_accum_steps, dp_rank=0, dp_size=1))
    losses = []
    for step in range(steps):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(step, cfg.optim, t.steps))
        total = 0.0
        for _ in range(t.grad_accum_steps):
            inputs, labels = next(batches)
            loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()) / t.grad_accum_steps
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or math.inf)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(total)
    return losses, model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("world_size,ac,accum", [(4, "op", 1), (2, "full", 2)])
def test_a_teams_gpt2_trains_through_the_trainer_like_plain_training(tmp_path, world_size, ac, accum):
    cfg = tiny_config(ac={"mode": ac}, train={"output_dir": str(tmp_path), "steps": 3, "grad_accum_steps": accum,
                                              "micro_batch_size": 8 // world_size // accum})
    [result, *_] = run_ranks(train_gpt2, world_size, cfg)
    ref_losses, ref_state = reference(cfg, world_size, cfg.train.steps)
    assert [row["loss"] for row in result["history"]] == pytest.approx(ref_losses, abs=2e-5)
    assert result["state"].keys() == ref_state.keys()
    for name, value in ref_state.items():
        torch.testing.assert_close(result["state"][name], value, atol=2e-5, rtol=0, msg=name)
    assert result["state"]["lm_head.weight"].equal(result["state"]["wte.weight"])  # still tied


@pytest.mark.slow
def test_a_teams_model_resumes_on_another_world_size(tmp_path):
    """Saved at step 2 of 4 on 2 ranks, resumed on 1 at the same global batch: the uninterrupted run's losses."""
    first = tiny_config(train={"output_dir": str(tmp_path / "a"), "steps": 4}, checkpoint={"interval": 2})
    uninterrupted = run_ranks(train_gpt2, 2, first)[0]["history"]
    resumed = copy.deepcopy(first)
    resumed.train.output_dir, resumed.train.micro_batch_size = str(tmp_path / "b"), 8
    resumed.checkpoint.resume = str(tmp_path / "a" / "checkpoints" / "step_00000002")
    history = run_ranks(train_gpt2, 1, resumed)[0]["history"]
    assert [row["step"] for row in history] == [3, 4]
    assert [row["loss"] for row in history] == pytest.approx([row["loss"] for row in uninterrupted[2:]], abs=2e-5)


def one_step(model):
    """train_step on one process, the model unsharded and checked as the trainer checks a team's model, on a batch
    of 2 x 32 tokens."""
    cfg = tiny_config()
    check_logits_once(model, cfg.model.vocab_size)
    optimizer = build_optimizer(model, cfg.optim)
    tokens = torch.randint(0, 320, (2, 33), generator=torch.Generator().manual_seed(0))
    batches = iter([(tokens[:, :-1], tokens[:, 1:])])
    scheduler = build_scheduler(optimizer, cfg.optim, 1)
    train.train_step(model, optimizer, scheduler, batches, cfg, None, torch.device("cpu"))


class ReturnsTuple(GPT2):
    def forward(self, tokens):
        return super().forward(tokens), None  # logits and a cache, as some models do


class Classifier(GPT2):
    def forward(self, tokens):
        return super().forward(tokens)[:, 0]  # one prediction per sequence


class NarrowHead(GPT2):
    def forward(self, tokens):
        return super().forward(tokens)[..., :300]  # fewer classes than the data's ids


@pytest.mark.parametrize("model,returned", [(ReturnsTuple, "a tuple"), (Classifier, r"a tensor of shape \(2, 320\)"),
                                            (NarrowHead, r"a tensor of shape \(2, 32, 300\)")])
def test_a_forward_that_does_not_return_logits_is_named(model, returned):
    with pytest.raises(ConfigError, match=rf"model\(tokens\) returned {returned} for tokens of shape \(2, 32\): the "
                                        r"trainer needs the logits alone, one tensor of shape \(batch, seq_len, "
                                        r"vocab_size\) with vocab_size at least model.vocab_size=320"):
        one_step(model())


def narrow_head_fn(cfg):
    return NarrowHead(), (GPT2Block,), []


@pytest.mark.slow
def test_the_trainer_checks_the_logits_of_a_teams_model(tmp_path):
    """The check above is the one build_model puts on a team's model (the stdlib data's byte ids, all below 300, would
    train unchecked)."""
    cfg = tiny_config(train={"output_dir": str(tmp_path)})
    with pytest.raises(AssertionError, match=r"ConfigError: model\(tokens\) returned a tensor of shape \(4, 32, "
                                             r"300\)"):
        run_ranks(train_gpt2, 1, cfg, narrow_head_fn)


def test_the_logits_are_checked_at_the_first_forward_only():
    """Every step's shapes are the first one's; after training, the model is the user's, whose other uses (generation
    with a cache, say) return more than logits."""
    model = GPT2()
    check_logits_once(model, 320)
    tokens = torch.zeros(2, 32, dtype=torch.long)
    model(tokens)
    model.forward = lambda tokens: (GPT2.forward(model, tokens), None)
    logits, cache = model(tokens)
    assert logits.shape == (2, 32, 320) and cache is None


def small_vocab_fn(cfg):
    return GPT2(vocab=300), (GPT2Block,), []


def test_an_embedding_smaller_than_the_data_s_vocabulary_is_named_before_the_first_step():
    """Ids up to model.vocab_size would index past it: an IndexError in the first step, a device-side assert on GPUs.
    (test_main_names_... runs this and the next check through the trainer.)"""
    cfg = tiny_config()
    with pytest.raises(ConfigError, match=r"^GPT2's largest embedding has 300 rows, but the data may hold ids up to "
                                          r"model.vocab_size=320: set --model.vocab_size 300"):
        check_own_model(small_vocab_fn(cfg), cfg)


def byte_vocab_fn(cfg):
    """A byte-level vocabulary with a long context: the position table, not the token embedding, is the largest."""
    return GPT2(vocab=300, ctx=1024), (GPT2Block,), []


def test_a_token_embedding_smaller_than_the_vocabulary_is_named_at_the_first_lookup():
    """Its 1024 positions pass the check of the largest embedding against model.vocab_size=512; the lookup of the
    tokens in its 300 rows is refused before it indexes past them (an IndexError, a device-side assert on GPUs)."""
    cfg = tiny_config(model={"vocab_size": 512})
    model, _, _ = check_own_model(byte_vocab_fn(cfg), cfg)
    with pytest.raises(ConfigError, match=r"^GPT2's token embedding wte has 300 rows, but the data may hold ids up "
                                          r"to model.vocab_size=512: set --model.vocab_size 300"):
        model(torch.zeros(2, 32, dtype=torch.long))


def test_the_token_embedding_is_checked_at_the_first_forward_only():
    """The position lookup (not the tokens) passes; after the first forward no hook is left to cost anything."""
    model = GPT2(vocab=300, ctx=1024)
    check_token_embedding_once(model, 320)
    with pytest.raises(ConfigError, match="GPT2's token embedding wte has 300 rows"):
        model(torch.zeros(2, 8, dtype=torch.long))
    assert not model._forward_pre_hooks and not model._forward_hooks and not model.wte._forward_pre_hooks
    model(torch.zeros(2, 8, dtype=torch.long))  # unchecked from now on
    model = GPT2(vocab=320)
    check_token_embedding_once(model, 320)
    model(torch.zeros(2, 8, dtype=torch.long))
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not any(module._forward_pre_hooks for module in model.modules())


def sharded_units_of_generators(cfg):
    """Worker: which of GPT2's modules become FSDP units of their own when model_fn gives its groups as generators
    (the trainer reads them twice: to check them, then to shard them)."""
    from torch.distributed.fsdp import FSDPModule

    def generators_fn(cfg):
        model = GPT2()
        return model, (GPT2Block,), (iter(group) for group in ([model.wpe], [model.ln_f]))

    distributed.init()
    model, _ = train.build_model(cfg, distributed.build_mesh("cpu", 1, 1), torch.device("cpu"), generators_fn)
    return [isinstance(module, FSDPModule) for module in (model.wpe, model.ln_f)]


@pytest.mark.slow
def test_groups_given_as_generators_are_sharded_as_listed(tmp_path):
    assert run_ranks(sharded_units_of_generators, 1, tiny_config(train={"output_dir": str(tmp_path)})) == [[True, True]]


def split_tie_fn(cfg):
    """The tied embedding in a group of its own, its head left to the root: two units would each shard a copy."""
    model = GPT2()
    return model, (GPT2Block,), [[model.wte]]


def two_tuple_fn(cfg):
    return GPT2(), (GPT2Block,)  # groups left out


def returns_tuple_fn(cfg):
    return ReturnsTuple(), (GPT2Block,), []


@pytest.mark.parametrize("model_fn,message", [
    ("small_vocab_fn", "GPT2's largest embedding has 300 rows"),
    ("byte_vocab_fn", "GPT2's token embedding wte has 300 rows, but the data may hold ids up to model.vocab_size=320"),
    ("two_tuple_fn", "model_fn returned a tuple of 2, but must return (model, block classes, groups), e.g. (model, "
                     "(MyBlock,), []), with [] for no groups"),
    ("returns_tuple_fn", "model(tokens) returned a tuple for tokens of shape (2, 32): the trainer needs the logits "
                         "alone"),
    ("split_tie_fn", "GPT2 as model_fn returned it: lm_head.weight (in the root (what no block or group "
                     "holds)) is the same parameter as wte.weight (in group [wte]), tied weights"),
])
@pytest.mark.slow
def test_main_names_what_is_wrong_with_a_teams_model_in_one_line(tmp_path, model_fn, message):
    """The trainer's command line, a single process: a model that does not fit the settings, or cannot be sharded
    as model_fn lists its units, is bad input (exit 2, one error line), not a crash with a traceback per rank."""
    out = run_forked(partial(train.main, model_fn=globals()[model_fn]), [
        *TINY_FLAGS, "--data.source", "synthetic", "--dist.no_flight_recorder", "--train.output_dir", str(tmp_path)])
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"error: {message}" in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]


def test_the_chunked_loss_refuses_a_forward_that_takes_only_tokens():
    cfg = tiny_config(train={"loss_chunk_tokens": 16})
    with pytest.raises(ConfigError, match=r"^train.loss_chunk_tokens needs GPT2.forward\(tokens, labels, "
                                          r"chunk_tokens\) returning the mean loss, but its forward takes \(tokens\): "
                                          "set --train.loss_chunk_tokens 0"):
        check_own_model(gpt2_fn(cfg), cfg)


def start_main_until_the_group(tmp_path, monkeypatch, *flags: str) -> None:
    """main(model_fn=gpt2_fn) on the tiny flags and `flags`, up to where it would start the process group."""
    monkeypatch.setattr(train.distributed, "init", lambda *a, **k: pytest.fail("group started"))
    monkeypatch.setattr(train.StopSignals, "install", lambda self: None)  # main() would not restore them here
    with pytest.raises(pytest.fail.Exception, match="group started"):
        train.main([*TINY_FLAGS, "--data.source", "synthetic", "--dist.no_flight_recorder",
                    "--train.output_dir", str(tmp_path), *flags], model_fn=gpt2_fn)


def test_the_memory_plan_is_skipped_for_a_teams_model_and_says_so(tmp_path, monkeypatch, capsys):
    """On a GPU (faked), the Llama of --model.* is not what runs: no plan refuses or passes the run in its name."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: pytest.fail("planned"))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    start_main_until_the_group(tmp_path, monkeypatch)
    assert "memory plan: none for your own model; the planner knows only the Llama that --model.* describes" in \
        capsys.readouterr().err


def test_the_llama_preset_s_context_and_depth_do_not_bound_a_teams_model(tmp_path, monkeypatch):
    """GPT2's 32 positions and 2 blocks, not the preset's 16 positions and 1 block: seq_len 32, keep_gathered 2 and
    selective AC of every 2nd block start (its own bounds are checked once it is built)."""
    start_main_until_the_group(tmp_path, monkeypatch, "--model.max_seq_len", "16", "--model.n_layers", "1",
                               "--parallel.keep_gathered", "2", "--ac.mode", "selective", "--ac.every", "2")


class LongContextGPT2(GPT2):
    max_seq_len = 32


@pytest.mark.parametrize("flags,message", [
    (["--train.seq_len", "64"], "train.seq_len=64 exceeds LongContextGPT2.max_seq_len=32: lower --train.seq_len, or "
                                "build the model with a longer context"),
    (["--parallel.keep_gathered", "3"], "parallel.keep_gathered=3: must be between 0 and the model's 2 blocks"),
    (["--ac.mode", "selective", "--ac.every", "3"], "ac.every=3 with ac.mode=selective checkpoints every 3th block, "
                                                    "and the model has 2: none would be"),
])
def test_a_teams_model_s_own_context_and_blocks_bound_the_run(flags, message):
    cfg = parse_args([*TINY_FLAGS, *flags])
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_own_model((LongContextGPT2(), (GPT2Block,), []), cfg)
    check_own_model((LongContextGPT2(), (GPT2Block,), []), parse_args(TINY_FLAGS))


@pytest.mark.parametrize("build,message", [
    (lambda: (lambda m: (m, [m.wpe]))(GPT2()), r"GPT2 as model_fn returned it: groups holds an item of type Embedding where a "
                                     r"list of modules belongs: groups is a list of lists of modules, e.g. "
                                     r"\[\[model.embed\], "),
    (lambda: (GPT2(), [[]]), "GPT2 as model_fn returned it: a group in `groups` is empty"),
    # Built on meta, its scale and its position buffer, in the root, which has neither reset_parameters() nor
    # init_param and init_buffers, would hold garbage.
    (lambda: (GPT2().to("meta"), []), "GPT2 as model_fn returned it: init_weights cannot initialize logit_scale, "
                                      "positions: materialized from meta they would hold garbage"),
])
def test_a_teams_model_that_cannot_be_sharded_or_materialized_is_named_before_sharding(build, message):
    """As a ConfigError (one line, exit 2, from main), before anything is sharded or allocated, not as a TypeError
    from reading the groups or a ValueError from init_weights after sharding, once per rank."""
    cfg = parse_args(TINY_FLAGS)
    model, groups = build()
    with pytest.raises(ConfigError, match=message):
        check_own_model((model, (GPT2Block,), groups), cfg)


def test_flops_per_token_of_a_teams_model(caplog):
    """The model's own count where it has one, else 6 per parameter, said in the log."""
    model = GPT2()
    params = sum(p.numel() for p in model.parameters())
    with caplog.at_level("INFO", logger="fsdp_trainer"):
        assert train.flops_per_token(model, None, 32, params) == 6 * params
    assert "GPT2 has no flops_per_token(seq_len): TFLOPs and MFU assume 6 FLOPs per parameter" in caplog.text
    model.flops_per_token = lambda seq_len: 1000 * seq_len
    assert train.flops_per_token(model, None, 32, params) == 32000


# -- the checks of tools/model_checks.py on their own: the units a model can be sharded in, and meta-device init --
def test_a_module_in_two_fsdp_units_is_named():
    """fully_shard would fail on the second with a bare assertion, or an invariant error for one nested in another."""
    model = llama.build(ARGS, device="meta")
    for groups, name in (([[model.layers[3], model.output]], "layers.3"), ([[model.output], [model.norm, model.output]],
                                                                           "output"),
                         ([[model.norm, model.norm]], "norm"), ([[model.layers[0].attention]], "layers.0.attention"),
                         ([[model.layers]], "layers.0"), ([[model]], "layers.0")):
        with pytest.raises(ValueError, match=f"^{name} is in two FSDP units"):
            check_units(model, (llama.TransformerBlock,), groups)
    with pytest.raises(ValueError, match="a group in `groups` is empty"):  # it would fail in sharding, obscurely
        check_units(model, (llama.TransformerBlock,), [[model.output], []])


def test_block_classes_matching_modules_inside_the_blocks_are_refused():
    """fully_shard would fail on the inner ones with an invariant error."""
    with torch.device("meta"):
        model = TiedLM()
    with pytest.raises(ValueError, match=r"^blocks.0.attn.out_proj is in two FSDP units: the block class "
                                         r"NonDynamicallyQuantizableLinear matches modules inside another block "
                                         r"\(blocks.0, of class AttentionBlock\): give block_types the class of the "
                                         "outermost repeated blocks only$"):
        check_units(model, (AttentionBlock, nn.Linear))


@pytest.mark.parametrize("groups,names", [
    ([["embed"], ["norm", "head"]], r"head.weight \(in group \[norm, head\]\) is the same parameter as embed.weight "
                                    r"\(in group \[embed\]\)"),
    ([["embed"]], r"head.weight \(in the root \(what no block or group holds\)\) is the same parameter as "
                  r"embed.weight \(in group \[embed\]\)"),
])
def test_tied_weights_split_across_units_are_refused(groups, names):
    """Each unit would shard a copy of its own; FSDP2 refuses it at the first forward at best, once per rank."""
    with torch.device("meta"):
        model = TiedLM()
    with pytest.raises(ValueError, match=names + ", tied weights, which must live in one FSDP unit: put the "
                                               r"modules that share it \(embed and head\) in one group"):
        check_units(model, (AttentionBlock,), [[getattr(model, name) for name in group] for group in groups])


def _tie_across(model, where):
    if where == "two blocks":
        model.blocks[1].mlp.weight = model.blocks[0].mlp.weight
    else:  # a block and the root
        model.norm.weight = model.blocks[1].norm.weight
    return model


@pytest.mark.parametrize("where,names", [
    ("two blocks", r"blocks.1.mlp.weight \(in block blocks.1\) is the same parameter as blocks.0.mlp.weight \(in "
                   r"block blocks.0\)"),
    ("block and root", r"norm.weight \(in the root \(what no block or group holds\)\) is the same parameter as "
                       r"blocks.1.norm.weight \(in block blocks.1\)"),
])
def test_a_weight_tied_inside_a_block_is_refused_with_advice_that_can_work(where, names):
    """A module inside a block cannot join a group (it would be in two units), nor the root: the advice for ties
    between groups and the root would only lead to another error."""
    with torch.device("meta"):
        model = _tie_across(TiedLM(), where)
    users = {"two blocks": "blocks.0.mlp and blocks.1.mlp", "block and root": "blocks.1.norm and norm"}[where]
    with pytest.raises(ValueError, match=f"^{names}, tied weights, which must live in one FSDP unit, and a block's "
                                         "unit is the block: hold the shared weight in one module registered once on "
                                         r"the model, outside the blocks \(the root or a group of its own then holds "
                                         r"it\), or pass block classes whose modules contain all its users "
                                         rf"\({users}\)$"):
        check_units(model, (AttentionBlock,))
    if where == "two blocks":  # the second way out: a block class holding all its users (the Sequential of blocks)
        assert check_units(model, (nn.Sequential,))[0] == [model.blocks]


@pytest.mark.parametrize("groups,message", [
    (lambda m: [m.embed, m.norm], r"groups holds an item of type Embedding where a list of modules belongs: groups is "
                                  r"a list of lists of modules, e.g. \[\[model.embed\], \[model.norm, "
                                  r"model.head\]\], or \[\] for none"),
    (lambda m: [(m.norm)], "groups holds an item of type LayerNorm where a list of modules belongs"),
    # list() would take the Sequential's blocks for the group
    (lambda m: [m.blocks], "groups holds an item of type Sequential where a list of modules belongs"),
    (lambda m: m.norm, "groups holds an item of type LayerNorm where a list of modules belongs: groups is a list of "
                       "lists of modules"),
    (lambda m: [["norm", "head"]], "a group holds an item of type str, not a module: groups is a list of lists"),
])
def test_groups_in_another_form_than_lists_of_modules_are_refused_showing_the_form(groups, message):
    with torch.device("meta"):
        model = TiedLM()
    with pytest.raises(TypeError, match=f"^{message}"):
        check_units(model, (AttentionBlock,), groups(model))


def test_a_group_given_as_a_module_list_is_its_modules():
    with torch.device("meta"):
        model = TiedLM()
    assert check_units(model, (AttentionBlock,), [nn.ModuleList([model.norm])])[1] == [[model.norm]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_model_built_in_16_bits_is_refused(dtype):
    """fully_shard would keep the 16-bit dtype for the sharded parameters: master weights and AdamW moments in 16
    bits, and the float32-reduced gradients rounded down to it, with nothing to show for it but a worse loss."""
    model = llama.build(ARGS, device="meta").to(dtype)
    with pytest.raises(ValueError, match=r"^trainable parameters in 16 bits \(tok_embeddings.weight, "
                                         r"layers.0.attention_norm.weight, layers.0.attention.wq.weight, "
                                         r"layers.0.attention.wk.weight ...\), but the sharded parameters are the "
                                         "optimizer's master weights"):
        check_units(model, (llama.TransformerBlock,))
    # A frozen 16-bit base has no master weights: only the trainable parameters must be float32.
    model = llama.build(ARGS, device="meta").to(dtype).requires_grad_(False)
    model.output.float().requires_grad_(True)
    check_units(model, (llama.TransformerBlock,))


def test_init_weights_would_leave_parameters_and_buffers_nothing_fills():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)  # reset_parameters() fills it
            self.scale = nn.Parameter(torch.ones(4))
            self.register_buffer("table", torch.arange(4.0), persistent=False)

    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(ValueError, match="cannot initialize scale, table: materialized from meta"):
        check_initializable(model)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Gate(4))  # no module around the gate resets
    with pytest.raises(ValueError, match=r"cannot initialize 1.scale: materialized from meta"):
        check_initializable(model)
    with torch.device("meta"):
        check_initializable(TiedLM())  # the gate's block resets it
