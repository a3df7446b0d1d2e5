"""The memory planner against measured peaks: predicted vs torch.cuda.max_memory_allocated() per run, and the
predicted reserved memory vs torch.cuda.max_memory_reserved().

    python benchmarks/plan_accuracy.py                     # the default matrix, rows up to the GPUs present
    python benchmarks/plan_accuracy.py --row "2 1b op mb4=configs/llama3_1b.toml --ac.mode op ..."
    python benchmarks/plan_accuracy.py --heldout           # HELD_OUT on one GPU, then the accuracy table
    python benchmarks/plan_accuracy.py --table             # the table from the recorded results alone (no GPU)

A row is "GPUS NAME=CONFIG FLAGS". Each is a real `torchrun -m fsdp_trainer.train` run on that many GPUs; the
trainer logs the plan's predicted allocator peak next to the measured one after its second step.
The default matrix spans 1B and 8B, every ac.mode, micro-batch 1/2/4, 1/2/4 GPUs, the reshard policies,
compile on and off, and the chunked loss. tests/test_plan.py pins the runs the planner's constants were fitted to.

--heldout measures runs none of them was fitted to: configurations no recorded result holds (the script refuses one
that is), on one GPU, 3 steps each (AdamW's state exists from the second), each row's seconds recorded. It writes
plan_heldout.json: one table of every recorded configuration ("fitted": the newest row of each in
benchmarks/results, its prediction as the planner of its day made it) and the held-out ones, the worst held-out
error, and the error band it sets (fsdp_trainer.tools.plan.ERROR_BAND, which tests/test_plan.py holds to it).
Memory only: a run of a few steps from step 0 has no steady rate, so the rows carry no tokens/s or step times.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import shlex
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from results import exit_if_failed, git_revision, write_results
from runs import NO_CHECKPOINTS, split_environment
from throughput import AVERAGED, run_variant

EAGER, COMPILED = "--parallel.no_compile", "--parallel.compile"
DEFAULT_ROWS = [
    f"1 1b none mb2=configs/llama3_1b.toml --ac.mode none --train.micro_batch_size 2 {EAGER}",
    f"1 1b op mb4=configs/llama3_1b.toml --ac.mode op --train.micro_batch_size 4 {EAGER}",
    f"1 8b 4 layers none=configs/llama3_8b.toml --model.n_layers 4 --ac.mode none {EAGER}",
    f"2 1b full mb4=configs/llama3_1b.toml --ac.mode full --train.micro_batch_size 4 {EAGER}",
    f"2 1b selective mb2 never=configs/llama3_1b.toml --ac.mode selective --train.micro_batch_size 2 "
    f"--parallel.reshard_after_forward never {EAGER}",
    f"2 1b none mb1 always=configs/llama3_1b.toml --ac.mode none --train.micro_batch_size 1 "
    f"--parallel.reshard_after_forward always {EAGER}",
    f"2 8b 12 layers op seq4096=configs/llama3_8b.toml --model.n_layers 12 --train.seq_len 4096 --ac.mode op {EAGER}",
    f"2 8b 12 layers none chunked loss=configs/llama3_8b.toml --model.n_layers 12 --ac.mode none "
    f"--train.loss_chunk_tokens 2048 {EAGER}",
    f"4 8b op=configs/llama3_8b.toml --ac.mode op {EAGER}",
    f"4 8b full mb2=configs/llama3_8b.toml --ac.mode full --train.micro_batch_size 2 {EAGER}",
    f"4 8b none compiled=configs/llama3_8b.toml --ac.mode none {COMPILED}",
    f"4 8b op mb2 compiled=configs/llama3_8b.toml --ac.mode op --train.micro_batch_size 2 {COMPILED}",
    f"4 1b none mb4 compiled=configs/llama3_1b.toml --ac.mode none --train.micro_batch_size 4 {COMPILED}",
]
THREE_B, ONE_B, EIGHT_B = "configs/llama3_8b.toml --model.name 3b", "configs/llama3_1b.toml", "configs/llama3_8b.toml"
HELD_OUT = [  # one GPU each, eager (compiling would take most of the time), each within an H100's 80 GB
    f"1 3b op seq4096 mb2={THREE_B} --train.seq_len 4096 --train.micro_batch_size 2 --ac.mode op {EAGER}",
    f"1 3b full={THREE_B} --ac.mode full {EAGER}",
    f"1 3b selective={THREE_B} --ac.mode selective {EAGER}",
    f"1 3b none seq2048 mb4 chunked={THREE_B} --train.seq_len 2048 --train.micro_batch_size 4 --ac.mode none "
    f"--train.loss_chunk_tokens 2048 {EAGER}",
    f"1 3b full accum2 float16={THREE_B} --ac.mode full --train.grad_accum_steps 2 --parallel.param_dtype float16 "
    f"{EAGER}",
    f"1 1b none seq8192={ONE_B} --train.seq_len 8192 --train.micro_batch_size 1 --ac.mode none {EAGER}",
    f"1 1b op seq8192 mb2={ONE_B} --train.seq_len 8192 --train.micro_batch_size 2 --ac.mode op {EAGER}",
    f"1 1b op mb4 float16={ONE_B} --train.micro_batch_size 4 --ac.mode op --parallel.param_dtype float16 {EAGER}",
    f"1 1b op accum4 deferred={ONE_B} --ac.mode op --train.grad_accum_steps 4 --parallel.defer_grad_sync {EAGER}",
    f"1 1b selective4 seq8192 never={ONE_B} --train.seq_len 8192 --train.micro_batch_size 1 --ac.mode selective "
    f"--ac.every 4 --parallel.reshard_after_forward never {EAGER}",
    f"1 8b 12 layers full={EIGHT_B} --model.n_layers 12 --ac.mode full {EAGER}",
    f"1 8b 12 layers op seq4096 keep 12={EIGHT_B} --model.n_layers 12 --train.seq_len 4096 --ac.mode op "
    f"--parallel.keep_gathered 12 {EAGER}",
    f"1 8b 12 layers full accum2 chunked={EIGHT_B} --model.n_layers 12 --ac.mode full --train.grad_accum_steps 2 "
    f"--train.loss_chunk_tokens 2048 {EAGER}",
    f"1 8b 12 layers selective float16 chunked={EIGHT_B} --model.n_layers 12 --ac.mode selective "
    f"--parallel.param_dtype float16 --train.loss_chunk_tokens 2048 {EAGER}",
    f"1 8b 16 layers full offload={EIGHT_B} --model.n_layers 16 --ac.mode full --parallel.cpu_offload {EAGER}",
    f"1 8b 16 layers full chunked={EIGHT_B} --model.n_layers 16 --ac.mode full --train.loss_chunk_tokens 2048 "
    f"{EAGER}",
]
RECORDED = Path(__file__).resolve().parent / "results"
HELD_OUT_NAME = "plan_heldout"
# What a row measured and planned, and the table's name for each (the trainer's and benchmarks' keys first).
MEASURES = {"planned_peak_gib": "planned_peak_gib", "measured_peak_gib": "measured_peak_gib",
            "planned_reserved_gib": "planned_reserved_gib", "mem_reserved_gib": "measured_reserved_gib"}
# Flags that change how long a run trains, where it writes and what it logs, not the memory of a step.
NOT_THE_RUN = {"--train.steps", "--train.log_every", "--train.output_dir", "--metrics.no_tensorboard",
               *NO_CHECKPOINTS[::2], NO_CHECKPOINTS[-1]}


def parse_row(spec: str) -> tuple[int, str, str, list[str]]:
    head, _, rest = spec.partition("=")
    gpus, _, name = head.strip().partition(" ")
    config, *flags = shlex.split(rest)
    return int(gpus), name.strip(), config, flags


def recorded_run(command: str) -> tuple[int, list[str]]:
    """(GPUs, trainer flags) of a recorded `torchrun ... -m fsdp_trainer.train FLAGS` command."""
    _, words = split_environment(shlex.split(command))
    gpus = next(int(w.split("=")[1]) for w in words if w.startswith("--nproc_per_node="))
    return gpus, words[words.index("fsdp_trainer.train") + 1:]


def configuration(gpus: int, flags: list[str]) -> Optional[tuple[int, str]]:
    """(GPUs, the run's Config as JSON, without what does not change a step's memory): equal for two runs of the
    same configuration however their flags spell it; None where today's trainer would not parse the flags."""
    from fsdp_trainer.config import ConfigError, parse_args

    argv, rest = [], list(flags)
    while rest:
        word = rest.pop(0)
        value = [rest.pop(0)] if rest and not rest[0].startswith("--") else []
        if word == "--config":  # recorded runs ran in the repository's root
            value = [str(RECORDED.parents[1] / value[0])]
        if word not in NOT_THE_RUN:
            argv += [word, *value]
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # a flag since renamed: tyro's box would say so
            cfg = parse_args(argv)
    except (ConfigError, SystemExit):
        return None
    fields = dataclasses.asdict(cfg)
    for section in ("checkpoint", "metrics"):
        fields.pop(section)
    for name in ("steps", "log_every", "output_dir"):
        fields["train"].pop(name)
    return gpus, json.dumps(fields, sort_keys=True, default=str)


