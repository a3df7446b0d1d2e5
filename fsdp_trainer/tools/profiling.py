"""`--profile.steps a:b`: a torch.profiler trace of those steps, an optional memory snapshot, and a breakdown of
where the GPU time went (matmuls, attention, communication and how much of it was exposed, optimizer, idle).

The trace opens in Perfetto (ui.perfetto.dev) or TensorBoard; the snapshot in pytorch.org/memory_viz.
"""

from __future__ import annotations

import bisect
import json
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable, Optional

import torch

from fsdp_trainer.config import parse_steps
from fsdp_trainer.distributed import logger
from fsdp_trainer.tools.faults import WRITING_PROFILE

# GPU kernel name fragments per category; the first category that matches wins.
CATEGORIES = {
    "communication": ("nccl", "allgather", "reducescatter", "allreduce"),
    "attention": ("flash", "fmha", "cudnn", "attention", "sdpa"),
    "matmul": ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "wgmma"),
}
# The training step's record_function range around clipping, the optimizer step and zero_grad. Its kernels are told
# apart by when they run, not by name: FSDP2's all-gather copy-in and copy-out are foreach kernels too. The trace
# gives a kernel only to its innermost range, so torch's own "Optimizer.step#AdamW.step" (and zero_grad) count too.
OPTIMIZER_RANGE = "optimizer"
OPTIMIZER_RANGES = (OPTIMIZER_RANGE, "Optimizer.")


# Inductor's fused pointwise and reduction kernels, named after every op they absorbed: RoPE fused into the
# attention's input and gradient casts reads "..._scaled_dot_product_cudnn_attention_..." but is elementwise work.
FUSED_ELEMENTWISE = ("triton_poi_", "triton_red_", "triton_per_")


def category(kernel_name: str) -> str:
    name = kernel_name.lower()
    if name.startswith(FUSED_ELEMENTWISE):
        return "other"
    return next((cat for cat, keys in CATEGORIES.items() if any(k in name for k in keys)), "other")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _subtract(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Total length of `spans` (disjoint, sorted) not covered by `cover` (disjoint, sorted)."""
    exposed, j = 0.0, 0
    for start, end in spans:
        cursor = start
        while j < len(cover) and cover[j][1] <= cursor:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < end:
            if cover[k][0] > cursor:
                exposed += cover[k][0] - cursor
            cursor = max(cursor, cover[k][1])
            k += 1
        exposed += max(0.0, end - cursor)
    return exposed


def breakdown(trace: dict) -> dict[str, float]:
    """Milliseconds of GPU time per category over the trace's kernels, plus `exposed_communication`
    (communication running while no compute kernel runs) and `idle` (no kernel at all). A kernel that starts
    inside the GPU-side span of the `optimizer` range counts as optimizer, unless it is communication."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        return {}
    optimizer = _union([(e["ts"], e["ts"] + e["dur"]) for e in events
                        if e.get("cat") == "gpu_user_annotation" and e.get("name", "").startswith(OPTIMIZER_RANGES)])
    starts = [start for start, _ in optimizer]
    spans: dict[str, list[tuple[float, float]]] = {}
    for event in kernels:
        cat = category(event["name"])
        i = bisect.bisect_right(starts, event["ts"]) - 1
        if cat != "communication" and i >= 0 and event["ts"] < optimizer[i][1]:
            cat = "optimizer"
        spans.setdefault(cat, []).append((event["ts"], event["ts"] + event["dur"]))
    result = {cat: _length(_union(s)) / 1e3 for cat, s in spans.items()}
    compute = _union([iv for cat, s in spans.items() if cat != "communication" for iv in s])
    comm = _union(spans.get("communication", []))
    result["exposed_communication"] = _subtract(comm, compute) / 1e3
    busy = _union([iv for s in spans.values() for iv in s])
    result["wall"] = (busy[-1][1] - busy[0][0]) / 1e3
    result["idle"] = result["wall"] - _length(busy) / 1e3
    return result


class StepProfiler:
    """Call `before(step)` and `after(step)` around each training step; records steps first..last.
    `history_on`: the allocator's history is recorded for the whole run already (memory.oom_snapshot), and stays
    on after the snapshot."""

    def __init__(self, spec: Optional[str], memory_snapshot: bool, output_dir: Path, rank: int,
                 device: torch.device, history_on: bool = False):
        self.range = parse_steps(spec) if spec else None
        self.memory_snapshot = memory_snapshot and device.type == "cuda"
        self.history_on = history_on
        self.dir, self.rank, self.device = output_dir / "profile", rank, device
        self.profiler = None

    def start(self, first_step: int) -> None:
        """Say so if the run begins past the window (a resume): then nothing would be profiled."""
        if self.range is not None and first_step > self.range[0]:
            logger.warning(f"profile.steps={self.range[0]}:{self.range[1]} starts before this run's first step, "
                           f"{first_step}: nothing is profiled; give steps from {first_step} on")

    def close(self) -> None:
        """Stop a recording that the run's end or a failure cut short, keeping nothing of it."""
        if self.profiler is not None:
            self.profiler.stop()
            self._release()

    def _write(self) -> Path:
        """Write the stopped recording's trace (and the memory snapshot), and return the trace's path."""
        self.dir.mkdir(parents=True, exist_ok=True)
        first, last = self.range
        path = self.dir / f"trace_rank{self.rank}_steps{first}-{last}.json"
        self.profiler.export_chrome_trace(str(path))
        if self.memory_snapshot:
            torch.cuda.memory._dump_snapshot(str(self.dir / f"memory_rank{self.rank}_steps{first}-{last}.pickle"))
        self._release()
        return path

    def _release(self) -> None:
        """Forget the stopped profiler, and stop the allocator's history if it was started for it."""
        self.profiler = None
        if self.memory_snapshot and not self.history_on:
            torch.cuda.memory._record_memory_history(enabled=None)

    def before(self, step: int) -> None:
        if self.range is None or step != self.range[0]:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            # The earlier steps' kernels still queued would land in the trace and in its per-step breakdown.
            torch.cuda.synchronize(self.device)
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            if self.memory_snapshot and not self.history_on:
                torch.cuda.memory._record_memory_history(max_entries=200_000)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.start()

    def after(self, step: int, paused: Callable[[str], AbstractContextManager]) -> None:
        """At the window's end: write the trace (and snapshot) and log the breakdown, inside `paused`
        (Watchdog.paused: writing a long window's trace can take longer than a step timeout)."""
        if self.profiler is None or step != self.range[1]:
            return
        # The sync waits for the profiled steps' collectives: outside the pause, so that a peer hung in them is
        # still caught by this rank's watchdog, and this rank is not the one reported as writing.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.profiler.stop()
        with paused(WRITING_PROFILE):
            path = self._write()
            parts = breakdown(json.loads(path.read_text()))
        first, last = self.range
        steps = last - first + 1
        summary = " | ".join(f"{k} {v / steps:.1f} ms" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
        logger.info(f"profile of steps {first}-{last} written to {path}" +
                    (f"; per step: {summary}" if summary else ""))
