"""Throughput sweep: tokens/s/GPU, TFLOPs/GPU, MFU, peak memory and the step-time breakdown (data wait,
forward+backward, optimizer; exposed communication comes from `--profile.steps`) for named variants of a config,
and, in variants that evaluate (`--eval.every`), the last evaluation's tokens/s beside training's.

    python benchmarks/throughput.py --config configs/llama3_8b.toml --nproc 4 --steps 30 \\
        --variant "eager op-AC=--ac.mode op --parallel.no_compile" \\
        --variant "compiled op-AC=--ac.mode op" \\
        --variant "compiled op-AC, 16 NCCL CTAs=NCCL_MAX_CTAS=16 --ac.mode op"

A variant's flags may start with environment assignments (NAME=value), set for that run only: NCCL and CUDA
allocator settings are levers too.

Each variant is a real `torchrun -m fsdp_trainer.train` run; rates are total tokens / total time over the logging
windows that start at or after step `--warmup` (compilation and allocator warm-up excluded) and hold no profiled step
(a variant's `--profile.steps`: its per-step breakdown is recorded as `profile_ms`). Results: a table on
stdout, and JSON (+ PNG when matplotlib is installed) in benchmarks/results/<date>-<gpu>x<count>/, with the torch
version and exact commands.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import tempfile
from pathlib import Path
from typing import Optional

from results import exit_if_failed, print_table, write_results
from runs import NO_CHECKPOINTS, command_line, error_line, run, split_environment, train_command

COLUMNS = [("tokens/s/GPU", "tokens_per_s_per_gpu", "{:,.0f}"), ("TFLOPs/GPU", "tflops_per_gpu", "{:.1f}"),
           ("MFU %", "mfu", "{:.1%}"), ("active GiB", "mem_active_gib", "{:.1f}"),
           ("reserved GiB", "mem_reserved_gib", "{:.1f}"), ("planned reserved GiB", "planned_reserved_gib", "{:.1f}"),
           ("planned peak GiB", "planned_peak_gib", "{:.1f}"),
           ("measured peak GiB", "measured_peak_gib", "{:.1f}"), ("data ms", "data_ms", "{:.1f}"),
           ("fwd+bwd ms", "forward_backward_ms", "{:.0f}"), ("optim ms", "optimizer_ms", "{:.1f}"),
           ("alloc retries", "alloc_retries", "{:,}"),
           ("loss", "loss", "{:.3f}"), ("eval tokens/s/GPU", "val/tokens_per_s_per_gpu", "{:,.0f}"),
           ("eval / train", "eval_over_train", "{:.2f}x")]
AVERAGED = ("tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "data_ms", "forward_backward_ms", "optimizer_ms")
VARIANT = ("variant", "variant", "{}")
# The trainer's line once a --profile.steps trace is written: the steps, then the breakdown per step.
PROFILED = re.compile(r"profile of steps (\d+)-(\d+) written to .*?(?:; per step: (.*))?$", re.MULTILINE)


def parse_variant(spec: str) -> tuple[str, dict[str, str], list[str]]:
    """'NAME=[ENV=value ...] FLAGS' -> (name, environment, train flags)."""
    name, _, flags = spec.partition("=")
    return (name.strip(), *split_environment(shlex.split(flags)))


def run_variant(name: str, env: dict[str, str], overrides: list[str], args, workdir: Path) -> dict:
    out = workdir / re.sub(r"\W+", "_", name)
    cmd = train_command(args.nproc, args.config, "--train.steps", str(args.steps), "--train.log_every",
                        str(args.log_every), "--train.output_dir", str(out), *NO_CHECKPOINTS, *args.extra, *overrides)
    proc = run(cmd, env)
    row = {"variant": name, "command": command_line(cmd, env), "returncode": proc.returncode}
    metrics = out / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.is_file():
        row["error"] = error_line(proc)
        return row
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    profiled = PROFILED.search(proc.stderr)
    if profiled and profiled[3]:
        row["profile_ms"] = {key: float(ms) for key, ms in re.findall(r"(\w+) ([\d.]+) ms", profiled[3])}
    try:
        row.update(steady_state(rows, args.warmup, (int(profiled[1]), int(profiled[2])) if profiled else None))
    except ValueError as err:  # the run logged fewer windows than asked (it stopped early): a failed row, not a crash
        row["error"] = str(err)
    # The others' latest values; the planned-vs-measured peak is logged once, in the first window; the last
    # evaluation's rate is past the first's compilation.
    row.update({key: r[key] for r in rows for _, key, _ in COLUMNS if key in r and key not in AVERAGED})
    if "val/tokens_per_s_per_gpu" in row and "tokens_per_s_per_gpu" in row:
        row["eval_over_train"] = row["val/tokens_per_s_per_gpu"] / row["tokens_per_s_per_gpu"]
    return row


def steady_state(rows: list[dict], warmup: int, profiled: Optional[tuple[int, int]] = None) -> dict:
    """The AVERAGED metrics over the logging windows that start at or after step `warmup`, all their steps together:
    rates as total tokens / total time, phases as total time / total steps. A window that starts earlier would
    count compilation and the allocator's warm-up; one that holds a step of `profiled` (first, last), the
    profiler's overhead and the seconds spent writing its trace."""
    starts = [0] + [r["step"] for r in rows[:-1]]
    steady = [(r["step"] - start, r) for start, r in zip(starts, rows)
              if start >= warmup and not (profiled and start < profiled[1] and r["step"] >= profiled[0])]
    if not steady:
        raise ValueError(f"no logging window starts at or after step {warmup} (--warmup)"
                         + (f" and holds none of the profiled steps {profiled[0]}-{profiled[1]}" if profiled else "")
                         + ", so no rate excludes warm-up: run more steps, or log more often")
    averaged = {}
    for key in AVERAGED:
        windows = [(steps, r[key]) for steps, r in steady if key in r]
        if not windows:
            continue
        steps = sum(n for n, _ in windows)
        if key.endswith("_ms"):
            averaged[key] = sum(n * ms for n, ms in windows) / steps
        else:  # a window's time is proportional to its steps / its rate
            averaged[key] = steps / sum(n / rate for n, rate in windows)
    return averaged


