"""Model weights in and out of the trainer, read one tensor at a time: a Hugging Face Llama folder
(config.json + safetensors) to a checkpoint and back, and a model filled from either, for checkpoint.init_from,
`fsdp_trainer.tools.convert` and `fsdp_trainer.tools.generate`. Training state (optimizer, data position, RNG) does
not travel this way: resuming is checkpoint.py's.

Runbook:
    python -m fsdp_trainer.tools.convert from-hf Llama-3.2-1B/ ckpt/          # import_hf(): ckpt/step_00000000
    python -m fsdp_trainer.tools.convert to-hf outputs/checkpoints exported/   # export()
    python -m fsdp_trainer.train --checkpoint.init_from hf:Llama-3.2-1B/ ...   # model_from_init_from(), load_weights()

config.json sets every model setting (model_args_from_hf): shapes, RoPE base and llama3 scaling, RMSNorm's eps, tied
embeddings; export writes them back as read. Our q and k projections keep Meta's interleaved RoPE pairs; Hugging
Face's rotate-half layout pairs rows half a head apart, so those rows are permuted on the way out (to_hf_rows) and
back on the way in (from_hf_rows).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import tomllib
import warnings
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp_trainer.checkpoint import (CONFIG, FORMAT, MARKER, MODEL_CLASS, STEP_DIR, WEIGHTS_ONLY, Checkpoint,
                                     CheckpointError, check_usable, find_latest, incomplete_reason, list_checkpoints,
                                     load_dcp, model_class, read_marker, step_dir, write_marker)
from fsdp_trainer.config import Config, ConfigError, ModelConfig, from_dict, model_flag, to_toml
from fsdp_trainer.data import write_atomic
from fsdp_trainer.distributed import cores_per_rank
from fsdp_trainer.models.llama import ROPE_SCALING, ModelArgs, Transformer, build, model_args_from_config
from fsdp_trainer.tools.checksums import Checksums, checked

# Our ModelArgs field -> its config.json key, and transformers' LlamaConfig default where the key may be absent.
HF_FIELDS = {"dim": ("hidden_size", None), "n_layers": ("num_hidden_layers", None),
             "n_heads": ("num_attention_heads", None), "n_kv_heads": ("num_key_value_heads", None),
             "vocab_size": ("vocab_size", None), "ffn_hidden_dim": ("intermediate_size", None),
             "max_seq_len": ("max_position_embeddings", 2048), "rope_theta": ("rope_theta", 10000.0),
             "norm_eps": ("rms_norm_eps", 1e-6), "tie_embeddings": ("tie_word_embeddings", False)}
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}  # safetensors' names
LLAMA_CLASS = f"{Transformer.__module__}.{Transformer.__qualname__}"


def model_settings(args: ModelArgs) -> dict:
    """What a checkpoint records of a Llama's settings, for a resume to compare: all but the two that only derive
    ffn_hidden_dim, and max_seq_len, which only lengthens the RoPE table."""
    return {key: value for key, value in dataclasses.asdict(args).items()
            if key not in ("ffn_dim_multiplier", "multiple_of", "max_seq_len")}


# ----------------------------------------------------------------------------------------------- checkpoints

def _export_hint(path: Path) -> str:
    """A hint, for a folder that holds an export rather than checkpoints, on how to load it."""
    if (path / "config.json").is_file() and any(path.glob("model*.safetensors*")):
        return f"; it holds a Hugging Face model: give hf:{path} (e.g. --checkpoint.init_from hf:{path})"
    return ""


def resolve(path: str | Path, flag: str) -> Checkpoint:
    """The complete checkpoint a user named: a step folder, or a checkpoint folder (then its newest one)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{flag} {path}: no such folder; give a step_* folder holding {MARKER}, or the "
                              "checkpoint folder that holds them")
    if STEP_DIR.match(path.name) or (path / ".metadata").exists() or (path / MARKER).exists():
        if (reason := incomplete_reason(path)) is not None:
            raise CheckpointError(f"{flag} {path}: not a complete checkpoint: it {reason}; give a complete one")
        return check_usable(path)
    latest = find_latest(path)
    if latest is None:
        raise CheckpointError(f"{flag} {path}: holds no complete checkpoint (a step_* folder with {MARKER})"
                              f"{_export_hint(path)}")
    return latest


