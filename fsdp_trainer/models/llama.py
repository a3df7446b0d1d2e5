"""A Llama-3-style decoder: RMSNorm, RoPE (with Llama 3.1's scaling), grouped-query attention through SDPA, SwiGLU.

No parallelism here: sharding, activation checkpointing and compilation are applied from outside
(`fsdp_trainer.parallelize`). Parameters are initialized by `init_param`, one full tensor at a time, from a
generator seeded by (seed, parameter name), so the weights are the same however the model is later sharded.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_trainer.loss import linear_cross_entropy

# In compiled blocks the only complex op is `view_as_real` of the RoPE table, a view that Inductor leaves to ATen at
# no cost; its warning that complex operators may run slower than eager does not apply.
warnings.filterwarnings("ignore", message="Torchinductor does not support code generation for complex operators")


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256
    ffn_hidden_dim: Optional[int] = None
    ffn_dim_multiplier: float = 1.3
    multiple_of: int = 1024
    max_seq_len: int = 8192
    rope_theta: float = 500000.0
    # Llama 3.1's RoPE scaling ("rope_type": "llama3" in Hugging Face's config.json): the keys of ROPE_SCALING.
    rope_scaling: Optional[dict[str, float]] = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self):
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)}: must be at least 1")
        if self.ffn_hidden_dim is not None and self.ffn_hidden_dim < 1:
            raise ValueError(f"model.ffn_hidden_dim={self.ffn_hidden_dim}: must be at least 1")
        # Each of these would otherwise surface as a shape error deep in torch, or as NaN losses (RoPE's frequencies
        # are powers of rope_theta; RMSNorm divides by sqrt(mean + norm_eps)).
        for name in ("ffn_dim_multiplier", "rope_theta", "norm_eps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"model.{name}={value}: must be a finite number > 0; set one, or leave it unset "
                                 "for the preset's")
        self.rope_scaling = _checked_rope_scaling(self.rope_scaling)
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head dim dim/n_heads={self.head_dim} must be even for RoPE")
        if self.ffn_hidden_dim is None:
            # Llama's rule: 2/3 of 4*dim, scaled, rounded up to a multiple of `multiple_of`.
            hidden = int(self.ffn_dim_multiplier * int(2 * 4 * self.dim / 3))
            self.ffn_hidden_dim = self.multiple_of * math.ceil(hidden / self.multiple_of)
            if self.ffn_hidden_dim < 1:
                raise ValueError(f"model.ffn_dim_multiplier={self.ffn_dim_multiplier} leaves the SwiGLU no width "
                                 f"at model.dim={self.dim}; raise it, or set model.ffn_hidden_dim")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "ModelArgs":
        if name not in PRESETS:
            raise ValueError(f"model.name={name!r} is not a preset; choose one of {', '.join(PRESETS)}")
        fields = {**PRESETS[name], **overrides}
        return cls(**fields)

    def num_params(self) -> int:
        """Parameter count, a tied embedding counted once."""
        d, h, kv = self.dim, self.head_dim, self.n_kv_heads
        attention = d * (self.n_heads * h) * 2 + d * (kv * h) * 2
        block = attention + 3 * d * self.ffn_hidden_dim + 2 * d
        embedding = self.vocab_size * d
        output = 0 if self.tie_embeddings else self.vocab_size * d
        return self.n_layers * block + embedding + output + d

    def num_matmul_params(self) -> int:
        """Weights that take part in a matmul per token: everything but norms and the embedding lookup."""
        return self.num_params() - self.vocab_size * self.dim * (0 if self.tie_embeddings else 1) \
            - (2 * self.n_layers + 1) * self.dim

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per matmul weight, plus attention's scores and values counted over the whole
        seq_len x seq_len square (12 * layers * dim * seq_len), though causal attention computes half of it: the
        convention published MFU figures use (torchtitan's among them), kept so that they compare."""
        return 6 * self.num_matmul_params() + 12 * self.n_layers * self.dim * seq_len


ROPE_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _checked_rope_scaling(scaling: Optional[dict]) -> Optional[dict[str, float]]:
    """RoPE scaling with every key of ROPE_SCALING, in that order (None for none, as {} is)."""
    if not scaling:
        return None
    if set(scaling) != set(ROPE_SCALING):
        raise ValueError(f"model.rope_scaling={scaling}: give exactly {', '.join(ROPE_SCALING)} (llama3 scaling), "
                         "or none")
    if not all(math.isfinite(v) and v > 0 for v in scaling.values()) or \
            scaling["low_freq_factor"] >= scaling["high_freq_factor"]:
        raise ValueError(f"model.rope_scaling={scaling}: every value must be finite and > 0, and low_freq_factor "
                         "below high_freq_factor")
    return {key: (int if key == "original_max_position_embeddings" else float)(scaling[key]) for key in ROPE_SCALING}


# Llama 3.1's, 3.2's and 3.3's RoPE scaling, as their config.json give it.
LLAMA31_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
LLAMA32_ROPE = {**LLAMA31_ROPE, "factor": 32.0}

