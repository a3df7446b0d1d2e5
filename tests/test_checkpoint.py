"""Checkpoints: exact resume, resharding resume, crashes during saves, preemption, retention, async vs sync,
export / import, errors. CPU and gloo; multi-rank runs are real torchrun jobs of a tiny model (about 10 s each)."""

import copy
import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import types
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fsdp_trainer import checkpoint as ck
from fsdp_trainer import distributed
from fsdp_trainer.tools import checkpoints as ckpt_cli
from fsdp_trainer.tools import checksums as cs
from fsdp_trainer.tools import weights
from fsdp_trainer.config import parse_args
from fsdp_trainer.models.llama import build, model_args_from_config
from fsdp_trainer.optim import build_optimizer, build_scheduler
from fsdp_trainer.tools import convert
from fsdp_trainer.train import build_model, main, run

from helpers import TINY_FLAGS, checkout_env, launch_fault, run_ranks, tiny_config, train_ranks
from test_own_model import GPT2, GPT2Block

REPO = Path(__file__).resolve().parents[1]
TINY = [*TINY_FLAGS, "--data.source", "synthetic"]
# Within the default 20 warmup steps the learning rate rises every step and does not depend on train.steps, so a
# scheduler resumed at the wrong step shows in the losses, and runs of different lengths stay comparable.
STEPS = 10


def train_job(nproc: int, out: Path, *flags: str, ok: bool = True) -> str:
    """Run a training job on `nproc` ranks to its end, expecting exit code 0 if ok else a failure; returns its
    output."""
    proc = train_ranks(nproc, *TINY, "--train.output_dir", str(out), *flags)
    assert (proc.returncode == 0) == ok, f"exit code {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc.stderr


def killed(fault: str, rank: str, step: str, out: Path, *flags: str) -> str:
    """A training job that tests/fault_worker.py SIGKILLs during a save (`fault`: kill_saving or kill_commit)."""
    proc, _ = launch_fault(fault, rank, step, *TINY, "--train.output_dir", str(out), *flags)
    assert proc.returncode != 0, proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def rows(out: Path) -> dict[int, dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    result = {row["step"]: row for row in map(json.loads, lines)}
    assert len(result) == len(lines), "a step was logged twice"
    return result


def assert_rows_equal(got: dict[int, dict], want: dict[int, dict], steps, rel: float = 0.0) -> None:
    """Loss, grad norm and lr per step (bit-for-bit when rel=0), and the same data position after every step."""
    assert sorted(got) == list(steps)
    for step in steps:
        assert got[step]["consumed_samples"] == want[step]["consumed_samples"], step
        for key in ("loss", "grad_norm", "lr"):
            if rel == 0:
                assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])
            else:
                assert got[step][key] == pytest.approx(want[step][key], rel=rel), (step, key)


def complete_steps(root: Path) -> list[int]:
    return [step for step, path in ck.list_checkpoints(root) if ck.read_marker(path)[0]]


def all_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, full size, read in this process."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def drop_checksums(step: Path) -> None:
    """Make `step` a checkpoint saved with checkpoint.checksums off: DCP's own checks are all there is."""
    state = ck.read_marker(step)[0]
    del state[cs.CHECKSUMS], state[cs.MARKER_SUM]
    (step / ck.MARKER).write_text(json.dumps(state))


def summed_files(step: Path) -> set[str]:
    """The files of a checkpoint that its checksums cover: all but the marker that holds them and config.toml."""
    return {p.name for p in step.iterdir()} - {ck.MARKER, ck.CONFIG}