def read_metadata(path: Path, fix: str) -> Metadata:
    """DCP's index of the checkpoint `path`; a CheckpointError ending in `fix` if it cannot be read."""
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # a truncated or foreign file fails in pickle, in torch or in the OS
        raise CheckpointError(f"checkpoint {path}: its .metadata cannot be read ({type(err).__name__}: {err}); "
                              f"{fix}") from None


def _load_dcp(state: dict, path: Path, group: Optional[dist.ProcessGroup], fix: str) -> None:
    """load_dcp, where DCP's warning that no group (None) means a load in one process is left out: that is the point."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        load_dcp(state, path, group, fix)


def own_model_class(state: dict) -> Optional[str]:
    """The class of a checkpoint's model if it is a team's own (train.main's model_fn), whose config.toml's --model.*
    settings describe a Llama preset that was never trained; None for fsdp_trainer's Llama."""
    saved = state.get(MODEL_CLASS)
    return saved if saved not in (None, LLAMA_CLASS) else None


def tensor_shapes(state: dict, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """Flattened key (as DCP names it) -> global shape of every tensor reachable through nested dicts."""
    shapes = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            shapes.update(tensor_shapes(value, f"{name}."))
        elif isinstance(value, torch.Tensor):  # a DTensor's shape is the global, unsharded one
            shapes[name] = tuple(value.shape)
    return shapes


def _saved_model_settings(path: Path) -> str:
    """What the checkpoint at `path` records of its model, as a sentence: its --model.* settings, or its own class."""
    if own := own_model_class(read_marker(path)[0] or {}):
        return f" It holds a model of your own, {own}."
    try:
        model = tomllib.loads((Path(path) / CONFIG).read_text()).get("model", {})
    except (OSError, ValueError):
        return ""
    return " It was saved with " + " ".join(model_flag(k, v) for k, v in model.items()) + "."


def saved_config(path: Path) -> Config:
    """The config of the run that saved the checkpoint `path`, from its config.toml; a CheckpointError naming the
    checkpoint and a fix if that is missing or unusable."""
    file = Path(path) / CONFIG
    try:
        raw = tomllib.loads(file.read_text())
        if "model" not in raw:  # to_toml always writes one: an empty file would read as the default preset
            raise ValueError("no [model] table: it is empty or cut short")
        cfg = from_dict(raw, source=str(file))
        model_args_from_config(cfg.model)
    except (OSError, ValueError) as err:  # ValueError: TOML's errors and ConfigError too
        problem = "is missing" if isinstance(err, FileNotFoundError) else f"is unusable ({err})"
        raise CheckpointError(f"checkpoint {path}: its {CONFIG}, the only record of the model's settings, {problem}; "
                              "copy in the config.toml of the run that saved it (from its train.output_dir), or use "
                              "another of its checkpoints") from None
    return cfg


def shapeless_changes(path: Path, args, names: Sequence[str]) -> tuple[str, str, str]:
    """Of the model settings `names`, those that differ between the model saved in `path` (its config.toml, where it
    can be read) and `args`, as ("model.x A, ...", "model.x B, ...", "--model.x A ..."): saved, here, and the flags
    that restore the saved ones. No tensor's shape shows them."""
    try:
        saved = model_args_from_config(saved_config(path).model)
    except CheckpointError:
        return "", "", ""
    changed = [name for name in names if getattr(saved, name) != getattr(args, name)]
    return (", ".join(f"model.{name} {getattr(saved, name)}" for name in changed),
            ", ".join(f"model.{name} {getattr(args, name)}" for name in changed),
            " ".join(model_flag(name, getattr(saved, name)) for name in changed))


def check_shapes(path: Path, metadata: Metadata, expected: dict[str, tuple[int, ...]], unexpected_prefix: str,
                 fix: str, misfit: str = "") -> None:
    """Raise a CheckpointError listing every expected tensor that `path` lacks or holds in another shape, and
    every saved tensor under `unexpected_prefix` that is not expected (a model with more layers, say), then `fix`.
    It says that the checkpoint does not fit, and which model settings its config.toml records; or, for expected
    shapes that this config.toml gave, `misfit` instead: then the settings in it are what is in doubt."""
    saved = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata)}
    problems = []
    for key, shape in expected.items():
        if key not in saved:
            problems.append(f"{key} is missing from the checkpoint")
        elif saved[key] != shape:
            problems.append(f"{key} has shape {list(saved[key])} in the checkpoint but {list(shape)} in this model")
    problems += [f"{key} is in the checkpoint but not in this model" for key in saved
                 if key.startswith(unexpected_prefix) and key not in expected]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        settings = "" if misfit else _saved_model_settings(path)
        raise CheckpointError(f"checkpoint {path} {misfit or 'does not fit'}: {'; '.join(problems[:3])}{more}."
                              f"{settings} {fix}")


