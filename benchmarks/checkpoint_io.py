"""Checkpoint save and load: training blocked per save, total save time and GB/s, load time, per async mode.

    python benchmarks/checkpoint_io.py --config configs/llama3_8b.toml --nproc 4

For each checkpoint.async_mode (and each --write-threads count, and with and without checksums if --checksums on off)
it trains `--steps` steps saving every `--interval`, then resumes once from the last checkpoint (the load time, which
includes the check of the checksums that runs alongside it, and the check's own time), after evicting the
checkpoint's files from the page cache so that the load reads the disk. Numbers come from the trainer's own log lines; a failed run is a row with its error.
The checkpoints go to --dir (a fast local disk with 12 bytes/parameter free for each checkpoint kept) and are
deleted afterwards.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from results import exit_if_failed, print_table, write_results
from runs import error_line, run, train_command

BLOCKED = re.compile(r"checkpoint step (\d+) \((\w+)\): training blocked ([\d.]+) s"
                     r"(?: \(of which ([\d.]+) s waiting for the previous save\))?")
COMPLETE = re.compile(r"complete: ([\d.]+) GB in ([\d.]+) s \(([\d.]+) GB/s")
STAGING = re.compile(r"checkpoint staging: .*allocated in ([\d.]+) s")
LOADED = re.compile(r"loaded .*: ([\d.]+) GB in ([\d.]+) s \(([\d.]+) GB/s\)")
CHECKED = re.compile(r"match their checksums \(.*checked by this process in ([\d.]+) s\)")
COLUMNS = [("run", "label", "{}"), ("buffers s", "staging_alloc_s", "{:.1f}"),
           ("first block s", "first_blocked_s", "{:.2f}"), ("block s", "blocked_s", "{:.2f}"),
           ("of which wait s", "waited_s", "{:.2f}"), ("GB", "gb", "{:.1f}"), ("save s", "save_s", "{:.1f}"),
           ("save GB/s", "save_gb_per_s", "{:.2f}"), ("check s", "check_s", "{:.1f}"), ("load s", "load_s", "{:.1f}"),
           ("load GB/s", "load_gb_per_s", "{:.2f}")]


def train(args, mode: str, threads: int, checksums: str, out: Path, steps: int, resume: str,
          *flags: str) -> subprocess.CompletedProcess:
    return run(train_command(args.nproc, args.config, "--train.steps", str(steps), "--train.output_dir", str(out),
                             "--checkpoint.interval", str(args.interval), "--checkpoint.async_mode", mode,
                             "--checkpoint.write_threads", str(threads), "--checkpoint.resume", resume,
                             "--checkpoint.keep", "1", "--train.log_every", "5",
                             *(["--checkpoint.no_checksums"] if checksums == "off" else []), *args.extra, *flags))


def drop_from_page_cache(folder: Path) -> int:
    """Evict every file under `folder` from the page cache, so that the load that follows reads the disk, as a resume
    after a restart or on another node does. Returns the bytes evicted."""
    dropped = 0
    for path in folder.rglob("*"):
        if not path.is_file():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped: write them out first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        dropped += path.stat().st_size
    return dropped


def measure(args, mode: str, threads: int, checksums: str, out: Path) -> dict:
    row = {"mode": mode, "write_threads": threads, "checksums": checksums == "on",
           "label": f"{mode}, {threads} threads" + ("" if checksums == "on" else ", no checksums")}
    saved = train(args, mode, threads, checksums, out, args.steps, "none")
    if saved.returncode:
        return {**row, "error": error_line(saved)}
    log = saved.stderr
    saves = [(float(m.group(3)), float(m.group(4) or 0)) for m in BLOCKED.finditer(log)]
    done = [m.groups() for m in COMPLETE.finditer(log)]
    row["saves"] = len(saves)
    if not saves or not done:  # the resume would start fresh: a row of blanks, reported as a result
        return {**row, "error": f"no save completed in {args.steps} steps (--interval {args.interval}, and a final "
                                "save unless --checkpoint.no_save_final)"}
    # The first save pays one-time costs (pinned buffers, process groups); a later one may also wait for
    # its predecessor to finish writing when the interval is shorter than a save. Report each apart.
    later = saves[1:] or saves
    row.update(first_blocked_s=saves[0][0], blocked_s=max(b for b, _ in later),
               waited_s=max(w for _, w in later), gb=float(done[-1][0]), save_s=float(done[-1][1]),
               save_gb_per_s=float(done[-1][2]))
    staging = STAGING.search(log)
    if staging:  # async_pinned allocates its host buffers once, after step 1
        row.update(staging_alloc_s=float(staging.group(1)))
    row["load_page_cache_dropped_gb"] = drop_from_page_cache(out) / 1e9
    # One more step after the load, and no save, periodic (--interval may divide --steps + 1) or final: another full
    # checkpoint could fill the disk.
    resumed = train(args, mode, threads, checksums, out, args.steps + 1, "auto", "--checkpoint.interval", "0",
                    "--checkpoint.no_save_final")
    if resumed.returncode:
        return {**row, "error": f"resume: {error_line(resumed)}"}
    load = LOADED.search(resumed.stderr)
    if not load:
        return {**row, "error": "resume: no checkpoint loaded"}
    row.update(load_s=float(load.group(2)), load_gb_per_s=float(load.group(3)))
    checked = CHECKED.search(resumed.stderr)
    if checked:
        row.update(check_s=float(checked.group(1)))
    elif checksums == "on":  # a checkpoint committed without sums: its load time is not one with the check
        return {**row, "error": "resume: no checksums checked (the save recorded none: --checkpoint.no_checksums "
                                "among the flags, or a warning in its log)"}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=["none", "async", "async_pinned"])
    parser.add_argument("--write-threads", type=int, nargs="+", default=[4], help="checkpoint.write_threads values")
    parser.add_argument("--checksums", nargs="+", choices=["on", "off"], default=["on"],
                        help="checkpoint.checksums settings to compare (on: the default)")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp folder)")
    parser.add_argument("extra", nargs="*", help="train flags for every run (after --)")
    args = parser.parse_args()
    rows = []
    for mode, threads, checksums in [(m, t, c) for t in args.write_threads for m in args.modes for c in args.checksums]:
        out = Path(tempfile.mkdtemp(prefix=f"ckpt-{mode}-", dir=args.dir))
        try:
            rows.append(measure(args, mode, threads, checksums, out))
        finally:
            shutil.rmtree(out, ignore_errors=True)
        print(rows[-1], flush=True)
        write_results(f"checkpoint_io_{Path(args.config).stem}", rows, gpus=args.nproc,
                      plot=("blocked_s", "training blocked per save, s"), label="label")
    print_table(rows, COLUMNS)
    exit_if_failed(rows)


if __name__ == "__main__":
    main()
