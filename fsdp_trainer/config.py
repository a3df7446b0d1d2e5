"""Every setting of a run: dataclasses (`--help` shows their docstrings), TOML defaults, flags, validation."""

import argparse
import dataclasses
import difflib
import json
import math
import os
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NoReturn, Optional, Sequence, Union, get_args, get_origin, get_type_hints

import tyro

from fsdp_trainer.models.llama import model_args_from_config


class ConfigError(ValueError):
    """A setting that cannot work; the message names the field, the value and a fix."""


def exit_with_error(message: str, show: bool) -> NoReturn:
    """Exit with status 2 (bad input, not a crash), printing the message where `show`."""
    if show:
        print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


@dataclass
class ModelConfig:
    name: str = "debug"
    """Preset: debug, 125m; 1b, 3b (Llama 3.2); 8b, 70b (Llama 3); 3.1-8b, 3.1-70b. The fields below override
    single values of it; checkpoint.init_from=hf:<folder> sets them all from its config.json."""
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
    rope_scaling: Optional[dict[str, float]] = None
    """Llama 3.1's RoPE scaling: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings, e.g.
    `factor 8 low_freq_factor 1 high_freq_factor 4 original_max_position_embeddings 8192`; none if empty."""
    norm_eps: Optional[float] = None
    """RMSNorm's epsilon (None: the preset's)."""
    tie_embeddings: Optional[bool] = None
    """Share the token embedding with the output projection (None: the preset's)."""

    def overrides(self) -> dict[str, Any]:
        """The fields set explicitly, as keyword arguments for `ModelArgs.from_preset`."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "name" and getattr(self, f.name) is not None}


@dataclass
class DataConfig:
    source: Literal["stdlib", "tokens", "synthetic"] = "stdlib"
    """stdlib: Python's own source, byte-tokenized; tokens: shards of `python -m fsdp_trainer.tools.prepare`."""
    path: Optional[str] = None
    """Folder of token shards for source=tokens (refused with any other source)."""
    eval_path: Optional[str] = None
    """Held-out token shards for source=tokens (None: <data.path>/val, which prepare --holdout writes)."""
    seed: int = 0
    """Seed of the sample order (or of synthetic tokens): the same samples in the same order for any world size."""
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
    """Seed of weight init (the same weights for any world size) and of every rank's torch and Python RNGs."""
    output_dir: str = "outputs"
    """Logs, TensorBoard events, the resolved config and checkpoints go here."""
    log_every: int = 10
    """Print and record metrics every N steps: besides saves, the only steps on which the host waits for the GPU."""
    loss_chunk_tokens: int = 0
    """Compute the loss this many tokens at a time, so that the whole sequence's logits never exist (0: all at once)."""
    deterministic: bool = False
    """Deterministic kernels and no autotuning, for chasing numerical differences (slower)."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A step with a non-finite loss or grad norm is never applied; stop: end the run; skip: go on, up to a limit."""
    max_skipped_steps: int = 10
    """With on_nonfinite=skip: stop once more steps than this were skipped."""
    gc_every: int = 50
    """Collect garbage every N steps on every rank at once (0: when Python decides, stalling the other ranks)."""


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
    """Linear warmup from 0 to lr over this many steps (a run of fewer train.steps never reaches lr)."""
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
    """Dtype of the gathered parameters (auto: bfloat16, or float16 with loss scaling on older GPUs, float32 on CPU)."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype gradients are reduce-scattered in."""
    reshard_after_forward: Literal["default", "always", "never"] = "default"
    """Free gathered parameters after forward: default (all but the last module to run), always, never (more memory)."""
    keep_gathered: int = 0
    """With reshard_after_forward=default, also keep the last N blocks gathered from forward through backward."""
    prefetch: int = 1
    """Blocks all-gathered ahead of the running one (1: FSDP2's schedule; 2 helps a CPU-bound run, for more memory)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory (CPUOffloadPolicy)."""
    offload_threads: int = 0
    """Threads of each rank's AdamW step under cpu_offload (0: the rank's share of the cores its affinity allows)."""
    compile: bool = False
    """torch.compile each block (after activation checkpointing, before sharding) and the loss. CUDA only."""
    defer_grad_sync: bool = False
    """With grad_accum_steps > 1, reduce-scatter only after the last micro-batch (holding unsharded gradients)."""
    grads_in_compute_pool: bool = True
    """Allocate sharded gradients from the compute stream's memory, for the next forward to reuse (where it is safe)."""
    copy_engine_all_gather: bool = True
    """All-gather on the GPUs' copy engines, sparing the SMs (one host, dp_shard > 1, NCCL >= 2.28, cuMem on)."""


@dataclass
class ACConfig:
    mode: Literal["none", "full", "selective", "op"] = "none"
    """Activation checkpointing: none; full; selective (every N-th block); op (recompute all but matmuls, attention)."""
    every: int = 2
    """For mode=selective: checkpoint every N-th block."""