def hf_names(n_layers: int) -> dict[str, str]:
    """Our parameter names -> Hugging Face LlamaForCausalLM's."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    block = {"attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
             "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
             "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
             "feed_forward.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
             "ffn_norm.weight": "post_attention_layernorm.weight"}
    for i in range(n_layers):
        names.update({f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in block.items()})
    return names


def _rope_heads(name: str, args: ModelArgs) -> Optional[int]:
    """Heads of a projection whose output rows RoPE rotates (q and k), else None."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.n_kv_heads
    return None


def to_hf_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k rows from Meta's interleaved RoPE pairs (x0,x1),(x2,x3)... to HF's rotate-half layout, whose
    pairs are (x_i, x_{i+d/2}): within each head, the even rows, then the odd ones."""
    rows, cols = weight.shape
    return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def from_hf_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of to_hf_rows."""
    rows, cols = weight.shape
    return weight.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _to_hf_tensor(name: str, tensor: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    heads = _rope_heads(name, args)
    return (tensor if heads is None else to_hf_rows(tensor, heads)).contiguous()


def to_hf(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our full state dict -> HF Llama's (a tied output projection is left to tie_word_embeddings)."""
    return {theirs: _to_hf_tensor(ours, state[ours], args) for ours, theirs in hf_names(args.n_layers).items()
            if not (ours == "output.weight" and args.tie_embeddings)}


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    """config.json of the equivalent transformers LlamaForCausalLM, in the form transformers 4 and 5 both read."""
    rope = args.rope_scaling and {**args.rope_scaling, "rope_type": "llama3"}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": args.head_dim,
            **{key: getattr(args, ours) for ours, (key, _) in HF_FIELDS.items()}, "rope_scaling": rope,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
            "torch_dtype": str(dtype).removeprefix("torch.")}


# ----------------------------------------------------------------------------------------------- config.json

def _read_hf_json(path: Path, key: Optional[str] = None) -> dict:
    """A JSON object of a Hugging Face model folder (its `key` entry, if given), or a CheckpointError naming the
    file."""
    try:
        value = json.loads(path.read_text())
        if key is not None:
            value = value[key]
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object, found {type(value).__name__}")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"hf:{path.parent}: {path.name} is unreadable or not as Hugging Face writes it "
                              f"({type(err).__name__}: {err}); download or export the model again") from None
    return value


