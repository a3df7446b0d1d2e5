"""Where and how every benchmark records its results: one folder per date, GPU model and count."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Optional

import torch

RESULTS = Path(os.environ.get("BENCH_RESULTS_DIR") or Path(__file__).resolve().parent / "results")
"""benchmarks/results/, or the folder BENCH_RESULTS_DIR names."""


def gpu_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def result_dir(count: int) -> Path:
    """<RESULTS>/<YYYY-MM-DD>-<gpu>x<count>/"""
    gpu = gpu_name().replace("NVIDIA ", "").replace(" ", "-")
    folder = RESULTS / f"{datetime.date.today().isoformat()}-{gpu}x{count}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_results(folder: Path, name: str, rows: list[dict], *, command: str,
                  plot: Optional[tuple[str, str]] = None, label: str = "variant") -> Path:
    """JSON with the machine facts and exact command; a bar chart of `plot=(key, title)` if matplotlib exists."""
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "gpu": gpu_name(),
            "gpu_count_visible": torch.cuda.device_count(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "command": command}
    path = folder / f"{name}.json"
    path.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
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
