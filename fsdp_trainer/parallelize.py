"""Activation checkpointing, compilation and FSDP2 sharding for any model whose repeated blocks can be named.

In one order, as `fsdp_trainer.train.build_model` applies it to Llama and to a team's own model:

    blocks = (MyBlock,)
    apply_ac(model, blocks, mode="op")
    apply_compile(model, blocks)
    apply_fsdp(model, mesh, block_types=blocks, groups=[[model.embed], [model.norm, model.head]])
    init_weights(model, device, seed=0)  # a model built on meta: the same weights for any world size

AC and compile replace a block's `forward` on the instance instead of wrapping the module, so parameter names (and
so checkpoints) do not depend on them. The blocks must be registered in the order forward runs them, as in nearly
every model: keep_gathered and prefetch count blocks by it, and it tells which unit runs last in forward.
"""

from __future__ import annotations

import contextlib
import functools
import zlib
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
# Alpha in torch 2.11, and what FSDP2's own set_symm_mem_for_comm (torch 2.13) uses.
from torch.distributed import _symmetric_memory as symm_mem
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
# The interfaces FSDPModule.set_custom_all_gather/_reduce_scatter take; torch.distributed.fsdp does not export them.
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def blocks_of(model: nn.Module, block_types: Sequence[type] | type) -> list[nn.Module]:
    """The model's submodules of the block classes, in registration order."""
    types = block_types if isinstance(block_types, type) else tuple(block_types)
    blocks = [m for m in model.modules() if isinstance(m, types)]
    if not blocks:
        names = ", ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise ValueError(f"{type(model).__name__} has no submodule of the block classes ({names}): pass the classes "
                         "of its repeated blocks as block_types (for a model without any, of its largest submodules)")
    return blocks


def block_ac_modes(n_blocks: int, mode: str, every: int) -> list[str]:
    """How each block runs under AC `mode` (none, full, selective, op): "checkpointed" whole, per "op", or "none".
    Selective checkpoints blocks every, 2*every, ... (1-based). What apply_ac wraps and the planner prices."""
    if mode == "selective":
        return ["checkpointed" if (i + 1) % every == 0 else "none" for i in range(n_blocks)]
    return [{"none": "none", "op": "op", "full": "checkpointed"}[mode]] * n_blocks


# Outputs worth keeping under per-op AC: the matmuls and attention are the expensive ops to recompute; the rest
# (norms, activations, RoPE, residual adds) is cheap elementwise work. Linear layers with a bias run addmm,
# batched and hand-written attention bmm/baddbmm.
_OP_AC_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _op_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _OP_AC_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, block_types: Sequence[type], mode: str, every: int = 2) -> None:
    """Activation checkpointing per block: none, full, selective (every `every`-th block) or op (per-op)."""
    whole = functools.partial(checkpoint, use_reentrant=False)
    per_op = functools.partial(whole, context_fn=functools.partial(create_selective_checkpoint_contexts, _op_policy))
    blocks = blocks_of(model, block_types)
    for block, how in zip(blocks, block_ac_modes(len(blocks), mode, every)):
        if how != "none":
            inner = block.forward
            block.forward = functools.wraps(inner)(functools.partial(whole if how == "checkpointed" else per_op, inner))


def apply_compile(model: nn.Module, block_types: Sequence[type]) -> None:
    """Compile each block's forward (the blocks repeat, so one compilation serves them all). The forward, not the
    module: FSDP's hooks, registered on the module afterwards, stay outside the graph."""
    for block in blocks_of(model, block_types):
        block.forward = torch.compile(block.forward, fullgraph=True)


class ComputePoolReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter with its output, which becomes the sharded gradients, allocated from the compute
    stream's memory pool. The caching allocator lends a stream's freed memory to that stream only: left on the
    reduce-scatter stream, the gradients zero_grad frees stay out of reach of the next forward's activations.

    No `record_stream` is needed while every free of the output is ordered on the compute stream behind the
    reduce-scatter, which holds only when the output itself becomes the gradient: a 1-D mesh, float32 reduction, no
    CPU offload (apply_fsdp refuses the others) and no accumulation into an existing gradient (refused here).
    `params`: the parameters whose gradients this fully_shard call's reduce-scatter makes."""

    def __init__(self, compute_stream: torch.cuda.Stream, params: Sequence[nn.Parameter]):
        self.compute_stream, self.params = compute_stream, params

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if any(p.grad is not None for p in self.params):
            raise RuntimeError("grads_in_compute_pool: this reduce-scatter would add into gradients that already "
                               "exist, unsafe with the gradients in the compute stream's memory; sync gradients on "
                               "the last micro-batch only (parallel.defer_grad_sync), zero_grad(set_to_none=True), "
                               "or turn grads_in_compute_pool off")
        stream = torch.cuda.current_stream(device)
        with torch.cuda.stream(self.compute_stream):
            buffer = torch.empty(*size, dtype=dtype, device=device)
        if stream != self.compute_stream:  # the block may have been freed by compute-stream work still queued
            stream.wait_stream(self.compute_stream)
        return buffer

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class SymmetricMemoryAllGather(AllGather):
    """FSDP2's all-gather into NCCL symmetric memory, registered with the group's communicator: on one host with
    NCCL_CTA_POLICY=2, NCCL copies it with the copy engines, leaving every SM to the compute."""

    def __init__(self, group: dist.ProcessGroup):
        symm_mem.set_backend("NCCL")
        dist.barrier(group=group)  # the group's NCCL communicator must exist before the first rendezvous

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        with _symmetric_memory_errors(), torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device)):
            return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        with _symmetric_memory_errors():
            symm_mem.rendezvous(output_tensor, group=group.group_name)
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


@contextlib.contextmanager
def _symmetric_memory_errors():
    """NCCL refusing symmetric memory (no cuMem in a container, say) names the way around it; running out of memory
    and a peer's failure pass as they came, for the OOM report and the watchdog."""
    try:
        yield
    except (torch.OutOfMemoryError, dist.DistError):
        raise
    except RuntimeError as err:
        raise RuntimeError(f"NCCL symmetric memory for the all-gathers failed ({err}); train with FSDP2's own "
                           "all-gather: --parallel.no_copy_engine_all_gather") from err


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, block_types: Sequence[type],
               groups: Iterable[Sequence[nn.Module]] = (),
               param_dtype: torch.dtype = torch.bfloat16, reduce_dtype: torch.dtype = torch.float32,
               reshard_after_forward: str = "default", keep_gathered: int = 0, prefetch: int = 1,
               cpu_offload: bool = False, grads_in_compute_pool: bool = False,
               symmetric_memory_all_gather: bool = False) -> None:
    """`fully_shard` each block, then each group of modules, then the root (what no block or group holds).

    `groups`: modules outside the blocks that share an all-gather of their own (Llama's embedding; its final norm
    with the output projection); tied weights must stay in one. A 2-D (replicate, shard) mesh gives HSDP. The
    shards stay in the model's float32 (the optimizer's master weights), gathered in `param_dtype` and reduced in
    `reduce_dtype`. reshard_after_forward: default, always or never; under default, the `keep_gathered` last
    blocks stay gathered after forward too. `prefetch` > 1: each block all-gathers that many blocks ahead.
    CUDA only: `grads_in_compute_pool` (ComputePoolReduceScatter) and `symmetric_memory_all_gather`
    (SymmetricMemoryAllGather, NCCL)."""
    if grads_in_compute_pool and (mesh.ndim != 1 or cpu_offload or reduce_dtype != torch.float32):
        raise ValueError("grads_in_compute_pool needs a 1-D mesh, float32 reduction and no CPU offload: the sharded "
                         "gradients must be the reduce-scatter's output itself")
    blocks, groups = blocks_of(model, block_types), [list(group) for group in groups]
    # The unit that runs last in forward runs first in backward: resharding it only to all-gather it again at once
    # would cost a collective and save no memory at the peak. By registration order: the last block, or a group
    # with a module registered after it (Llama's final norm and output projection, even tied to the embedding).
    position = {id(module): index for index, module in enumerate(model.modules())}
    last = max([[blocks[-1]], *groups], key=lambda unit: max(position[id(module)] for module in unit))
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload_policy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    all_gather = None  # with no one to gather from, FSDP2 gathers nothing
    if symmetric_memory_all_gather and mesh.size(-1) > 1:
        all_gather = SymmetricMemoryAllGather(mesh.get_group(mesh.ndim - 1))
    claimed: set[int] = set()

    def shard(modules: list[nn.Module], keep: bool | None) -> None:
        """`keep`: stay gathered after forward under the default policy (None: FSDP2's choice, for the root)."""
        policy = {} if keep is None else \
            {"reshard_after_forward": {"always": True, "never": False, "default": not keep}[reshard_after_forward]}
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh, mp_policy=mp_policy,
                    offload_policy=offload_policy, **policy)
        # One FSDP state, and so one all-gather and one reduce-scatter, per call: installed on any of its modules.
        params = {id(p): p for module in modules for p in module.parameters() if id(p) not in claimed}
        claimed.update(params)
        if all_gather:
            modules[0].set_custom_all_gather(all_gather)
        if grads_in_compute_pool:
            modules[0].set_custom_reduce_scatter(ComputePoolReduceScatter(torch.cuda.current_stream(),
                                                                          list(params.values())))

    for index, block in enumerate(blocks):
        shard([block], keep=block is last[0] or index >= len(blocks) - keep_gathered)
    for group in groups:
        shard(group, keep=group is last)
    shard([model], keep=None)  # FSDP2 keeps the root gathered after forward: backward starts with it
    if prefetch > 1:
        for index, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[index + 1:index + 1 + prefetch])
            block.set_modules_to_backward_prefetch(blocks[max(0, index - prefetch):index][::-1])