def model_args_from_hf(folder: Path) -> ModelArgs:
    """The model a Hugging Face Llama folder's config.json describes; a CheckpointError for one this model cannot
    compute (another activation or RoPE type, a head_dim of its own)."""
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"hf:{folder}: no config.json; expected a Hugging Face Llama model folder")
    config = _read_hf_json(folder / "config.json")
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' two names of one function
        raise CheckpointError(f"hf:{folder}: config.json's hidden_act is {act!r}, but this model's SwiGLU uses silu, "
                              "so its weights would compute another function; give a Llama model folder")
    # transformers 5 writes RoPE's settings as rope_parameters, 4 as rope_theta and rope_scaling ("type" before 4.43).
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default" if set(rope) <= {"rope_theta"} else None))
    if kind not in ("default", "llama3"):
        raise CheckpointError(f"hf:{folder}: config.json's RoPE type is {kind!r}, which this model does not implement "
                              "(default and llama3 only), so its weights would compute another function")
    fields = {ours: config.get(key, default) for ours, (key, default) in HF_FIELDS.items()}
    fields["n_kv_heads"] = fields["n_kv_heads"] or fields["n_heads"]
    fields["rope_theta"] = rope.get("rope_theta", fields["rope_theta"])
    try:
        missing = [HF_FIELDS[ours][0] for ours, value in fields.items() if value is None]
        missing += [key for key in ROPE_SCALING if kind == "llama3" and key not in rope]
        if missing:
            raise ValueError(f"it lacks {', '.join(missing)}")
        args = ModelArgs(**fields, rope_scaling={key: rope[key] for key in ROPE_SCALING} if kind == "llama3" else None)
        if config.get("head_dim", args.head_dim) != args.head_dim:
            raise ValueError(f"its head_dim {config['head_dim']} is not hidden_size / num_attention_heads, as here")
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"hf:{folder}: config.json describes no model this Llama can be ({err})") from None
    return args


def model_config_from_hf(folder: Path, model: ModelConfig) -> ModelConfig:
    """`model` with every setting taken from hf:<folder>'s config.json; a ConfigError naming both values where a
    setting given explicitly (flag or TOML) disagrees."""
    args = model_args_from_hf(folder)
    fields = {name: getattr(args, name) for name in HF_FIELDS} | {"rope_scaling": args.rope_scaling or {}}
    for name, value in model.overrides().items():
        try:  # ffn_dim_multiplier has no say where the width is given (ffn_hidden_dim): a flag would do nothing
            agrees = name != "ffn_dim_multiplier" and ModelArgs(**{**fields, name: value}) == args
        except (ValueError, TypeError):
            agrees = False
        if not agrees:
            key = HF_FIELDS.get(name, ("intermediate_size" if name == "ffn_dim_multiplier" else name,))[0]
            theirs = fields.get(name, fields["ffn_hidden_dim"])
            raise ConfigError(f"model.{name}={value}, but hf:{folder}/config.json, which sets the model, has {key} "
                              f"{'none' if theirs == {} else theirs}; remove --model.{name}")
    return ModelConfig(name=model.name, **fields)


def model_from_init_from(cfg: Config) -> None:
    """Where checkpoint.init_from is hf:<folder>, make cfg.model the model its config.json describes (a resumed run
    too: it trains that model)."""
    source = cfg.checkpoint.init_from or ""
    if source.startswith("hf:"):
        cfg.model = model_config_from_hf(Path(source[3:]).expanduser(), cfg.model)


def _check_hf_config(folder: Path, args: ModelArgs) -> None:
    """A CheckpointError naming the settings in which the folder's model differs from `args` (max_seq_len only
    lengthens the RoPE table: any will do)."""
    theirs = model_args_from_hf(folder)
    wrong = [name for name in (*HF_FIELDS, "rope_scaling") if name != "max_seq_len"
             and getattr(theirs, name) != getattr(args, name)]
    if wrong:
        sets = ", ".join(f"{name}={getattr(args, name)} here but {getattr(theirs, name)} there" for name in wrong)
        flags = " ".join(model_flag(name, getattr(theirs, name)) for name in wrong)
        raise CheckpointError(f"hf:{folder}: config.json does not fit this model ({sets}); set {flags}")


