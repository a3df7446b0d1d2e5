"""Weights in and out (weights.py): what a Hugging Face folder or a checkpoint's config.toml must agree on before
any weight is copied. The round trips themselves are in test_checkpoint.py."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Optional

import pytest
import torch

from fsdp_trainer import distributed
from fsdp_trainer.tools import weights
from fsdp_trainer.checkpoint import CheckpointError
from fsdp_trainer.config import parse_args
from fsdp_trainer.models.llama import build, model_args_from_config
from fsdp_trainer.parallelize import init_weights
from fsdp_trainer.train import run

from helpers import TINY_FLAGS

TINY = [*TINY_FLAGS, "--data.source", "synthetic"]


def tiny_args(*flags: str):
    return model_args_from_config(parse_args([*TINY, *flags]).model)


def hf_folder(folder: Path, args, extra: Optional[dict[str, torch.Tensor]] = None, **config) -> Path:
    """A Hugging Face Llama folder of a freshly initialized model of `args`, its config.json changed by `config`
    (None: the key left out) and `extra` tensors added to its file."""
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file
    model = build(args, device="cpu")
    init_weights(model, "cpu", seed=0)
    folder.mkdir()
    save_file({**weights.to_hf(model.state_dict(), args), **(extra or {})}, str(folder / "model.safetensors"))
    settings = {**weights.hf_config(args, torch.float32), **config}
    (folder / "config.json").write_text(json.dumps({k: v for k, v in settings.items() if v is not None}))
    return folder


def load_hf(folder: Path, args):
    model = build(args, device="cpu")
    weights.load_weights(model, f"hf:{folder}", args)
    return model


def test_hf_tensors_with_no_place_in_the_model_are_named(tmp_path):
    """A Llama-like model with attention biases (Qwen2's, or attention_bias = true) loaded without them would be
    another function; old transformers' RoPE buffers and a tied model's copy of the embedding are not weights."""
    args = tiny_args()
    bias = {"model.layers.0.self_attn.q_proj.bias": torch.zeros(64), "model.layers.1.self_attn.k_proj.bias":
            torch.zeros(32)}
    with pytest.raises(CheckpointError, match=re.escape("model.layers.0.self_attn.q_proj.bias is there but has no "
                                                        "place in this model; model.layers.1.self_attn.k_proj.bias")):
        load_hf(hf_folder(tmp_path / "bias", args, bias, attention_bias=True), args)
    load_hf(hf_folder(tmp_path / "inv_freq", args, {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}),
            args)
    tied = tiny_args("--model.tie_embeddings", "True")
    load_hf(hf_folder(tmp_path / "tied", tied, {"lm_head.weight": torch.zeros(320, 64)}), tied)


def test_an_index_pointing_at_a_shard_without_the_tensor_names_both(tmp_path):
    from safetensors.torch import load_file, save_file
    args = tiny_args()
    folder = hf_folder(tmp_path / "hf", args)
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    moved = "model.layers.1.mlp.down_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != moved}, str(folder / "part-1.safetensors"))
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, str(folder / "part-2.safetensors"))
    weight_map = {name: "part-2.safetensors" if name == moved else "part-1.safetensors" for name in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=re.escape(f"{moved} is not in part-2.safetensors, where the index says "
                                                        "it is")):
        load_hf(folder, args)


@pytest.mark.parametrize("damage,sharded", [("truncated", False), ("garbage", False), ("truncated", True),
                                            ("garbage", True), ("unreadable", False)])
def test_a_damaged_safetensors_file_is_named_with_the_fix(tmp_path, monkeypatch, damage, sharded):
    """A download cut short, or another file under the name: safetensors' own error names neither the file nor what
    to do. One that cannot be opened (another user's, say) is not called damaged."""
    from safetensors import safe_open
    args = tiny_args()
    folder = hf_folder(tmp_path / "hf", args)
    file = folder / "model.safetensors"
    if sharded:
        with safe_open(str(file), "pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model-00001-of-00001.safetensors")
        file = file.rename(folder / "model-00001-of-00001.safetensors")
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    if damage == "unreadable":  # another user's download, say: safetensors says "No such file" whatever the reason
        import safetensors

        from fsdp_trainer.tools import weights

        def denied(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(safetensors, "safe_open", lambda *args, **kwargs: (_ for _ in ()).throw(
            FileNotFoundError(2, "No such file or directory")))
        monkeypatch.setattr(weights, "open", denied, raising=False)
        with pytest.raises(CheckpointError, match=re.escape(f"hf:{folder}: {file.name} cannot be opened: Permission "
                                                            "denied") + "$"):
            load_hf(folder, args)
        return
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2] if damage == "truncated" else b"not safetensors at all")
    with pytest.raises(CheckpointError, match=re.escape(f"hf:{folder}: {file.name} cannot be read (SafetensorError: ")
                       + r".*\): it is cut short or its header is damaged; download or export the model again$"):
        load_hf(folder, args)


def test_hf_config_without_tie_word_embeddings_is_untied_as_in_transformers(tmp_path):
    """LlamaConfig's default is untied: its lm_head.weight is the output layer, which a tied model would drop."""
    folder = hf_folder(tmp_path / "hf", tiny_args(), tie_word_embeddings=None)
    tied = tiny_args("--model.tie_embeddings", "True")
    with pytest.raises(CheckpointError, match=re.escape("tie_embeddings=True here but False there); set "
                                                        "--model.tie_embeddings False")):
        load_hf(folder, tied)
    load_hf(folder, tiny_args())


def test_hf_model_with_another_activation_is_refused(tmp_path):
    folder = hf_folder(tmp_path / "hf", tiny_args(), hidden_act="gelu_pytorch_tanh")  # Gemma's: the same names
    with pytest.raises(CheckpointError, match="hidden_act is 'gelu_pytorch_tanh', but this model's SwiGLU uses silu"):
        load_hf(folder, tiny_args())
    load_hf(hf_folder(tmp_path / "swish", tiny_args(), hidden_act="swish"), tiny_args())  # transformers: silu's alias


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The step-2 checkpoint of a finished one-rank run of the tiny untied model."""
    out = tmp_path_factory.mktemp("run")
    cfg = parse_args([*TINY, "--train.steps", "2", "--checkpoint.async_mode", "none", "--train.output_dir", str(out)])
    info = distributed.init(60)
    try:
        run(cfg, info)
    finally:
        distributed.shutdown()
    return out / "checkpoints" / "step_00000002"


@pytest.mark.parametrize("wrong,message", [
    (("n_layers = 2", "n_layers = 1"), "model.layers.1.attention.wk.weight is in the checkpoint but not in this model"),
    (("n_layers = 2", "n_layers = 3"), "model.layers.2.attention.wk.weight is missing from the checkpoint"),
    (("[model]\n", "[model]\ntie_embeddings = true\n"), "tie_embeddings = true in it, but the output projection "
                                                        "saved there is not the embedding. "),
])
@pytest.mark.slow
def test_export_refuses_a_config_toml_of_another_model(checkpoint, tmp_path, wrong, message):
    """saved_config asks for the run's config.toml where it is lost: one copied from another run would have blocks
    left out of the export, or the output projection replaced by the embedding."""
    step = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, step)
    config = step / "config.toml"
    assert wrong[0] in config.read_text()
    config.write_text(config.read_text().replace(*wrong, 1))
    with pytest.raises(CheckpointError, match=f"checkpoint {re.escape(str(step))} has a config.toml that does not "
                                              f"describe the model saved there: .*{re.escape(message)}.*Copy in the "
                                              "config.toml of the run that saved it"):
        weights.export(step, tmp_path / "export", log=lambda line: None)
    assert not (tmp_path / "export").exists()