def flip_a_bit(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 1
    file.write_bytes(data)


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root with its size and modification time: to prove nothing was touched."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@contextmanager
def one_rank():
    """A one-rank gloo process group in this process, as a run without a launcher starts it; torn down afterwards."""
    info = distributed.init(60)
    try:
        yield info
    finally:
        distributed.shutdown()


def train_in_process(*argv: str) -> dict:
    """The trainer on one rank in this process (what main() does), returning run()'s result."""
    cfg = parse_args([*TINY, *argv])
    with one_rank() as info:
        return run(cfg, info)


def full_state(model) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v.detach().clone()
            for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------ multi-rank end to end

@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """Uninterrupted: 2 ranks, STEPS steps, async checkpoints at steps 4 and 8 and at the end."""
    out = tmp_path_factory.mktemp("reference")
    train_job(2, out, "--train.steps", str(STEPS), "--checkpoint.interval", "4")
    assert complete_steps(out / "checkpoints") == [4, 8, 10]
    return out


@pytest.mark.slow
def test_kill_during_saves_then_resume_is_bit_identical(reference, tmp_path):
    """SIGKILL while an async save is in flight (after a random delay), then while rank 0 is about to commit; each
    time resume auto takes the newest complete checkpoint and names the partial ones, the partial folder in the
    way of a new save is cleared first, and the run ends bit-identical to the uninterrupted one, with retention
    leaving the newest 3."""
    out, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    flags = ("--train.steps", str(STEPS), "--checkpoint.interval", "1")
    delay = random.uniform(0, 0.02)
    killed("kill_saving", "all", f"3+{delay:.3f}", out, *flags)
    assert complete_steps(root)[:2] == [1, 2], delay
    newest = complete_steps(root)[-1]
    partial = [p for step, p in ck.list_checkpoints(root) if step > newest]

    log = killed("kill_commit", "0", "9", out, *flags)
    assert f"resuming from {ck.step_dir(root, newest)}" in log
    assert all(f"skipping {p}" in log for p in partial), (partial, log[-3000:])
    step9 = ck.step_dir(root, 9)
    assert (step9 / ".metadata").is_file() and "interrupted before rank 0 committed" in ck.incomplete_reason(step9)
    assert complete_steps(root) == [6, 7, 8]
    (step9 / "__7_0.distcp").write_text("left over from a save on more ranks")

    log = train_job(2, out, *flags)
    assert f"resuming from {ck.step_dir(root, 8)}" in log and f"skipping {step9}" in log
    assert f"clearing {step9}" in log and not (step9 / "__7_0.distcp").exists()
    assert_rows_equal(rows(out), rows(reference), range(1, STEPS + 1))
    assert [step for step, _ in ck.list_checkpoints(root)] == complete_steps(root) == [8, 9, 10]
    assert not list(root.rglob(".*.tmp"))


@pytest.mark.slow
def test_stop_signal_to_one_rank_saves_and_exits_0(reference, tmp_path):
    """SIGTERM to rank 1 only, as its step 3 begins: both ranks stop at the same step, save it, exit 0; time-based
    saves (interval_minutes, decided by rank 0) happened meanwhile; the resumed run ends bit-identical."""
    out, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    proc, _ = launch_fault("term", "1", 3, *TINY, "--train.output_dir", str(out), "--train.steps", "1000",
                           "--checkpoint.interval", "0", "--checkpoint.interval_minutes", "1e-9")
    output = proc.stderr
    assert proc.returncode == 0, output[-4000:]
    # The stop vote cast after step 3 is read after step 4, and acted on there by both ranks.
    assert max(rows(out)) == 4
    assert "stopped at step 4 on a stop signal" in output and "SIGTERM: finishing the step" in output
    assert complete_steps(root) == [2, 3, 4]  # saved by time from step 2 on; checkpoint.keep=3

    train_job(2, out, "--train.steps", str(STEPS), "--checkpoint.interval", "0")
    assert_rows_equal(rows(out), rows(reference), range(1, STEPS + 1))


@pytest.mark.slow
def test_resume_on_other_world_sizes_and_meshes(reference, tmp_path):
    """2 ranks -> 4 ranks HSDP (2x2) -> 2 ranks with gradient accumulation, the global batch kept at 4: the
    losses follow the uninterrupted run up to reduction order and every step reads the same samples."""
    hsdp = tmp_path / "hsdp"
    log = train_job(4, hsdp, "--train.steps", str(STEPS), "--train.micro_batch_size", "1", "--parallel.dp_replicate",
                   "2", "--checkpoint.interval", "3",
                   "--checkpoint.resume", str(reference / "checkpoints/step_00000004"))
    assert "saved on 2 ranks, resuming on 4" in log
    assert_rows_equal(rows(hsdp), rows(reference), range(5, STEPS + 1), rel=1e-5)
    assert ck.read_marker(hsdp / "checkpoints/step_00000006")[0]["mesh"] == {"dp_replicate": 2, "dp_shard": 2}

    back = tmp_path / "back"
    log = train_job(2, back, "--train.steps", str(STEPS), "--train.micro_batch_size", "1",
                   "--train.grad_accum_steps", "2", "--checkpoint.resume", str(hsdp / "checkpoints/step_00000006"))
    assert "saved on 4 ranks, resuming on 2" in log
    assert_rows_equal(rows(back), rows(reference), range(7, STEPS + 1), rel=1e-5)


@pytest.mark.slow
def test_saved_on_8_ranks_resumes_on_4(tmp_path):
    """The 8-GPU node's checkpoint continued on half the GPUs: 8 x 1 sample per step, then 4 x 2."""
    eight = tmp_path / "eight"
    train_job(8, eight, "--train.steps", "4", "--train.micro_batch_size", "1", "--checkpoint.interval", "2")
    four = tmp_path / "four"
    log = train_job(4, four, "--train.steps", "4", "--checkpoint.resume", str(eight / "checkpoints/step_00000002"))
    assert "saved on 8 ranks, resuming on 4" in log
    assert_rows_equal(rows(four), rows(eight), range(3, 5), rel=1e-5)


class DropoutGPT2(GPT2):
    """The test GPT2 with dropout on its embedding's features, its rate drawn from Python's RNG and its mask from
    torch's: one mask per forward, whatever the batch, so that what a rank draws does not depend on how many
    samples it holds."""

    def __init__(self):
        super().__init__()
        self.masks: list[torch.Tensor] = []  # each forward's, to compare with another run's
        self.wte.register_forward_hook(self._dropout)

    def _dropout(self, module, inputs, embedded: torch.Tensor) -> torch.Tensor:
        mask = F.dropout(embedded.new_ones(embedded.shape[-1]), p=random.uniform(0.2, 0.8))
        self.masks.append(mask)
        return embedded * mask


def dropout_gpt2_fn(cfg):
    model = DropoutGPT2()
    # From here on each rank draws its own masks, as dropout under data parallelism does: a rank that resumed another
    # rank's saved streams would draw that rank's.
    torch.manual_seed(cfg.train.seed + 1 + dist.get_rank())
    random.seed(cfg.train.seed + 1 + dist.get_rank())
    return model, (GPT2Block,), []


def train_dropout_gpt2(cfg) -> tuple[list[float], list[torch.Tensor]]:
    """Worker: the trainer on DropoutGPT2; the losses logged, and this rank's dropout masks in order."""
    result = run(cfg, distributed.init(60), model_fn=dropout_gpt2_fn)
    return [row["loss"] for row in result["history"]], result["model"].masks


@pytest.mark.slow
def test_each_resumed_rank_continues_its_own_random_streams(tmp_path):
    """A model drawing from torch's and Python's RNGs (dropout) resumed on the same world size: each rank continues
    its own saved streams, and the losses are the uninterrupted run's, bit for bit. Resumed on one rank, that rank
    continues saved rank 0's streams: its masks are rank 0's (its losses cannot be: it holds rank 1's samples too,
    which rank 1 dropped out otherwise)."""
    first = tiny_config(data={"source": "synthetic"}, train={"output_dir": str(tmp_path / "first"), "steps": 4},
                        checkpoint={"interval": 2, "async_mode": "none"})
    uninterrupted = run_ranks(train_dropout_gpt2, 2, first)
    losses, masks = uninterrupted[0][0], [torch.stack(drawn) for _, drawn in uninterrupted]
    assert len(losses) == len(masks[0]) == 4 and not masks[0][2:].equal(masks[1][2:])  # the ranks draw apart

    same = copy.deepcopy(first)
    same.train.output_dir = str(tmp_path / "same")
    same.checkpoint.resume = str(ck.step_dir(tmp_path / "first" / "checkpoints", 2))
    resumed = run_ranks(train_dropout_gpt2, 2, same)
    assert resumed[0][0] == losses[2:]
    assert all(torch.stack(drawn).equal(masks[rank][2:]) for rank, (_, drawn) in enumerate(resumed))

    fewer = copy.deepcopy(same)
    fewer.train.output_dir, fewer.train.micro_batch_size = str(tmp_path / "fewer"), 8  # the same global batch
    [(_, drawn)] = run_ranks(train_dropout_gpt2, 1, fewer)
    assert torch.stack(drawn).equal(masks[0][2:])


# ------------------------------------------------------------------------------------------- one rank, in process

@pytest.fixture(scope="session")
def small(tmp_path_factory) -> Path:
    """A finished one-rank run with sync checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("small")
    train_in_process("--train.steps", "4", "--checkpoint.interval", "2", "--checkpoint.async_mode", "none",
                     "--train.output_dir", str(out))
    assert complete_steps(out / "checkpoints") == [2, 4]
    return out


@pytest.mark.slow
def test_a_checkpoint_counts_the_tokens_of_the_samples_it_consumed(small):
    """tokens_seen, which a resume reports, is the samples consumed x train.seq_len: 2 samples of 32 tokens a step."""
    for step in (2, 4):
        state = ck.read_marker(ck.step_dir(small / "checkpoints", step))[0]
        assert (state["consumed_samples"], state["tokens_seen"]) == (2 * step, 2 * step * 32), step


def test_a_resume_restores_the_loss_scaler(tmp_path):
    """float16's GradScaler comes back with the scale it had and its count of steps since the last overflow (which
    decides when the scale next grows), not at a fresh scaler's 2**16 and 0."""
    cfg = parse_args([*TINY, "--train.output_dir", str(tmp_path), "--checkpoint.async_mode", "none"])
    saved, restored = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    saved.load_state_dict({**saved.state_dict(), "scale": 1024.0, "_growth_tracker": 7})
    with one_rank() as info:
        def checkpointer(scaler) -> ck.Checkpointer:
            model, _ = build_model(cfg, distributed.build_mesh("cpu", 1, 1), info.device)
            optimizer = build_optimizer(model, cfg.optim)
            scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
            return ck.Checkpointer(cfg, info, model, optimizer, scheduler, scaler)

        saving = checkpointer(saved)
        saving.restore()
        saving.finish(ck.Progress(step=2, consumed_samples=4, tokens_seen=128))
        assert checkpointer(restored).restore().step == 2
    assert (restored.get_scale(), restored._get_growth_tracker()) == (1024.0, 7)


