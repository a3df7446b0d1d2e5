"""Failing fast and clearly: a progress watchdog that names the ranks that are behind, the flight recorder,
non-finite steps that are never applied, and out-of-memory reports.

A dead rank is noticed by torchrun, which stops the others within seconds. A *hung* rank is the hard case: the
others wait in their next collective for as long as its timeout. Every rank therefore runs a watchdog thread.
When its own step has not finished for `init_timeout_s` (until the first step is done, which includes
compilation) or `timeout_s` (afterwards), it writes to the c10d store (a TCP side channel that works while the
collectives do not) its last finished step and whether its main thread waits inside torch.distributed or is
busy elsewhere. Every stalled rank does the same at about the same time. It then reads the others' reports,
names the suspects, and exits the process. Nothing is written per step: the training loop pays nothing.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from fsdp_trainer.distributed import logger

EXIT_HANG = 3
REPORT = "fsdp_trainer/stalled/{}"


def enable_flight_recorder(output_dir: Path) -> None:
    """Ask NCCL's process groups (created after this call) to record their last collectives and dump them
    to <output_dir>/flight_recorder/rank_<r> on a timeout. Settings already in the environment win."""
    folder = output_dir.resolve() / "flight_recorder"
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(folder / "rank_"))


def _dump_flight_recorder(rank: int) -> Optional[str]:
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None) or \
        getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if not prefix or dump is None or not torch.cuda.is_available():
        return None
    try:
        path = f"{prefix}{rank}"
        with open(path, "wb") as f:
            f.write(dump())
        return path
    except Exception:  # noqa: BLE001 - the report below matters more than the dump
        return None


class Watchdog:
    """Ends this process when it makes no progress for the timeout, after saying which ranks are behind."""

    def __init__(self, rank: int, world_size: int, init_timeout_s: float, timeout_s: float):
        self.rank, self.world_size = rank, world_size
        self.init_timeout_s, self.timeout_s = init_timeout_s, timeout_s
        self.store = dist.distributed_c10d._get_default_store()
        self.step, self.timeout = 0, init_timeout_s
        self.last_progress = time.monotonic()
        self.paused_depth = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="fsdp_trainer-watchdog", daemon=True)
        self.thread.start()

    def beat(self, step: int) -> None:
        """Record that `step` finished. After the first one, switch to the steady-state timeout and make the
        process group's own timeout a backstop just behind it."""
        self.step, self.last_progress = step, time.monotonic()
        if self.timeout != self.timeout_s:
            self.timeout = self.timeout_s
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=self.timeout_s + 60))

    @contextmanager
    def paused(self):
        """For work that may legitimately take long without steps: checkpoint saves and loads."""
        self.paused_depth += 1
        try:
            yield
        finally:
            self.paused_depth -= 1
            self.last_progress = time.monotonic()

    def stop(self) -> None:
        self.stopped.set()

    def _watch(self) -> None:
        poll = min(5.0, self.timeout_s / 4)
        while not self.stopped.wait(poll):
            if self.paused_depth or time.monotonic() - self.last_progress < self.timeout:
                continue
            try:
                # Say where this rank is stuck, then give the other ranks' watchdogs time to say the same.
                self.store.set(REPORT.format(self.rank), json.dumps([self.step, *_main_thread_location()]))
                time.sleep(2 * poll)
                logger.error(self.report())
            finally:
                dumped = _dump_flight_recorder(self.rank)
                if dumped:
                    logger.error(f"rank {self.rank}: flight recorder trace written to {dumped}")
                for handler in logger.handlers:
                    handler.flush()
                os._exit(EXIT_HANG)

    def report(self) -> str:
        """Which ranks to suspect: behind the others, busy outside any collective, or silent."""
        waited = time.monotonic() - self.last_progress
        try:
            self.store.set_timeout(datetime.timedelta(seconds=5))
            reports = {}
            for r in range(self.world_size):
                key = REPORT.format(r)
                reports[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        except Exception as err:  # noqa: BLE001 - the store lives on rank 0's host; it may be gone too
            return (f"rank {self.rank}: no progress for {waited:.0f} s after step {self.step}, and the c10d store "
                    f"(on the rendezvous host) cannot be reached ({err}); the job's head node or rank 0 is down")
        high = max(report[0] for report in reports.values() if report)
        suspects = {}
        for r, report in reports.items():
            if report is None:
                suspects[r] = "sent no report: dead, or its host is unreachable"
            elif report[0] < high:
                suspects[r] = f"finished step {report[0]} while others finished step {high}"
            elif not report[1]:
                suspects[r] = f"busy outside any collective, at {report[2]}"
        if suspects:
            verdict = "suspect rank(s): " + "; ".join(f"{r} ({why})" for r, why in sorted(suspects.items()))
        else:
            verdict = (f"every rank finished step {high} and waits in a collective: a communication problem; run "
                       "`python -m fsdp_trainer.doctor` on these nodes")
        return (f"rank {self.rank}: no progress for {waited:.0f} s (timeout {self.timeout:.0f} s); {verdict}. "
                "If steps are legitimately this slow, raise dist.timeout_s.")


def _main_thread_location() -> tuple[bool, str]:
    """(waiting inside torch.distributed?, innermost frame) of this process's main thread."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    stack = traceback.extract_stack(frame) if frame else []
    if not stack:
        return False, "unknown"
    # Only what the training loop called counts (torchrun's error-recording wrapper sits above it).
    loop = max((i for i, f in enumerate(stack) if f.filename.endswith(f"fsdp_trainer{os.sep}train.py")), default=-1)
    in_collective = any(f"torch{os.sep}distributed" in f.filename for f in stack[loop + 1:])
    last = stack[-1]
    return in_collective, f"{last.name} ({Path(last.filename).name}:{last.lineno})"


class NonFiniteError(RuntimeError):
    pass


class NonFiniteGuard:
    """Skips optimizer updates whose global grad norm is not finite, without a host sync on GPU.

    Fused AdamW (CUDA) accepts a `found_inf` tensor and then leaves weights, moments and step count untouched,
    all on the device. Elsewhere the check is a plain `.item()`, which costs nothing extra on a CPU.
    The count of skipped steps and the first one's number are read on logging steps and before checkpoints."""

    def __init__(self, device: torch.device, mode: str, max_skipped: int, start_step: int = 0):
        self.mode, self.max_skipped, self.step_number = mode, max_skipped, start_step
        self.skipped = torch.zeros((), device=device, dtype=torch.int64)
        self.first_bad = torch.full((), -1, device=device, dtype=torch.int64)

    def step(self, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> None:
        """optimizer.step(), unless grad_norm is not finite."""
        self.step_number += 1
        bad = ~torch.isfinite(grad_norm)
        self.skipped += bad
        self.first_bad = torch.where(bad & (self.first_bad < 0), self.step_number, self.first_bad)
        if optimizer.defaults.get("fused"):
            optimizer.found_inf = bad.float()
            optimizer.step()
        elif not bad.item():
            optimizer.step()

    def check(self) -> int:
        """Raise if the configured limit is exceeded; return the number of skipped steps. A host sync."""
        skipped = int(self.skipped.item())
        if skipped and (self.mode == "stop" or skipped > self.max_skipped):
            first = int(self.first_bad.item())
            why = "train.on_nonfinite=stop" if self.mode == "stop" else \
                f"{skipped} steps skipped > train.max_skipped_steps={self.max_skipped}"
            raise NonFiniteError(
                f"non-finite loss or gradient norm at step {first} ({why}). No update from a non-finite step was "
                "applied and no checkpoint was written after it. Lower optim.lr, raise optim.warmup_steps, check "
                "the data around that step, or set train.on_nonfinite=skip to skip such steps.")
        return skipped


def describe_oom(err: BaseException, rank: int, device: torch.device, planned_bytes: Optional[int],
                 suggestion: Optional[str], snapshot_dir: Optional[Path]) -> str:
    """One message for a CUDA out-of-memory: where it happened, measured vs planned peak, and what to change."""
    frames = [f.name for f in traceback.extract_tb(err.__traceback__)]
    phase = "backward" if "backward" in frames else "optimizer step" if "step" in frames else "forward"
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    capacity = torch.cuda.get_device_properties(device).total_memory / 2**30
    parts = [f"rank {rank}: CUDA out of memory during {phase}; peak allocated {peak:.1f} GiB of {capacity:.1f} GiB"]
    if planned_bytes:
        parts.append(f"the memory plan predicted {planned_bytes / 2**30:.1f} GiB")
    if suggestion:
        parts.append(f"suggestion: {suggestion}")
    if snapshot_dir is not None:
        snapshot_dir.mkdir(parents=True, exist_ok=True)
        path = snapshot_dir / f"oom_snapshot_rank{rank}.pickle"
        with open(path, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        parts.append(f"memory snapshot (open in pytorch.org/memory_viz): {path}")
    return "; ".join(parts)
