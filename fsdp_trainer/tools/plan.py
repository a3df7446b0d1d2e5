"""Memory planner: know before launching whether a run fits on its GPUs, and what to change if it does not.

    # the same flags as training, plus the GPUs to plan for:
    python -m fsdp_trainer.tools.plan --config configs/llama3_8b.toml --gpus 8 --gpu h100-sxm
    python -m fsdp_trainer.tools.plan --config configs/llama3_8b.toml --gpus 8 --gpu a6000 --ac.mode full
    python -m fsdp_trainer.tools.plan --config configs/llama3_8b.toml --gpus 16 --gpu-memory 80GB --json

The verdict is "fits", "marginal" (the headroom is inside the plan's error band, ERROR_BAND: the output lists the
changes that leave it) or "does not fit" (the changes that would). Exit status: 0 fits or marginal, 1 does not fit,
2 bad arguments. Without --gpus, --gpu or --gpu-memory the planner uses this machine's GPUs, or assumes 8 x 80 GiB
(and says so) where it has none. param_dtype 'auto' is resolved as the trainer resolves it on this machine's GPU
(float16 before Ampere); for another card, or no GPU, it is planned as bfloat16, and the plan says so.

From the trainer, before anything is allocated:

    plan = check_fits(cfg, world_size, gpus.this_gpu(device))
    print(plan.summary_line())            # rank 0; if not plan.fits: stop unless cfg.memory.ignore_plan;
                                          # marginal: a warning naming the change that leaves the band
    ...after a few steps: plan.predicted_peak_bytes vs torch.cuda.max_memory_allocated()

The model of memory, per GPU, in the steady state (step 2 on, once AdamW's state exists):
  - Sharded float32 parameters, gradients and AdamW's two float32 moments, each divided by dp_shard (HSDP
    replicates them over dp_replicate). FSDP2 pads each parameter's first dimension to a multiple of dp_shard.
  - Unsharded param_dtype parameters of the FSDP groups in flight (all-gather outputs), their param_dtype
    gradients and the reduce_dtype reduce-scatter input; groups that reshard_after_forward keeps gathered. With
    grad accumulation reduced every micro-batch, the reduce-scatter output beside the gradient it is added to.
  - Activations autograd saves per micro-batch, by AC mode (`block_saved_bytes` lists the tensors), plus the
    logits and the cross-entropy's float32 buffers, which dominate at long sequences and large vocabularies
    (with train.loss_chunk_tokens: one chunk's logits, and the loss's gradients held from forward to backward).
  - The peak is the largest of four moments of a step, each summed from what is alive then (`_moments`):
    loss backward (or the chunked loss), output-projection backward, last block's backward, end of backward.
    The fused AdamW step updates in place and stays below "end of backward".
  - Then what the caching allocator reserves beyond that peak (`_reserved`). It lends a stream's freed memory to
    that stream only, and FSDP2 allocates the all-gather outputs on its all-gather stream. Reserved = the compute
    stream's largest moment plus fragmentation, plus the all-gather stream's buffers (none at dp_shard 1, where
    FSDP2 casts each group on the compute stream when it is used), or, with the all-gathers on the copy engines
    (parallel.copy_engine_all_gather), NCCL's symmetric memory pool, where the groups outside the blocks do not
    share memory. Under CPU offload, the reduce-scatter stream
    keeps the block of the largest group's float32 output, freed there after its copy to the host. Where FSDP2
    also allocates the sharded gradients on its reduce-scatter stream (parallel.grads_in_compute_pool off or not
    applicable), what zero_grad frees stays reserved for the next gradients, out of the activations' reach: the
    compute stream's moments then exclude the gradients, and every sharded gradient is added. Below the reserved
    figure, a capped allocator runs but empties its cache and retries, stalling the GPU, each step. Last, NCCL/cuBLAS
    workspaces and the CUDA context, outside the allocator.
    Every constant below is an assumption, stated where it is defined.
The constants of this model are fixed: its accuracy is measured on runs none of them was fitted to
(benchmarks/plan_accuracy.py --heldout), and the worst error found there is its error band, ERROR_BAND.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from fsdp_trainer.checkpoint import CheckpointError
from fsdp_trainer.config import (Config, ConfigError, grads_in_compute_pool, mesh_shape, parse_args,
                                 resolve_param_dtype, validate)
from fsdp_trainer.distributed import logger
from fsdp_trainer.evaluate import LOSS_CHUNK_TOKENS, evaluates, micro_batch_size
from fsdp_trainer.metrics import GiB
from fsdp_trainer.models.llama import ModelArgs, build, model_args_from_config
from fsdp_trainer.parallelize import block_ac_modes
from fsdp_trainer.tools.gpus import GPU, GPUS, REFERENCE, generic, this_gpu
from fsdp_trainer.tools.weights import model_from_init_from

# -- assumptions ---------------------------------------------------------------------------------------------------
GPUS_PER_NODE = 8
"""GPUs per node, for host RAM under CPU offload and for which collectives cross nodes (fewer if the run has fewer)."""
DEFAULT_GPUS, DEFAULT_GPU_MEMORY = 8, 80 * GiB
"""What to plan for on a machine without GPUs when --gpus / --gpu-memory are not given."""
CUDA_CONTEXT_BYTES = 1 * GiB
"""CUDA context and PyTorch's lazily loaded kernels, outside the allocator: 0.5-1 GiB per process on H100-class GPUs."""
WORKSPACE_BYTES = 3 * GiB // 4
"""NCCL communicator buffers (outside the allocator; they grow with peers) and cuBLAS workspaces."""
FRAGMENTATION = 0.05
"""Fragmentation of the compute stream's memory: reserved beyond what it has allocated at its peak."""
FRAGMENTATION_AMONG_GRADS = 0.085
"""The same where that peak is the end of backward and the sharded gradients share the compute stream's pool: they
are allocated block by block between the activations that backward frees."""

# The throughput model only ranks suggestions by their rough cost; these and the card's profile (tools/gpus.py) set
# the compute/communication balance.
ACHIEVED_MFU = 0.4
"""Share of the card's dense bf16 peak a training step sustains (400 of an H100's 989 TFLOP/s)."""
INTER_NODE_BUS_BW = 40e9
"""Per GPU across nodes: 400 Gb/s InfiniBand per GPU at ~80%."""
HOST_ADAMW_BW = 115e9
"""Bytes/s of host memory that one node's ranks stream together through the fused CPU AdamW under CPU offload, each on
its share of the cores (parallel.offload_threads=0), as measured on an H200 host: memory bandwidth, not cores, is the
limit. --host-bandwidth-gbs gives another host's (benchmarks/host_adamw.py measures it)."""
GATHER_COPY_SECONDS_PER_BYTE = 1.3e-3 / GiB
"""Compute-stream time of FSDP2's copies per all-gathered byte, on gpus.REFERENCE (benchmarks/README.md, keeping
blocks gathered)."""
NCCL_ALL_GATHER_SECONDS_PER_BYTE = 0.62e-3 / GiB
"""Compute time NCCL's all-gather kernels take from the step, per all-gathered byte, where the copy engines do not
run the all-gathers (parallel.copy_engine_all_gather), on gpus.REFERENCE (benchmarks/README.md)."""
OP_AC_RECOMPUTE = {"compiled": 0.01, "eager": 0.028}
"""Per-op AC recomputes only elementwise work (norms, RoPE, SiLU), no matmuls; Inductor fuses it into neighbouring
kernels, eager runs each op on its own. Extra time per token against no AC, for the 8B
(benchmarks/results/2026-11-26-H200x4/llama3_8b*.json)."""
FORWARD_TIME_PER_FLOP = 0.62
"""A block's forward takes this share of the time its FLOPs would take at the step's average rate, as backward's
kernels (attention's above all) run slower per FLOP than forward's: from full AC's cost against no AC, for the 8B
and its 8-block cut (benchmarks/results/2026-11-26-H200x4/llama3_8b.json, */llama3_8b_8layers.json)."""
SAME_SPEED = 0.005
"""Changes in time per token smaller than this read as "~same speed", and are not offered to a run that fits."""
ERROR_BAND = 0.05
"""The plan's error either way, as a share of its total: the worst held-out error, reserved memory's included, rounded
up to half a percent (benchmarks/results/2026-12-07-H100-80GB-HBM3x1/plan_heldout.json; tests/test_plan.py holds it)."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
OPTIMIZER = {"name": "AdamW", "state": "exp_avg + exp_avg_sq", "state_dtype": "float32", "state_bytes_per_param": 8}
"""What optim.build_optimizer runs, as the plan counts it: two moments per parameter in the float32 of the sharded
parameters they update (an 8-bit Adam would hold 2 bytes a parameter, not 8)."""


# -- what the model is made of ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Group:
    """One `fully_shard` unit: parameters all-gathered and reduce-scattered together."""
    name: str
    role: str  # embedding | block | output | root
    shapes: tuple[tuple[int, ...], ...]

    def shard_numel(self, shards: int) -> int:
        """Elements one rank holds: FSDP2 splits each parameter's dim 0 into `shards` padded chunks."""
        return sum(math.ceil(s[0] / shards) * math.prod(s[1:]) for s in self.shapes)

    def gathered_numel(self, shards: int) -> int:
        """Elements of the all-gather output (the padded full group)."""
        return self.shard_numel(shards) * shards


