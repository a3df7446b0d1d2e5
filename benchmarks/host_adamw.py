"""How fast AdamW steps in host memory, as under CPU offload: GB/s per rank with R ranks stepping at once on T
threads each.

    python benchmarks/host_adamw.py [--ranks 1 2] [--threads 1 0] [--numel 67108864] [--steps 5]

Each rank is a process holding its own float32 parameters, gradients and two moments of `numel` elements, as a rank
holds its shard, and the ranks start every step together, as a job's ranks do after the same backward. 0 threads is
what the trainer's parallel.offload_threads=0 gives a rank: its share of the cores it may use. GB/s counts 28 bytes
per element: parameter, gradient and both moments read, three of them written. Results are filed under the machine
the script ran on (its GPU model and count), though it uses no GPU.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import torch

from fsdp_trainer.distributed import cores_per_rank
from results import exit_if_failed, write_results

BYTES_PER_ELEMENT = 28


def step_rank(ranks: int, threads: int, impl: str, numel: int, steps: int, barrier, results) -> None:
    """One rank: `steps` AdamW steps after a first, each started with the other ranks; puts its mean seconds."""
    torch.set_num_threads(threads or cores_per_rank(ranks))
    params = [torch.nn.Parameter(torch.randn(numel // 4)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, **{impl: True})
    elapsed = []
    for _ in range(steps + 1):
        barrier.wait()
        start = time.perf_counter()
        optimizer.step()
        elapsed.append(time.perf_counter() - start)
    results.put((torch.get_num_threads(), sum(elapsed[1:]) / steps))


def measure(ranks: int, threads: int, impl: str, numel: int, steps: int) -> dict:
    context = mp.get_context("spawn")
    barrier, results = context.Barrier(ranks), context.Queue()
    procs = [context.Process(target=step_rank, args=(ranks, threads, impl, numel, steps, barrier, results))
             for _ in range(ranks)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    row = {"ranks": ranks, "threads": threads or "share", "impl": impl, "numel": numel}
    if any(proc.exitcode for proc in procs):
        return {**row, "error": f"a rank exited with {[proc.exitcode for proc in procs]}"}
    measured = [results.get() for _ in procs]
    seconds = max(s for _, s in measured)  # the slowest rank paces a job's step
    per_rank = BYTES_PER_ELEMENT * numel / seconds / 1e9
    return {**row, "threads_per_rank": measured[0][0], "ms_per_step": round(seconds * 1e3, 2),
            "gb_per_s_per_rank": round(per_rank, 1), "gb_per_s_total": round(per_rank * ranks, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="ranks stepping at once")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 0],
                        help="threads per rank; 0: the rank's share of the cores")
    parser.add_argument("--impl", nargs="+", default=["fused"], choices=["fused", "foreach"])
    parser.add_argument("--numel", type=int, default=64 * 2**20, help="float32 elements per rank (4 tensors)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    print(f"{cores_per_rank(1)} cores; {BYTES_PER_ELEMENT} bytes per element")
    print(f"{'ranks':>5} {'threads':>7} {'impl':>7} {'ms/step':>8} {'GB/s/rank':>9} {'GB/s':>6}")
    rows = []
    for ranks in args.ranks:
        for threads in args.threads:
            for impl in args.impl:
                rows.append(measure(ranks, threads, impl, args.numel, args.steps))
                r = rows[-1]
                print(f"{ranks:>5} {r.get('threads_per_rank', r['threads']):>7} {impl:>7} "
                      f"{r.get('ms_per_step', r.get('error'))!s:>8} {r.get('gb_per_s_per_rank', ''):>9} "
                      f"{r.get('gb_per_s_total', ''):>6}")
                write_results("host_adamw", rows, gpus=torch.cuda.device_count())
    exit_if_failed(rows)


if __name__ == "__main__":
    main()