@dataclass
class EvalConfig:
    every: int = 50
    """Evaluate the held-out loss every N steps (0: never)."""
    samples: int = 128
    """Held-out samples per evaluation, the same set on any number of ranks (0: the whole held-out split)."""
    micro_batch_size: int = 0
    """Samples per rank per forward pass of an evaluation (0: train.micro_batch_size)."""
    at_end: bool = True
    """Also evaluate after the last step when train.steps is not a multiple of eval.every."""


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
    """What a save blocks for: async_pinned, a copy into pinned host buffers kept; async, into fresh ones; none, all."""
    write_threads: int = 4
    """Files each rank writes, and checks on restore, in parallel (parallel file systems reward more)."""
    checksums: bool = True
    """Record each saved file's size and CRC32 and check them on restore: a file changed since is an error naming it."""
    resume: str = "auto"
    """auto: the newest complete checkpoint in dir, if any; none: start fresh; or a path (until this run has saved)."""
    init_from: Optional[str] = None
    """Fine-tune from these weights (a checkpoint, or hf:<folder>) with a fresh optimizer and step (not on resume)."""
    allow_data_change: bool = False
    """Resume although the data differ from the checkpoint's (off: refused, lest samples be skipped or repeated)."""
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
    """Longest a rank may take to its first step, restore and compilation included, before the watchdog ends the job."""
    timeout_s: float = 120.0
    """Longest a rank may take for each later step (saves excepted) before the watchdog names it and ends the job."""
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
    eval: EvalConfig = field(default_factory=EvalConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def __post_init__(self):  # one expansion of ~ in every path, wherever it was set: no shell expands a TOML file
        for section, name in PATH_FIELDS:
            values = getattr(self, section)
            setattr(values, name, getattr(values, name) and os.path.expanduser(getattr(values, name)))


PATH_FIELDS = (("data", "path"), ("data", "eval_path"), ("data", "cache_dir"), ("train", "output_dir"),
               ("checkpoint", "dir"), ("checkpoint", "resume"), ("checkpoint", "init_from"))


def from_dict(raw: dict[str, Any], source: str = "config", cls: type = Config, prefix: str = "") -> Config:
    """A Config (or a section of it) from nested dicts, a parsed TOML file, rejecting unknown keys by name."""
    types = {name: hint for name, hint in get_type_hints(cls).items() if name != "config"}  # --config's alone
    for key in raw:
        if key not in types:
            close = difflib.get_close_matches(key, types, n=1)
            hint = f"did you mean '{prefix}{close[0]}'?" if close else f"valid keys: {', '.join(types)}"
            raise ConfigError(f"{source}: unknown key '{prefix}{key}'; {hint}")
    return cls(**{key: _checked(value, types[key], source, prefix + key) for key, value in raw.items()})


def _checked(value: Any, annotation: Any, source: str, name: str) -> Any:
    """A TOML value checked against its field's type (the CLI gets the same checks from tyro)."""
    options, origin = get_args(annotation), get_origin(annotation)
    if origin is Union:  # Optional[X]
        return _checked(value, options[0], source, name)
    if dataclasses.is_dataclass(annotation) and isinstance(value, dict):  # a section
        return from_dict(value, source, annotation, prefix=f"{name}.")
    if origin is Literal and value in options:
        return value
    if origin is dict and isinstance(value, dict):
        return {key: _checked(v, options[1], source, f"{name}.{key}") for key, v in value.items()}
    if origin is tuple and isinstance(value, list) and len(value) == len(options):
        return tuple(_checked(v, t, source, name) for v, t in zip(value, options))
    scalar = {float: (int, float), int: int, bool: bool, str: str}.get(annotation)
    if scalar and isinstance(value, scalar) and (annotation is bool or not isinstance(value, bool)):
        return float(value) if annotation is float else value
    expected = {Literal: f"one of {', '.join(map(repr, options))}", dict: "a table, such as {factor = 8.0}",
                tuple: f"a list of {len(options)} numbers"}.get(origin, getattr(annotation, "__name__", annotation))
    if dataclasses.is_dataclass(annotation):
        expected = f"a [{name}] table"
    raise ConfigError(f"{source}: {name} = {value!r}: expected {expected}")


def load_toml(path: str | Path) -> Config:
    path = Path(path).expanduser()  # no shell expands ~ in --config=~/run.toml
    try:
        return from_dict(tomllib.loads(path.read_text()), source=str(path))
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"--config {path}: not a readable TOML file ({getattr(err, 'strerror', err)})") from None


