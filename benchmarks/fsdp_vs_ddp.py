"""FSDP2 against DistributedDataParallel on a model that fits both: speed and peak memory per GPU.

    python benchmarks/fsdp_vs_ddp.py --config configs/llama3_1b.toml --nproc 2 -- --ac.mode none

Both use the trainer's model, data, AdamW and training step. FSDP2 shards float32 parameters, gradients and
optimizer state and computes in bf16 (MixedPrecisionPolicy). DDP replicates all of them and computes under bf16
autocast. The difference in memory is the 16 bytes/parameter of model state that DDP keeps on every GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import time

import torch

RESULT = "RESULT "


def worker(mode: str, config: str, steps: int, warmup: int, overrides: list[str]) -> None:
    from torch.nn.parallel import DistributedDataParallel

    from fsdp_trainer import distributed, train
    from fsdp_trainer.config import parse_args
    from fsdp_trainer.data import build_dataloader, samples_per_step
    from fsdp_trainer.models.llama import build, model_args_from_config
    from fsdp_trainer.optim import build_optimizer, build_scheduler

    cfg = parse_args(["--config", config, *overrides])
    info = distributed.init()
    device = info.device
    if mode == "fsdp":
        mesh = distributed.build_mesh(device.type, 1, info.world_size)
        model, args = train.build_model(cfg, mesh, device)
        autocast = contextlib.nullcontext()
    else:
        args = model_args_from_config(cfg.model)
        model = build(args, device=device)
        model.init_weights(cfg.train.seed)
        model = DistributedDataParallel(model, device_ids=[device.index])
        autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    optimizer = build_optimizer(model, cfg.optim, device)
    scheduler = build_scheduler(optimizer, cfg.optim, steps)
    t = cfg.train
    batches = iter(build_dataloader(cfg.data, seq_len=t.seq_len, micro_batch_size=t.micro_batch_size,
                                    grad_accum_steps=t.grad_accum_steps, dp_rank=info.rank,
                                    dp_size=info.world_size, vocab_size=args.vocab_size, device_type="cuda"))
    for step in range(steps):
        if step == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        with autocast:
            loss, _ = train.train_step(model, optimizer, scheduler, batches, cfg, None, device)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = (steps - warmup) * samples_per_step(t.micro_batch_size, t.grad_accum_steps, info.world_size) * t.seq_len
    tps = tokens / elapsed / info.world_size
    if info.is_main:
        print(RESULT + json.dumps({
            "mode": mode, "tokens_per_s_per_gpu": tps, "tflops_per_gpu": tps * args.flops_per_token(t.seq_len) / 1e12,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30, "loss": loss.item()}), flush=True)
    distributed.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--worker", choices=["fsdp", "ddp"], help=argparse.SUPPRESS)
    parser.add_argument("extra", nargs="*", help="train flags for both runs (after --)")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.config, args.steps, args.warmup, args.extra)

    from results import result_dir, write_results
    rows = []
    for mode in ("fsdp", "ddp"):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", __file__,
               "--worker", mode, "--config", args.config, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--", *args.extra]
        print("$", shlex.join(cmd), flush=True)
        proc = subprocess.run(cmd, text=True, capture_output=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        found = [json.loads(line[len(RESULT):]) for line in proc.stdout.splitlines() if line.startswith(RESULT)]
        if found:
            rows.append(found[0])
        else:
            rows.append({"mode": mode, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]})
            sys.stderr.write(proc.stderr[-3000:])
    print(f"{'mode':>5} {'tokens/s/GPU':>13} {'TFLOPs/GPU':>11} {'peak GiB':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:>5} FAILED: {r['error']}")
        else:
            print(f"{r['mode']:>5} {r['tokens_per_s_per_gpu']:>13,.0f} {r['tflops_per_gpu']:>11.1f} "
                  f"{r['peak_allocated_gib']:>9.1f}")
    write_results(result_dir(args.nproc), "fsdp_vs_ddp", rows, command=shlex.join([sys.executable, *sys.argv]),
                  plot=("tokens_per_s_per_gpu", "tokens/s/GPU"), label="mode")


if __name__ == "__main__":
    main()
