"""Process group and device mesh set-up, and rank-aware logging.

Works the same under `torchrun` (reads RANK/WORLD_SIZE/LOCAL_RANK) and under a plain `python -m`, where it
starts a one-rank group of its own so that FSDP2 and DCP run unchanged.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

logger = logging.getLogger("fsdp_trainer")

# How far the process groups' own timeout trails the watchdog's, for the watchdog to notice (up to a poll late), hear
# the other ranks and report first: the group's timeout ends a waiting rank (gloo raises, NCCL aborts) without a word
# on the suspect, and the report of the rank that times out next would call it dead.
BACKSTOP_S = 60
# Per torchrun restart: a restarted job must not read the reports or the alarm of the attempt before.
# Per torchrun restart: a restarted job must not read the reports or the alarm of the attempt before.
ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def spans(ranks: list[int]) -> str:
    """Ascending ranks as runs, "0-3, 5, 7-8": a job of thousands of ranks fits a line."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{first}-{last}" if last > first else str(first) for first, last in runs)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_logging(rank: int) -> None:
    """Rank 0 logs at INFO; other ranks only warnings and errors, each line prefixed with its rank."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank{rank}] %(asctime)s %(message)s", "%H:%M:%S"))
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False


def launched_rank_and_world_size() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) as a launcher set them, or (0, 1) without one (no RANK): a WORLD_SIZE left in the
    environment by something else would otherwise size a job of one process."""
    if "RANK" not in os.environ:
        return 0, 1
    return int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", 1))


def cores_per_rank(ranks_on_node: Optional[int] = None) -> int:
    """This rank's share of the cores the process may run on (its CPU affinity, which Slurm and container runtimes
    narrow), split evenly among the node's ranks (`ranks_on_node`, else LOCAL_WORLD_SIZE); at least 1. With
    ranks_on_node=1, all of them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // (ranks_on_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def copy_engines_can_all_gather(world_size: int) -> bool:
    """Whether NCCL can run FSDP2's all-gathers on the copy engines (parallel.copy_engine_all_gather): every rank on
    this host, whose GPUs the engines copy between, NCCL 2.28 or later, whose zero-CTA policy uses them, and its
    cuMem allocation, which its symmetric memory needs, not turned off (NCCL_CUMEM_ENABLE=0, for older drivers)."""
    return (torch.cuda.is_available() and 1 < world_size == int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            and os.environ.get("NCCL_CUMEM_ENABLE") != "0" and torch.cuda.nccl.version() >= (2, 28))


def init(timeout_s: float = 600.0, cpu_collectives: bool = False, copy_engines: bool = False) -> DistInfo:
    """Start (or join) the default process group: NCCL with one GPU per rank, else gloo on CPU.

    `cpu_collectives` adds gloo for CPU tensors beside NCCL (FSDP's CPU offload keeps the gradients in host memory,
    and the global gradient norm is all-reduced there). `copy_engines` sets NCCL_CTA_POLICY=2, unless the
    environment sets it, before the communicator starts (it reads it then): NCCL's zero-CTA policy, under which it
    all-gathers into symmetric memory with the copy engines (parallel.copy_engine_all_gather)."""
    if copy_engines:
        os.environ.setdefault("NCCL_CTA_POLICY", "2")
    under_launcher = "RANK" in os.environ
    rank, world_size = launched_rank_and_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # Without a launcher: a one-rank group whose store binds port 0, a free port of the kernel's choosing that no
    # other process can take first. Passed directly rather than through os.environ, so that processes this one
    # starts do not mistake themselves for ranks of it.
    group_args = {} if under_launcher else dict(init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    setup_logging(rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"rank {rank}: LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs "
                               "are visible; start at most that many processes per node (--nproc_per_node)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # device_id binds the communicator to this GPU eagerly, so a broken NCCL set-up fails here, not mid-step.
        backend = "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=timeout, device_id=device, **group_args)
    else:
        device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timeout, **group_args)
        backend = "gloo"
    return DistInfo(rank, world_size, local_rank, device, backend)


def build_mesh(device_type: str, dp_replicate: int, dp_shard: int) -> DeviceMesh:
    """A 1-D ("dp_shard",) mesh for FSDP, or 2-D ("dp_replicate", "dp_shard") for HSDP."""
    if dp_replicate == 1:
        return init_device_mesh(device_type, (dp_shard,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(device_type, (dp_replicate, dp_shard), mesh_dim_names=("dp_replicate", "dp_shard"))


def shutdown(abort: bool = False) -> None:
    """Tear down every process group: gracefully, or, with `abort`, without waiting for the other ranks. A rank
    that fails leaves them inside a collective it will never join, and NCCL's graceful teardown would wait for
    them until their watchdogs fire; aborted, it exits now, and torchrun stops the job naming this rank."""
    if not dist.is_initialized():
        return
    if abort:
        dist.distributed_c10d._abort_process_group()  # every group, NCCL's within one group call (no deadlock)
    else:
        dist.destroy_process_group()