def same_state(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal; for floating-point tensors, within 1e-6 of the largest magnitude: two runs in this one long-lived
    process have been seen, once, to round a few float32 values apart (CPU kernels are not bit-reproducible across
    a process's history), while the state one step later lies over 1e-4 away (1.1e-4 for the least-moved tensor,
    the token embedding, from step 2 to 3), so a save that caught a step too late still fails."""
    if not want.is_floating_point() or not want.numel():
        return torch.equal(got, want)
    return got.shape == want.shape and bool((got - want).abs().max() <= 1e-6 * want.abs().max())


@pytest.mark.slow
def test_async_and_sync_saves_hold_the_same_tensors(small, tmp_path):
    """none, async and async_pinned: the same model, optimizer and RNG tensors in every checkpoint, also in one
    saved while training went on, and the same export (to float32 rounding: see same_state)."""
    for mode in ("async", "async_pinned"):
        out = tmp_path / mode
        train_in_process("--train.steps", "4", "--checkpoint.interval", "2", "--checkpoint.async_mode", mode,
                         "--train.output_dir", str(out))
        for step in (2, 4):
            path = ck.step_dir(out / "checkpoints", step)
            assert set(ck.read_marker(path)[0][cs.CHECKSUMS]) == summed_files(path)
            with cs.checked(ck.check_usable(path), None, "", threads=1) as report:
                pass
            assert report and "match their checksums" in report[0]
            want = all_tensors(ck.step_dir(small / "checkpoints", step))
            got = all_tensors(path)
            assert sorted(got) == sorted(want) and any(k.startswith("optim.state.") for k in got)
            # Python's RNG is this test process's, run after run.
            for key in want.keys() - {"rng.rank0.python", "rng.rank0.python_gauss"}:
                assert same_state(got[key], want[key]), (mode, step, key, (got[key] - want[key]).abs().max())
        convert.main(["to-hf", str(out / "checkpoints"), str(tmp_path / f"export_{mode}")])
    convert.main(["to-hf", str(small / "checkpoints"), str(tmp_path / "export_none")])
    load_file = pytest.importorskip("safetensors.torch").load_file
    want = load_file(tmp_path / "export_none/model.safetensors")
    for mode in ("async", "async_pinned"):
        got = load_file(tmp_path / f"export_{mode}/model.safetensors")
        assert got.keys() == want.keys() and all(same_state(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_a_failing_step_still_commits_the_save_in_flight(tmp_path, monkeypatch):
    """An error in training while an async save is in flight: the save completes and counts."""
    import fsdp_trainer.train as train
    real_step, calls = train.train_step, []

    def failing_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train, "train_step", failing_step)
    with pytest.raises(RuntimeError, match="injected"):
        train_in_process("--train.steps", "4", "--checkpoint.interval", "2", "--train.output_dir", str(tmp_path))
    assert complete_steps(tmp_path / "checkpoints") == [2]


@pytest.mark.slow
def test_async_pinned_allocates_its_staging_buffers_after_the_first_step(tmp_path, capfd):
    """The host copy of the state is allocated once, at step 1, not inside the first save (saved at step 3)."""
    train_in_process("--train.steps", "3", "--checkpoint.interval", "3", "--checkpoint.async_mode", "async_pinned",
                     "--train.output_dir", str(tmp_path))
    lines = capfd.readouterr().err.splitlines()
    staging = [i for i, line in enumerate(lines) if "checkpoint staging:" in line]
    step_1, step_2 = (next(i for i, line in enumerate(lines) if f"step {n}/3" in line) for n in (1, 2))
    assert len(staging) == 1 and step_1 < staging[0] < step_2
    assert complete_steps(tmp_path / "checkpoints") == [3]


@pytest.mark.slow
def test_saving_before_the_first_applied_step_leaves_the_optimizer_as_it_was(tmp_path, monkeypatch):
    """Step 1 is skipped as non-finite, so AdamW has no state when async_pinned sizes its buffers after it, or when
    step 1 is saved. torch's get_state_dict creates the state by an AdamW step at lr 0, which counts a step: the
    count must stay 0, in the optimizer and in the checkpoint, so that the weights do not depend on the
    checkpoint mode."""
    import fsdp_trainer.train as train
    real_loss, calls = train.cross_entropy, []

    def nan_at_step_1(*args):
        calls.append(1)
        return real_loss(*args) * (float("nan") if len(calls) == 1 else 1.0)

    monkeypatch.setattr(train, "cross_entropy", nan_at_step_1)
    runs = {}
    for mode, interval in (("none", 0), ("none", 1), ("async_pinned", 3)):
        calls.clear()
        out = tmp_path / f"{mode}_{interval}"
        result = train_in_process("--train.steps", "3", "--train.on_nonfinite", "skip", "--checkpoint.async_mode",
                                  mode, "--checkpoint.interval", str(interval), "--train.output_dir", str(out))
        assert {state["step"].item() for state in result["optimizer"].state.values()} == {2.0}, mode
        runs[mode, interval] = full_state(result["model"])
    saved = all_tensors(ck.step_dir(tmp_path / "none_1/checkpoints", 1))
    assert {t.item() for k, t in saved.items() if k.endswith(".step")} == {0.0}
    want = runs["none", 0]
    for key, got in runs.items():
        assert all(torch.equal(got[k], want[k]) for k in want), key


@pytest.mark.slow
def test_async_pinned_copies_every_save_into_the_same_host_memory(tmp_path, monkeypatch):
    """async_pinned keeps one stager for the run, so that every save reuses the host copy the first one allocated
    (a stager per save, or DCP's own, would allocate, and pin, the whole state again each time)."""
    staged, stage = [], ck.DefaultStager.stage

    def recorded(stager, state):
        copy = stage(stager, state)
        staged.append(copy["model"]["tok_embeddings.weight"].to_local().data_ptr())
        return copy

    monkeypatch.setattr(ck.DefaultStager, "stage", recorded)
    train_in_process("--train.steps", "3", "--checkpoint.interval", "1", "--checkpoint.async_mode", "async_pinned",
                     "--train.output_dir", str(tmp_path))
    assert len(staged) == 4 and len(set(staged)) == 1, staged  # allocated after step 1, then a save per step


def test_a_stager_that_torch_closes_after_each_copy_is_replaced(tmp_path, monkeypatch):
    """torch 2.11's DefaultStager closes its copier after every stage, and a closed one fails the next with KeyError
    <class 'type'> (pytorch#183413): with that behaviour, every save of an async_pinned run still completes."""
    stage = ck.DefaultStager.stage

    def stage_then_close(stager, state):
        copy = stage(stager, state)
        stager._state_dict_stager.close()
        return copy

    monkeypatch.setattr(ck.DefaultStager, "stage", stage_then_close)
    train_in_process("--train.steps", "3", "--checkpoint.interval", "1", "--checkpoint.async_mode", "async_pinned",
                     "--train.output_dir", str(tmp_path))
    assert complete_steps(tmp_path / "checkpoints") == [1, 2, 3]


def test_rng_state_round_trips_python_s_cached_gaussian():
    random.seed(0)
    random.random(), random.gauss(0, 1)  # gauss caches a second value: the state's optional part is set now
    want = random.getstate()
    state = {name: tensor.clone() for name, tensor in ck.rng_state(torch.device("cpu")).items()}
    random.seed(1)
    ck.set_rng_state(state, torch.device("cpu"))
    assert random.getstate() == want


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_export_and_import_round_trip(tmp_path, tied):
    """The export holds exactly the trained weights; init_from <checkpoint> and init_from hf:<export> give them back;
    transformers' LlamaForCausalLM computes our logits from the export."""
    flags = ["--train.steps", "3", "--checkpoint.async_mode", "none", "--train.output_dir", str(tmp_path / "run"),
             "--model.tie_embeddings", str(tied)]
    trained = full_state(train_in_process(*flags)["model"])
    convert.main(["to-hf", str(tmp_path / "run/checkpoints/step_00000003"), str(tmp_path / "export")])
    cfg = parse_args([*TINY, *flags])
    args = model_args_from_config(cfg.model)
    assert_init_from_gives(cfg, str(tmp_path / "run/checkpoints"), trained)

    exported = pytest.importorskip("safetensors.torch").load_file(tmp_path / "export/model.safetensors")
    want = weights.to_hf(trained, args)
    assert exported.keys() == want.keys() and all(torch.equal(exported[k], want[k]) for k in want)
    assert_init_from_gives(cfg, f"hf:{tmp_path / 'export'}", trained)
    hint = f"it holds a Hugging Face model: give hf:{tmp_path / 'export'}"
    with pytest.raises(ck.CheckpointError, match=re.escape(hint)):
        weights.resolve(tmp_path / "export", "--checkpoint.init_from")  # the export folder without hf:
    for name in ("model.safetensors", "config.json"):  # through a temporary file, which mkstemp makes 0600
        assert (tmp_path / "export" / name).stat().st_mode & 0o777 == 0o644, name  # readable by all, as shards
    wider = model_args_from_config(parse_args([*TINY, "--model.dim", "128"]).model)
    with pytest.raises(ck.CheckpointError, match="dim=128 here but 64 there.*--model.dim 64"):
        weights.load_weights(build(wider, device="cpu"), f"hf:{tmp_path / 'export'}", wider)
    if not tied:
        assert_sharded_hf_folders_load_and_a_missing_lm_head_is_named(tmp_path, cfg, trained)
    transformers = pytest.importorskip("transformers")
    ours = build(args, device="cpu")
    ours.load_state_dict(trained)
    assert (ours.output.weight is ours.tok_embeddings.weight) == tied
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.float32).eval()
    tokens = torch.randint(args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), atol=1e-5, rtol=1e-5)


