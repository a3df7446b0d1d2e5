"""Which SDPA backend runs Llama-3 8B attention, and how fast: grouped KV heads vs KV expanded to all heads.

    python benchmarks/attention.py [--seq 8192]

Forward+backward of causal attention, 32 query heads, 8 KV heads, head dim 128, bf16, batch 1.
"""

from __future__ import annotations

import argparse
import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from results import exit_if_failed, write_results

BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
GQA = "gqa (enable_gqa)"


def time_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def fwd_bwd(attend, inputs: tuple[torch.Tensor, ...], backend) -> None:
    """One forward+backward on `backend` (None: the default choice) from fresh gradients, as after a training
    step's zero_grad(set_to_none=True): accumulating into the previous ones would time an extra add per input."""
    for t in inputs:
        t.grad = None
    with sdpa_kernel([backend]) if backend else contextlib.nullcontext():
        attend().sum().backward()


def no_kernel_expected(layout: str, backend: str, message: str) -> bool:
    # The memory-efficient kernel has no grouped-KV form: with enable_gqa=True, sdpa_kernel([EFFICIENT_ATTENTION])
    # finds no kernel to run. That is the row's answer ("no kernel" in the README's table), not a failed run.
    return layout == GQA and backend == "efficient" and message.startswith("No available kernel")


def measure(layout: str, attend, inputs: tuple[torch.Tensor, ...], backend: str) -> dict:
    """The row of `layout` on `backend`: its forward+backward ms, else why it did not run, as an error (out of
    memory, a backend that should run it is missing) unless the backend is known to have no kernel for it."""
    row = {"layout": layout, "backend": backend}
    try:
        ms = time_ms(functools.partial(fwd_bwd, attend, inputs, BACKENDS[backend]))
    except RuntimeError as err:
        message = str(err).splitlines()[0][:80]
        return {**row, ("no_kernel" if no_kernel_expected(layout, backend, message) else "error"): message}
    return {**row, "fwd_bwd_ms": round(ms, 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=8192)
    args = parser.parse_args()
    q = torch.randn(1, 32, args.seq, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, args.seq, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    layouts = {
        GQA: lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "expanded kv": lambda: F.scaled_dot_product_attention(
            q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True),
    }
    rows = [measure(layout, attend, (q, k, v), backend) for layout, attend in layouts.items() for backend in BACKENDS]
    for r in rows:
        print(f"{r['layout']:>18}  {r['backend']:>9}  {r.get('fwd_bwd_ms', r.get('no_kernel', r.get('error')))}")
    write_results("attention", rows, gpus=1)
    exit_if_failed(rows)


if __name__ == "__main__":
    main()
