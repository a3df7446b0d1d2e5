"""Held-out evaluation: disjoint held-out data on every source, one exact number on any number of ranks, the same
after a resume and from the checkpoint command, no recompilation, and the planner's eval moment."""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fsdp_trainer import data, distributed, evaluate, train
from fsdp_trainer.config import ConfigError, DataConfig, validate
from fsdp_trainer.data import BYTE_EOS, STDLIB_HELD_OUT, UNFINISHED, SyntheticTokens, build_dataset, load_shards, stdlib_shards
from fsdp_trainer.models.llama import build, model_args_from_config
from fsdp_trainer.parallelize import init_weights
from fsdp_trainer.tools.plan import plan
from fsdp_trainer.tools.prepare import prepare

from helpers import REPO, checkout_env, run_ranks, tiny_config


def documents(folder: Path) -> list[bytes]:
    """The documents of a folder of byte shards, split at the end-of-document token."""
    stream = load_shards(str(folder))
    tokens = stream.read(0, len(stream))
    docs = np.split(tokens, np.flatnonzero(tokens == BYTE_EOS))
    return [bytes(doc[doc != BYTE_EOS].astype(np.uint8)) for doc in docs]


# ------------------------------------------------------------------------------------------ held-out data

def test_stdlib_holds_out_a_fixed_set_of_its_files(tmp_path):
    lib = tmp_path / "lib"
    files = {f"pkg/mod{i}.py": f"x = {i}\n".encode() for i in range(300)}
    for name, content in files.items():
        (lib / name).parent.mkdir(parents=True, exist_ok=True)
        (lib / name).write_bytes(content)
    out = stdlib_shards(str(tmp_path / "cache"), root=str(lib))
    held = {content for name, content in files.items() if zlib.crc32(name.encode()) % STDLIB_HELD_OUT == 0}
    train_docs, val_docs = documents(out), documents(out / "val")
    assert set(val_docs) == held and 0 < len(held) < 20
    assert not set(train_docs) & set(val_docs) and len(train_docs) + len(val_docs) == len(files)
    cfg = DataConfig(source="stdlib", cache_dir=str(tmp_path / "cache"))
    assert "/val" in repr(build_dataset(cfg, 4, 257, held_out=True)) and "/val" not in repr(build_dataset(cfg, 4, 257))


def test_prepare_holds_out_documents_by_their_text(tmp_path):
    texts = [f"document {i} " * (i % 7 + 1) for i in range(400)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in reversed(texts)))
    prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "one"), holdout=0.1, log=lambda line: None)
    prepare([str(tmp_path / "b.jsonl")], str(tmp_path / "two"), holdout=0.1, shard_tokens=500, log=lambda line: None)
    train_docs, val_docs = set(documents(tmp_path / "one")), set(documents(tmp_path / "one" / "val"))
    assert not train_docs & val_docs and train_docs | val_docs == {t.encode() for t in texts}
    assert 20 < len(val_docs) < 60
    # Another order of the documents and another sharding hold out the same ones.
    assert set(documents(tmp_path / "two" / "val")) == val_docs
    cfg = DataConfig(source="tokens", path=str(tmp_path / "one"))
    assert build_dataset(cfg, 8, 257, held_out=True).stream.shards[0].path.parent == tmp_path / "one" / "val"
    prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "none"), log=lambda line: None)
    with pytest.raises(ConfigError, match="no val/ folder.*--holdout"):
        build_dataset(DataConfig(source="tokens", path=str(tmp_path / "none")), 8, 257, held_out=True)


def test_the_held_out_folder_is_marked_unfinished_while_prepare_writes_it(tmp_path, monkeypatch):
    """val/ is read on its own (data.eval_path): a prepare killed midway must leave it refused there too."""
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(200)))
    marked, real_write_atomic = [], data.write_atomic

    def record(path, write):
        marked.append((path.parent.name, (path.parent / UNFINISHED).exists()))
        real_write_atomic(path, write)

    monkeypatch.setattr(data, "write_atomic", record)
    prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "out"), holdout=0.2, shard_tokens=64, log=lambda line: None)
    assert {folder for folder, _ in marked} == {"out", "val"} and all(m for _, m in marked)
    assert not (tmp_path / "out" / "val" / UNFINISHED).exists() and load_shards(str(tmp_path / "out" / "val"))


def test_synthetic_held_out_samples_are_not_training_samples():
    seen = {tuple(SyntheticTokens(16, 320, seed=0)[g][0].tolist()) for g in range(500)}
    held_out = [tuple(SyntheticTokens(16, 320, seed=0, held_out=True)[g][0].tolist()) for g in range(500)]
    assert not seen & set(held_out) and len(set(held_out)) == 500


