"""The training loss, cross-entropy in float32, computed one of three ways.

- Eager, `cross_entropy` holds three float32 tensors of the logits' size at its backward.
- Compiled with the blocks (`compiled_cross_entropy`), Inductor saves only the logits and a log-sum-exp per token,
  and writes the logits' gradient in param_dtype in one pass: no float32 tensor of that size exists.
- Chunked (`train.loss_chunk_tokens`, `linear_cross_entropy`), the whole sequence's logits never exist: each chunk's
  logits become its loss and its gradients (known in forward, as the loss is the last operation), then are dropped.
  The weight's gradient sums over chunks in float32: in bfloat16 its rounding error would grow with the chunks.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of the cross-entropy of logits [..., vocab] (any float dtype) in float32."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())


# Compiled on first call, for one shape per run (train.seq_len x micro_batch_size).
compiled_cross_entropy = torch.compile(cross_entropy, fullgraph=True)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk_tokens: int) -> torch.Tensor:
    """Mean over tokens of cross_entropy(hidden @ weight.T, labels), in float32.

    hidden: [..., dim]; weight: [vocab, dim]; labels: [...] with every entry a valid class (no ignore_index).
    Differentiable with respect to hidden and weight; under no_grad only the loss is computed."""
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, labels, chunk_tokens)
    return _loss_sum(hidden, weight, labels, chunk_tokens, None, None) / labels.numel()


def _loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int,
              grad_hidden: Optional[torch.Tensor], grad_weight: Optional[torch.Tensor]) -> torch.Tensor:
    """Sum of the per-token losses; fills grad_hidden and adds into grad_weight the gradients of that sum."""
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, labels.numel(), chunk_tokens):
        h, y = hidden[start:start + chunk_tokens], labels[start:start + chunk_tokens]
        logits = (h @ weight.t()).float()
        logsumexp = torch.logsumexp(logits, dim=-1)
        total += (logsumexp - logits.gather(1, y[:, None]).squeeze(1)).sum()
        if grad_hidden is None and grad_weight is None:
            continue
        # d(sum of losses)/d(logits) = softmax(logits) - one_hot(labels), built in place in the float32 logits.
        probs = logits.sub_(logsumexp[:, None]).exp_()
        probs[torch.arange(y.numel(), device=y.device), y] -= 1
        grad_logits = probs.to(hidden.dtype)
        del logits, probs
        if grad_hidden is not None:
            torch.mm(grad_logits, weight, out=grad_hidden[start:start + chunk_tokens])
        if grad_weight is not None:
            # In float16 the product alone, a sum over the chunk's tokens, can pass 65504 before any loss scale
            # divides it: every later step would overflow alike, the scaler would cut its scale to a stop.
            grad_weight += grad_logits.t().float() @ h.float() if h.dtype == torch.float16 else grad_logits.t() @ h
        del grad_logits  # before the next chunk's float32 logits exist: one chunk's buffers at a time
    return total


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_tokens):
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        # The gradients of the *sum* are kept: with float16 those of the mean would underflow before backward
        # multiplies in the loss scale. The weight's, a sum over every token, could overflow float16 instead: it
        # stays float32 until then.
        total = _loss_sum(hidden, weight, labels, chunk_tokens, grad_hidden, grad_weight)
        if grad_weight is not None and weight.dtype != torch.float16:
            grad_weight = grad_weight.to(weight.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.tokens, ctx.weight_dtype = labels.numel(), weight.dtype
        return total / ctx.tokens

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_output / ctx.tokens
        # In place: the held gradients become the returned ones, so backward allocates nothing here (but float16's
        # cast of the weight's).
        return (grad_hidden.mul_(scale) if grad_hidden is not None else None,
                grad_weight.mul_(scale).to(ctx.weight_dtype) if grad_weight is not None else None, None, None)