def fsdp_groups(args: ModelArgs) -> tuple[Group, ...]:
    """The FSDP groups `train.build_model` creates, in forward order, read off the model built on the meta device
    (so the shapes come from the model itself): untied, [embedding], each block, [final norm + output];
    tied, the root (the shared embedding, which runs first, and the final norm), then each block."""
    return _groups(dataclasses.astuple(dataclasses.replace(args, rope_scaling=None)))  # a dict; it shapes nothing


@functools.lru_cache(maxsize=16)
def _groups(fields: tuple) -> tuple[Group, ...]:
    model = build(ModelArgs(*fields), device="meta")
    by_group: dict[str, list[tuple[int, ...]]] = {}
    for name, param in model.named_parameters():  # a tied weight is listed once
        parts = name.split(".")
        if parts[0] == "layers":
            key = f"block {parts[1]}"
        elif model.args.tie_embeddings:
            key = "root"
        else:
            key = "embedding" if parts[0] == "tok_embeddings" else "output"
        by_group.setdefault(key, []).append(tuple(param.shape))
    role = {"embedding": "embedding", "output": "output", "root": "root"}
    return tuple(Group(key, role.get(key, "block"), tuple(shapes)) for key, shapes in by_group.items())


def kept_after_forward(groups: Sequence[Group], policy: str, keep_blocks: int = 0) -> list[Group]:
    """Groups whose gathered parameters stay from forward through their backward. Mirrors
    `parallelize.apply_fsdp`: default keeps the non-root group that runs last in forward (its backward comes
    first) and the last `keep_blocks` blocks, never keeps all, always none; FSDP2 itself never reshards the root
    after forward."""
    last = [g for g in groups if g.role != "root"][-1]
    blocks = [g for g in groups if g.role == "block"]
    kept_blocks = blocks[len(blocks) - keep_blocks:] if keep_blocks else []
    return [g for g in groups if g.role == "root" or policy == "never"
            or (policy == "default" and (g is last or g in kept_blocks))]


# -- activations -----------------------------------------------------------------------------------------------------
def rms_norm_saved_bytes(tokens: int, dim: int, pbytes: int) -> int:
    """What one RMSNorm saves for backward, its output excluded (the matmul that reads it saves that): as the fused
    kernel CUDA runs (`_fused_rms_norm`), the input in param_dtype and the float32 1/rms per token."""
    return pbytes * tokens * dim + 4 * tokens


def block_saved_bytes(args: ModelArgs, tokens: int, pbytes: int) -> dict[str, int]:
    """Tensors one TransformerBlock saves for backward without AC, for `tokens` = micro_batch x seq_len.

    Not saved: RoPE's float32 intermediates (its products save only the cos/sin tables, slices of a buffer that
    needs no gradient; the rotated q and k are cast back to param_dtype and saved by SDPA), residual sums' operands
    (add saves nothing), and views (q/k/v reshapes, the attention output's transpose: flash and cuDNN attention
    write it in [batch, seq, heads, head_dim] order, so the wo input is the same storage). SDPA is assumed to be a
    flash-style kernel with native GQA (k and v stay n_kv_heads wide; cuDNN on H200s with torch 2.11); the math
    fallback would also save the seq x seq scores."""
    d, h, kv = args.dim, args.ffn_hidden_dim, args.n_kv_heads * args.head_dim
    norm = rms_norm_saved_bytes(tokens, d, pbytes)
    return {
        "attention_norm: input, 1/rms": norm,
        "wq/wk/wv input (attention_norm output)": pbytes * tokens * d,
        "q, k after RoPE (SDPA inputs)": pbytes * tokens * (d + kv),
        "v (SDPA input, the wv output)": pbytes * tokens * kv,
        "attention output (also the wo input)": pbytes * tokens * d,
        "attention logsumexp, float32": 4 * tokens * args.n_heads,
        "ffn_norm: input, 1/rms": norm,
        "w1/w3 input (ffn_norm output)": pbytes * tokens * d,
        "w1 output (SiLU input)": pbytes * tokens * h,
        "w3 output": pbytes * tokens * h,
        "SiLU output": pbytes * tokens * h,
        "SiLU x w3 (w2 input)": pbytes * tokens * h,
    }


def op_ac_saved_bytes(args: ModelArgs, tokens: int, pbytes: int) -> dict[str, int]:
    """Per-op AC (`parallelize._op_policy`): the block's input (the checkpoint's argument) and the output of every
    matmul and of SDPA are kept, whether or not backward reads them; norms, RoPE and SiLU are recomputed."""
    d, h, kv = args.dim, args.ffn_hidden_dim, args.n_kv_heads * args.head_dim
    return {
        "block input": pbytes * tokens * d,
        "wq, wk, wv outputs": pbytes * tokens * (d + 2 * kv),
        "SDPA output, logsumexp (float32)": pbytes * tokens * d + 4 * tokens * args.n_heads,
        "wo output": pbytes * tokens * d,
        "w1, w3 outputs": 2 * pbytes * tokens * h,
        "w2 output": pbytes * tokens * d,
    }


def block_bytes_by_mode(args: ModelArgs, tokens: int, pbytes: int, compiled: bool = False) -> dict[str, int]:
    """Bytes one block keeps from its forward to its backward, for each way it can be run. Compiled, Inductor's
    partitioner keeps only what the backward reads. A block without AC then keeps no SiLU output: SiLU is fused
    into its product and recomputed in backward. A per-op AC block keeps no w2 output, which eager SAC saves only
    because it is a matmul's."""
    none = sum(block_saved_bytes(args, tokens, pbytes).values())
    op = op_ac_saved_bytes(args, tokens, pbytes)
    return {"none": none - (pbytes * tokens * args.ffn_hidden_dim if compiled else 0),
            "op": sum(op.values()) - (op["w2 output"] if compiled else 0),
            # a checkpointed block keeps only its input and recomputes everything in its backward
            "checkpointed": pbytes * tokens * args.dim}


def ids_labels_bytes(tokens: int) -> int:
    """The token ids (saved by the embedding's backward) and the labels (by nll_loss's), int64 each."""
    return 2 * 8 * tokens


def head_saved_bytes(args: ModelArgs, tokens: int, pbytes: int) -> int:
    """Saved outside the blocks, logits excluded: token ids, labels, the final norm and its output (the output
    projection's input)."""
    return ids_labels_bytes(tokens) + rms_norm_saved_bytes(tokens, args.dim, pbytes) \
        + pbytes * tokens * args.dim


