"""The optimizer's pieces against values worked out by hand, not by the code under test."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_trainer.config import OptimConfig
from fsdp_trainer.optim import build_optimizer, build_scheduler, clip_grad_norm, lr_at


@pytest.mark.parametrize("warmup,schedule,expected", [
    # lr 1, min_lr 0.1, 6 steps. 2 warmup steps: 0.5, then the peak 1 once; the 4 steps after it decay with progress
    # 1/4, 2/4, 3/4 and 1, so the last step applies min_lr.
    (2, "cosine", [0.5, 1.0, 0.1 + 0.45 * (1 + 0.5 ** 0.5), 0.55, 0.1 + 0.45 * (1 - 0.5 ** 0.5), 0.1]),
    (2, "linear", [0.5, 1.0, 0.775, 0.55, 0.325, 0.1]),
    (2, "constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
    # No warmup: the first step applies the peak, then 5 steps decay to min_lr.
    (0, "linear", [1.0, 0.82, 0.64, 0.46, 0.28, 0.1]),
])
def test_schedule_values(warmup, schedule, expected):
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=warmup, schedule=schedule)
    assert [lr_at(step, cfg, 6) for step in range(6)] == pytest.approx(expected)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    scheduler = build_scheduler(optimizer, cfg, 6)
    applied = []
    for _ in range(6):
        applied.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert applied == pytest.approx(expected)


def test_clipping_scales_the_gradients_to_the_max_norm_and_returns_the_norm_before():
    model = nn.Linear(2, 2, bias=False)
    model.weight.grad = torch.tensor([[3.0, 0.0], [0.0, 4.0]])  # norm 5
    norm = clip_grad_norm(model, max_norm=1.0)
    assert norm.item() == pytest.approx(5.0)
    torch.testing.assert_close(model.weight.grad, torch.tensor([[0.6, 0.0], [0.0, 0.8]]), rtol=1e-5, atol=1e-6)
    model.weight.grad = torch.tensor([[0.3, 0.0], [0.0, 0.4]])  # under the limit: untouched
    clip_grad_norm(model, max_norm=1.0)
    torch.testing.assert_close(model.weight.grad, torch.tensor([[0.3, 0.0], [0.0, 0.4]]))


@pytest.mark.parametrize("grad,applied", [
    ([[3.0, 0.0], [0.0, 4.0]], [[0.6, 0.0], [0.0, 0.8]]),  # norm 5, clipped to 1
    ([[0.3, 0.0], [0.0, 0.4]], [[0.3, 0.0], [0.0, 0.4]]),  # under the limit: applied as it is
])
def test_clipping_in_the_fused_step_applies_the_clipped_gradient(grad, applied):
    """Given the optimizer, the gradient stays as it is and the step applies it clipped: AdamW's first moment
    after one step is (1 - beta1) x the gradient it applied."""
    model = nn.Linear(2, 2, bias=False)
    optimizer = build_optimizer(model, OptimConfig(betas=(0.9, 0.95)))
    model.weight.grad = torch.tensor(grad)
    norm = clip_grad_norm(model, max_norm=1.0, optimizer=optimizer)
    assert norm.item() == pytest.approx(sum(v * v for row in grad for v in row) ** 0.5)
    torch.testing.assert_close(model.weight.grad, torch.tensor(grad))
    optimizer.step()
    state = optimizer.state[model.weight]
    torch.testing.assert_close(state["exp_avg"], 0.1 * torch.tensor(applied), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(state["exp_avg_sq"], 0.05 * torch.tensor(applied) ** 2, rtol=1e-5, atol=1e-9)


def test_no_weight_decay_on_norms_and_other_vectors():
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.1))
    decay = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    assert decay[id(model[0].weight)] == 0.1
    assert decay[id(model[0].bias)] == decay[id(model[1].weight)] == decay[id(model[1].bias)] == 0.0