def parse_args(argv: Optional[Sequence[str]] = None, cls: type = Config,
               description: Optional[str] = None, prog: str = "python -m fsdp_trainer.train"):
    """Command line -> config: `--config file.toml` supplies defaults, the other flags override them. `cls` may be
    any dataclass that embeds Config's fields (tools such as the planner add their own flags)."""
    argv, default = list(sys.argv[1:] if argv is None else argv), cls()
    config_flag = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    config_flag.add_argument("--config")
    path = config_flag.parse_known_args(argv)[0].config  # the last one, as tyro reads every repeated flag
    if path is not None:
        vars(default).update(vars(load_toml(path)), config=Path(path))
    return tyro.cli(cls, args=argv, default=default, use_underscores=True, description=description, prog=prog)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML, loadable again with --config (settings left at None are omitted)."""
    return "\n".join(f"[{section}]\n" + "".join(f"{key} = {_toml(value)}\n" for key, value in values.items()
                                               if value is not None)
                     for section, values in dataclasses.asdict(cfg).items() if isinstance(values, dict))


def _toml(value: Any) -> str:
    """A value as TOML: JSON's form, which is TOML's too, but for a table: {key = value, ...}."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {_toml(v)}" for key, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


def model_flag(name: str, value: Any) -> str:
    """The --model flag that sets model.<name> to `value`."""
    if name == "rope_scaling":  # a dict, or none (given as an empty one)
        return " ".join([f"--model.{name}", *(f"{k} {v}" for k, v in (value or {}).items())])
    return f"--model.{name} {value}"


def mesh_shape(parallel: ParallelConfig, world_size: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for this world size, with dp_shard=-1 resolved."""
    rep = parallel.dp_replicate
    shard = world_size // rep if parallel.dp_shard == -1 else parallel.dp_shard
    if rep * shard != world_size:
        raise ConfigError(f"parallel.dp_replicate x parallel.dp_shard = {rep} x {shard} = {rep * shard}, but this job "
                          f"has {world_size} ranks; set dp_shard=-1 (the rest) and a dp_replicate that divides it")
    return rep, shard


def resolve_param_dtype(name: str, device_type: str) -> str:
    """'auto' -> bfloat16 on GPUs that have it (not emulated, as on V100 and T4), float16 on others, float32 on CPU."""
    if name != "auto" or device_type != "cuda":
        return "float32" if name == "auto" else name
    import torch
    return "bfloat16" if torch.cuda.is_bf16_supported(including_emulation=False) else "float16"


def grads_in_compute_pool(p: ParallelConfig, grad_accum_steps: int) -> bool:
    """Whether it applies: each sharded gradient must be the reduce-scatter's output, written once per zero_grad."""
    return (p.grads_in_compute_pool and p.dp_replicate == 1 and p.reduce_dtype == "float32" and not p.cpu_offload
            and (grad_accum_steps == 1 or p.defer_grad_sync))


_AT_LEAST = {"train.steps": 1, "train.seq_len": 1, "train.micro_batch_size": 1, "train.grad_accum_steps": 1,
             "train.log_every": 1, "train.loss_chunk_tokens": 0, "train.gc_every": 0, "train.max_skipped_steps": 0,
             "optim.min_lr": 0, "optim.warmup_steps": 0, "optim.grad_clip": 0, "parallel.dp_replicate": 1,
             "parallel.prefetch": 1, "parallel.offload_threads": 0, "ac.every": 1, "checkpoint.interval": 0,
             "checkpoint.interval_minutes": 0, "checkpoint.keep": 1, "checkpoint.write_threads": 1, "dist.timeout_s": 1,
             "dist.init_timeout_s": 1, "eval.every": 0, "eval.samples": 0, "eval.micro_batch_size": 0}


def validate(cfg: Config, world_size: int, device_type: str, own_model: bool = False) -> None:
    """Check every setting against the job it will run in (own_model: a team's, checked by tools.model_checks)."""
    settings = {f"{section.name}.{f.name}": getattr(getattr(cfg, section.name), f.name)
                for section in dataclasses.fields(cfg) if dataclasses.is_dataclass(section.default_factory)
                for f in dataclasses.fields(section.default_factory)}
    for name, value in settings.items():  # the flags and TOML accept inf and nan, which pass every comparison below
        if any(isinstance(v, float) and not math.isfinite(v) for v in (value if isinstance(value, tuple) else [value])):
            raise ConfigError(f"{name}={value}: must be finite; inf and nan mean nothing here, set a number")
    for name, least in _AT_LEAST.items():  # the least value that means something (0, where allowed, is off)
        if settings[name] < least:
            raise ConfigError(f"{name}={settings[name]}: must be at least {least}")
    for name in ("optim.lr", "optim.eps", "memory.limit_gib"):  # the schedule divides by lr, AdamW by eps
        if settings[name] is not None and settings[name] <= 0:
            raise ConfigError(f"{name}={settings[name]}: must be > 0")
    try:
        args = model_args_from_config(cfg.model)
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from None
    mesh_shape(cfg.parallel, world_size)
    t, o, p = cfg.train, cfg.optim, cfg.parallel
    if not own_model:
        if t.seq_len > args.max_seq_len:
            raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={args.max_seq_len} of preset "
                              f"'{cfg.model.name}'; lower train.seq_len or raise model.max_seq_len")
        check_block_counts(cfg, args.n_layers)
    if not 0 <= t.seed < 2 ** 44:  # each parameter's generator is seeded with seed x 1,000,003 + crc32(its name)
        raise ConfigError(f"train.seed={t.seed}: must be between 0 and 2**44 - 1")
    if o.schedule != "constant" and o.min_lr > o.lr:  # a constant schedule never decays to min_lr
        raise ConfigError(f"optim.lr={o.lr}, optim.min_lr={o.min_lr}: the {o.schedule} decay needs min_lr <= lr")
    if p.keep_gathered and p.reshard_after_forward != "default":
        raise ConfigError(f"parallel.keep_gathered={p.keep_gathered} adds blocks to what reshard_after_forward="
                          f"default keeps, but reshard_after_forward={p.reshard_after_forward}; set one or the other")
    for name in ("path", "eval_path"):  # else a run meant for that data trains on other data
        if settings[f"data.{name}"] is not None and cfg.data.source != "tokens":
            raise ConfigError(f"data.{name}={settings[f'data.{name}']} is set, but data.source={cfg.data.source} "
                              f"does not read it: add --data.source tokens, or unset data.{name}")
    if cfg.eval.samples == 0 and cfg.data.source == "synthetic":
        raise ConfigError("eval.samples=0 evaluates the whole held-out split, and synthetic data has no end: set "
                          "--eval.samples to a number")
    if cfg.profile.memory_snapshot and not cfg.profile.steps:
        raise ConfigError("profile.memory_snapshot records the steps of profile.steps, which is not set; add "
                          "--profile.steps a:b (e.g. 10:12)")
    if cfg.profile.steps and parse_steps(cfg.profile.steps)[1] > t.steps:
        raise ConfigError(f"profile.steps={cfg.profile.steps} ends after train.steps={t.steps}, so the trace would "
                          "never be written; profile earlier steps or train longer")
    gpu_only = [name for name in ("parallel.cpu_offload", "parallel.compile", "memory.limit_gib", "memory.oom_snapshot",
                                  "profile.memory_snapshot") if settings[name] not in (None, False)]
    gpu_only += ["parallel.param_dtype=float16"] if p.param_dtype == "float16" else []
    if gpu_only and device_type != "cuda":
        raise ConfigError(f"{gpu_only[0]} needs a CUDA GPU, and this job runs on CPU; remove it (or run on GPUs)")


