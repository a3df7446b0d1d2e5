"""The parallelism helpers on their own: activation checkpointing, and sharding a model that is not ours."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fsdp_trainer.config import parse_args
from fsdp_trainer.models.llama import ModelArgs, TransformerBlock, build
from fsdp_trainer.parallelize import apply_ac, apply_fsdp, blocks_of, init_weights

from helpers import SDPA, TINY_FLAGS, OpCounter, is_gathered, run_ranks

ARGS = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim_multiplier=1.0,
                 multiple_of=32, max_seq_len=64, rope_theta=10000.0)


def _grads_and_backward_ops(mode: str, every: int = 2):
    """Gradients, and the ops run during backward (recomputed forward ops show up here)."""
    model = build(ARGS, device="cpu")
    init_weights(model, "cpu", seed=0)
    apply_ac(model, (TransformerBlock,), mode, every)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
    with OpCounter() as counter:
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, counter.counts


def test_every_ac_mode_gives_the_gradients_of_no_ac_and_recomputes_what_it_should():
    reference, base = _grads_and_backward_ops("none")
    assert base["silu"] == base[SDPA] == 0
    # q, k, v, o, w1, w3 per block: recomputation stops early before w2, whose output backward never needs.
    forward_mms = 6 * ARGS.n_layers
    expected = {  # mode: (forward matmuls recomputed, blocks whose SwiGLU activation, and attention, is recomputed)
        "full": (forward_mms, ARGS.n_layers, ARGS.n_layers),
        "selective": (forward_mms // 2, ARGS.n_layers // 2, ARGS.n_layers // 2),
        "op": (0, ARGS.n_layers, 0),  # matmul and attention outputs saved, the cheap elementwise ops recomputed
    }
    for mode, (mms, silus, attentions) in expected.items():
        grads, ops = _grads_and_backward_ops(mode)
        for name, grad in reference.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=f"{mode}: {name}")
        assert ops["mm"] - base["mm"] == mms, mode
        assert ops["silu"] == silus, mode
        assert ops[SDPA] == attentions, mode


def test_blocks_of_names_the_missing_block_type():
    with pytest.raises(ValueError, match=r"^Sequential has no submodule of the block classes \(Linear\): pass the "
                                         "classes of its repeated blocks as block_types"):
        blocks_of(nn.Sequential(nn.ReLU()), (nn.Linear,))
    with pytest.raises(ValueError, match=r"^TiedLM has no submodule of the block classes \(\): pass the classes of "
                                         r"its repeated blocks as block_types \(for a model without any, of its "
                                         r"largest submodules\)$"):
        blocks_of(TiedLM(), ())


def test_block_types_are_a_tuple_of_classes_or_one_class():
    model = build(ARGS, device="meta")
    assert blocks_of(model, TransformerBlock) == blocks_of(model, (TransformerBlock,)) == list(model.layers)
    for name in ("TransformerBlock", ("TransformerBlock",)):
        with pytest.raises(TypeError, match="isinstance"):
            blocks_of(model, name)


def test_a_misspelt_ac_mode_or_reshard_policy_fails_before_anything_is_wrapped_or_sharded(monkeypatch):
    """A team calls apply_ac or apply_fsdp on its own model: a misspelt mode must not leave it without AC, unsaid."""
    from fsdp_trainer import parallelize

    model = build(ARGS, device="meta")
    with pytest.raises(KeyError, match="Full"):
        apply_ac(model, (TransformerBlock,), "Full")
    assert all("forward" not in vars(block) for block in model.layers)
    monkeypatch.setattr(parallelize, "fully_shard", lambda module, **kwargs: pytest.fail("sharded before the check"))
    with pytest.raises(KeyError, match="Never"):
        apply_fsdp(model, None, block_types=(TransformerBlock,), reshard_after_forward="Never")


# -- a team's own model: not a transformer, no init_param, built eagerly ------------------------------------
class ResidualMLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Regressor(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3):
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.body = nn.Sequential(*(ResidualMLP(width) for _ in range(depth)))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.body(self.stem(x)))


def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 8, 8, generator=g)  # 3 steps x global batch 8
    return x, x.sum(-1, keepdim=True).sin()


def _train(model, x, y, rank, world):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(x.shape[0]):
        shard = slice(rank * 8 // world, (rank + 1) * 8 // world)
        loss = F.mse_loss(model(x[step, shard]), y[step, shard])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def shard_own_model(world):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fsdp_trainer import distributed
    info = distributed.init()
    torch.manual_seed(0)
    model = Regressor()
    apply_ac(model, (ResidualMLP,), "op")
    apply_fsdp(model, distributed.build_mesh("cpu", 1, world), block_types=(ResidualMLP,),
               param_dtype=torch.float32)
    losses = _train(model, *_data(), info.rank, world)
    mean_loss = torch.stack(losses)
    torch.distributed.all_reduce(mean_loss)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return (mean_loss / world).tolist(), state


@pytest.mark.slow
def test_a_teams_own_model_shards_and_matches_plain_training():
    results = run_ranks(shard_own_model, 2, 2)
    torch.manual_seed(0)
    reference = Regressor()
    ref_losses = [loss.item() for loss in _train(reference, *_data(), 0, 1)]
    losses, state = results[0]
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=1e-5, rtol=0, msg=name)


def record_prefetch(prefetches):
    """For each prefetch setting, which blocks each block asks FSDP2 to all-gather ahead, in forward and in backward
    (as block indices)."""
    from torch.distributed.fsdp import FSDPModule

    from fsdp_trainer import distributed
    distributed.init()
    mesh = distributed.build_mesh("cpu", 1, 1)
    results = []
    for prefetch in prefetches:
        calls = {}

        def recorder(kind):
            def record(self, modules):
                calls.setdefault(kind, {})[id(self)] = [id(m) for m in modules]
            return record

        FSDPModule.set_modules_to_forward_prefetch = recorder("forward")
        FSDPModule.set_modules_to_backward_prefetch = recorder("backward")
        model = build(ARGS, device="meta")
        apply_fsdp(model, mesh, block_types=(TransformerBlock,), prefetch=prefetch)
        index = {id(block): i for i, block in enumerate(model.layers)}
        results.append({kind: {index[k]: [index[m] for m in v] for k, v in by_block.items()}
                        for kind, by_block in calls.items()})
    return results


def gathered_after_forward(cases):
    """For each (reshard_after_forward, keep_gathered, embedding in a group of its own): which blocks, and whether
    the embedding, still hold gathered (plain tensor) parameters between forward and backward."""
    from fsdp_trainer import distributed
    distributed.init()
    mesh = distributed.build_mesh("cpu", 1, 2)
    results = []
    for reshard, keep_gathered, embedding_group in cases:
        model = build(ARGS, device="meta")
        apply_fsdp(model, mesh, block_types=(TransformerBlock,),
                   groups=[[model.tok_embeddings]] if embedding_group else (),
                   param_dtype=torch.float32, reshard_after_forward=reshard, keep_gathered=keep_gathered)
        init_weights(model, torch.device("cpu"))
        model(torch.zeros(1, 8, dtype=torch.long)).sum()
        results.append(([i for i, block in enumerate(model.layers) if is_gathered(block)],
                        is_gathered(model.tok_embeddings)))
    return results


GATHERED = {  # (reshard_after_forward, keep_gathered): the blocks still gathered after forward
    ("default", 0): [3],  # no other groups: the last block runs last in forward and first in backward
    ("default", 2): [2, 3],
    ("default", 3): [1, 2, 3],
    ("never", 0): [0, 1, 2, 3],
    ("always", 0): [],
}


@pytest.fixture(scope="module")
def gathered() -> list[dict]:
    """Per rank, gathered_after_forward's answer for each case of GATHERED and for the embedding in a group of its
    own: all from one launch of 2 ranks, which costs seconds."""
    cases = [(reshard, keep, False) for reshard, keep in GATHERED] + [("default", 0, True)]
    return [dict(zip(cases, answers)) for answers in run_ranks(gathered_after_forward, 2, cases)]


@pytest.mark.slow
@pytest.mark.parametrize("reshard,keep", GATHERED)
def test_blocks_kept_gathered_after_forward(gathered, reshard, keep):
    assert [answers[reshard, keep, False][0] for answers in gathered] == [GATHERED[reshard, keep]] * 2


@pytest.mark.slow
def test_the_module_kept_gathered_is_the_last_to_run_not_the_last_group_listed(gathered):
    # The embedding is a group of its own, registered (and run) before the blocks: the last block stays gathered.
    assert [answers["default", 0, True] for answers in gathered] == [([3], False)] * 2


@pytest.mark.parametrize("unsafe", [{"cpu_offload": True}, {"reduce_dtype": torch.bfloat16}])
def test_gradients_in_the_compute_pool_are_refused_where_the_gradient_is_not_the_reduce_scatter_output(unsafe):
    class OneDimMesh:
        ndim, device_type = 1, "cuda"

    with pytest.raises(ValueError, match="grads_in_compute_pool needs a 1-D mesh, float32 reduction and no CPU"):
        apply_fsdp(build(ARGS, device="meta"), OneDimMesh(), block_types=(TransformerBlock,),
                   grads_in_compute_pool=True, **unsafe)


@pytest.mark.slow
def test_prefetch_two_asks_each_block_for_the_next_two_in_both_directions():
    one, two = run_ranks(record_prefetch, 1, [1, 2])[0]
    assert one == {}  # FSDP2's own schedule
    assert two == {
        "forward": {0: [1, 2], 1: [2, 3], 2: [3], 3: []},
        "backward": {0: [], 1: [0], 2: [1, 0], 3: [2, 1]},
    }


def _backward_ops_of_a_teams_model(mode):
    torch.manual_seed(0)
    model = Regressor()
    apply_ac(model, (ResidualMLP,), mode)
    x, y = _data()
    loss = F.mse_loss(model(x[0]), y[0])
    with OpCounter() as counter:
        loss.backward()
    return counter.counts


def test_per_op_ac_keeps_the_outputs_of_linear_layers_with_a_bias():
    """nn.Linear with a bias runs addmm, not mm: per-op AC saves its output too and recomputes only the cheap ops."""
    base, op, full = (_backward_ops_of_a_teams_model(mode) for mode in ("none", "op", "full"))
    # Full AC runs each of the 3 blocks' up projection again (recomputation stops before down: no backward reads
    # its output).
    assert full["addmm"] - base["addmm"] == 3
    assert op["addmm"] == base["addmm"] and op["gelu"] == 3



def test_the_compute_pool_reduce_scatter_refuses_to_add_into_existing_gradients():
    """Accumulating into a gradient happens on the reduce-scatter stream and would race the compute stream's reuse
    of the memory: refused at the moment FSDP2 asks for the output."""
    from fsdp_trainer.parallelize import ComputePoolReduceScatter

    param = nn.Parameter(torch.zeros(2))
    comm = ComputePoolReduceScatter(None, [param])
    param.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="would add into gradients that already exist"):
        comm.allocate((2,), dtype=torch.float32, device=torch.device("cpu"))


def test_every_group_gathers_in_param_dtype_and_reduces_in_float32(monkeypatch):
    """bfloat16 compute with float32 gradient reduction, for every fully_shard call (FSDP2 would otherwise reduce
    in the compute dtype, a precision loss no loss curve at this size would show)."""
    from fsdp_trainer import parallelize

    policies = []
    monkeypatch.setattr(parallelize, "fully_shard", lambda module, **kwargs: policies.append(kwargs["mp_policy"]))
    model = build(ARGS, device="meta")
    apply_fsdp(model, None, block_types=(TransformerBlock,), groups=[[model.tok_embeddings], [model.norm, model.output]])
    assert len(policies) == ARGS.n_layers + 3
    assert {(p.param_dtype, p.reduce_dtype) for p in policies} == {(torch.bfloat16, torch.float32)}


def test_the_trainer_gathers_and_reduces_every_group_in_the_dtypes_its_flags_name(monkeypatch):
    """--parallel.param_dtype and --parallel.reduce_dtype reach every fully_shard call the trainer makes."""
    from fsdp_trainer import parallelize, train

    policies = []
    monkeypatch.setattr(parallelize, "fully_shard", lambda module, **kwargs: policies.append(kwargs["mp_policy"]))
    monkeypatch.setattr(train, "init_weights", lambda *args, **kwargs: None)  # nothing was sharded to fill
    cfg = parse_args([*TINY_FLAGS, "--parallel.param_dtype", "float16", "--parallel.reduce_dtype", "bfloat16"])
    train.build_model(cfg, None, torch.device("cpu"))
    assert len(policies) == cfg.model.n_layers + 3
    assert {(p.param_dtype, p.reduce_dtype) for p in policies} == {(torch.float16, torch.bfloat16)}


# -- a team's own transformer: torch's MultiheadAttention and LayerNorm, biases, a tied embedding ------------
class Gate(nn.Module):
    """A parameter with no reset_parameters() of its own: the block around it fills it."""

    def __init__(self, width: int):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(width))

    def forward(self, x):
        return x * self.scale


class AttentionBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)  # only the private _reset_parameters()
        self.mlp = nn.Linear(width, width)
        self.gate = Gate(width)
        self.reset_parameters()

    def reset_parameters(self):
        # Runs after the submodules' own resets, in eager construction as in init_weights: it has the last word.
        nn.init.constant_(self.gate.scale, 0.5)
        nn.init.normal_(self.mlp.weight, std=0.02)

    def forward(self, x):
        h = self.norm(x)
        return x + self.gate(self.attn(h, h, h, need_weights=False)[0] + self.mlp(h))


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 16, width: int = 8, depth: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*(AttentionBlock(width) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.tie_weights()

    def tie_weights(self):
        # The head is reset last, so eager construction and init_weights both leave its initialization in the tie.
        self.embed.weight = self.head.weight

    def forward(self, tokens):
        return self.head(self.norm(self.blocks(self.embed(tokens))))


def _lm_losses(model, rank, world, steps=3):
    # A global batch of 12 sequences, split evenly over 1, 2 or 3 ranks: the mean of the ranks' means is its mean.
    tokens = torch.randint(0, 16, (steps, 12, 6), generator=torch.Generator().manual_seed(5))
    # SGD, not Adam: the attention's key bias has a gradient of zero but for rounding, which Adam would blow up to
    # full steps of either sign.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        batch = tokens[step, rank * 12 // world:(rank + 1) * 12 // world]
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def shard_tied_lm(world, groups):
    """Built on meta, sharded with the tied embedding and head in one unit, initialized by init_weights (TiedLM has
    no init_param: its modules' resets run); its initial weights, gathered, then its losses and final weights after
    training from them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fsdp_trainer import distributed
    info = distributed.init()
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    with torch.device("meta"):
        model = TiedLM()
    apply_fsdp(model, distributed.build_mesh("cpu", 1, world), block_types=(AttentionBlock,),
               groups=[[getattr(model, name) for name in group] for group in groups], param_dtype=torch.float32)
    init_weights(model, torch.device("cpu"), seed=0)
    assert model.embed.weight is model.head.weight
    initial = {name: param.full_tensor().clone() for name, param in model.named_parameters()}  # not views
    losses = torch.stack(_lm_losses(model, info.rank, world))
    torch.distributed.all_reduce(losses)
    return initial, (losses / world).tolist(), get_model_state_dict(model, options=full)


def test_init_weights_fills_multihead_attention_and_parameters_their_block_resets():
    """Meta-device init gives eager construction's weights: MultiheadAttention through its _reset_parameters(),
    the gate through its block's reset_parameters(), which runs after the block's submodules' resets."""
    torch.manual_seed(0)
    reference = TiedLM().state_dict()
    with torch.device("meta"):
        model = TiedLM()
    init_weights(model, torch.device("cpu"), seed=0)
    assert model.embed.weight is model.head.weight
    for name, value in model.state_dict().items():
        assert torch.equal(value, reference[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_teams_tied_transformer_shards_and_matches_plain_training(world):
    """Initialized on meta without init_param, on any number of CPU ranks (3 cut every dimension of TiedLM
    unevenly), the weights are eager construction's under the same seed, not a rank's shard repeated: the resets
    run on full replicas, of which each rank keeps its shard."""
    results = run_ranks(shard_tied_lm, world, world, [["embed", "norm", "head"]])
    torch.manual_seed(0)
    reference = TiedLM()
    initial, losses, state = results[0]
    assert initial.keys() == dict(reference.named_parameters()).keys()
    for name, value in reference.named_parameters():
        assert torch.equal(initial[name], value), name
    ref_losses = [loss.item() for loss in _lm_losses(reference, 0, 1)]
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=1e-5, rtol=0, msg=name)


def second_backward_training_one_module(cases):
    """For each (model, module) case: the model sharded in its groups with the compute-pool reduce-scatter and only
    that module trainable, so that the modules sharded with it hold no gradient. A second backward without
    zero_grad, which would add into that module's gradients, must be refused. On CPU the reduce-scatter's streams
    are None (torch.cuda.stream(None) does nothing)."""
    from fsdp_trainer import distributed
    torch.cuda.current_stream = lambda device=None: None
    distributed.init()
    mesh = distributed.build_mesh("cpu", 1, 2)
    for case, trained in cases:
        if case == "llama":  # as training shards it, untied
            model = build(ARGS, device="meta")
            blocks, groups = (TransformerBlock,), [[model.tok_embeddings], [model.norm, model.output]]
        else:  # the head tied to the embedding, both in one group with the final norm
            with torch.device("meta"):
                model = TiedLM()
            blocks, groups = (AttentionBlock,), [[model.embed, model.norm, model.head]]
        apply_fsdp(model, mesh, block_types=blocks, groups=groups, param_dtype=torch.float32,
                   grads_in_compute_pool=True)
        init_weights(model, torch.device("cpu"))
        trainable = {id(param) for param in getattr(model, trained).parameters()}
        for param in model.parameters():
            param.requires_grad_(id(param) in trainable)
        tokens = torch.zeros(2, 8, dtype=torch.long)
        model(tokens).sum().backward()
        with pytest.raises(RuntimeError, match="would add into gradients that already exist"):
            model(tokens).sum().backward()


@pytest.mark.slow
def test_the_compute_pool_guard_covers_every_module_sharded_together():
    """The final norm and the output projection (and a tied embedding) are sharded in one fully_shard call, which
    has one reduce-scatter: its guard must see the gradients of each of them, whichever alone trains."""
    run_ranks(second_backward_training_one_module, 2,
              [("llama", "output"), ("llama", "norm"), ("tied", "head"), ("tied", "norm")])


def test_init_param_leaves_each_buffer_to_its_modules_reset():
    """init_param fills parameters only: a BatchNorm's running statistics, which its reset_parameters() fills (so
    check_initializable passes them), are reset (materialized from meta, they held garbage)."""
    class Normed(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(64, 64)
            self.norm = nn.BatchNorm1d(64)

        def init_param(self, name, tensor, generator):
            tensor.fill_(0.5)

    with torch.device("meta"):
        model = Normed()
    init_weights(model, torch.device("cpu"))
    assert torch.equal(model.norm.running_mean, torch.zeros(64))
    assert torch.equal(model.norm.running_var, torch.ones(64))
    assert model.norm.num_batches_tracked.item() == 0
    assert all(torch.equal(param, torch.full_like(param, 0.5)) for param in model.parameters())  # init_param's


def tied_group_gathered_after_forward():
    """TiedLM sharded with its tied embedding and head in one group (with the final norm): whether each block, and
    the group, still hold gathered parameters between forward and backward."""
    from fsdp_trainer import distributed
    distributed.init()
    with torch.device("meta"):
        model = TiedLM()
    apply_fsdp(model, distributed.build_mesh("cpu", 1, 2), block_types=(AttentionBlock,),
               groups=[[model.embed, model.norm, model.head]], param_dtype=torch.float32)
    init_weights(model, torch.device("cpu"))
    model(torch.zeros(1, 4, dtype=torch.long)).sum()
    return [is_gathered(block) for block in model.blocks], is_gathered(model.head)


@pytest.mark.slow
def test_a_group_that_runs_last_stays_gathered_though_its_first_module_runs_first():
    """The group's head runs after the last block, so the group, not that block, is the unit kept gathered after
    forward, though its embedding is registered (and runs) before the blocks."""
    assert run_ranks(tied_group_gathered_after_forward, 2) == [([False, False], True)] * 2


@pytest.mark.parametrize("world,local,nccl,cumem,dp_replicate,applies", [
    (4, "4", (2, 28, 9), None, 1, True),
    (8, "4", (2, 28, 9), None, 1, False),  # two hosts: no copy engine reaches the other one
    (4, None, (2, 28, 9), None, 1, False),  # no launcher said the ranks share a host
    (4, "4", (2, 27, 7), None, 1, False),  # before NCCL's zero-CTA policy
    (1, "1", (2, 28, 9), None, 1, False),  # nothing to gather
    (4, "4", (2, 28, 9), None, 4, False),  # dp_shard 1: replicas only
    (4, "4", (2, 28, 9), "0", 1, False),  # NCCL_CUMEM_ENABLE=0: no symmetric memory
])
def test_the_copy_engines_all_gather_only_on_one_host_with_nccl_2_28_and_shards_to_gather(
        monkeypatch, world, local, nccl, cumem, dp_replicate, applies):
    from fsdp_trainer import train

    for name, value in (("LOCAL_WORLD_SIZE", local), ("NCCL_CUMEM_ENABLE", cumem)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: nccl)
    cfg = parse_args([*TINY_FLAGS, "--parallel.dp_replicate", str(dp_replicate)])
    assert train.copy_engines_all_gather(cfg, world) is applies
    cfg.parallel.copy_engine_all_gather = False
    assert not train.copy_engines_all_gather(cfg, world)


def test_a_symmetric_memory_failure_names_the_flag_that_avoids_it(monkeypatch):
    """A host where NCCL cannot give symmetric memory (a container without cuMem, say) fails at the first all-gather
    with the way around it, not with NCCL's words alone."""
    from fsdp_trainer import parallelize

    def refuse(*args, **kwargs):
        raise RuntimeError("ncclMemAlloc failed: unhandled cuda error")

    monkeypatch.setattr(parallelize.symm_mem, "get_mem_pool", refuse)
    monkeypatch.setattr(parallelize.symm_mem, "rendezvous", refuse)
    comm = object.__new__(parallelize.SymmetricMemoryAllGather)  # no NCCL group to barrier on here
    calls = (lambda: comm.allocate((4,), dtype=torch.bfloat16, device=torch.device("cpu")),
             lambda: comm(torch.empty(4), torch.empty(2), SimpleNamespace(group_name="0")))
    for call in calls:
        with pytest.raises(RuntimeError, match=r"ncclMemAlloc failed.*--parallel.no_copy_engine_all_gather"):
            call()
    # Out of memory, or a peer gone, is not symmetric memory's fault: raised as it came, for the OOM report or
    # the watchdog.
    for error in (torch.OutOfMemoryError("CUDA out of memory"), torch.distributed.DistError("peer closed")):
        def fail(*args, **kwargs):
            raise error

        monkeypatch.setattr(parallelize.symm_mem, "get_mem_pool", fail)
        monkeypatch.setattr(parallelize.symm_mem, "rendezvous", fail)
        for call in calls:
            with pytest.raises(type(error)) as raised:
                call()
            assert raised.value is error


def all_gathers_counted_through_the_installed_comm(symmetric: bool) -> int:
    """All-gathers of one forward and backward that reach the all-gather apply_fsdp installs for
    symmetric_memory_all_gather (here a gloo stand-in for SymmetricMemoryAllGather that counts them)."""
    import torch.distributed as dist

    from fsdp_trainer import distributed, parallelize

    calls = []

    class Counting(parallelize.AllGather):
        def __init__(self, group):
            pass

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            calls.append(output_tensor.numel())
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    parallelize.SymmetricMemoryAllGather = Counting
    distributed.init()
    model = build(ARGS, device="meta")
    apply_fsdp(model, distributed.build_mesh("cpu", 1, 2), block_types=(TransformerBlock,),
               groups=[[model.tok_embeddings], [model.norm, model.output]], param_dtype=torch.float32,
               symmetric_memory_all_gather=symmetric)
    init_weights(model, torch.device("cpu"))
    calls.clear()
    model(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
    return len(calls)


@pytest.mark.slow
def test_every_unit_all_gathers_through_the_symmetric_memory_all_gather_forward_and_backward():
    """Each block, the embedding and the output head all-gather through it in forward, and every unit resharded
    after forward (all but the output head) again in backward; without the flag, nothing does."""
    n = ARGS.n_layers
    assert run_ranks(all_gathers_counted_through_the_installed_comm, 2, True) == [(n + 2) + (n + 1)] * 2
    assert run_ranks(all_gathers_counted_through_the_installed_comm, 2, False) == [0, 0]