@pytest.mark.parametrize("settings,message", [
    ({"eval": {"samples": 0}, "data": {"source": "synthetic"}}, "has no end"),
    ({"data": {"eval_path": "/x"}}, "data.eval_path=/x is set, but data.source=stdlib does not read it"),
    ({"eval": {"every": -1}}, "eval.every=-1"),
])
def test_eval_settings_that_cannot_work_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(**settings), 1, "cpu")


def test_which_steps_evaluate_and_how_many_samples():
    cfg = tiny_config(train={"steps": 120}, eval={"every": 50, "at_end": False})
    assert [s for s in range(1, 121) if evaluate.is_due(cfg, s)] == [50, 100] and evaluate.evaluates(cfg)
    cfg.eval.at_end = True
    assert [s for s in range(1, 121) if evaluate.is_due(cfg, s)] == [50, 100, 120]
    cfg.eval.every = 200
    assert [s for s in range(1, 121) if evaluate.is_due(cfg, s)] == [120] and evaluate.evaluates(cfg)
    cfg.eval.at_end = False
    assert not evaluate.evaluates(cfg)
    cfg.eval.every, cfg.eval.at_end = 0, True  # 0 is never, the last step too
    assert not evaluate.evaluates(cfg) and not any(evaluate.is_due(cfg, s) for s in range(1, 121))
    split = SyntheticTokens(4, 320, 0, held_out=True)
    split.num_samples = 100  # as a folder's split has
    samples = [evaluate.num_samples(tiny_config(eval={"samples": n}), split) for n in (0, 10, 100, 1000)]
    assert samples == [100, 10, 100, 100]  # 0, or more than the split holds: all of it


# ------------------------------------------------------------------------------------------------ the number

SAMPLES = 13  # divides neither 2 x 2 nor 4 x 2 slots of a pass


def reference_loss(cfg) -> float:
    """The mean loss per token of the held-out samples 0..SAMPLES-1, unsharded, in one process."""
    model = build(model_args_from_config(cfg.model), device="cpu")
    init_weights(model, "cpu", seed=cfg.train.seed)
    held_out = SyntheticTokens(cfg.train.seq_len, cfg.model.vocab_size, cfg.data.seed, held_out=True)
    inputs, labels = map(torch.stack, zip(*(held_out[g] for g in range(SAMPLES))))
    with torch.no_grad():
        return F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).item()


def evaluate_on_ranks(cfg) -> tuple[dict, bool]:
    """Worker: the trainer's model, evaluated; with whether it is back in training mode."""
    info = distributed.init()
    mesh = distributed.build_mesh("cpu", 1, info.world_size)
    model, _ = train.build_model(cfg, mesh, info.device)
    held_out = SyntheticTokens(cfg.train.seq_len, cfg.model.vocab_size, cfg.data.seed, held_out=True)
    return evaluate.evaluate(model, held_out, cfg, info.device), model.training


@pytest.mark.slow
def test_one_two_and_four_ranks_give_the_unsharded_loss():
    cfg = tiny_config(data={"source": "synthetic"}, eval={"samples": SAMPLES, "micro_batch_size": 2})
    want = reference_loss(cfg)
    for world_size in (1, 2, 4):
        results = run_ranks(evaluate_on_ranks, world_size, cfg)
        for result, training in results:
            assert result["val/loss"] == pytest.approx(want, rel=1e-6, abs=0), world_size
            assert result["val/tokens"] == SAMPLES * cfg.train.seq_len and training


def train_uninterrupted_then_resumed(cfg, out: Path) -> tuple[list, list]:
    """Worker: 6 steps evaluated every 2 with checkpoints at 3 and 6; then a run resumed from step 3 elsewhere."""
    info = distributed.init()
    whole = train.run(cfg, info)["evals"]
    resumed = copy.deepcopy(cfg)
    resumed.train.output_dir = str(out / "resumed")
    resumed.checkpoint.resume = str(out / "whole/checkpoints/step_00000003")
    return whole, train.run(resumed, info)["evals"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, list, list]:
    out = tmp_path_factory.mktemp("eval")
    cfg = tiny_config(data={"source": "synthetic"}, train={"steps": 6, "output_dir": str(out / "whole")},
                      eval={"every": 2, "samples": SAMPLES, "micro_batch_size": 3}, checkpoint={"interval": 3},
                      metrics={"tensorboard": True})
    [(whole, resumed), _] = run_ranks(train_uninterrupted_then_resumed, 2, cfg, out)
    return out, whole, resumed


