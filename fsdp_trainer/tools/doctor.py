"""Is this node (or cluster) fit to train? Environment, collective correctness and bandwidth, each step on a deadline.

    python -m fsdp_trainer.tools.doctor                                   # one process: environment and a 1-rank group
    torchrun --nproc_per_node=8 -m fsdp_trainer.tools.doctor              # one node, every GPU
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \\
        -m fsdp_trainer.tools.doctor                                      # two nodes: run this on each
    torchrun --nproc_per_node=8 -m fsdp_trainer.tools.doctor --json > doctor.json   # the text report goes to stderr;
                                                                    # the JSON is the file's last JSON line
    python -m fsdp_trainer.tools.doctor --try-fixes --nproc 8             # a check failed: find the setting that fixes it
    NCCL_DEBUG=INFO torchrun --nproc_per_node=8 -m fsdp_trainer.tools.doctor --sizes 0   # which transport NCCL picked

What it does, in order; the exit status is 0 only if every step passed:
1. Environment: torch/CUDA/NCCL versions; per rank its host, pid and GPU (memory, compute capability, bf16);
   per host /dev/shm (a warning under 1 GiB: Docker's 64 MB default breaks NCCL's shared-memory transport),
   memory and network interfaces; every NCCL_*, TORCH_*, GLOO_* and CUDA_VISIBLE_DEVICES variable, explained;
   `nvidia-smi topo -m`. Gathered through the c10d store, so it prints even when the collectives are broken.
2. Checks: all_reduce, all_gather, reduce_scatter, broadcast (from rank 0) and a send/recv ring, on the group's
   device (NCCL on GPU, gloo on CPU), at a small and a large message size (NCCL switches protocol between them).
   On several nodes a second ring sends from each rank to the same local rank of the next node: the first ring
   leaves a node from one GPU only, so it would not see a dead network card of any other.
   Every rank contributes distinct small integers, so every element of every result has an exact expected value.
3. Bandwidth: all_reduce, all_gather and reduce_scatter over --sizes (powers of 4), the mean time of --iters runs
   back to back (CUDA events on GPU), as nccl-tests times them. algbw = size / time and busbw as nccl-tests
   defines them (size is the full, unsharded buffer), so the table compares with
   `all_reduce_perf -b 1K -e 1G -f 4`. Skipped once a check has failed.

How a hang is caught: before each step a rank writes an arrival key to the c10d store, before each collective
an entry key (removed once the collective's result is in), and after the step a done key (the store is a TCP side
channel, so it works while the collectives do not). A watchdog timer per step fires after --deadline-s: rank 0
then reads the keys and names the suspects: ranks that never arrived (with the last step they did reach), ranks
that arrived but never entered the collective the others wait in (stuck in their own work: their GPU or host,
before a step's first collective or between two), and ranks that left the step with an error (out of memory, say),
for which the others are still waiting inside the collective. Where every rank is stuck inside the send/recv
ring, each rank's completed receives name the links that never delivered, within a host or between hosts (a link
that one of its ends never took up, waiting on its other link, is said to be untried, not named). Rank 0 prints
the report and leaves with os._exit(1), because a rank blocked in a collective cannot shut down cleanly.
The other ranks wait for that report before they exit, since torchrun kills every rank as soon as one fails.

--try-fixes (single node only; run it as a plain process, it starts the groups itself): runs the doctor in a
fresh group of --nproc ranks; if that fails, again with each candidate setting until one passes, cheapest first:
NCCL_NVLS_ENABLE=0, NCCL_SHM_DISABLE=1, NCCL_IB_DISABLE=1, NCCL_SOCKET_IFNAME=<each interface>, NCCL_P2P_DISABLE=1
(on CPU: GLOO_SOCKET_IFNAME=<each interface>). Loopback and container or VM bridges (docker0, veth*, virbr*) are
not tried: they pass on one node, and fail the first run that spans nodes.

Fault injection, for the tests: FSDP_TRAINER_DOCTOR_FAULT=hang:rank=1 makes rank 1 block before its first
collective check; wrong:rank=1 makes rank 1 add 1 to everything it contributes; raise:rank=1 makes rank 1 raise
where it would contribute to its first check (as out of memory would), leaving the others inside the collective;
stall:rank=1 makes rank 1 block there instead, after it arrived and before the collective (as on a GPU that
wedged mid-run); stall_between:rank=1 makes rank 1 block after its first check's first size, before the second
size's collective (as in host work between two collectives); drop:rank=1 makes rank 1's ring sends never complete,
as over a dead link; drop_remote:rank=1 only those to another node, as over a dead network card; wedge:rank=1 makes
rank 1's queries of its own GPU never return, as in a wedged driver.
"""

from __future__ import annotations

import io
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
import tyro

from fsdp_trainer import distributed
from fsdp_trainer.distributed import logger

# torch 2.13 renamed these two (the old names warn); torch < 2.13 has only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

GiB = 2**30
FAULT_VAR = "FSDP_TRAINER_DOCTOR_FAULT"
# Each described in the docstring.
FAULTS = ("hang", "wrong", "raise", "stall", "stall_between", "drop", "drop_remote", "wedge")

