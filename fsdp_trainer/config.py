"""Every setting of a run: one dataclass per section, a TOML file for defaults, flags to override.

    python -m fsdp_trainer.train --config configs/llama3_8b.toml --train.steps 50 --ac.mode op

`--help` lists every flag with its docstring. `validate()` checks a config against the world it will run in
before anything is allocated, and every error names the field, the bad value and what would work.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
import tempfile
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

import tyro


class ConfigError(ValueError):
    """A setting that cannot work; the message names the field, the value and a fix."""


@dataclass
class ModelConfig:
    name: str = "debug"
    """Preset: debug, 125m, 1b, 3b, 8b, 70b (Llama 3 shapes). The fields below override single values of it."""
    dim: Optional[int] = None
    """Model width (None: the preset's)."""
    n_layers: Optional[int] = None
    """Number of transformer blocks (None: the preset's)."""
    n_heads: Optional[int] = None
    """Attention query heads (None: the preset's)."""
    n_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention; must divide n_heads (None: the preset's)."""
    vocab_size: Optional[int] = None
    """Vocabulary size; must exceed every token id in the data (None: the preset's)."""
    ffn_hidden_dim: Optional[int] = None
    """SwiGLU hidden width, exact (None: derived from ffn_dim_multiplier as Llama 3 does)."""
    ffn_dim_multiplier: Optional[float] = None
    """Multiplier on the default SwiGLU width 8*dim/3 before rounding (None: the preset's)."""
    max_seq_len: Optional[int] = None
    """Longest sequence the RoPE tables cover (None: the preset's)."""
    rope_theta: Optional[float] = None
    """RoPE base frequency (None: the preset's)."""
    tie_embeddings: Optional[bool] = None
    """Share the token embedding with the output projection (None: the preset's)."""

    def overrides(self) -> dict[str, Any]:
        """The fields set explicitly, as keyword arguments for `ModelArgs.from_preset`."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "name" and getattr(self, f.name) is not None}


# ac.mode's and parallel.reshard_after_forward's values, which parallelize.apply_ac and apply_fsdp take too.
ACMode = Literal["none", "full", "selective", "op"]
ReshardPolicy = Literal["default", "always", "never"]


@dataclass
class DataConfig:
    source: Literal["stdlib", "tokens", "synthetic"] = "stdlib"
    """stdlib: the Python standard library's source, byte-tokenized and cached (no download);
    tokens: pre-tokenized shards made by `python -m fsdp_trainer.tools.prepare`; synthetic: random tokens."""
    path: Optional[str] = None
    """Folder of token shards for source=tokens (and only for it: set with another source, it is refused)."""
    seed: int = 0
    """Seed of the data: for stdlib and tokens, of the sample order, a pure function of (seed, global sample
    index); for synthetic, of the random tokens themselves, each sample's a pure function of the same two."""
    cache_dir: str = "~/.cache/fsdp_trainer"
    """Where the stdlib corpus is tokenized to on first use."""
    num_workers: int = 1
    """Data-loader worker processes per rank (0 loads in the training process)."""


@dataclass
class TrainConfig:
    steps: int = 200
    """Optimizer steps to train for."""
    seq_len: int = 256
    """Tokens per sample; at most model.max_seq_len (for a team's own model, its max_seq_len attribute if any)."""
    micro_batch_size: int = 8
    """Samples per rank per forward/backward."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step. Global batch = micro_batch_size x grad_accum_steps x data-parallel ranks."""
    seed: int = 0
    """Seed of weight initialization (the same weights for any world size) and of torch's and Python's global RNGs
    on every rank (the Llama model draws nothing from them; checkpoints save and restore their state per rank)."""
    output_dir: str = "outputs"
    """Logs, TensorBoard events, the resolved config and checkpoints go here."""
    log_every: int = 10
    """Print and record metrics every N steps: on GPUs without CPU offload, the only steps (besides saves) on
    which the host waits for the GPU."""
    loss_chunk_tokens: int = 0
    """Compute the loss this many tokens at a time inside the output projection, so the whole sequence's logits
    never exist (0: one cross-entropy over all logits, compiled with the blocks under parallel.compile). At seq
    8192 with Llama 3's 128K vocabulary, 2048 cuts the peak by about 10 GiB per GPU in eager mode, where the
    cross-entropy holds float32 copies of the logits; compiled, by about 2 GiB."""
    deterministic: bool = False
    """Deterministic kernels and no autotuning, for chasing numerical differences (slower)."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A step whose loss or gradient norm is not finite is never applied; stop: end the run at the next logging
    step, naming it; skip: carry on, up to max_skipped_steps. Under float16 (parallel.param_dtype float16, or auto
    on GPUs without bfloat16) neither applies: the loss scaler skips such steps itself and lowers its scale, and
    the run stops at a logging step once the scale falls below 1."""
    max_skipped_steps: int = 10
    """With on_nonfinite=skip: stop once more steps than this were skipped."""
    gc_every: int = 50
    """Run Python's garbage collector every N steps, at the same step on every rank, instead of whenever its
    allocation counters say (0: automatic). An automatic collection stalls one rank at a random moment, and every
    other rank waits for it at the next collective."""


@dataclass
class OptimConfig:
    lr: float = 2e-3
    """Peak learning rate, applied by the last warmup step (the first step without warmup)."""
    min_lr: float = 2e-4
    """Learning rate at the end of the decay, applied by the last step (train.steps)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to norms or biases)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 20
    """Linear warmup from 0 to lr over this many steps (a run of fewer train.steps ends inside the warmup: it never
    reaches lr, and never decays)."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay from lr to min_lr after the peak, ending at train.steps."""
    grad_clip: float = 1.0
    """Clip gradients to this global L2 norm (0 disables clipping; the norm is still logged)."""


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    """Replica groups (HSDP's outer dimension): parameters are sharded within a group and replicated across groups."""
    dp_shard: int = -1
    """Ranks each parameter is sharded over; -1: all ranks not used by dp_replicate."""
    param_dtype: Literal["auto", "bfloat16", "float32", "float16"] = "auto"
    """Dtype of the unsharded parameters used in forward/backward. auto: bfloat16 on GPUs that have it,
    float16 (with loss scaling) on older GPUs, float32 on CPU. Sharded master weights and optimizer state stay float32."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype gradients are reduce-scattered in."""
    reshard_after_forward: ReshardPolicy = "default"
    """Free each module's gathered parameters after forward: default = all but the last to run (the last block, or
    the final norm and output projection where they are sharded apart from the embedding), whose backward starts at
    once; always; or never (faster, more memory)."""
    keep_gathered: int = 0
    """With reshard_after_forward=default, also keep the last N blocks' gathered parameters from forward through
    their backward: per block, one all-gather and its copies fewer per step, for one block's parameters in
    param_dtype more at the peak (Llama 3 8B: 0.41 GiB a block). On 4 H200s, all 32 blocks of the 8B made compiled
    per-op AC 1.9-2.3% faster (two sweeps) for 12.6 GiB more; `python -m fsdp_trainer.tools.plan` gives the memory for any N."""
    prefetch: int = 1
    """Blocks all-gathered ahead of the running one, in forward and backward. 1 is FSDP2's own schedule; 2 issues
    each all-gather a block earlier, which helps when the CPU cannot run far enough ahead of the GPU, for one more
    gathered block in memory."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory (CPUOffloadPolicy)."""
    offload_threads: int = 0
    """Threads each rank's AdamW step runs on in host memory under cpu_offload; 0: the rank's share of the cores it
    may use (its CPU affinity divided among the node's ranks). torchrun gives each of several ranks one thread,
    which streams about 20 GB/s; set 1 to keep that, where other work shares the host's cores."""
    compile: bool = False
    """torch.compile each block (after activation checkpointing, before sharding) and the loss. CUDA only."""
    defer_grad_sync: bool = False
    """With grad_accum_steps > 1, reduce-scatter gradients only after the last micro-batch: less communication,
    but every rank then holds unsharded gradients meanwhile."""
    grads_in_compute_pool: bool = True
    """Allocate the sharded gradients from the compute stream's memory, so that what zero_grad frees serves the next
    forward's activations; FSDP2 keeps them on its reduce-scatter stream, whose freed memory nothing else can use
    (4 bytes per local parameter of reserved memory beyond the peak). Applies where it is safe without extra
    synchronization: GPUs, FSDP without HSDP, float32 reduce_dtype, no CPU offload, and grad_accum_steps 1 or
    defer_grad_sync; elsewhere FSDP2's own allocation is used."""
    copy_engine_all_gather: bool = True
    """Run FSDP2's all-gathers on the GPUs' copy engines instead of NCCL kernels that take SMs from the compute: the
    all-gather outputs live in NCCL symmetric memory and NCCL's zero-CTA policy (NCCL_CTA_POLICY=2, unless set)
    copies them. The 8B on 4 H200s ran 1.9-2.4% faster in every AC mode, eager and compiled (0.6% at micro-batch
    2), for 0.885 GiB more reserved. Applies where every rank is on one host, with NCCL 2.28 or later (cuMem not
    turned off by NCCL_CUMEM_ENABLE=0) and dp_shard > 1; elsewhere FSDP2's own all-gather runs."""


@dataclass
class ACConfig:
    mode: ACMode = "none"
    """Activation checkpointing: none; full (every block recomputed); selective (every N-th block);
    op (per-op: keep matmul and attention outputs, recompute the rest)."""
    every: int = 2
    """For mode=selective: checkpoint every N-th block."""


@dataclass
class MetricsConfig:
    tensorboard: bool = True
    """Write TensorBoard scalars to <output_dir>/tb."""


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None
    """Checkpoint folder (None: <output_dir>/checkpoints)."""
    interval: int = 100
    """Save every N steps (0: only at the end and on preemption)."""
    interval_minutes: float = 0.0
    """Also save when this many minutes passed since the last save (0: off)."""
    keep: int = 3
    """Keep the newest k complete checkpoints; older ones are deleted after a newer one is complete."""
    async_mode: Literal["none", "async", "async_pinned"] = "async_pinned"
    """async_pinned: training waits only while the state is copied into host buffers allocated once after step 1
    and reused (pinned on GPUs; holds 12 bytes per parameter of each GPU's shard in host memory for the whole
    run, reported per node by the planner); async: the
    same into fresh pageable memory at every save (slower: 61 s blocked vs 0.95 s for 8B on 2 H200s); none:
    training waits for the whole write."""
    write_threads: int = 4
    """Files each rank writes in parallel per save (DCP's writer threads), and checks against their checksums in
    parallel on resume and init_from. Parallel and network file systems reward more concurrent writers; a single
    local disk is limited by its own bandwidth either way."""
    checksums: bool = True
    """Record the size and CRC32 of every data file of a save and of its .metadata (each rank sums its files as it
    writes them), and check them while resume or init_from reads the checkpoint, each rank its share of the files:
    a file changed on storage after the save is then an error naming it, where DCP alone would load it silently.
    Export checks them too, unless given --no-checksums."""
    resume: str = "auto"
    """auto: continue from the newest complete checkpoint in dir, if any; none: start fresh; or a checkpoint path
    (once this run has saved checkpoints of its own, the same command resumes the newest of those)."""
    init_from: Optional[str] = None
    """Start from these weights (a checkpoint path, or hf:<folder> for a Hugging Face Llama) with fresh
    optimizer and step count, for fine-tuning. Ignored when resuming."""
    allow_data_change: bool = False
    """Resume although the data differ from the checkpoint's (seed, token shards' names and sizes, or synthetic
    tokens instead of shards): training goes on
    at the saved sample count in the new data's order. Off: such a resume is an error, as data changed by
    mistake would skip or repeat samples."""
    save_final: bool = True
    """Save a checkpoint when training ends (benchmarks turn this off)."""


@dataclass
class MemoryConfig:
    limit_gib: Optional[float] = None
    """Cap each process's GPU memory at this many GiB (emulates a smaller card on a larger one)."""
    ignore_plan: bool = False
    """Start even when the memory planner predicts the run will not fit."""
    oom_snapshot: bool = False
    """Record allocator history and write a memory snapshot (for pytorch.org/memory_viz) on CUDA OOM."""


@dataclass
class DistConfig:
    init_timeout_s: float = 600.0
    """Until the first step has finished, the longest a rank may take to get there: the restore of a checkpoint
    (checkpoint.resume or init_from), compilation and the first step all count. Past it, the rank's watchdog names
    the ranks that are behind (one still restoring, say) and ends the job. Also the process group's timeout while it
    starts; the collectives' own timeout is then set 60 s later, as a backstop."""
    timeout_s: float = 120.0
    """After the first step, the longest a rank may take to finish its next one (a checkpoint save or a profile's
    writing does not count): past it, the rank's watchdog names the ranks that are behind and ends the job, so a
    dead or stuck rank stops it this quickly. The collectives' own timeout is set 60 s later, as a backstop."""
    flight_recorder: bool = True
    """Keep NCCL's flight recorder on and dump its trace to <output_dir>/flight_recorder on a timeout."""


@dataclass
class ProfileConfig:
    steps: Optional[str] = None
    """Record a torch.profiler trace of steps a to b (inclusive), e.g. 10:12, into <output_dir>/profile."""
    memory_snapshot: bool = False
    """Also record a CUDA memory snapshot of those steps (for pytorch.org/memory_viz)."""


@dataclass
class Config:
    """Train a Llama-style model with FSDP2 (one TOML file for defaults, flags to override)."""

    config: Optional[Path] = None
    """TOML file whose values become the defaults for every flag below."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    ac: ACConfig = field(default_factory=ACConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def __post_init__(self):
        # One expansion for every path, wherever it was set: no shell expands ~ in a TOML file.
        for section, name in PATH_FIELDS:
            value = getattr(getattr(self, section), name)
            if value is not None:
                setattr(getattr(self, section), name, os.path.expanduser(value))

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(dataclasses.asdict(self))


PATH_FIELDS = (("data", "path"), ("data", "cache_dir"), ("train", "output_dir"), ("checkpoint", "dir"),
               ("checkpoint", "resume"), ("checkpoint", "init_from"))
"""(section, field) of every setting that is a file system path, in which ~ means the home folder."""


def _to_plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (tuple, list)):
        return [_to_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def from_dict(raw: dict[str, Any], source: str = "config") -> Config:
    """Build a Config from nested dicts (a parsed TOML file), rejecting unknown keys by name."""
    if "config" in raw:  # a field for the flag alone: read from a file, it would be ignored, not included
        raise ConfigError(f"{source}: 'config' is the --config flag, not a key of the file (one file cannot "
                          "include another); remove it, and give the settings you wanted from that file here")
    return _build(Config, raw, source, prefix="")


def _build(cls: type, raw: dict[str, Any], source: str, prefix: str):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(fields)}"
            raise ConfigError(f"{source}: unknown key '{prefix}{key}'{hint}")
        sub = _section_type(cls, key)
        if sub is not None:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: '{prefix}{key}' must be a [{prefix}{key}] table")
            value = _build(sub, value, source, prefix=f"{prefix}{key}.")
        else:
            value = _checked(value, typing.get_type_hints(cls)[key], f"{source}: {prefix}{key}")
        kwargs[key] = value
    return cls(**kwargs)


def _checked(value: Any, annotation: Any, where: str) -> Any:
    """A TOML value checked against its field's type (the CLI gets the same checks from tyro)."""
    options = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin is Literal:
        if value not in options:
            raise ConfigError(f"{where} = {value!r} is not one of {', '.join(map(repr, options))}")
        return value
    if origin is typing.Union:  # Optional[X]
        return _checked(value, next(t for t in options if t is not type(None)), where)
    if origin is tuple:
        if not isinstance(value, list) or len(value) != len(options):
            raise ConfigError(f"{where} = {value!r}: expected a list of {len(options)} numbers")
        return tuple(_checked(v, t, where) for v, t in zip(value, options))
    expected = {float: (int, float), int: int, bool: bool, str: str, Path: str}.get(annotation)
    if expected and (not isinstance(value, expected) or (annotation is not bool and isinstance(value, bool))):
        raise ConfigError(f"{where} = {value!r}: expected {annotation.__name__}")
    return float(value) if annotation is float else Path(value) if annotation is Path else value


def _section_type(cls: type, name: str) -> Optional[type]:
    default_factory = next(f for f in dataclasses.fields(cls) if f.name == name).default_factory
    if default_factory is dataclasses.MISSING:
        return None
    return default_factory if dataclasses.is_dataclass(default_factory) else None


def load_toml(path: str | Path) -> Config:
    path = Path(path).expanduser()  # no shell expands ~ in --config=~/run.toml
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"--config {path}: not valid TOML ({err})") from None
    return from_dict(raw, source=str(path))


def _config_path(argv: Sequence[str]) -> Optional[str]:
    """The last --config given: argparse, and so tyro, keeps the last value of a repeated flag."""
    path = None
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
    return path


def parse_args(argv: Optional[Sequence[str]] = None, cls: type = Config,
               description: Optional[str] = None, prog: str = "python -m fsdp_trainer.train"):
    """Command line -> config: `--config file.toml` supplies defaults, the other flags override them.

    `cls` may be any dataclass that embeds Config's fields (tools such as the planner add their own flags).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    default = cls()
    path = _config_path(argv)
    if path is not None:
        from_file = load_toml(path)
        for f in dataclasses.fields(Config):
            setattr(default, f.name, getattr(from_file, f.name))
        default.config = Path(path)
    return tyro.cli(cls, args=argv, default=default, use_underscores=True, description=description, prog=prog)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML, loadable again with --config (fields left at None are omitted)."""
    lines = []
    for section, values in cfg.to_dict().items():
        if not isinstance(values, dict):
            continue
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def mesh_shape(parallel: ParallelConfig, world_size: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for this world size, with dp_shard=-1 resolved."""
    rep, shard = parallel.dp_replicate, parallel.dp_shard
    if rep < 1:
        raise ConfigError(f"parallel.dp_replicate={rep}: must be at least 1")
    if world_size % rep:
        raise ConfigError(f"parallel.dp_replicate={rep} does not divide the {world_size} ranks of this job; "
                          f"use a divisor of {world_size}")
    if shard == -1:
        shard = world_size // rep
    if shard < 1:
        raise ConfigError(f"parallel.dp_shard={shard}: must be at least 1, or -1 for all remaining ranks")
    if rep * shard != world_size:
        raise ConfigError(f"parallel.dp_replicate x parallel.dp_shard = {rep} x {shard} = {rep * shard}, but this "
                          f"job has {world_size} ranks; set parallel.dp_shard=-1 to use all of them")
    return rep, shard


def resolve_param_dtype(name: str, device_type: str) -> str:
    """'auto' -> bfloat16 on GPUs that support it, float16 on older GPUs, float32 on CPU."""
    if name != "auto":
        return name
    if device_type != "cuda":
        return "float32"
    import torch
    # Without the flag, V100 and T4 report bfloat16 as supported: emulated, and slower than float16.
    return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"


def block_ac_modes(n_blocks: int, mode: str, every: int) -> list[str]:
    """How each block runs under ac.mode: "checkpointed" (whole), "op" (per-op) or "none". Selective checkpoints
    blocks every, 2*every, ... (1-based). What `parallelize.apply_ac` wraps and the planner prices."""
    if mode == "selective":
        return ["checkpointed" if (i + 1) % every == 0 else "none" for i in range(n_blocks)]
    return [{"none": "none", "op": "op", "full": "checkpointed"}[mode]] * n_blocks


def grads_in_compute_pool(parallel: ParallelConfig, grad_accum_steps: int) -> bool:
    """Whether parallel.grads_in_compute_pool applies to this run (see `parallelize.ComputePoolReduceScatter`):
    each sharded gradient must be the reduce-scatter's output itself, written once per zero_grad."""
    p = parallel
    return (p.grads_in_compute_pool and p.dp_replicate == 1 and p.reduce_dtype == "float32" and not p.cpu_offload
            and (grad_accum_steps == 1 or p.defer_grad_sync))


def validate(cfg: Config, world_size: int, device_type: str, own_model: bool = False) -> None:
    """Check every setting against the job it will run in; raise ConfigError naming field, value and fix.
    `own_model`: a team's own model is trained (train.main's model_fn), not the Llama of model.*: its context and
    blocks are checked once it is built (train.check_own_model), not the preset's."""
    from fsdp_trainer.models.llama import model_args_from_config

    # No float setting means anything at inf or nan (a timeout of inf overflows torch's timedelta, a nan passes
    # every comparison below), and the flags and TOML both accept them.
    for name, value in _float_settings(cfg):
        if not all(math.isfinite(v) for v in (value if isinstance(value, tuple) else (value,))):
            raise ConfigError(f"{name}={value}: must be finite; inf and nan mean nothing here, set a number")
    try:
        args = model_args_from_config(cfg.model)
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from None
    mesh_shape(cfg.parallel, world_size)
    t = cfg.train
    for name in ("steps", "seq_len", "micro_batch_size", "grad_accum_steps", "log_every"):
        if getattr(t, name) < 1:
            raise ConfigError(f"train.{name}={getattr(t, name)}: must be at least 1")
    if not own_model:
        if t.seq_len > args.max_seq_len:
            raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={args.max_seq_len} of preset "
                              f"'{cfg.model.name}'; lower train.seq_len or raise model.max_seq_len")
        check_block_counts(cfg, args.n_layers)
    if not 0 <= t.seed < 2 ** 44:  # each parameter's generator is seeded with seed x 1,000,003 + crc32(its name)
        raise ConfigError(f"train.seed={t.seed}: must be between 0 and 2**44 - 1")
    o = cfg.optim
    if o.lr <= 0:
        raise ConfigError(f"optim.lr={o.lr}: must be > 0")
    if o.schedule != "constant" and not 0 <= o.min_lr <= o.lr:  # a constant schedule never decays to min_lr
        raise ConfigError(f"optim.lr={o.lr}, optim.min_lr={o.min_lr}: the {o.schedule} decay needs "
                          "0 <= min_lr <= lr")
    if o.warmup_steps < 0 or o.grad_clip < 0 or o.weight_decay < 0:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps}, optim.grad_clip={o.grad_clip}, optim.weight_decay="
                          f"{o.weight_decay}: each must be >= 0")
    if o.eps <= 0:
        raise ConfigError(f"optim.eps={o.eps}: must be > 0 (AdamW divides by sqrt(exp_avg_sq) + eps, which is 0 for "
                          "a parameter that has had only zero gradients, such as the embedding of an unseen token)")
    if not all(0 <= beta < 1 for beta in o.betas):
        raise ConfigError(f"optim.betas={tuple(o.betas)}: each must be in [0, 1)")
    if t.max_skipped_steps < 0:
        raise ConfigError(f"train.max_skipped_steps={t.max_skipped_steps}: must be >= 0")
    if cfg.memory.limit_gib is not None and cfg.memory.limit_gib <= 0:
        raise ConfigError(f"memory.limit_gib={cfg.memory.limit_gib}: must be > 0 GiB (or unset for the whole GPU)")
    if cfg.dist.timeout_s < 1 or cfg.dist.init_timeout_s < 1:
        raise ConfigError(f"dist.timeout_s={cfg.dist.timeout_s}, dist.init_timeout_s={cfg.dist.init_timeout_s}: "
                          "both must be at least 1 second")
    for name in ("loss_chunk_tokens", "gc_every"):
        if getattr(t, name) < 0:
            raise ConfigError(f"train.{name}={getattr(t, name)}: must be >= 0 (0 turns it off)")
    if cfg.parallel.keep_gathered and cfg.parallel.reshard_after_forward != "default":
        raise ConfigError(f"parallel.keep_gathered={cfg.parallel.keep_gathered} adds blocks to what "
                          "reshard_after_forward=default keeps, but reshard_after_forward="
                          f"{cfg.parallel.reshard_after_forward}; set one or the other")
    if cfg.parallel.prefetch < 1:
        raise ConfigError(f"parallel.prefetch={cfg.parallel.prefetch}: must be at least 1 (FSDP2's own schedule)")
    if cfg.ac.every < 1:
        raise ConfigError(f"ac.every={cfg.ac.every}: must be at least 1")
    if cfg.data.path is not None and cfg.data.source != "tokens":  # else a run meant for that data trains on other
        raise ConfigError(f"data.path={cfg.data.path} is set, but data.source={cfg.data.source} does not read it: "
                          "add --data.source tokens, or unset data.path")
    if cfg.data.num_workers < 0:
        raise ConfigError(f"data.num_workers={cfg.data.num_workers}: must be >= 0")
    if cfg.parallel.offload_threads < 0:
        raise ConfigError(f"parallel.offload_threads={cfg.parallel.offload_threads}: must be >= 0 (0: this rank's "
                          "share of the host's cores)")
    if cfg.checkpoint.keep < 1 or cfg.checkpoint.write_threads < 1:
        raise ConfigError(f"checkpoint.keep={cfg.checkpoint.keep} and checkpoint.write_threads="
                          f"{cfg.checkpoint.write_threads}: both must be >= 1")
    if cfg.checkpoint.interval < 0 or cfg.checkpoint.interval_minutes < 0:
        raise ConfigError("checkpoint.interval and checkpoint.interval_minutes must be >= 0 (0 turns them off)")
    if cfg.profile.memory_snapshot and not cfg.profile.steps:
        raise ConfigError("profile.memory_snapshot records the steps of profile.steps, which is not set; add "
                          "--profile.steps a:b (e.g. 10:12)")
    if cfg.profile.steps:
        try:
            first, last = parse_steps(cfg.profile.steps)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if last > t.steps:
            raise ConfigError(f"profile.steps={cfg.profile.steps} ends after train.steps={t.steps}, so the trace "
                              "would never be written; profile earlier steps or train longer")
    if device_type != "cuda":
        gpu_only = {"parallel.param_dtype=float16": cfg.parallel.param_dtype == "float16",
                    "parallel.cpu_offload": cfg.parallel.cpu_offload,
                    "parallel.compile": cfg.parallel.compile,
                    "memory.limit_gib": cfg.memory.limit_gib is not None,
                    "memory.oom_snapshot": cfg.memory.oom_snapshot,
                    "profile.memory_snapshot": cfg.profile.memory_snapshot}
        for name, is_set in gpu_only.items():
            if is_set:
                raise ConfigError(f"{name} needs a CUDA GPU, and this job runs on CPU; remove it "
                                  "(or run on a machine with GPUs)")