# -- one configuration on one GPU ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Setup:
    """The facts of a run the arithmetic needs, resolved from Config and the GPU count."""
    args: ModelArgs
    groups: tuple[Group, ...]
    gpus: int
    gpus_per_node: int
    gpu: GPU
    host_bw: float  # bytes/s of host memory one node's ranks stream through host AdamW under CPU offload
    replicate: int
    shard: int
    param_dtype: str
    rbytes: int
    seq: int
    micro_batch: int
    accum: int
    ac_mode: str
    ac_every: int
    reshard: str
    keep_gathered: int
    offload: bool
    defer: bool
    loss_chunk: int
    prefetch: int
    compiled: bool
    pooled_grads: bool  # parallel.grads_in_compute_pool applies: gradients share the compute stream's memory
    symmetric_all_gather: bool  # parallel.copy_engine_all_gather applies: all-gather outputs in NCCL's own pool
    eval_tokens: int  # per forward pass of an evaluation (0: the run never evaluates)

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq

    @property
    def pbytes(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def ranks_per_node(self) -> int:
        return min(self.gpus_per_node, self.gpus)

    def shard_numel(self, groups: Sequence[Group] | None = None) -> int:
        return sum(g.shard_numel(self.shard) for g in (self.groups if groups is None else groups))

    def gathered_numel(self, groups: Sequence[Group] | None = None) -> int:
        return sum(g.gathered_numel(self.shard) for g in (self.groups if groups is None else groups))

    def gathered_bytes(self, group: Group) -> int:
        """One group's all-gathered parameters, in param_dtype."""
        return self.pbytes * group.gathered_numel(self.shard)


def _setup(cfg: Config, gpus: int, gpus_per_node: int, gpu: GPU = REFERENCE,
           host_bw: float = HOST_ADAMW_BW) -> _Setup:
    args = model_args_from_config(cfg.model)
    replicate, shard = mesh_shape(cfg.parallel, gpus)
    p = cfg.parallel
    # 'auto' left unresolved is planned as Ampere and newer GPUs run it; the plan notes it (`_estimate`).
    param_dtype = "bfloat16" if p.param_dtype == "auto" else p.param_dtype
    return _Setup(args, fsdp_groups(args), gpus, gpus_per_node, gpu, host_bw, replicate, shard, param_dtype,
                  DTYPE_BYTES[p.reduce_dtype], cfg.train.seq_len, cfg.train.micro_batch_size,
                  cfg.train.grad_accum_steps, cfg.ac.mode, cfg.ac.every, p.reshard_after_forward, p.keep_gathered,
                  p.cpu_offload, p.defer_grad_sync and cfg.train.grad_accum_steps > 1, cfg.train.loss_chunk_tokens,
                  p.prefetch, p.compile, grads_in_compute_pool(p, cfg.train.grad_accum_steps),
                  p.copy_engine_all_gather and shard > 1 and gpus <= gpus_per_node,
                  micro_batch_size(cfg) * cfg.train.seq_len if evaluates(cfg) else 0)


def _moments(s: _Setup) -> dict[str, dict[str, int]]:
    """Allocator bytes alive at the four moments a step can peak at, by row (keys of ROW_LABELS)."""
    blocks = [g for g in s.groups if g.role == "block"]
    kept = kept_after_forward(s.groups, s.reshard, s.keep_gathered)
    first_back = next(g for g in reversed(s.groups) if g.role in ("output", "root"))  # holds the output projection
    last_back = s.groups[0]  # holds the embedding: untied its own group, tied the root
    tokens, vocab = s.tokens, s.args.vocab_size
    on_gpu = 0 if s.offload else 1  # CPU offload moves the float32 shards and AdamW's state to host memory
    shards = 4 * s.shard_numel() * on_gpu
    gathered = s.gathered_bytes

    def gathered_unless_kept(group: Group) -> int:
        return 0 if group in kept else gathered(group)

    def last_group_backward(group: Group) -> int:
        """The embedding's group, last in backward, at the largest of its three steps: its backward (gathered
        parameters, param_dtype gradients); its post-backward copy-in (parameters resharded first, gradients copied
        into the reduce_dtype reduce-scatter input); the reduce-scatter (the input, and the output that becomes the
        group's sharded gradient, or is added to the one accumulated from earlier micro-batches, counted here rather
        than in the gradients row). With one rank FSDP2 has freed the param_dtype gradients by then; with more, the
        allocator keeps them until the reduce-scatter stream has read them (both seen in allocator traces on
        H200s)."""
        numel = group.gathered_numel(s.shard)
        grads_in_reduce = s.pbytes * numel if s.shard > 1 else 0
        return max(gathered(group) + s.pbytes * numel, (s.pbytes + s.rbytes) * numel,
                   grads_in_reduce + s.rbytes * numel + 4 * group.shard_numel(s.shard))

    modes = block_ac_modes(s.args.n_layers, s.ac_mode, s.ac_every)
    per_block = block_bytes_by_mode(s.args, tokens, s.pbytes, compiled=s.compiled)
    block_acts = sum(per_block[m] for m in modes)
    chunk = min(s.loss_chunk, tokens)
    if chunk:
        # The chunked loss saves neither the output projection's input nor the logits; it holds the gradients of
        # the hidden states and of the weight from its forward to its backward.
        head = ids_labels_bytes(tokens) + rms_norm_saved_bytes(tokens, s.args.dim, s.pbytes)
        held_logits, hidden_grads = 0, s.pbytes * tokens * s.args.dim
    else:
        head = head_saved_bytes(s.args, tokens, s.pbytes)
        # train_step's `logits` variable (param_dtype) lives until the next micro-batch replaces it.
        held_logits, hidden_grads = s.pbytes * tokens * vocab, 0
    # Sharded gradients of earlier micro-batches stay through later ones. With one micro-batch, zero_grad
    # (set_to_none) has freed them, and backward allocates them group by group as activations are freed.
    held_grads = shards if s.accum > 1 and not s.defer else 0
    # With no_sync, FSDP2 accumulates every unsharded gradient in reduce_dtype until the last micro-batch.
    deferred = s.rbytes * s.gathered_numel() if s.defer else 0
    base = {"params": shards, "optimizer": 2 * shards, "kept": s.pbytes * s.gathered_numel(kept),
            "deferred": deferred, "grads": held_grads}
    tied = first_back.role == "root"
    root_or_output_grads = s.pbytes * first_back.gathered_numel(s.shard)
    # Tied: the root's param_dtype gradient (embedding + output projection) accumulates until backward ends.
    root_grads = root_or_output_grads if tied else 0
    # FSDP2 keeps one reduce-scatter input in flight: the output group's while the last block runs backward.
    retained_reduce = root_grads or s.rbytes * first_back.gathered_numel(s.shard)
    # FSDP2 reshards every group after its backward, so the kept output group is gone once the blocks' start.
    resharded_output = 0 if tied or first_back not in kept else gathered(first_back)
    # FSDP2 gathers one group ahead (parallel.prefetch: that many blocks ahead).
    prefetched = sum(gathered_unless_kept(g) for g in blocks[max(0, len(blocks) - 1 - s.prefetch):-1])
    recompute = per_block["none"] - per_block[modes[-1]]  # a checkpointed block's forward runs again in backward
    # Activation gradients in flight in a block's backward: SwiGLU's three [tokens, hidden] gradients at its
    # product's backward, plus the residual stream's gradient and its update, [tokens, dim] each.
    work = s.pbytes * tokens * (3 * s.args.ffn_hidden_dim + 2 * s.args.dim)
    if chunk:
        # Inside the loss's forward: its input (the final norm's output), the gradients it is filling (the hidden
        # states', and the weight's summed in float32), and either one chunk's float32 logits beside their
        # param_dtype copy, or that copy (the chunk's logit gradient) beside its product with the chunk's hidden
        # states, a weight-sized param_dtype tensor. The output projection is gathered, kept after forward or not.
        weight_grad_sum = 4 * root_or_output_grads // s.pbytes
        if s.param_dtype == "float16":
            # float16 keeps that sum in float32 until backward has scaled it, then casts it: both at once there.
            # Each chunk's product is float32 too, of float32 copies of its logit gradient and hidden states, since
            # in float16 it could overflow (`linear_cross_entropy`).
            weight_grad_float32 = weight_grad_sum
            chunk_product = 4 * chunk * (vocab + s.args.dim) + weight_grad_sum
        else:
            weight_grad_float32, chunk_product = 0, root_or_output_grads
        chunk_buffers = max((4 + s.pbytes) * chunk * vocab, s.pbytes * chunk * vocab + chunk_product)
        loss_moment = {"chunked loss": {**base, "blocks": block_acts, "head": head + s.pbytes * tokens * s.args.dim,
                                        "logits": hidden_grads + weight_grad_sum + chunk_buffers,
                                        "comm": gathered_unless_kept(first_back)}}
    else:
        # cross_entropy's backward, next to the param_dtype logits. Eager: log_softmax's float32 output, nll_loss's
        # float32 gradient and log_softmax's float32 input gradient at once. Compiled: the logits' param_dtype
        # gradient, written in one pass (`fsdp_trainer.loss`).
        loss_buffers = s.pbytes * tokens * vocab if s.compiled else 3 * 4 * tokens * vocab
        weight_grad_float32 = 0
        loss_moment = {"loss backward": {**base, "blocks": block_acts, "head": head,
                                         "logits": held_logits + loss_buffers}}
    if s.eval_tokens:
        # An evaluation's forward, after zero_grad freed the gradients, saving nothing: the residual stream and one
        # block's tensors (at most what it saves for backward), or the logits and one float32 chunk of them.
        t, eval_chunk = s.eval_tokens, min(LOSS_CHUNK_TOKENS, s.eval_tokens)
        in_block = {"comm": gathered_unless_kept(blocks[-1]) + prefetched, "head": s.pbytes * t * s.args.dim,
                    "work": block_bytes_by_mode(s.args, t, s.pbytes)["none"]}
        at_loss = {"comm": gathered_unless_kept(first_back), "head": s.pbytes * t * s.args.dim,
                   "logits": s.pbytes * t * vocab + 8 * eval_chunk * vocab}
        loss_moment["eval forward"] = {**base, "grads": 0, "deferred": 0,
                                       **max(in_block, at_loss, key=lambda rows: sum(rows.values()))}
    return {
        **loss_moment,
        # output projection's backward: logits and their param_dtype gradient (chunked: the hidden states'
        # gradient, and float16's float32 weight gradient), the output group's weights and param_dtype gradients,
        # the last block gathered ahead.
        "output backward": {**base, "blocks": block_acts, "head": head,
                            "logits": 2 * held_logits + hidden_grads + weight_grad_float32,
                            "comm": (root_grads if tied else gathered_unless_kept(first_back) + root_or_output_grads)
                            + gathered_unless_kept(blocks[-1])},
        # last block's backward (every block's activations still held): its weights and gradients, the next block
        # gathered ahead, the retained reduce-scatter input, the block's recomputed forward and gradients in flight.
        "last block backward": {**base, "blocks": block_acts, "head": ids_labels_bytes(tokens),
                                "logits": held_logits, "kept": base["kept"] - resharded_output,
                                "grads": held_grads or (0 if tied else 4 * first_back.shard_numel(s.shard) * on_gpu),
                                "comm": gathered_unless_kept(blocks[-1]) + s.pbytes * blocks[-1].gathered_numel(s.shard)
                                + prefetched + retained_reduce,
                                "work": recompute + work},
        # end of backward: every other group's sharded gradient (none when deferred; accumulating, every group's,
        # as FSDP2 adds the embedding group's reduce-scatter output to its gradient, not in its place), the
        # embedding's group reduced; activations are gone and every other group is resharded.
        "end of backward": {**base, "kept": 0, "logits": held_logits,
                            "grads": held_grads or (0 if s.defer
                                                    else shards - 4 * last_back.shard_numel(s.shard) * on_gpu),
                            "comm": last_group_backward(last_back)},
    }


ROW_LABELS = {
    "params": "parameters, float32 shards",
    "grads": "gradients, float32 shards",
    "optimizer": f"{OPTIMIZER['name']} {OPTIMIZER['state']}, {OPTIMIZER['state_dtype']} shards",
    "kept": "gathered params kept after forward",
    "comm": "all-gather / reduce-scatter buffers in flight",
    "deferred": "unsharded grads held for deferred sync",
    "blocks": "activations saved by the blocks",
    "head": "token ids, labels, final norm",
    "logits": "logits + cross-entropy buffers",
    "work": "backward working set (recompute, grads)",
}


def _recompute_fraction(s: _Setup) -> float:
    """Extra compute of activation checkpointing, as a fraction of a step without it."""
    if s.ac_mode == "op":
        return OP_AC_RECOMPUTE["compiled" if s.compiled else "eager"]
    checkpointed = block_ac_modes(s.args.n_layers, s.ac_mode, s.ac_every).count("checkpointed")
    # A checkpointed block runs its forward twice; forward is a third of the block's training FLOPs.
    block_matmul_params = s.args.num_matmul_params() - s.args.vocab_size * s.args.dim
    block_forward = 2 * block_matmul_params + 4 * s.args.n_layers * s.args.dim * s.seq
    flops_share = block_forward * checkpointed / s.args.n_layers / s.args.flops_per_token(s.seq)
    return FORWARD_TIME_PER_FLOP * flops_share


def step_parts(s: _Setup) -> dict[str, float]:
    """Seconds of one optimizer step on s.gpu, by part, from a rough model. FSDP overlaps collectives with compute,
    so the slower of the two sets the pace (`_step_seconds`); FSDP2 copies every gathered group out on the compute
    stream, and CPU offload's copies and host AdamW come on top."""
    flops = s.accum * s.tokens * s.args.flops_per_token(s.seq) * (1 + _recompute_fraction(s))
    compute = flops / (ACHIEVED_MFU * s.gpu.bf16_flops)
    numel = s.gathered_numel()
    resharded = numel - s.gathered_numel(kept_after_forward(s.groups, s.reshard, s.keep_gathered))
    reduces = 1 if s.defer else s.accum
    # Each micro-batch gathers every group for forward and the resharded ones again for backward.
    gathered = s.accum * s.pbytes * (numel + resharded)
    shard_bytes = gathered + reduces * s.rbytes * numel
    across_nodes = min(s.gpu.bus_bw, INTER_NODE_BUS_BW)  # a ring through both links runs at the slower
    shard_bw = s.gpu.bus_bw if s.shard <= s.gpus_per_node else across_nodes
    comm = shard_bytes * (s.shard - 1) / s.shard / shard_bw
    if s.replicate > 1:  # HSDP all-reduces the sharded gradients across replicas
        replica_bw = across_nodes if s.gpus > s.gpus_per_node else s.gpu.bus_bw
        comm += reduces * 2 * s.rbytes * numel / s.shard * (s.replicate - 1) / s.replicate / replica_bw
    # The copies and NCCL's kernels are memory-bound work on the GPU, measured on the reference card.
    per_byte = GATHER_COPY_SECONDS_PER_BYTE + (
        0.0 if s.symmetric_all_gather or s.shard == 1 else NCCL_ALL_GATHER_SECONDS_PER_BYTE)
    parts = {"compute": compute, "communication": comm,
             "gather copies": gathered * per_byte * REFERENCE.memory_bw / s.gpu.memory_bw}
    if s.offload:
        shard = s.shard_numel()
        copies = 4 * shard * (s.accum * (numel + resharded) / numel + reduces)  # float32 shards in, gradients out
        parts["host copies"] = copies / s.gpu.host_bw
        # AdamW reads parameter, gradient and both moments and writes back three of them: 28 bytes per element, for
        # every rank of the node at once.
        parts["host AdamW"] = 28 * shard * s.ranks_per_node / s.host_bw
    return parts


def _step_seconds(parts: dict[str, float]) -> float:
    return max(parts["compute"], parts["communication"]) + sum(
        t for name, t in parts.items() if name not in ("compute", "communication"))


def _host_bytes_per_node(s: _Setup) -> int:
    """Host RAM CPU offload needs per node: per GPU the float32 parameter and gradient shards and AdamW's two
    moments (the fused CPU step allocates no temporaries)."""
    if not s.offload:
        return 0
    return 16 * s.shard_numel() * s.ranks_per_node


def _staging_bytes_per_node(cfg: Config, s: _Setup) -> int:
    """Host RAM async checkpoints stage into per node: per GPU the float32 parameter shards and AdamW's two
    moments (async_pinned keeps it pinned for the whole run, async during each save)."""
    if cfg.checkpoint.async_mode == "none":
        return 0
    return 12 * s.shard_numel() * s.ranks_per_node


# -- the plan --------------------------------------------------------------------------------------------------------
@dataclass
class Row:
    name: str
    bytes: int
    note: str = ""


def _flag(path: str, value: Any) -> str:
    """One command-line flag; booleans are tyro's --section.name / --section.no_name."""
    if isinstance(value, bool):
        section, name = path.split(".")
        return f"--{section}.{'' if value else 'no_'}{name}"
    return f"--{path} {value}"


@dataclass
class Suggestion:
    change: dict[str, Any]
    """Config fields to set (section.name -> value), as the flags `flags()` prints."""
    gpus: int
    """GPUs the change runs on (more than planned for: a hardware change)."""
    total_bytes: int
    """Predicted per-GPU total with the change, margins included."""
    cost: float
    """Rough change in time per token per GPU: 0.33 is a third slower."""
    note: str = ""

    def flags(self) -> str:
        return " ".join(_flag(path, value) for path, value in self.change.items() if path != "gpus")

    def describe(self) -> str:
        where = f"on {self.gpus} GPUs " if self.change.get("gpus") else ""
        cost = f"~{self.cost:+.0%} time per token" if abs(self.cost) >= SAME_SPEED else "~same speed"
        return (f"{where}{self.flags()}".strip() + f"  ->  {self.total_bytes / GiB:.1f} GiB, {cost}"
                + (f"; {self.note}" if self.note else ""))


@dataclass
class Plan:
    setup: str
    """The run planned, in words."""
    num_params: int
    gpus: int
    gpus_per_node: int
    """The node size, which a run on fewer GPUs does not fill."""
    dp_replicate: int
    dp_shard: int
    capacity_bytes: int
    capacity_source: str
    gpu: GPU
    """The card planned for: its memory, compute and links, which the time model reads."""
    host_bandwidth: float
    """Bytes/s of host memory one node's ranks stream through host AdamW under CPU offload."""
    rows: list[Row]
    """Per-GPU bytes at the peak moment, margins last."""
    peak_moment: str
    moments: dict[str, int]
    """Allocator bytes at each modeled moment."""
    predicted_peak_bytes: int
    """What torch.cuda.max_memory_allocated() should read after the first steps (no margins)."""
    predicted_reserved_bytes: int
    """What torch.cuda.max_memory_reserved() should read when nothing caps the allocator (`_reserved`)."""
    total_bytes: int
    """predicted_reserved_bytes plus workspaces and CUDA context: compared with capacity_bytes."""
    host_bytes_per_node: int
    """Host RAM per node for CPU offload."""
    staging_bytes_per_node: int
    """Host RAM per node for async checkpoint staging."""
    step_seconds: float
    """Rough model of one optimizer step, for comparing suggestions; not a benchmark."""
    step_parts: dict[str, float]
    """step_seconds by part (`step_parts`): compute and communication overlap, the others add."""
    suggestions: list[Suggestion] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    assumed: str = ""
    """The GPU count or memory planned for where neither given nor found, in words, with the flags that set them."""

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.capacity_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.total_bytes

    @property
    def band_bytes(self) -> int:
        """The plan's error band, ERROR_BAND of its total."""
        return int(ERROR_BAND * self.total_bytes)

    @property
    def verdict(self) -> str:
        """'fits', 'marginal' (fits, but with less headroom than the error band) or 'does not fit'."""
        return "does not fit" if not self.fits else "marginal" if self.headroom_bytes < self.band_bytes else "fits"

    def remedy(self) -> Optional[Suggestion]:
        """The cheapest listed change that uses less memory than this plan (options for a run that fits use more)."""
        return next((s for s in self.suggestions if s.total_bytes < self.total_bytes), None)

    def _headroom(self) -> str:
        return (f"{self.headroom_bytes / GiB:.2f} GiB headroom ({self.headroom_bytes / self.capacity_bytes:.0%}), "
                f"{'inside' if self.verdict == 'marginal' else 'outside'} the plan's error band of "
                f"±{ERROR_BAND:.1%} ({self.band_bytes / GiB:.2f} GiB)")

    def summary_line(self) -> str:
        verdict = {"fits": f"fits, {self.headroom_bytes / GiB:.1f} GiB headroom",
                   "marginal": f"MARGINAL: {self._headroom()}: it may not fit",
                   "does not fit": f"DOES NOT FIT by {-self.headroom_bytes / GiB:.1f} GiB"}[self.verdict]
        line = (f"memory plan: {self.num_params / 1e9:.2f}B params on {self.gpus} GPUs: predicted "
                f"{self.total_bytes / GiB:.1f} GiB per GPU (peak at {self.peak_moment}) of "
                f"{self.capacity_bytes / GiB:.1f} GiB: {verdict}")
        if self.verdict != "fits" and self.suggestions:
            line += f"; {'to leave the band' if self.fits else 'try'} {self.suggestions[0].describe()}"
        return line

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "optimizer": OPTIMIZER, "fits": self.fits, "verdict": self.verdict,
                "error_band": ERROR_BAND, "band_bytes": self.band_bytes, "headroom_bytes": self.headroom_bytes}

    def render(self) -> str:
        lines = [self.setup, f"GPU {self.gpu.describe()}", *([self.assumed] if self.assumed else []),
                 f"per GPU, at the peak ({self.peak_moment}):"]
        lines += [f"  {row.name:<46}{row.bytes / GiB:>8.2f} GiB  {row.note}".rstrip() for row in self.rows]
        lines.append(f"  {'total':<46}{self.total_bytes / GiB:>8.2f} GiB  of {self.capacity_bytes / GiB:.2f} GiB "
                     f"({self.capacity_source})")
        others = ", ".join(f"{name} {size / GiB:.1f}" for name, size in self.moments.items()
                           if name != self.peak_moment)
        lines.append(f"  allocator peak {self.predicted_peak_bytes / GiB:.2f} GiB, reserved "
                     f"{self.predicted_reserved_bytes / GiB:.2f} GiB; other moments: {others} GiB")
        host = [f"CPU offload {self.host_bytes_per_node / GiB:.1f} GiB"] if self.host_bytes_per_node else []
        if self.staging_bytes_per_node:
            host.append(f"async checkpoint staging {self.staging_bytes_per_node / GiB:.1f} GiB")
        if host:
            lines.append(f"  host RAM per node ({min(self.gpus, self.gpus_per_node)} GPUs): {', '.join(host)}")
        lines.append({"fits": f"verdict: fits, {self._headroom()}",
                      "marginal": f"verdict: MARGINAL: {self._headroom()}: it may not fit",
                      "does not fit": f"verdict: DOES NOT FIT: {-self.headroom_bytes / GiB:.2f} GiB over"}[
                         self.verdict])
        offload = self.host_bytes_per_node or any(s.change.get("parallel.cpu_offload") for s in self.suggestions)
        parts = ", ".join(f"{name} {t:.2f}" for name, t in self.step_parts.items() if t)
        lines.append(f"time, from a rough model on {self.gpu.name}: ~{self.step_seconds:.2f} s a step ({parts}; "
                     "compute and communication overlap)"
                     + (f"; host AdamW at {self.host_bandwidth / 1e9:.0f} GB/s per node (--host-bandwidth-gbs)"
                        if offload else ""))
        if self.suggestions:
            lines.append(("faster settings that fit outside the error band, fastest first" if self.verdict == "fits"
                          else "changes that fit outside the error band, cheapest first")
                         + " (time per token per GPU from a rough model):")
            lines += [f"  {i}. {s.describe()}" for i, s in enumerate(self.suggestions, 1)]
        elif not self.fits:
            lines.append("no change the planner tries fits: use more GPUs or a smaller model or sequence")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _estimate(cfg: Config, gpus: int, capacity: int, capacity_source: str, gpus_per_node: int, gpu: GPU,
              host_bandwidth: float) -> Plan:
    s = _setup(cfg, gpus, gpus_per_node, gpu, host_bandwidth)
    by_moment = _moments(s)
    moments = {name: sum(parts.values()) for name, parts in by_moment.items()}
    peak_moment = max(moments, key=moments.get)
    parts = by_moment[peak_moment]
    # Rows that are empty at the peak and say nothing about this run are left out.
    rows = [Row(ROW_LABELS[key], parts.get(key, 0), note) for key, note in _row_notes(s, cfg).items()
            if parts.get(key, 0) or note]
    allocated = moments[peak_moment]
    cached = _reserved(s, by_moment, moments, peak_moment)
    reserved = allocated + sum(r.bytes for r in cached)
    times = step_parts(s)
    outside = [Row("NCCL + cuBLAS workspaces", WORKSPACE_BYTES, "estimate"),
               Row("CUDA context", CUDA_CONTEXT_BYTES, "estimate, outside PyTorch's allocator")]
    mesh = f"FSDP over {s.shard}" if s.replicate == 1 else f"HSDP {s.replicate} x {s.shard}"
    setup = (f"model {cfg.model.name}: {s.args.num_params() / 1e9:.2f}B params ({s.args.num_params():,}) | "
             f"{gpus} GPUs, {mesh} | seq {s.seq} x micro-batch {s.micro_batch}, grad accum {s.accum} | "
             f"ac {s.ac_mode}{f' every {s.ac_every}' if s.ac_mode == 'selective' else ''} | "
             f"{s.param_dtype} params, {cfg.parallel.reduce_dtype} reduce | "
             f"optimizer {OPTIMIZER['name']}, {OPTIMIZER['state_dtype']} state | "
             f"reshard {s.reshard}{f' + last {s.keep_gathered} blocks kept' if s.keep_gathered else ''}"
             f"{' | cpu offload' if s.offload else ''}"
             f"{' | deferred grad sync' if s.defer else ''}")
    notes = (["torch.compile: blocks keep only what their backward reads (no SiLU output without AC, no w2 "
              "output with per-op AC); the compiled loss makes no float32 copy of the logits"]
             if cfg.parallel.compile else [])
    if cfg.parallel.param_dtype == "auto":
        notes.append("param_dtype 'auto' planned as bfloat16, as Ampere and newer GPUs run it; older ones run float16 "
                     "with loss scaling: plan that with --parallel.param_dtype float16")
    return Plan(setup, s.args.num_params(), gpus, gpus_per_node, s.replicate, s.shard, capacity, capacity_source,
                gpu, host_bandwidth, rows + cached + outside, peak_moment, moments, allocated, reserved,
                reserved + sum(r.bytes for r in outside),
                _host_bytes_per_node(s), _staging_bytes_per_node(cfg, s), _step_seconds(times), times, notes=notes)


