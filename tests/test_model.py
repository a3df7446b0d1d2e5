"""The Llama model on its own: shapes of the presets, parameter and FLOP counts, RoPE, causality."""

from __future__ import annotations

import pytest
import torch

from fsdp_trainer.models.llama import PRESETS, ModelArgs, _rope_complex, _rope_real, apply_rope, build, rope_table
from fsdp_trainer.parallelize import init_weights


@pytest.mark.parametrize("name", list(PRESETS))
def test_parameter_count_formula_matches_the_built_model(name):
    args = ModelArgs.from_preset(name)
    model = build(args, device="meta")
    assert args.num_params() == sum(p.numel() for p in model.parameters())


def test_presets_have_the_public_llama3_shapes():
    eight = ModelArgs.from_preset("8b")
    assert (eight.dim, eight.n_layers, eight.n_heads, eight.n_kv_heads, eight.vocab_size, eight.ffn_hidden_dim) == \
        (4096, 32, 32, 8, 128256, 14336)
    assert round(eight.num_params() / 1e9, 2) == 8.03
    assert ModelArgs.from_preset("70b").ffn_hidden_dim == 28672
    assert ModelArgs.from_preset("1b").ffn_hidden_dim == 8192 and ModelArgs.from_preset("1b").tie_embeddings
    assert ModelArgs.from_preset("8b", n_layers=2).n_layers == 2


@pytest.mark.parametrize("name,published", [("125m", 125e6), ("1b", 1.24e9), ("3b", 3.21e9), ("8b", 8.03e9),
                                            ("70b", 70.6e9)])
def test_presets_have_the_size_their_names_say(name, published):
    assert ModelArgs.from_preset(name).num_params() == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize("scaling,message", [
    ({"factor": 8.0}, "give exactly factor, low_freq_factor, high_freq_factor, original_max_position_embeddings"),
    ({"factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0, "original_max_position_embeddings": 8192},
     "low_freq_factor below high_freq_factor"),
])
def test_rope_scaling_is_all_of_llama3_s_or_none(scaling, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_preset("debug", rope_scaling=scaling)
    assert ModelArgs.from_preset("1b", rope_scaling={}).rope_scaling is None


def test_flops_per_token_counts_matmuls_and_attention():
    args = ModelArgs.from_preset("8b")
    d, h, kv, f, v, n = 4096, 128, 8, 14336, 128256, 32
    matmul_weights = n * (d * d * 2 + d * kv * h * 2 + 3 * d * f) + v * d  # blocks + output projection
    assert args.flops_per_token(8192) == 6 * matmul_weights + 12 * n * d * 8192
    # The quoted reference: 8,572 tokens/s/GPU is 50.2% MFU of 989 TFLOP/s for this shape.
    assert 8572 * args.flops_per_token(8192) / 989e12 == pytest.approx(0.502, abs=0.001)


@pytest.mark.parametrize("rope", [_rope_complex, _rope_real], ids=["eager (complex)", "compiled (real)"])
def test_rope_rotates_each_pair_and_encodes_relative_position(rope):
    head_dim, seq, theta, table = 16, 64, 10000.0, rope_table(16, 64, 10000.0)
    x = torch.randn(1, seq, 2, head_dim, dtype=torch.bfloat16)
    # Pair k of position m turns by the angle m * theta^(-2k/d): a 2x2 rotation matrix per pair.
    angles = torch.outer(torch.arange(seq).double(), theta ** (-torch.arange(0, head_dim, 2).double() / head_dim))
    matrices = torch.stack((torch.stack((angles.cos(), -angles.sin()), -1),
                            torch.stack((angles.sin(), angles.cos()), -1)), -2)  # [seq, pairs, 2, 2]
    expected = torch.einsum("spij,bshpj->bshpi", matrices, x.double().unflatten(-1, (-1, 2))).flatten(3)
    rotated = rope(x, table)
    assert rotated.dtype == torch.bfloat16
    torch.testing.assert_close(rotated, expected.to(torch.bfloat16))
    q, k = torch.randn(head_dim), torch.randn(head_dim)

    def score(m, n):
        qs = rope(q.expand(1, seq, 1, head_dim), table)[0, m, 0]
        ks = rope(k.expand(1, seq, 1, head_dim), table)[0, n, 0]
        return qs @ ks

    assert score(10, 3).item() == pytest.approx(score(40, 33).item(), rel=1e-4)


def test_rope_table_is_not_cast_by_fsdp_mixed_precision():
    # FSDP2 casts floating-point forward arguments to param_dtype; a complex table passes into the blocks as is.
    table = rope_table(128, 16, 500000.0)
    assert table.dtype == torch.complex64 and not table.is_floating_point()


def test_rope_formulations_agree_in_value_and_gradient():
    table = rope_table(128, 256, 500000.0)
    x = torch.randn(2, 256, 4, 128, requires_grad=True)
    grad = torch.randn(2, 256, 4, 128)
    (complex_grad,) = torch.autograd.grad(_rope_complex(x, table), x, grad)
    (real_grad,) = torch.autograd.grad(_rope_real(x, table), x, grad)
    torch.testing.assert_close(_rope_complex(x, table), _rope_real(x, table))
    torch.testing.assert_close(complex_grad, real_grad)
    assert apply_rope(x, table).equal(_rope_complex(x, table))  # eager takes the complex multiply


def test_output_is_causal_and_tied_weights_share_storage():
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=50, multiple_of=16, max_seq_len=16,
                     tie_embeddings=True)
    model = build(args, device="cpu")
    init_weights(model, "cpu", seed=0)
    assert model.output.weight is model.tok_embeddings.weight
    tokens = torch.randint(0, 50, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 50
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[0, :8], b[0, :8])
    assert not torch.allclose(a[0, 8:], b[0, 8:])


def test_invalid_shapes_are_rejected_with_the_field_name():
    with pytest.raises(ValueError, match="model.dim=100 is not divisible by model.n_heads=8"):
        ModelArgs(dim=100, n_heads=8)
    with pytest.raises(ValueError, match="model.n_kv_heads=3 must divide"):
        ModelArgs(dim=64, n_heads=8, n_kv_heads=3)
    with pytest.raises(ValueError, match="model.ffn_dim_multiplier=0.001 leaves the SwiGLU no width at model.dim=64"):
        ModelArgs(dim=64, n_heads=8, ffn_dim_multiplier=0.001, multiple_of=1)


@pytest.mark.parametrize("name", ["ffn_dim_multiplier", "rope_theta", "norm_eps"])
@pytest.mark.parametrize("value", [-1.0, 0.0, float("inf"), float("nan")])
def test_scalars_that_would_break_the_model_are_rejected(name, value):
    # Otherwise: a negative or zero FFN width in torch, or NaN losses blamed on the learning rate.
    with pytest.raises(ValueError, match=f"model.{name}={value}: must be a finite number > 0"):
        ModelArgs(dim=64, n_heads=8, **{name: value})
