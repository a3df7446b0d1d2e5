"""FSDP2 against DistributedDataParallel on a model that fits both: speed and peak memory per GPU.

    python benchmarks/fsdp_vs_ddp.py --config configs/llama3_1b.toml --nproc 2 -- --ac.mode none

Both run the trainer's model, data, AdamW, loss and training step with the config's activation checkpointing,
compile setting and compute dtype (parallel.param_dtype): FSDP2 through its MixedPrecisionPolicy, DDP under
autocast to the same dtype. Per parameter, FSDP2 holds 16/N bytes per GPU of float32 parameters, gradients and
AdamW state, plus the gathered bf16 copies of the blocks being computed. DDP holds all 16 bytes on every GPU (its
gradients are views into the all-reduce buckets, gradient_as_bucket_view=True, so no second copy of them), plus the
bf16 copy of each weight that autocast caches during a step. Without GPUs both run as gloo processes on the CPU,
for trying the script. Refused: what DDP has no counterpart for (parallel.cpu_offload, memory.limit_gib), and
float16 compute, which the trainer trains with a loss scaler that this benchmark does not run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel

from fsdp_trainer import distributed, train
from fsdp_trainer.config import ConfigError, mesh_shape, parse_args, resolve_param_dtype, validate
from fsdp_trainer.data import build_dataloader, build_dataset, samples_per_step, stop_workers
from fsdp_trainer.models.llama import TransformerBlock, build, model_args_from_config
from fsdp_trainer.optim import build_optimizer, build_scheduler
from fsdp_trainer.parallelize import init_weights, DTYPES, apply_ac, apply_compile
from results import exit_if_failed, print_table, write_results
from runs import emit, reported_row, run, torchrun

COLUMNS = [("mode", "mode", "{}"), ("tokens/s/GPU", "tokens_per_s_per_gpu", "{:,.0f}"),
           ("TFLOPs/GPU", "tflops_per_gpu", "{:.1f}"), ("peak GiB", "peak_allocated_gib", "{:.1f}"),
           ("loss", "loss", "{:.4f}")]


def prepare(mode: str, cfg, info: distributed.DistInfo):
    """(model, model args, the autocast its steps run under) for one side, set up alike."""
    device = info.device
    if mode == "fsdp":
        mesh = distributed.build_mesh(device.type, *mesh_shape(cfg.parallel, info.world_size))
        model, args = train.build_model(cfg, mesh, device)
        return model, args, contextlib.nullcontext()
    args = model_args_from_config(cfg.model)
    model = build(args, device=device)
    blocks = (TransformerBlock,)  # AC, then compile, as train.build_model applies them before sharding
    apply_ac(model, blocks, cfg.ac.mode, cfg.ac.every)
    if cfg.parallel.compile:
        apply_compile(model, blocks)
    init_weights(model, device, seed=cfg.train.seed)
    # broadcast_buffers=False: its one buffer, RoPE's table, is computed alike on every rank, and FSDP2 sends none;
    # broadcast before every forward, it would add a collective to DDP's side only. The old name on purpose: torch
    # 2.11 has no forward_sync_buffers, and 2.13 only warns that it renamed the flag.
    model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                    gradient_as_bucket_view=True, broadcast_buffers=False)
    # The training step's switch for parallel.defer_grad_sync, as FSDP2 names it; DDP's no_sync() flips this flag.
    model.set_requires_gradient_sync = lambda sync: setattr(model, "require_backward_grad_sync", sync)
    dtype = DTYPES[resolve_param_dtype(cfg.parallel.param_dtype, device.type)]
    return model, args, torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def worker(mode: str, config: str, steps: int, warmup: int, overrides: list[str]) -> None:
    cfg = parse_args(["--config", config, *overrides])
    # FSDP2 as the trainer runs it, its all-gathers on the copy engines where they apply.
    world_size = distributed.launched_rank_and_world_size()[1]
    info = distributed.init(copy_engines=mode == "fsdp" and train.copy_engines_all_gather(cfg, world_size))
    device = info.device
    cuda = device.type == "cuda"
    model, args, autocast = prepare(mode, cfg, info)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, steps)
    t = cfg.train
    batches = iter(build_dataloader(build_dataset(cfg.data, t.seq_len, args.vocab_size),
                                    num_workers=cfg.data.num_workers, micro_batch_size=t.micro_batch_size,
                                    grad_accum_steps=t.grad_accum_steps, dp_rank=info.rank,
                                    dp_size=info.world_size, device_type=device.type))
    for step in range(steps):
        if step == warmup:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
        with autocast:
            loss, _ = train.train_step(model, optimizer, scheduler, batches, cfg, None, device)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = (steps - warmup) * samples_per_step(t.micro_batch_size, t.grad_accum_steps, info.world_size) * t.seq_len
    tps = tokens / elapsed / info.world_size
    loss = train.mean_over_ranks(loss, info.world_size)
    if info.is_main:
        emit({"mode": mode, "tokens_per_s_per_gpu": tps, "tflops_per_gpu": tps * args.flops_per_token(t.seq_len) / 1e12,
              "loss": loss, **({"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30} if cuda else {})})
    torch.distributed.barrier()  # every rank is past its last collective
    # Not Python's exit: tearing down torch's threads and process groups there aborted a worker once after its
    # result was out ("terminate called without an active exception", SIGABRT, on two CPU ranks). os._exit skips
    # the exit handler that stops the loader's workers too: they ignore SIGTERM, and would outlive this rank by
    # seconds, holding the output pipes the launcher reads to their end.
    stop_workers(batches)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=10, help="steps before the timing starts")
    parser.add_argument("--worker", choices=["fsdp", "ddp"], help=argparse.SUPPRESS)
    parser.add_argument("extra", nargs="*", help="train flags for both runs (after --)")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must be more than --warmup")
    if args.worker:
        return worker(args.worker, args.config, args.steps, args.warmup, args.extra)
    cfg = parse_args(["--config", args.config, *args.extra])
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        validate(cfg, args.nproc, device_type)  # the trainer's own checks, before any rank starts
    except ConfigError as err:
        parser.error(str(err))
    param_dtype = cfg.parallel.param_dtype
    unsupported = {
        "memory.limit_gib is not applied here: both sides run with the whole GPU": cfg.memory.limit_gib is not None,
        "parallel.cpu_offload has no DDP counterpart (DDP keeps all its state on the GPU): remove it":
            cfg.parallel.cpu_offload,
        f"parallel.param_dtype={param_dtype} computes in float16 here, which the trainer trains with a loss scaler "
        "and this benchmark does not: set --parallel.param_dtype float32 (or bfloat16 on a GPU that has it)":
            resolve_param_dtype(param_dtype, device_type) == "float16",
    }
    for message, is_set in unsupported.items():
        if is_set:
            parser.error(message)

    rows = []
    for mode in ("fsdp", "ddp"):
        proc = run([*torchrun(args.nproc), __file__, "--worker", mode, "--config", args.config, "--steps",
                    str(args.steps), "--warmup", str(args.warmup), "--", *args.extra])
        rows.append(reported_row(proc, {"mode": mode}))
        write_results("fsdp_vs_ddp", rows, gpus=args.nproc, plot=("tokens_per_s_per_gpu", "tokens/s/GPU"),
                      label="mode")
    print_table(rows, COLUMNS)
    exit_if_failed(rows)


if __name__ == "__main__":
    main()