def add_window_arguments(parser: argparse.ArgumentParser) -> None:
    """--steps, --log-every and --warmup: how long each run trains, and which of its logging windows count."""
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=10,
                        help="logging windows that start before this step are left out of the averages")


def check_windows(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before any run trains, window arguments that leave steady_state nothing to average: a sweep would
    otherwise fail every run only after training it."""
    if args.steps < 1 or args.log_every < 1:
        parser.error(f"--steps {args.steps} --log-every {args.log_every}: each must be at least 1")
    # Windows start at step 0 and at every multiple of --log-every before --steps (the last ends at --steps).
    first = max(0, -(-args.warmup // args.log_every) * args.log_every)  # the first start at or after --warmup
    if first >= args.steps:
        last = (args.steps - 1) // args.log_every * args.log_every
        parser.error(f"--warmup {args.warmup}: a logging window must start at or after it and end by --steps "
                     f"{args.steps}, and windows start at multiples of --log-every {args.log_every}: lower --warmup "
                     f"to {last} or less, or raise --steps above {first}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--nproc", type=int, default=1, help="GPUs (processes) per run")
    add_window_arguments(parser)
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=FLAGS",
                        help="a name and the train flags that define it, after any NAME=value environment "
                        "settings for its run; repeat for each variant")
    parser.add_argument("--name", default="throughput", help="file name stem of the results")
    parser.add_argument("extra", nargs="*", help="flags added to every variant (after --)")
    args = parser.parse_args()
    check_windows(parser, args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.variant:
            rows.append(run_variant(*parse_variant(spec), args, Path(tmp)))
            print_table(rows[-1:], [VARIANT, *COLUMNS])
            write_results(args.name, rows, gpus=args.nproc, plot=("tokens_per_s_per_gpu", "tokens/s/GPU"))
    print()
    print_table(rows, [VARIANT, *COLUMNS])
    exit_if_failed(rows)


if __name__ == "__main__":
    main()
