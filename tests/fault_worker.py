"""Runs the trainer with one injected fault, for tests/test_faults.py (launched under torchrun).

    python -m torch.distributed.run ... tests/fault_worker.py <hang|crash|nan> <rank|all> <step> -- <train flags>
"""

import os
import sys
import time

import torch.nn.functional as F

from fsdp_trainer import train

fault, fault_rank, fault_step = sys.argv[1], sys.argv[2], int(sys.argv[3])
train_flags = sys.argv[sys.argv.index("--") + 1:]
real_step, real_cross_entropy = train.train_step, F.cross_entropy
calls = 0


def faulty_step(*args, **kwargs):
    global calls
    calls += 1
    if calls == fault_step and fault_rank in ("all", os.environ["RANK"]):
        if fault == "hang":
            time.sleep(3600)
        if fault == "crash":
            raise RuntimeError("injected crash")
        if fault == "nan":
            F.cross_entropy = lambda *a, **k: real_cross_entropy(*a, **k) * float("nan")
            try:
                return real_step(*args, **kwargs)
            finally:
                F.cross_entropy = real_cross_entropy
    return real_step(*args, **kwargs)


train.train_step = faulty_step
train.main(train_flags)
