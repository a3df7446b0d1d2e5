"""Model weights in and out of the trainer: a checkpoint's weights exported as one consolidated model.pt and as a
Hugging Face Llama (config.json + model.safetensors), and a model filled from a checkpoint (resharded by DCP) or
from a Hugging Face Llama folder, for checkpoint.init_from. Training state (optimizer, data position, RNG) does not
travel this way: resuming is checkpoint.py's.

Runbook:
    python -m fsdp_trainer.tools.checkpoints export outputs/checkpoints/step_00000200 exported/  # main() calls export()
    python -m fsdp_trainer.train --checkpoint.init_from hf:exported/ ...   # Checkpointer.restore: load_weights()
    python -m fsdp_trainer.train --checkpoint.init_from outputs/checkpoints ...  # or a checkpoint's weights

hf:DIR refuses a config.json that differs in a setting a --model flag sets, naming the flag, and warns of those no
flag sets (RoPE scaling, rms_norm_eps). Export refuses a model of your own and gives the dcp_to_torch_save line
that writes its weights.

Our q and k projections keep Meta's interleaved RoPE pairs; Hugging Face's rotate-half layout pairs rows half a
head apart, so those rows are permuted on the way out (to_hf_rows) and back on the way in (from_hf_rows).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp_trainer.checkpoint import (CONFIG, CheckpointError, check_shapes, checked, load_dcp, model_class,
                                     own_model_class, read_metadata, resolve, saved_config, shapeless_changes,
                                     tensor_shapes)
from fsdp_trainer.config import Config, to_toml
from fsdp_trainer.distributed import cores_per_rank, logger
from fsdp_trainer.models.llama import ModelArgs, Transformer, build, model_args_from_config


def _hf_names(n_layers: int) -> dict[str, str]:
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


def to_hf(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our full state dict -> HF Llama's (a tied output projection is left to tie_word_embeddings)."""
    out = {}
    for ours, theirs in _hf_names(args.n_layers).items():
        if ours == "output.weight" and args.tie_embeddings:
            continue
        heads = _rope_heads(ours, args)
        tensor = state[ours] if heads is None else to_hf_rows(state[ours], heads)
        out[theirs] = tensor.contiguous()
    return out


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    """config.json of the equivalent transformers LlamaForCausalLM."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden_dim, "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
            "vocab_size": args.vocab_size, "max_position_embeddings": args.max_seq_len, "rope_theta": args.rope_theta,
            "rms_norm_eps": args.norm_eps, "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
            "torch_dtype": str(dtype).removeprefix("torch.")}


def load_consolidated(path: Path, checksums: bool = True) -> tuple[dict[str, torch.Tensor], Config]:
    """The full (unsharded) model weights of a complete checkpoint and its config, read in this one process
    without a process group: DCP fills tensors allocated from its metadata, whatever the saving world size. With
    `checksums`, the files are checked against those the save recorded, if any."""
    checkpoint = resolve(path, "checkpoint")
    path, fix = checkpoint.path, "export an earlier complete checkpoint"
    own = own_model_class(checkpoint.state)
    if own:
        raise CheckpointError(f"checkpoint {path} holds a model of your own, {own}; export converts fsdp_trainer's "
                              "Llama only. Its full weights: torch.distributed.checkpoint.format_utils."
                              f"dcp_to_torch_save('{path}', 'model.pt'), then your_model.load_state_dict("
                              "torch.load('model.pt')['model'])")
    metadata = read_metadata(checkpoint, fix, checksums)
    cfg = saved_config(path)  # before the tensors: a large model's take minutes to read
    # config.toml may have been copied in from another run (saved_config asks for that when it is lost): blocks it
    # does not know would be left out of the Hugging Face export, its untied output projection replaced.
    args = model_args_from_config(cfg.model)
    misfit = f"has a {CONFIG} that does not describe the model saved there"
    fix_config = ("Copy in the config.toml of the run that saved it (from its train.output_dir); a model of your own "
                  "(train.main's model_fn) is no Llama, which is all export converts")
    check_shapes(path, metadata, tensor_shapes({"model": build(args).state_dict()}), "model.", fix_config, misfit)
    state = {key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    with checked(checkpoint, None, fix, threads=cores_per_rank(1), enabled=checksums):
        load_dcp({"model": state}, path, None, fix)
    if args.tie_embeddings:
        if not torch.equal(state["output.weight"], state["tok_embeddings.weight"]):
            raise CheckpointError(f"checkpoint {path} {misfit}: tie_embeddings = true in it, but the output "
                                  f"projection saved there is not the embedding. {fix_config}")
        state["output.weight"] = state["tok_embeddings.weight"]  # one tensor again, as in the model
    return state, cfg


def export(path: str | Path, out_dir: str | Path, dtype: Optional[torch.dtype] = None,
           log: Callable[[str], None] = print, checksums: bool = True) -> Path:
    """Write a checkpoint's weights to out_dir as model.pt (our names; `Transformer.load_state_dict` takes it)
    and, if safetensors is installed, as a Hugging Face Llama (config.json + model.safetensors). The folder and
    the checkpoint's config.toml are checked before the first file is written."""
    out = Path(out_dir)
    _check_no_weights_in(out)
    state, cfg = load_consolidated(Path(path), checksums)
    args = model_args_from_config(cfg.model)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
        if args.tie_embeddings:
            state["output.weight"] = state["tok_embeddings.weight"]
    out.mkdir(parents=True, exist_ok=True)
    torch.save(state, out / "model.pt")
    (out / CONFIG).write_text(to_toml(cfg))
    log(f"wrote {out / 'model.pt'} ({len(state)} tensors, {args.num_params() / 1e6:,.1f}M parameters)")
    try:
        from safetensors.torch import save_file
    except ImportError:
        log("skipped the Hugging Face export: it needs safetensors (pip install safetensors, or fsdp_trainer[hf])")
        return out
    save_file(to_hf(state, args), str(out / "model.safetensors"), metadata={"format": "pt"})
    # safetensors writes a temporary file (mode 0600) and renames it; give it the mode of model.pt, which open()
    # created through the umask like every other file here.
    shutil.copymode(out / "model.pt", out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(hf_config(args, state["norm.weight"].dtype), indent=2) + "\n")
    log(f"wrote {out / 'model.safetensors'} and config.json: transformers' LlamaForCausalLM.from_pretrained loads it")
    return out


