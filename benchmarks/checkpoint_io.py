"""Checkpoint save and load: training blocked per save, total save time and GB/s, load time, per async mode.

    python benchmarks/checkpoint_io.py --config configs/llama3_8b.toml --nproc 4

For each checkpoint.async_mode it trains `--steps` steps saving every `--interval`, then resumes once from the
last checkpoint (load time). Numbers come from the trainer's own log lines; the checkpoints go to --dir (a fast
local disk, several times the model's 16 bytes/parameter free) and are deleted afterwards.
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

BLOCKED = re.compile(r"checkpoint step (\d+) \((\w+)\): training blocked ([\d.]+) s")
COMPLETE = re.compile(r"complete: ([\d.]+) GB in ([\d.]+) s \(([\d.]+) GB/s")
LOADED = re.compile(r"loaded .*: ([\d.]+) GB in ([\d.]+) s \(([\d.]+) GB/s\)")


def train(args, mode: str, out: Path, steps: int, resume: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", "-m", "fsdp_trainer.train",
           "--config", args.config, "--train.steps", str(steps), "--train.output_dir", str(out),
           "--checkpoint.interval", str(args.interval), "--checkpoint.async_mode", mode, "--checkpoint.resume", resume,
           "--checkpoint.keep", "2", "--metrics.no_tensorboard", "--train.log_every", "5", *args.extra]
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
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp folder)")
    parser.add_argument("extra", nargs="*", help="train flags for every run (after --)")
    args = parser.parse_args()
    rows = []
    for mode in args.modes:
        out = Path(tempfile.mkdtemp(prefix=f"ckpt-{mode}-", dir=args.dir))
        log = train(args, mode, out, args.steps, "none")
        blocked = [float(m.group(3)) for m in BLOCKED.finditer(log)]
        done = [m.groups() for m in COMPLETE.finditer(log)]
        load = LOADED.search(train(args, mode, out, args.steps + 1, "auto"))
        row = {"mode": mode, "saves": len(blocked)}
        if blocked and done:
            # The first save of a mode pays one-time costs (pinned buffers, process groups): report both.
            row.update(first_blocked_s=blocked[0], blocked_s=max(blocked[1:] or blocked),
                       gb=float(done[-1][0]), save_s=float(done[-1][1]), save_gb_per_s=float(done[-1][2]))
        if load:
            row.update(load_s=float(load.group(2)), load_gb_per_s=float(load.group(3)))
        rows.append(row)
        shutil.rmtree(out, ignore_errors=True)
        print(row, flush=True)
    print(f"{'mode':>13} {'first block s':>13} {'block s':>8} {'GB':>7} {'save s':>7} {'save GB/s':>9} {'load s':>7}")
    for r in rows:
        print(f"{r['mode']:>13} {r.get('first_blocked_s', float('nan')):>13.2f} {r.get('blocked_s', float('nan')):>8.2f} "
              f"{r.get('gb', float('nan')):>7.1f} {r.get('save_s', float('nan')):>7.1f} "
              f"{r.get('save_gb_per_s', float('nan')):>9.2f} {r.get('load_s', float('nan')):>7.1f}")
    write_results(result_dir(args.nproc), f"checkpoint_io_{Path(args.config).stem}", rows,
                  command=shlex.join([sys.executable, *sys.argv]), plot=("blocked_s", "training blocked per save, s"),
                  label="mode")


if __name__ == "__main__":
    main()
