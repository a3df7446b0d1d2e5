"""Where a run's reserved GPU memory sits, stream by stream, from a `--profile.memory_snapshot` file: the caching
allocator lends a stream's freed memory to that stream only, so memory one stream reserves is out of the others'
reach. For checking the memory planner's reserved estimate term by term (fsdp_trainer/tools/plan.py, `_reserved`).

    python benchmarks/memory_streams.py outputs/profile/memory_rank0_steps2-2.pickle [--top 8]

Per stream: its reserved bytes and segments, then its largest allocations over the recorded steps, each with the
FSDP2 and fsdp_trainer frames that made it (the same size from the same place is listed once).
"""

from __future__ import annotations

import argparse
import pickle
from collections import defaultdict

GiB = 1024 ** 3
OWN_FRAMES = ("torch/distributed/fsdp", "fsdp_trainer")


def reserved_by_stream(snapshot: dict) -> dict[int, tuple[int, int]]:
    """stream -> (reserved bytes, segments)."""
    streams: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for segment in snapshot["segments"]:
        streams[segment["stream"]][0] += segment["total_size"]
        streams[segment["stream"]][1] += 1
    return {stream: (size, count) for stream, (size, count) in streams.items()}


def largest_allocations(snapshot: dict, top: int) -> dict[int, list[tuple[int, str]]]:
    """stream -> up to `top` (bytes, where) of its largest allocations in the recorded history, largest first."""
    by_stream: dict[int, list[dict]] = defaultdict(list)
    for trace in snapshot.get("device_traces", []):
        for event in trace:
            if event["action"] == "alloc":
                by_stream[event["stream"]].append(event)
    largest = {}
    for stream, events in by_stream.items():
        seen: list[tuple[int, str]] = []
        for event in sorted(events, key=lambda e: -e["size"]):
            frames = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}:{f['name']}" for f in event.get("frames", [])
                      if any(own in f["filename"] for own in OWN_FRAMES)]
            entry = (event["size"], " < ".join(frames[:3]) or "(no FSDP2 or fsdp_trainer frame)")
            if entry not in seen:
                seen.append(entry)
            if len(seen) == top:
                break
        largest[stream] = seen
    return largest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshot", help="a memory snapshot written by --profile.memory_snapshot")
    parser.add_argument("--top", type=int, default=8, help="allocations listed per stream")
    args = parser.parse_args()
    with open(args.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    largest = largest_allocations(snapshot, args.top)
    for stream, (size, count) in sorted(reserved_by_stream(snapshot).items(), key=lambda item: -item[1][0]):
        print(f"stream {stream}: reserved {size / GiB:.3f} GiB in {count} segment(s); largest allocations:")
        for size, where in largest.get(stream, []):
            print(f"  {size / GiB:8.3f} GiB  {where}")


if __name__ == "__main__":
    main()
