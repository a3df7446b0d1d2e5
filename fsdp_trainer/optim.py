"""AdamW, the learning-rate schedule, gradient clipping by the true global norm, and skipping non-finite steps."""

import math
from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from fsdp_trainer.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """Fused AdamW (on CPU too: one pass over each parameter's state) over the sharded float32 parameters, without
    weight decay on norms and other 1-D parameters. `grad_scale` clips and `found_inf` skips, without a host sync."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then decay to min_lr. Each end is applied
    once: lr by the last warmup step (the first step without warmup), min_lr by the last step, total_steps - 1."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    peak = max(cfg.warmup_steps - 1, 0)
    progress = min(1.0, (step - peak) / max(1, total_steps - 1 - peak))
    if cfg.schedule == "linear":
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """A LambdaLR over `lr_at`, so its state (the step count) checkpoints with the rest."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg, total_steps) / cfg.lr)


def follow_current_schedule(scheduler, cfg: OptimConfig) -> None:
    """After a resume: this run's optim settings from the saved step on. LambdaLR's state brings back the saved base
    rate and the groups' last rate: a new optim.lr would apply only as a ratio, and only from the step after next."""
    scheduler.base_lrs = [cfg.lr] * len(scheduler.base_lrs)
    # LambdaLR's own arithmetic, not lr_at: a resumed run must apply an uninterrupted one's rates to the last bit.
    for group, base_lr, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * factor(scheduler.last_epoch)


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float, optimizer: Optional[torch.optim.Optimizer] = None
                   ) -> torch.Tensor:
    """Clip gradients to `max_norm` (0: no clipping); return the global L2 norm over all shards, as a plain tensor.
    Given the fused optimizer, its next step divides each gradient by `grad_scale` as it reads it, saving a pass over
    the gradients; without it (the float16 loss scaler sets `grad_scale` itself) they are multiplied in place."""
    params = [p for p in model.parameters() if p.grad is not None]
    total_norm = get_total_norm([p.grad for p in params], norm_type=2.0, foreach=True)
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()  # the shards' partial norms reduced: the whole gradient's norm
    if max_norm <= 0:
        return total_norm
    if optimizer is not None:
        # The reciprocal of clip_grads_with_norm_'s factor, with its epsilon; 1 (an exact no-op) under the limit.
        optimizer.grad_scale = torch.clamp((total_norm + 1e-6) / max_norm, min=1.0)
    else:
        clip_grads_with_norm_(params, max_norm, total_norm, foreach=True)  # takes the parameters, not the grads
    return total_norm


class NonFiniteError(RuntimeError):
    pass


MIN_LOSS_SCALE = 1.0  # below it, float16's gradients overflow even unscaled: the run has diverged
_FIXES = "Lower optim.lr, raise optim.warmup_steps, check the data"


class NonFiniteGuard:
    """Skips the updates whose global grad norm is not finite, on the device (fused AdamW's `found_inf`), and counts
    them for the whole run, read on logging steps and before saves. Under float16 the loss scaler skips them itself;
    the run stops once its scale falls below MIN_LOSS_SCALE."""

    def __init__(self, device: torch.device, mode: str, max_skipped: int, start_step: int = 0, skipped: int = 0,
                 scaler: Optional[torch.amp.GradScaler] = None):
        self.mode, self.max_skipped, self.step_number, self.scaler = mode, max_skipped, start_step, scaler
        self.skipped_before, self.skipped = skipped, torch.full((), skipped, device=device, dtype=torch.int64)
        self.first_bad = torch.full((), -1, device=device, dtype=torch.int64)

    def step(self, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> None:
        """optimizer.step(), unless grad_norm is not finite."""
        self.step_number += 1
        bad = ~torch.isfinite(grad_norm)
        self.skipped += bad
        self.first_bad = torch.where(bad & (self.first_bad < 0), self.step_number, self.first_bad)
        optimizer.found_inf = bad.float()
        optimizer.step()

    def check(self) -> int:
        """Raise if the configured limit is exceeded; return the number of skipped steps (a host sync)."""
        if self.scaler is not None and self.scaler.get_scale() < MIN_LOSS_SCALE:
            raise NonFiniteError(f"the float16 loss scale fell to {self.scaler.get_scale():g}: the gradients overflow "
                                 f"even unscaled, so every step is skipped. {_FIXES}, or train in bfloat16.")
        skipped = int(self.skipped.item())
        # stop: any since this run started; skip: more than max_skipped in the whole run, perhaps all before a resume
        if self.mode == "stop" and skipped > self.skipped_before:
            raise NonFiniteError(f"non-finite loss or gradient norm at step {int(self.first_bad.item())}, not applied "
                                 f"and followed by no checkpoint. {_FIXES} around it, or set train.on_nonfinite=skip.")
        if self.mode == "skip" and skipped > self.max_skipped:
            first = int(self.first_bad.item())
            since = (f"the first of this run at step {first}" if first >= 0 else
                     "all before the checkpoint this run resumed from")
            raise NonFiniteError(f"{skipped} steps with a non-finite loss or gradient norm were skipped ({since}), "
                                 f"more than train.max_skipped_steps={self.max_skipped}. {_FIXES}, or raise "
                                 "train.max_skipped_steps.")
        return skipped
