"""Metrics: the step-phase timer, throughput and MFU, the console line, TensorBoard after a resume."""

from __future__ import annotations

import time
import types
from pathlib import Path

import pytest
import torch

from fsdp_trainer.metrics import PhaseTimer, _duration

from helpers import run_ranks


def test_phases_are_averaged_per_step_and_the_time_between_steps_is_left_out(monkeypatch):
    # A clock that moves only when told to, so that the phases come out exact however busy the machine is.
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])

    def sleep(seconds: float) -> None:
        now[0] += seconds

    timer = PhaseTimer(torch.device("cpu"))
    for _ in range(2):
        timer.begin_step()
        for _ in range(2):  # two micro-batches: the phases add up within a step
            sleep(0.01)
            timer.lap("data")
            sleep(0.03)
            timer.lap("forward_backward")
        sleep(0.02)
        timer.lap("optimizer")
        sleep(1.0)  # logging, checkpoints: no phase
    phases = timer.read()
    assert phases == pytest.approx({"data_ms": 20, "forward_backward_ms": 60, "optimizer_ms": 20})
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
    ("NVIDIA GeForce RTX 4090", 165e12), ("NVIDIA GeForce RTX 3090", 71e12), ("NVIDIA H800 PCIe", 756e12),
    ("Tesla V100-PCIE-32GB", 112e12), ("Tesla V100S-PCIE-32GB", 130e12),
])
def test_peak_flops_match_whole_card_names(monkeypatch, name, peak):
    from fsdp_trainer import metrics

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert metrics.peak_flops(torch.device("cuda")) == peak


def test_tensorboard_after_a_resume_shows_each_step_once(monkeypatch, tmp_path):
    """A run killed at step 14 and resumed from its step-10 checkpoint logs steps 11-14 again: TensorBoard must
    show the second run's values there, once, as metrics.jsonl does."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fsdp_trainer import metrics

    for loss, start, stop in ((1.0, 0, 14), (2.0, 10, 30)):
        # Event files are read in name order, and named by the second they are opened in: the second run's later,
        # as it would be.
        monkeypatch.setattr(time, "time", lambda: 1e9 + 60 * loss)
        m = metrics.Metrics(device=torch.device("cpu"), total_steps=30, tokens_per_step=8, world_size=1,
                            flops_per_token=6, output_dir=tmp_path, tensorboard=True, is_main=True)
        m.start(start)
        for step in range(start + 1, stop + 1):
            m.log(step, loss, 1.0, 1e-3)
        m.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert scalars == [(step, 1.0) for step in range(1, 11)] + [(step, 2.0) for step in range(11, 31)]


def test_tflops_and_mfu_follow_the_tokens_per_second_of_each_window(monkeypatch, tmp_path):
    """TFLOPs/GPU = tokens/s/GPU x FLOPs per token / 1e12, and MFU = that / the GPU's peak, per logging window:
    here on an A100 (312 TFLOP/s), and on the CPU, which has no peak, on a clock that moves only when told to."""
    from fsdp_trainer import metrics

    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(metrics, "memory_gib", lambda device: {})

    def rows(device: str, seconds_per_window: list[float]) -> list[dict]:
        """8 GPUs, 8000 tokens and 6.24e9 FLOPs per token: the rows of 10-step windows of the given lengths."""
        m = metrics.Metrics(device=torch.device(device), total_steps=100, tokens_per_step=8000, world_size=8,
                            flops_per_token=6.24e9, output_dir=tmp_path, tensorboard=False, is_main=False)
        m.start(0)
        logged = []
        for window, seconds in enumerate(seconds_per_window, 1):
            now[0] += seconds
            logged.append(m.log(10 * window, 1.0, 1.0, 1e-3))
        return logged

    # 10 steps x 8000 tokens / 2 s / 8 GPUs = 5000 tokens/s/GPU; x 6.24e9 FLOPs = 31.2 TFLOP/s, 10% of 312. The
    # next 10 steps in 4 s: half of each.
    a100 = rows("cuda", [2.0, 4.0])
    assert [r["tokens_per_s_per_gpu"] for r in a100] == pytest.approx([5000, 2500])
    assert [r["tflops_per_gpu"] for r in a100] == pytest.approx([31.2, 15.6])
    assert [r["mfu"] for r in a100] == pytest.approx([0.10, 0.05])
    [cpu] = rows("cpu", [2.0])
    assert cpu["tflops_per_gpu"] == pytest.approx(31.2) and "mfu" not in cpu


def console_metrics(monkeypatch, tmp_path, total_steps: int):
    """One rank's Metrics printing into `lines`, on a clock `now` that moves only when told to; no GPU memory."""
    from fsdp_trainer import metrics

    now, lines = [100.0], []
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(metrics, "memory_gib", lambda device: {})
    monkeypatch.setattr(metrics, "logger", types.SimpleNamespace(info=lines.append))
    m = metrics.Metrics(device=torch.device("cpu"), total_steps=total_steps, tokens_per_step=8, world_size=1,
                        flops_per_token=6, output_dir=tmp_path, tensorboard=False, is_main=True)
    return m, now, lines


