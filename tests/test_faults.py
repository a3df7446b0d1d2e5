"""Fault injection on real gloo groups: a hung or crashed rank ends the job quickly, naming the rank; a
non-finite step is never applied and never checkpointed."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from helpers import TINY_FLAGS, free_port

WORKER = Path(__file__).with_name("fault_worker.py")
TINY = [*TINY_FLAGS, "--data.source", "synthetic"]


def launch(fault: str, rank: str, step: int, tmp_path: Path, *flags: str, nproc: int = 2, timeout: float = 180):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           str(WORKER), fault, rank, str(step), "--", *TINY, "--train.output_dir", str(tmp_path), *flags]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def test_a_hung_rank_ends_the_job_within_the_timeout_naming_it(tmp_path):
    proc, elapsed = launch("hang", "1", 3, tmp_path, "--train.steps", "6", "--dist.timeout_s", "5",
                           "--checkpoint.interval", "0", "--checkpoint.no_save_final")
    assert proc.returncode != 0
    assert "suspect rank(s): 1 (busy outside any collective, at faulty_step (fault_worker.py" in proc.stderr, \
        proc.stderr[-3000:]
    assert elapsed < 60, elapsed  # 5 s timeout + start-up + torchrun tear-down, not the 10-minute default


def test_a_crashed_rank_ends_the_job_naming_it_with_its_traceback(tmp_path):
    proc, elapsed = launch("crash", "1", 3, tmp_path, "--train.steps", "6", "--checkpoint.interval", "0",
                           "--checkpoint.no_save_final")
    assert proc.returncode != 0
    assert "injected crash" in proc.stderr
    assert "rank      : 1" in proc.stderr  # torchrun's root-cause summary, from the error file
    assert elapsed < 60, elapsed


def test_a_crash_on_every_rank_ends_the_job_with_loader_workers_running(tmp_path):
    # The workers ignore SIGTERM so that a preempted rank can checkpoint; they must not keep a failed rank alive.
    proc, elapsed = launch("crash", "all", 3, tmp_path, "--train.steps", "6", "--checkpoint.interval", "0",
                           "--checkpoint.no_save_final", "--data.num_workers", "2", timeout=120)
    assert proc.returncode != 0
    assert "injected crash" in proc.stderr
    assert elapsed < 60, elapsed


def test_nonfinite_step_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    proc, _ = launch("nan", "all", 5, tmp_path, "--train.steps", "8", "--checkpoint.interval", "2",
                     "--checkpoint.async_mode", "none")
    assert proc.returncode != 0
    assert "non-finite loss or gradient norm at step 5" in proc.stderr, proc.stderr[-3000:]
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved[-1] == "step_00000004"  # nothing written after the bad step
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["grad_norm"])) for r in rows if r["step"] < 5)


def test_skip_mode_skips_nonfinite_steps_and_finishes_with_finite_weights(tmp_path):
    proc, _ = launch("nan", "0", 3, tmp_path, "--train.steps", "6", "--train.on_nonfinite", "skip",
                     "--checkpoint.interval", "0", "--checkpoint.async_mode", "none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["skipped_steps"] == 1
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if r["step"] != 3)