def _check_no_weights_in(out: Path) -> None:
    """A CheckpointError if `out` holds model weights already: an earlier export's files that this one would not
    replace (the shards and index of a sharded model, say) would be loaded instead of the new ones, or mixed with
    them. Nothing is deleted: they may be the only copy of another model."""
    found = sorted({file.name for pattern in ("model.pt", "model*.safetensors", "model.safetensors.index.json")
                    for file in out.glob(pattern)})
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        raise CheckpointError(f"{out} holds model weights already ({', '.join(found[:3])}{more}); export into a new or "
                              "empty folder, or remove those files first")


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
        raise CheckpointError("checkpoint.init_from=hf:... needs safetensors: pip install safetensors "
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


def _hf_rope(config: dict) -> tuple[float, dict]:
    """(rope_theta, RoPE scaling parameters or {} for none) of a config.json. transformers 5 writes them together
    as rope_parameters, earlier versions as rope_theta and rope_scaling; an absent theta is transformers' default."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
    # "type": transformers 4's older name. Parameters without a type still scale something: not "none".
    if rope.get("rope_type", rope.get("type")) == "default":
        scaling = {}
    return theta, scaling


def _check_hf_config(folder: Path, args: ModelArgs) -> None:
    """A CheckpointError naming the settings of config.json that differ from this model's and a --model flag can set;
    a warning for those that no flag can (RoPE scaling, RMSNorm's eps): refusing them would rule out fine-tuning
    such a model at all, and the weights still carry over, though the first logits differ from the original's.
    Another activation than SwiGLU's silu is refused: no fine-tuning would make those weights the model's."""
    config = _read_hf_json(folder / "config.json")
    act = config.get("hidden_act", "silu")  # absent keys: transformers' LlamaConfig defaults, as for rope_theta
    if act not in ("silu", "swish"):  # transformers' two names of one function
        raise CheckpointError(f"hf:{folder}: config.json's hidden_act is {act!r}, but this model's SwiGLU uses silu, "
                              "so its weights would compute another function; give a Llama model folder")
    theta, scaling = _hf_rope(config)
    hf = {**config, "rope_theta": theta, "tie_word_embeddings": config.get("tie_word_embeddings", False)}
    fields = {"hidden_size": ("dim", args.dim), "num_hidden_layers": ("n_layers", args.n_layers),
              "num_attention_heads": ("n_heads", args.n_heads),
              "num_key_value_heads": ("n_kv_heads", args.n_kv_heads),
              "intermediate_size": ("ffn_hidden_dim", args.ffn_hidden_dim),
              "vocab_size": ("vocab_size", args.vocab_size),
              "tie_word_embeddings": ("tie_embeddings", args.tie_embeddings),
              "rope_theta": ("rope_theta", args.rope_theta)}
    wrong = [(flag, hf[key], ours) for key, (flag, ours) in fields.items() if key in hf and hf[key] != ours]
    if wrong:
        sets = ", ".join(f"{flag}={ours} here but {theirs} there" for flag, theirs, ours in wrong)
        flags = " ".join(f"--model.{flag} {theirs}" for flag, theirs, _ in wrong)
        raise CheckpointError(f"hf:{folder}: config.json does not fit this model ({sets}); set {flags}")
    unmatched = [f"RoPE scaling {scaling} there, none here"] if scaling else []
    eps = config.get("rms_norm_eps", 1e-6)  # transformers' default
    if eps != args.norm_eps:
        unmatched.append(f"rms_norm_eps {eps} there, {args.norm_eps} here")
    if unmatched:
        logger.warning(f"hf:{folder}: {'; '.join(unmatched)}: no --model flag can match this, so this model's logits "
                       "will differ from the original's until fine-tuning adapts its weights")


def _hf_full_tensors(folder: Path, args: ModelArgs,
                     shapes: dict[str, tuple[int, ...]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, full tensor in our layout) for each parameter in `shapes` (our name -> full shape), one tensor
    in memory at a time; every shape is checked before the first tensor is read."""
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"hf:{folder}: no config.json; expected a Hugging Face Llama model folder")
    _check_hf_config(folder, args)
    files, theirs = _hf_tensor_files(folder), _hf_names(args.n_layers)
    if args.tie_embeddings:  # HF omits lm_head.weight when tied; untied, its absence is an error below
        theirs["output.weight"] = theirs["tok_embeddings.weight"]
    # Buffers that older transformers saved (derived from rope_theta), and the output projection that a tied
    # model's file may hold too (transformers ignores it when tied): every other tensor must have a place here.
    used = {theirs[name] for name in shapes} | ({"lm_head.weight"} if args.tie_embeddings else set())
    problems = [f"{name} is there but has no place in this model" for name in sorted(files)
                if name not in used and not name.endswith("rotary_emb.inv_freq")]
    for name, expected in shapes.items():
        if theirs[name] not in files:
            problems.append(f"{theirs[name]} is missing")
            continue
        with _safetensors(files[theirs[name]]) as f:
            if theirs[name] not in f.keys():  # the index points at a file without it (a download cut short?)
                problems.append(f"{theirs[name]} is not in {files[theirs[name]].name}, where the index says it is")
                continue
            shape = tuple(f.get_slice(theirs[name]).get_shape())
        if shape != expected:
            problems.append(f"{theirs[name]} has shape {list(shape)} there but our {name} is {list(expected)}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"hf:{folder} does not fit this model: {'; '.join(problems[:3])}{more}; set the "
                              "--model.* flags to match its config.json")
    for name in shapes:
        with _safetensors(files[theirs[name]]) as f:
            tensor = f.get_tensor(theirs[name])
        heads = _rope_heads(name, args)
        yield name, tensor if heads is None else from_hf_rows(tensor, heads)


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
    Hugging Face Llama); shapes are checked first, and a mismatch raises a CheckpointError naming it. A checkpoint's
    files are checked against the checksums its save recorded, `threads` files at a time per rank (0: no check)."""
    if source.startswith("hf:"):
        params = dict(model.named_parameters())  # a tied weight appears once; a DTensor's shape is the full one
        shapes = {name: tuple(p.shape) for name, p in params.items()}
        for name, full in _hf_full_tensors(Path(source[3:]).expanduser(), args, shapes):
            _copy_full(params[name], full)
        return
    checkpoint = resolve(source, "--checkpoint.init_from")
    path, model_sd = checkpoint.path, get_model_state_dict(model)
    fix = "give --checkpoint.init_from an earlier complete checkpoint"
    own = own_model_class(checkpoint.state) or model_class(model) is not Transformer
    check_shapes(path, read_metadata(checkpoint, fix, threads > 0), tensor_shapes({"model": model_sd}), "model.",
                 "Build the model it was saved with." if own else "Set the --model.* flags it was saved with.")
    # Heads of the same shapes would cut the saved projections into others. A tied checkpoint loads into an untied
    # model as two equal tensors (untying it); the other way round, one of the saved two would overwrite the other
    # in the model's single tensor. Another RoPE base is a new run's choice (a longer context, say).
    # (A model of one's own has none of these settings: config.toml's are of a preset that was not trained.)
    then, now, flags = ("", "", "") if own else shapeless_changes(
        path, args, ("n_heads", "n_kv_heads") + (("tie_embeddings",) if args.tie_embeddings else ()))
    if then:
        raise CheckpointError(f"checkpoint {path} was saved with {then}, but this model has {now}, and its weights "
                              f"would compute another function: set {flags}")
    with checked(checkpoint, group, fix, threads, enabled=threads > 0):
        load_dcp({"model": model_sd}, path, group, fix)
    set_model_state_dict(model, model_sd)
