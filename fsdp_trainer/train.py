"""Train a Llama-style model, or a team's own (`main(model_fn=...)`, see ModelFn), with FSDP2.

    python -m fsdp_trainer.train                                     # the debug model, on CPU or one GPU
    torchrun --nproc_per_node=8 -m fsdp_trainer.train --config configs/llama3_8b.toml --train.steps 50

Flags override the TOML file; --help lists them. launch/ holds the multi-node launchers.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import random
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import Dataset

from fsdp_trainer import distributed
from fsdp_trainer.checkpoint import CheckpointError, Checkpointer, StopSignals, model_class
from fsdp_trainer.config import (Config, ConfigError, check_output_dirs, exit_with_error, grads_in_compute_pool,
                                 mesh_shape, parse_args, resolve_param_dtype, to_toml, validate)
from fsdp_trainer.data import (DataError, build_dataloader, build_dataset, check_enough_samples, samples_per_step,
                               stop_workers)
from fsdp_trainer.distributed import logger
from fsdp_trainer.evaluate import evaluate, evaluates, is_due
from fsdp_trainer.loss import compiled_cross_entropy, cross_entropy
from fsdp_trainer.metrics import GiB, Metrics, PhaseTimer, environment, write_run_info
from fsdp_trainer.models.llama import TransformerBlock, build, model_args_from_config
from fsdp_trainer.optim import (NonFiniteError, NonFiniteGuard, build_optimizer, build_scheduler, clip_grad_norm,
                                follow_current_schedule)
from fsdp_trainer.parallelize import DTYPES, apply_ac, apply_compile, apply_fsdp, init_weights
# The tools this entry point wires in; no other core module imports them.
from fsdp_trainer.tools.checksums import Checksums
from fsdp_trainer.tools.faults import RESTORING, Watchdog, describe_oom, enable_flight_recorder, requested_bytes
from fsdp_trainer.tools.model_checks import check_own_model
from fsdp_trainer.tools.plan import Plan, planned_vs_measured, preflight, remedy_after_oom
from fsdp_trainer.tools.profiling import OPTIMIZER_RANGE, StepProfiler
from fsdp_trainer.tools.weights import load_weights, model_from_init_from, model_settings


# A team's own model: `model_fn(cfg)` returns (model, block classes, groups), the model on the meta device
# (init_weights fills it, seeded by train.seed) or built eagerly, with model.vocab_size rows for the data's ids;
# tools/model_checks.py lists what it must satisfy, and README's "Your own model" shows one.
ModelFn = Callable[[Config], tuple[nn.Module, Sequence[type], Sequence[Sequence[nn.Module]]]]


def copy_engines_all_gather(cfg: Config, world_size: int) -> bool:
    """Whether parallel.copy_engine_all_gather applies: the all-gathers in NCCL symmetric memory, which NCCL copies
    with the copy engines under NCCL_CTA_POLICY=2 (distributed.init(copy_engines=True) sets it)."""
    return (cfg.parallel.copy_engine_all_gather and mesh_shape(cfg.parallel, world_size)[1] > 1
            and distributed.copy_engines_can_all_gather(world_size))


def build_model(cfg: Config, mesh, device: torch.device, model_fn: Optional[ModelFn] = None):
    """Llama (or model_fn's model) on the meta device -> AC -> compile -> FSDP per block -> materialized and
    initialized. Returns the model and its Llama ModelArgs (None for model_fn's)."""
    if model_fn is None:
        args = model_args_from_config(cfg.model)
        model = build(args, device="meta")
        blocks = (TransformerBlock,)
        # A tied embedding and output projection share one parameter, so they must live in one FSDP group:
        # leave all three to the root. Untied, each gets its own all-gather.
        groups = [] if args.tie_embeddings else [[model.tok_embeddings], [model.norm, model.output]]
    else:
        args = None
        model, blocks, groups = check_own_model(model_fn(cfg), cfg)  # before sharding and materializing
    apply_ac(model, blocks, cfg.ac.mode, cfg.ac.every)
    if cfg.parallel.compile:
        apply_compile(model, blocks)
    p = cfg.parallel
    apply_fsdp(model, mesh, block_types=blocks, groups=groups,
               param_dtype=DTYPES[resolve_param_dtype(p.param_dtype, device.type)],
               reduce_dtype=DTYPES[p.reduce_dtype], reshard_after_forward=p.reshard_after_forward,
               keep_gathered=p.keep_gathered, prefetch=p.prefetch, cpu_offload=p.cpu_offload,
               grads_in_compute_pool=device.type == "cuda" and grads_in_compute_pool(p, cfg.train.grad_accum_steps),
               symmetric_memory_all_gather=device.type == "cuda" and copy_engines_all_gather(cfg, mesh.size()))
    # A model built eagerly holds its weights already (fully_shard moved them to the mesh's device).
    if any(param.is_meta for param in model.parameters()):
        init_weights(model, device, seed=cfg.train.seed, offload=p.cpu_offload)
    return model, args


def flops_per_token(model: nn.Module, args, seq_len: int, num_params: int) -> int:
    """Training FLOPs per token for MFU: Llama's count, a model's own flops_per_token(seq_len), else 6 per parameter."""
    if args is not None:
        return args.flops_per_token(seq_len)
    if hasattr(model, "flops_per_token"):
        return model.flops_per_token(seq_len)
    logger.info(f"{model_class(model).__name__} has no flops_per_token(seq_len): TFLOPs and MFU assume 6 FLOPs per "
                "parameter per token, without attention; define it for exact numbers")
    return 6 * num_params


def train_step(model, optimizer, scheduler, batches, cfg: Config, scaler, device: torch.device, guard=None,
               phases: Optional[PhaseTimer] = None):
    """One optimizer step over `grad_accum_steps` micro-batches. Returns (mean loss, global grad norm) as
    device tensors: nothing here waits for the GPU. `phases` times data, forward+backward and optimizer."""
    lap = phases.lap if phases else lambda phase: None
    accum = cfg.train.grad_accum_steps
    loss_of = compiled_cross_entropy if cfg.parallel.compile else cross_entropy
    loss_sum = torch.zeros((), device=device)
    for micro in range(accum):
        inputs, labels = (t.to(device, non_blocking=True) for t in next(batches))
        lap("data")
        if cfg.parallel.defer_grad_sync:
            model.set_requires_gradient_sync(micro == accum - 1)
        # Mean over this micro-batch's tokens, divided by accum: k micro-batches of b equal one batch of k*b.
        if cfg.train.loss_chunk_tokens:  # the model computes it in chunks, never holding all logits
            loss = model(inputs, labels, cfg.train.loss_chunk_tokens) / accum
        else:
            logits = model(inputs)
            loss = loss_of(logits, labels) / accum
        (scaler.scale(loss) if scaler else loss).backward()
        loss_sum += loss.detach()
        lap("forward_backward")
    with torch.profiler.record_function(OPTIMIZER_RANGE):  # the profile's breakdown attributes kernels by it
        if scaler:
            scaler.unscale_(optimizer)
        grad_norm = clip_grad_norm(model, cfg.optim.grad_clip, None if scaler else optimizer)
        if scaler:  # the scaler skips steps with inf/NaN gradients itself, and lowers the scale
            scaler.step(optimizer)
            scaler.update()
        elif guard:
            guard.step(optimizer, grad_norm)
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    lap("optimizer")
    return loss_sum, grad_norm


def mean_over_ranks(value: torch.Tensor, world_size: int) -> float:
    """All-reduce and read to the host: a sync point, called on logging steps only."""
    value = value.detach().clone()
    dist.all_reduce(value)  # gloo has no AVG
    return value.item() / world_size


def run(cfg: Config, info: distributed.DistInfo, memory_plan: Optional[Plan] = None,
        signals: Optional[StopSignals] = None, dataset: Optional[Dataset] = None,
        model_fn: Optional[ModelFn] = None, held_out: Optional[Dataset] = None) -> dict:
    """Train `cfg`'s Llama, or the causal language model model_fn builds (see ModelFn): forward(tokens) returns
    logits of shape (batch, seq_len, vocab_size), and with train.loss_chunk_tokens forward(tokens, labels,
    chunk_tokens) returns the mean loss."""
    device = info.device
    dp_replicate, dp_shard = mesh_shape(cfg.parallel, info.world_size)
    output_dir = Path(cfg.train.output_dir)
    # A team's model may draw from either (dropout, random masking); checkpoints save and restore both per rank.
    torch.manual_seed(cfg.train.seed)
    random.seed(cfg.train.seed)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    if cfg.memory.limit_gib is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.memory.limit_gib * GiB / total), device)
    if cfg.memory.oom_snapshot and device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    if cfg.parallel.cpu_offload:  # AdamW steps on the host, the one CPU-bound phase of a step
        cores = max(torch.get_num_threads(), distributed.cores_per_rank())
        torch.set_num_threads(cfg.parallel.offload_threads or cores)

    mesh = distributed.build_mesh(device.type, dp_replicate, dp_shard)
    model, args = build_model(cfg, mesh, device, model_fn)
    num_params = args.num_params() if args is not None else sum(p.numel() for p in model.parameters())
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    param_dtype = resolve_param_dtype(cfg.parallel.param_dtype, device.type)
    # FSDP2's gradients are DTensors, which torch.amp's scaler handles (found-inf reduced across ranks).
    scaler = torch.amp.GradScaler(device.type) if param_dtype == "float16" else None

    t = cfg.train
    global_batch = samples_per_step(t.micro_batch_size, t.grad_accum_steps, info.world_size)
    if dataset is None:  # main() built it before the process group, to fail fast
        dataset = build_dataset(cfg.data, t.seq_len, model_args_from_config(cfg.model).vocab_size)
    if held_out is None and evaluates(cfg):
        held_out = build_dataset(cfg.data, t.seq_len, model_args_from_config(cfg.model).vocab_size, held_out=True)
    c = cfg.checkpoint
    ckpt = Checkpointer(cfg, info, model, optimizer, scheduler, scaler, signals, data=dataset.identity(),
                        model_settings=model_settings(args) if args else None,
                        storage=Checksums(c.write_threads) if c.checksums else None)
    # Watching from here on, the restore included: a rank stuck in it is named, and the others stop, within
    # dist.init_timeout_s. The `with` stops the watchdog's thread however the set-up below ends.
    with Watchdog(info.rank, info.world_size, cfg.dist.init_timeout_s, cfg.dist.timeout_s, mesh) as watchdog:
        with watchdog.doing(RESTORING):
            progress = ckpt.restore(lambda: load_weights(model, c.init_from, model_args_from_config(cfg.model),
                                                         ckpt.group, c.write_threads if c.checksums else 0))
        follow_current_schedule(scheduler, cfg.optim)
        # A skipped step is numbered, and counted toward max_skipped_steps, in the whole run, not since this resume.
        guard = NonFiniteGuard(device, t.on_nonfinite, t.max_skipped_steps, progress.step, progress.skipped_steps,
                               scaler)
        if progress.step >= t.steps:
            logger.info(f"step {progress.step} of train.steps={t.steps} is done already: nothing to train "
                        "(raise --train.steps to continue)")
            return {"step": progress.step, "history": [], "model": model, "optimizer": optimizer}
        loader = build_dataloader(dataset, num_workers=cfg.data.num_workers, micro_batch_size=t.micro_batch_size,
                                  grad_accum_steps=t.grad_accum_steps, dp_rank=info.rank, dp_size=info.world_size,
                                  start_sample=progress.consumed_samples, device_type=device.type)
        batches = iter(loader)

        if info.is_main:
            write_run_info(output_dir, to_toml(cfg), environment(device, info.world_size, mesh.mesh.shape))
            name = cfg.model.name if args is not None else model_class(model).__name__
            policy = os.environ.get("NCCL_CTA_POLICY", "unset")
            all_gather = (f" | all-gathers in NCCL symmetric memory, NCCL_CTA_POLICY={policy}"
                          if copy_engines_all_gather(cfg, info.world_size) else "")
            offload = f" | host AdamW on {torch.get_num_threads()} threads" if cfg.parallel.cpu_offload else ""
            logger.info(f"model {name}: {num_params / 1e6:,.1f}M parameters | mesh "
                        f"{dict(zip(mesh.mesh_dim_names, mesh.mesh.shape))} | {param_dtype} compute | "
                        f"global batch {global_batch} x {t.seq_len} tokens | ac {cfg.ac.mode}{all_gather}{offload}")
        metrics = Metrics(device=device, total_steps=t.steps, tokens_per_step=global_batch * t.seq_len,
                          world_size=info.world_size, output_dir=output_dir, is_main=info.is_main,
                          flops_per_token=flops_per_token(model, args, t.seq_len, num_params),
                          tensorboard=cfg.metrics.tensorboard)
        profiler = StepProfiler(cfg.profile.steps, cfg.profile.memory_snapshot, output_dir, info.rank, device,
                                history_on=cfg.memory.oom_snapshot and device.type == "cuda")
        metrics.start(progress.step)
        profiler.start(progress.step + 1)
        rows_file = start_rows_file(output_dir, progress.step) if info.is_main else None
        history, evals, memory_compared = [], [], memory_plan is None
        try:
            with ckpt.training(watchdog.paused, before_save=guard.check), scheduled_gc(t.gc_every) as collect_garbage:
                while progress.step < t.steps:
                    profiler.before(progress.step + 1)
                    metrics.phases.begin_step()
                    lr = optimizer.param_groups[0]["lr"]  # the rate this step applies (train_step advances it)
                    loss, grad_norm = train_step(model, optimizer, scheduler, batches, cfg, scaler, device, guard,
                                                 metrics.phases)
                    progress.advance(global_batch, t.seq_len)
                    profiler.after(progress.step, watchdog.paused)
                    watchdog.beat(progress.step)
                    collect_garbage(progress.step)
                    if progress.step % t.log_every == 0 or progress.step == t.steps:
                        extra = {"consumed_samples": progress.consumed_samples, "skipped_steps": guard.check()}
                        if not memory_compared and progress.step >= 2:  # the plan is of steps with AdamW state
                            extra.update(planned_vs_measured(memory_plan, device))
                            memory_compared = True
                        row = metrics.log(progress.step, mean_over_ranks(loss, info.world_size), grad_norm.item(),
                                          lr, extra=extra)
                        history.append({"step": progress.step, **row})
                        append_row(rows_file, history[-1])
                    if held_out is not None and is_due(cfg, progress.step):
                        result = evaluate(model, held_out, cfg, device, on_pass=lambda: watchdog.beat(progress.step))
                        metrics.log_eval(progress.step, result)
                        evals.append({"step": progress.step, **result})
                        append_row(rows_file, evals[-1])
                    if ckpt.after_step(progress):  # saves when due; True once the ranks agreed to stop on a signal
                        break
                ckpt.finish(progress)
        except torch.OutOfMemoryError as err:
            remedy = memory_plan and remedy_after_oom(cfg, memory_plan, requested_bytes(err))
            top = remedy.describe() if remedy else None
            snapshots = output_dir / "memory" if cfg.memory.oom_snapshot else None
            logger.error(describe_oom(err, info.rank, device, memory_plan and memory_plan.predicted_peak_bytes, top,
                                      snapshots))
            raise SystemExit(1) from None
        finally:
            profiler.close()
            metrics.close()
            stop_workers(batches)
    return {"step": progress.step, "history": history, "evals": evals, "model": model, "optimizer": optimizer,
            "scaler": scaler}


