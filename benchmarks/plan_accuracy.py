"""The memory planner against measured peaks: predicted vs torch.cuda.max_memory_allocated() per run.

    python benchmarks/plan_accuracy.py --nproc 2 --row "1b none mb2=configs/llama3_1b.toml --ac.mode none" ...

Each row is a real `torchrun -m fsdp_trainer.train` run; the trainer logs the plan's predicted allocator peak
next to the measured one after its first logging window. Target: within 10% on every row.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

from results import result_dir, write_results
from throughput import run_variant

DEFAULT_ROWS = [
    "1b none mb1=configs/llama3_1b.toml --ac.mode none --train.micro_batch_size 1",
    "1b none mb2=configs/llama3_1b.toml --ac.mode none --train.micro_batch_size 2",
    "1b op mb4=configs/llama3_1b.toml --ac.mode op --train.micro_batch_size 4",
    "1b full mb4=configs/llama3_1b.toml --ac.mode full --train.micro_batch_size 4",
    "1b selective mb2 never=configs/llama3_1b.toml --ac.mode selective --train.micro_batch_size 2 "
    "--parallel.reshard_after_forward never",
    "8b op seq8192=configs/llama3_8b.toml --ac.mode op",
    "8b full seq8192 mb2=configs/llama3_8b.toml --ac.mode full --train.micro_batch_size 2",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--row", action="append", metavar="NAME=CONFIG FLAGS", help="default: a 1B and 8B matrix")
    args = parser.parse_args()
    args.log_every, args.warmup, args.extra = 2, 0, ["--parallel.no_compile"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.row or DEFAULT_ROWS:
            name, _, rest = spec.partition("=")
            config, *flags = shlex.split(rest)
            args.config = config
            row = run_variant(name.strip(), flags, args, Path(tmp))
            if "planned_peak_gib" in row and "measured_peak_gib" in row:
                row["error_pct"] = 100 * (row["planned_peak_gib"] / row["measured_peak_gib"] - 1)
            rows.append(row)
            print(f"{row['variant']:>28}  planned {row.get('planned_peak_gib', float('nan')):6.2f} GiB  measured "
                  f"{row.get('measured_peak_gib', float('nan')):6.2f} GiB  error {row.get('error_pct', float('nan')):+.1f}%"
                  + (f"  FAILED: {row['error']}" if "error" in row else ""), flush=True)
            # Rewritten after every row: a matrix cut off by a time limit keeps what it measured.
            write_results(result_dir(args.nproc), "plan_accuracy", rows,
                          command=shlex.join([sys.executable, *sys.argv]),
                          plot=("error_pct", "planned vs measured peak, %"))


if __name__ == "__main__":
    main()
