"""The step-phase timer: time per phase per step, the gaps between steps excluded."""

from __future__ import annotations

import time

import torch

from fsdp_trainer.metrics import PhaseTimer


def test_phases_are_averaged_per_step_and_the_time_between_steps_is_left_out():
    timer = PhaseTimer(torch.device("cpu"))
    for _ in range(2):
        timer.begin_step()
        for _ in range(2):  # two micro-batches: the phases add up within a step
            time.sleep(0.01)
            timer.lap("data")
            time.sleep(0.03)
            timer.lap("forward_backward")
        time.sleep(0.02)
        timer.lap("optimizer")
        time.sleep(0.3)  # logging, checkpoints: no phase
    phases = timer.read()
    assert set(phases) == {"data_ms", "forward_backward_ms", "optimizer_ms"}
    assert 20 <= phases["data_ms"] < 150
    assert 60 <= phases["forward_backward_ms"] < 190
    assert 20 <= phases["optimizer_ms"] < 150
    assert timer.read() == {}  # read starts a new window
