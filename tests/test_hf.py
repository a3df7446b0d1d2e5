"""Hugging Face Llama 3, 3.1 and 3.2 in and out through the public commands (convert, init_from hf:, generate),
against transformers itself: logits, the round trip of config.json and tensors, greedy tokens; and the presets
against the published configs."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.filesystem as fs

from fsdp_trainer import checkpoint as ck
from fsdp_trainer.tools import weights
from fsdp_trainer.config import ConfigError, ModelConfig
from fsdp_trainer.models.llama import ModelArgs
from fsdp_trainer.tools import convert, generate, plan
from fsdp_trainer.train import main

transformers = pytest.importorskip("transformers")
load_file = pytest.importorskip("safetensors.torch").load_file

LLAMA3 = {"rope_theta": 500000.0, "rms_norm_eps": 1e-5}
# original_max_position_embeddings 256, so that a sequence of 4096 reaches far past it.
SCALED = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
STYLES = {"3": LLAMA3, "3.1": {**LLAMA3, "rope_scaling": {**SCALED, "factor": 8.0}},
          "3.2": {**LLAMA3, "rope_scaling": {**SCALED, "factor": 32.0}, "tie_word_embeddings": True},
          "eps 1e-6": {**LLAMA3, "rms_norm_eps": 1e-6}}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small run fastest on one thread: with two, every op waits for both, a long wait on busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(STYLES))
def style(request, tmp_path_factory) -> tuple[object, Path, Path]:
    """(transformers' model, its save_pretrained folder, that folder converted to a checkpoint folder)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=320, max_position_embeddings=4096,
                                      **STYLES[request.param])
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.generation_config.eos_token_id = None  # 32 tokens, as ours
    folder = tmp_path_factory.mktemp("hf")
    theirs.save_pretrained(folder)
    convert.main(["from-hf", str(folder), str(folder / "checkpoints")])
    return theirs, folder, folder / "checkpoints"


@pytest.mark.parametrize("seq", [64, 4096])
def test_imported_logits_equal_transformers(style, seq):
    theirs, _, checkpoints = style
    ours = weights.load_model(str(checkpoints))
    tokens = torch.randint(320, (1, seq), generator=torch.Generator().manual_seed(seq))
    with torch.no_grad():
        want, got = theirs(tokens).logits, ours(tokens)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("style", ["3.2"], indirect=True)
def test_a_writer_that_loads_ahead_converts_the_same_tensors(style, tmp_path, monkeypatch):
    """On a CUDA host DCP's writer loads tensors ahead of the one it writes: each is still written whole."""
    _, folder, checkpoints = style
    serial = fs._SerialCpuLoader.values
    monkeypatch.setattr(fs._SerialCpuLoader, "values", lambda loader: iter(list(serial(loader))))
    convert.main(["from-hf", str(folder), str(tmp_path / "checkpoints")])
    want, got = (weights.load_model(str(path)).state_dict() for path in (checkpoints, tmp_path / "checkpoints"))
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_round_trip_gives_back_config_and_tensors(style, tmp_path):
    """HF -> checkpoint -> HF: equal tensors, and a config.json that transformers reads as the same model (it writes
    rope_parameters where export writes rope_theta and rope_scaling, which transformers 4 and 5 both read)."""
    _, folder, checkpoints = style
    convert.main(["to-hf", str(checkpoints), str(tmp_path / "out")])
    want, got = load_file(folder / "model.safetensors"), load_file(tmp_path / "out/model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype
                                             for k in want)
    want, got = (transformers.AutoConfig.from_pretrained(path).to_dict() for path in (folder, tmp_path / "out"))
    used = [key for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                            "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rope_theta",
                            "rope_scaling", "rope_parameters", "rms_norm_eps", "tie_word_embeddings", "hidden_act",
                            "attention_bias", "mlp_bias") if key in want]
    assert {key: got[key] for key in used} == {key: want[key] for key in used} and len(used) >= 14


def test_greedy_tokens_equal_transformers_generate(style):
    theirs, _, checkpoints = style
    prompt = [72, 105, 33, 10, 300, 7]
    want = theirs.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
    assert generate.greedy(weights.load_model(str(checkpoints)), prompt, 32) == want and len(want) == 32


@pytest.mark.parametrize("style", ["3.2"], indirect=True)
def test_generate_command_continues_a_prompt_as_transformers_does(style, capsys):
    theirs, _, checkpoints = style
    generate.main([str(checkpoints), "--prompt", "Hi!", "--tokens", "32"])  # the byte tokenizer: 72 105 33
    want = theirs.generate(torch.tensor([[72, 105, 33]]), max_new_tokens=32, do_sample=False)[0, 3:].tolist()
    assert capsys.readouterr().out == "Hi!" + bytes(t for t in want if t < 256).decode(errors="replace") + "\n"


@pytest.mark.parametrize("style", ["3"], indirect=True)
@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn", "longrope"])
def test_unsupported_rope_types_are_refused_by_name(style, tmp_path, capsys, kind):
    _, folder, _ = style
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": kind, "factor": 2.0, "rope_theta": 500000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    message = f"config.json's RoPE type is '{kind}', which this model does not implement"
    with pytest.raises(SystemExit):
        convert.main(["from-hf", str(tmp_path), str(tmp_path / "checkpoints")])
    assert message in capsys.readouterr().err and not (tmp_path / "checkpoints").exists()
    with pytest.raises(ck.CheckpointError, match=message):
        weights.model_config_from_hf(tmp_path, ModelConfig())


