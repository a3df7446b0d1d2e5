"""Train a Llama-style model with FSDP2.

Runbook:
    # CPU or one GPU, the debug model on the Python standard library's source (no download), ~1 minute:
    python -m fsdp_trainer.train
    # one node, 8 GPUs:
    torchrun --nproc_per_node=8 -m fsdp_trainer.train --config configs/llama3_8b.toml
    # two nodes (run on each; see launch/multinode.sh and launch/slurm.sbatch):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29500 --rdzv-id=$JOB \\
        -m fsdp_trainer.train --config configs/llama3_8b.toml
    # any flag overrides the TOML file; --help lists them all:
    python -m fsdp_trainer.train --config configs/llama3_1b.toml --train.steps 50 --ac.mode op
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp_trainer import distributed
from fsdp_trainer.config import Config, ConfigError, mesh_shape, parse_args, resolve_param_dtype, to_toml, validate
from fsdp_trainer.data import build_dataloader, samples_per_step
from fsdp_trainer.distributed import logger
from fsdp_trainer.metrics import GiB, Metrics, environment, write_run_info
from fsdp_trainer.models.llama import TransformerBlock, build, model_args_from_config
from fsdp_trainer.optim import build_optimizer, build_scheduler, clip_grad_norm
from fsdp_trainer.parallelize import DTYPES, apply_ac, apply_compile, apply_fsdp, init_weights


def build_model(cfg: Config, mesh, device: torch.device):
    """Llama on the meta device -> AC -> compile -> FSDP per block -> materialized and initialized."""
    args = model_args_from_config(cfg.model)
    model = build(args, device="meta")
    blocks = (TransformerBlock,)
    apply_ac(model, blocks, cfg.ac.mode, cfg.ac.every)
    if cfg.parallel.compile:
        apply_compile(model, blocks)
    # A tied embedding and output projection share one parameter, so they must live in one FSDP group:
    # leave all three to the root. Untied, each gets its own all-gather.
    groups = [] if args.tie_embeddings else [[model.tok_embeddings], [model.norm, model.output]]
    p = cfg.parallel
    apply_fsdp(model, mesh, block_types=blocks, groups=groups,
               param_dtype=DTYPES[resolve_param_dtype(p.param_dtype, device.type)],
               reduce_dtype=DTYPES[p.reduce_dtype], reshard_after_forward=p.reshard_after_forward,
               cpu_offload=p.cpu_offload)
    init_weights(model, device, seed=cfg.train.seed, offload=p.cpu_offload)
    return model, args


def train_step(model, optimizer, scheduler, batches, cfg: Config, scaler, device: torch.device):
    """One optimizer step over `grad_accum_steps` micro-batches. Returns (mean loss, global grad norm) as
    device tensors: nothing here waits for the GPU."""
    accum = cfg.train.grad_accum_steps
    loss_sum = torch.zeros((), device=device)
    for micro in range(accum):
        inputs, labels = (t.to(device, non_blocking=True) for t in next(batches))
        if cfg.parallel.defer_grad_sync:
            model.set_requires_gradient_sync(micro == accum - 1)
        logits = model(inputs)
        # Mean over this micro-batch's tokens, divided by accum: k micro-batches of b equal one batch of k*b.
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()) / accum
        (scaler.scale(loss) if scaler else loss).backward()
        loss_sum += loss.detach()
    if scaler:
        scaler.unscale_(optimizer)
    grad_norm = clip_grad_norm(model, cfg.optim.grad_clip)
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return loss_sum, grad_norm


def mean_over_ranks(value: torch.Tensor, world_size: int) -> float:
    """All-reduce and read to the host: a sync point, called on logging steps only."""
    value = value.detach().clone()
    dist.all_reduce(value)  # gloo has no AVG
    return value.item() / world_size


def run(cfg: Config, info: distributed.DistInfo) -> dict:
    device = info.device
    dp_replicate, dp_shard = mesh_shape(cfg.parallel, info.world_size)
    output_dir = Path(cfg.train.output_dir)
    torch.manual_seed(cfg.train.seed)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    if cfg.memory.limit_gib is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.memory.limit_gib * GiB / total), device)

    mesh = distributed.build_mesh(device.type, dp_replicate, dp_shard)
    model, args = build_model(cfg, mesh, device)
    optimizer = build_optimizer(model, cfg.optim, device)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    param_dtype = resolve_param_dtype(cfg.parallel.param_dtype, device.type)
    scaler = None
    if param_dtype == "float16":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        scaler = ShardedGradScaler()

    t = cfg.train
    global_batch = samples_per_step(t.micro_batch_size, t.grad_accum_steps, info.world_size)
    step, consumed_samples = 0, 0
    loader = build_dataloader(cfg.data, seq_len=t.seq_len, micro_batch_size=t.micro_batch_size,
                              grad_accum_steps=t.grad_accum_steps, dp_rank=info.rank, dp_size=info.world_size,
                              vocab_size=args.vocab_size, start_sample=consumed_samples, device_type=device.type)
    batches = iter(loader)

    if info.is_main:
        write_run_info(output_dir, to_toml(cfg), environment(device, info.world_size, mesh.mesh.shape))
        logger.info(f"model {cfg.model.name}: {args.num_params() / 1e6:,.1f}M parameters | mesh "
                    f"{dict(zip(mesh.mesh_dim_names, mesh.mesh.shape))} | {param_dtype} compute | "
                    f"global batch {global_batch} x {t.seq_len} tokens | ac {cfg.ac.mode}")
    metrics = Metrics(device=device, total_steps=t.steps, tokens_per_step=global_batch * t.seq_len,
                      world_size=info.world_size, flops_per_token=args.flops_per_token(t.seq_len),
                      output_dir=output_dir, tensorboard=cfg.metrics.tensorboard, is_main=info.is_main)
    metrics.start(step)
    history = []
    while step < t.steps:
        loss, grad_norm = train_step(model, optimizer, scheduler, batches, cfg, scaler, device)
        step += 1
        consumed_samples += global_batch
        if step % t.log_every == 0 or step == t.steps:
            row = metrics.log(step, mean_over_ranks(loss, info.world_size), grad_norm.item(),
                              scheduler.get_last_lr()[0])
            history.append({"step": step, **row})
    metrics.close()
    if info.is_main:
        import json
        (output_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    return {"step": step, "history": history, "model": model}


def main(argv=None) -> None:
    cfg = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        # Everything that can be checked without a GPU is checked before the process group or any memory.
        validate(cfg, world_size, "cuda" if torch.cuda.is_available() else "cpu")
    except ConfigError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    info = distributed.init(cfg.dist.init_timeout_s)
    try:
        run(cfg, info)
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main()
