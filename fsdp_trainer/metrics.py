"""Throughput, MFU and memory figures: one console line on rank 0 and TensorBoard scalars."""

from __future__ import annotations

import json
import platform
import re
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from fsdp_trainer.distributed import logger

# Dense bf16 (fp16 for pre-Ampere cards) tensor-core peak with float32 accumulation, as training runs, FLOP/s, by the
# vendors' datasheets (GeForce cards accumulate in float32 at half their float16-accumulate headline rate: the 4090's
# 165 here, not 330; its 82.6 is the CUDA cores' float32 rate, not the tensor cores').
# Matched as whole words of torch.cuda.get_device_name() ("A40" is not "RTX A4000"); the first match wins, so
# specific names come before their families.
PEAK_FLOPS = [
    ("GH200", 989e12), ("H200 NVL", 835e12), ("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12),
    ("H800 PCIe", 756e12), ("H800", 989e12), ("H20", 148e12), ("B200", 2250e12), ("B100", 1750e12),
    ("A100", 312e12), ("A800", 312e12), ("A10G", 70e12), ("A10", 125e12), ("A6000", 155e12), ("A40", 150e12),
    ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12), ("RTX 6000 Ada", 364e12), ("4090", 165e12),
    ("3090", 71e12), ("V100S", 130e12), ("V100-PCIE", 112e12), ("V100", 125e12), ("T4", 65e12),
]

GiB = 1024 ** 3


