"""The benchmark scripts' own logic that runs without a GPU: variant parsing and the kernel table."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from kernels import kernel_totals  # noqa: E402
from throughput import parse_variant  # noqa: E402


def test_variant_flags_may_start_with_environment_settings():
    assert parse_variant("compiled opAC 16 NCCL CTAs=NCCL_MAX_CTAS=16 A_B=x=y --ac.mode op") == (
        "compiled opAC 16 NCCL CTAs", {"NCCL_MAX_CTAS": "16", "A_B": "x=y"}, ["--ac.mode", "op"])
    # only leading assignments are environment; a flag's value may hold '='
    assert parse_variant("eager=--ac.mode op --data.path a=b") == (
        "eager", {}, ["--ac.mode", "op", "--data.path", "a=b"])


def test_kernel_totals_group_calls_by_category_and_name():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_256x128", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_256x128", "ts": 200, "dur": 300},
        {"ph": "X", "cat": "kernel", "name": "triton_poi_fused__scaled_dot_product_cudnn_attention_mul", "ts": 0,
         "dur": 5},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 999},
    ]}
    totals = kernel_totals(trace)
    assert totals["matmul"] == {"nvjet_sm90_tst_256x128": [100, 300]}
    assert list(totals["other"]) == ["triton_poi_fused__scaled_dot_product_cudnn_attention_mul"]
    assert "attention" not in totals


def test_plan_accuracy_runs_each_row_through_the_throughput_runner(monkeypatch, tmp_path, capsys):
    """The matrix script calls throughput.run_variant as that function is now, and reports both errors."""
    import inspect

    import plan_accuracy
    import throughput

    calls = []

    def fake_run_variant(*args, **kwargs):
        inspect.signature(throughput.run_variant).bind(*args, **kwargs)  # raises on a stale call
        calls.append(args)
        return {"variant": args[0], "planned_peak_gib": 10.0, "measured_peak_gib": 8.0,
                "planned_reserved_gib": 11.0, "mem_reserved_gib": 11.0}

    monkeypatch.setattr(plan_accuracy, "run_variant", fake_run_variant)
    monkeypatch.setattr(plan_accuracy, "result_dir", lambda gpus: tmp_path)
    monkeypatch.setattr(plan_accuracy.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(sys, "argv", ["plan_accuracy.py", "--row", "1 tiny=configs/debug.toml --ac.mode op"])
    plan_accuracy.main()
    assert [c[0] for c in calls] == ["tiny"] and calls[0][2] == ["--ac.mode", "op"]
    assert "peak: planned  10.00 GiB, measured   8.00 GiB, +25.0%" in capsys.readouterr().out
    assert (tmp_path / "plan_accuracy.json").is_file()
