"""Checkpoint save and load: training blocked per save, total save time and GB/s, load time, per async mode.

    python benchmarks/checkpoint_io.py --config configs/llama3_8b.toml --nproc 4

For each checkpoint.async_mode (and each --write-threads count) it trains `--steps` steps saving every `--interval`, then resumes once from the
last checkpoint (load time). Numbers come from the trainer's own log lines; the checkpoints go to --dir (a fast
local disk with 12 bytes/parameter free for each checkpoint kept) and are deleted afterwards.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from results import result_dir, write_results

BLOCKED = re.compile(r"checkpoint step (\d+) \((\w+)\): training blocked ([\d.]+) s"
                     r"(?: \(of which ([\d.]+) s waiting for the previous save\))?")
COMPLETE = re.compile(r"complete: ([\d.]+) GB in ([\d.]+) s \(([\d.]+) GB/s")
STAGING = re.compile(r"checkpoint staging: ([\d.]+) GB of .*allocated in ([\d.]+) s")
LOADED = re.compile(r"loaded .*: ([\d.]+) GB in ([\d.]+) s \(([\d.]+) GB/s\)")


def train(args, mode: str, threads: int, out: Path, steps: int, resume: str, *flags: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", "-m", "fsdp_trainer.train",
           "--config", args.config, "--train.steps", str(steps), "--train.output_dir", str(out),
           "--checkpoint.interval", str(args.interval), "--checkpoint.async_mode", mode, "--checkpoint.write_threads", str(threads),
           "--checkpoint.resume", resume,
           "--checkpoint.keep", "1", "--metrics.no_tensorboard", "--train.log_every", "5", *args.extra, *flags]
    print("$", shlex.join(cmd), flush=True)
    proc = subprocess.run(cmd, text=True, capture_output=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode:
        sys.stderr.write(proc.stderr[-3000:])
    return proc.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=["none", "async", "async_pinned"])
    parser.add_argument("--write-threads", type=int, nargs="+", default=[4], help="checkpoint.write_threads values")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp folder)")
    parser.add_argument("extra", nargs="*", help="train flags for every run (after --)")
    args = parser.parse_args()
    rows = []
    for mode, threads in [(m, t) for t in args.write_threads for m in args.modes]:
        out = Path(tempfile.mkdtemp(prefix=f"ckpt-{mode}-", dir=args.dir))
        log = train(args, mode, threads, out, args.steps, "none")
        saves = [(float(m.group(3)), float(m.group(4) or 0)) for m in BLOCKED.finditer(log)]
        done = [m.groups() for m in COMPLETE.finditer(log)]
        # One more step after the load, and no final save: a third full checkpoint could fill the disk.
        load = LOADED.search(train(args, mode, threads, out, args.steps + 1, "auto", "--checkpoint.no_save_final"))
        row = {"mode": mode, "write_threads": threads, "label": f"{mode}, {threads} threads", "saves": len(saves)}
        if saves and done:
            # The first save pays one-time costs (pinned buffers, process groups); a later one may also wait for
            # its predecessor to finish writing when the interval is shorter than a save. Report each apart.
            later = saves[1:] or saves
            row.update(first_blocked_s=saves[0][0], blocked_s=max(b for b, _ in later),
                       waited_s=max(w for _, w in later), gb=float(done[-1][0]), save_s=float(done[-1][1]),
                       save_gb_per_s=float(done[-1][2]))
        staging = STAGING.search(log)
        if staging:  # async_pinned allocates its host buffers once, after step 1
            row.update(staging_alloc_s=float(staging.group(2)))
        if load:
            row.update(load_s=float(load.group(2)), load_gb_per_s=float(load.group(3)))
        rows.append(row)
        shutil.rmtree(out, ignore_errors=True)
        print(row, flush=True)
        # Rewritten after every row: a sweep cut off by a time limit keeps what it measured.
        write_results(result_dir(args.nproc), f"checkpoint_io_{Path(args.config).stem}", rows,
                      command=shlex.join([sys.executable, *sys.argv]),
                      plot=("blocked_s", "training blocked per save, s"), label="label")
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    columns = [("mode", "mode", "{}"), ("threads", "write_threads", "{}"), ("buffers s", "staging_alloc_s", "{:.1f}"),
               ("first block s", "first_blocked_s", "{:.2f}"),
               ("block s", "blocked_s", "{:.2f}"), ("of which wait s", "waited_s", "{:.2f}"), ("GB", "gb", "{:.1f}"),
               ("save s", "save_s", "{:.1f}"), ("save GB/s", "save_gb_per_s", "{:.2f}"), ("load s", "load_s", "{:.1f}"),
               ("load GB/s", "load_gb_per_s", "{:.2f}")]
    lines = [[title for title, _, _ in columns]]
    lines += [[fmt.format(r[key]) if key in r else "-" for _, key, fmt in columns] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
    for line in lines:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))


if __name__ == "__main__":
    main()
