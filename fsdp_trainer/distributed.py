"""Process group and device mesh set-up, and rank-aware logging: the same under `torchrun` and under a plain
`python -m`, where a one-rank group of its own lets FSDP2 and DCP run unchanged."""

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

logger = logging.getLogger("fsdp_trainer")

# How far the groups' own timeout trails the watchdog's, so that the watchdog reports first: the group's timeout
# ends a waiting rank without a word on the suspect.
BACKSTOP_S = 60


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
    """(RANK, WORLD_SIZE) as a launcher set them, or (0, 1) without one: a stray WORLD_SIZE must not size the job."""
    return (int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", 1))) if "RANK" in os.environ else (0, 1)


def cores_per_rank(ranks_on_node: Optional[int] = None) -> int:
    """This rank's share (at least 1) of the cores its CPU affinity allows, which Slurm and containers narrow, split
    among `ranks_on_node` ranks (default LOCAL_WORLD_SIZE)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // (ranks_on_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def copy_engines_can_all_gather(world_size: int) -> bool:
    """Whether NCCL can all-gather with the copy engines: every rank on this host, NCCL 2.28 or later, and its cuMem
    allocation, which symmetric memory needs, not turned off (NCCL_CUMEM_ENABLE=0, for older drivers)."""
    return (torch.cuda.is_available() and 1 < world_size == int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            and os.environ.get("NCCL_CUMEM_ENABLE") != "0" and torch.cuda.nccl.version() >= (2, 28))


def init(timeout_s: float = 600.0, cpu_collectives: bool = False, copy_engines: bool = False) -> DistInfo:
    """Start (or join) the default process group: NCCL with one GPU per rank, else gloo. `cpu_collectives` adds gloo
    beside NCCL (CPU offload's gradients); `copy_engines` sets NCCL_CTA_POLICY=2, NCCL's zero-CTA policy, if unset."""
    if copy_engines:
        os.environ.setdefault("NCCL_CTA_POLICY", "2")  # read when the communicator starts
    rank, world_size = launched_rank_and_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # Without a launcher: a one-rank group whose store binds a free port of the kernel's choosing, passed directly
    # rather than through os.environ, so that processes this one starts do not mistake themselves for its ranks.
    group_args = {} if "RANK" in os.environ else dict(init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    setup_logging(rank)
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"rank {rank}: LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPUs "
                               "are visible; start at most that many processes per node (--nproc_per_node)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"
        group_args["device_id"] = device  # binds the communicator now: a broken NCCL set-up fails here, not mid-step
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **group_args)
    return DistInfo(rank, world_size, local_rank, device, backend)


def build_mesh(device_type: str, dp_replicate: int, dp_shard: int) -> DeviceMesh:
    """A 1-D ("dp_shard",) mesh for FSDP, or 2-D ("dp_replicate", "dp_shard") for HSDP."""
    shape = {"dp_replicate": dp_replicate, "dp_shard": dp_shard} if dp_replicate > 1 else {"dp_shard": dp_shard}
    return init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))


def shutdown(abort: bool = False) -> None:
    """Tear down every process group; with `abort`, without waiting for the other ranks, which a failed rank leaves
    inside a collective it will never join (NCCL's graceful teardown would wait for their watchdogs)."""
    if dist.is_initialized() and abort:
        dist.distributed_c10d._abort_process_group()  # every group, NCCL's within one group call (no deadlock)
    elif dist.is_initialized():
        dist.destroy_process_group()