# ----------------------------------------------------------------------------------------------- tensors in

def _hf_tensor_files(folder: Path) -> dict[str, Path]:
    """HF tensor name -> the .safetensors file holding it (one file, or shards listed by an index)."""
    index, single = folder / "model.safetensors.index.json", folder / "model.safetensors"
    if index.is_file() and single.is_file():
        raise CheckpointError(f"hf:{folder}: holds both {single.name} and {index.name} (one left over from an "
                              "earlier download or export?), so which weights are the model's is unclear; remove "
                              "the one that is not")
    if index.is_file():
        files = {name: folder / file for name, file in _read_hf_json(index, "weight_map").items()}
        missing = sorted({path.name for path in files.values() if not path.is_file()})
        if missing:
            raise CheckpointError(f"hf:{folder}: {', '.join(missing)}, listed in {index.name}, "
                                  f"{'is' if len(missing) == 1 else 'are'} missing; download the model again")
        return files
    if not single.is_file():
        raise CheckpointError(f"hf:{folder}: has neither model.safetensors nor model.safetensors.index.json")
    with _safetensors(single) as f:
        return {name: single for name in f.keys()}


@contextlib.contextmanager
def _safetensors(file: Path) -> Iterator:
    """safe_open(file) for the block, or a CheckpointError naming the file where safetensors is not installed, the
    file cannot be opened, or safetensors finds it damaged (in the block too): safetensors' own errors name no file,
    and it reports any failure to open one as "No such file or directory"."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise CheckpointError("reading a Hugging Face model needs safetensors: pip install safetensors "
                              "(or fsdp_trainer[hf])") from None
    try:
        handle = safe_open(str(file), "pt")
    except (OSError, SafetensorError) as err:
        try:
            open(file, "rb").close()  # the real reason it cannot be opened (permissions, say), if that is it
        except OSError as cause:
            raise CheckpointError(f"hf:{file.parent}: {file.name} cannot be opened: {cause.strerror}") from None
        raise _damaged(file, err) from None
    with handle as f:
        try:
            yield f
        except SafetensorError as err:
            raise _damaged(file, err) from None


def _damaged(file: Path, err: Exception) -> CheckpointError:
    return CheckpointError(f"hf:{file.parent}: {file.name} cannot be read ({type(err).__name__}: {err}): it is cut "
                           "short or its header is damaged; download or export the model again")


def _hf_tensors(folder: Path, args: ModelArgs, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple]:
    """Our name -> (file, HF name, dtype) of each parameter in `shapes` (our name -> full shape), every name and
    shape checked against the folder's files; a CheckpointError listing the problems."""
    files, theirs = _hf_tensor_files(folder), hf_names(args.n_layers)
    if args.tie_embeddings:  # HF omits lm_head.weight when tied; untied, its absence is an error below
        theirs["output.weight"] = theirs["tok_embeddings.weight"]
    # Buffers that older transformers saved (derived from rope_theta), and the output projection that a tied
    # model's file may hold too (transformers ignores it when tied): every other tensor must have a place here.
    used = {theirs[name] for name in shapes} | ({"lm_head.weight"} if args.tie_embeddings else set())
    problems = [f"{name} is there but has no place in this model" for name in sorted(files)
                if name not in used and not name.endswith("rotary_emb.inv_freq")]
    found = {}
    for name, expected in shapes.items():
        if theirs[name] not in files:
            problems.append(f"{theirs[name]} is missing")
            continue
        with _safetensors(files[theirs[name]]) as f:
            if theirs[name] not in f.keys():  # the index points at a file without it (a download cut short?)
                problems.append(f"{theirs[name]} is not in {files[theirs[name]].name}, where the index says it is")
                continue
            tensor = f.get_slice(theirs[name])
            shape, dtype = tuple(tensor.get_shape()), tensor.get_dtype()
        if shape != expected:
            problems.append(f"{theirs[name]} has shape {list(shape)} there but our {name} is {list(expected)}")
        elif dtype not in _DTYPES.values():
            problems.append(f"{theirs[name]} is {dtype}, not a floating-point type of {', '.join(_DTYPES.values())}")
        found[name] = (files[theirs[name]], theirs[name], {v: k for k, v in _DTYPES.items()}.get(dtype))
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"hf:{folder} does not fit this model: {'; '.join(problems[:3])}{more}")
    return found