@contextlib.contextmanager
def scheduled_gc(every: int):
    """Python's garbage collector only every `every` steps (0: automatic), with what lives on entry (model,
    optimizer, loader) frozen out of every collection."""
    if not every:
        yield lambda step: None
        return
    was_enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield lambda step: gc.collect() if step % every == 0 else None
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def start_rows_file(output_dir: Path, start_step: int) -> Path:
    """<output_dir>/metrics.jsonl; a resumed run drops the rows past its step, which it redoes."""
    path = output_dir / "metrics.jsonl"
    rows = path.read_text().splitlines() if start_step and path.is_file() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(row + "\n" for row in rows if _row_step(row) <= start_step))
    return path


def _row_step(row: str) -> float:
    """A row's step; infinity (dropped) for a line cut off when a run was killed mid-write."""
    try:
        return json.loads(row)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def append_row(path: Optional[Path], row: dict) -> None:
    """Append a row as it is logged: a killed run leaves the rows of the steps it did (rank 0 only)."""
    if path is not None:
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")


@record  # torchrun's error file, and so its failure summary, gets the failing rank's real traceback
def main(argv=None, model_fn: Optional[ModelFn] = None) -> None:
    """The trainer's command line; `model_fn` trains a team's own model instead of Llama (see ModelFn, run)."""
    rank, world_size = distributed.launched_rank_and_world_size()
    # First: a preemption's signal during start-up (rendezvous, restore, compilation) must not kill the rank, or
    # torchrun counts a failure and Slurm does not requeue. The Checkpointer acts on it.
    signals = StopSignals(rank)
    signals.install()

    # Everything that can be checked without a GPU is checked before the process group or any memory.
    try:
        cfg = parse_args(argv)
        model_from_init_from(cfg)
        validate(cfg, world_size, "cuda" if torch.cuda.is_available() else "cpu", own_model=model_fn is not None)
    except (ConfigError, CheckpointError) as err:  # the same on every rank: one message is enough
        exit_with_error(str(err), show=rank == 0)
    # Errors that depend on the node (its data, its GPUs) are printed once per node, by its first rank.
    first_on_node = int(os.environ.get("LOCAL_RANK", "0")) == 0
    try:
        check_output_dirs(cfg)
        dataset = build_dataset(cfg.data, cfg.train.seq_len, model_args_from_config(cfg.model).vocab_size)
        check_enough_samples(dataset, cfg.train.micro_batch_size, cfg.train.grad_accum_steps, world_size)
        held_out = build_dataset(cfg.data, cfg.train.seq_len, model_args_from_config(cfg.model).vocab_size,
                                 held_out=True) if evaluates(cfg) else None
    except ConfigError as err:  # the data may be missing or unreadable on one node only
        exit_with_error(f"[rank {rank}] {err}", show=first_on_node)
    if rank == 0:
        print(f"data: {dataset!r}", file=sys.stderr)
    try:
        memory_plan = preflight(cfg, world_size, rank, model_fn is not None, copy_engines_all_gather(cfg, world_size))
    except ConfigError as err:  # each node plans for its own GPUs
        exit_with_error(f"[rank {rank}] {err}", show=first_on_node)
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
    if cfg.dist.flight_recorder and torch.cuda.is_available():
        enable_flight_recorder(Path(cfg.train.output_dir))
    info = distributed.init(cfg.dist.init_timeout_s, cpu_collectives=cfg.parallel.cpu_offload,
                            copy_engines=copy_engines_all_gather(cfg, world_size))
    try:
        run(cfg, info, memory_plan, signals, dataset, model_fn, held_out)
    except BaseException as err:
        distributed.shutdown(abort=not (isinstance(err, SystemExit) and not err.code))  # exit 0: a clean stop
        if isinstance(err, DataError):  # raised by the ranks that read the bad data only (a ConfigError too)
            exit_with_error(f"[rank {info.rank}] {err}", show=True)
        # Raised alike on every rank (a team's model checked once built, say): one message will do.
        if isinstance(err, (CheckpointError, ConfigError, NonFiniteError)):
            exit_with_error(str(err), show=info.is_main)
        raise
    else:
        distributed.shutdown()
    finally:
        signals.restore()


if __name__ == "__main__":
    main()