def _reserved(s: _Setup, by_moment: dict[str, dict[str, int]], moments: dict[str, int], peak_moment: str) -> list[Row]:
    """What the caching allocator reserves beyond the allocated peak, by cause (see the module docstring)."""
    on_side_stream = not (s.offload or s.pooled_grads)  # the gradients' memory, out of the activations' reach
    compute = {name: moments[name] - (parts.get("grads", 0) if on_side_stream else 0)
               for name, parts in by_moment.items()}
    compute_moment = max(compute, key=compute.get)
    rows = []
    if on_side_stream:
        rows.append(Row("grad memory kept by the reduce-scatter stream",
                        4 * s.shard_numel() - by_moment[peak_moment].get("grads", 0)
                        + _reduce_output_kept(s, peak_moment),
                        "FSDP2 allocates gradients and reduce-scatter outputs on that stream; what zero_grad frees "
                        "stays there"))
    elif s.offload:
        rows.append(Row("reduce-scatter stream's output block", 4 * max(g.shard_numel(s.shard) for g in s.groups),
                        "each group's output is copied to the host and freed there: the largest group's stays"))
    if s.shard > 1:  # with no one to gather from, FSDP2 casts each group on the compute stream when it is used
        # Groups outside the blocks (Llama: embedding, output projection) and the blocks gathered ahead.
        others = [s.gathered_bytes(g) for g in s.groups if g.role != "block"]
        block = max(s.gathered_bytes(g) for g in s.groups if g.role == "block")
        # In NCCL's symmetric memory pool the groups outside the blocks share no memory (benchmarks/README.md).
        if s.symmetric_all_gather:
            rows.append(Row("all-gather symmetric memory pool", sum(others) + s.prefetch * block,
                            "every gathered group outside the blocks + the blocks gathered ahead"))
        else:
            rows.append(Row("all-gather stream's buffers", max(others, default=0) + s.prefetch * block,
                            "the largest gathered group + the blocks gathered ahead"))
    if compute_moment != peak_moment and compute[compute_moment] > compute[peak_moment]:
        rows.append(Row(f"compute stream's peak at {compute_moment}", compute[compute_moment] - compute[peak_moment],
                        "beyond its use at this moment"))
    fraction = (FRAGMENTATION_AMONG_GRADS if s.pooled_grads and compute_moment == "end of backward"
                else FRAGMENTATION)
    rows.append(Row(f"allocator fragmentation ({fraction:.1%})", int(fraction * compute[compute_moment]),
                    "of the compute stream's peak"))
    return rows


