"""Activation checkpointing, compilation and FSDP2 sharding for any model whose repeated blocks can be named.

Applied in one visible order (as `fsdp_trainer.train.build_model` does for Llama):
    apply_ac -> apply_compile -> apply_fsdp -> init_weights (materialize from meta, then initialize)

AC and compile replace a block's `forward` on the instance instead of wrapping the module, so parameter
names (and therefore checkpoints) are the same whatever the AC mode or compile setting.

A team's own model:

    blocks = (MyBlock,)
    apply_ac(model, blocks, mode="op")
    apply_fsdp(model, mesh, block_types=blocks)
    init_weights(model, device, seed=0)

The blocks must be registered (`model.modules()` order) in the order forward runs them, as in nearly every model:
keep_gathered and prefetch count blocks by it, and it tells which module runs last in forward.
"""

from __future__ import annotations

import contextlib
import functools
import zlib
from typing import Iterable, Sequence, get_args

import torch
from torch import nn
import torch.distributed as dist
# Alpha in torch 2.11, and what FSDP2's own set_symm_mem_for_comm (torch 2.13) uses.
from torch.distributed import _symmetric_memory as symm_mem
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
# The interface FSDPModule.set_custom_reduce_scatter takes; torch.distributed.fsdp does not re-export it.
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fsdp_trainer.config import ACMode, ReshardPolicy, block_ac_modes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def blocks_of(model: nn.Module, block_types: Sequence[type]) -> list[nn.Module]:
    if isinstance(block_types, type) or not all(isinstance(t, type) for t in block_types):
        raise TypeError(f"block_types={block_types!r}: expected a tuple of the classes of the model's repeated "
                        "blocks, e.g. (MyBlock,), not a class alone or a name")
    if not block_types:
        raise ValueError(f"block_types is empty, but {type(model).__name__} is sharded block by block: pass the class "
                         "of its repeated blocks, or, for a model without any, the class of its largest submodules "
                         "(each becomes a unit of its own; not a container without a forward such as nn.ModuleList)")
    blocks = [m for m in model.modules() if isinstance(m, tuple(block_types))]
    if not blocks:
        names = ", ".join(t.__name__ for t in block_types)
        raise ValueError(f"{type(model).__name__} has no submodule of type {names}; pass the class of its "
                         "repeated blocks as block_types")
    return blocks


def _check_choice(name: str, value, choices) -> None:
    """Refuse `value` unless it is one of the Literal type `choices`' values. Misspelt ("Full"), a mode would
    otherwise leave every block without AC, unsaid, and a reshard policy fail later with a bare KeyError."""
    allowed = get_args(choices)
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(map(repr, allowed))}")


def _replace_forward(module: nn.Module, wrap) -> None:
    inner = module.forward
    module.forward = functools.wraps(inner)(functools.partial(wrap, inner))


# Outputs worth keeping under per-op AC: the matmuls and attention are the expensive ops to recompute;
# everything else (norms, activations, RoPE, residual adds) is cheap elementwise work. Linear layers with a bias
# run addmm, batched and hand-written attention bmm/baddbmm.
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


