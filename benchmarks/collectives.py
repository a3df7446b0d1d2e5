"""The doctor's bandwidth table on this machine, beside a bare PyTorch + NCCL all_reduce loop at 1 GiB.

    python benchmarks/collectives.py --nproc 4

The bare loop is the ceiling the doctor's figures should approach: the same all_reduce of 1 GiB of float32,
timed with CUDA events over back-to-back iterations (no per-iteration synchronize). The results also record whether
the doctor's checks passed, and why either run failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess

import torch

from fsdp_trainer.tools.doctor import bus_factor, last_report
from results import exit_if_failed, print_table, write_results
from runs import emit, error_line, reported_row, run, torchrun

COLUMNS = [("source", "source", "{}"), ("checks ok", "ok", "{}"), ("op", "op", "{}"), ("size", "bytes", "{:,}"),
           ("busbw GB/s", "busbw_gbps", "{:.1f}")]


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
        emit({"bytes": x.numel() * 4, "time_us": seconds * 1e6, "algbw_gbps": algbw,
              "busbw_gbps": algbw * bus_factor("all_reduce", world)})
    dist.destroy_process_group()


def doctor_rows(proc: subprocess.CompletedProcess) -> list[dict]:
    """The doctor's bandwidth rows, each with whether its checks passed; with the error, the checks that failed or
    why it exited non-zero, if it did not pass."""
    found = last_report(proc.stdout)
    if found is None:
        return [{"source": "doctor", "ok": False, "error": error_line(proc)}]
    failed = [check["name"] for check in found["checks"] if not check["ok"]]
    verdict = {"source": "doctor", "ok": found["ok"]}
    if failed:
        verdict.update(failed_checks=failed, error=f"failed checks: {', '.join(failed)}")
    elif proc.returncode:
        verdict["error"] = error_line(proc)
    return [{**verdict, **r} for r in found["bandwidth"]] or [verdict]


def bare_row(proc: subprocess.CompletedProcess) -> dict:
    return reported_row(proc, {"source": "bare PyTorch + NCCL", "op": "all_reduce"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=max(1, torch.cuda.device_count()))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return bare_all_reduce()
    rows = doctor_rows(run([*torchrun(args.nproc), "-m", "fsdp_trainer.tools.doctor", "--json"]))
    rows.append(bare_row(run([*torchrun(args.nproc), __file__, "--worker"])))
    print_table(rows, COLUMNS)
    write_results("collectives", rows, gpus=args.nproc)
    exit_if_failed(rows)


if __name__ == "__main__":
    main()