def test_a_resumed_run_s_eta_is_its_remaining_steps_at_its_own_pace(monkeypatch, tmp_path):
    """Resumed at step 10 of 30, 10 steps in 10 s: 10 steps left take 10 s more (the steps before the resume were
    not timed, and the ones done since are not left to do)."""
    m, now, lines = console_metrics(monkeypatch, tmp_path, total_steps=30)
    m.start(10)
    now[0] += 10.0
    m.log(20, 1.0, 1.0, 1e-3)
    assert lines[-1].startswith("step 20/30 | ") and lines[-1].endswith(" | elapsed 0:00:10 eta 0:00:10"), lines


def test_the_eta_leaves_out_the_first_window_s_one_off_costs(monkeypatch, tmp_path):
    """Step 1 compiles for 120 s, then every step takes 3 s: from the second logged window on, the ETA is the steps
    left at 3 s each, not at the average that the compilation inflates (130 s / 10 steps at step 10, say)."""
    m, now, lines = console_metrics(monkeypatch, tmp_path, total_steps=1000)
    m.start(0)
    now[0] += 120.0 + 9 * 3.0
    m.log(10, 1.0, 1.0, 1e-3)
    assert lines[-1].endswith(f"eta {_duration(147.0 / 10 * 990)}"), lines  # no other pace known yet
    for step in (20, 30):
        now[0] += 10 * 3.0
        m.log(step, 1.0, 1.0, 1e-3)
        assert lines[-1].endswith(f"eta {_duration(3.0 * (1000 - step))}"), lines


def phases_over_two_ranks(data_ms: list[float]) -> tuple[dict, list[str]]:
    """On each of 2 gloo ranks: a logging step at which this rank waited data_ms[rank] for its data; the row it
    got, and the lines rank 0 printed."""
    import torch.distributed as dist

    from fsdp_trainer import distributed, metrics

    info = distributed.init(60)
    lines: list[str] = []
    metrics.logger = types.SimpleNamespace(info=lines.append)
    m = metrics.Metrics(device=torch.device("cpu"), total_steps=10, tokens_per_step=8, world_size=2,
                        flops_per_token=6, output_dir=Path("."), tensorboard=False, is_main=info.is_main)
    m.start(0)
    rank = dist.get_rank()
    m.phases.read = lambda: {"data_ms": data_ms[rank], "forward_backward_ms": 500.0 + 10 * rank,
                             "optimizer_ms": 20.0 - rank}
    return m.log(5, 1.0, 1.0, 1e-3), lines


@pytest.mark.slow
@pytest.mark.parametrize("slow", [0, 1])
def test_the_logged_phase_times_are_the_slowest_rank_s_and_name_the_rank_that_waited_for_data(slow):
    """A rank whose data are slow stalls the others in the next collective, where its wait would count as their
    forward and backward: every rank's row holds each phase's largest time over the ranks, and the rank that
    waited longest for data, which rank 0's line names (rank 1's wait is not lost in rank 0's row, nor rank 0's
    in rank 1's)."""
    waits = [0.8, 0.8]
    waits[slow] = 325.9
    results = run_ranks(phases_over_two_ranks, 2, waits)
    for row, _ in results:
        assert (row["data_ms"], row["data_rank"]) == (325.9, slow)
        assert (row["forward_backward_ms"], row["optimizer_ms"]) == (510.0, 20.0)
    assert "ms/step data 325.9 (rank %d) fwd+bwd 510 optim 20" % slow in results[0][1][-1], results[0][1]
    assert results[1][1] == []  # only rank 0 prints
