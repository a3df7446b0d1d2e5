"""The doctor's bandwidth table on this machine, beside a bare PyTorch + NCCL all_reduce loop at 1 GiB.

    python benchmarks/collectives.py --nproc 4

The bare loop is the ceiling the doctor's figures should approach: the same all_reduce of 1 GiB of float32,
timed with CUDA events over back-to-back iterations (no per-iteration synchronize).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

import torch

RESULT = "RESULT "


def bare_all_reduce(iters: int = 20) -> None:
    import torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    x = torch.ones(2**28, device="cuda")  # 1 GiB of float32
    for _ in range(3):
        dist.all_reduce(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        dist.all_reduce(x)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    algbw = x.numel() * 4 / seconds / 1e9
    if rank == 0:
        print(RESULT + json.dumps({"bytes": x.numel() * 4, "time_us": seconds * 1e6, "algbw_gbps": algbw,
                                   "busbw_gbps": algbw * 2 * (world - 1) / world}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=max(1, torch.cuda.device_count()))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return bare_all_reduce()
    from results import result_dir, write_results
    launch = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}"]
    doctor = subprocess.run(launch + ["-m", "fsdp_trainer.doctor", "--json"], text=True, capture_output=True)
    report = json.loads(doctor.stdout) if doctor.stdout.strip() else {"ok": False, "bandwidth": []}
    bare = subprocess.run(launch + [__file__, "--worker"], text=True, capture_output=True)
    bare_row = next((json.loads(l[len(RESULT):]) for l in bare.stdout.splitlines() if l.startswith(RESULT)), None)
    rows = [{"source": "doctor", **r} for r in report["bandwidth"]]
    if bare_row:
        rows.append({"source": "bare PyTorch + NCCL", "op": "all_reduce", **bare_row})
    print(f"doctor ok: {report['ok']}")
    print(f"{'source':>20} {'op':>15} {'size':>12} {'busbw GB/s':>11}")
    for r in rows:
        print(f"{r['source']:>20} {r['op']:>15} {r['bytes']:>12,} {r['busbw_gbps']:>11.1f}")
    write_results(result_dir(args.nproc), "collectives", rows, command=shlex.join([sys.executable, *sys.argv]))


if __name__ == "__main__":
    main()