def _read_hf(name: str, entry: tuple, args: ModelArgs) -> torch.Tensor:
    """One parameter of _hf_tensors' in our layout."""
    file, theirs, _ = entry
    with _safetensors(file) as f:
        tensor = f.get_tensor(theirs)
    heads = _rope_heads(name, args)
    return tensor if heads is None else from_hf_rows(tensor, heads)


@torch.no_grad()
def _copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        # Every rank holds the full tensor, so each cuts its own shard without communication.
        full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param = param.to_local()
    param.copy_(full)


def load_weights(model: nn.Module, source: str, args: ModelArgs, group: Optional[dist.ProcessGroup] = None,
                 threads: int = 4) -> None:
    """Fill a (sharded) model with the weights of a checkpoint (a folder, resharded by DCP) or of hf:<folder> (a
    Hugging Face Llama); settings and shapes are checked first, and a mismatch raises a CheckpointError naming it. A
    checkpoint's files are checked against the checksums its save recorded, `threads` files at a time per rank (0:
    no check)."""
    if source.startswith("hf:"):
        folder = Path(source[3:]).expanduser()
        _check_hf_config(folder, args)
        params = dict(model.named_parameters())  # a tied weight appears once; a DTensor's shape is the full one
        found = _hf_tensors(folder, args, {name: tuple(p.shape) for name, p in params.items()})
        for name, entry in found.items():
            _copy_full(params[name], _read_hf(name, entry, args))
        return
    checkpoint = resolve(source, "--checkpoint.init_from")
    path, model_sd = checkpoint.path, get_model_state_dict(model)
    fix = "give --checkpoint.init_from an earlier complete checkpoint"
    own = own_model_class(checkpoint.state) or model_class(model) is not Transformer
    # Heads of the same shapes would cut the saved projections into others, another eps normalize otherwise. A tied
    # checkpoint loads into an untied model as two equal tensors (untying it); the other way round, one of the saved
    # two would overwrite the other in the model's single tensor. Another RoPE base or scaling is a new run's choice
    # (a longer context, say). (A model of one's own has none of these settings: config.toml's are of a preset that
    # was not trained.)
    then, now, flags = ("", "", "") if own else shapeless_changes(
        path, args, ("n_heads", "n_kv_heads", "norm_eps") + (("tie_embeddings",) if args.tie_embeddings else ()))
    with checked(checkpoint, group, fix, threads, enabled=threads > 0):
        check_shapes(path, read_metadata(path, fix), tensor_shapes({"model": model_sd}), "model.",
                     "Build the model it was saved with." if own else "Set the --model.* flags it was saved with.")
        if then:
            raise CheckpointError(f"checkpoint {path} was saved with {then}, but this model has {now}, and its "
                                  f"weights would compute another function: set {flags}")
        _load_dcp({"model": model_sd}, path, group, fix)
    set_model_state_dict(model, model_sd)