def fitted_rows(folder: Path = RECORDED) -> list[dict]:
    """The newest recorded measurement of each configuration on each GPU model, held-out tables aside."""
    newest: dict[tuple, dict] = {}
    for path in sorted(folder.glob("*/*.json")):
        if path.stem.startswith(HELD_OUT_NAME):
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for row in data.get("rows", []) if isinstance(data, dict) else []:
            if not all(key in row for key in MEASURES) or "fsdp_trainer.train" not in row.get("command", ""):
                continue
            gpus, flags = recorded_run(row["command"])
            key = configuration(gpus, flags) or (gpus, row["command"])
            newest[(data.get("gpu"), *key)] = table_row("fitted", data.get("gpu"), gpus, row, data.get("git"),
                                                        f"{path.parent.name}/{path.name}")
    return sorted(newest.values(), key=lambda r: (r["gpus"], r["name"]))


def table_row(kind: str, gpu: Optional[str], gpus: Optional[int], row: dict, commit: Optional[str],
              source: str) -> dict:
    out = {"set": kind, "name": row.get("variant"), "gpu": gpu, "gpus": gpus, "command": row.get("command"),
           "commit": commit, "source": source, **{name: row[key] for key, name in MEASURES.items() if key in row}}
    for what in ("peak", "reserved"):
        if f"planned_{what}_gib" in out and f"measured_{what}_gib" in out:
            out[f"{what}_error_pct"] = 100 * (out[f"planned_{what}_gib"] / out[f"measured_{what}_gib"] - 1)
    if "error" in row:
        out["error"] = row["error"]
    return out


