"""Runs the trainer with one injected fault, for tests/test_faults.py (launched under torchrun).

    python -m torch.distributed.run ... tests/fault_worker.py <fault> <rank|all> <step> -- <train flags>

Faults, at the <step>-th call of train_step on the chosen rank(s): hang, crash, nan (its loss); stall (hangs,
while the other ranks go on as they do under NCCL, whose steps only queue GPU work: they return at once, and so
next wait in the stop/save vote or a save); stall_slow (the same, where the other ranks' steps take 3 s each,
as a large model's would); term (SIGTERM to itself as the step begins, as from a scheduler).
preempt: SIGUSR1 while the model is built, before the first step. slow_profile: writing the profile's trace takes
<step> seconds longer. hang_restore: reading a checkpoint's files hangs (<step> unused), as on hung storage: a resume
hangs in the restore.
"""

import os
import signal
import sys
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.filesystem import FileSystem

from fsdp_trainer import train

fault, fault_rank, fault_step = sys.argv[1], sys.argv[2], int(sys.argv[3])
train_flags = sys.argv[sys.argv.index("--") + 1:]
real_step, real_cross_entropy, real_build_model = train.train_step, F.cross_entropy, train.build_model
chosen = fault_rank in ("all", os.environ["RANK"])
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


@contextmanager
def hung_reads(self, path, mode):
    if "r" in mode and chosen:
        time.sleep(3600)
    with real_create_stream(self, path, mode) as stream:
        yield stream


if fault == "slow_profile":
    torch.profiler.profile.export_chrome_trace = slow_export
if fault == "hang_restore":
    FileSystem.create_stream = hung_reads
train.train_step, train.build_model = faulty_step, build_model_preempted
train.main(train_flags)