def apply_ac(model: nn.Module, block_types: Sequence[type], mode: ACMode, every: int = 2) -> None:
    """Activation checkpointing per block: full, every `every`-th block (selective), or per-op (op)."""
    _check_choice("mode", mode, ACMode)
    if mode == "selective" and every < 1:
        raise ValueError(f"every={every!r}: selective AC checkpoints every `every`-th block, so it must be 1 or more")
    if mode == "none":
        return
    whole = functools.partial(checkpoint, use_reentrant=False)
    per_op = functools.partial(whole, context_fn=functools.partial(create_selective_checkpoint_contexts, _op_policy))
    blocks = blocks_of(model, block_types)
    for block, how in zip(blocks, block_ac_modes(len(blocks), mode, every)):
        if how != "none":
            _replace_forward(block, whole if how == "checkpointed" else per_op)


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
    all four; `apply_fsdp` refuses the first three, and `allocate` the last, as it happens). `record_stream` would
    be safe everywhere, but it defers each freed block until the GPU has passed the reduce-scatter stream's work,
    and the CPU runs a step ahead: measured on 4 H200s, it reserved no less.

    One instance per fully_shard call: `params` are the parameters whose gradients its reduce-scatter makes."""

    def __init__(self, compute_stream: torch.cuda.Stream, params: Sequence[nn.Parameter]):
        self.compute_stream, self.params = compute_stream, params

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if any(p.grad is not None for p in self.params):
            raise RuntimeError("grads_in_compute_pool: this reduce-scatter would add into gradients that already "
                               "exist (a backward per micro-batch with gradient sync on, or zero_grad(set_to_none="
                               "False)), which is unsafe with the gradients in the compute stream's memory; turn "
                               "gradient sync off for all but the last micro-batch (set_requires_gradient_sync, "
                               "parallel.defer_grad_sync), zero_grad(set_to_none=True), or grads_in_compute_pool "
                               "off")
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


class SymmetricMemoryAllGather(AllGather):
    """FSDP2's all-gather with its output in NCCL symmetric memory, registered with the group's communicator, so
    that NCCL may use its symmetric-memory all-gather: on one host with the zero-CTA policy (NCCL_CTA_POLICY=2), a
    copy-engine transfer that leaves every SM to the compute. The pool hands the same blocks back step after step."""

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
    """NCCL refusing symmetric memory (a container without cuMem, say) is told with the way around it. Running out
    of memory and a peer's failure pass unchanged: the trainer reports those itself (the OOM report, the watchdog)."""
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
               reshard_after_forward: ReshardPolicy = "default", keep_gathered: int = 0, prefetch: int = 1,
               cpu_offload: bool = False, grads_in_compute_pool: bool = False,
               symmetric_memory_all_gather: bool = False) -> None:
    """`fully_shard` each block, then each extra group of modules, then the root.

    `groups` are modules outside the blocks that deserve their own all-gather (for Llama: the embedding;
    the final norm with the output projection). A 1-D mesh shards; a 2-D
    (replicate, shard) mesh gives HSDP. Sharded parameters stay float32 (the optimizer's master weights; a
    model built in 16 bits is refused); `param_dtype` is only the dtype they are gathered in. `keep_gathered`
    blocks, counted back from the last, also stay gathered after forward under the default policy. `prefetch` > 1
    makes each block all-gather that many blocks ahead of itself, in forward and in backward (1 leaves FSDP2's
    schedule of one ahead).
    `grads_in_compute_pool` lets the sharded gradients and the activations share memory (CUDA). It is refused
    where it would be unsafe (`ComputePoolReduceScatter`): here for a 2-D mesh, CPU offload or a reduction that is
    not float32; during backward if a reduce-scatter would add into existing gradients.
    `symmetric_memory_all_gather` all-gathers into NCCL symmetric memory (`SymmetricMemoryAllGather`; CUDA and
    NCCL only)."""
    _check_choice("reshard_after_forward", reshard_after_forward, ReshardPolicy)
    if grads_in_compute_pool and (mesh.ndim != 1 or cpu_offload or reduce_dtype != torch.float32):
        raise ValueError("grads_in_compute_pool needs a 1-D mesh, float32 reduction and no CPU offload: the sharded "
                         "gradients must be the reduce-scatter's output itself")
    blocks, groups = blocks_of(model, block_types), [list(group) for group in groups]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    shard = functools.partial(fully_shard, mesh=mesh, mp_policy=mp, offload_policy=offload)
    # The unit that runs last in forward runs first in backward: freeing its parameters only to all-gather them
    # again at once would cost a collective and save no memory at the peak. By registration order: the last
    # block, or a group with a module registered after it (Llama's final norm and output projection; a tied
    # embedding and head, whose group also runs first).
    position = {id(module): index for index, module in enumerate(model.modules())}
    last = max([[blocks[-1]], *groups], key=lambda unit: max(position[id(module)] for module in unit))[0]

    def reshard(keep: bool) -> bool:
        return {"always": True, "never": False, "default": not keep}[reshard_after_forward]

    for index, block in enumerate(blocks):
        shard(block, reshard_after_forward=reshard(block is last or index >= len(blocks) - keep_gathered))
    for group in groups:
        shard(group if len(group) > 1 else group[0], reshard_after_forward=reshard(group[0] is last))
    shard(model)
    if symmetric_memory_all_gather and mesh.size(-1) > 1:  # with no one to gather from, FSDP2 gathers nothing
        all_gather = SymmetricMemoryAllGather(mesh.get_group(mesh.ndim - 1))
        for module, _ in _units(model).values():
            module.set_custom_all_gather(all_gather)
    if grads_in_compute_pool and mesh.device_type == "cuda":  # one memory pool per device elsewhere
        _pool_gradients(model, torch.cuda.current_stream())
    if prefetch > 1:
        for index, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[index + 1:index + 1 + prefetch])
            block.set_modules_to_backward_prefetch(blocks[max(0, index - prefetch):index][::-1])


def _pool_gradients(model: nn.Module, compute_stream: torch.cuda.Stream) -> None:
    """Install a ComputePoolReduceScatter for each fully_shard call, over all the parameters that call manages.

    The modules sharded in one call (Llama's final norm and output projection; a tied embedding and head) share
    one FSDP state, and so one reduce-scatter, which set_custom_reduce_scatter on any of them replaces: one
    installed per module would leave the last one's, whose guard is blind to the other modules' gradients."""
    for module, params in _units(model).values():
        module.set_custom_reduce_scatter(ComputePoolReduceScatter(compute_stream, params))


