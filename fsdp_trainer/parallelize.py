"""Activation checkpointing, compilation and FSDP2 sharding for any model whose repeated blocks can be named.

Applied in one visible order, as `parallelize()` does:
    apply_ac -> apply_compile -> apply_fsdp -> init_weights (materialize from meta, then initialize)

AC and compile replace a block's `forward` on the instance instead of wrapping the module, so parameter
names (and therefore checkpoints) are the same whatever the AC mode or compile setting.

A team's own model:

    blocks = (MyBlock,)
    apply_ac(model, blocks, mode="op")
    apply_fsdp(model, mesh, block_types=blocks)
    init_weights(model, device, seed=0)
"""

from __future__ import annotations

import functools
from typing import Iterable, Literal, Sequence

import torch
from torch import nn
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
# The interface FSDPModule.set_custom_reduce_scatter takes; torch.distributed.fsdp does not re-export it.
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fsdp_trainer.models.llama import param_generator

ACMode = Literal["none", "full", "selective", "op"]
ReshardPolicy = Literal["default", "always", "never"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def blocks_of(model: nn.Module, block_types: Sequence[type]) -> list[nn.Module]:
    blocks = [m for m in model.modules() if isinstance(m, tuple(block_types))]
    if not blocks:
        names = ", ".join(t.__name__ for t in block_types)
        raise ValueError(f"{type(model).__name__} has no submodule of type {names}; pass the class of its "
                         "repeated blocks as block_types")
    return blocks


def _replace_forward(module: nn.Module, wrap) -> None:
    inner = module.forward
    module.forward = functools.wraps(inner)(functools.partial(wrap, inner))


# Outputs worth keeping under per-op AC: the matmuls and attention are the expensive ops to recompute;
# everything else (norms, activations, RoPE, residual adds) is cheap elementwise work.
_OP_AC_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _op_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _OP_AC_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(inner, *args, context_fn=None, **kwargs):
    if context_fn is None:
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)
    return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def apply_ac(model: nn.Module, block_types: Sequence[type], mode: ACMode, every: int = 2) -> None:
    """Activation checkpointing per block: full, every `every`-th block (selective), or per-op (op)."""
    if mode == "none":
        return
    op_context = functools.partial(create_selective_checkpoint_contexts, _op_policy)
    for index, block in enumerate(blocks_of(model, block_types)):
        if mode == "full" or (mode == "selective" and (index + 1) % every == 0):
            _replace_forward(block, _checkpointed)
        elif mode == "op":
            _replace_forward(block, functools.partial(_checkpointed, context_fn=op_context))


def apply_compile(model: nn.Module, block_types: Sequence[type]) -> None:
    """Compile each block's forward (the blocks repeat, so one compilation serves them all).

    The forward is compiled rather than the module so that FSDP's hooks, registered on the module
    afterwards, stay outside the graph."""
    for block in blocks_of(model, block_types):
        block.forward = torch.compile(block.forward, fullgraph=True)


class ComputePoolReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter with its output, which becomes the sharded gradients, allocated from the compute
    stream's memory pool instead of the reduce-scatter stream's.

    The caching allocator lends a stream's freed memory to that stream only. Left on the reduce-scatter stream, the
    gradients that zero_grad frees stay reserved for the next step's gradients, out of reach of the next forward's
    activations, which peak while no gradient exists: 4 bytes per local parameter reserved beyond the peak.

    No `record_stream` is needed where every free of the output is ordered on the compute stream behind the
    reduce-scatter: FSDP2 makes the compute stream wait for the reduce-scatter stream before the optimizer, and
    zero_grad frees the gradients after it. That holds only when the output itself becomes the gradient: a 1-D mesh
    (HSDP all-reduces it on another stream), float32 reduction into the float32 shards (no cast to a new tensor),
    no CPU offload (no copy to host), and no accumulation into an existing sharded gradient, which adds the output
    on the reduce-scatter stream and drops it at once (`grads_in_compute_pool` in `fsdp_trainer.config` checks
    all four). `record_stream` would be safe everywhere, but it defers each freed block until the GPU has passed
    the reduce-scatter stream's work, and the CPU runs a step ahead: measured on 4 H200s, it reserved no less."""

    def __init__(self, compute_stream: torch.cuda.Stream):
        self.compute_stream = compute_stream

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        stream = torch.cuda.current_stream(device)
        with torch.cuda.stream(self.compute_stream):
            buffer = torch.empty(*size, dtype=dtype, device=device)
        # The block may have been freed by compute-stream work still queued: the stream that writes it waits for
        # that work first. FSDP2 makes the same wait before its reduce-scatter; here it does not depend on where.
        if stream != self.compute_stream:
            stream.wait_stream(self.compute_stream)
        return buffer

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, block_types: Sequence[type],
               groups: Iterable[Sequence[nn.Module]] = (),
               param_dtype: torch.dtype = torch.bfloat16, reduce_dtype: torch.dtype = torch.float32,
               reshard_after_forward: ReshardPolicy = "default", keep_gathered: int = 0, prefetch: int = 1,
               cpu_offload: bool = False, grads_in_compute_pool: bool = False) -> None:
    """`fully_shard` each block, then each extra group of modules, then the root.

    `groups` are modules outside the blocks that deserve their own all-gather (for Llama: the embedding;
    the final norm with the output projection), listed in forward order. A 1-D mesh shards; a 2-D
    (replicate, shard) mesh gives HSDP. Sharded parameters stay float32 (the optimizer's master weights);
    `param_dtype` is only the dtype they are gathered in. `keep_gathered` blocks, counted back from the last, also
    stay gathered after forward under the default policy. `prefetch` > 1 makes each block all-gather that many
    blocks ahead of itself, in forward and in backward (1 leaves FSDP2's schedule of one ahead).
    `grads_in_compute_pool` lets the sharded gradients and the activations share memory (CUDA; see
    `ComputePoolReduceScatter` for when it is safe: the caller vouches for it)."""
    if grads_in_compute_pool and (mesh.ndim != 1 or cpu_offload or reduce_dtype != torch.float32):
        raise ValueError("grads_in_compute_pool needs a 1-D mesh, float32 reduction and no CPU offload: the sharded "
                         "gradients must be the reduce-scatter's output itself")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    shard = functools.partial(fully_shard, mesh=mesh, mp_policy=mp, offload_policy=offload)
    blocks = blocks_of(model, block_types)
    groups = [list(group) for group in groups]

    def reshard(keep: bool) -> bool:
        return {"always": True, "never": False, "default": not keep}[reshard_after_forward]

    for index, block in enumerate(blocks):
        # The module that runs last in forward runs first in backward: freeing its parameters only to
        # all-gather them again at once would cost a collective and save no memory at the peak.
        is_last = index == len(blocks) - 1 and not groups
        shard(block, reshard_after_forward=reshard(is_last or index >= len(blocks) - keep_gathered))
    for index, group in enumerate(groups):
        shard(group if len(group) > 1 else group[0], reshard_after_forward=reshard(index == len(groups) - 1))
    shard(model)
    if grads_in_compute_pool and mesh.device_type == "cuda":  # one memory pool per device elsewhere
        comm = ComputePoolReduceScatter(torch.cuda.current_stream())
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(comm)
    if prefetch > 1:
        for index, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[index + 1:index + 1 + prefetch])
            block.set_modules_to_backward_prefetch(blocks[max(0, index - prefetch):index][::-1])


@torch.no_grad()
def init_weights(model: nn.Module, device: torch.device, seed: int = 0, offload: bool = False) -> None:
    """Materialize a model built on the meta device and initialize it, identically for any sharding.

    Models with `init_param(name, full_tensor, generator)` (ours) get each parameter filled as a full
    tensor from a generator seeded by (seed, name), then keep their local shard: the weights do not depend
    on the world size or mesh. Other models get `reset_parameters()` of every submodule, which is
    world-size independent only where DTensor's random ops are (CUDA). With `offload` (FSDP's CPU offload)
    parameters are materialized in host memory and buffers on `device`."""
    torch.manual_seed(seed)
    model.to_empty(device="cpu" if offload else device)
    if offload:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    if hasattr(model, "init_buffers"):
        model.init_buffers()
    if not hasattr(model, "init_param"):
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        return
    for name, param in model.named_parameters():
        full = torch.empty(param.shape, dtype=param.dtype, device=device)
        model.init_param(name, full, param_generator(seed, name, full.device))
        if isinstance(param, DTensor):
            # Every rank built the same full tensor, so each can cut its own shard without communication.
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)
