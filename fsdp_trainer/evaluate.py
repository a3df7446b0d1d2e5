"""Held-out evaluation: the mean loss per token over a fixed set of held-out samples, the same on any number of ranks.

The evaluated set is samples 0..n-1 of the held-out split (`build_dataset(..., held_out=True)`), n = eval.samples or
the whole split. With W ranks and micro-batches of b, rank r's pass p holds samples p*W*b + r*b + [0, b): every
rank runs the same number of forward passes, as FSDP's all-gathers need, and the slots past n repeat sample 0 with
every label IGNORE_INDEX, so each sample counts once whatever W. Each rank sums its tokens' losses in float32, and
one all-reduce adds the ranks' sums.

The model runs as it trains: sharded (each unit gathered in its turn), in its mixed precision, with its compiled
blocks (the first evaluation compiles their gradient-free variant, once). Activation checkpointing costs nothing
here: without gradients, torch.utils.checkpoint runs a block as it is.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from fsdp_trainer.config import Config

IGNORE_INDEX = -100
"""The label of a padding slot: cross_entropy leaves it out."""
LOSS_CHUNK_TOKENS = 4096
"""Tokens whose logits the loss turns into float32 at a time: no float32 copy of all the logits exists."""


def evaluates(cfg: Config) -> bool:
    """Whether training with cfg evaluates at some step (eval.every=0: never)."""
    return cfg.eval.every > 0 and (cfg.eval.at_end or cfg.eval.every <= cfg.train.steps)


def is_due(cfg: Config, step: int) -> bool:
    every = cfg.eval.every
    return every > 0 and (step % every == 0 or (cfg.eval.at_end and step == cfg.train.steps))


def micro_batch_size(cfg: Config) -> int:
    return cfg.eval.micro_batch_size or cfg.train.micro_batch_size


def num_samples(cfg: Config, held_out: Dataset) -> int:
    """eval.samples, or the whole split where it is 0 or more than the split holds (synthetic data has no end)."""
    total = getattr(held_out, "num_samples", None)
    return total if total is not None and not 0 < cfg.eval.samples <= total else cfg.eval.samples


@torch.no_grad()
def evaluate(model: nn.Module, held_out: Dataset, cfg: Config, device: torch.device,
             on_pass: Callable[[], None] = lambda: None) -> dict:
    """The model's loss on the held-out set, the same on every rank: val/loss (mean per token), val/perplexity,
    val/tokens, val/seconds and val/tokens_per_s_per_gpu. `on_pass` is called after each forward pass."""
    start = time.perf_counter()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    samples, b = num_samples(cfg, held_out), micro_batch_size(cfg)
    passes = math.ceil(samples / (world_size * b))
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    tokens = 0
    try:
        for first in range(rank * b, passes * world_size * b, world_size * b):
            indices = range(first, first + b)
            inputs, labels = map(torch.stack, zip(*(held_out[g if g < samples else 0] for g in indices)))
            labels[torch.tensor([g >= samples for g in indices])] = IGNORE_INDEX
            tokens += int((labels != IGNORE_INDEX).sum())
            logits = model(inputs.to(device, non_blocking=True)).flatten(0, -2)
            labels = labels.to(device, non_blocking=True).flatten()
            for i in range(0, len(labels), LOSS_CHUNK_TOKENS):
                chunk = slice(i, i + LOSS_CHUNK_TOKENS)
                loss_sum += F.cross_entropy(logits[chunk].float(), labels[chunk], ignore_index=IGNORE_INDEX,
                                            reduction="sum")
            del logits  # before the next pass's exist
            on_pass()
    finally:
        model.train(was_training)
    totals = torch.tensor([tokens], dtype=torch.int64, device=device)
    dist.all_reduce(loss_sum)
    dist.all_reduce(totals)
    loss, tokens = loss_sum.item() / totals.item(), totals.item()
    seconds = time.perf_counter() - start
    return {"val/loss": loss, "val/perplexity": math.inf if loss > 700 else math.exp(loss), "val/tokens": tokens,
            "val/seconds": seconds, "val/tokens_per_s_per_gpu": tokens / seconds / world_size}
