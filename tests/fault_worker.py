"""The trainer with one injected fault, for the fault tests: inject() in a rank that helpers.train_ranks forked, or
this script under torchrun:

    python -m torch.distributed.run ... tests/fault_worker.py <fault> <rank|all> <step> -- <train flags>

Faults, at the <step>-th call of train_step on the chosen rank(s): hang, crash, nan (its loss); stall (hangs,
while the other ranks go on as they do under NCCL, whose steps only queue GPU work: they return at once, and so
next wait in the stop/save vote or a save); stall_slow (the same, where the other ranks' steps take 3 s each,
as a large model's would); term (SIGTERM to itself as the step begins, as from a scheduler); freeze, die (SIGSTOP,
SIGKILL to itself as the step begins, after printing "<signal> at <time.time()>" and its pid).
preempt: SIGUSR1 while the model is built, before the first step. slow_profile: writing the profile's trace takes
<step> seconds longer. hang_restore: reading a checkpoint's files hangs (<step> unused), as on hung storage: a resume
hangs in the restore. hang_writes: writing a checkpoint's files hangs (<step> unused), and the checkpointer's groups
time out after dist.init_timeout_s alone, not 60 s later, to keep the test short. kill_saving: SIGKILL <seconds>
after the save of step <step> was handed to DCP (<step>+<seconds>); kill_commit: SIGKILL as rank 0 is about to
write the marker of step <step> (torchrun then stops the other ranks).
"""

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.filesystem import FileSystem

from fsdp_trainer import checkpoint, train

fault, fault_step, kill_delay, chosen = "", 0, "", False
real_step, real_cross_entropy, real_build_model = train.train_step, F.cross_entropy, train.build_model
calls = 0


def faulty_step(*args, **kwargs):
    global calls
    calls += 1
    if fault in ("stall", "stall_slow") and calls >= fault_step:
        if chosen:
            time.sleep(3600)
        if fault == "stall_slow":
            time.sleep(3)
        return torch.zeros(()), torch.zeros(())
    if calls == fault_step and chosen:
        if fault == "hang":
            time.sleep(3600)
        if fault == "crash":
            raise RuntimeError("injected crash")
        if fault == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        if fault in ("freeze", "die"):
            sig = signal.SIGSTOP if fault == "freeze" else signal.SIGKILL
            print(f"[fault_worker] {sig.name} at {time.time()} to pid {os.getpid()}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), sig)
        if fault == "nan":
            F.cross_entropy = lambda *a, **k: real_cross_entropy(*a, **k) * float("nan")
            try:
                return real_step(*args, **kwargs)
            finally:
                F.cross_entropy = real_cross_entropy
    return real_step(*args, **kwargs)


def build_model_preempted(*args, **kwargs):
    if fault == "preempt" and chosen:
        os.kill(os.getpid(), signal.SIGUSR1)
    return real_build_model(*args, **kwargs)


real_export = torch.profiler.profile.export_chrome_trace


def slow_export(self, path):
    if chosen:
        time.sleep(fault_step)
    return real_export(self, path)


real_create_stream = FileSystem.create_stream


def hung_streams(direction: str):
    """FileSystem.create_stream whose files opened for `direction` ("r" or "w") hang on the chosen rank."""
    @contextmanager
    def create_stream(self, path, mode):
        if direction in mode and chosen:
            time.sleep(3600)
        with real_create_stream(self, path, mode) as stream:
            yield stream
    return create_stream


real_save, real_write_atomic = checkpoint.Checkpointer.save, checkpoint.write_atomic


def save_then_kill(self, progress):
    real_save(self, progress)
    if progress.step == fault_step and chosen:
        threading.Timer(float(kill_delay or 0), os.kill, (os.getpid(), signal.SIGKILL)).start()


def kill_before_marker(path, write):
    if path.name == checkpoint.MARKER and path.parent == checkpoint.step_dir(path.parent.parent, fault_step) and chosen:
        os.kill(os.getpid(), signal.SIGKILL)
    real_write_atomic(path, write)


def inject(kind: str, rank: str, step: str) -> None:
    """Inject fault `kind` on `rank` ("all" for every rank) at its `step` ("<step>+<seconds>" for kill_saving)."""
    global fault, fault_step, kill_delay, chosen
    fault, chosen = kind, rank in ("all", os.environ["RANK"])
    step, _, kill_delay = step.partition("+")
    fault_step = int(step)
    if fault == "kill_saving":
        checkpoint.Checkpointer.save = save_then_kill
    if fault == "kill_commit":
        checkpoint.write_atomic = kill_before_marker
    if fault == "slow_profile":
        torch.profiler.profile.export_chrome_trace = slow_export
    if fault == "hang_restore":
        FileSystem.create_stream = hung_streams("r")
    if fault == "hang_writes":
        FileSystem.create_stream = hung_streams("w")
        checkpoint.BACKSTOP_S = 0
    train.train_step, train.build_model = faulty_step, build_model_preempted


if __name__ == "__main__":
    inject(*sys.argv[1:4])
    train.main(sys.argv[sys.argv.index("--") + 1:])
