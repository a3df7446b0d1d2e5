"""Failing fast and clearly: a progress watchdog that names the ranks that are behind, dead or frozen, the flight
recorder, non-finite steps that are never applied, and out-of-memory reports.

A *hung* rank is the hard case: the others wait in their next collective for as long as its timeout. Every rank
therefore runs a watchdog thread. When its own step has not finished for `init_timeout_s` (until the first step is
done, which includes the restore of a checkpoint and compilation) or `timeout_s` (afterwards), it writes to the c10d
store (a TCP side channel that works while the collectives do not) its last finished step and whether its main thread
waits (in a collective or a GPU sync) or is busy elsewhere, and raises an alarm there. Every other rank's watchdog
answers the alarm with its own report, at once: a stalled rank's last step ends one step before the others' when it
stalls after the step's last collective, so the others time out a whole step later, and would be taken for dead had
the first one waited for their own timeouts. It then reads the reports, names the suspects, and exits the process. A
rank in a checkpoint save does not time out, but says so in the same place, so that it is not taken for a dead one. A
rank restoring a checkpoint does time out (were every rank's storage down, none would ever report), and is named as
restoring. Nothing is written per step: the training loop pays nothing.

A rank that dies makes a collective fail on the others: each runs the same reports at once, and names the rank that
sends none by the host and pid all ranks shared at the start, in place of gloo's or NCCL's error. A *frozen* rank
(stopped, or stuck in a call that holds the GIL) runs no watchdog and ignores torchrun's SIGTERM, which torchrun
follows with SIGKILL only 30 s later, and no rank on another host can end it. So in a job of several ranks each
watchdog starts a guard, a small process beside its rank, and renews every poll a deadline GUARD_POLLS polls past its
timeout after its last progress; past it, the guard SIGKILLs the rank. Every node thus ends its own frozen ranks,
whatever the launcher. The rank that reports also writes its report into torchrun's error file: torchrun's failure
summary, the job's last words, quotes it.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdp_trainer.distributed import BACKSTOP_S, logger

EXIT_HANG = 3
# The longest a watchdog waits between looks, and for a call to the c10d store: the time to report is a few of them.
POLL_S = 2.0
# Polls after a rank's timeout at which its guard kills it: one to notice, two for the other ranks' reports, two to
# spare (a store that does not answer, the GPU probe).
GUARD_POLLS = 5
# Per torchrun restart: a restarted job must not read the reports or the alarm of the attempt before.
ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
REPORT = f"fsdp_trainer/stalled/{ATTEMPT}/{{}}"
ALARM = f"fsdp_trainer/stalled/{ATTEMPT}/alarm"  # set by the first watchdog to time out: the others report at once
# What a rank does while its watchdog is paused, as its report says.
CHECKPOINTING, WRITING_PROFILE = "checkpointing", "writing a profile"
# What a rank busy in watched work does (Watchdog.doing), as its report says.
RESTORING = "restoring a checkpoint"
# Calls whose line, as the innermost frame of a stalled main thread, means it waits for the GPU (which may wait for
# a peer in a collective) or for a collective of its own. Python cannot see which C call a frame is in.
_WAITS = (".item()", ".tolist()", "synchronize(", ".wait()")
# DCP's file storage reads and writes files and calls no collective: a main thread inside it does I/O (on a rank whose
# storage hangs, say), not a wait for a peer, though torch.distributed is on its stack.
_DCP_STORAGE = os.path.join("torch", "distributed", "checkpoint", "filesystem.py")
# The guard (see the module's docstring), standard library only: it reads lines "<monotonic deadline> <last words>"
# from its rank, prints the last words and SIGKILLs the rank once the latest deadline has passed, and ends with it.
# It ignores the stop signals that torchrun sends the rank's whole process group: the rank decides.
_GUARD = """if True:
    import os, select, signal, sys, time
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    rank, deadline, words = os.getppid(), float("inf"), ""
    while os.getppid() == rank:
        if select.select([0], [], [], min(1.0, max(0.0, deadline - time.monotonic())))[0]:
            lines = os.read(0, 65536).decode().splitlines()
            if not lines:
                break
            deadline, words = lines[-1].split(" ", 1)
            deadline = float(deadline)
        elif time.monotonic() > deadline and os.getppid() == rank:
            print(words, file=sys.stderr, flush=True)
            os.kill(rank, signal.SIGKILL)
            break