KNOWN_VARIABLES = {
    "NCCL_DEBUG": "NCCL log level; INFO prints the transport chosen for each peer (P2P, SHM, NET) at start-up",
    "NCCL_DEBUG_SUBSYS": "which NCCL subsystems log (e.g. INIT,P2P,SHM,NET)",
    "NCCL_SOCKET_IFNAME": "network interface(s) NCCL uses for bootstrap and its TCP transport",
    "NCCL_IB_DISABLE": "1: no InfiniBand/RoCE; NCCL falls back to TCP sockets between nodes",
    "NCCL_IB_HCA": "which InfiniBand adapters (and ports) NCCL may use",
    "NCCL_P2P_DISABLE": "1: no direct GPU-to-GPU transport (NVLink/PCIe); data goes through host memory",
    "NCCL_P2P_LEVEL": "the furthest topology distance at which NCCL still uses GPU peer-to-peer",
    "NCCL_SHM_DISABLE": "1: no shared-memory (/dev/shm) transport between processes on one host",
    "NCCL_NVLS_ENABLE": "NVLink SHARP (multicast) collectives on NVSwitch systems; 0 disables them",
    "NCCL_NET_GDR_LEVEL": "when the NIC may read/write GPU memory directly (GPUDirect RDMA)",
    "NCCL_ALGO": "forces the collective algorithm (Ring, Tree, NVLS, ...); for experiments only",
    "NCCL_PROTO": "forces the protocol (LL, LL128, Simple); for experiments only",
    "NCCL_CUMEM_ENABLE": "cuMem-based buffer allocation; 0 falls back to cudaMalloc (older drivers, containers) "
                         "and turns off the trainer's copy-engine all-gathers, which need NCCL symmetric memory",
    "NCCL_CTA_POLICY": "how many SMs NCCL's kernels may take; 2 (zero-CTA) lets the copy engines do all-gathers "
                       "into symmetric memory (the trainer sets it on one host: parallel.copy_engine_all_gather)",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "what the NCCL watchdog does when a collective fails or times out (0: "
                                       "nothing, 1: abort and exit, 2: abort and raise, 3 (default): exit)",
    "TORCH_NCCL_BLOCKING_WAIT": "1: wait() blocks the CPU and raises on timeout instead of the watchdog aborting",
    "TORCH_FR_BUFFER_SIZE": "flight-recorder entries kept per rank (0: off); needed for hang dumps (the trainer "
                            "sets it)",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "the older, deprecated name of TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1: dump the flight recorder on a timeout (needs TORCH_FR_BUFFER_SIZE>0)",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "path prefix of the flight-recorder dumps",
    "TORCH_FR_DUMP_TEMP_FILE": "path prefix of the flight-recorder dumps (the newer name of "
                               "TORCH_NCCL_DEBUG_INFO_TEMP_FILE; the trainer sets it)",
    "TORCH_NCCL_ENABLE_MONITORING": "1: a heartbeat monitor kills a process whose watchdog is itself stuck",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "how long the heartbeat monitor waits for a stuck watchdog",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1: symmetric memory without NVLink multicast (where it is unavailable)",
    "TORCH_DISTRIBUTED_DEBUG": "DETAIL: check collective shapes/order across ranks (slow; for debugging only)",
    "TORCH_CPP_LOG_LEVEL": "c10d's own log level (INFO shows process-group set-up)",
    "GLOO_SOCKET_IFNAME": "network interface gloo uses",
    "CUDA_VISIBLE_DEVICES": "the GPUs this process sees, in this order",
}


@dataclass
class DoctorArgs:
    json: bool = False
    """Print one JSON object on stdout (rank 0): environment, checks, bandwidth. The text report goes to stderr."""
    deadline_s: float = 60.0
    """Seconds a step (one check, one bandwidth size) may take before the doctor names the late ranks and exits 1."""
    sizes: str = "auto"
    """Bandwidth sizes, powers of 4: "1K..1G", a top ("64M" = 1K..64M) or "0"; auto: 1K..1G on GPU, 1K..16M on CPU."""
    iters: int = 20
    """Runs per bandwidth size, timed back to back after 3 warm-up runs; the table shows their mean."""
    try_fixes: bool = False
    """Single node, plain process only (not torchrun): rerun in fresh groups, then with each fix until one passes."""
    nproc: int = 0
    """Ranks per group for --try-fixes (0: every visible GPU, or 2 on CPU)."""


def parse_sizes(spec: str) -> list[int]:
    """ "1K..1G" -> [1K, 4K, ..., 1G]; "64M" -> 1K..64M; "0" -> []. Units are binary (K = KiB). Anything else
    raises ValueError: a size under 1 byte or a range that runs backwards would silently measure nothing."""

    def nbytes(text: str) -> int:
        size = text.strip().upper().removesuffix("B").removesuffix("I")
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        try:
            value = float(size.rstrip("KMG")) * scale
        except ValueError:
            value = float("nan")
        if not 1 <= value < float("inf"):  # nan fails this too
            raise ValueError(f"{text.strip()} is not a size of 1 byte or more")
        return int(value)

    if spec.strip() == "0":
        return []
    low, dots, high = spec.partition("..")
    high = nbytes(high if dots else low)
    low = nbytes(low) if dots else min(1024, high)
    if low > high:
        raise ValueError("the range runs backwards")
    sizes = []
    while low <= high:
        sizes.append(low)
        low *= 4
    return sizes


def _bandwidth_sizes(spec: str) -> list[int]:
    """--sizes in bytes; "auto" is 1K..1G on GPU and 1K..16M on CPU. ValueError names the flag and its forms."""
    try:
        return parse_sizes(("1K..1G" if torch.cuda.is_available() else "1K..16M") if spec == "auto" else spec)
    except ValueError as err:
        raise ValueError(f"--sizes {spec}: {err}; expected sizes of 1 byte or more: a range (1K..1G), a top (64M, "
                         "for 1K..64M), or 0 to measure no bandwidth") from None


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw: the fraction of the buffer each rank's link carries, comparable across n."""
    return (2 * (n - 1) / n) if op == "all_reduce" else (n - 1) / n


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if round(n, 1) < 1024 or unit == "GiB":  # sizes rounded down to n shards read as the size asked for
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024