@pytest.mark.slow
@pytest.mark.parametrize("style", ["3.2"], indirect=True)
def test_init_from_hf_sets_the_model_and_a_converted_checkpoint_resumes_the_same(style, tmp_path, capfd):
    """--checkpoint.init_from hf:DIR trains the model of its config.json, no --model flag given, and records every
    setting; a flag that disagrees is an error naming both values. Resuming the converted checkpoint of step 0
    (weights only) trains the same steps, from the same weights with a fresh optimizer."""
    _, folder, checkpoints = style
    flags = ["--checkpoint.init_from", f"hf:{folder}", "--data.source", "synthetic", "--data.num_workers", "0",
             "--train.seq_len", "32", "--train.micro_batch_size", "2", "--train.steps", "2", "--train.log_every", "1",
             "--parallel.param_dtype", "float32", "--metrics.no_tensorboard", "--checkpoint.async_mode", "none",
             "--eval.every", "0"]
    main([*flags, "--train.output_dir", str(tmp_path / "new")])
    saved = weights.saved_config(ck.step_dir(tmp_path / "new/checkpoints", 2)).model
    assert saved == weights.model_config_from_hf(folder, ModelConfig())
    config = json.loads((folder / "config.json").read_text())
    assert (saved.norm_eps, saved.rope_scaling.get("factor")) == (config["rms_norm_eps"],
                                                                  config["rope_parameters"].get("factor"))
    with pytest.raises(SystemExit) as exit_info:
        main([*flags, "--train.output_dir", str(tmp_path / "wrong"), "--model.norm_eps", "1e-4"])
    assert exit_info.value.code == 2 and (f"model.norm_eps=0.0001, but hf:{folder}/config.json, which sets the "
                                          "model, has rms_norm_eps 1e-05; remove --model.norm_eps") in capfd.readouterr().err

    shutil.copytree(checkpoints, tmp_path / "imported")
    main([*flags, "--train.output_dir", str(tmp_path / "resumed"), "--checkpoint.dir", str(tmp_path / "imported")])
    assert f"initialized the model from {tmp_path / 'imported/step_00000000'} (weights only)" in capfd.readouterr().err
    losses = [[json.loads(row)["loss"] for row in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
              for out in ("new", "resumed")]
    assert len(losses[0]) == 2 and losses[0] == losses[1]


@pytest.mark.parametrize("style", ["3.1"], indirect=True)
def test_explicit_model_settings_must_agree_with_config_json(style):
    _, folder, _ = style
    hf = weights.model_config_from_hf(folder, ModelConfig(name="8b", dim=64, n_layers=2))
    assert hf.dim == 64 and hf.max_seq_len == 4096 and hf.ffn_hidden_dim == 160
    for name, value, key in (("dim", 128, "hidden_size 64"), ("ffn_dim_multiplier", 1.3, "intermediate_size 160"),
                             ("rope_theta", 10000.0, "rope_theta 500000.0")):
        with pytest.raises(ConfigError, match=re.escape(f"model.{name}={value}, but hf:{folder}/config.json, which "
                                                        f"sets the model, has {key}; remove --model.{name}")):
            weights.model_config_from_hf(folder, ModelConfig(**{name: value}))


@pytest.mark.parametrize("style", ["3.2"], indirect=True)
def test_the_planner_plans_the_model_of_init_from_hf(style, capsys):
    _, folder, _ = style
    with pytest.raises(SystemExit):
        plan.main(["--checkpoint.init_from", f"hf:{folder}", "--gpus", "1", "--gpu-memory", "80GiB", "--json"])
    assert json.loads(capsys.readouterr().out)["num_params"] == weights.model_args_from_hf(folder).num_params()


# Published config.json values of the fields the model uses, and parameter counts (safetensors' total_size / 2).
LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
             "rope_scaling": None, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "hidden_act": "silu"}
LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64}
LLAMA32_1B = {**LLAMA3_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "head_dim": 64,
              "max_position_embeddings": 131072, "rope_scaling": {**LLAMA31_ROPE, "factor": 32.0},
              "tie_word_embeddings": True}
PUBLISHED = {
    "1b": (LLAMA32_1B, 1_235_814_400),
    "3b": ({**LLAMA32_1B, "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24, "head_dim": 128},
           3_212_749_824),
    "8b": (LLAMA3_8B, 8_030_261_248),
    "3.1-8b": ({**LLAMA3_8B, "max_position_embeddings": 131072, "rope_scaling": LLAMA31_ROPE}, 8_030_261_248),
    "70b": (LLAMA3_70B, 70_553_706_496),
    "3.1-70b": ({**LLAMA3_70B, "max_position_embeddings": 131072, "rope_scaling": LLAMA31_ROPE}, 70_553_706_496),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_are_the_published_models(name):
    published, params = PUBLISHED[name]
    args = ModelArgs.from_preset(name)
    config = weights.hf_config(args, torch.bfloat16)
    assert {key: config[key] for key in published} == published and args.num_params() == params


def test_generate_reads_a_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "<|end_of_text|>": 2, "[UNK]": 3},
                                                           unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    encode, decode, eos = generate.tokenizer(str(tmp_path / "tokenizer.json"))
    assert (encode("a b a"), decode([1, 0]), eos) == ([0, 1, 0], "b a", 2)
