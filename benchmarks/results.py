"""Where and how every benchmark records its results: one folder per date, GPU model and count."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch

from runs import command_line, split_environment

RESULTS = Path(os.environ.get("BENCH_RESULTS_DIR") or Path(__file__).resolve().parent / "results")
"""benchmarks/results/, or the folder BENCH_RESULTS_DIR names."""

# Settings that change the numbers without appearing on the command line.
RECORDED_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL", "TORCH_SYMM_MEM")
RECORDED_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDA_VISIBLE_DEVICES")


def gpu_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def result_dir(count: int) -> Path:
    """<RESULTS>/<YYYY-MM-DD>-<gpu>x<count>/ (<YYYY-MM-DD>-cpu/ for a count of 0: no GPU), dated in local time like
    the files in it."""
    gpu = gpu_name().replace("NVIDIA ", "").replace(" ", "-")
    folder = RESULTS / f"{datetime.date.today().isoformat()}-{f'{gpu}x{count}' if count else 'cpu'}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def recorded_env() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith(RECORDED_ENV_PREFIXES) or k in RECORDED_ENV}


def git_revision(checkout: Path = Path(__file__).parent) -> Optional[str]:
    """The commit these scripts ran from, with "-modified" when tracked files differ from it (the code that ran is
    then not that commit's). In a tree unpacked from `git archive` (how a GPU host without the repository gets it),
    the commit `git archive` wrote into archived_commit.txt; None in any other copy."""
    stamp = checkout / "archived_commit.txt"  # "$Format:%H$", which git archive replaces (.gitattributes)
    archived = stamp.read_text().strip() if stamp.exists() else ""
    if archived and "$" not in archived:
        return archived
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=checkout, text=True, capture_output=True,
                              check=True).stdout.strip()
    try:
        # An archive unpacked inside another checkout (on a GPU host, say) would be taken for that checkout's commit.
        if Path(git("rev-parse", "--show-toplevel")).resolve() != checkout.resolve().parent:
            return None
        # Results files are tracked too, and a sweep rewrites its own after every row: they do not count.
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ":/", ":(top,exclude)benchmarks/results")
        return git("rev-parse", "HEAD") + ("-modified" if changed else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def metadata(gpus: int, command: list[str]) -> dict:
    """What a results file records besides its measurements: the date, the machine, torch and CUDA, the commit,
    the environment settings that change results, and `command` after them (and after its own leading NAME=value
    settings), so that pasting it reruns the measurement."""
    env = recorded_env()
    own, cmd = split_environment(command)
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "gpu": gpu_name(), "gpus": gpus,
            "torch": torch.__version__, "cuda": torch.version.cuda, "git": git_revision(), "environment": env,
            "command": command_line(cmd, {**env, **own})}


def header(meta: dict) -> str:
    """`meta` as the first line of a text results file."""
    return (f"# {meta['date']}, {meta['gpus']} x {meta['gpu']}, torch {meta['torch']}, CUDA {meta['cuda']}, "
            f"commit {meta['git']}: {meta['command']}")


def write_results(name: str, rows: list[dict], *, gpus: int, plot: Optional[tuple[str, str]] = None,
                  label: str = "variant", summary: Optional[dict] = None) -> Path:
    """<name>.json in result_dir(gpus): the rows (after a `summary` of them, if given), the machine, the commit, and
    this process's command after the environment settings that change results, so that pasting it reruns the
    measurement. A bar chart of `plot=(key, title)` beside it if matplotlib is installed.

    Scripts call it after every row: a sweep that is cut off (a job's time limit, a crash) keeps what it measured."""
    meta = metadata(gpus, [sys.executable, *sys.argv])
    folder = result_dir(gpus)
    path = folder / f"{name}.json"
    path.write_text(json.dumps({**meta, **({"summary": summary} if summary else {}), "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")
    if plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return path
        key, title = plot
        shown = [r for r in rows if key in r]
        fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(shown)), 3.5))
        ax.bar([str(r[label]) for r in shown], [r[key] for r in shown])
        ax.set_ylabel(title)
        ax.set_title(f"{name}: {meta['gpu']}, torch {meta['torch']}")
        ax.tick_params(axis="x", labelrotation=30)
        fig.tight_layout()
        fig.savefig(folder / f"{name}.png", dpi=120)
        plt.close(fig)
    return path


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """The rows under `columns` of (title, key, format), the first naming each row. A failed row reads FAILED where
    it has no value, and its error follows the table."""
    lines = [[title for title, _, _ in columns]]
    lines += [[fmt.format(r[key]) if key in r else ("FAILED" if "error" in r else "-") for _, key, fmt in columns]
              for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
    for line in lines:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))
    name = columns[0][1]
    for r in rows:
        if "error" in r:
            print(f"{r[name]}: {r['error']}")


def exit_if_failed(rows: list[dict]) -> None:
    """After the results are written: exit 1 if any run failed, so that a caller (gpu_check.sh) counts it."""
    failed = [r for r in rows if "error" in r]
    if failed:
        raise SystemExit(f"{len(failed)} of {len(rows)} runs failed")


def main() -> None:
    parser = argparse.ArgumentParser(description="For gpu_check.sh, which writes some results files itself: "
                                     "where they go, and the line they start with.")
    parser.add_argument("what", choices=["dir", "header"],
                        help="dir: the folder for results on GPUS GPUs; header: a file's first line, with what "
                        "write_results records besides the rows")
    parser.add_argument("gpus", type=int, metavar="GPUS")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="header: the command that made the file, after any NAME=value settings of its own")
    args = parser.parse_args()
    print(result_dir(args.gpus) if args.what == "dir" else header(metadata(args.gpus, args.command)))


if __name__ == "__main__":
    main()