def load_model(source: str, device: torch.device | str = "cpu") -> Transformer:
    """The Llama of a checkpoint (with its config.toml's settings) or of hf:<folder> (its config.json's), on
    `device` in float32, for inference. Read on the CPU, then moved: DCP's single-process load reads into host
    tensors."""
    if source.startswith("hf:"):
        args = model_args_from_hf(Path(source[3:]).expanduser())
    else:
        args = model_args_from_config(saved_config(resolve(source, "checkpoint").path).model)
    model = build(args).to_empty(device="cpu")
    model.init_buffers()
    model.tie_weights()
    load_weights(model, source, args, threads=cores_per_rank(1))
    return model.to(device).eval()


# ---------------------------------------------------------------------------------------------- tensors out

def write_safetensors(file: Path, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]],
                      read: Callable[[str], torch.Tensor]) -> None:
    """A .safetensors file of `tensors` (name -> shape, dtype), each one's data taken from read(name) as it is
    written: one tensor in memory at a time, where safetensors' own writer wants them all."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (shape, dtype) in tensors.items():
        end = offset + torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data 8-byte aligned, as safetensors writes it

    def write(f) -> None:
        f.write(len(text).to_bytes(8, "little") + text)
        for name, (shape, dtype) in tensors.items():
            tensor = read(name).to(dtype).contiguous()
            if tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"{name} has shape {list(tensor.shape)}, not the {list(shape)} of the header")
            f.write(tensor.view(torch.uint8).numpy())

    write_atomic(file, write)


def export(path: str | Path, out_dir: str | Path, dtype: Optional[torch.dtype] = None,
           log: Callable[[str], None] = print, checksums: bool = True) -> Path:
    """Write a checkpoint's weights to out_dir as a Hugging Face Llama (config.json + model.safetensors), in their
    saved dtype or `dtype`, reading one tensor at a time. The folder and the checkpoint's config.toml are checked
    before the first file is written; with `checksums`, the checkpoint's files against those its save recorded."""
    out = Path(out_dir)
    _check_no_weights_in(out)
    checkpoint = resolve(path, "checkpoint")
    path, fix = checkpoint.path, "export an earlier complete checkpoint"
    own = own_model_class(checkpoint.state)
    if own:
        raise CheckpointError(f"checkpoint {path} holds a model of your own, {own}; export converts fsdp_trainer's "
                              "Llama only. Its full weights: torch.distributed.checkpoint.format_utils."
                              f"dcp_to_torch_save('{path}', 'model.pt'), then your_model.load_state_dict("
                              "torch.load('model.pt')['model'])")
    # config.toml may have been copied in from another run (saved_config asks for that when it is lost): blocks it
    # does not know would be left out of the export, its untied output projection replaced.
    args = model_args_from_config(saved_config(path).model)
    misfit = f"has a {CONFIG} that does not describe the model saved there"
    fix_config = ("Copy in the config.toml of the run that saved it (from its train.output_dir); a model of your own "
                  "(train.main's model_fn) is no Llama, which is all export converts")
    # The whole checkpoint is checked first, as the export reads it a tensor at a time and must not write from damage.
    with checked(checkpoint, None, fix, threads=cores_per_rank(1), enabled=checksums):
        metadata = read_metadata(path, fix)
        check_shapes(path, metadata, tensor_shapes({"model": build(args).state_dict()}), "model.", fix_config, misfit)
    saved = {key.removeprefix("model."): meta for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}

    def read(*names: str) -> list[torch.Tensor]:
        state = {name: torch.empty(saved[name].size, dtype=saved[name].properties.dtype) for name in names}
        _load_dcp({"model": state}, path, None, fix)
        return list(state.values())

    names = {theirs: ours for ours, theirs in hf_names(args.n_layers).items()
             if not (ours == "output.weight" and args.tie_embeddings)}
    tensors = {theirs: (tuple(saved[ours].size), dtype or saved[ours].properties.dtype) for theirs, ours in names.items()}
    # Training saves a tied model's one tensor under both names: they must be equal.
    if args.tie_embeddings and not torch.equal(*read("tok_embeddings.weight", "output.weight")):
        raise CheckpointError(f"checkpoint {path} {misfit}: tie_embeddings = true in it, but the output projection "
                              f"saved there is not the embedding. {fix_config}")
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", tensors,
                      lambda name: _to_hf_tensor(names[name], read(names[name])[0], args))
    config = hf_config(args, tensors["model.norm.weight"][1])
    write_atomic(out / "config.json", lambda f: f.write((json.dumps(config, indent=2) + "\n").encode()))
    log(f"wrote {out / 'model.safetensors'} and config.json ({args.num_params() / 1e6:,.1f}M parameters): "
        "transformers' LlamaForCausalLM.from_pretrained loads it")
    return out


