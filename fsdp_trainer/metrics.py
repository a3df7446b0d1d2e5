"""Throughput, MFU and memory figures: one console line on rank 0 and TensorBoard scalars."""

import json
import platform
import re
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from fsdp_trainer.distributed import logger

# Dense bf16 (pre-Ampere: fp16) tensor-core FLOP/s with float32 accumulation, as training runs, by the datasheets.
# Matched as whole words of the device name, first match first: specific names precede their families.
PEAK_FLOPS = [("GH200", 989e12), ("H200 NVL", 835e12), ("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12),
              ("H100", 989e12), ("H800 PCIe", 756e12), ("H800", 989e12), ("H20", 148e12), ("B200", 2250e12),
              ("B100", 1750e12), ("A100", 312e12), ("A800", 312e12), ("A10G", 70e12), ("A10", 125e12),
              ("A6000", 155e12), ("A40", 150e12), ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12),
              ("RTX 6000 Ada", 364e12), ("4090", 165e12), ("3090", 71e12), ("V100S", 130e12), ("V100-PCIE", 112e12),
              ("V100", 125e12), ("T4", 65e12)]

GiB = 1024 ** 3


def peak_flops(device: torch.device | str) -> Optional[float]:
    """Peak FLOP/s of this GPU, or of the one CUDA names so; None on CPU or an unknown GPU: MFU is then not shown."""
    name = device if isinstance(device, str) else torch.cuda.get_device_name(device) if device.type == "cuda" else ""
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
    """Peak active and reserved GPU memory, and how often the allocator emptied its cache to retry (empty on CPU)."""
    stats = torch.cuda.memory_stats(device) if device.type == "cuda" else None
    return {} if stats is None else {"mem_active_gib": stats.get("active_bytes.all.peak", 0) / GiB,
            "mem_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / GiB,
            "alloc_retries": stats.get("num_alloc_retries", 0)}


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class PhaseTimer:
    """Where each step's time goes, without a host sync: a timestamp at every phase boundary, read on logging steps.
    On GPUs they are CUDA events, so waiting for data counts only where it left the GPU idle."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, Any]] = []  # (the phase that ends here, timestamp); "" starts a step
        self.steps = 0

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        (event := torch.cuda.Event(enable_timing=True)).record()
        return event

    def begin_step(self) -> None:
        self.lap("")
        self.steps += 1

    def lap(self, phase: str) -> None:
        """The phase that began at the previous mark ends now."""
        self.marks.append((phase, self._now()))

    def read(self) -> dict[str, float]:
        """Milliseconds per step in each phase since the last read (`<phase>_ms`); time between steps counts in none."""
        if self.cuda and self.marks:
            self.marks[-1][1].synchronize()
        totals: dict[str, float] = {}
        for (_, start), (phase, end) in zip(self.marks, self.marks[1:]):
            if phase:
                ms = start.elapsed_time(end) if self.cuda else 1e3 * (end - start)
                totals[f"{phase}_ms"] = totals.get(f"{phase}_ms", 0.0) + ms / self.steps
        self.marks, self.steps = [], 0
        return totals


class Metrics:
    """Turns (step, loss, grad norm, lr) on logging steps into rates, prints them and records them."""

    def __init__(self, *, device: torch.device, total_steps: int, tokens_per_step: int, world_size: int,
                 flops_per_token: int, output_dir: Path, tensorboard: bool, is_main: bool):
        self.device, self.total_steps, self.world_size, self.is_main = device, total_steps, world_size, is_main
        self.tokens_per_step, self.flops_per_token, self.peak = tokens_per_step, flops_per_token, peak_flops(device)
        self.tensorboard_dir = output_dir / "tb" if is_main and tensorboard else None
        self.writer, self.phases, self.warned_retries = None, PhaseTimer(device), False
        self.start(0)

    def start(self, step: int) -> None:
        """Begin timing at `step`: the step a run resumes from, once everything before the loop is done."""
        self.start_step = self.window_step = step
        self.start_time = self.window_time = time.perf_counter()
        # The ETA's pace is timed from the first logged window's end: that window pays one-off costs (compilation).
        self.pace: Optional[tuple[int, float]] = None

    def log(self, step: int, loss: float, grad_norm: float, lr: float, extra: Optional[dict] = None) -> dict:
        now = time.perf_counter()
        seconds = max(now - self.window_time, 1e-9)
        tokens_per_s_gpu = (step - self.window_step) * self.tokens_per_step / seconds / self.world_size
        self.window_step, self.window_time = step, now
        row = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens_per_s_per_gpu": tokens_per_s_gpu,
               "tflops_per_gpu": tokens_per_s_gpu * self.flops_per_token / 1e12}
        if self.peak:
            row["mfu"] = tokens_per_s_gpu * self.flops_per_token / self.peak
        memory = memory_gib(self.device)
        if memory.get("alloc_retries") and not self.warned_retries:  # every rank: it names the ones at their limit
            self.warned_retries = True
            logger.warning(f"by step {step} the CUDA caching allocator has run out {memory['alloc_retries']} times and "
                           "retried, stalling the GPU each time: `python -m fsdp_trainer.tools.plan` with the same "
                           "flags shows what this run needs and what to change")
        row.update(self._largest_over_ranks({**memory, **self.phases.read()}), **(extra or {}))
        pace_step, pace_time = self.pace or (self.start_step, self.start_time)
        self.pace = self.pace or (step, now)
        if self.is_main:
            eta = (now - pace_time) / (step - pace_step) * (self.total_steps - step) if step > pace_step else 0.0
            parts = [f"step {step}/{self.total_steps}", f"loss {loss:.4f}", f"lr {lr:.2e}", f"gnorm {grad_norm:.3f}",
                     f"{tokens_per_s_gpu:,.0f} tok/s/gpu", f"{row['tflops_per_gpu']:.1f} TFLOPs/gpu"]
            if "mfu" in row:
                parts.append(f"mfu {100 * row['mfu']:.1f}%")
            if "forward_backward_ms" in row:
                waited = f" (rank {row['data_rank']})" if "data_rank" in row else ""
                parts.append(f"ms/step data {row['data_ms']:.1f}{waited} fwd+bwd {row['forward_backward_ms']:.0f} "
                             f"optim {row['optimizer_ms']:.0f}")
            if "mem_active_gib" in row:
                parts.append(f"mem {row['mem_active_gib']:.1f}/{row['mem_reserved_gib']:.1f} GiB")
            parts.append(f"elapsed {_duration(now - self.start_time)} eta {_duration(eta)}")
            logger.info(" | ".join(parts))
            for key, value in row.items() if self.tensorboard_dir else ():
                self._tensorboard().add_scalar(f"train/{key}", value, step)
        return row

    def log_eval(self, step: int, row: dict) -> None:
        """Held-out results on the console and in TensorBoard (val/...); their time is left out of training's rate."""
        self.window_time += row["val/seconds"]
        if self.is_main:
            logger.info(f"step {step}/{self.total_steps} | {eval_line(row)}")
            for key, value in row.items() if self.tensorboard_dir else ():
                self._tensorboard().add_scalar(key, value, step)

    def _tensorboard(self):
        if self.writer is None:  # once `start` knows the step: purge_step drops a killed run's events after it
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(self.tensorboard_dir), purge_step=self.start_step + 1)
        return self.writer

    def _largest_over_ranks(self, local: dict[str, float]) -> dict[str, float]:
        """Each phase time and memory peak as the largest over the ranks, and `data_rank`, the rank that waited longest
        for data: its wait stalls the others in the next collective, where it would count as their forward/backward."""
        if self.world_size == 1 or not local:
            return local
        every: list = [None] * self.world_size
        dist.all_gather_object(every, local)
        largest = {key: max(ranks[key] for ranks in every) for key in local}
        if "data_ms" in local:
            largest["data_rank"] = max(range(self.world_size), key=lambda rank: every[rank]["data_ms"])
        return largest

    def close(self) -> None:
        if self.writer:
            self.writer.close()


def eval_line(row: dict) -> str:
    return (f"val/loss {row['val/loss']:.4f} | val/perplexity {row['val/perplexity']:.2f} | {row['val/tokens']:,} "
            f"tokens in {row['val/seconds']:.1f} s, {row['val/tokens_per_s_per_gpu']:,.0f} tok/s/gpu")


def write_run_info(output_dir: Path, config_toml: str, env: dict) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "config.toml").write_text(config_toml)
    (output_dir / "environment.json").write_text(json.dumps(env, indent=2) + "\n")
