"""Weak scaling: the same model and per-GPU batch on 1, 2, 4 (and 8) GPUs of one host.

    python benchmarks/scaling.py --config configs/llama3_8b.toml --gpus 1 2 4 8 -- --ac.mode op

Efficiency at N GPUs = (tokens/s/GPU at N) / (tokens/s/GPU at the smallest count measured). A count larger than
the visible GPUs is skipped, and named; a count the model does not fit on shows FAILED with the error. Without GPUs
every count runs as gloo processes on the CPU, for trying the script.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from results import exit_if_failed, print_table, write_results
from throughput import COLUMNS, VARIANT, add_window_arguments, check_windows, run_variant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8])
    add_window_arguments(parser)
    parser.add_argument("extra", nargs="*", help="train flags for every run (after --)")
    args = parser.parse_args()
    check_windows(parser, args)
    available = torch.cuda.device_count()
    counts = sorted({n for n in args.gpus if not available or n <= available})
    skipped = sorted(set(args.gpus) - set(counts))
    if skipped:
        print(f"skipped --gpus {' '.join(map(str, skipped))}: more than the {available} GPUs here", flush=True)
    if not counts:
        raise SystemExit(f"no count in --gpus fits the {available} GPUs here")
    rows, base = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            args.nproc = n
            row = {"gpus": n, **run_variant(f"{n} GPU", {}, [], args, Path(tmp))}
            if "tokens_per_s_per_gpu" in row:
                base = base or row
                row["efficiency"] = row["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
            rows.append(row)
            # After every run: a sweep cut off by a time limit keeps what it measured.
            write_results(f"scaling_{Path(args.config).stem}", rows, gpus=max(counts),
                          plot=("tokens_per_s_per_gpu", "tokens/s/GPU"))
    print_table(rows, [VARIANT, ("efficiency", "efficiency", "{:.1%}"), *COLUMNS])
    if base:
        print(f"efficiency: per-GPU throughput against {base['variant']}")
    exit_if_failed(rows)


if __name__ == "__main__":
    main()