def assert_sharded_hf_folders_load_and_a_missing_lm_head_is_named(tmp_path, cfg, trained) -> None:
    """Released Llama checkpoints come in several files listed by model.safetensors.index.json; an untied model
    without lm_head.weight is an error, not the embedding reused as the output layer."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "export/model.safetensors")
    names = sorted(tensors)
    split, headless = tmp_path / "split", tmp_path / "headless"
    weight_map = {}
    for folder in (split, headless):
        folder.mkdir()
        shutil.copy(tmp_path / "export/config.json", folder)
    for index, part in enumerate((names[:len(names) // 2], names[len(names) // 2:]), 1):
        save_file({name: tensors[name] for name in part}, split / f"model-{index}-of-2.safetensors")
        weight_map.update({name: f"model-{index}-of-2.safetensors" for name in part})
    (split / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert_init_from_gives(cfg, f"hf:{split}", trained)
    (split / "model-2-of-2.safetensors").rename(tmp_path / "elsewhere")
    args = model_args_from_config(cfg.model)
    with pytest.raises(ck.CheckpointError, match="model-2-of-2.safetensors, listed in model.safetensors.index.json, "
                                                 "is missing; download the model again"):
        weights.load_weights(build(args, device="cpu"), f"hf:{split}", args)
    save_file({name: t for name, t in tensors.items() if name != "lm_head.weight"}, headless / "model.safetensors")
    with pytest.raises(ck.CheckpointError, match="lm_head.weight is missing"):
        weights.load_weights(build(args, device="cpu"), f"hf:{headless}", args)


def assert_init_from_gives(cfg, source: str, want: dict[str, torch.Tensor]) -> None:
    """A fresh one-rank model restored with checkpoint.init_from=source starts at step 0 with the weights `want`."""
    cfg.checkpoint.init_from = source
    cfg.checkpoint.dir = str(Path(cfg.train.output_dir) / "fresh")
    with one_rank() as info:
        model, _ = build_model(cfg, distributed.build_mesh("cpu", 1, 1), info.device)
        optimizer = build_optimizer(model, cfg.optim)
        ckpt = ck.Checkpointer(cfg, info, model, optimizer, build_scheduler(optimizer, cfg.optim, cfg.train.steps))
        args = model_args_from_config(cfg.model)
        assert ckpt.restore(lambda: weights.load_weights(model, source, args, ckpt.group)) == ck.Progress()
        got = full_state(model)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), source


@pytest.mark.slow
def test_export_refuses_a_folder_with_weights_and_import_a_folder_with_two_sets(small, tmp_path, capsys):
    """An earlier export's files that a new one would not replace (a sharded model's index and shards) would be
    what init_from hf: loads: export refuses such a folder and deletes nothing; a folder holding both
    model.safetensors and an index is refused by the importer, which cannot tell which one is the model."""
    out = tmp_path / "old"
    out.mkdir()
    (out / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (out / "model-00001-of-00001.safetensors").write_text("an older model")
    before = tree(out)
    with pytest.raises(SystemExit) as exit_info:
        convert.main(["to-hf", str(small / "checkpoints"), str(out)])
    assert exit_info.value.code == 2
    assert (f"{out} holds model weights already (model-00001-of-00001.safetensors, model.safetensors.index.json); "
            "export into a new or empty folder, or remove those files first") in capsys.readouterr().err
    assert tree(out) == before

    safetensors = pytest.importorskip("safetensors")
    new = tmp_path / "new"
    weights.export(small / "checkpoints", new, log=lambda line: None)
    with pytest.raises(ck.CheckpointError, match=re.escape(f"{new} holds model weights already (model.safetensors)")):
        weights.export(small / "checkpoints", new, log=lambda line: None)
    # A sharded copy beside the single file, as an export over an older sharded model used to leave it.
    shard = new / "model-00001-of-00001.safetensors"
    shutil.copy(new / "model.safetensors", shard)
    with safetensors.safe_open(str(shard), "pt") as f:
        weight_map = dict.fromkeys(f.keys(), shard.name)
    (new / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    args = model_args_from_config(parse_args(TINY).model)
    with pytest.raises(ck.CheckpointError, match="holds both model.safetensors and model.safetensors.index.json"):
        weights.load_weights(build(args, device="cpu"), f"hf:{new}", args)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["missing", "empty"])
def test_export_of_a_checkpoint_without_its_config_names_it_and_writes_nothing(small, tmp_path, capsys, damage):
    """A checkpoint's config.toml is the only record of its model's settings: without it, export stops before
    writing anything (an empty one used to read as the default preset). Resume needs none of it: the checkpoint
    stays usable."""
    step = tmp_path / "step_00000004"
    shutil.copytree(small / "checkpoints/step_00000004", step)
    if damage == "missing":
        (step / ck.CONFIG).unlink()
    else:
        (step / ck.CONFIG).write_text("")
    with pytest.raises(SystemExit) as exit_info:
        convert.main(["to-hf", str(step), str(tmp_path / "export")])
    assert exit_info.value.code == 2
    problem = "is missing" if damage == "missing" else "is unusable (no [model] table: it is empty or cut short)"
    assert (f"checkpoint {step}: its config.toml, the only record of the model's settings, {problem}; copy in the "
            "config.toml of the run that saved it (from its train.output_dir)") in capsys.readouterr().err
    assert not (tmp_path / "export").exists()
    assert ck.read_marker(step)[1] is None


@pytest.mark.slow
def test_config_toml_and_the_folder_are_on_disk_before_the_marker_commits_the_checkpoint(tmp_path, monkeypatch):
    """A crash, power loss included, must never commit a checkpoint with an empty or partial config.toml, export's
    only record of the model: the file gets its name only once whole and on disk, and that name is on disk before
    the marker is written. So is the folder's own name in the checkpoint root: once committed, retention deletes
    older checkpoints there, and a power loss could keep those deletions and lose the new folder."""
    step = tmp_path / "checkpoints" / "step_00000001"
    synced = []  # (inode, whether the step folder and config.toml had their names yet) of each fsync, in order
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append((os.fstat(fd).st_ino, step.is_dir(), (step / ck.CONFIG).exists()))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    train_in_process("--train.steps", "1", "--checkpoint.async_mode", "none", "--train.output_dir", str(tmp_path))
    inodes = [inode for inode, _, _ in synced]
    config, marker = (step / ck.CONFIG).stat().st_ino, (step / ck.MARKER).stat().st_ino
    assert config in inodes, "config.toml's data never went to disk"
    first = inodes.index(config)
    assert not synced[first][2], "config.toml had its name before its data was on disk"
    assert step.stat().st_ino in inodes[first:inodes.index(marker)], "config.toml's name was not on disk before " \
        "the marker was written"
    assert (step.parent.stat().st_ino, True) in [entry[:2] for entry in synced[:inodes.index(marker)]], \
        "the step folder's name was not on disk before the marker was written"


def test_hf_import_reads_rope_and_norm_settings_as_transformers_4_and_5_write_them(tmp_path):
    """transformers 5 writes RoPE's settings as rope_parameters, 4 as rope_theta and rope_scaling ("type" before
    4.43): each setting the model does not match is an error naming the flag that would; an absent theta is
    transformers' default, 10000; RoPE scaling without a type is no default RoPE."""
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file
    args = model_args_from_config(parse_args(TINY).model)  # rope_theta 10000, norm_eps 1e-5
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file(weights.to_hf(build(args, device="cpu").state_dict(), args), str(folder / "model.safetensors"))
    config = {k: v for k, v in weights.hf_config(args, torch.float32).items() if k not in ("rope_theta", "rope_scaling")}

    def load(model_args=args, **settings) -> None:
        (folder / "config.json").write_text(json.dumps({**config, **settings}))
        weights.load_weights(build(model_args, device="cpu"), f"hf:{folder}", model_args)

    with pytest.raises(ck.CheckpointError, match=re.escape("rope_theta=10000.0 here but 500000.0 there); set "
                                                           "--model.rope_theta 500000.0")):
        load(rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
    with pytest.raises(ck.CheckpointError, match=re.escape("rope_theta=10000.0 here but 500000 there")):
        load(rope_theta=500000, rope_scaling=None)  # as transformers 4 writes it
    wide = model_args_from_config(parse_args([*TINY, "--model.rope_theta", "500000"]).model)
    with pytest.raises(ck.CheckpointError, match=re.escape("rope_theta=500000.0 here but 10000.0 there")):
        load(wide)
    load(rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    load(rope_scaling={"type": "default"})
    llama3 = {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
              "original_max_position_embeddings": 8192, "rope_theta": 10000.0, "rope_type": "llama3"}
    with pytest.raises(ck.CheckpointError, match=re.escape(
            "norm_eps=1e-05 here but 1e-06 there, rope_scaling=None here but {'factor': 8.0, 'low_freq_factor': "
            "1.0, 'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192} there); set --model.norm_eps "
            "1e-06 --model.rope_scaling factor 8.0 low_freq_factor 1.0 high_freq_factor 4.0 "
            "original_max_position_embeddings 8192")):
        load(rope_parameters=llama3, rms_norm_eps=1e-6)
    scaled = model_args_from_config(parse_args([*TINY, "--model.norm_eps", "1e-6", "--model.rope_scaling", "factor",
                                                "8", "low_freq_factor", "1", "high_freq_factor", "4",
                                                "original_max_position_embeddings", "8192"]).model)
    load(scaled, rope_parameters=llama3, rms_norm_eps=1e-6)
    older = {key: value for key, value in llama3.items() if key != "rope_type"} | {"type": "llama3"}
    load(scaled, rope_theta=10000.0, rope_scaling=older, rms_norm_eps=1e-6)
    with pytest.raises(ck.CheckpointError, match="config.json's RoPE type is None, which this model does not "
                                                 "implement"):
        load(rope_scaling={"factor": 2.0})


def test_rope_row_permutation():
    """HF's rotate-half RoPE (its own formula) on the permuted q/k rows equals our interleaved RoPE on ours."""
    from fsdp_trainer.models.llama import apply_rope, rope_table
    heads, head_dim, seq, theta = 2, 8, 5, 10000.0
    w, x = torch.randn(heads * head_dim, 16), torch.randn(1, seq, 16)
    ours = apply_rope((x @ w.T).view(1, seq, heads, head_dim), rope_table(head_dim, seq, theta))
    q = (x @ weights.to_hf_rows(w, heads).T).view(1, seq, heads, head_dim)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), inv_freq).repeat(1, 2)[:, None]
    rotate_half = torch.cat([-q[..., head_dim // 2:], q[..., :head_dim // 2]], -1)
    theirs = q * angles.cos() + rotate_half * angles.sin()
    rows = weights.to_hf_rows(torch.arange(heads * head_dim).float()[:, None], heads).long().flatten()
    torch.testing.assert_close(ours.flatten(2)[..., rows], theirs.flatten(2))
    assert torch.equal(weights.from_hf_rows(weights.to_hf_rows(w, heads), heads), w)


@pytest.mark.slow
def test_another_model_is_refused_naming_its_settings_or_shapes_and_deletes_nothing(small, capsys):
    """A run of other model settings is refused by the settings the checkpoint records; a model that records none
    (one's own) by DCP's own error, which names the tensor and both shapes."""
    before = tree(small)
    for resume in (str(small / "checkpoints/step_00000004"), "auto"):
        with pytest.raises(SystemExit) as exit_info:
            main([*TINY, "--model.dim", "128", "--train.output_dir", str(small), "--checkpoint.resume", resume])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"checkpoint {small / 'checkpoints/step_00000004'} was saved with model.dim 64," in err
        assert "--model.dim 64" in err  # what it was saved with
    cfg = parse_args([*TINY, "--model.dim", "128", "--train.output_dir", str(small)])
    with one_rank() as info:
        model, _ = build_model(cfg, distributed.build_mesh("cpu", 1, 1), info.device)
        optimizer = build_optimizer(model, cfg.optim)
        checkpointer = ck.Checkpointer(cfg, info, model, optimizer, build_scheduler(optimizer, cfg.optim, 10))
        with pytest.raises(ck.CheckpointError, match=r"step_00000004 could not be read \(rank 0: .*Size mismatch.*"
                                                     r"\[320, 64\].*\[320, 128\].*model\.tok_embeddings\.weight"):
            checkpointer.restore()
    assert tree(small) == before


@pytest.mark.slow
def test_resume_refuses_missing_partial_and_corrupt_checkpoints(small, tmp_path, capsys):
    root = tmp_path / "checkpoints"
    shutil.copytree(small / "checkpoints", root)
    cases = {
        "nothing": (tmp_path / "nope", "no complete checkpoint: it does not exist"),
        "no_marker": (root / "step_00000006", "has no trainer_state.json: the save was interrupted"),
        "no_metadata": (root / "step_00000008", "has no .metadata: not every rank had finished writing"),
    }
    shutil.copytree(root / "step_00000004", root / "step_00000006")
    (root / "step_00000006" / ck.MARKER).unlink()
    shutil.copytree(root / "step_00000004", root / "step_00000008")
    (root / "step_00000008" / ".metadata").unlink()
    (root / "step_00000008" / ck.MARKER).unlink()
    assert ck.find_latest(root).path == root / "step_00000004" == weights.resolve(root, "--checkpoint.init_from").path

    truncated = root / "step_00000004" / "__0_0.distcp"
    truncated.write_bytes(truncated.read_bytes()[:1000])
    shutil.copytree(root / "step_00000002", root / "step_00000010")
    (root / "step_00000010" / ".metadata").write_bytes(b"not a pickle")
    drop_checksums(root / "step_00000010")
    shutil.copytree(root / "step_00000004", root / "step_00000012")
    drop_checksums(root / "step_00000012")
    # A size in the index changed by one bit: it still unpickles, and would read as another model's shape.
    shutil.copytree(root / "step_00000002", root / "step_00000014")
    index = root / "step_00000014" / ".metadata"
    index.write_bytes(index.read_bytes().replace(b"K@", b"KA", 1))  # pickle's 1-byte int 64 -> 65
    assert dcp.FileSystemReader(str(index.parent)).read_metadata()
    cases["truncated"] = (root / "step_00000004", "is corrupt: __0_0.distcp holds 1,000 bytes where the save wrote")
    cases["bad_metadata"] = (root / "step_00000010", "global metadata read failed: invalid load key")
    cases["metadata_that_unpickles"] = (root / "step_00000014", "is corrupt: .metadata differs from what the save "
                                        "wrote")
    cases["truncated_without_checksums"] = (root / "step_00000012", "could not be read (rank 0: EOFError)")

    before = tree(root)
    for name, (path, message) in cases.items():
        with pytest.raises(SystemExit):
            main([*TINY, "--train.output_dir", str(tmp_path / name), "--checkpoint.dir", str(tmp_path / name),
                  "--checkpoint.resume", str(path)])
        err = capsys.readouterr().err
        assert str(path) in err and message in err, (name, err)
    assert tree(root) == before


@pytest.mark.slow
def test_init_from_a_corrupt_checkpoint_or_hf_folder_names_the_file(small, tmp_path, capsys):
    """A truncated shard fails inside DCP with a CheckpointException, which is a BaseException: it must still end
    as one clear error, and so must unreadable Hugging Face JSON files."""
    source = tmp_path / "step_00000004"
    shutil.copytree(small / "checkpoints/step_00000004", source)
    shard = source / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    fix = "give --checkpoint.init_from an earlier complete checkpoint"
    with pytest.raises(SystemExit) as exit_info:
        main([*TINY, "--train.output_dir", str(tmp_path / "run"), "--checkpoint.init_from", str(source)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"checkpoint {source} is corrupt: __0_0.distcp holds 1,000 bytes" in err
    assert fix in err
    drop_checksums(source)
    with pytest.raises(SystemExit) as exit_info:
        main([*TINY, "--train.output_dir", str(tmp_path / "run"), "--checkpoint.init_from", str(source)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"checkpoint {source} could not be read" in err and fix in err, err
    shard.unlink()
    with pytest.raises(SystemExit):
        main([*TINY, "--train.output_dir", str(tmp_path / "run"), "--checkpoint.init_from", str(source)])
    err = capsys.readouterr().err
    assert "could not be read (rank 0: FileNotFoundError: " in err and f"{shard}')" in err, err

    args = model_args_from_config(parse_args(TINY).model)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"hidden_size": 64,')
    pytest.importorskip("safetensors")
    with pytest.raises(ck.CheckpointError, match="config.json is unreadable .*; download or export the model again"):
        weights.load_weights(build(args, device="cpu"), f"hf:{hf}", args)
    (hf / "config.json").write_text("{}")
    with pytest.raises(ck.CheckpointError, match="config.json describes no model this Llama can be \\(it lacks "
                                                 "hidden_size, num_hidden_layers, "):
        weights.load_weights(build(args, device="cpu"), f"hf:{hf}", args)
    (hf / "config.json").write_text(json.dumps(weights.hf_config(args, torch.float32)))
    (hf / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ck.CheckpointError, match="model.safetensors.index.json is unreadable .*KeyError: 'weight_map'"):
        weights.load_weights(build(args, device="cpu"), f"hf:{hf}", args)


@pytest.mark.slow
def test_list_takes_markers_without_skipped_steps_and_names_the_folder_to_list(small, tmp_path, capsys):
    root = tmp_path / "checkpoints"
    shutil.copytree(small / "checkpoints", root)
    # Older checkpoints lack skipped_steps; a marker edited on purpose drops its own sum
    state = ck.read_marker(ck.step_dir(root, 2))[0]
    for key in ("skipped_steps", cs.MARKER_SUM):
        del state[key]
    (ck.step_dir(root, 2) / ck.MARKER).write_text(json.dumps(state))
    ckpt_cli.main(["list", str(root)])
    assert "step_00000002  complete" in capsys.readouterr().out

    ckpt_cli.main(["list", str(tmp_path)])  # the output folder, not its checkpoints folder
    assert f"{tmp_path}: no checkpoints (no step_* folders); did you mean its checkpoints folder, {root}?" in \
        capsys.readouterr().out
    ckpt_cli.main(["list", str(ck.step_dir(root, 2))])  # a checkpoint, not a folder of them
    assert f"{ck.step_dir(root, 2)}: no checkpoints (no step_* folders); it is a checkpoint itself: list the folder " \
        f"that holds it, {root.resolve()}" in capsys.readouterr().out

    with pytest.raises(SystemExit) as exit_info:
        ckpt_cli.main(["list", str(tmp_path / "nope")])
    assert exit_info.value.code == 2
    assert f"{tmp_path / 'nope'}: no such folder" in capsys.readouterr().err


@pytest.mark.slow
def test_retention_deletes_incomplete_folders_older_than_the_newest_complete_one(tmp_path, capfd):
    """What a crash mid-save or mid-deletion left goes once a newer checkpoint is complete; a newer incomplete
    folder stays (the save of its step clears it)."""
    root = tmp_path / "checkpoints"
    for step in (1, 9):
        ck.step_dir(root, step).mkdir(parents=True)
        (ck.step_dir(root, step) / "__0_0.distcp").write_text("half written")
    train_in_process("--train.steps", "2", "--checkpoint.interval", "2", "--checkpoint.async_mode", "none",
                     "--train.output_dir", str(tmp_path))
    assert [step for step, _ in ck.list_checkpoints(root)] == [2, 9] and complete_steps(root) == [2]
    assert f"deleted {ck.step_dir(root, 1)} (incomplete, older than the newest complete checkpoint)" in \
        capfd.readouterr().err


@pytest.mark.slow
def test_training_never_waits_for_retention_to_finish_deleting(tmp_path, monkeypatch, capfd):
    """Deleting old checkpoints on slow storage may outlast a step, and a rank 0 that waited for it at the next
    commit would look hung to the other ranks' watchdogs. Here the first deletion cannot finish before step 4 has
    begun, so a commit that waited for it would never get there; the run still ends with checkpoint.keep."""
    reached_step_4, waited_out = threading.Event(), []
    delete, after_step = ck._delete, ck.Checkpointer.after_step

    def slow_delete(paths):
        if not reached_step_4.wait(timeout=10):
            waited_out.append(paths)
        delete(paths)

    def watched_after_step(self, progress):
        if progress.step >= 4:
            reached_step_4.set()
        return after_step(self, progress)

    monkeypatch.setattr(ck, "_delete", slow_delete)
    monkeypatch.setattr(ck.Checkpointer, "after_step", watched_after_step)
    train_in_process("--train.steps", "5", "--checkpoint.interval", "1", "--checkpoint.keep", "1",
                     "--checkpoint.async_mode", "none", "--train.output_dir", str(tmp_path))
    assert not waited_out, "a commit waited for retention's deletion"
    assert "could not delete" not in capfd.readouterr().err  # nor was a folder being deleted deleted again
    assert [step for step, _ in ck.list_checkpoints(tmp_path / "checkpoints")] == [5]


@pytest.mark.slow
def test_links_are_no_checkpoints_and_what_they_link_to_is_never_deleted(small, tmp_path):
    """step_* links to another run's checkpoint and to an interrupted save elsewhere: resume, retention and the count
    of checkpoint.keep pass them by (--checkpoint.resume names a checkpoint elsewhere), so the folders they link to
    keep every file: their markers and files are the other run's."""
    other, root = tmp_path / "other", tmp_path / "run" / "checkpoints"
    shutil.copytree(small / "checkpoints/step_00000002", other / "step_00000002")
    (other / "step_00000003").mkdir()
    (other / "step_00000003" / "__0_0.distcp").write_text("half written")
    before = tree(other)
    root.mkdir(parents=True)
    for step in (2, 3):
        ck.step_dir(root, 10 + step).symlink_to(ck.step_dir(other, step))
    train_in_process("--train.steps", "4", "--checkpoint.interval", "1", "--checkpoint.keep", "1",
                     "--checkpoint.async_mode", "none", "--train.output_dir", str(tmp_path / "run"))
    assert tree(other) == before and complete_steps(other) == [2]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004", "step_00000012", "step_00000013"]
    assert complete_steps(root) == [4]


@pytest.mark.slow
def test_a_folder_with_checkpoints_resumes_its_newest_and_never_starts_fresh_into_them(small, capsys):
    """Saves next to another run's checkpoints would be mixed with them (resume would later pick them, retention
    delete them): resume none is refused, and a named checkpoint gives way to the folder's newest."""
    before = tree(small)
    with pytest.raises(SystemExit):
        main([*TINY, "--train.output_dir", str(small), "--checkpoint.resume", "none"])
    assert "step_00000002, step_00000004 that this run would mix with its own" in capsys.readouterr().err
    main([*TINY, "--train.output_dir", str(small), "--train.steps", "4", "--checkpoint.resume",
          str(small / "checkpoints/step_00000002")])
    assert "step 4 of train.steps=4 is done already" in capsys.readouterr().err  # it took step 4, not step 2
    assert tree(small) == before


@pytest.mark.slow
def test_rerunning_an_explicit_resume_continues_its_own_checkpoints(small, tmp_path, capfd):
    """A run begun with --checkpoint.resume <checkpoint> into a new folder, then run again as launched (a requeue
    after preemption): it resumes its own newest checkpoint, not the one named, also once the one named is gone."""
    start, out = tmp_path / "from" / "step_00000002", tmp_path / "run"
    shutil.copytree(small / "checkpoints/step_00000002", start)
    flags = [*TINY, "--train.output_dir", str(out), "--checkpoint.resume", str(start), "--checkpoint.interval", "2",
             "--checkpoint.async_mode", "none"]
    main([*flags, "--train.steps", "4"])
    main([*flags, "--train.steps", "6"])
    root = out / "checkpoints"
    assert f"resuming from {ck.step_dir(root, 4)}: step 4" in capfd.readouterr().err

    shutil.rmtree(start)  # as retention does when the run saves into the folder it began from
    main([*flags, "--train.steps", "8"])
    assert f"resuming from {ck.step_dir(root, 6)}: step 6" in capfd.readouterr().err
    assert sorted(rows(out)) == [3, 4, 5, 6, 7, 8]  # no step trained twice


@pytest.mark.slow
def test_resume_refuses_other_data_unless_allowed(small, tmp_path, capfd):
    """The saved sample count is a position in the saved data's order: resuming on other data is an error that
    names the change and deletes nothing, unless checkpoint.allow_data_change says it is meant."""
    out = tmp_path / "run"
    shutil.copytree(small / "checkpoints", out / "checkpoints")
    before = tree(out / "checkpoints")
    flags = [*TINY, "--train.output_dir", str(out), "--train.steps", "6", "--checkpoint.async_mode", "none",
             "--data.seed", "1"]
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    assert exit_info.value.code == 2
    err = capfd.readouterr().err
    assert "was saved reading other data (seed 0 then, 1 now)" in err and "--checkpoint.allow_data_change" in err
    assert tree(out / "checkpoints") == before
    main([*flags, "--checkpoint.allow_data_change"])
    assert "on other data (seed 0 then, 1 now)" in capfd.readouterr().err
    assert ck.read_marker(ck.step_dir(out / "checkpoints", 6))[0]["data"]["seed"] == 1


def test_a_checkpoint_of_the_same_data_in_another_sample_order_names_the_change(tmp_path):
    """A checkpoint saved before the data's identity named its order (the shuffle then was another): the error names
    the order, and --checkpoint.allow_data_change, the way on."""
    here = {"kind": "token shards", "order": "feistel", "seed": 0, "tokens": 1000, "shards": 2, "shards_digest": "ab"}
    checkpointer = types.SimpleNamespace(data=here, cfg=parse_args(TINY), model_settings=None)
    saved = {key: value for key, value in here.items() if key != "order"}
    with pytest.raises(ck.CheckpointError, match=r"saved reading other data \(order None then, feistel now\); .*"
                                                 r"pass --checkpoint.allow_data_change to go on"):
        ck.Checkpointer._check_run(checkpointer, tmp_path, {"data": saved, "consumed_samples": 8, "seq_len": 32})


@pytest.mark.slow
def test_an_unusable_marker_is_an_error_and_never_deleted(small, tmp_path, capfd):
    """A committed checkpoint whose marker is of another format (a newer fsdp_trainer's, say) is no interrupted
    save: resume auto stops at it instead of resuming from an older one, resume from an older one refuses to save
    next to it, and retention keeps an unreadable one."""
    out, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    shutil.copytree(small / "checkpoints", root)
    step2, step4 = root / "step_00000002", root / "step_00000004"
    state = ck.read_marker(step4)[0]
    (step4 / ck.MARKER).write_text(json.dumps({**state, "format": 2}))
    flags = [*TINY, "--train.steps", "6", "--checkpoint.interval", "2", "--checkpoint.async_mode", "none",
             "--train.output_dir", str(out)]
    before = tree(root)
    for resume in ("auto", str(step2)):
        with pytest.raises(SystemExit) as exit_info:
            main([*flags, "--checkpoint.resume", resume])
        assert exit_info.value.code == 2
        err = capfd.readouterr().err
        assert f"checkpoint {step4} cannot be used: it has a {ck.MARKER} that is not format 1" in err, resume
        assert f"rename it (mv {step4} {step4}.unusable) to resume from the complete checkpoint before it" in err
    assert tree(root) == before
    ckpt_cli.main(["list", str(root)])
    assert f"{step4}  UNUSABLE: it has a {ck.MARKER} that is not format 1" in capfd.readouterr().out

    (step4 / ck.MARKER).write_text(json.dumps(state))
    (step2 / ck.MARKER).write_text("{")
    kept = tree(step2)
    main([*flags, "--checkpoint.keep", "1"])
    assert f"resuming from {step4}" in capfd.readouterr().err
    assert complete_steps(root) == [6] and tree(step2) == kept


@pytest.mark.slow
def test_each_way_past_a_corrupt_checkpoint_works(small, tmp_path, capfd):
    """A truncated shard in the newest checkpoint: the error names it and the way on, renaming it, which works as
    written; so does resuming an earlier one into another folder."""
    out, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    shutil.copytree(small / "checkpoints", root)
    step2, step4 = root / "step_00000002", root / "step_00000004"
    shard = step4 / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    flags = [*TINY, "--train.steps", "6", "--checkpoint.interval", "2", "--checkpoint.async_mode", "none",
             "--train.output_dir", str(out)]
    with pytest.raises(SystemExit):
        main(flags)
    err = capfd.readouterr().err
    rename, elsewhere = f"mv {step4} {step4}.unusable", f"--checkpoint.resume {step2} --checkpoint.dir <new folder>"
    assert f"checkpoint {step4} is corrupt: __0_0.distcp holds 1,000 bytes where the save wrote " in err
    assert rename in err

    main([*flags, *elsewhere.replace("<new folder>", str(tmp_path / "elsewhere")).split()])
    assert f"resuming from {step2}" in capfd.readouterr().err and complete_steps(tmp_path / "elsewhere") == [4, 6]
    step4.rename(f"{step4}.unusable")
    main(flags)
    assert f"resuming from {step2}" in capfd.readouterr().err and complete_steps(root) == [2, 4, 6]


@pytest.mark.slow
def test_a_flipped_bit_in_a_shard_stops_resume_on_every_rank(reference, tmp_path):
    """DCP keeps no checksums: a shard changed after the save loads without a word (as --checkpoint.no_checksums
    shows at the end). The marker holds the size and CRC32 of both ranks' files; each rank checks its share while
    the load reads them, and every rank stops with the damaged file's name before training; nothing is deleted."""
    root = tmp_path / "checkpoints"
    shutil.copytree(reference / "checkpoints", root)
    step10 = root / "step_00000010"
    sums = ck.read_marker(step10)[0][cs.CHECKSUMS]
    assert set(sums) == summed_files(step10)
    assert {name[:3] for name in sums if name.endswith(".distcp")} == {"__0", "__1"}
    damaged = sorted(name for name in sums if name.startswith("__1_"))[-1]  # rank 1 wrote it, and checks it
    flip_a_bit(step10 / damaged)
    before = tree(root)
    output = train_job(2, tmp_path, "--train.steps", "12", ok=False)
    message = f"checkpoint {step10} is corrupt: {damaged} differs from what the save wrote"
    assert output.count(message) == 1, output[-3000:]  # rank 0's: it knows of rank 1's share only by the check
    assert "resuming from" not in output and tree(root) == before
    output = train_job(2, tmp_path, "--train.steps", "12", "--checkpoint.no_checksums")
    assert f"resuming from {step10}" in output and "is corrupt" not in output


def fail_in_an_extra_writer_thread(monkeypatch, owner, name: str, error_for: Callable[..., Optional[Exception]]):
    """Make owner.<name>, which DCP's writer threads call, raise error_for(*its arguments) (None: no error for
    that call) in the extra threads torch starts (checkpoint.write_threads but the first). DCP's own thread waits
    in such a call for an extra thread's failure, so that it cannot take every file before an extra thread takes
    one."""
    real, failed = getattr(owner, name), threading.Event()

    def faulty(*args, **kwargs):
        error = error_for(*args)
        if error is not None:
            if "_write_files_from_queue" in threading.current_thread().name:  # the name of torch's extra threads
                failed.set()
                raise error
            assert failed.wait(timeout=10), "no extra writer thread took a file"
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, faulty)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("mode,checksums,fault", [
    ("none", [], "write ENOSPC"), ("async", [], "open EACCES"),
    ("none", ["--checkpoint.no_checksums"], "open EACCES"), ("async", ["--checkpoint.no_checksums"], "write ENOSPC")],
    ids=["sync-checksums-ENOSPC", "async-checksums-EACCES", "sync-no_checksums-EACCES", "async-no_checksums-ENOSPC"])
@pytest.mark.slow
def test_a_failed_extra_writer_thread_fails_the_save_in_one_line_and_is_never_committed(small, tmp_path, monkeypatch,
                                                                                         mode, checksums, fault):
    """torch only prints the error of a writer thread other than the first, and without our check DCP would commit
    a checkpoint lacking that thread's tensors: the save fails with one line saying so, and the earlier checkpoints
    stay as they were."""
    from torch.distributed.checkpoint import filesystem
    out = tmp_path / "run"
    shutil.copytree(small / "checkpoints", out / "checkpoints")
    before = tree(out / "checkpoints")
    failing = ck.step_dir(out / "checkpoints", 5)
    if fault == "write ENOSPC":
        fail_in_an_extra_writer_thread(
            monkeypatch, filesystem, "_write_item", lambda transforms, stream, *rest:
            OSError(errno.ENOSPC, "No space left on device") if Path(stream.name).parent == failing else None)
    else:
        fail_in_an_extra_writer_thread(
            monkeypatch, filesystem.FileSystem, "create_stream", lambda fs, path, mode:
            PermissionError(errno.EACCES, "Permission denied", str(path)) if Path(path).parent == failing else None)
    with pytest.raises(RuntimeError) as failed:
        train_in_process("--train.steps", "5", "--checkpoint.async_mode", mode, "--checkpoint.write_threads", "2",
                         "--train.output_dir", str(out), *checksums)
    assert re.fullmatch(rf"saving checkpoint {re.escape(str(failing))} failed: rank 0: RuntimeError: \d+ of this "
                        r"rank's \d+ tensors were not written: a writer thread failed \(its error is printed above\)",
                        str(failed.value)), str(failed.value)
    assert ck.incomplete_reason(failing) is not None
    after = tree(out / "checkpoints")
    assert {name: stat for name, stat in after.items() if not name.startswith(failing.name)} == before
    latest = ck.find_latest(out / "checkpoints")
    assert latest.path == ck.step_dir(out / "checkpoints", 4)
    with cs.checked(latest, None, "the fix", threads=2):
        all_tensors(latest.path)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_writer_thread_that_failed_outside_its_file_is_never_committed(tmp_path, monkeypatch):
    """An error before a thread opens its file reaches no file system: the tensors it did not write still fail the
    save, which DCP would otherwise commit without them."""
    from torch.distributed.checkpoint import filesystem
    fail_in_an_extra_writer_thread(monkeypatch, filesystem._SerialCpuLoader, "start_loading",
                                   lambda loader: RuntimeError("no tensors today"))
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="tensors were not written: a writer thread failed"):
        train_in_process("--train.steps", "1", "--checkpoint.async_mode", "none", "--checkpoint.write_threads", "2",
                         "--train.output_dir", str(out))
    assert complete_steps(out / "checkpoints") == []


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "async"])
def test_a_failed_save_names_its_cause_in_one_line(tmp_path, monkeypatch, capsys, mode):
    """DCP's error holds every failing rank's traceback: the message names the first one's error, the traceback
    stays in the chain. A synchronous save that failed is not logged as taken first."""
    from torch.distributed.checkpoint import filesystem

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(filesystem, "_write_item", no_space)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError) as failed:
        # One writer thread, DCP's own, whose error torch raises (an extra thread's: see the test above).
        train_in_process("--train.steps", "1", "--checkpoint.async_mode", mode, "--checkpoint.write_threads", "1",
                         "--train.output_dir", str(out))
    step = ck.step_dir(out / "checkpoints", 1)
    assert str(failed.value) == f"saving checkpoint {step} failed: rank 0: OSError: [Errno 28] No space left on device"
    assert isinstance(failed.value.__cause__, ck.CheckpointException)
    assert (f"checkpoint step 1 ({mode}): training blocked" in capsys.readouterr().err) == (mode != "none")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "async", "async_pinned"])