@torch.no_grad()
def init_weights(model: nn.Module, device: torch.device, seed: int = 0, offload: bool = False) -> None:
    """Materialize a model built on the meta device and initialize it, identically for any sharding.

    What the model may define, all optional:
    - `init_param(name, full_tensor, generator)`: fills each parameter as a full tensor from a generator seeded by
      (seed, name); each rank keeps its shard. Without it, every submodule's reset (`reset_of`) runs, children
      before parents as in eager construction: on a CUDA mesh on the shards (DTensor's RNG draws each as its part
      of one full tensor), elsewhere on full replicas of which each rank keeps its shard.
    - `init_buffers()`: recomputes the buffers (a RoPE table, say); without it each module's reset fills its own.
    - `tie_weights()`: ties shared parameters again after materializing.
    `offload` (FSDP's CPU offload): parameters in host memory, buffers on `device`."""
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
        sharded = [param for param in model.parameters() if isinstance(param, DTensor)]
        # On CUDA the resets stay on the shards: full replicas of a model sharded to fit would not fit one GPU.
        replicas = _full_replicas(model) if sharded and sharded[0].device_mesh.device_type != "cuda" else \
            contextlib.nullcontext()
        with replicas:
            for module in _children_first(model):
                if reset := reset_of(module):
                    reset()
        return
    if not hasattr(model, "init_buffers"):  # each buffer is its module's reset to fill (a BatchNorm's statistics)
        for module in _children_first(model):
            if (reset := reset_of(module)) and next(module.buffers(recurse=False), None) is not None:
                reset()
    for name, param in model.named_parameters():
        full = torch.empty(param.shape, dtype=param.dtype, device=device)
        model.init_param(name, full, param_generator(seed, name, full.device))
        _keep_shard(param, full)


def param_generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """A generator for one parameter: a pure function of (seed, name), never of rank or world size."""
    return torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _keep_shard(param: nn.Parameter, full: torch.Tensor) -> None:
    """Copy this rank's part of `full`, the same full tensor on every rank, into `param`."""
    if isinstance(param, DTensor):  # every rank cuts its own shard, without communication
        param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements,
                                                 src_data_rank=None).to_local())
    else:
        param.copy_(full)


@contextlib.contextmanager
def _full_replicas(model: nn.Module):
    """Within: each DTensor parameter replaced, in every module that holds it, by one full tensor of its shape (one
    per parameter, so that a tie holds). On leaving, each rank keeps its shard of it, and the DTensors return."""
    fulls: dict[int, tuple[DTensor, nn.Parameter]] = {}  # id(DTensor parameter) -> (it, its full replica)
    slots: list[tuple[nn.Module, str, DTensor]] = []
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if isinstance(param, DTensor):
                if id(param) not in fulls:
                    full = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
                    fulls[id(param)] = param, nn.Parameter(full, param.requires_grad)
                module._parameters[name] = fulls[id(param)][1]
                slots.append((module, name, param))
    try:
        yield
    finally:
        for module, name, param in slots:
            module._parameters[name] = param
    for param, replica in fulls.values():
        _keep_shard(param, replica)


def reset_of(module: nn.Module):
    """The method that initializes `module`: its reset_parameters(), or the private _reset_parameters() that
    torch.nn's own modules (MultiheadAttention, Transformer) call from their constructors instead; else None."""
    if hasattr(module, "reset_parameters"):
        return module.reset_parameters
    private = getattr(type(module), "_reset_parameters", None)
    # Where the method is defined, not the module's class, which fully_shard replaces with a subclass of its own.
    return module._reset_parameters if private and private.__module__.startswith("torch.nn.") else None


def _children_first(model: nn.Module, seen: set[int] | None = None) -> Iterable[nn.Module]:
    """Every module once, each after its children, siblings in registration order: the order in which eager
    construction resets them, and so the same random draws."""
    seen = set() if seen is None else seen
    seen.add(id(model))
    for child in model.children():
        if id(child) not in seen:
            yield from _children_first(child, seen)
    yield model