@pytest.mark.slow
def test_a_resumed_run_evaluates_as_the_uninterrupted_one(trained):
    out, whole, resumed = trained
    assert [row["step"] for row in whole] == [2, 4, 6] and [row["step"] for row in resumed] == [4, 6]
    assert [row["val/loss"] for row in resumed] == [row["val/loss"] for row in whole[1:]]
    assert whole[-1]["val/loss"] < whole[0]["val/loss"]  # trained, on tokens it never saw
    # Reported: metrics.jsonl rows of their own, and TensorBoard scalars by their own names.
    rows = [json.loads(line) for line in (out / "whole/metrics.jsonl").read_text().splitlines()]
    assert [row for row in rows if "val/loss" in row] == whole
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out / "whole/tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("val/loss")] == [
        (row["step"], pytest.approx(row["val/loss"])) for row in whole]


@pytest.mark.slow
def test_the_checkpoint_command_gives_the_value_training_logged(trained):
    """README's command: the run's newest checkpoint, saved on 2 ranks, evaluated on 1 and sharded otherwise."""
    out, whole, _ = trained
    proc = subprocess.run([sys.executable, "-m", "fsdp_trainer.tools.evaluate", "--config",
                           str(out / "whole/config.toml")],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=checkout_env())
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)
    assert row["step"] == 6 and row["val/tokens"] == whole[-1]["val/tokens"]
    assert row["val/loss"] == pytest.approx(whole[-1]["val/loss"], rel=1e-6, abs=0)
    assert f"val/loss {row['val/loss']:.4f}" in proc.stderr


# --------------------------------------------------------------------------------------------- compilation

def count_compilations_around_evaluations(cfg) -> list[int]:
    """Worker: the blocks compiled with a backend that counts its compilations; the count after a training step,
    an evaluation, a step, and two more evaluations."""
    compiled = []

    def counting_backend(graph, example_inputs):
        compiled.append(graph)
        return graph.forward

    torch.compile = functools.partial(torch.compile, backend=counting_backend)
    info = distributed.init()
    model, _ = train.build_model(cfg, distributed.build_mesh("cpu", 1, info.world_size), info.device)
    held_out = SyntheticTokens(cfg.train.seq_len, cfg.model.vocab_size, cfg.data.seed, held_out=True)
    inputs, labels = (torch.stack([t] * cfg.train.micro_batch_size) for t in held_out[0])
    counts = []
    for action in ("train", "eval", "train", "eval", "eval"):
        if action == "train":
            F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).backward()
        else:
            evaluate.evaluate(model, held_out, cfg, info.device)
        counts.append(len(compiled))
    return counts


@pytest.mark.slow
def test_evaluations_reuse_the_compiled_blocks():
    cfg = tiny_config(data={"source": "synthetic"}, parallel={"compile": True},
                      eval={"samples": 6, "micro_batch_size": 3})  # another batch shape, and no gradients
    [counts, _] = run_ranks(count_compilations_around_evaluations, 2, cfg)
    assert counts[0] >= 1 and counts[1] <= counts[0] + 1  # the first evaluation may compile once
    assert counts[1:] == [counts[1]] * 4, counts  # then nothing compiles again, in training or evaluation


# ------------------------------------------------------------------------------------------------- planner

def test_the_plan_holds_the_evaluation_forward():
    cfg = tiny_config()
    cfg.model.name, cfg.model.n_layers, cfg.model.vocab_size, cfg.model.dim = "8b", 8, None, None
    cfg.model.n_heads, cfg.model.n_kv_heads, cfg.train.seq_len, cfg.train.micro_batch_size = None, None, 8192, 1
    cfg.parallel.param_dtype, cfg.train.steps, cfg.eval.every = "bfloat16", 100, 50
    off = copy.deepcopy(cfg)
    off.eval.every = 0
    base = plan(off, 1, 80 * 2**30)
    on = plan(cfg, 1, 80 * 2**30)
    assert "eval forward" not in base.moments and on.predicted_peak_bytes == base.predicted_peak_bytes
    # An eval micro-batch of 16 holds 16 sequences' logits: then evaluation is the peak, and the plan says so.
    cfg.eval.micro_batch_size = 16
    big = plan(cfg, 1, 80 * 2**30)
    assert big.peak_moment == "eval forward" and big.predicted_peak_bytes > base.predicted_peak_bytes
    logits = 16 * 8192 * 128256 * 2
    assert big.moments["eval forward"] - on.moments["eval forward"] >= 15 / 16 * logits