def check_block_counts(cfg: Config, n_blocks: int) -> None:
    """The settings that count a model's blocks, against the n_blocks it has."""
    if not 0 <= cfg.parallel.keep_gathered <= n_blocks:
        raise ConfigError(f"parallel.keep_gathered={cfg.parallel.keep_gathered}: must be between 0 and the model's "
                          f"{n_blocks} blocks (reshard_after_forward=never keeps every group)")
    if cfg.ac.mode == "selective" and cfg.ac.every > n_blocks:
        raise ConfigError(f"ac.every={cfg.ac.every} with ac.mode=selective checkpoints every {cfg.ac.every}th block, "
                          f"and the model has {n_blocks}: none would be; lower ac.every, or set ac.mode=none")


def _float_settings(cfg: Config):
    """(section.field, value) of every setting that is a float or a tuple of them (optim.betas), and is set."""
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        if dataclasses.is_dataclass(values):
            for f in dataclasses.fields(values):
                value = getattr(values, f.name)
                if isinstance(value, float) or (isinstance(value, tuple) and isinstance(value[0], float)):
                    yield f"{section.name}.{f.name}", value


def checkpoint_root(cfg: Config) -> Path:
    """The folder the run's checkpoints go to: checkpoint.dir, else <train.output_dir>/checkpoints."""
    return Path(cfg.checkpoint.dir or Path(cfg.train.output_dir) / "checkpoints")


