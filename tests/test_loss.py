"""The chunked output-projection cross-entropy against F.cross_entropy on the full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fsdp_trainer.loss import linear_cross_entropy
from fsdp_trainer.models.llama import ModelArgs, build
from fsdp_trainer.parallelize import init_weights


def _inputs(tokens=37, dim=16, vocab=50, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, dim, generator=g).to(dtype).requires_grad_()
    weight = (0.3 * torch.randn(vocab, dim, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    return hidden, weight, labels


def _reference(hidden, weight, labels):
    loss = F.cross_entropy((hidden @ weight.t()).float(), labels)
    grad_hidden, grad_weight = torch.autograd.grad(loss, (hidden, weight))
    return loss, grad_hidden, grad_weight


@pytest.mark.parametrize("chunk", [1, 8, 10, 37, 1000])
def test_loss_and_gradients_match_the_full_logits_in_float32(chunk):
    hidden, weight, labels = _inputs()
    loss, grad_hidden, grad_weight = _reference(hidden, weight, labels)
    ours = linear_cross_entropy(hidden, weight, labels, chunk)
    ours_hidden, ours_weight = torch.autograd.grad(ours * 3.0, (hidden, weight))  # a loss scale passes through
    torch.testing.assert_close(ours, loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours_hidden, 3.0 * grad_hidden, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ours_weight, 3.0 * grad_weight, rtol=1e-5, atol=1e-7)


def test_bfloat16_stays_close_to_the_full_logits():
    hidden, weight, labels = _inputs(tokens=256, dim=64, vocab=300, dtype=torch.bfloat16)
    loss, grad_hidden, grad_weight = _reference(hidden, weight, labels)
    ours = linear_cross_entropy(hidden, weight, labels, 64)
    ours_hidden, ours_weight = torch.autograd.grad(ours, (hidden, weight))
    assert ours.dtype == torch.float32 and ours_hidden.dtype == ours_weight.dtype == torch.bfloat16
    torch.testing.assert_close(ours, loss, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(ours_hidden.float(), grad_hidden.float(), rtol=0.05, atol=2e-5)
    torch.testing.assert_close(ours_weight.float(), grad_weight.float(), rtol=0.05, atol=2e-5)


def test_without_grad_only_the_loss_is_computed():
    hidden, weight, labels = _inputs()
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, 8)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, F.cross_entropy(hidden @ weight.t(), labels))


def test_frozen_weight_gets_no_gradient():
    hidden, weight, labels = _inputs()
    weight = weight.detach()
    linear_cross_entropy(hidden, weight, labels, 8).backward()
    _, grad_hidden, _ = _reference(hidden, weight.requires_grad_(), labels)
    torch.testing.assert_close(hidden.grad, grad_hidden)


@pytest.mark.parametrize("tie,chunk", [(False, 16), (True, 16), (False, 0)])  # 0: all tokens at once
def test_model_loss_matches_cross_entropy_of_its_logits(tie, chunk):
    args = ModelArgs.from_preset("debug", tie_embeddings=tie)
    torch.manual_seed(0)
    model = build(args, device="cpu")
    init_weights(model, "cpu", seed=0)
    tokens = torch.randint(0, args.vocab_size, (2, 24))
    labels = torch.randint(0, args.vocab_size, (2, 24))
    reference = F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten())
    expected = torch.autograd.grad(reference, list(model.parameters()))
    ours = model(tokens, labels, chunk)
    got = torch.autograd.grad(ours, list(model.parameters()))
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)
    for (name, _), a, b in zip(model.named_parameters(), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_compiled_cross_entropy_matches_eager_in_value_and_gradient():
    from fsdp_trainer.loss import compiled_cross_entropy, cross_entropy
    g = torch.Generator().manual_seed(0)
    source = (3 * torch.randn(2, 64, 500, generator=g)).to(torch.bfloat16)
    labels = torch.randint(0, 500, (2, 64), generator=g)
    results = []
    for loss_of in (cross_entropy, compiled_cross_entropy):
        logits = source.clone().requires_grad_()
        loss = loss_of(logits, labels)
        loss.backward()
        results.append((loss.detach(), logits.grad))
    (eager_loss, eager_grad), (loss, grad) = results
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, eager_grad)


def test_the_weight_gradient_is_no_less_precise_in_many_chunks():
    """Summed over 64 chunks, the weight's bfloat16 gradient keeps the precision of the unchunked one."""
    hidden, weight, labels = _inputs(tokens=4096, dim=64, vocab=256, dtype=torch.bfloat16)
    exact = torch.autograd.grad(F.cross_entropy(hidden.double() @ weight.double().t(), labels), weight)[0]

    def error(chunk):
        grad = torch.autograd.grad(linear_cross_entropy(hidden, weight, labels, chunk), weight)[0]
        return ((grad.double() - exact).norm() / exact.norm()).item()

    assert error(64) <= 1.5 * error(4096)


@pytest.mark.parametrize("chunk", [2048, 8192])  # 8192: one chunk, whose own sum passes 65504
def test_float16_weight_gradient_of_many_tokens_does_not_overflow_before_the_loss_scale_divides_it(chunk):
    """Over 8192 tokens of one frequent label the weight's gradient of the summed loss passes float16's 65504,
    while the scaled gradient of the mean (what backward returns) fits easily."""
    torch.manual_seed(0)
    hidden = (torch.randn(8192, 16) * 0.5 + 16).half().requires_grad_()
    weight = (torch.randn(32, 16) * 0.01).half().requires_grad_()
    labels = torch.zeros(8192, dtype=torch.long)
    labels[::4] = 1
    scale = 1024.0
    linear_cross_entropy(hidden, weight, labels, chunk).backward(torch.tensor(scale, dtype=torch.float16))
    reference = weight.detach().float().requires_grad_()
    (F.cross_entropy(hidden.detach().float() @ reference.t(), labels) * scale).backward()
    assert weight.grad.dtype == torch.float16
    torch.testing.assert_close(weight.grad.float(), reference.grad, rtol=2e-3, atol=1e-2)
