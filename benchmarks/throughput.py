"""Throughput sweep: tokens/s/GPU, TFLOPs/GPU, MFU, peak memory and the step-time breakdown (data wait,
forward+backward, optimizer; exposed communication comes from `--profile.steps`) for named variants of a config.

    python benchmarks/throughput.py --config configs/llama3_8b.toml --nproc 4 --steps 30 \\
        --variant "eager op-AC=--ac.mode op --parallel.no_compile" \\
        --variant "compiled op-AC=--ac.mode op" \\
        --variant "compiled op-AC, 16 NCCL CTAs=NCCL_MAX_CTAS=16 --ac.mode op"

A variant's flags may start with environment assignments (NAME=value), set for that run only: NCCL and CUDA
allocator settings are levers too.

Each variant is a real `torchrun -m fsdp_trainer.train` run; rates are averaged over the logging windows after
`--warmup` steps (compilation and allocator warm-up excluded). Results: a table on stdout, and JSON (+ PNG when
matplotlib is installed) in benchmarks/results/<date>-<gpu>x<count>/, with the torch version and exact commands.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from results import result_dir, write_results

COLUMNS = [("tokens/s/GPU", "tokens_per_s_per_gpu", "{:,.0f}"), ("TFLOPs/GPU", "tflops_per_gpu", "{:.1f}"),
           ("MFU %", "mfu", "{:.1%}"), ("active GiB", "mem_active_gib", "{:.1f}"),
           ("reserved GiB", "mem_reserved_gib", "{:.1f}"), ("planned reserved GiB", "planned_reserved_gib", "{:.1f}"),
           ("planned peak GiB", "planned_peak_gib", "{:.1f}"),
           ("measured peak GiB", "measured_peak_gib", "{:.1f}"), ("data ms", "data_ms", "{:.1f}"),
           ("fwd+bwd ms", "forward_backward_ms", "{:.0f}"), ("optim ms", "optimizer_ms", "{:.1f}"),
           ("alloc retries", "alloc_retries", "{:,}"),
           ("loss", "loss", "{:.3f}")]
AVERAGED = ("tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "data_ms", "forward_backward_ms", "optimizer_ms")


ENV_ASSIGNMENT = re.compile(r"[A-Z_][A-Z0-9_]*=")


def parse_variant(spec: str) -> tuple[str, dict[str, str], list[str]]:
    """'NAME=[ENV=value ...] FLAGS' -> (name, environment, train flags)."""
    name, _, flags = spec.partition("=")
    words = shlex.split(flags)
    env = {}
    while words and ENV_ASSIGNMENT.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return name.strip(), env, words


def run_variant(name: str, env: dict[str, str], overrides: list[str], args, workdir: Path) -> dict:
    out = workdir / re.sub(r"\W+", "_", name)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", "-m", "fsdp_trainer.train",
           "--config", args.config, "--train.steps", str(args.steps), "--train.log_every", str(args.log_every),
           "--train.output_dir", str(out), "--checkpoint.interval", "0", "--checkpoint.resume", "none",
           "--checkpoint.no_save_final", "--metrics.no_tensorboard", *args.extra, *overrides]
    command = shlex.join([f"{k}={v}" for k, v in env.items()] + cmd)
    print("$", command, flush=True)
    proc = subprocess.run(cmd, text=True, capture_output=True, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"})
    sys.stderr.write(proc.stderr[-3000:])
    row = {"variant": name, "command": command, "returncode": proc.returncode}
    metrics = out / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.is_file():
        row["error"] = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return row
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steady = [r for r in rows if r["step"] > args.warmup] or rows[-1:]
    for _, key, _ in COLUMNS:
        if key in AVERAGED:  # averaged over the steady windows
            values = [r[key] for r in steady if key in r]
            if values:
                row[key] = sum(values) / len(values)
        else:  # the latest value; the planned-vs-measured peak is logged once, in the first window
            values = [r[key] for r in rows if key in r]
            if values:
                row[key] = values[-1]
    return row


def print_table(rows: list[dict]) -> None:
    header = ["variant"] + [title for title, _, _ in COLUMNS]
    lines = [[r["variant"]] + [fmt.format(r[key]) if key in r else ("FAILED" if "error" in r else "-")
                               for _, key, fmt in COLUMNS] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *lines)]
    for line in [header] + lines:
        print("  ".join(str(x).rjust(w) for x, w in zip(line, widths)))
    for r in rows:
        if "error" in r:
            print(f"{r['variant']}: {r['error']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--nproc", type=int, default=1, help="GPUs (processes) per run")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=10, help="steps excluded from the averages")
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=FLAGS",
                        help="a name and the train flags that define it, after any NAME=value environment "
                        "settings for its run; repeat for each variant")
    parser.add_argument("--name", default="throughput", help="file name stem of the results")
    parser.add_argument("extra", nargs="*", help="flags added to every variant (after --)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.variant:
            rows.append(run_variant(*parse_variant(spec), args, Path(tmp)))
            print_table(rows[-1:])
            # Rewritten after every variant: a sweep cut off by a time limit keeps what it measured.
            write_results(result_dir(args.nproc), args.name, rows, command=shlex.join([sys.executable, *sys.argv]),
                          plot=("tokens_per_s_per_gpu", "tokens/s/GPU"))
    print()
    print_table(rows)


if __name__ == "__main__":
    main()