def test_async_saves_write_while_the_next_step_trains(tmp_path, monkeypatch, mode):
    """The save of step 1 cannot write a byte until step 2 has begun: asynchronous modes train on meanwhile, where
    a save that blocked training would wait for ever (10 s here). Saving synchronously, every write is done before
    step 2."""
    import fsdp_trainer.train as train
    from torch.distributed.checkpoint import filesystem
    real_write, real_step = filesystem._write_item, train.train_step
    second_step, order = threading.Event(), []  # order: the folder of each write, "step <n>" as each step begins

    def gated_write(transforms, stream, *args, **kwargs):
        if mode != "none" and not second_step.wait(timeout=10):
            second_step.set()  # the save blocks training: the other writes need not wait too, to fail below
        result = real_write(transforms, stream, *args, **kwargs)
        order.append(Path(stream.name).parent.name)
        return result

    def step(*args, **kwargs):
        order.append(f"step {sum(e.startswith('step ') for e in order) + 1}")
        if order[-1] == "step 2":
            second_step.set()
        return real_step(*args, **kwargs)

    monkeypatch.setattr(filesystem, "_write_item", gated_write)
    monkeypatch.setattr(train, "train_step", step)
    train_in_process("--train.steps", "2", "--checkpoint.interval", "1", "--checkpoint.async_mode", mode,
                     "--train.output_dir", str(tmp_path))
    first_save = [i for i, entry in enumerate(order) if entry == "step_00000001"]
    begun = order.index("step 2")
    assert first_save and (max(first_save) < begun if mode == "none" else min(first_save) > begun), order
    assert complete_steps(tmp_path / "checkpoints") == [1, 2]


