"""Shared test helpers: run a function on N real gloo ranks, tiny configs, op counts, FSDP2 gather state, launches,
launches side by side."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_trainer.config import Config

REPO = Path(__file__).resolve().parents[1]

# Command-line flags for a model and batch small enough that a few steps on several CPU ranks take seconds.
TINY_FLAGS = ["--model.n_layers", "2", "--model.dim", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
              "--model.vocab_size", "320", "--train.seq_len", "32", "--train.micro_batch_size", "2",
              "--train.log_every", "1", "--data.num_workers", "0", "--parallel.param_dtype", "float32",
              "--metrics.no_tensorboard", "--eval.every", "0"]

# torchrun for one node. --standalone: its rendezvous and store bind port 0 themselves, so that no other process
# can take their port first, as it could a free port looked up beforehand. --local-addr: they meet on loopback,
# not at this host's name, which need not resolve.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr=127.0.0.1"]


def free_port() -> int:
    """A TCP port free on this host right now, only for the launch scripts' tests, which must be given HEAD or
    PORT: another process may take it before the launcher binds it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# One server imports torch and the trainer once, then forks every rank of every test from that clean process: a
# spawned rank, or one that torchrun starts, spends seconds importing them again.
FORK_SERVER = mp.get_context("forkserver")
FORK_SERVER.set_forkserver_preload(["helpers", "fsdp_trainer.train"])


def _enter(environ: dict, cwd: str) -> None:
    """Take the caller's environment and folder, not the fork server's."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)


def _join(rank: int, world_size: int, port: int, environ: dict, cwd: str) -> None:
    """Become `rank` in the caller's environment and folder. env:// as under torchrun, which has the ranks join its
    store (TORCHELASTIC_USE_AGENT_STORE) rather than rank 0 start one."""
    _enter(environ, cwd)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)


def _start(world_size: int, target: Callable, *args,
           env: Optional[dict[str, str]] = None) -> tuple[dist.TCPStore, list]:
    """`world_size` processes forked from the fork server, each running target(rank, world_size, port, environ, cwd,
    *args) with this process's environment and `env`. The group's store is served from here on port 0, so that no
    other process can take its port first, as it could a free port looked up for rank 0 to bind."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    environ = {**os.environ, **(env or {})}
    procs = [FORK_SERVER.Process(target=target, args=(r, world_size, store.port, environ, os.getcwd(), *args))
             for r in range(world_size)]
    for p in procs:
        p.start()
    return store, procs


def _worker(rank: int, world_size: int, port: int, environ: dict, cwd: str, fn, args, queue) -> None:
    _join(rank, world_size, port, environ, cwd)
    try:
        # Plain pickle bytes: torch's queue would share tensors through file descriptors that die with us.
        queue.put((rank, pickle.dumps(fn(*args)), None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test with it
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0) -> list:
    """Run `fn(*args)` on `world_size` processes forming one gloo group; return each rank's result."""
    queue = FORK_SERVER.Queue()
    _store, procs = _start(world_size, _worker, fn, args, queue)
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, value, error = queue.get(timeout=timeout)
            results[rank] = pickle.loads(value) if value is not None else None
            if error:
                errors.append(f"rank {rank}:\n{error}")
                break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert not errors, "\n".join(errors)
    return [results[r] for r in range(world_size)]


def _output_to(out: str, err: str) -> None:
    """This process's stdout and stderr, from Python and from C, appended to the files `out` and `err`."""
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)


def _trainer(rank: int, world_size: int, port: int, environ: dict, cwd: str, argv: list[str], log: str,
             fault: Optional[tuple[str, str, str]]) -> None:
    _join(rank, world_size, port, environ, cwd)
    _output_to(log, log)
    if fault:
        import fault_worker
        fault_worker.inject(*fault)
    from fsdp_trainer import train
    train.main(argv)


def _wait(procs: list, seconds: float, any_failed: bool = False) -> None:
    """Until every process has ended (or, with any_failed, one has failed), at most `seconds`."""
    deadline = time.monotonic() + seconds
    while (running := [p.sentinel for p in procs if p.exitcode is None]) and time.monotonic() < deadline:
        if any_failed and any(p.exitcode for p in procs):
            return
        wait(running, timeout=deadline - time.monotonic())