def _reduce_output_kept(s: _Setup, peak_moment: str) -> int:
    """Accumulating without deferred sync, each group's reduce-scatter output is added to its gradient and freed,
    on the reduce-scatter stream, which keeps the block for the next one: the largest group's, beyond every peak but
    the end of backward, where the embedding group's is allocated."""
    if s.accum == 1 or s.defer:
        return 0
    largest = 4 * max(g.shard_numel(s.shard) for g in s.groups)
    return largest - (4 * s.groups[0].shard_numel(s.shard) if peak_moment == "end of backward" else 0)


def _row_notes(s: _Setup, cfg: Config) -> dict[str, str]:
    """Each row's note: its full size where that differs from the peak, and what it is made of."""
    shards = 4 * s.shard_numel()
    where = "in host memory (cpu offload)" if s.offload else ""
    kept = kept_after_forward(s.groups, s.reshard, s.keep_gathered)
    modes = block_ac_modes(s.args.n_layers, s.ac_mode, s.ac_every)
    per_block = block_bytes_by_mode(s.args, s.tokens, s.pbytes, compiled=s.compiled)
    block_note = ", ".join(f"{modes.count(m)} x {per_block[m] / GiB:.3f} GiB ({m})"
                           for m in ("none", "op", "checkpointed") if m in modes)
    return {
        "params": where or f"{s.args.num_params() / 1e9:.2f}B / dp_shard {s.shard}",
        "grads": where or (f"{shards / GiB:.2f} GiB once backward ends; zero_grad frees them each step"
                           if s.accum == 1 else "reduced once, after the last micro-batch" if s.defer
                           else "kept across micro-batches"),
        "optimizer": where or f"{OPTIMIZER['state_bytes_per_param']} bytes a parameter / dp_shard {s.shard}",
        "kept": f"reshard_after_forward={s.reshard}: " + (", ".join(g.name for g in kept[:3]) or "none")
        + (f" +{len(kept) - 3} more" if len(kept) > 3 else ""),
        "comm": f"{s.param_dtype} gathers and grads, {cfg.parallel.reduce_dtype} reduce-scatter input",
        "deferred": f"{s.rbytes * s.gathered_numel() / GiB:.2f} GiB, all groups" if s.defer else "",
        "blocks": block_note,
        "head": "",
        "logits": (f"chunks of {min(s.loss_chunk, s.tokens)} tokens; the loss's gradients held to backward"
                   if s.loss_chunk else f"[{s.tokens}, {s.args.vocab_size}] in {s.param_dtype} + "
                   + ("its gradient (compiled loss)" if s.compiled else "3 float32 at the loss backward")),
        "work": "",
    }


