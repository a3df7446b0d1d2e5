"""Evaluate a checkpoint on held-out data: the numbers training logs as val/*, on any number of ranks, CPU or GPUs.

    python -m fsdp_trainer.tools.evaluate --config outputs/config.toml     # the debug run's newest checkpoint
    torchrun --nproc_per_node=8 -m fsdp_trainer.tools.evaluate --config configs/llama3_8b.toml \\
        --data.source tokens --data.path data/mycorpus --eval.samples 0 \\
        --checkpoint.resume outputs/llama3_8b/checkpoints/step_00001000     # the whole held-out split

The weights are those training with the same flags would start from: checkpoint.resume (auto: the newest complete
checkpoint in the run's folder; a path: that one), else checkpoint.init_from (a checkpoint, or hf:<folder>), else
the initialized weights of train.seed. The held-out data, eval.samples, eval.micro_batch_size, train.seq_len and
parallel.param_dtype and compile mean what they mean in training. The model is sharded over all ranks (no HSDP, no
CPU offload). Rank 0 prints the results as a metrics.jsonl row on stdout, and the console line on stderr.
"""

from __future__ import annotations

import json
from typing import Optional, Sequence

import torch

from fsdp_trainer import distributed
from fsdp_trainer.checkpoint import CheckpointError, find_latest
from fsdp_trainer.config import (Config, ConfigError, checkpoint_root, exit_with_error, parse_args,
                                 resolve_param_dtype, validate)
from fsdp_trainer.data import build_dataset
from fsdp_trainer.distributed import logger
from fsdp_trainer.evaluate import evaluate
from fsdp_trainer.metrics import eval_line
from fsdp_trainer.models.llama import TransformerBlock, build, model_args_from_config
from fsdp_trainer.parallelize import DTYPES, apply_compile, apply_fsdp, init_weights
from fsdp_trainer.tools.weights import load_weights, model_from_init_from, resolve


def weights_of(cfg: Config) -> tuple[Optional[str], Optional[int]]:
    """The weights to evaluate, as load_weights takes them (None: the initialized ones), and their step."""
    resume = cfg.checkpoint.resume
    if resume != "none":
        checkpoint = (find_latest(checkpoint_root(cfg)) if resume == "auto"
                      else resolve(resume, "--checkpoint.resume"))
        if checkpoint is not None:
            return str(checkpoint.path), checkpoint.state["step"]
    return cfg.checkpoint.init_from, None


def main(argv: Optional[Sequence[str]] = None) -> None:
    rank, world_size = distributed.launched_rank_and_world_size()
    try:
        cfg = parse_args(argv, description=__doc__.split("\n\n")[0], prog="python -m fsdp_trainer.tools.evaluate")
        cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cfg.parallel.cpu_offload = 1, -1, False
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        model_from_init_from(cfg)
        validate(cfg, world_size, device_type)
        args = model_args_from_config(cfg.model)
        held_out = build_dataset(cfg.data, cfg.train.seq_len, args.vocab_size, held_out=True)
        source, step = weights_of(cfg)
    except (ConfigError, CheckpointError) as err:
        exit_with_error(err, show=rank == 0)
    info = distributed.init(cfg.dist.init_timeout_s)
    try:
        mesh = distributed.build_mesh(info.device.type, 1, info.world_size)
        model = build(args, device="meta")
        if cfg.parallel.compile:
            apply_compile(model, (TransformerBlock,))
        # The embedding and output projection stay with the root: without a backward, finer units save nothing.
        apply_fsdp(model, mesh, block_types=(TransformerBlock,),
                   param_dtype=DTYPES[resolve_param_dtype(cfg.parallel.param_dtype, device_type)])
        init_weights(model, info.device, seed=cfg.train.seed)
        if source is not None:
            load_weights(model, source, args, None, cfg.checkpoint.write_threads if cfg.checkpoint.checksums else 0)
        row = {"step": step, "weights": source or f"initialized (train.seed={cfg.train.seed})",
               **evaluate(model, held_out, cfg, info.device)}
    except CheckpointError as err:  # the same on every rank: the weights do not fit the model
        distributed.shutdown(abort=True)
        exit_with_error(err, show=info.is_main)
    if info.is_main:
        logger.info(f"{row['weights']} | {held_out!r} | {eval_line(row)}")
        print(json.dumps(row))
    distributed.shutdown()


if __name__ == "__main__":
    main()