def check_output_dirs(cfg: Config) -> None:
    """Create train.output_dir and the checkpoint folder (every run saves there on a stop signal), and write a file
    in each: a folder that cannot hold them fails here, before any process group or GPU memory, instead of at the
    first save after hours of training. Every rank of every node may run this at once on a shared file system:
    folders are created if missing, and each test file has a unique name and is removed at once."""
    folders = {"train.output_dir": Path(cfg.train.output_dir),
               "checkpoint.dir" if cfg.checkpoint.dir else "checkpoint.dir (unset: <train.output_dir>/checkpoints)":
               checkpoint_root(cfg)}
    for name, folder in folders.items():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=folder, prefix=".write_test."):  # deleted on closing
                pass
        except OSError as err:
            reason = "a file is in the way" if isinstance(err, (FileExistsError, NotADirectoryError)) else err.strerror
            raise ConfigError(f"{name}: cannot create or write the folder {folder} ({reason}); choose a folder "
                              "this user can write on every node") from None


def parse_steps(spec: str) -> tuple[int, int]:
    """'a:b' -> (a, b), the first and last step to record (1-based, inclusive)."""
    try:
        first, last = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"profile.steps={spec!r}: expected 'a:b', e.g. 10:12") from None
    if not 1 <= first <= last:
        raise ValueError(f"profile.steps={spec!r}: need 1 <= a <= b")
    return first, last
