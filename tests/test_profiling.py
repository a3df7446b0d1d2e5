"""The profile breakdown's interval arithmetic, and a real CPU profile of training steps."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest

from fsdp_trainer import train
from fsdp_trainer.config import parse_steps
from fsdp_trainer.tools.profiling import OPTIMIZER_RANGE, breakdown, category

from helpers import TINY_FLAGS, run_forked


def kernel(name, start, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": dur}


def test_breakdown_separates_overlapped_and_exposed_communication():
    trace = {"traceEvents": [
        kernel("sm90_xmma_gemm_bf16", 0, 1000),              # compute 0-1 ms
        kernel("ncclDevKernel_AllGather_RING", 500, 1000),    # comm 0.5-1.5 ms: 0.5 ms exposed
        kernel("flash_fwd_kernel", 2000, 500),                # idle 1.5-2 ms, attention 2-2.5 ms
        kernel("ncclDevKernel_ReduceScatter", 2100, 200),     # fully hidden under attention
        kernel("multi_tensor_apply_kernel<Copy>", 2600, 100),  # FSDP's copy-out: a foreach kernel, not optimizer
        kernel("multi_tensor_apply_kernel<Norm>", 3000, 50),  # gradient clipping, in our optimizer range
        kernel("ncclDevKernel_AllReduce", 3050, 50),          # the gradient norm's all_reduce: communication
        kernel("multi_tensor_apply_kernel<Adam>", 3100, 200),  # in torch's nested Optimizer.step range
        {"ph": "X", "cat": "gpu_user_annotation", "name": "optimizer", "ts": 3000, "dur": 100},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "Optimizer.step#AdamW.step", "ts": 3100, "dur": 200},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "FSDP::copy_out", "ts": 2600, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9999},  # not a kernel: ignored
    ]}
    parts = breakdown(trace)
    assert parts["matmul"] == pytest.approx(1.0)
    assert parts["attention"] == pytest.approx(0.5)
    assert parts["communication"] == pytest.approx(1.25)
    assert parts["exposed_communication"] == pytest.approx(0.55)
    assert parts["optimizer"] == pytest.approx(0.25)
    assert parts["other"] == pytest.approx(0.1)
    assert parts["wall"] == pytest.approx(3.3)
    assert parts["idle"] == pytest.approx(0.9)  # 1.5-2, 2.5-2.6 and 2.7-3 ms


def test_kernel_categories_and_step_ranges():
    assert category("void cutlass::Kernel<cutlass_80_tensorop_bf16_s16816gemm>") == "matmul"
    assert category("cudnn_generated_fort_native_sdpa_sm90") == "attention"
    assert category("elementwise_kernel") == "other"
    # from a compiled block: RoPE and casts fused around SDPA, named after it
    assert category("triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy__unsafe_view_add_mul") == "other"
    assert parse_steps("3:5") == (3, 5)
    for bad in ("5:3", "x", "0:2"):
        with pytest.raises(ValueError, match="profile.steps"):
            parse_steps(bad)


@pytest.mark.slow
def test_profiled_run_writes_a_chrome_trace_of_exactly_its_steps(tmp_path):
    """Steps 2 to 4 of 5: three optimizer ranges in the trace, one a step (a window off by one step has two or four)."""
    out = run_forked(train.main, ["--config", "configs/debug.toml", *TINY_FLAGS, "--train.steps", "5",
                                  "--profile.steps", "2:4", "--train.output_dir", str(tmp_path),
                                  "--checkpoint.no_save_final"], timeout=300)
    assert out.returncode == 0, out.stderr
    trace = tmp_path / "profile" / "trace_rank0_steps2-4.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("aten::mm") for e in events)
    ranges = [e for e in events if e.get("name") == OPTIMIZER_RANGE and e.get("cat") == "user_annotation"]
    assert len(ranges) == 3, ranges
    assert "profile of steps 2-4 written to" in out.stderr


def test_a_window_cut_short_is_stopped_and_one_before_the_run_is_named(tmp_path, caplog):
    """A failure or stop inside the window leaves no profiler running (the next one would refuse to start), and a
    resumed run whose first step is past the window says that nothing is profiled instead of staying silent."""
    import torch

    from fsdp_trainer.tools.profiling import StepProfiler

    cut = StepProfiler("2:5", False, tmp_path, 0, torch.device("cpu"))
    cut.start(1)
    cut.before(2)
    torch.ones(4) @ torch.ones(4)
    cut.close()
    assert cut.profiler is None and not (tmp_path / "profile").exists()
    with torch.profiler.profile():  # refused while another profiler still runs
        pass

    with caplog.at_level("WARNING", logger="fsdp_trainer"):
        StepProfiler("2:5", False, tmp_path, 0, torch.device("cpu")).start(7)
    assert "profile.steps=2:5 starts before this run's first step, 7: nothing is profiled" in caplog.text


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_the_sync_after_the_window_waits_outside_the_watchdog_pause(tmp_path, monkeypatch):
    """Under NCCL the sync after the window's last step waits for that step's collectives: inside Watchdog.paused, a
    peer hung in them would go uncaught by this rank's watchdog, and this rank would be named as still writing."""
    import torch

    from fsdp_trainer.tools.profiling import StepProfiler

    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("GPU sync"))

    @contextmanager
    def paused(activity: str):
        events.append(f"paused: {activity}")
        yield
        events.append("unpaused")

    profiler = StepProfiler("2:2", False, tmp_path, 0, torch.device("cuda"))  # the patched synchronize is its GPU
    profiler.before(2)
    events.clear()
    profiler.after(2, paused)
    assert events == ["GPU sync", "paused: writing a profile", "unpaused"]