def _units(model: nn.Module) -> dict[object, tuple[FSDPModule, list[nn.Parameter]]]:
    """Each fully_shard call's FSDP state (FSDPModule has no public name for the one its modules share) -> one of
    its modules and the parameters it manages."""
    owned: dict[object, tuple[FSDPModule, list[nn.Parameter]]] = {}
    claimed: set[int] = set()
    # Innermost first: model.modules() lists a module before its children, so reversed lists children first.
    for module in reversed(list(model.modules())):
        if isinstance(module, FSDPModule):
            _, params = owned.setdefault(module._get_fsdp_state(), (module, []))
            params += [p for p in module.parameters() if id(p) not in claimed]
            claimed.update(id(p) for p in params)
    return owned


@torch.no_grad()
def init_weights(model: nn.Module, device: torch.device, seed: int = 0, offload: bool = False) -> None:
    """Materialize a model built on the meta device and initialize it, identically for any sharding.

    What the model may define, all optional (ours defines all three):
    - `init_param(name, full_tensor, generator)`: fills each parameter as a full tensor from a generator seeded
      by (seed, name); each rank keeps its shard, so the weights do not depend on the world size or mesh.
      Without it, every submodule's `reset_parameters()` runs (or, for torch.nn's own modules such as
      MultiheadAttention, the `_reset_parameters()` their constructors call), each module's after its children's
      as in eager construction, so that a block's own reset_parameters() has the last word over its submodules'.
      On a CUDA mesh they run on the shards, and DTensor's offset-based RNG draws each shard as its part of one
      full tensor. On any other mesh, whose DTensors draw every shard from the same stream, they run on full
      replicas of the parameters, of which each rank keeps its shard: the weights of eager construction under
      the same seed, for any world size.
    - `init_buffers()`: recomputes the buffers (a RoPE table, say), which materializing leaves unset. Without it,
      each buffer is left to its own module's reset, with or without init_param.
    - `tie_weights()`: ties shared parameters again after materializing.
    With `offload` (FSDP's CPU offload) parameters are materialized in host memory and buffers on `device`."""
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
        if sharded and sharded[0].device_mesh.device_type != "cuda":
            with _full_replicas(model):
                _reset_all(model)
        else:
            _reset_all(model)
        return
    if not hasattr(model, "init_buffers"):
        # init_param fills parameters only: each buffer is its own module's reset to fill (a BatchNorm's running
        # statistics). The parameters these resets fill too are filled again below.
        for module in _children_first(model):
            reset = reset_of(module)
            if reset and next(module.buffers(recurse=False), None) is not None:
                reset()
    for name, param in model.named_parameters():
        full = torch.empty(param.shape, dtype=param.dtype, device=device)
        model.init_param(name, full, param_generator(seed, name, full.device))
        _keep_shard(param, full)


def _keep_shard(param: nn.Parameter, full: torch.Tensor) -> None:
    """Copy this rank's part of `full`, the same full tensor on every rank, into `param`."""
    if isinstance(param, DTensor):
        # Every rank holds the same full tensor, so each can cut its own shard without communication.
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def _reset_all(model: nn.Module) -> None:
    for module in _children_first(model):
        reset = reset_of(module)
        if reset:
            reset()


@contextlib.contextmanager
def _full_replicas(model: nn.Module):
    """Within: each DTensor parameter replaced, in every module that holds it, by one full tensor of its shape (one
    per parameter, so that a tie holds). On leaving, each rank keeps its shard of what the full tensor then holds,
    and the DTensors are put back."""
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
    torch.nn's own modules (MultiheadAttention, Transformer) have instead, which their constructors call."""
    if hasattr(module, "reset_parameters"):
        return module.reset_parameters
    private = getattr(type(module), "_reset_parameters", None)
    # Where the method is defined, not the module's class, which fully_shard replaces with a subclass of its own.
    if private is not None and private.__module__.startswith("torch.nn."):
        return module._reset_parameters
    return None


def _children_first(model: nn.Module) -> list[nn.Module]:
    """Every module once, each after its children, siblings in registration order: the order in which eager
    construction resets them, and so the same random draws."""
    order: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        seen.add(id(module))
        for child in module.children():
            if id(child) not in seen:
                visit(child)
        order.append(module)

    visit(model)
    return order


def param_generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """A generator for one parameter: a pure function of (seed, name), never of rank or world size."""
    return torch.Generator(device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