@pytest.mark.slow
def test_a_resumed_optimizer_takes_this_run_s_settings_and_the_saved_state(small, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(small / "checkpoints", out / "checkpoints")
    result = train_in_process("--train.output_dir", str(out), "--train.steps", "5", "--checkpoint.async_mode", "none",
                              "--optim.weight_decay", "0.01", "--optim.betas", "0.8", "0.9", "--optim.eps", "1e-6")
    decayed, other = result["optimizer"].param_groups
    assert (decayed["weight_decay"], other["weight_decay"]) == (0.01, 0.0)
    assert decayed["betas"] == other["betas"] == (0.8, 0.9) and decayed["eps"] == other["eps"] == 1e-6
    assert all(state["step"] == 5 for state in result["optimizer"].state.values())  # the saved 4, plus this one


@pytest.mark.slow
def test_tied_and_untied_embeddings_never_load_into_each_other_silently(small, tmp_path, capfd):
    """`small` is untied. Resuming it tied is refused; so is init_from it into a tied model (one of its two tensors
    would overwrite the other); a tied checkpoint unties into two copies of its one tensor."""
    out = tmp_path / "resume"
    shutil.copytree(small / "checkpoints", out / "checkpoints")
    before = tree(out / "checkpoints")
    with pytest.raises(SystemExit) as exit_info:
        main([*TINY, "--train.output_dir", str(out), "--train.steps", "6", "--model.tie_embeddings", "True"])
    err = capfd.readouterr().err
    assert exit_info.value.code == 2 and "saved with model.tie_embeddings False, but this run has " \
        "model.tie_embeddings True: set --model.tie_embeddings False" in err, err
    assert tree(out / "checkpoints") == before

    tied_args = model_args_from_config(parse_args([*TINY, "--model.tie_embeddings", "True"]).model)
    with one_rank():
        with pytest.raises(ck.CheckpointError, match="saved with model.tie_embeddings False, but this model has "
                                                     "model.tie_embeddings True.*set --model.tie_embeddings False"):
            weights.load_weights(build(tied_args, device="cpu"), str(small / "checkpoints"), tied_args)
    tied = full_state(train_in_process("--train.steps", "2", "--checkpoint.async_mode", "none", "--train.output_dir",
                                       str(tmp_path / "tied"), "--model.tie_embeddings", "True")["model"])
    cfg = parse_args([*TINY, "--train.output_dir", str(tmp_path / "untied")])
    assert_init_from_gives(cfg, str(tmp_path / "tied" / "checkpoints"), tied)
    assert torch.equal(tied["output.weight"], tied["tok_embeddings.weight"])


@pytest.mark.slow
def test_resume_with_other_heads_rope_or_eps_of_the_same_shapes_is_refused(small, tmp_path, capfd):
    """8 heads of 8 and 4 kv heads of 8 hold the tensors of 4 heads of 16 and 2 kv heads of 16, shape for shape, and
    another RoPE or norm eps changes no shape: each would resume without a word and train another function."""
    out = tmp_path / "run"
    shutil.copytree(small / "checkpoints", out / "checkpoints")
    before = tree(out / "checkpoints")
    heads, theta = ["--model.n_heads", "8", "--model.n_kv_heads", "4"], ["--model.rope_theta", "500000"]
    scaling = ["--model.rope_scaling", "factor", "8", "low_freq_factor", "1", "high_freq_factor", "4",
               "original_max_position_embeddings", "16"]
    for flags, message in (
            (heads, "was saved with model.n_heads 4, model.n_kv_heads 2, but this run has model.n_heads 8, "
                    "model.n_kv_heads 4: set --model.n_heads 4 --model.n_kv_heads 2"),
            (theta, "was saved with model.rope_theta 10000.0, but this run has model.rope_theta 500000.0: set "
                    "--model.rope_theta 10000.0"),
            ([*scaling, "--model.norm_eps", "1e-6"], "was saved with model.rope_scaling None, model.norm_eps 1e-05, "
             "but this run has model.rope_scaling {'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, "
             "'original_max_position_embeddings': 16}, model.norm_eps 1e-06: set --model.rope_scaling "
             "--model.norm_eps 1e-05")):
        with pytest.raises(SystemExit) as exit_info:
            main([*TINY, "--train.output_dir", str(out), "--train.steps", "6", *flags])
        err = capfd.readouterr().err
        assert exit_info.value.code == 2 and f"step_00000004 {message}" in err, err
    assert tree(out / "checkpoints") == before

    # A new run from its weights: other heads or eps are refused too; another RoPE is that run's choice.
    for flags, refused in ((heads, "model.n_heads 4, model.n_kv_heads 2, but this model has model.n_heads 8, "
                                   "model.n_kv_heads 4"),
                           (["--model.norm_eps", "1e-6"], "model.norm_eps 1e-05, but this model has model.norm_eps "
                                                          "1e-06"), (theta, ""), (scaling, "")):
        args = model_args_from_config(parse_args([*TINY, *flags]).model)
        with one_rank():
            if refused:
                with pytest.raises(ck.CheckpointError, match=re.escape(f"saved with {refused}")):
                    weights.load_weights(build(args, device="cpu"), str(out / "checkpoints"), args)
            else:
                weights.load_weights(build(args, device="cpu"), str(out / "checkpoints"), args)


@pytest.mark.slow
def test_resume_with_another_seq_len_is_refused(small, tmp_path, capfd):
    """consumed_samples counts windows of the saved train.seq_len (data.py): another length would read other
    windows, skipping or repeating data. The new run from its weights that the error suggests works."""
    step4 = small / "checkpoints/step_00000004"
    before = tree(small)
    with pytest.raises(SystemExit):
        main([*TINY, "--train.seq_len", "64", "--train.steps", "6", "--train.output_dir", str(small)])
    err = capfd.readouterr().err
    new_run = f"--checkpoint.init_from {step4} --train.output_dir <new folder>"
    assert f"{step4} was saved with train.seq_len=32 but this run has 64" in err and "--train.seq_len 32" in err
    assert new_run in err and tree(small) == before
    main([*TINY, "--train.seq_len", "64", "--train.steps", "2", "--checkpoint.async_mode", "none",
          *new_run.replace("<new folder>", str(tmp_path)).split()])
    assert f"initialized the model from {step4}" in capfd.readouterr().err


@pytest.mark.slow
def test_finished_run_resumes_to_nothing(small, capsys):
    before = tree(small)
    main([*TINY, "--train.steps", "4", "--train.output_dir", str(small)])
    assert "step 4 of train.steps=4 is done already" in capsys.readouterr().err
    assert tree(small) == before


@pytest.mark.slow
def test_signal_handlers_restored_and_second_signal_exits_at_once():
    previous = signal.getsignal(signal.SIGTERM)
    stop = ck.StopSignals(rank=0)
    stop.install()
    assert signal.getsignal(signal.SIGTERM) == stop._handle
    stop.restore()
    assert signal.getsignal(signal.SIGTERM) == previous

    script = ("import os, signal, time\nfrom fsdp_trainer.checkpoint import StopSignals\n"
              "s = StopSignals(rank=0); s.install()\n"
              "os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.2); print('first:', s.received, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGUSR1); time.sleep(10); print('still running')\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env=checkout_env())
    assert proc.returncode == 128 + signal.SIGUSR1
    assert "first: SIGTERM" in proc.stdout and "still running" not in proc.stdout
    assert "second stop signal (SIGUSR1): exiting now" in proc.stderr


@pytest.mark.slow
def test_an_own_model_s_checkpoint_names_its_class_and_no_llama_preset(tmp_path):
    """config.toml's --model.* settings describe a preset an own-model run never trained: a checkpoint records the
    model's class instead, mismatch errors name it rather than those flags, and export refuses it up front with a
    route to its weights that works."""
    cfg = tiny_config(data={"source": "synthetic"}, train={"output_dir": str(tmp_path), "steps": 2},
                      checkpoint={"async_mode": "none"})
    run_ranks(train_dropout_gpt2, 1, cfg)
    path = ck.step_dir(tmp_path / "checkpoints", 2)
    own = f"{DropoutGPT2.__module__}.DropoutGPT2"
    assert ck.read_marker(path)[0][ck.MODEL_CLASS] == own

    with pytest.raises(ck.CheckpointError) as refused:
        weights.export(path, tmp_path / "export")
    assert f"holds a model of your own, {own}; export converts fsdp_trainer's Llama only" in str(refused.value)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(path), str(tmp_path / "model.pt"))  # the route the error gives
    DropoutGPT2().load_state_dict(torch.load(tmp_path / "model.pt")["model"])  # strict: every key, every shape

    llama = build(model_args_from_config(cfg.model))
    with pytest.raises(ck.CheckpointError) as misfit:
        weights.load_weights(llama, str(path), model_args_from_config(cfg.model), threads=0)
    assert f"It holds a model of your own, {own}. Build the model it was saved with." in str(misfit.value)
    assert "--model." not in str(misfit.value)