def plan(cfg: Config, gpus: int, gpu: GPU | int, gpus_per_node: Optional[int] = None,
         host_bandwidth: float = HOST_ADAMW_BW) -> Plan:
    """Predict per-GPU memory of training `cfg` on `gpus` cards of profile `gpu`, or of that many bytes of memory
    (a generic card; memory.limit_gib, when set and smaller, is the capacity); when it does not fit, list changes
    that do, cheapest first; when it fits, faster settings that fit too, fastest first."""
    validate(cfg, gpus, "cuda")
    gpu = gpu if isinstance(gpu, GPU) else generic(gpu)
    capacity, source = gpu.memory_bytes, "GPU memory"
    if cfg.memory.limit_gib is not None and cfg.memory.limit_gib * GiB < capacity:
        capacity, source = int(cfg.memory.limit_gib * GiB), "memory.limit_gib"
    # The node size itself, even where the run uses fewer GPUs: suggestions of more GPUs fill nodes of that size.
    result = _estimate(cfg, gpus, capacity, source, gpus_per_node or GPUS_PER_NODE, gpu, host_bandwidth)
    if result.verdict == "fits":
        result.suggestions = _faster_options(cfg, result)
    else:
        result.suggestions = _suggestions(cfg, result)
        hsdp = _hsdp_option(cfg, result)
        result.suggestions = _cheapest_first(result.suggestions + ([hsdp] if hsdp else []))
    return result


def check_fits(cfg: Config, world_size: int, gpu: GPU | int) -> Plan:
    """The plan for the job being started on `gpu` (gpus.this_gpu): `plan` with the node size torchrun reports
    (LOCAL_WORLD_SIZE), and param_dtype 'auto' resolved for this node's GPUs."""
    return plan(_for_this_gpu(cfg), world_size, gpu, int(os.environ.get("LOCAL_WORLD_SIZE", GPUS_PER_NODE)))


def remedy_after_oom(cfg: Config, planned: Plan, short_by: int) -> Optional[Suggestion]:
    """For the job `planned` (check_fits' plan) that ran out of memory where an allocation of `short_by` bytes failed:
    the cheapest change the planner says lowers the peak by that much, outside the error band (enough: the run
    was short by that allocation less the memory then free). Where the plan said the run fits, the plan fell short
    as the run did, so the change must lower the plan itself; where it said it would not (memory.ignore_plan), its
    own cheapest change that fits. None where no change the planner tries lowers it that much."""
    if not planned.fits:
        return planned.remedy()
    below = dataclasses.replace(planned, capacity_bytes=planned.total_bytes - short_by)
    return next(iter(_suggestions(_for_this_gpu(cfg), below)), None)


def _for_this_gpu(cfg: Config) -> Config:
    """cfg with param_dtype 'auto' resolved as the trainer resolves it on this machine's GPU (float16 before
    Ampere)."""
    dtype = resolve_param_dtype(cfg.parallel.param_dtype, "cuda")
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, param_dtype=dtype))


# -- what to change --------------------------------------------------------------------------------------------------
AC_SETTINGS = ({"ac.mode": "none"}, {"ac.mode": "op"}, {"ac.mode": "selective", "ac.every": 2}, {"ac.mode": "full"})
"""The AC settings the planner tries, from the most memory (and least recompute) to the least."""
RESHARD_POLICIES = ("never", "default", "always")
"""reshard_after_forward, from the most gathered parameters kept to the fewest."""


def _ac_changes(cfg: Config) -> list[dict[str, Any]]:
    """AC_SETTINGS other than the run's."""
    return [c for c in AC_SETTINGS if c["ac.mode"] != cfg.ac.mode or c.get("ac.every", cfg.ac.every) != cfg.ac.every]


