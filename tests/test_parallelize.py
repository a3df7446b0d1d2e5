"""The parallelism helpers on their own: activation checkpointing, and sharding a model that is not ours."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_trainer.models.llama import ModelArgs, TransformerBlock, build
from fsdp_trainer.parallelize import apply_ac, apply_fsdp, blocks_of

from helpers import run_ranks

ARGS = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim_multiplier=1.0,
                 multiple_of=32, max_seq_len=64, rope_theta=10000.0)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _grads_and_backward_ops(mode: str, every: int = 2):
    """Gradients, and the ops run during backward (recomputed forward ops show up here)."""
    model = build(ARGS, device="cpu")
    model.init_weights(seed=0)
    apply_ac(model, (TransformerBlock,), mode, every)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
    with OpCounter() as counter:
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, counter.counts


def test_every_ac_mode_gives_the_gradients_of_no_ac_and_recomputes_what_it_should():
    reference, base = _grads_and_backward_ops("none")
    assert base["silu"] == 0
    # q, k, v, o, w1, w3 per block: recomputation stops early before w2, whose output backward never needs.
    forward_mms = 6 * ARGS.n_layers
    expected = {  # mode: (forward matmuls recomputed, blocks whose SwiGLU activation is recomputed)
        "full": (forward_mms, ARGS.n_layers),
        "selective": (forward_mms // 2, ARGS.n_layers // 2),
        "op": (0, ARGS.n_layers),  # matmul outputs saved, the cheap elementwise ops recomputed
    }
    for mode, (mms, silus) in expected.items():
        grads, ops = _grads_and_backward_ops(mode)
        for name, grad in reference.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=f"{mode}: {name}")
        assert ops["mm"] - base["mm"] == mms, mode
        assert ops["silu"] == silus, mode


def test_blocks_of_names_the_missing_block_type():
    with pytest.raises(ValueError, match="has no submodule of type Linear"):
        blocks_of(nn.Sequential(nn.ReLU()), (nn.Linear,))


# -- a team's own model: not a transformer, no init_param, built eagerly ------------------------------------
class ResidualMLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Regressor(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3):
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.body = nn.Sequential(*(ResidualMLP(width) for _ in range(depth)))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.body(self.stem(x)))


def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 8, 8, generator=g)  # 3 steps x global batch 8
    return x, x.sum(-1, keepdim=True).sin()


def _train(model, x, y, rank, world):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(x.shape[0]):
        shard = slice(rank * 8 // world, (rank + 1) * 8 // world)
        loss = F.mse_loss(model(x[step, shard]), y[step, shard])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def shard_own_model(world):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from fsdp_trainer import distributed
    info = distributed.init()
    torch.manual_seed(0)
    model = Regressor()
    apply_ac(model, (ResidualMLP,), "op")
    apply_fsdp(model, distributed.build_mesh("cpu", 1, world), block_types=(ResidualMLP,),
               param_dtype=torch.float32)
    losses = _train(model, *_data(), info.rank, world)
    mean_loss = torch.stack(losses)
    torch.distributed.all_reduce(mean_loss)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return (mean_loss / world).tolist(), state


def test_a_teams_own_model_shards_and_matches_plain_training():
    results = run_ranks(shard_own_model, 2, 2)
    torch.manual_seed(0)
    reference = Regressor()
    ref_losses = [loss.item() for loss in _train(reference, *_data(), 0, 1)]
    losses, state = results[0]
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, atol=1e-5, rtol=0, msg=name)


def record_prefetch(prefetch):
    """Which blocks each block asks FSDP2 to all-gather ahead, in forward and in backward (as block indices)."""
    from torch.distributed.fsdp import FSDPModule

    from fsdp_trainer import distributed
    distributed.init()
    calls = {}

    def recorder(kind):
        def record(self, modules):
            calls.setdefault(kind, {})[id(self)] = [id(m) for m in modules]
        return record

    FSDPModule.set_modules_to_forward_prefetch = recorder("forward")
    FSDPModule.set_modules_to_backward_prefetch = recorder("backward")
    model = build(ARGS, device="meta")
    apply_fsdp(model, distributed.build_mesh("cpu", 1, 1), block_types=(TransformerBlock,), prefetch=prefetch)
    index = {id(block): i for i, block in enumerate(model.layers)}
    return {kind: {index[k]: [index[m] for m in v] for k, v in by_block.items()} for kind, by_block in calls.items()}


def gathered_after_forward(reshard, keep_gathered, embedding_group=False):
    """Which blocks (and whether the embedding) still hold gathered (plain tensor) parameters between forward and
    backward."""
    from torch.distributed.tensor import DTensor

    from fsdp_trainer import distributed
    from fsdp_trainer.parallelize import init_weights
    distributed.init()
    model = build(ARGS, device="meta")
    apply_fsdp(model, distributed.build_mesh("cpu", 1, 2), block_types=(TransformerBlock,),
               groups=[[model.tok_embeddings]] if embedding_group else (),
               param_dtype=torch.float32, reshard_after_forward=reshard, keep_gathered=keep_gathered)
    init_weights(model, torch.device("cpu"))
    model(torch.zeros(1, 8, dtype=torch.long)).sum()
    blocks = [i for i, block in enumerate(model.layers) if not isinstance(block.attention.wq.weight, DTensor)]
    return blocks, not isinstance(model.tok_embeddings.weight, DTensor)


@pytest.mark.parametrize("reshard,keep,gathered", [
    ("default", 0, [3]),  # no other groups: the last block runs last in forward and first in backward
    ("default", 2, [2, 3]),
    ("default", 3, [1, 2, 3]),
    ("never", 0, [0, 1, 2, 3]),
    ("always", 0, []),
])
def test_blocks_kept_gathered_after_forward(reshard, keep, gathered):
    assert [blocks for blocks, _ in run_ranks(gathered_after_forward, 2, reshard, keep)] == [gathered, gathered]


def test_the_module_kept_gathered_is_the_last_to_run_not_the_last_group_listed():
    # The embedding is a group of its own, registered (and run) before the blocks: the last block stays gathered.
    assert run_ranks(gathered_after_forward, 2, "default", 0, True) == [([3], False)] * 2


@pytest.mark.parametrize("unsafe", [{"cpu_offload": True}, {"reduce_dtype": torch.bfloat16}])
def test_gradients_in_the_compute_pool_are_refused_where_the_gradient_is_not_the_reduce_scatter_output(unsafe):
    class OneDimMesh:
        ndim, device_type = 1, "cuda"

    with pytest.raises(ValueError, match="grads_in_compute_pool needs a 1-D mesh, float32 reduction and no CPU"):
        apply_fsdp(build(ARGS, device="meta"), OneDimMesh(), block_types=(TransformerBlock,),
                   grads_in_compute_pool=True, **unsafe)


def test_prefetch_two_asks_each_block_for_the_next_two_in_both_directions():
    assert run_ranks(record_prefetch, 1, 1) == [{}]  # FSDP2's own schedule
    assert run_ranks(record_prefetch, 1, 2) == [{
        "forward": {0: [1, 2], 1: [2, 3], 2: [3], 3: []},
        "backward": {0: [], 1: [0], 2: [1, 0], 3: [2, 1]},
    }]


def _backward_ops_of_a_teams_model(mode):
    torch.manual_seed(0)
    model = Regressor()
    apply_ac(model, (ResidualMLP,), mode)
    x, y = _data()
    loss = F.mse_loss(model(x[0]), y[0])
    with OpCounter() as counter:
        loss.backward()
    return counter.counts


def test_per_op_ac_keeps_the_outputs_of_linear_layers_with_a_bias():
    """nn.Linear with a bias runs addmm, not mm: per-op AC saves its output too and recomputes only the cheap ops."""
    base, op, full = (_backward_ops_of_a_teams_model(mode) for mode in ("none", "op", "full"))
    # Full AC runs each of the 3 blocks' up projection again (recomputation stops before down: no backward reads
    # its output).
    assert full["addmm"] - base["addmm"] == 3
    assert op["addmm"] == base["addmm"] and op["gelu"] == 3


def test_init_weights_refuses_parameters_and_buffers_nothing_would_fill():
    from fsdp_trainer.parallelize import init_weights

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)  # reset_parameters() fills it
            self.scale = nn.Parameter(torch.ones(4))
            self.register_buffer("table", torch.arange(4.0), persistent=False)

    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(ValueError, match="cannot initialize scale, table: materialized from meta"):
        init_weights(model, torch.device("cpu"))
    assert model.linear.weight.is_meta  # refused before anything was allocated


def test_the_compute_pool_reduce_scatter_refuses_to_add_into_existing_gradients():
    """Accumulating into a gradient happens on the reduce-scatter stream and would race the compute stream's reuse
    of the memory: refused at the moment FSDP2 asks for the output."""
    from fsdp_trainer.parallelize import ComputePoolReduceScatter

    param = nn.Parameter(torch.zeros(2))
    comm = ComputePoolReduceScatter(None, [param])
    param.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="would add into gradients that already exist"):
        comm.allocate((2,), dtype=torch.float32, device=torch.device("cpu"))


def test_every_group_gathers_in_param_dtype_and_reduces_in_float32(monkeypatch):
    """bfloat16 compute with float32 gradient reduction, for every fully_shard call (FSDP2 would otherwise reduce
    in the compute dtype, a precision loss no loss curve at this size would show)."""
    from fsdp_trainer import parallelize

    policies = []
    monkeypatch.setattr(parallelize, "fully_shard", lambda module, **kwargs: policies.append(kwargs["mp_policy"]))
    model = build(ARGS, device="meta")
    apply_fsdp(model, None, block_types=(TransformerBlock,), groups=[[model.tok_embeddings], [model.norm, model.output]])
    assert len(policies) == ARGS.n_layers + 3
    assert {(p.param_dtype, p.reduce_dtype) for p in policies} == {(torch.bfloat16, torch.float32)}