def _pattern(rank: int, count: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    """What `rank` contributes: small integers, so sums over even thousands of ranks are exact in float32."""
    return (torch.arange(offset, offset + count, device=device) % 251 + rank).float()


def _sum_of_patterns(n: int, count: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    return (torch.arange(offset, offset + count, device=device) % 251 * n + n * (n - 1) // 2).float()


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> Optional[str]:
    bad = (got != want).nonzero().flatten()
    if bad.numel() == 0:
        return None
    i = int(bad[0])
    return f"{bad.numel()} of {got.numel()} elements wrong, first [{i}] = {got[i]:g}, expected {want[i]:g}"


def _available_memory_bytes(meminfo: str = "/proc/meminfo") -> int:
    """What can be allocated without swapping: Linux's MemAvailable, which counts the page cache it can drop. Free
    memory alone (sysconf's AVPHYS_PAGES, the fallback) is near zero on a node that has read its data or checkpoints,
    and would misstate the room for a checkpoint's pinned staging."""
    try:
        with open(meminfo) as lines:
            for line in lines:
                name, _, value = line.partition(":")
                if name == "MemAvailable":
                    return int(value.split()[0]) * 1024  # in kB
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _rank_facts(info: distributed.DistInfo) -> dict:
    facts = {"rank": info.rank, "host": socket.gethostname(), "pid": os.getpid(), "device": str(info.device),
             "interfaces": [name for _, name in socket.if_nameindex()],
             "variables": {k: v for k, v in sorted(os.environ.items())
                           if k.startswith(("NCCL_", "TORCH_", "GLOO_")) or k == "CUDA_VISIBLE_DEVICES"},
             "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
             "memory_available_bytes": _available_memory_bytes()}
    try:
        shm = os.statvfs("/dev/shm")
        facts["shm_bytes"], facts["shm_free_bytes"] = shm.f_blocks * shm.f_frsize, shm.f_bavail * shm.f_frsize
    except OSError:
        facts["shm_bytes"] = facts["shm_free_bytes"] = None
    if info.device.type == "cuda":
        p = torch.cuda.get_device_properties(info.device)
        facts["gpu"] = {"name": p.name, "memory_gib": round(p.total_memory / GiB, 1),
                        "capability": f"{p.major}.{p.minor}", "bf16": torch.cuda.is_bf16_supported()}
    return facts


def _topology(timeout_s: float) -> Optional[str]:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        done = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=timeout_s)
        return re.sub(r"\x1b\[[0-9;]*m", "", done.stdout or done.stderr).rstrip()  # it underlines the header
    except subprocess.TimeoutExpired:
        return f"nvidia-smi topo -m did not answer within {timeout_s:g} s (a wedged driver or GPU?)"


def _per_host(ranks: list[dict]) -> dict[str, dict]:
    """The facts of each host's lowest rank: /dev/shm, memory and interfaces are the same for its other ranks."""
    hosts = {}
    for f in ranks:
        hosts.setdefault(f["host"], f)
    return hosts


def _environment_warnings(ranks: list[dict]) -> list[str]:
    warnings = []
    for host, f in _per_host(ranks).items():
        if f["shm_bytes"] is None:
            warnings.append(f"{host}: no /dev/shm; NCCL's shared-memory transport cannot work (NCCL_SHM_DISABLE=1)")
        elif f["shm_bytes"] < GiB:
            warnings.append(f"{host}: /dev/shm is only {_fmt_bytes(f['shm_bytes'])}, under 1 GiB (Docker's default "
                            "is 64 MB); NCCL's shared-memory transport fails or hangs with it. Restart the container with "
                            "--shm-size=16g (or --ipc=host), or set NCCL_SHM_DISABLE=1")

    def settings(f: dict) -> dict:  # CUDA_VISIBLE_DEVICES may differ per rank by design (e.g. under SLURM)
        return {k: v for k, v in f["variables"].items() if k != "CUDA_VISIBLE_DEVICES"}

    differ = [f["rank"] for f in ranks if settings(f) != settings(ranks[0])]
    if differ:
        warnings.append(f"rank(s) {_ranks(differ)} see different NCCL_/TORCH_/GLOO_ variables than rank 0; "
                        "set them the same on every node")
    if len({f.get("gpu", {}).get("name") for f in ranks}) > 1:
        warnings.append("ranks run on different GPU models; the slowest sets the pace of every collective")
    return warnings


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in ranks)


# Loopback and the bridges and veth pairs of containers and VMs reach this host only: a socket setting that passes
# on them in a one-node run is wrong advice for a run that spans nodes.
_HOST_ONLY_INTERFACE = re.compile(r"lo|docker\d+|veth.*|virbr.*|br-.*|cni\d+|ifb\d+")


def _network_interfaces() -> list[str]:
    """This host's interfaces that may reach other hosts: the ones worth pinning NCCL or gloo to."""
    return [name for _, name in socket.if_nameindex() if not _HOST_ONLY_INTERFACE.fullmatch(name)]


def _hints(report: dict) -> list[str]:
    """Settings to try for a failed or hung step, most telling first. Runs on rank 0, so its host is this one.
    None of the transport's where every failure is a timeout with suspects (ranks that never arrived, never entered
    the collective, or raised): the others merely waited for them, and the transport is not in question."""
    env = report["environment"]
    ifaces = ", ".join(_network_interfaces()) or "none but loopback and bridges"
    hints = [w for w in env.get("warnings", []) if "/dev/shm" in w]
    failed = [c for c in report["checks"] if not c["ok"]]
    if failed and all(c.get("timed_out") and c.get("suspects") for c in failed):
        return hints
    if env.get("backend") == "nccl":
        hints += [
            "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,SHM,NET: shows the transport each pair of ranks uses",
            "NCCL_SHM_DISABLE=1: rules out the shared-memory transport (small /dev/shm, containers)",
            "NCCL_P2P_DISABLE=1: rules out GPU peer-to-peer (PCIe ACS/IOMMU, virtualised GPUs); costs bandwidth",
            "NCCL_NVLS_ENABLE=0: rules out NVLink SHARP on NVSwitch systems (fabric manager / IMEX not running)",
            "NCCL_IB_DISABLE=1: rules out InfiniBand/RoCE between nodes (falls back to TCP)",
            f"NCCL_SOCKET_IFNAME=<iface>: pins the interface NCCL uses; rank 0's host has: {ifaces}",
        ]
    else:
        hints.append(f"GLOO_SOCKET_IFNAME=<iface>: pins the interface gloo uses; rank 0's host has: {ifaces}")
    hints.append("python -m fsdp_trainer.tools.doctor --try-fixes --nproc N: tries these one at a time on this node")
    already = {f"{k}={v}" for k, v in os.environ.items()}
    return [h for h in hints if h.split(":")[0] not in already]  # no advice to set what is set already


def _receives_first(rank: int, stride: int) -> bool:
    """Whether `rank` receives before it sends in the ring of `stride` (see Doctor._ring)."""
    return (rank // stride) % 2 == 1


def _ring_key(what: str, count: int, stride: int, rank: int) -> str:
    """The store key that says `rank`'s send or receive ("sent", "received") of `count` in that ring is done."""
    return f"doctor/ring/{stride}/{count}/{what}/{rank}"


def _link_verdict(links: list[list[int]], facts: dict[int, dict], nccl: bool) -> str:
    """Which transport the links that never delivered use. NCCL moves data within a host by GPU peer-to-peer or
    shared memory and between hosts over the network, so the kind of link that hangs tells which one is broken."""
    host = {r: f["host"] for r, f in facts.items()}
    within = [(p, r) for p, r in links if host[p] == host[r]]
    between = [(p, r) for p, r in links if host[p] != host[r]]
    text = "no data arrived over " + ", ".join([f"{p} -> {r} (within {host[r]})" for p, r in within]
                                                + [f"{p} -> {r} ({host[p]} -> {host[r]})" for p, r in between])
    if not nccl:
        return text + ": gloo sends over TCP; set GLOO_SOCKET_IFNAME to an interface every host can reach"
    if within:
        text += (". Within a host: GPU peer-to-peer (NVLink/PCIe) or shared memory; try NCCL_P2P_DISABLE=1, then "
                 "NCCL_SHM_DISABLE=1")
    if between:
        text += (". Between hosts: the network; try NCCL_IB_DISABLE=1, or NCCL_SOCKET_IFNAME=<the interface the "
                 "hosts reach each other on>")
    return text


class Doctor:
    """One doctor run on one rank: init, environment, checks and bandwidth, each as a step on the deadline."""

    def __init__(self, args: DoctorArgs, sizes: list[int], fault: Optional[tuple[str, int]]):
        self.args, self.sizes, self.fault = args, sizes, fault
        self.out = sys.stderr if args.json else sys.stdout
        self.report = {"ok": False, "deadline_s": args.deadline_s, "environment": {}, "checks": [],
                       "bandwidth": [], "hints": []}

    def run(self) -> int:
        failure = None
        with _watchdog(self.args.deadline_s, lambda: self._init_failed(f"took over {self.args.deadline_s:g} s")):
            try:
                # The group's own timeout is longer than ours, so that our deadline fires first and names the ranks.
                self.info = distributed.init(timeout_s=self.args.deadline_s + 30)
            except Exception as e:  # e.g. NCCL cannot use the interface it was given
                failure = f"failed: {type(e).__name__}: {' '.join(str(e).split())}"
        if failure:  # outside the deadline's timer, which would report a second time while this one waits
            self._init_failed(failure)
        self.rank, self.n, self.device = self.info.rank, self.info.world_size, self.info.device
        self.store = dist.distributed_c10d._get_default_store()
        self.report["environment"]["backend"] = self.info.backend  # for the hints, should the next step hang
        cuda = self.device.type == "cuda"
        # A small message (NCCL's LL protocol) and a large one (Simple); CPU keeps the large one modest.
        self.check_counts = (1031, 1 << 22 if cuda else 1 << 16)
        self.report["check_elements"] = list(self.check_counts)

        # torchrun numbers ranks node by node: rank // local is the node.
        self.local = int(os.environ.get("LOCAL_WORLD_SIZE", self.n))
        self.ring_strides = {"send_recv_ring": 1}
        # One rank per node: the first ring already crosses between nodes on every link (and the two would share
        # their store keys).
        if 1 < self.local < self.n and self.n % self.local == 0:
            self.ring_strides["send_recv_nodes"] = self.local
        self._environment()
        checks = [("all_reduce", self._all_reduce), ("all_gather", self._all_gather),
                  ("reduce_scatter", self._reduce_scatter), ("broadcast", self._broadcast),
                  *((name, partial(self._ring, stride=stride)) for name, stride in self.ring_strides.items())]
        for name, check in checks:
            if name == "send_recv_ring" and self.n == 1:
                self.report["checks"].append({"name": name, "ok": True, "skipped": "needs 2+ ranks"})
            else:
                self._check(name, check)
        if self._rank0_decides("run bandwidth", all(c["ok"] for c in self.report["checks"])):
            self._bandwidth(self.sizes)
        return self._finish()

    # -- steps ---------------------------------------------------------------------------------------------------

    def _step(self, name: str, body: Callable[[], dict]) -> Optional[list[dict]]:
        """Run body() on every rank under the deadline; rank 0 gets every rank's result through the store."""
        with _watchdog(self.args.deadline_s, lambda: self._timed_out(name)):
            if self.fault == ("hang", self.rank) and name != "environment":
                threading.Event().wait()  # the injected hang: never joins; the watchdog ends the process
            self.store.set(f"doctor/last/{self.rank}", name)
            self.step = name  # for _entering()
            self.store.set(f"doctor/{name}/arrived/{self.rank}", "")
            try:
                result = body()
            except Exception as e:  # e.g. out of memory: reported per rank, as the suspect if others are left waiting
                result = {"error": f"{type(e).__name__}: {e}".strip()}
            self.store.set(f"doctor/{name}/done/{self.rank}", json.dumps(result))
            keys = [f"doctor/{name}/done/{r}" for r in range(self.n)]
            if self.rank != 0:
                if "error" in result:
                    # The others may still sit in the collective this rank left, and its next collective would
                    # pair with theirs (ranks match collectives by order). So it waits; the deadline names it.
                    self._wait_for(keys)
                return None
            self._wait_for(keys)  # a rank that never finishes is the watchdog's to report
            return [json.loads(self.store.get(k)) for k in keys]

    def _wait_for(self, keys: list[str], timeout_s: float = float("inf")) -> bool:
        """Poll the store. Not store.wait(): the client runs one request at a time, and a blocking wait would
        hold it from the watchdog thread that needs it to name the laggards."""
        give_up = time.monotonic() + timeout_s
        while not self.store.check(keys):
            if time.monotonic() > give_up:
                return False
            time.sleep(0.001)
        return True

    def _rank0_decides(self, name: str, decision: bool) -> bool:
        """Rank 0's decision, on every rank (only rank 0 holds the verdicts, and all ranks must take one path)."""
        with _watchdog(self.args.deadline_s, lambda: self._timed_out(name)):
            if self.rank == 0:
                self.store.set(f"doctor/{name}", str(int(decision)))
            self._wait_for([f"doctor/{name}"])
            return self.store.get(f"doctor/{name}") == b"1"

    def _entering(self) -> None:
        """Called just before each collective of a step: a rank that arrived and never got here is stuck in its own
        work, not in the transport. On GPU that work is asynchronous, so it waits for it: a wedged GPU stops here."""
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        self.store.set(self._entry_key(), "")

    def _left(self) -> None:
        """Called once a collective's result is on this host. Without it, the entry key of a step's first
        collective would still stand while the rank is stuck in its own work before the next, and the others
        waiting inside that next collective would read as a transport that hangs."""
        self.store.delete_key(self._entry_key())

    def _entry_key(self) -> str:
        return f"doctor/{self.step}/entered/{self.rank}"

    def _timed_out(self, name: str) -> None:
        """Watchdog thread: the step overran. Rank 0 names the laggards and reports; every rank then exits."""
        if self.rank != 0:
            logger.error(f"rank {self.rank}: step {name!r} did not finish within {self.args.deadline_s:g} s; "
                         "rank 0 reports which ranks are missing")
            self._finish()
            _exit(1)

        def has(key: str) -> bool:  # check() never blocks, unlike get()
            return self.store.check([key])

        missing = [r for r in range(self.n) if not has(f"doctor/{name}/arrived/{r}")]
        late = [r for r in range(self.n) if r not in missing and not has(f"doctor/{name}/done/{r}")]
        done = {r: json.loads(self.store.get(f"doctor/{name}/done/{r}")) for r in range(self.n)
                if r not in missing + late}
        failed = {r: result["error"] for r, result in done.items() if "error" in result}
        # A rank that arrived but is not inside a collective (it never entered one, or left one and never entered
        # the next) is stuck in its own work (its GPU or host), not in the transport. The environment step has no
        # collective, so every rank late in it is one.
        outside = [r for r in late if not has(f"doctor/{name}/entered/{r}")]
        stuck = [r for r in late if r not in outside]  # inside the collective
        suspects = sorted([*missing, *failed, *outside])
        facts = {f["rank"]: f for f in self.report["environment"].get("ranks", [])}

        def where(r: int) -> str:
            return f" ({facts[r]['host']} pid {facts[r]['pid']})" if r in facts else ""

        parts = []
        for r in missing:
            last = self.store.get(f"doctor/last/{r}").decode() if has(f"doctor/last/{r}") else "init"
            parts.append(f"rank {r}{where(r)} never arrived; the last step it reached was {last!r}")
        parts += [f"rank {r}{where(r)} failed: {e}" for r, e in failed.items()]
        if outside and name == "environment":
            parts.append(f"rank(s) {_ranks(outside)} are stuck gathering their facts: a CUDA query or nvidia-smi "
                         "that does not answer (a wedged driver or GPU?)")
        elif outside:
            parts.append(f"rank(s) {_ranks(outside)} arrived but never entered the collective: stuck in their own "
                         "work before it (a wedged GPU, or a blocked host process?)")
        if missing or outside:
            self.report["hints"].append("a rank that never arrived or never entered the collective is stuck or dead "
                                        "outside it: `py-spy dump --pid PID` on its host shows where")
        if failed:
            self.report["hints"].append("a rank that failed left the others waiting inside the collective: fix "
                                        "its error first (out of memory at the largest bandwidth sizes: pass a "
                                        "smaller --sizes, e.g. --sizes 256M)")
        stride = self.ring_strides.get(name)
        links, untried = self._undelivered(stuck, stride) if stride and stuck and not suspects else ([], [])
        if stuck and suspects:
            parts.append(f"rank(s) {_ranks(stuck)} are waiting inside it for rank(s) {_ranks(suspects)}")
        elif links:
            parts.append(f"rank(s) {_ranks(stuck)} are stuck inside it; "
                         + _link_verdict(links, facts, self.info.backend == "nccl"))
            if untried:
                parts.append(f"{', '.join(f'{p} -> {r}' for p, r in untried)} untried: a rank takes its second "
                             "link of the ring only once its first is through")
        elif stuck:
            parts.append(f"rank(s) {_ranks(stuck)} arrived but are stuck inside it: the transport itself hangs "
                         "(see the settings below)")
        entry = {"name": name, "ok": False, "timed_out": True, "ranks": suspects or stuck, "suspects": suspects,
                 "error": f"no result within {self.args.deadline_s:g} s: " + "; ".join(parts)}
        if links:
            entry["links"] = links
        self.report["checks"].append(entry)
        self._finish()
        _exit(1)

    def _undelivered(self, stuck: list[int], stride: int) -> tuple[list[list[int]], list[list[int]]]:
        """The ring's links [prev, rank] that never delivered, and those never tried: the stuck ranks without a
        receive at the first size where any is missing (a rank that got past that size and waits at the next one
        waits for a laggard). A rank starts its second half of the ring only once its first is done (_ring), so a
        link was tried only where its sender, if it receives first, got its receive, and its receiver, if it sends
        first, got its send through. Were those named too, one dead link between two ranks (or two nodes) would be
        named in both directions, and one out of a rank that sends first along with the two links beside it."""

        def done(what: str, rank: int, count: int) -> bool:
            return self.store.check([_ring_key(what, count, stride, rank)])

        for count in self.check_counts:
            late = [r for r in stuck if not done("received", r, count)]
            if late:
                links = [[(r - stride) % self.n, r] for r in late]
                tried = [[p, r] for p, r in links
                         if (not _receives_first(p, stride) or done("received", p, count))
                         and (_receives_first(r, stride) or done("sent", r, count))]
                return tried, [link for link in links if link not in tried]
        return [], []

    def _init_failed(self, what: str) -> None:
        """No group, so no store: each rank reports for itself, and rank 0 writes the report."""
        rank = int(os.environ.get("RANK", "0"))
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        message = (f"process group set-up on rank {rank} {what} (rendezvous at {where}). Likely: a rank did not "
                   "start, cannot reach that address, or NCCL cannot create its communicator")
        logger.error(message)
        if rank == 0:
            self.report["environment"]["backend"] = "nccl" if torch.cuda.is_available() else "gloo"
            self.report["checks"].append({"name": "init", "ok": False, "timed_out": what.startswith("took"),
                                          "error": message})
            self._emit(1)
        else:
            # Rank 0 writes the report. Exiting now would have torchrun stop it first wherever rank 0 started
            # later than this rank (a slower import, another node), so its deadline would come after ours.
            time.sleep(min(self.args.deadline_s, 30))
        _exit(1)

    def _environment(self) -> None:
        # The other ranks go on to the first check and wait in it for rank 0, within one deadline: rank 0 gives
        # the topology query half of it, inside this step.
        def body() -> dict:
            if self.fault == ("wedge", self.rank):
                threading.Event().wait()
            return _rank_facts(self.info) | (
                {"topology": _topology(self.args.deadline_s / 2)} if self.rank == 0 else {})

        facts = self._step("environment", body)
        if self.rank != 0:
            return
        topology = facts[0].pop("topology", None)
        nccl = torch.cuda.nccl.version() if self.device.type == "cuda" else None
        env = self.report["environment"]
        env.update(torch=torch.__version__, cuda=torch.version.cuda,
                   nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
                   python=platform.python_version(), backend=self.info.backend, world_size=self.n,
                   ranks=facts, topology=topology)
        env["warnings"] = _environment_warnings(facts)
        text = io.StringIO()
        render_environment(env, text)
        _write_whole(self.out, text.getvalue())

    # -- checks --------------------------------------------------------------------------------------------------

    def _check(self, name: str, check: Callable[[int], tuple[Optional[str], list[int]]]) -> None:
        def body() -> dict:
            result = {}
            # Every size, even after a wrong result, so that the ranks stay in step. An exception ends the check on
            # the rank that raised it only; _step holds that rank until the others are done or the deadline fires.
            for i, count in enumerate(self.check_counts):
                if i and self.fault == ("stall_between", self.rank):
                    threading.Event().wait()  # the injected stall: after a size's collective, before the next one's
                wrong, sources = check(count)
                self._left()  # each check reads its result on the host, so on GPU the collective is done by now
                if wrong and not result:
                    result = {"wrong": f"{count} elements/rank: {wrong}", "sources": sources}
            return result

        results = self._step(name, body)
        if self.rank != 0:
            return
        errors = {r: res["error"] for r, res in enumerate(results) if "error" in res}
        wrong = {r: res["wrong"] for r, res in enumerate(results) if "wrong" in res}
        sources = sorted({s for res in results for s in res.get("sources", [])})
        messages = [f"rank {r} raised {e}" for r, e in sorted(errors.items())]
        if wrong:
            first = min(wrong)
            messages.append(f"wrong result on rank(s) {_ranks(sorted(wrong))} (rank {first}: {wrong[first]})"
                            + (f"; the bad data came from rank(s) {_ranks(sources)}" if sources else ""))
        entry = {"name": name, "ok": not messages, "ranks": sorted(errors | wrong), "suspects": sources}
        if messages:
            entry["error"] = "; ".join(messages)
        self.report["checks"].append(entry)

    def _contribution(self, count: int) -> torch.Tensor:
        if self.fault == ("raise", self.rank):
            raise RuntimeError(f"injected fault ({FAULT_VAR}): rank {self.rank} raised before the collective")
        if self.fault == ("stall", self.rank):
            threading.Event().wait()  # the injected stall: never enters; the watchdog ends the process
        x = _pattern(self.rank, count, self.device)
        if self.fault == ("wrong", self.rank):
            x += 1
        return x

    def _all_reduce(self, count: int):
        x = self._contribution(count)
        self._entering()
        dist.all_reduce(x)
        return _mismatch(x, _sum_of_patterns(self.n, count, self.device)), []  # a sum cannot tell who was wrong

    def _all_gather(self, count: int):
        out, mine = torch.full((self.n, count), -1.0, device=self.device), self._contribution(count)
        self._entering()
        _all_gather(out.view(-1), mine)
        wrong = {src: m for src in range(self.n) if (m := _mismatch(out[src], _pattern(src, count, self.device)))}
        return (f"block from rank {min(wrong)}: {wrong[min(wrong)]}" if wrong else None), sorted(wrong)

    def _reduce_scatter(self, count: int):
        out, mine = torch.full((count,), -1.0, device=self.device), self._contribution(self.n * count)
        self._entering()
        _reduce_scatter(out, mine)
        return _mismatch(out, _sum_of_patterns(self.n, count, self.device, offset=self.rank * count)), []

    def _broadcast(self, count: int):
        x = self._contribution(count) if self.rank == 0 else torch.full((count,), -1.0, device=self.device)
        self._entering()
        dist.broadcast(x, src=0)
        wrong = _mismatch(x, _pattern(0, count, self.device))
        return wrong, [0] if wrong else []

    def _ring(self, count: int, stride: int = 1):
        """Each rank sends to rank + stride and receives from rank - stride."""
        prev, after = (self.rank - stride) % self.n, (self.rank + stride) % self.n
        send, recv = self._contribution(count), torch.full((count,), -1.0, device=self.device)
        remote = after // self.local != self.rank // self.local
        dropped = self.fault == ("drop", self.rank) or (remote and self.fault == ("drop_remote", self.rank))
        self._entering()
        # Single sends and receives, not one batch: NCCL completes a batch as one piece of work, and a hang report
        # needs to know which receive never completed. Ranks of even (rank // stride) send first, the others receive
        # first, so that each send meets a posted receive, and each rank starts its second only once its first is
        # done. NCCL runs them so anyway (a group bound to its GPU runs a rank's sends and receives on one stream, in
        # order); holding to it on every backend lets the report tell a link that never delivered from one that was
        # never tried (_undelivered).
        if _receives_first(self.rank, stride):
            self._receive(recv, prev, count, stride)
            self._send(send, after, dropped, count, stride)
        else:
            self._send(send, after, dropped, count, stride)
            self._receive(recv, prev, count, stride)
        wrong = _mismatch(recv, _pattern(prev, count, self.device))
        return (f"from rank {prev}: {wrong}", [prev]) if wrong else (None, [])

    def _send(self, tensor: torch.Tensor, after: int, dropped: bool, count: int, stride: int) -> None:
        if dropped:
            threading.Event().wait()  # the injected dead link: the send never completes
        self._ring_done(dist.isend(tensor, after), "sent", count, stride)

    def _receive(self, tensor: torch.Tensor, prev: int, count: int, stride: int) -> None:
        self._ring_done(dist.irecv(tensor, prev), "received", count, stride)

    def _ring_done(self, work: dist.Work, what: str, count: int, stride: int) -> None:
        """Wait for a send or receive of the ring, then say in the store that it is done, for the report."""
        work.wait()
        if self.device.type == "cuda":  # NCCL's wait() only orders the stream; the host must see it done
            torch.cuda.current_stream().synchronize()
        self.store.set(_ring_key(what, count, stride, self.rank), "")

    # -- bandwidth -----------------------------------------------------------------------------------------------

    def _bandwidth(self, sizes: list[int]) -> None:
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            for size in sizes:
                count = size // 4 // self.n * self.n  # float32, divisible into n equal shards
                if count == 0:
                    continue
                results = self._step(f"bandwidth {op} {_fmt_bytes(size)}", lambda: self._time(op, count))
                if self.rank != 0:
                    continue
                errors = {r: res["error"] for r, res in enumerate(results) if "error" in res}
                # Every rank got here, each with a time or an error (e.g. out of memory at the largest sizes on
                # every rank), so all go on to the next size together. A rank that raised alone is not here: it left
                # the others inside the collective, and the deadline reports it.
                if errors:
                    self.report["checks"].append({"name": f"bandwidth {op} {_fmt_bytes(size)}", "ok": False,
                                                  "ranks": sorted(errors), "error": "; ".join(
                                                      f"rank {r} raised {e}" for r, e in errors.items())})
                    continue
                seconds = max(res["seconds"] for res in results)  # the collective is as slow as its slowest rank
                algbw = count * 4 / seconds / 1e9
                self.report["bandwidth"].append({"op": op, "bytes": count * 4, "time_us": seconds * 1e6,
                                                 "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(op, self.n)})

    def _time(self, op: str, count: int) -> dict:
        shard = count // self.n
        full, part = torch.ones(count, device=self.device), torch.ones(shard, device=self.device)
        run = {"all_reduce": partial(dist.all_reduce, full), "all_gather": partial(_all_gather, full, part),
               "reduce_scatter": partial(_reduce_scatter, part, full)}[op]
        self._entering()  # once, outside the timed runs
        for _ in range(3):  # the first runs set up connections and buffers
            run()
        # One timing around all the runs, back to back, as nccl-tests and benchmarks/collectives.py take it: a sync
        # after each run would add its own latency (tens of microseconds) to each, and swamp the small sizes.
        iters = self.args.iters
        if self.device.type == "cuda":  # events on the stream time the GPU's work, not the host's launches
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                run()
            end.record()
            end.synchronize()
            return {"seconds": start.elapsed_time(end) / 1e3 / iters}
        start = time.perf_counter()
        for _ in range(iters):
            run()  # gloo's collectives return when they are done
        return {"seconds": (time.perf_counter() - start) / iters}

    # -- the end -------------------------------------------------------------------------------------------------

    def _finish(self) -> int:
        """Rank 0 reports and publishes the exit status; the others wait for it, so none exits first and has
        torchrun kill rank 0 mid-report."""
        if self.rank != 0:
            if not self._wait_for(["doctor/exit"], self.args.deadline_s):
                return 1  # rank 0 is gone, so it cannot have reported success
            return int(self.store.get("doctor/exit"))
        code = 0 if all(c["ok"] for c in self.report["checks"]) else 1
        self._emit(code)
        self.store.set("doctor/exit", str(code))
        return code

    def _emit(self, code: int) -> None:
        self.report["ok"] = code == 0
        if code:
            self.report["hints"] += _hints(self.report)
        text = io.StringIO()
        for render in (render_checks, render_bandwidth, render_verdict):
            render(self.report, text)
        _write_whole(self.out, text.getvalue())
        if self.args.json:
            _write_whole(sys.stdout, json.dumps(self.report) + "\n")


@contextmanager
def _watchdog(seconds: float, on_timeout: Callable[[], None]):
    """Calls on_timeout from a timer thread unless the block finishes within `seconds`."""
    timer = threading.Timer(seconds, on_timeout)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _write_whole(out, text: str) -> None:
    """`text` in one write() to `out`'s file: NCCL_DEBUG writes to the same stream from threads of its own (and other
    ranks may share it), and Python's stream would cut a report into a write per line (per 8 KiB piped), between which
    their lines land, or split the JSON from its newline. A file or terminal takes one write() whole; a full pipe may
    still let another writer in within one over PIPE_BUF (4 KiB), and a signal may cut one short, hence the loop."""
    out.flush()  # what was printed before comes first
    data = text.encode()
    while data:
        data = data[os.write(out.fileno(), data):]


def _exit(code: int) -> None:
    # os._exit: a thread blocked inside a collective would keep a normal exit (and NCCL's teardown) waiting.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# -- text report (also used by --try-fixes to show the unchanged run) --------------------------------------------

def render_environment(env: dict, out) -> None:
    ranks = env["ranks"]
    print("== environment ==", file=out)
    print(f"torch {env['torch']} | CUDA {env['cuda'] or '-'} | NCCL {env['nccl'] or '-'} | Python {env['python']}"
          f" | backend {env['backend']} | {env['world_size']} rank(s) on "
          f"{len({f['host'] for f in ranks})} host(s)", file=out)
    for f in ranks:
        gpu = f.get("gpu")
        device = (f"{f['device']} {gpu['name']}, {gpu['memory_gib']} GiB, sm {gpu['capability']}, "
                  f"bf16 {'yes' if gpu['bf16'] else 'NO'}") if gpu else f["device"]
        print(f"  rank {f['rank']}: {f['host']} pid {f['pid']}, {device}", file=out)
    for host, f in _per_host(ranks).items():
        shm = (f"{_fmt_bytes(f['shm_bytes'])} ({_fmt_bytes(f['shm_free_bytes'])} free)"
               if f["shm_bytes"] is not None else "missing")
        print(f"  host {host}: /dev/shm {shm}, memory {_fmt_bytes(f['memory_bytes'])} "
              f"({_fmt_bytes(f['memory_available_bytes'])} available), interfaces {', '.join(f['interfaces'])}",
              file=out)
    variables = ranks[0]["variables"]
    print("variables (rank 0):" + ("" if variables else " none of NCCL_*, TORCH_*, GLOO_*, CUDA_VISIBLE_DEVICES"),
          file=out)
    for k, v in variables.items():
        print(f"  {k}={v}" + (f"  # {KNOWN_VARIABLES[k]}" if k in KNOWN_VARIABLES else ""), file=out)
    if env["topology"]:
        print("topology (nvidia-smi topo -m on rank 0's host):", file=out)
        print("\n".join("  " + line for line in env["topology"].splitlines()), file=out)
    for w in env["warnings"]:
        print(f"WARNING: {w}", file=out)
    out.flush()


def render_checks(report: dict, out) -> None:
    sizes = " and ".join(map(str, report.get("check_elements", [])))  # none when the group never formed
    what = f"{sizes} float32 per rank; " if sizes else ""
    print(f"== checks ({what}deadline {report['deadline_s']:g} s per step) ==", file=out)
    for c in report["checks"]:
        status = "SKIP" if c.get("skipped") else "PASS" if c["ok"] else "TIMEOUT" if c.get("timed_out") else "FAIL"
        print(f"  {c['name']:<16} {status:<8} {c.get('skipped') or c.get('error') or ''}".rstrip(), file=out)


def render_bandwidth(report: dict, out) -> None:
    rows = report["bandwidth"]
    if not rows:
        if not all(c["ok"] for c in report["checks"]):
            print("== bandwidth: not measured, a check failed ==", file=out)
        return
    print("== bandwidth (float32, mean time of back-to-back runs; busbw as nccl-tests) ==", file=out)
    print(f"  {'size':>9}  {'op':<15} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}", file=out)
    for r in rows:
        print(f"  {_fmt_bytes(r['bytes']):>9}  {r['op']:<15} {r['time_us']:>10.1f} {r['algbw_gbps']:>12.2f} "
              f"{r['busbw_gbps']:>12.2f}", file=out)


def render_verdict(report: dict, out) -> None:
    print(f"== result: {'PASS' if report['ok'] else 'FAIL'} ==", file=out)
    suspects = sorted({r for c in report["checks"] for r in c.get("suspects", [])})
    ranks = {f["rank"]: f for f in report["environment"].get("ranks", [])}
    if suspects:
        print("suspect rank(s): " + "; ".join(
            f"{r} ({ranks[r]['host']} pid {ranks[r]['pid']}, {ranks[r]['device']})" if r in ranks else str(r)
            for r in suspects), file=out)
    if report["hints"]:
        print("likely causes and settings to try, one at a time:", file=out)
        print("\n".join(f"  {h}" for h in report["hints"]), file=out)
    out.flush()


# -- --try-fixes -------------------------------------------------------------------------------------------------

def _candidates(nccl: bool) -> list[tuple[str, str]]:
    interfaces = _network_interfaces()
    if not nccl:
        candidates = [("GLOO_SOCKET_IFNAME", i) for i in interfaces]
    else:  # cheapest first, so the first that passes is the one to keep: disabling P2P costs the most bandwidth
        candidates = [("NCCL_NVLS_ENABLE", "0"), ("NCCL_SHM_DISABLE", "1"), ("NCCL_IB_DISABLE", "1"),
                      *[("NCCL_SOCKET_IFNAME", i) for i in interfaces], ("NCCL_P2P_DISABLE", "1")]
    return [(k, v) for k, v in candidates if os.environ.get(k) != v]  # a setting in force already failed


def last_report(stdout: str) -> Optional[dict]:
    """The --json report in a run's stdout: its last JSON line. Not simply the last line: NCCL_DEBUG writes to
    stdout too (unless NCCL_DEBUG_FILE is set), and other ranks may print after rank 0's report."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def try_fixes(args: DoctorArgs) -> int:
    """Run the doctor as fresh local groups: unchanged, then with each candidate setting until one passes."""
    if "RANK" in os.environ:
        raise SystemExit("--try-fixes starts its own groups: run it as a plain process, not under torchrun")
    nproc = args.nproc or torch.cuda.device_count() or 2
    flags = [f"--deadline-s={args.deadline_s}", f"--iters={args.iters}", f"--sizes={args.sizes}"]
    # The children import this package as we did, installed or not.
    package_root = str(Path(__file__).resolve().parents[1])
    pythonpath = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    out = sys.stderr if args.json else sys.stdout

    def attempt(setting: dict[str, str]) -> tuple[Optional[dict], str]:
        # --standalone: torchrun's rendezvous and store bind port 0 themselves, so that no other process can take
        # their port first, as it could a free port looked up beforehand. The ranks meet on loopback, as they did.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr=127.0.0.1",
               f"--nproc_per_node={nproc}", "-m", "fsdp_trainer.tools.doctor", "--json", *flags]
        env = os.environ | {"PYTHONPATH": pythonpath} | setting
        # Its own session, so that a group that outlives every deadline can be killed whole, workers included.
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=300 + 10 * args.deadline_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        report = last_report(stdout)
        if report is None:  # it crashed: show its last error rather than torchrun's summary
            lines = [line for line in stderr.splitlines() if "Error" in line] or stderr.splitlines() or ["(none)"]
            return None, "no report; its last error: " + lines[-1].strip()
        return report, ""

    def summary(report: Optional[dict], why: str) -> str:
        if report is None:
            return f"FAIL  {why}"
        failed = [c["name"] + (" (timeout)" if c.get("timed_out") else "") for c in report["checks"] if not c["ok"]]
        return "PASS" if report["ok"] else "FAIL  " + ", ".join(failed)

    print(f"== try-fixes: the unchanged run, {nproc} rank(s) on this node ==", file=out)
    baseline, why = attempt({})
    if baseline is not None:  # in full: its failures say where to look if no setting helps
        if baseline["environment"].get("ranks"):
            render_environment(baseline["environment"], out)
        render_checks(baseline, out)
        render_bandwidth(baseline, out)
    result = {"ok": bool(baseline and baseline["ok"]), "baseline": baseline, "attempts": [], "fix": None}
    print("== try-fixes: one setting at a time ==", file=out)
    print(f"  {'(unchanged)':<28} {summary(baseline, why)}", file=out)
    if not result["ok"]:
        for name, value in _candidates(nccl=torch.cuda.is_available()):  # as distributed.init() decides
            report, why = attempt({name: value})
            passed = bool(report and report["ok"])
            result["attempts"].append({"setting": f"{name}={value}", "ok": passed, "report": report})
            print(f"  {name + '=' + value:<28} {summary(report, why)}", file=out, flush=True)
            if passed:
                result["fix"] = f"{name}={value}"
                break
        print(f"fix: export {result['fix']}" if result["fix"] else
              "no single setting fixed it; read the unchanged run's report above and the hints it lists", file=out)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


def _parse_fault(spec: str) -> Optional[tuple[str, int]]:
    """$FSDP_TRAINER_DOCTOR_FAULT as (kind, rank), None where unset; ValueError names the variable and its form."""
    if not spec:
        return None
    kind, _, target = spec.partition(":")
    if kind not in FAULTS or not target.startswith("rank=") or not target[5:].isdigit():
        raise ValueError(f"{FAULT_VAR}={spec}: expected {', '.join(FAULTS[:-1])} or {FAULTS[-1]}, then :rank=N "
                         "(e.g. hang:rank=1)")
    return kind, int(target[5:])


def _parsed(parse: Callable[[str], object], text: str, refusals: list[str]):
    """parse(text), or None with the ValueError's message added to the refusals."""
    try:
        return parse(text)
    except ValueError as e:
        refusals.append(str(e))
        return None


def main(argv: Optional[list[str]] = None) -> None:
    args = tyro.cli(DoctorArgs, args=argv, prog="python -m fsdp_trainer.tools.doctor", description=__doc__)
    # Refused before anything runs, with argparse's exit status 2 (as the planner's), not the 1 of a failed check:
    # a deadline of 0 would time every step out at once and blame a rank, and the mean of no runs would fail like a
    # broken collective.
    refusals = [
        f"--deadline-s {args.deadline_s:g}: must be above 0 (the seconds each step may take; default 60)"
        if args.deadline_s <= 0 else "",
        f"--iters {args.iters}: the bandwidth table needs at least one timed run per size; pass --iters 1 or more, "
        "or --sizes 0 to measure no bandwidth" if args.iters < 1 else "",
        f"--nproc {args.nproc}: must be 0 (every visible GPU, or 2 on CPU) or more" if args.nproc < 0 else "",
    ]
    # A malformed --sizes or fault is bad input too; refused here also before --try-fixes starts its groups.
    sizes = _parsed(_bandwidth_sizes, args.sizes, refusals)
    fault = _parsed(_parse_fault, os.environ.get(FAULT_VAR, ""), refusals)
    for refusal in filter(None, refusals):
        print(f"python -m fsdp_trainer.tools.doctor: error: {refusal}", file=sys.stderr)
    if any(refusals):
        sys.exit(2)
    if args.try_fixes:
        sys.exit(try_fixes(args))
    code = Doctor(args, sizes, fault).run()
    if code:  # after a failed collective, NCCL's teardown can block for good; the report is out, so just go
        _exit(code)
    distributed.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