def check_block_counts(cfg: Config, n_blocks: int) -> None:
    """The settings that count a model's blocks, against the n_blocks it has."""
    if not 0 <= cfg.parallel.keep_gathered <= n_blocks:
        raise ConfigError(f"parallel.keep_gathered={cfg.parallel.keep_gathered}: must be between 0 and the model's "
                          f"{n_blocks} blocks (reshard_after_forward=never keeps every group)")
    if cfg.ac.mode == "selective" and cfg.ac.every > n_blocks:
        raise ConfigError(f"ac.every={cfg.ac.every} with ac.mode=selective checkpoints every {cfg.ac.every}th block, "
                          f"and the model has {n_blocks}: none would be; lower ac.every, or set ac.mode=none")


def checkpoint_root(cfg: Config) -> Path:
    """The folder the run's checkpoints go to: checkpoint.dir, else <train.output_dir>/checkpoints."""
    return Path(cfg.checkpoint.dir or Path(cfg.train.output_dir) / "checkpoints")


def check_output_dirs(cfg: Config) -> None:
    """Create the output and checkpoint folders and write a file in each, so that an unwritable one fails now."""
    for name, folder in (("train.output_dir", Path(cfg.train.output_dir)), ("checkpoint.dir", checkpoint_root(cfg))):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tempfile.NamedTemporaryFile(dir=folder, prefix=".write_test.").close()  # a unique name: every rank may
        except OSError as err:
            reason = "a file is in the way" if isinstance(err, (FileExistsError, NotADirectoryError)) else err.strerror
            raise ConfigError(f"{name}: cannot create or write the folder {folder} ({reason}); choose a folder "
                              "this user can write on every node") from None


def parse_steps(spec: str) -> tuple[int, int]:
    """'a:b' -> (a, b), the first and last step to record (1-based, inclusive)."""
    first, _, last = spec.partition(":")
    if not (first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        raise ConfigError(f"profile.steps={spec!r}: expected 'a:b' with 1 <= a <= b, e.g. 10:12")
    return int(first), int(last)
