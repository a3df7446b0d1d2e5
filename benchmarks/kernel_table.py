"""The heaviest GPU kernels of `--profile.steps` traces, side by side: which matmul, attention and other kernels a
step runs, how often, and for how long. For telling two runs apart kernel by kernel (eager and compiled, or
before and after a change), where the profile's breakdown only gives the totals per category.

    python benchmarks/kernel_table.py EAGER_TRACE.json COMPILED_TRACE.json [--steps 2] [--top 12]

Per trace and category: the top kernels by total time, in ms per step, with calls per step and mean µs per call.
The steps a trace holds come from its name as the trainer writes it (trace_rank0_steps12-13.json: 2), else --steps.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Optional

from fsdp_trainer.tools.profiling import category


def kernel_totals(trace: dict) -> dict[str, dict[str, list[float]]]:
    """category -> kernel name -> the durations (µs) of its calls."""
    totals: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and event.get("cat") == "kernel":
            totals[category(event["name"])][event["name"]].append(event["dur"])
    return totals


def steps_in(path: Path, default: Optional[int]) -> int:
    """The steps a trace holds: --steps if given, else from the trainer's file name, else 1."""
    if default is not None:
        return default
    named = re.search(r"steps(\d+)-(\d+)", path.name)
    return int(named[2]) - int(named[1]) + 1 if named else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--steps", type=int, default=None,
                        help="steps each trace holds (the results are per step); default: from the file name, or 1")
    parser.add_argument("--top", type=int, default=10, help="kernels listed per category")
    parser.add_argument("--width", type=int, default=110, help="characters of each kernel name shown")
    args = parser.parse_args()
    for path in args.traces:
        totals = kernel_totals(json.loads(path.read_text()))
        steps = steps_in(path, args.steps)
        print(f"== {path} ({steps} step{'s' if steps > 1 else ''})")
        by_kernel = {cat: {name: sum(durations) for name, durations in kernels.items()}
                     for cat, kernels in totals.items()}  # µs per kernel name
        for cat, spent in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1].values())):
            print(f"  {cat}: {sum(spent.values()) / 1e3 / steps:.1f} ms per step, {len(spent)} kernels")
            for name, total in sorted(spent.items(), key=lambda kv: -kv[1])[:args.top]:
                calls = len(totals[cat][name])
                print(f"    {total / 1e3 / steps:8.2f} ms {calls / steps:7.1f} x {total / calls:8.1f} us  "
                      f"{name[:args.width]}")


if __name__ == "__main__":
    main()
