"""The step-phase timer: time per phase per step, the gaps between steps excluded."""

from __future__ import annotations

import time

import pytest
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
        time.sleep(1.0)  # logging, checkpoints: no phase (far above the bounds below, so a leak cannot hide)
    phases = timer.read()
    assert set(phases) == {"data_ms", "forward_backward_ms", "optimizer_ms"}
    assert 20 <= phases["data_ms"] < 150
    assert 60 <= phases["forward_backward_ms"] < 190
    assert 20 <= phases["optimizer_ms"] < 150
    assert timer.read() == {}  # read starts a new window


def test_allocator_retries_are_recorded_and_warned_about_once(monkeypatch, tmp_path):
    """A capped allocator that empties its cache and retries keeps running, only slowly: say so, once."""
    import logging

    from fsdp_trainer import metrics
    from fsdp_trainer.distributed import logger

    retries = iter([0, 3, 9])
    monkeypatch.setattr(metrics, "memory_gib", lambda device: {"mem_active_gib": 40.0, "mem_reserved_gib": 47.0,
                                                               "alloc_retries": next(retries)})
    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger.addHandler(handler)
    try:
        m = metrics.Metrics(device=torch.device("cpu"), total_steps=30, tokens_per_step=8, world_size=1,
                            flops_per_token=6, output_dir=tmp_path, tensorboard=False, is_main=False)
        m.start(0)
        rows = [m.log(step, 1.0, 1.0, 1e-3) for step in (10, 20, 30)]
    finally:
        logger.removeHandler(handler)
    assert [r["alloc_retries"] for r in rows] == [0, 3, 9]
    assert len(warnings) == 1 and "by step 20" in warnings[0] and "run out 3 times" in warnings[0]


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989e12),
    ("NVIDIA H200 NVL", 835e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A10", 125e12),
    ("NVIDIA L40S", 362e12), ("NVIDIA RTX A4000", None), ("Tesla V100-SXM2-32GB", 125e12),
])
def test_peak_flops_match_whole_card_names(monkeypatch, name, peak):
    from fsdp_trainer import metrics

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert metrics.peak_flops(torch.device("cuda")) == peak