def _check_no_weights_in(out: Path) -> None:
    """A CheckpointError if `out` holds model weights already: an earlier export's files that this one would not
    replace (the shards and index of a sharded model, say) would be loaded instead of the new ones, or mixed with
    them. Nothing is deleted: they may be the only copy of another model."""
    found = sorted({file.name for pattern in ("model*.safetensors", "model.safetensors.index.json")
                    for file in out.glob(pattern)})
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        raise CheckpointError(f"{out} holds model weights already ({', '.join(found[:3])}{more}); export into a new or "
                              "empty folder, or remove those files first")


class _StreamingPlanner(DefaultSavePlanner):
    """DCP's save planner over a state dict of meta tensors: each tensor's data is read when DCP asks for it. None is
    released early: on a CUDA host DCP's writer loads tensors ahead of the one it writes."""

    def __init__(self, read: Callable[[str], torch.Tensor]):
        super().__init__()
        self.read = read

    def resolve_data(self, write_item):
        return self.read(write_item.index.fqn.removeprefix("model."))


def import_hf(folder: str | Path, root: str | Path, log: Callable[[str], None] = print) -> Path:
    """Write hf:<folder> as the checkpoint of step 0 in the checkpoint folder `root`: the weights in their dtype, no
    optimizer state, and a config.toml whose model settings are config.json's. init_from and resume take it."""
    folder, root = Path(folder).expanduser(), Path(root).expanduser()
    args = model_args_from_hf(folder)
    if list_checkpoints(root):
        raise CheckpointError(f"{root} holds checkpoints already; convert into a new or empty folder")
    shapes = tensor_shapes(build(args).state_dict())  # with a tied model's output projection, as training saves it
    found = _hf_tensors(folder, args, {name: shape for name, shape in shapes.items() if name != "output.weight"}
                        if args.tie_embeddings else shapes)
    found.setdefault("output.weight", found["tok_embeddings.weight"])
    state = {"model": {name: torch.empty(shape, dtype=found[name][2], device="meta") for name, shape in shapes.items()}}
    path = step_dir(root, 0)
    path.mkdir(parents=True)
    cfg = Config(model=model_config_from_hf(folder, ModelConfig()))
    write_atomic(path / CONFIG, lambda f: f.write(to_toml(cfg).encode()))
    storage = Checksums(threads=1)
    writer = storage.writer(path, thread_count=1)
    with warnings.catch_warnings():  # DCP warns that no_dist saves in one process: that is the point
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save(state, storage_writer=writer, no_dist=True,
                 planner=_StreamingPlanner(lambda name: _read_hf(name, found[name], args)))
    write_marker(path, storage.commit({"format": FORMAT, "step": 0, "consumed_samples": 0, "tokens_seen": 0,
                                       "world_size": 1, "mesh": {"dp_replicate": 1, "dp_shard": 1}, "global_batch": 0,
                                       "scheduler": None, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                       "torch": torch.__version__, "model": model_settings(args),
                                       MODEL_CLASS: LLAMA_CLASS, WEIGHTS_ONLY: True}, writer))
    log(f"wrote {path} ({args.num_params() / 1e6:,.1f}M parameters): give it to --checkpoint.init_from, or resume "
        f"from it with --checkpoint.dir {root} --config {path / CONFIG}")
    return path