PRESETS: dict[str, dict[str, Any]] = {
    "debug": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=512, ffn_dim_multiplier=1.0,
                  multiple_of=64, max_seq_len=1024, rope_theta=10000.0),
    # GPT-3 Small's width; 16 blocks, not its 12, make up for a smaller vocabulary and grouped-query attention:
    # 125.9M parameters.
    "125m": dict(dim=768, n_layers=16, n_heads=12, n_kv_heads=4, vocab_size=32768, ffn_dim_multiplier=1.0,
                 multiple_of=256, max_seq_len=2048, tie_embeddings=True),
    # Llama 3.2 1B and 3B.
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
               max_seq_len=131072, rope_scaling=LLAMA32_ROPE, tie_embeddings=True),
    "3b": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, multiple_of=256,
               max_seq_len=131072, rope_scaling=LLAMA32_ROPE, tie_embeddings=True),
    # Llama 3 8B and 70B; Llama 3.1's differ only in RoPE scaling and context.
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024),
    "70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096),
}
PRESETS.update({f"3.1-{name}": dict(PRESETS[name], max_seq_len=131072, rope_scaling=LLAMA31_ROPE)
                for name in ("8b", "70b")})


def rope_table(head_dim: int, max_seq_len: int, theta: float, scaling: Optional[dict] = None,
               device=None) -> torch.Tensor:
    """e^(i * pos * freq_k), freq_k = theta^(-2k/d) (scaled if `scaling`), complex64 [max_seq_len, head_dim // 2].

    Complex, so that it keeps its float32 precision inside the blocks: FSDP's mixed precision casts every
    floating-point forward argument to param_dtype, and bfloat16 cos/sin would be off by up to 2^-9."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling:
        freqs = _llama3_scaled(freqs, **scaling)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def _llama3_scaled(freqs: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                   original_max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1's RoPE scaling: wavelengths longer than the original context / low_freq_factor are stretched by
    `factor`, those shorter than it / high_freq_factor kept, the band between interpolated. Float32 ops in the order
    of Meta's and transformers' code, so that the angles at long positions agree to the bit."""
    wavelen = 2 * math.pi / freqs
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    scaled = torch.where(wavelen > original_max_position_embeddings / low_freq_factor, freqs / factor, freqs)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original_max_position_embeddings / high_freq_factor) & \
        (wavelen <= original_max_position_embeddings / low_freq_factor)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of x [batch, seq, heads, head_dim] (Meta's interleaved layout) in float32.

    Two formulations of one rotation. Eager, a complex multiply: three kernels each way, where the real-valued
    form takes about nine. Compiled, the real-valued form, which Inductor fuses into one kernel with the casts;
    it generates no code for a complex multiply."""
    if torch.compiler.is_compiling():
        return _rope_real(x, rope)
    return _rope_complex(x, rope)


def _rope_complex(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rope[: x.shape[1], None]).flatten(3).type_as(x)


def _rope_real(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    pairs = x.float().unflatten(-1, (-1, 2))
    rotation = torch.view_as_real(rope[: x.shape[1], None])
    cos, sin = rotation[..., 0], rotation[..., 1]
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rotated.flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class OutputProjection(nn.Linear):
    """The output projection. Given labels, it returns their mean cross-entropy instead of the logits, computed
    `loss_chunk_tokens` tokens at a time (0: all at once; `fsdp_trainer.loss`) inside this module's forward,
    where FSDP has its weight gathered."""

    def forward(self, hidden: torch.Tensor, labels: Optional[torch.Tensor] = None,
                loss_chunk_tokens: int = 0) -> torch.Tensor:
        if labels is None:
            return super().forward(hidden)
        return linear_cross_entropy(hidden, self.weight, labels, loss_chunk_tokens or labels.numel())


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = OutputProjection(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: derived from args, so checkpoints stay independent of max_seq_len.
        self.register_buffer("rope", rope_table(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling),
                             persistent=False)

    def forward(self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None,
                loss_chunk_tokens: int = 0) -> torch.Tensor:
        """The logits; or, given labels, their mean cross-entropy, computed without the full logits."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.output(self.norm(h), labels, loss_chunk_tokens)

    # -- initialization ----------------------------------------------------------------------------------
    def tie_weights(self) -> None:
        """Re-tie the output projection to the embedding (materializing from meta unties them)."""
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def init_buffers(self) -> None:
        a = self.args
        self.rope = rope_table(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling, device=self.rope.device)

    @torch.no_grad()
    def init_param(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Fill the full (unsharded) tensor of parameter `name`.

        Truncated normals (at 3 std): the embedding std 1, or 0.02 when tied to the output projection; the untied
        output projection dim**-0.5, so the first logits are about unit scale; projections into the residual stream
        (wo, w2) 0.02 scaled down by depth so the residual's variance does not grow with n_layers; other linears
        0.02. Norms 1."""
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
            return
        if name == "tok_embeddings.weight":
            std = 1.0 if not self.args.tie_embeddings else 0.02
        elif name == "output.weight":
            std = self.args.dim ** -0.5
        elif name.endswith(("wo.weight", "w2.weight")):
            std = 0.02 / math.sqrt(2 * self.args.n_layers)
        else:
            std = 0.02
        nn.init.trunc_normal_(tensor, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)


def build(args: ModelArgs, device: torch.device | str = "meta") -> Transformer:
    with torch.device(device):
        return Transformer(args)


def model_args_from_config(cfg) -> ModelArgs:
    """ModelArgs from a `config.ModelConfig`: the preset, then any fields set explicitly."""
    return ModelArgs.from_preset(cfg.name, **cfg.overrides())