def peak_flops(device: torch.device) -> Optional[float]:
    """Peak FLOP/s of this GPU, or None (CPU, unknown GPU): MFU is then not shown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS if re.search(rf"\b{re.escape(key)}\b", name)), None)


def environment(device: torch.device, world_size: int, mesh_shape: tuple[int, ...]) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
           "world_size": world_size, "mesh": list(mesh_shape), "device": device.type}
    if device.type == "cuda":
        env.update(cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())),
                   gpu=torch.cuda.get_device_name(device),
                   gpu_memory_gib=round(torch.cuda.get_device_properties(device).total_memory / GiB, 1))
    return env


def memory_gib(device: torch.device) -> dict[str, float]:
    """Peak active and reserved GPU memory since the process started, and how often the allocator has emptied its
    cache to retry an allocation (empty on CPU)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {"mem_active_gib": stats.get("active_bytes.all.peak", 0) / GiB,
            "mem_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / GiB,
            "alloc_retries": stats.get("num_alloc_retries", 0)}


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class PhaseTimer:
    """Where each step's time goes, without a host sync: a timestamp at every phase boundary, read back on logging
    steps (which sync anyway). On GPUs the timestamps are CUDA events on the GPU's timeline, so waiting for data
    counts only where it left the GPU idle; on CPU they are the wall clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, Any]] = []  # (the phase that ends here, timestamp); "" starts a step
        self.steps = 0

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin_step(self) -> None:
        self.marks.append(("", self._now()))
        self.steps += 1

    def lap(self, phase: str) -> None:
        """The phase that began at the previous mark ends now."""
        self.marks.append((phase, self._now()))

    def read(self) -> dict[str, float]:
        """Milliseconds per step in each phase since the last read (`<phase>_ms`); the time between steps
        (logging, checkpoints) belongs to none."""
        if self.cuda and self.marks:
            self.marks[-1][1].synchronize()
        totals: dict[str, float] = {}
        for (_, start), (phase, end) in zip(self.marks, self.marks[1:]):
            if phase:
                totals[phase] = totals.get(phase, 0.0) + (start.elapsed_time(end) if self.cuda
                                                          else 1e3 * (end - start))
        result = {f"{phase}_ms": total / self.steps for phase, total in totals.items()}
        self.marks, self.steps = [], 0
        return result


class Metrics:
    """Turns (step, loss, grad norm, lr) on logging steps into rates, prints them and records them."""

    def __init__(self, *, device: torch.device, total_steps: int, tokens_per_step: int, world_size: int,
                 flops_per_token: int, output_dir: Path, tensorboard: bool, is_main: bool):
        self.device, self.total_steps, self.world_size = device, total_steps, world_size
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak = peak_flops(device)
        self.is_main = is_main
        self.tensorboard_dir = output_dir / "tb" if is_main and tensorboard else None
        self.writer = None
        self.phases = PhaseTimer(device)
        self.warned_retries = False
        self.start(0)

    def start(self, step: int) -> None:
        """Begin timing at `step`: the step a run resumes from, once everything before the loop is done."""
        self.start_step = self.window_step = step
        self.start_time = self.window_time = time.perf_counter()
        # The ETA's pace is timed from the end of the first logged window on: that window holds the one-off costs
        # (compilation, the first communicators, pinned staging buffers) that the steps left to run will not pay.
        self.pace_step: Optional[int] = None
        self.pace_time = 0.0

    def log(self, step: int, loss: float, grad_norm: float, lr: float, extra: Optional[dict] = None) -> dict:
        now = time.perf_counter()
        steps = step - self.window_step
        tokens_per_s_gpu = steps * self.tokens_per_step / max(now - self.window_time, 1e-9) / self.world_size
        self.window_step, self.window_time = step, now
        row = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens_per_s_per_gpu": tokens_per_s_gpu,
               "tflops_per_gpu": tokens_per_s_gpu * self.flops_per_token / 1e12}
        if self.peak:
            row["mfu"] = tokens_per_s_gpu * self.flops_per_token / self.peak
        memory = memory_gib(self.device)
        if memory.get("alloc_retries") and not self.warned_retries:  # every rank: it names the ones at their limit
            self.warned_retries = True
            logger.warning(f"by step {step} the CUDA caching allocator has run out {memory['alloc_retries']} times, "
                           f"emptied its cache and retried (reserved {memory['mem_reserved_gib']:.1f} GiB). Each retry "
                           "stalls the GPU: this run is at its memory limit. `python -m fsdp_trainer.tools.plan` with the "
                           "same flags shows what it needs and what to change")
        row.update(self._largest_over_ranks({**memory, **self.phases.read()}))
        row.update(extra or {})
        if self.pace_step is None:
            eta_steps, eta_time = step - self.start_step, now - self.start_time
            self.pace_step, self.pace_time = step, now
        else:
            eta_steps, eta_time = step - self.pace_step, now - self.pace_time
        if self.is_main:
            elapsed = now - self.start_time
            eta = eta_time / eta_steps * (self.total_steps - step) if eta_steps else 0.0
            parts = [f"step {step}/{self.total_steps}", f"loss {loss:.4f}", f"lr {lr:.2e}",
                     f"gnorm {grad_norm:.3f}", f"{tokens_per_s_gpu:,.0f} tok/s/gpu",
                     f"{row['tflops_per_gpu']:.1f} TFLOPs/gpu"]
            if "mfu" in row:
                parts.append(f"mfu {100 * row['mfu']:.1f}%")
            if "forward_backward_ms" in row:
                waited = f" (rank {row['data_rank']})" if "data_rank" in row else ""
                parts.append(f"ms/step data {row['data_ms']:.1f}{waited} fwd+bwd {row['forward_backward_ms']:.0f} "
                             f"optim {row['optimizer_ms']:.0f}")
            if "mem_active_gib" in row:
                parts.append(f"mem {row['mem_active_gib']:.1f}/{row['mem_reserved_gib']:.1f} GiB")
            parts.append(f"elapsed {_duration(elapsed)} eta {_duration(eta)}")
            logger.info(" | ".join(parts))
            if self.tensorboard_dir:
                if self.writer is None:
                    from torch.utils.tensorboard import SummaryWriter
                    # A resumed run redoes the steps after its checkpoint, whose events a killed run may have
                    # written: purge_step makes TensorBoard discard those, as metrics.jsonl drops their rows
                    # (train.start_rows_file). Opened here, not in __init__, since only `start` knows the step.
                    self.writer = SummaryWriter(str(self.tensorboard_dir), purge_step=self.start_step + 1)
                for key, value in row.items():
                    self.writer.add_scalar(f"train/{key}", value, step)
        return row

    def _largest_over_ranks(self, local: dict[str, float]) -> dict[str, float]:
        """Each of this rank's phase times and memory peaks as the largest over the ranks, and `data_rank`, the rank
        that waited longest for its data: a rank whose input is slow stalls the others in the step's next
        collective, where its wait would count as their forward and backward. One small all-gather, on logging
        steps only (they sync anyway)."""
        if self.world_size == 1 or not local:
            return local
        keys = sorted(local)
        mine = torch.tensor([local[k] for k in keys], dtype=torch.float64, device=self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine)
        every = torch.stack(gathered).cpu()
        largest = {k: type(local[k])(v) for k, v in zip(keys, every.max(dim=0).values.tolist())}  # counts stay int
        if "data_ms" in largest:
            largest["data_rank"] = int(every[:, keys.index("data_ms")].argmax())
        return largest

    def close(self) -> None:
        if self.writer:
            self.writer.close()


def write_run_info(output_dir: Path, config_toml: str, env: dict) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config.toml").write_text(config_toml)
    (output_dir / "environment.json").write_text(json.dumps(env, indent=2) + "\n")
