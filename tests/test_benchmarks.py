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