def train_ranks(nproc: int, *argv: str, fault: Optional[tuple[str, str, str]] = None,
                env: Optional[dict[str, str]] = None, timeout: float = 180,
                grace: float = 5) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=nproc -m fsdp_trainer.train *argv` without the seconds each rank spends importing:
    the ranks are forked from the fork server, `env` added to their environment, `fault` (fault_worker.inject's
    arguments) injected. As under torchrun, the first rank to fail ends the others (SIGTERM, SIGKILL `grace` seconds
    later); its exit status is the job's. The ranks' output, interleaved, is in stderr."""
    command = ["train_ranks", str(nproc), *argv]
    with tempfile.NamedTemporaryFile("r") as log:
        _store, procs = _start(nproc, _trainer, list(argv), log.name, fault, env=env)
        try:
            _wait(procs, timeout, any_failed=True)
            status = next((p.exitcode for p in procs if p.exitcode), 0)
            if not status and any(p.exitcode is None for p in procs):
                raise subprocess.TimeoutExpired(command, timeout, log.read())
        finally:
            for sig, seconds in ((signal.SIGTERM, grace), (signal.SIGKILL, timeout)):
                for p in procs:
                    if p.exitcode is None:
                        os.kill(p.pid, sig)
                _wait(procs, seconds)
        return subprocess.CompletedProcess(command, status, "", log.read())


def _call(environ: dict, cwd: str, out: str, err: str, fn: Callable, args: tuple) -> None:
    _enter(environ, cwd)
    _output_to(out, err)
    fn(*args)


def run_forked(fn: Callable, *args, env: Optional[dict[str, str]] = None,
               timeout: float = 120) -> subprocess.CompletedProcess:
    """fn(*args) in a process of its own, as `python -c` runs it, without the seconds it spends importing: forked
    from the fork server, with this process's environment and `env`. Its exit status (SystemExit's code, 1 for an
    exception), stdout and stderr."""
    command = ["run_forked", repr(fn), *map(repr, args)]
    with tempfile.NamedTemporaryFile("r") as out, tempfile.NamedTemporaryFile("r") as err:
        proc = FORK_SERVER.Process(target=_call, args=({**os.environ, **(env or {})}, os.getcwd(), out.name, err.name,
                                                        fn, args))
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(command, timeout, out.read(), err.read())
        return subprocess.CompletedProcess(command, proc.exitcode, out.read(), err.read())


def tiny_config(**sections) -> Config:
    """TINY_FLAGS as a Config, with `sections` ({"train": {"steps": 3}, ...}) set on top."""
    cfg = Config()
    cfg.model.n_layers, cfg.model.dim, cfg.model.n_heads, cfg.model.n_kv_heads = 2, 64, 4, 2
    cfg.model.vocab_size = 320
    cfg.data.num_workers = 0
    cfg.train.steps, cfg.train.seq_len, cfg.train.micro_batch_size, cfg.train.log_every = 4, 32, 4, 1
    cfg.optim.warmup_steps = 2
    cfg.parallel.param_dtype = "float32"
    cfg.metrics.tensorboard = False
    cfg.checkpoint.interval = 0
    cfg.eval.every = 0
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    return cfg


# The op that F.scaled_dot_product_attention runs on CPU, in forward only (its backward is another op).
SDPA = "_scaled_dot_product_flash_attention_for_cpu"


class OpCounter(TorchDispatchMode):
    """How many times each aten op runs inside the `with` block, by name (`counts["mm"]`)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def is_gathered(module: torch.nn.Module) -> bool:
    """Whether a module that FSDP2 shards holds its gathered parameters now: from its all-gather to its reshard,
    FSDP2 swaps the module's DTensor shards for plain tensors."""
    return not isinstance(next(module.parameters()), DTensor)


def checkout_env(**settings: str) -> dict[str, str]:
    """This process's environment, with this checkout first on PYTHONPATH (ahead of an installed copy of the
    package, and of what PYTHONPATH held, which stays), and `settings` added: for a subprocess that must run the
    code under test. A script's own folder (tests/) is all that Python puts on its path otherwise."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **settings}


def launch_fault(fault: str, rank: str, step: int | str, *train_flags: str, nproc: int = 2, timeout: float = 180,
                 env: Optional[dict[str, str]] = None,
                 torchrun: bool = False) -> tuple[subprocess.CompletedProcess, float]:
    """The trainer with every one of `train_flags`, and `fault` injected on `rank` at its `step`-th step
    (tests/fault_worker.py), `env` added to the environment: on ranks that train_ranks forks, or with `torchrun` as
    tests/fault_worker.py under torchrun, for a test of what torchrun reports. Returns the finished job and the
    seconds it took."""
    start = time.monotonic()
    if not torchrun:
        proc = train_ranks(nproc, *train_flags, fault=(fault, rank, str(step)), env=env, timeout=timeout)
        return proc, time.monotonic() - start
    worker = Path(__file__).with_name("fault_worker.py")
    cmd = [*TORCHRUN, f"--nproc_per_node={nproc}", str(worker), fault, rank, str(step), "--", *train_flags]
    proc = subprocess.run(cmd, cwd=REPO, env=checkout_env(**(env or {})), capture_output=True, text=True,
                          timeout=timeout)
    return proc, time.monotonic() - start


def processes_with(variable: str, value: str, grace: float = 3.0) -> list[int]:
    """The processes whose environment sets `variable` to `value` (a launch's, which its processes inherit), once
    none is left or after `grace` seconds."""
    entry, deadline = f"{variable}={value}".encode(), time.monotonic() + grace
    while True:
        found = []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                if entry in environ.read_bytes().split(b"\0"):
                    found.append(int(environ.parent.name))
            except OSError:  # gone meanwhile, or not ours
                pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def blames(output: str, rank: int, pid: int) -> bool:
    """Whether torchrun's failure summary at the end of `output` blames `rank` (process `pid`, on this host): as the
    root cause itself, or in the root cause's message, as the watchdog's report names a rank."""
    root = output.rpartition("Root Cause (first observed failure):")[2]
    return (f"rank      : {rank} " in root and f"(pid: {pid})" in root) or \
        f"{rank} on host {socket.gethostname()} (pid {pid})" in root


def node_name(test: Callable, case: object = None) -> str:
    """The name pytest gives `test` (the function), with the id of its parameters `case`: its request.node.name."""
    return test.__name__ if case is None else f"{test.__name__}[{case}]"


def side_by_side(request: pytest.FixtureRequest, runs: dict[str, Callable[[], object]],
                 at_once: int) -> dict[str, Future]:
    """For a module-scoped fixture: the runs of the tests of its module selected in this session (keyed by test name,
    as node_name gives it), each in a thread, `at_once` at a time in the order given, all finished. Launches that
    spend much of their time waiting (on a deadline, a stand-in's sleep) or on one core take less time side by side
    than one after another. A test takes its run's outcome with .result(), which raises there what the run raised."""
    selected = {item.name for item in request.session.items if item.module is request.module}
    with ThreadPoolExecutor(at_once) as pool:
        return {name: pool.submit(run) for name, run in runs.items() if name in selected}