def _knobs(cfg: Config) -> list[list[dict[str, Any]]]:
    """Each knob's alternatives to the current setting (as config-path -> value), an empty change first."""
    t, p = cfg.train, cfg.parallel
    micro = [{"train.micro_batch_size": m, "train.grad_accum_steps": t.grad_accum_steps * t.micro_batch_size // m}
             for m in range(t.micro_batch_size - 1, 0, -1) if t.micro_batch_size % m == 0]
    lighter = RESHARD_POLICIES[RESHARD_POLICIES.index(p.reshard_after_forward) + 1:]
    knobs = [
        [c for c in _ac_changes(cfg) if c["ac.mode"] != "none"],  # no AC saves no memory
        micro,
        [{"parallel.keep_gathered": 0}] if p.keep_gathered else [],
        # keep_gathered only adds to the default policy: a lighter one is valid combined with the knob above only
        # (validation refuses it alone), and came twice when it also cleared keep_gathered itself
        [{"parallel.reshard_after_forward": r} for r in lighter],
        [{"parallel.defer_grad_sync": False}] if p.defer_grad_sync else [],
        # back to the defaults: the pool costs no time, nor did prefetching 2 blocks ahead gain any (benchmarks/README)
        [{"parallel.grads_in_compute_pool": True}] if not p.grads_in_compute_pool else [],
        [{"parallel.prefetch": 1}] if p.prefetch > 1 else [],
        [{"parallel.copy_engine_all_gather": False}] if p.copy_engine_all_gather else [],
        [{"train.loss_chunk_tokens": LOSS_CHUNK}] if not t.loss_chunk_tokens else [],
        [{"parallel.cpu_offload": True}] if not p.cpu_offload else [],
        # HSDP (or DDP, dp_shard 1) replicates what FSDP over every GPU would shard
        [{"parallel.dp_replicate": 1, "parallel.dp_shard": -1}] if p.dp_replicate > 1 else [],
    ]
    return [[{}] + options for options in knobs]


def _apply(cfg: Config, change: dict[str, Any]) -> Config:
    new = copy.deepcopy(cfg)
    for path, value in change.items():
        if path != "gpus":
            section, name = path.split(".")
            setattr(getattr(new, section), name, value)
    return new


def _replan(cfg: Config, base: Plan, change: dict[str, Any]) -> Optional[Plan]:
    """The plan with `change` applied; None where the trainer's own validation would refuse the changed run, which
    the planner then never offers (selective AC every 2 blocks of a 1-block model, say)."""
    new, gpus = _apply(cfg, change), change.get("gpus", base.gpus)
    try:
        validate(new, gpus, "cuda")
    except ConfigError:
        return None
    return _estimate(new, gpus, base.capacity_bytes, base.capacity_source, base.gpus_per_node, base.gpu,
                     base.host_bandwidth)


def _cost(base: Plan, new: Plan, tokens_ratio: float = 1.0) -> float:
    """Relative time per token per GPU; `tokens_ratio` = tokens per GPU per step, new over base."""
    return new.step_seconds / tokens_ratio / base.step_seconds - 1


def _roomy(new: Optional[Plan]) -> bool:
    """Whether a suggested setting is valid and fits outside the error band."""
    return new is not None and new.verdict == "fits"


# The chunk the planner suggests: 2048 tokens of a 128K vocabulary are 1.5 GiB of chunk buffers.
LOSS_CHUNK = 2048

_AC_WHAT = {"none": "no recompute: every block keeps its activations",
            "op": "recomputes norms, RoPE and SiLU in backward, keeps the matmul outputs",
            "selective": "recomputes one block in {every} in backward",
            "full": "recomputes every block in backward"}
_WHY = {"train.loss_chunk_tokens": "the loss in chunks of tokens: no full-sequence logits",
        "parallel.defer_grad_sync": "reduce-scatters every micro-batch instead of holding unsharded grads",
        "parallel.cpu_offload": "params, grads and AdamW state in host RAM: much slower"}


def _freed_after_forward(cfg: Config, change: dict[str, Any]) -> str:
    """In words, the groups the run keeps gathered from forward to backward and the change frees ('' if none)."""
    groups = fsdp_groups(model_args_from_config(cfg.model))
    p, q = cfg.parallel, _apply(cfg, change).parallel
    after = kept_after_forward(groups, q.reshard_after_forward, q.keep_gathered)
    freed = [g for g in kept_after_forward(groups, p.reshard_after_forward, p.keep_gathered) if g not in after]
    blocks = [g for g in groups if g.role == "block"]
    index = [blocks.index(g) for g in freed if g.role == "block"]
    words = []
    if index:
        first, last, n = index[0], index[-1], len(blocks)
        if first == 0 and last == n - 1:
            words.append("every block")
        elif first == 0:
            words.append("every block but the last" + (f" {n - 1 - last}" if last < n - 2 else ""))
        elif last == n - 1:
            words.append(f"the last {len(index)} blocks" if len(index) > 1 else "the last block")
        else:
            words.append(f"blocks {first} to {last}" if len(index) > 1 else blocks[first].name)
    words += ["the embedding" if g.role == "embedding" else "the output layer" for g in freed if g.role != "block"]
    return " and ".join([", ".join(words[:-1]), words[-1]] if len(words) > 1 else words)


def _note(cfg: Config, change: dict[str, Any], new: Plan) -> str:
    """What the change does to the run, part by part, and the host RAM it needs."""
    why = []
    if "ac.mode" in change:
        why.append(_AC_WHAT[change["ac.mode"]].format(every=change.get("ac.every", cfg.ac.every)))
    if "train.micro_batch_size" in change:
        fewer = change["train.micro_batch_size"] > cfg.train.micro_batch_size
        why.append(f"same global batch in {'fewer, larger' if fewer else 'more, smaller'} micro-batches")
    freed = _freed_after_forward(cfg, change)
    if freed:
        why.append(f"frees {freed} after forward (gathered again in backward)")
    why += [text for key, text in _WHY.items() if key in change]
    if "parallel.copy_engine_all_gather" in change:
        engines = change["parallel.copy_engine_all_gather"]
        why.append("all-gathers on the copy engines, in NCCL symmetric memory" if engines
                   else "FSDP2's all-gather: NCCL kernels on SMs, no symmetric memory pool")
    if "parallel.dp_replicate" in change:
        why.append("HSDP: less inter-node traffic, more memory per GPU" if change["parallel.dp_replicate"] > 1
                   else "FSDP over all GPUs: less memory per GPU, more inter-node traffic")
    if new.host_bytes_per_node:
        why.append(f"needs {new.host_bytes_per_node / GiB:.0f} GiB host RAM per node")
    return "; ".join(why)


def _suggestions(cfg: Config, base: Plan, limit: int = 5) -> list[Suggestion]:
    """Every combination of the knobs, re-planned; the `limit` cheapest of those that fit outside the error band
    and change nothing needlessly, and the smallest GPU count the unchanged run fits on, cheapest first."""
    fitting = []
    for combo in itertools.product(*_knobs(cfg)):
        change = {k: v for part in combo for k, v in part.items()}
        if not change:
            continue
        new = _replan(cfg, base, change)
        if _roomy(new):
            fitting.append((change, new))
    changes = [c for c, _ in fitting]

    def needless(c: dict[str, Any]) -> bool:
        """It contains a smaller fitting change, or reshards always where default, the rest alike, fits: default
        already frees every block; always also frees the group that runs last, to gather it again at once."""
        return any(o.items() < c.items() for o in changes) or (
            c.get("parallel.reshard_after_forward") == "always"
            and {**c, "parallel.reshard_after_forward": "default"} in changes)

    found = [Suggestion(c, base.gpus, p.total_bytes, _cost(base, p), _note(cfg, c, p))
             for c, p in fitting if not needless(c)]
    more = _more_gpus(cfg, base)
    return _cheapest_first(sorted(found, key=lambda s: s.cost)[:limit] + ([more] if more else []))


def _cheapest_first(suggestions: list[Suggestion]) -> list[Suggestion]:
    """By cost, time per token per GPU, which prices more GPUs as it does a change of settings: in GPU hours per
    token. More GPUs at the same speed per GPU come before a 20x slower CPU offload; equal costs keep their order."""
    return sorted(suggestions, key=lambda s: s.cost)


def _more_gpus(cfg: Config, base: Plan) -> Optional[Suggestion]:
    """The smallest multiple of the GPU count (up to 16x) the unchanged run fits on outside the error band. The
    global batch stays the same where grad_accum_steps can shrink by the same factor."""
    accum = cfg.train.grad_accum_steps
    for factor in (2, 4, 8, 16):
        change: dict[str, Any] = {"gpus": base.gpus * factor}
        if cfg.parallel.dp_shard != -1:
            change["parallel.dp_shard"] = -1
        if accum % factor == 0:
            change["train.grad_accum_steps"] = accum // factor
        new = _replan(cfg, base, change)
        if _roomy(new):
            same_batch = accum % factor == 0
            return Suggestion(change, new.gpus, new.total_bytes, _cost(base, new, 1 / factor if same_batch else 1.0),
                              "" if same_batch else f"the global batch grows {factor}x")
    return None


def _faster_options(cfg: Config, result: Plan, limit: int = 3) -> list[Suggestion]:
    """For a run that fits: the changes the time model says are faster and that fit outside the error band,
    fastest first. HSDP across nodes, more blocks kept gathered, lighter AC, the copy engines' all-gather where it
    was turned off, and fewer, larger micro-batches (only where grad_accum_steps shrinks as much: a larger global
    batch would change the training, not only its speed)."""
    t = cfg.train
    tweaks = _ac_changes(cfg) + [
        {"train.micro_batch_size": t.micro_batch_size * f, "train.grad_accum_steps": t.grad_accum_steps // f}
        for f in range(2, t.grad_accum_steps + 1) if t.grad_accum_steps % f == 0] + (
        [] if cfg.parallel.copy_engine_all_gather else [{"parallel.copy_engine_all_gather": True}])
    hsdp = _hsdp_option(cfg, result)
    # A step takes the longer of compute and communication: where inter-node all-gathers set the pace, less
    # recompute gains little without HSDP, so each tweak is also tried on top of it.
    changes = tweaks + ([{**tweak, **hsdp.change} for tweak in tweaks] if hsdp else [])
    options = [option for option in (hsdp, _keep_gathered_option(cfg, result)) if option]
    for change in changes:
        new = _replan(cfg, result, change)
        if _roomy(new):
            options.append(Suggestion(change, result.gpus, new.total_bytes, _cost(result, new),
                                      _note(cfg, change, new)))
    return sorted((o for o in options if o.cost <= -SAME_SPEED), key=lambda o: o.cost)[:limit]


def _keep_gathered_option(cfg: Config, result: Plan) -> Optional[Suggestion]:
    """For a run that fits with room to spare: the most blocks `parallel.keep_gathered` can keep outside the error
    band, each one all-gather and its copies fewer per step."""
    p = cfg.parallel
    n_layers = model_args_from_config(cfg.model).n_layers
    if p.reshard_after_forward != "default" or p.keep_gathered >= n_layers:
        return None
    low, high, best = p.keep_gathered, n_layers, None  # the largest count that fits, by bisection
    while low < high:
        middle = (low + high + 1) // 2
        new = _replan(cfg, result, {"parallel.keep_gathered": middle})
        if _roomy(new):
            low, best = middle, new
        else:
            high = middle - 1
    if best is None:
        return None
    return Suggestion({"parallel.keep_gathered": low}, result.gpus, best.total_bytes, _cost(result, best),
                      f"keeps the last {low} blocks gathered from forward to backward")


def _hsdp_option(cfg: Config, result: Plan) -> Optional[Suggestion]:
    """HSDP (shard within a node, replicate across nodes) for a multi-node FSDP run: more memory per GPU than
    sharding over every GPU, but only one all-reduce of sharded gradients per step crosses nodes. Offered on top of
    the run if it fits, else on top of its first same-hardware suggestion, and only outside the error band."""
    nodes = result.gpus // result.gpus_per_node
    if result.dp_replicate > 1 or nodes < 2 or result.gpus % result.gpus_per_node:
        return None
    on_top = {} if result.verdict == "fits" else next(
        (s.change for s in result.suggestions if "gpus" not in s.change), None)
    if on_top is None:
        return None
    change = {**on_top, "parallel.dp_replicate": nodes, "parallel.dp_shard": result.gpus_per_node}
    new = _replan(cfg, result, change)
    if not _roomy(new):
        return None
    return Suggestion(change, result.gpus, new.total_bytes, _cost(result, new), _note(cfg, change, new))


# -- command line ----------------------------------------------------------------------------------------------------
_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_memory(text: str) -> int:
    """'47.4GiB' -> bytes. GiB/MiB are powers of 2, GB/MB powers of 10; a unit is required, since nvidia-smi (MiB)
    and vendor sheets (GB) differ by 7% at this size."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]+)\s*", text)
    unit = _UNITS.get(match.group(2).lower()) if match else None
    size = int(float(match.group(1)) * unit) if unit else 0
    if size < 1:  # under a byte counts as none: 0 would have stood for "not given", and been planned as 80 GiB
        raise ConfigError(f"--gpu-memory {text!r}: expected a positive number with a unit, e.g. 80GiB, 47.4GiB or "
                          "80GB (GiB = 2^30 bytes, GB = 10^9 bytes)")
    return size


@dataclass
class PlanArgs(Config):
    """Predict per-GPU memory of a training run before launching it; every training flag applies."""

    gpus: Optional[int] = None
    """GPUs the run will use (None: this machine's GPUs, or 8 where it has none)."""
    gpu: Optional[str] = None
    """The card, for its memory and time costs: a100-40gb, a100-80gb, a6000, l40s, h100-sxm, h100-pcie, h200
    (None: this machine's; given, param_dtype 'auto' is planned as bfloat16)."""
    gpu_memory: Optional[str] = None
    """Memory of one GPU with a unit, e.g. 80GiB, 47.4GiB, 80GB (None: the card's). Alone, a generic card of that
    memory, planned as --gpu is."""
    host_bandwidth_gbs: Optional[float] = None
    """GB/s one node's ranks stream through host AdamW under CPU offload, as benchmarks/host_adamw.py measures it
    (None: 115, an H200 host's)."""
    json: bool = False
    """Print the plan as JSON instead of a table."""


def _hardware(args: PlanArgs) -> tuple[int, GPU, bool, dict[str, str]]:
    """GPU count and card: the flags, else this machine's GPUs, else DEFAULT_GPUS generic cards of
    DEFAULT_GPU_MEMORY. Then whether the plan is for this machine's GPU (whatever the count), and what was assumed,
    in words, by the flag that would set it."""
    if args.gpus is not None and args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus}: must be at least 1")
    if args.gpu is not None and args.gpu not in GPUS:
        raise ConfigError(f"--gpu {args.gpu}: not a card the planner knows; choose one of {', '.join(GPUS)}, or give "
                          "--gpu-memory alone for a generic card")
    memory = parse_memory(args.gpu_memory) if args.gpu_memory is not None else None
    here = torch.cuda.is_available()
    if here and args.gpu is None and memory is None:
        return args.gpus or torch.cuda.device_count(), this_gpu(), True, {}
    card = GPUS[args.gpu] if args.gpu else generic(memory or DEFAULT_GPU_MEMORY)
    card = dataclasses.replace(card, memory_bytes=memory or card.memory_bytes)
    assumed = {flag: value for flag, value, given in
               (("--gpus", f"{DEFAULT_GPUS} GPUs", args.gpus or here or None),
                ("--gpu", f"{DEFAULT_GPU_MEMORY / GiB:.0f} GiB each with an {REFERENCE.name}'s rates",
                 args.gpu or memory)) if given is None}
    return args.gpus or (torch.cuda.device_count() if here else DEFAULT_GPUS), card, False, assumed


def _in_words(assumed: dict[str, str]) -> str:
    """What `_hardware` assumed, and the flags to set instead ('' where nothing was)."""
    if not assumed:
        return ""
    return f"assumed {', '.join(assumed.values())}, as this machine has no GPU: set {' and '.join(assumed)} for yours"


def main(argv: Optional[Sequence[str]] = None) -> None:
    assumed: dict[str, str] = {}
    try:  # a bad flag or config file exits 2, apart from a plan that does not fit (1)
        args = parse_args(argv, cls=PlanArgs, description=__doc__.split("\n\n")[0],
                          prog="python -m fsdp_trainer.tools.plan")
        model_from_init_from(args)
        gpus, card, here, assumed = _hardware(args)
        host = HOST_ADAMW_BW if args.host_bandwidth_gbs is None else args.host_bandwidth_gbs * 1e9
        result = plan(_for_this_gpu(args) if here else args, gpus, card, host_bandwidth=host)
    except (ConfigError, CheckpointError) as err:
        # Validation reads the GPU count, not the memory: it may refuse a count the user never set (the ranks a
        # mesh does not divide).
        count = _in_words({flag: text for flag, text in assumed.items() if flag == "--gpus"})
        print(f"error: {err}" + (f" ({count})" if count else ""), file=sys.stderr)
        sys.exit(2)
    result.assumed = _in_words(assumed)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.render())
    sys.exit(0 if result.fits else 1)


def preflight(cfg: Config, world_size: int, rank: int, own_model: bool, copy_engines: bool) -> Optional[Plan]:
    """The trainer's check on GPUs: the plan's summary, and a ConfigError before anything is allocated if the run
    cannot fit (`copy_engines`: whether this host runs the all-gathers in symmetric memory, as the trainer decided)."""
    if not torch.cuda.is_available():
        return None
    if own_model:
        if rank == 0:
            print("memory plan: none for your own model; the planner knows only the Llama that --model.* describes",
                  file=sys.stderr)
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    # Planned as it will run here: the planner alone cannot know this host's NCCL and environment.
    planned = copy.deepcopy(cfg)
    planned.parallel.copy_engine_all_gather = copy_engines
    memory_plan = check_fits(planned, world_size, this_gpu(local_rank))
    if not memory_plan.fits and not cfg.memory.ignore_plan:
        raise ConfigError(f"{memory_plan.summary_line()}. Apply a suggested change, or "
                          "pass --memory.ignore_plan to start anyway. Details: python -m fsdp_trainer.tools.plan "
                          "with the same flags")
    if rank == 0:  # marginal: the headroom is inside the plan's error, a warning that names the change leaving it
        print(("warning: " if memory_plan.verdict == "marginal" else "") + memory_plan.summary_line(), file=sys.stderr)
    return memory_plan


def planned_vs_measured(memory_plan: Plan, device: torch.device) -> dict:
    """The plan's predicted allocator peak and reserved memory beside the measured ones, logged once after the
    first steps."""
    planned = memory_plan.predicted_peak_bytes / GiB
    measured = torch.cuda.max_memory_allocated(device) / GiB
    planned_reserved = memory_plan.predicted_reserved_bytes / GiB
    logger.info(f"memory: planned peak {planned:.2f} GiB, measured {measured:.2f} GiB "
                f"({100 * (planned / measured - 1):+.1f}%); planned reserved {planned_reserved:.2f} GiB")
    return {"planned_peak_gib": planned, "measured_peak_gib": measured, "planned_reserved_gib": planned_reserved}


if __name__ == "__main__":
    main()