"""


# Where NCCL writes its flight-recorder dumps, <prefix><rank>: torch reads the prefix from the first of these set.
DUMP_PREFIX_VARIABLES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
# The watchdog's own dump goes beside NCCL's as watchdog_rank<r>. Not at NCCL's <prefix><rank>: NCCL writes there on
# its own timeout, or on another rank's, and one dump would overwrite the other. Nor may the name hold NCCL's file
# prefix (the trainer's rank_): torch's analyser, `torchfrtrace DIR --prefix P`, reads every file whose name holds P.
WATCHDOG_DUMP = "watchdog_rank"


def spans(ranks: list[int]) -> str:
    """Ascending ranks as runs, "0-3, 5, 7-8": a job of thousands of ranks fits a line."""
    runs = [[r for _, r in run] for _, run in itertools.groupby(enumerate(ranks), lambda ir: ir[1] - ir[0])]
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def enable_flight_recorder(output_dir: Path) -> None:
    """Ask NCCL's process groups (created after this call) to record their last collectives and dump them
    to <output_dir>/flight_recorder/rank_<r> on a timeout; the watchdog's own dump goes beside them (WATCHDOG_DUMP).
    Settings already in the environment win."""
    folder = output_dir.resolve() / "flight_recorder"
    folder.mkdir(parents=True, exist_ok=True)
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:  # the deprecated name, if a user set it, wins too
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if not any(name in os.environ for name in DUMP_PREFIX_VARIABLES):  # a user's, under either name, wins
        os.environ["TORCH_FR_DUMP_TEMP_FILE"] = str(folder / "rank_")


def _dump_flight_recorder(rank: int) -> Optional[Path]:
    prefix = next((os.environ[name] for name in DUMP_PREFIX_VARIABLES if name in os.environ), None)
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None) or \
        getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if not prefix or dump is None or not torch.cuda.is_available():
        return None
    try:
        path = Path(os.path.dirname(prefix), f"{WATCHDOG_DUMP}{rank}")
        path.write_bytes(dump())
        return path
    except Exception:  # noqa: BLE001 - the report below matters more than the dump
        return None


class Watchdog:
    """Ends this process when it makes no progress for the timeout, or when a collective fails because a peer died,
    after saying which ranks to suspect; its guard ends it if frozen. Watches from its creation until stop(), or the
    end of a `with` block on it, which reports a collective's failure that ends the block."""

    def __init__(self, rank: int, world_size: int, init_timeout_s: float, timeout_s: float, mesh: DeviceMesh):
        self.rank, self.world_size = rank, world_size
        # This thread's device: the watchdog's own thread would otherwise see device 0.
        self.device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else None
        self.init_timeout_s, self.timeout_s = init_timeout_s, timeout_s
        self.poll = min(POLL_S, timeout_s / 4)
        self.store = _Impatient(dist.distributed_c10d._get_default_store(), self.poll)
        # Each rank's (host, pid), to name a rank that sends no report, or that hosted a store gone with it.
        self.peers: list = [None] * world_size
        dist.all_gather_object(self.peers, (socket.gethostname(), os.getpid()))
        # The mesh's sub-groups (HSDP) start with the backend's default timeout (NCCL 10 min, gloo 30), not the
        # default group's: every group gets the same timeouts.
        self.groups = [None, *(mesh.get_group(dim) for dim in range(mesh.ndim))]
        self._set_group_timeouts(init_timeout_s + BACKSTOP_S)
        self.step, self.timeout, self.steady = 0, init_timeout_s, False
        self.last_progress = time.monotonic()
        self.paused_for: tuple[str, ...] = ()  # what this rank does meanwhile (replaced whole: read by _watch)
        self.doing_now: Optional[str] = None  # set by doing()
        self.stopped = threading.Event()
        self.ending = threading.Lock()  # held by the thread that reports and ends the process
        # Only where other ranks wait for this one: a process alone holds up no job, and torchrun no grace.
        self.guard = (subprocess.Popen([sys.executable, "-I", "-S", "-c", _GUARD], stdin=subprocess.PIPE, bufsize=0)
                      if world_size > 1 else None)
        self.thread = threading.Thread(target=self._watch, name="fsdp_trainer-watchdog", daemon=True)
        self.thread.start()

    def beat(self, step: int) -> None:
        """Record that `step` finished. After the first one, switch to the steady-state timeout and make the
        process group's own timeout a backstop just behind it."""
        self.step, self.last_progress = step, time.monotonic()
        if not self.steady:
            self.steady, self.timeout = True, self.timeout_s
            self._set_group_timeouts(self.timeout_s + BACKSTOP_S)
            self._renew_guard(self.last_progress)  # now: the deadline it holds is dist.init_timeout_s's

    def _set_group_timeouts(self, seconds: float) -> None:
        for group in self.groups:
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)

    @contextmanager
    def doing(self, activity: str):
        """For work whose time counts, as a step's does: the restore of a checkpoint (RESTORING). If this rank is
        busy in it when a deadline passes, not waiting in a collective, its report names the activity. Not a pause:
        were every rank stuck in it (their storage down), no other watchdog would end the job."""
        self.doing_now = activity
        try:
            yield
        finally:
            self.doing_now = None

    @contextmanager
    def paused(self, activity: str = CHECKPOINTING):
        """For work that may legitimately take long without steps: checkpoint saves, writing a profile.
        Meanwhile this rank's report says what it does (see _watch and report)."""
        self.paused_for = (*self.paused_for, activity)
        try:
            yield
        finally:
            self.last_progress = time.monotonic()  # first: the watchdog must not see an old one once unpaused
            self.paused_for = self.paused_for[:-1]

    def stop(self) -> None:
        self.stopped.set()

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and _peer_failed(exc):
            self._end(f"a collective failed ({_first_words(exc)})")
        self.stop()

    def _watch(self) -> None:
        published, answered = None, False
        while not self.stopped.wait(self.poll):
            # A rank in a save may wait there for a hung peer: it publishes that, and withdraws it afterwards, so
            # that the hung rank's report does not call it dead. From this thread, so that a save pays nothing.
            paused_for = self.paused_for
            activity = paused_for[-1] if paused_for else None
            self._renew_guard(time.monotonic() if activity else self.last_progress)
            if activity != published:
                self._publish_activity(activity)
                published = activity
            if activity:
                continue
            if time.monotonic() - self.last_progress < self.timeout:
                answered = answered or self._answer_alarm()
                continue
            self._end()
            return
        if self.guard is not None:
            self._renew_guard(float("inf"))  # never, should the pipe stay open in a loader worker forked from here
            self.guard.stdin.close()
        self.store.caller.shutdown(wait=False)

    def _renew_guard(self, since: float) -> None:
        """Have the guard kill this rank GUARD_POLLS polls after its timeout from `since`, unless renewed before."""
        if self.guard is None:
            return
        waited = self.timeout + GUARD_POLLS * self.poll
        words = (f"rank {self._named(self.rank)} is frozen: neither its steps nor its watchdog moved for {waited:.0f} "
                 "s (it is stopped, or stuck in a call that holds the GIL); its guard kills it")
        try:
            self.guard.stdin.write(f"{since + waited} {words}\n".encode())
        except OSError:  # the guard is gone: only torchrun's own SIGKILL is left
            pass

    def _end(self, cause: Optional[str] = None) -> None:
        """Say which ranks to suspect, in the log and in torchrun's error file, and exit the process: on a timeout
        (`cause` None), or on what failed in the main thread (`cause`)."""
        if not self.ending.acquire(blocking=threading.current_thread() is threading.main_thread()):
            return  # the main thread reports
        state, location = self._where() if cause is None else ("waiting", "")
        try:
            # Say where this rank is stuck, raise the alarm, and give the other ranks' watchdogs two polls to report.
            self._publish_report(state, location, within_timeout=cause is not None)
            self.store.set(ALARM, str(self.rank))
            self._wait_for_reports(2 * self.poll)
            message = self.report(cause)
        except Exception as err:  # noqa: BLE001 - the store lives on rank 0's host; it may be gone too
            message = self._unreachable(err, state, location, cause)
        dumped = _dump_flight_recorder(self.rank)
        if dumped:
            logger.error(f"rank {self.rank}: flight recorder trace written to {dumped}; the watchdog names its "
                         f"dumps {WATCHDOG_DUMP}<rank>, apart from those NCCL writes on its own timeout "
                         f"(`torchfrtrace {dumped.parent} --prefix {WATCHDOG_DUMP}` reads the watchdog's)")
        logger.error(message)  # last: the line to read
        _tell_torchrun(message)
        for handler in logger.handlers:
            handler.flush()
        os._exit(EXIT_HANG)

    def _where(self) -> tuple[str, str]:
        state, location = _main_thread_location()
        if state == "busy" and not self._gpu_drains():
            # Under NCCL the CPU of a rank whose peer hangs is stopped by its GPU (in the autograd engine, or
            # launching into a full queue), not in a wait of its own: its GPU is what waits, in a collective.
            state = "waiting"
        if state == "busy" and self.doing_now:
            state = self.doing_now
        return state, location

    def _publish_report(self, state: str, location: str, within_timeout: bool) -> None:
        self.store.set(REPORT.format(self.rank), json.dumps([self.step, state, location, within_timeout]))

    def _answer_alarm(self) -> bool:
        """If another rank's watchdog has timed out, report where this one is, as still within its own timeout;
        True once done, or once this rank's main thread reports itself (_end)."""
        if not self.ending.acquire(blocking=False):
            return True
        try:
            if not self.store.check([ALARM]):
                return False
            self._publish_report(*self._where(), within_timeout=True)
            return True
        except Exception:  # noqa: BLE001 - an unreachable store is reported by the rank that timed out
            return False
        finally:
            self.ending.release()

    def _wait_for_reports(self, seconds: float) -> None:
        """Until every rank has reported, or `seconds` have passed (a dead rank never reports)."""
        keys = [REPORT.format(r) for r in range(self.world_size)]
        deadline = time.monotonic() + seconds
        while not self.store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.1)

    def _gpu_drains(self) -> bool:
        """Whether this rank's GPU finishes the work queued on it within a second (True without a GPU). Probed
        from a thread of its own: with the launch queue full, even recording an event blocks."""
        if self.device is None:
            return True
        drained = []

        def probe() -> None:
            try:
                with torch.cuda.device(self.device):  # a new thread starts on device 0
                    event = torch.cuda.Event()
                    event.record(torch.cuda.default_stream(self.device))
                    deadline = time.monotonic() + 1.0
                    while not event.query() and time.monotonic() < deadline:
                        time.sleep(0.01)
                    drained.append(event.query())
            except Exception:  # noqa: BLE001 - no answer from the GPU is no evidence that it waits
                drained.append(True)

        thread = threading.Thread(target=probe, name="fsdp_trainer-gpu-probe", daemon=True)
        thread.start()
        thread.join(timeout=2.0)
        return bool(drained and drained[0])

    def _publish_activity(self, activity: Optional[str]) -> None:
        """Say in this rank's report what it does while paused, or with None stop saying it."""
        try:
            if activity:
                self._publish_report(activity, _main_thread_location()[1], within_timeout=True)
            else:
                self.store.delete_key(REPORT.format(self.rank))
        except Exception as err:  # noqa: BLE001 - the store lives on rank 0's host; without it, nobody reads this
            logger.warning(f"rank {self.rank}: the c10d store cannot be reached ({err}); a hang while it is "
                           f"{activity or 'paused'} would be reported without this rank")

    def _unreachable(self, err: BaseException, state: str, location: str, cause: Optional[str]) -> str:
        """This rank's own report, for when the others' cannot be read: the store's host is the suspect."""
        if cause is None:
            where = "waiting in a collective or GPU sync" if state == "waiting" else state
            cause = f"no progress for {time.monotonic() - self.last_progress:.0f} s ({where}, at {location})"
        # torchrun's store on the rendezvous host, or, where the launch scripts turn its sharing off, rank 0's
        host = ("torchrun on the rendezvous host" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else
                f"rank(s): {self._named(0)}")
        return (f"rank {self.rank}: {cause} after step {self.step}, and the c10d store cannot be reached ({err}), so "
                f"the other ranks' reports cannot be read; suspect {host}, which hosts the store: dead, frozen, or "
                "its host unreachable")

    def _named(self, rank: int) -> str:
        host, pid = self.peers[rank]
        return f"{rank} on host {host} (pid {pid})"

    def report(self, cause: Optional[str] = None) -> str:
        """Which ranks to suspect: behind the others, busy outside any collective or GPU sync (restoring a
        checkpoint, writing a profile, or elsewhere), or silent; and which of the others wait. `cause`: what failed
        on this rank (a collective), for a report on a failure rather than a timeout."""
        waited = time.monotonic() - self.last_progress
        reports = {}
        for r in range(self.world_size):
            key = REPORT.format(r)
            try:
                reports[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except dist.DistStoreError:
                if self.store.check([key]):  # the store itself fails
                    raise
                # Withdrawn between the check and the read: the rank left a checkpoint save just now, so it lives.
        high = max(report[0] for report in reports.values() if report)
        behind = any(report and report[0] < high for report in reports.values())
        suspects = {}
        for r, report in reports.items():
            if report is None:
                suspects[r] = "sent no report (dead, frozen, or its host unreachable)"
            elif report[1] == WRITING_PROFILE:  # behind, and why: the others wait for it in their next step
                suspects[r] = f"still writing its profile, at {report[2]}; profile fewer steps (profile.steps)"
            elif report[1] == RESTORING:  # before any step: no rank is behind, the others wait for it in the restore
                suspects[r] = f"still restoring a checkpoint, at {report[2]}; check its storage"
            elif report[0] < high:
                suspects[r] = f"finished step {report[0]} while others finished step {high}"
            # Busy: a suspect, unless a rank behind explains the stall and this one, answering the alarm within its
            # own timeout, is busy with the steps it ran ahead.
            elif report[1] == "busy" and not (behind and report[3:] == [True]):
                suspects[r] = f"busy outside any collective or GPU sync, at {report[2]}"
        if suspects:
            verdict = "suspect rank(s): " + "; ".join(f"{self._named(r)}: {why}" for r, why in sorted(suspects.items()))
            waiting = [r for r, report in reports.items() if r not in suspects and report[1] == "waiting"]
            if waiting:
                verdict += f". Rank(s) {spans(waiting)} wait in a collective or GPU sync"
        else:
            verdict = (f"every rank finished step {high} and waits in a collective, a GPU sync or a checkpoint "
                       "save: a communication problem; run `python -m fsdp_trainer.tools.doctor` on these nodes")
        if cause:
            return f"rank {self.rank}: {cause} after step {self.step}; {verdict}."
        slow, flag = (("steps are", "dist.timeout_s") if self.steady else
                      ("start-up (a restore, compilation, the first step) is", "dist.init_timeout_s"))
        return (f"rank {self.rank}: no progress for {waited:.0f} s (timeout {self.timeout:.0f} s); {verdict}. "
                f"If {slow} legitimately this slow, raise {flag}.")


class _Impatient:
    """A c10d store whose calls raise TimeoutError after `seconds`. The store lives in rank 0 under the launch
    scripts, and a client of a frozen one waits for its answer forever, whatever the store's timeout."""

    def __init__(self, store: dist.Store, seconds: float):
        self.store, self.seconds = store, seconds
        self.caller = ThreadPoolExecutor(1, thread_name_prefix="fsdp_trainer-store")  # one call at a time

    def __getattr__(self, name: str):
        def call(*args):
            try:
                return self.caller.submit(getattr(self.store, name), *args).result(timeout=self.seconds)
            except TimeoutError:
                raise TimeoutError(f"no answer within {self.seconds:g} s") from None
        return call


def _peer_failed(err: BaseException) -> bool:
    """Whether `err` is a collective's failure, as when a peer died: NCCL's, or gloo's (a RuntimeError that names
    gloo's source file first), not an error of the package that quotes one."""
    return isinstance(err, dist.DistError) or (type(err) is RuntimeError and bool(re.match(r"\[[^\]]*gloo", str(err))))


def _first_words(err: BaseException) -> str:
    """An error's first sentence, without gloo's "[source:line] " before it."""
    return re.sub(r"^\[[^\]]*\] ", "", str(err)).split("\n")[0].split(". ")[0]


def _tell_torchrun(message: str) -> None:
    """Make `message` this rank's entry in torchrun's failure summary (its error file, in the format torch's
    ErrorHandler.record_exception writes): the process ends without an exception that @record could write."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        entry = {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}
        try:
            Path(path).write_text(json.dumps({"message": entry}))
        except OSError:
            pass


def _main_thread_location() -> tuple[str, str]:
    """("waiting" (in torch.distributed, but not in DCP's file storage, or in a call of _WAITS) or "busy",
    innermost frame) of this process's main thread."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    stack = traceback.extract_stack(frame) if frame else []
    if not stack:
        return "busy", "unknown"
    # Only what the training loop called counts (torchrun's error-recording wrapper sits above it).
    loop = max((i for i, f in enumerate(stack) if f.filename.endswith(f"fsdp_trainer{os.sep}train.py")), default=-1)
    in_storage = any(f.filename.endswith(_DCP_STORAGE) for f in stack[loop + 1:])
    last = stack[-1]
    waiting = ((not in_storage and any(f"torch{os.sep}distributed" in f.filename for f in stack[loop + 1:]))
               or any(call in (last.line or "") for call in _WAITS))
    return "waiting" if waiting else "busy", f"{last.name} ({Path(last.filename).name}:{last.lineno})"


# The calls on train_step's (train.py) lines, and the part of the step each is; any other line is the forward.
_STEP_CALLS = {".backward(": "backward", "unscale_(": "float16 unscaling", "clip_grad_norm(": "gradient clipping",
               "optimizer.step(": "optimizer step", ".step(optimizer": "optimizer step", "zero_grad(": "zero_grad"}


def oom_phase(err: BaseException) -> str:
    """The part of the training step that raised `err`, from the line of train_step that made the failing call
    (whatever wrappers, such as no_grad's or the optimizer's hooks, lie below it): backward, optimizer step...,
    the forward (the model or the loss), or "the training loop" outside train_step."""
    frames = traceback.extract_tb(err.__traceback__)
    step = next((frame for frame in frames if frame.name == "train_step"), None)
    if step is None:
        return "the training loop"
    if step is frames[-1]:
        return "the training step"
    return next((phase for call, phase in _STEP_CALLS.items() if call in (step.line or "")), "forward")


# The units of the caching allocator's format_size: "512 bytes", then KiB, MiB and GiB (2048.00 GiB beyond).
_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def requested_bytes(err: BaseException) -> int:
    """The size of the allocation that failed, from the caching allocator's message ("Tried to allocate 2.00 GiB");
    0 where the message has none."""
    found = re.search(r"Tried to allocate ([0-9.]+) (bytes|KiB|MiB|GiB)", str(err))
    return int(float(found[1]) * _UNITS[found[2]]) if found else 0


def describe_oom(err: BaseException, rank: int, device: torch.device, planned_bytes: Optional[int],
                 suggestion: Optional[str], snapshot_dir: Optional[Path]) -> str:
    """One message for a CUDA out-of-memory: where it happened, measured vs planned peak, and what to change."""
    phase = oom_phase(err)
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    capacity = torch.cuda.get_device_properties(device).total_memory / 2**30
    parts = [f"rank {rank}: CUDA out of memory during {phase}; peak allocated {peak:.1f} GiB of {capacity:.1f} GiB"]
    if planned_bytes:
        parts.append(f"the memory plan predicted {planned_bytes / 2**30:.1f} GiB")
    if suggestion:
        parts.append(f"suggestion: {suggestion}")
    elif planned_bytes:
        parts.append("no change the planner tries lowers the plan by the allocation that failed: `python -m "
                     "fsdp_trainer.tools.plan` with the same flags and a smaller --gpu-memory lists what each change frees")
    if snapshot_dir is not None:
        snapshot_dir.mkdir(parents=True, exist_ok=True)
        path = snapshot_dir / f"oom_snapshot_rank{rank}.pickle"
        with open(path, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        parts.append(f"memory snapshot (open in pytorch.org/memory_viz): {path}")
    return "; ".join(parts)