def summary(rows: list[dict]) -> dict:
    """The worst error of each set, peak and reserved, each naming its run; the band the held-out rows set: their
    worst error either way, rounded up to half a percent."""
    worst = {}
    for kind in ("fitted", "held-out"):
        for what in ("peak", "reserved"):
            measured = [r for r in rows if r["set"] == kind and f"{what}_error_pct" in r]
            if measured:
                top = max(measured, key=lambda r: abs(r[f"{what}_error_pct"]))
                worst[f"{kind} {what}"] = {"error_pct": top[f"{what}_error_pct"], "name": top["name"],
                                           "gpu": top["gpu"], "runs": len(measured)}
    held_out = [abs(w["error_pct"]) for k, w in worst.items() if k.startswith("held-out")]
    out = {"worst": worst, "failed": [r["name"] for r in rows if "error" in r]}
    if held_out:
        out["error_band"] = math.ceil(max(held_out) * 2 - 1e-9) / 200
    return out


def print_table(rows: list[dict], result: dict) -> None:
    nan = float("nan")
    for r in rows:
        print(f"{r['set']:>8} {r['gpus'] or '?'} x {str(r['gpu']):<22} {str(r['name']):>40}  peak: planned "
              f"{r.get('planned_peak_gib', nan):6.2f} GiB, measured {r.get('measured_peak_gib', nan):6.2f} GiB, "
              f"{r.get('peak_error_pct', nan):+5.1f}% | reserved: planned {r.get('planned_reserved_gib', nan):6.2f}, "
              f"measured {r.get('measured_reserved_gib', nan):6.2f}, {r.get('reserved_error_pct', nan):+5.1f}%"
              + (f"  FAILED: {r['error']}" if "error" in r else ""))
    for kind, w in result["worst"].items():
        print(f"worst {kind} error over {w['runs']} configurations: {w['error_pct']:+.1f}% ({w['name']}, {w['gpu']})")
    if "error_band" in result:
        print(f"error band the held-out rows set: ±{result['error_band']:.1%} (fsdp_trainer.tools.plan.ERROR_BAND)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--row", action="append", metavar="GPUS NAME=CONFIG FLAGS", help="default: the matrix above")
    parser.add_argument("--heldout", action="store_true", help="the held-out rows on one GPU, then the table")
    parser.add_argument("--table", action="store_true", help="the table from the recorded results; runs nothing")
    args = parser.parse_args()
    if args.table:
        recorded = sorted(RECORDED.glob(f"*/{HELD_OUT_NAME}.json"))
        held = [r for r in json.loads(recorded[-1].read_text())["rows"] if r["set"] == "held-out"] if recorded else []
        rows = fitted_rows() + held
        print_table(rows, summary(rows))
        return
    args.log_every, args.warmup, args.extra = 2, 0, []
    if args.heldout:  # the second step is the first with AdamW's state; the peak is logged after it
        args.steps, args.log_every = 3, 1
    available = torch.cuda.device_count()
    rows = [parse_row(spec) for spec in args.row or (HELD_OUT if args.heldout else DEFAULT_ROWS)]
    fitted = fitted_rows() if args.heldout else []
    if args.heldout:
        seen = {configuration(*recorded_run(r["command"])) for r in fitted} - {None}
        again = [name for gpus, name, config, flags in rows
                 if configuration(gpus, ["--config", config, *flags]) in seen]
        if again:
            raise SystemExit(f"not held out: {', '.join(again)} (a recorded result holds the same configuration)")
    skipped = [name for gpus, name, _, _ in rows if gpus > available]
    if skipped:
        print(f"skipped (need more than the {available} GPUs here): {', '.join(skipped)}")
    rows = [row for row in rows if row[0] <= available]
    if not rows:
        raise SystemExit("no row fits the GPUs on this machine")
    most = max(gpus for gpus, *_ in rows)
    results, start = [], time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for gpus, name, config, flags in rows:
            args.nproc, args.config = gpus, config
            began = time.monotonic()
            ran = run_variant(name, {}, flags, args, Path(tmp))
            # With warmup 0 its rates and step times include compilation and the first step: not measurements.
            row = {"gpus": gpus, **{k: v for k, v in ran.items() if k not in AVERAGED},
                   "seconds": time.monotonic() - began}
            for planned, measured, error in (("planned_peak_gib", "measured_peak_gib", "error_pct"),
                                             ("planned_reserved_gib", "mem_reserved_gib", "reserved_error_pct")):
                if planned in row and measured in row:
                    row[error] = 100 * (row[planned] / row[measured] - 1)
            results.append(row)
            nan = float("nan")
            print(f"{gpus} x {name:>26}  peak: planned {row.get('planned_peak_gib', nan):6.2f} GiB, measured "
                  f"{row.get('measured_peak_gib', nan):6.2f} GiB, {row.get('error_pct', nan):+.1f}% | reserved: "
                  f"planned {row.get('planned_reserved_gib', nan):6.2f} GiB, measured "
                  f"{row.get('mem_reserved_gib', nan):6.2f} GiB, {row.get('reserved_error_pct', nan):+.1f}%"
                  f" | {row['seconds']:.0f} s" + (f"  FAILED: {row['error']}" if "error" in row else ""), flush=True)
            if not args.heldout:
                write_results("plan_accuracy", results, gpus=most, plot=("error_pct", "planned vs measured peak, %"))
                continue
            held = [table_row("held-out", torch.cuda.get_device_name(0), r["gpus"], r, git_revision(), "this run")
                    for r in results]
            table = fitted + held
            write_results(HELD_OUT_NAME, table, gpus=most, label="name", summary=summary(table))
    if args.heldout:
        print_table(table, summary(table))
    print(f"{len(results)} runs in {time.monotonic() - start:.0f} s")
    exit_if_failed(results)


if __name__ == "__main__":
    main()
