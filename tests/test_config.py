"""Config loading, overrides and validation: every error names the field, the value and a fix."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from fsdp_trainer.config import (PATH_FIELDS, Config, ConfigError, check_output_dirs, grads_in_compute_pool, load_toml,
                                 mesh_shape, parse_args, to_toml, validate)
from fsdp_trainer import train
from fsdp_trainer.models.llama import model_args_from_config

from helpers import run_forked

ROOT = Path(__file__).resolve().parents[1]


def test_toml_sets_defaults_and_flags_override(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nsteps = 7\nseq_len = 64\n[optim]\nbetas = [0.8, 0.9]\n')
    cfg = parse_args(["--config", str(path), "--train.steps", "50"])
    assert (cfg.train.steps, cfg.train.seq_len, cfg.optim.betas) == (50, 64, (0.8, 0.9))
    assert cfg.model.name == "debug"  # untouched sections keep their defaults


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = parse_args(["--model.name", "1b", "--ac.mode", "op", "--train.steps", "3", "--model.norm_eps", "1e-6",
                      "--model.rope_scaling", "factor", "8", "low_freq_factor", "1", "high_freq_factor", "4",
                      "original_max_position_embeddings", "8192"])
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(cfg))
    again = load_toml(path)
    again.config = cfg.config
    assert again == cfg


def toml_error(tmp_path, text: str) -> tuple[Path, str]:
    """The ConfigError that loading this TOML text raises: (the file, the message)."""
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_toml(path)
    return path, str(err.value)


@pytest.mark.parametrize("text,expected", [
    ("[train]\nstep = 5\n", "unknown key 'train.step'; did you mean 'train.steps'?"),
    ("[trian]\nsteps = 5\n", "unknown key 'trian'; did you mean 'train'?"),
    ("[model]\nname = 'debug'\nn_layer = 2\n", "did you mean 'model.n_layers'?"),
])
def test_unknown_toml_key_names_key_file_and_closest_match(tmp_path, text, expected):
    path, message = toml_error(tmp_path, text)
    assert expected in message and str(path) in message


def test_missing_and_malformed_config_files(tmp_path):
    with pytest.raises(ConfigError, match=r"absent.toml: not a readable TOML file \(No such file or directory\)"):
        load_toml(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 1")
    with pytest.raises(ConfigError, match=r"bad.toml: not a readable TOML file \(Expected"):
        load_toml(bad)


@pytest.mark.parametrize("replicate,shard,world,expected", [
    (1, -1, 8, (1, 8)), (2, -1, 8, (2, 4)), (2, 4, 8, (2, 4)), (1, 1, 1, (1, 1)),
])
def test_mesh_shape(replicate, shard, world, expected):
    cfg = Config()
    cfg.parallel.dp_replicate, cfg.parallel.dp_shard = replicate, shard
    assert mesh_shape(cfg.parallel, world) == expected


@pytest.mark.parametrize("replicate,shard,world,message", [
    (3, -1, 8, "3 x 2 = 6, but this job has 8 ranks; set dp_shard=-1 (the rest) and a dp_replicate that divides it"),
    (2, 2, 8, "2 x 2 = 4, but this job has 8 ranks; set dp_shard=-1"),
    (4, 2, 6, "4 x 2 = 8, but this job has 6 ranks"),
    (0, -1, 8, "parallel.dp_replicate=0: must be at least 1"),
    (1, 0, 8, "1 x 0 = 0, but this job has 8 ranks; set dp_shard=-1"),
])
def test_impossible_mesh_is_rejected(replicate, shard, world, message):
    cfg = Config()
    cfg.parallel.dp_replicate, cfg.parallel.dp_shard = replicate, shard
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(cfg, world, "cpu")


@pytest.mark.parametrize("section,key,value,message", [
    ("train", "seq_len", 4096, "train.seq_len=4096 exceeds model.max_seq_len=1024"),
    ("train", "micro_batch_size", 0, "train.micro_batch_size=0: must be at least 1"),
    ("model", "name", "9b", "model.name='9b' is not a preset; choose one of debug, 125m"),
    ("model", "n_kv_heads", 3, "model.n_kv_heads=3 must divide model.n_heads=8"),
    ("optim", "min_lr", 1.0, "optim.lr=0.002, optim.min_lr=1.0: the cosine decay needs min_lr <= lr"),
    ("parallel", "compile", True, "parallel.compile needs a CUDA GPU"),
    ("parallel", "cpu_offload", True, "parallel.cpu_offload needs a CUDA GPU"),
    ("parallel", "param_dtype", "float16", "parallel.param_dtype=float16 needs a CUDA GPU"),
    ("memory", "limit_gib", 40.0, "memory.limit_gib needs a CUDA GPU"),
    ("memory", "oom_snapshot", True, "memory.oom_snapshot needs a CUDA GPU"),
    ("profile", "memory_snapshot", True, "profile.memory_snapshot records the steps of profile.steps, which is not"),
    ("parallel", "prefetch", 0, "parallel.prefetch=0: must be at least 1"),
    ("parallel", "offload_threads", -1, "parallel.offload_threads=-1: must be at least 0"),
    ("train", "loss_chunk_tokens", -1, "train.loss_chunk_tokens=-1: must be at least 0"),
    ("train", "gc_every", -1, "train.gc_every=-1: must be at least 0"),
    ("parallel", "keep_gathered", 5, "parallel.keep_gathered=5: must be between 0 and the model's 4 blocks"),
    ("checkpoint", "write_threads", 0, "checkpoint.write_threads=0: must be at least 1"),
    ("checkpoint", "keep", 0, "checkpoint.keep=0: must be at least 1"),
    ("model", "n_layers", 0, "model.n_layers=0: must be at least 1"),
    ("model", "n_heads", 0, "model.n_heads=0: must be at least 1"),
    ("train", "max_skipped_steps", -1, "train.max_skipped_steps=-1: must be at least 0"),
    ("memory", "limit_gib", -1.0, "memory.limit_gib=-1.0: must be > 0"),
    ("dist", "timeout_s", 0.0, "dist.timeout_s=0.0: must be at least 1"),
    ("dist", "init_timeout_s", 1e-7, "dist.init_timeout_s=1e-07: must be at least 1"),
    ("optim", "min_lr", -1e-4, "optim.min_lr=-0.0001: must be at least 0"),
    ("optim", "eps", 0.0, "optim.eps=0.0: must be > 0"),
    ("data", "path", "shards", "data.path=shards is set, but data.source=stdlib does not read it: add --data.source "
     "tokens"),
    ("train", "seed", 2 ** 47, "train.seed=140737488355328: must be between 0 and 2**44 - 1"),
    ("train", "seed", -1, "train.seed=-1: must be between 0"),
    ("dist", "timeout_s", float("inf"), "dist.timeout_s=inf: must be finite"),
    ("dist", "init_timeout_s", float("nan"), "dist.init_timeout_s=nan: must be finite"),
    ("optim", "lr", float("nan"), "optim.lr=nan: must be finite"),
    ("optim", "betas", (0.9, float("nan")), "optim.betas=(0.9, nan): must be finite"),
    ("optim", "grad_clip", float("inf"), "optim.grad_clip=inf: must be finite"),
    ("memory", "limit_gib", float("inf"), "memory.limit_gib=inf: must be finite"),
    ("model", "ffn_dim_multiplier", -1.0, "model.ffn_dim_multiplier=-1.0: must be a finite number > 0"),
    ("model", "ffn_dim_multiplier", 0.0, "model.ffn_dim_multiplier=0.0: must be a finite number > 0"),
    ("model", "rope_theta", 0.0, "model.rope_theta=0.0: must be a finite number > 0"),
    ("model", "rope_theta", -1.0, "model.rope_theta=-1.0: must be a finite number > 0"),
    ("profile", "steps", "5:201", "profile.steps=5:201 ends after train.steps=200"),
])
def test_invalid_settings_name_field_value_and_fix(section, key, value, message):
    cfg = Config()
    setattr(getattr(cfg, section), key, value)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(cfg, 1, "cpu")


@pytest.mark.parametrize("source", ["stdlib", "synthetic", "tokens"])
def test_data_path_is_refused_for_every_source_that_does_not_read_it(source):
    cfg = Config()
    cfg.data.path, cfg.data.source = "shards", source
    if source == "tokens":
        validate(cfg, 1, "cpu")
    else:
        with pytest.raises(ConfigError, match=re.escape(f"data.source={source} does not read it")):
            validate(cfg, 1, "cpu")


@pytest.mark.parametrize("section,key,value", [
    ("profile", "steps", "5:200"),  # the last step is traced too
    ("checkpoint", "keep", 1),
    ("optim", "betas", (0.0, 0.0)),
])
def test_settings_at_the_edge_of_their_range_are_accepted(section, key, value):
    cfg = Config()
    setattr(getattr(cfg, section), key, value)
    validate(cfg, 1, "cpu")


def test_selective_ac_must_checkpoint_some_block():
    cfg = parse_args(["--ac.mode", "selective", "--ac.every", "5"])  # the debug model has 4 blocks
    with pytest.raises(ConfigError, match="ac.every=5 with ac.mode=selective .* the model has 4: none would be"):
        validate(cfg, 1, "cpu")
    validate(parse_args(["--ac.mode", "selective", "--ac.every", "4"]), 1, "cpu")
    validate(parse_args(["--ac.mode", "op", "--ac.every", "5"]), 1, "cpu")  # every is selective's only


def test_a_teams_own_model_is_not_bounded_by_the_llama_preset_s_context_and_depth():
    """The debug preset's 1024 positions and 4 blocks describe the Llama only; a team's model is checked against its
    own once built (tools.model_checks.check_own_model)."""
    cfg = parse_args(["--train.seq_len", "4096", "--parallel.keep_gathered", "8", "--ac.mode", "selective",
                      "--ac.every", "8"])
    with pytest.raises(ConfigError, match="train.seq_len=4096 exceeds model.max_seq_len=1024"):
        validate(cfg, 1, "cpu")
    validate(cfg, 1, "cpu", own_model=True)


def test_a_constant_schedule_ignores_min_lr():
    cfg = parse_args(["--optim.lr", "1e-4", "--optim.schedule", "constant"])  # the default min_lr is above 1e-4
    assert cfg.optim.min_lr > cfg.optim.lr
    validate(cfg, 1, "cpu")


def test_keep_gathered_only_adds_to_the_default_reshard_policy():
    cfg = parse_args(["--parallel.keep_gathered", "2", "--parallel.reshard_after_forward", "never"])
    with pytest.raises(ConfigError, match="but reshard_after_forward=never; set one or the other"):
        validate(cfg, 1, "cpu")
    validate(parse_args(["--parallel.keep_gathered", "4"]), 1, "cpu")


@pytest.mark.parametrize("flags,applies", [
    ([], True),
    (["--train.grad_accum_steps", "2"], False),  # the second micro-batch adds into the gradient
    (["--train.grad_accum_steps", "2", "--parallel.defer_grad_sync"], True),  # one reduce-scatter per step
    (["--parallel.dp_replicate", "2"], False),  # HSDP all-reduces the output on another stream
    (["--parallel.reduce_dtype", "bfloat16"], False),  # cast to a new float32 tensor
    (["--parallel.cpu_offload"], False),  # copied to host
    (["--parallel.no_grads_in_compute_pool"], False),
])
def test_gradients_share_the_compute_pool_only_where_the_reduce_scatter_output_is_the_gradient(flags, applies):
    cfg = parse_args(flags)
    assert grads_in_compute_pool(cfg.parallel, cfg.train.grad_accum_steps) is applies


def test_every_shipped_config_loads_and_validates_for_gpus():
    for path in sorted((ROOT / "configs").glob("*.toml")):
        cfg = load_toml(path)
        validate(cfg, 8, "cuda")
        assert cfg.train.seq_len <= model_args_from_config(cfg.model).max_seq_len
    assert load_toml(ROOT / "configs" / "llama3_8b.toml").train.seq_len == 8192


def field_docstrings() -> dict[str, str]:
    """'section.field' -> the docstring under it in config.py, for every field of every section of Config."""
    tree = ast.parse((ROOT / "fsdp_trainer" / "config.py").read_text())
    classes = {node.name: node.body for node in tree.body if isinstance(node, ast.ClassDef)}
    docs = {}
    for section in dataclasses.fields(Config):
        if not dataclasses.is_dataclass(section.default_factory):
            continue
        body = classes[section.default_factory.__name__]
        for statement, after in zip(body, body[1:] + [None]):
            if isinstance(statement, ast.AnnAssign) and isinstance(after, ast.Expr):
                docs[f"{section.name}.{statement.target.id}"] = after.value.value
        assert set(docs) >= {f"{section.name}.{f.name}" for f in dataclasses.fields(section.default_factory)}
    return docs


def test_help_documents_every_flag(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--help"])  # as train.main's first step
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert text.startswith("usage: python -m fsdp_trainer.train")
    docs = field_docstrings()
    assert len(docs) > 60
    # Each flag's entry runs from the flag to the next one; bool flags read "--a.b, --a.no_b".
    where = {flag: re.search(rf"--{re.escape(flag)}[ ,]", text) for flag in docs}
    assert all(where.values()), [flag for flag, found in where.items() if not found]
    starts = sorted(found.start() for found in where.values())
    for flag, doc in docs.items():
        begin = where[flag].start()
        entry = text[begin:next((other for other in starts if other > begin), len(text))]
        assert " ".join(doc.split()[:6]) in entry, (flag, entry)


@pytest.mark.slow
def test_bad_config_exits_before_training_with_the_message(tmp_path):
    out = run_forked(train.main, ["--train.seq_len", "5000", "--train.output_dir", str(tmp_path / "never")])
    assert out.returncode == 2
    assert "train.seq_len=5000 exceeds model.max_seq_len=1024" in out.stderr
    assert not (tmp_path / "never").exists()


def test_bad_flag_value_is_rejected_by_the_cli(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--parallel.param_dtype", "bf16"])
    assert exit_.value.code != 0
    out = capsys.readouterr()
    assert "bfloat16" in out.out + out.err  # the valid choices are listed


@pytest.mark.parametrize("text,message", [
    ('[parallel]\nparam_dtype = "bf16"\n', "parallel.param_dtype = 'bf16': expected one of 'auto', 'bfloat16'"),
    ('[train]\nsteps = "10"\n', "train.steps = '10': expected int"),
    ('[train]\ndeterministic = 1\n', "train.deterministic = 1: expected bool"),
    ('[optim]\nbetas = [0.9]\n', "optim.betas = [0.9]: expected a list of 2 numbers"),
    ('[model]\ndim = 1.5\n', "model.dim = 1.5: expected int"),
    ('[model]\nrope_scaling = 8\n', "model.rope_scaling = 8: expected a table, such as {factor = 8.0}"),
    ('[model]\nrope_scaling = {factor = "8"}\n', "model.rope_scaling.factor = '8': expected float"),
])
def test_toml_values_are_type_checked_like_flags(tmp_path, text, message):
    assert message in toml_error(tmp_path, text)[1]


def test_home_folder_is_expanded_in_every_path_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    sections = {}
    for section, name in PATH_FIELDS:
        sections.setdefault(section, []).append(f'{name} = "~/{section}_{name}"')
    path = tmp_path / "run.toml"
    path.write_text("".join(f"[{section}]\n" + "\n".join(lines) + "\n" for section, lines in sections.items()))
    for cfg in (load_toml(path), parse_args(["--config", str(path)])):
        for section, name in PATH_FIELDS:
            assert getattr(getattr(cfg, section), name) == f"{tmp_path}/{section}_{name}"
    assert parse_args(["--train.output_dir=~/out"]).train.output_dir == f"{tmp_path}/out"  # no shell expands it


def output_dirs_cfg(tmp_path, *flags) -> Config:
    return parse_args(["--train.output_dir", str(tmp_path / "out"), *flags])


def test_output_and_checkpoint_folders_are_created_and_left_clean(tmp_path):
    check_output_dirs(output_dirs_cfg(tmp_path))
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["checkpoints"]
    assert not any((tmp_path / "out" / "checkpoints").iterdir())
    check_output_dirs(output_dirs_cfg(tmp_path, "--checkpoint.dir", str(tmp_path / "ckpt")))
    assert (tmp_path / "ckpt").is_dir() and not any((tmp_path / "ckpt").iterdir())


# The last: a run that saves only on a stop signal needs its checkpoint folder as much.
@pytest.mark.parametrize("flag,field,extra", [
    ("--train.output_dir", "train.output_dir", ()),
    ("--checkpoint.dir", "checkpoint.dir", ()),
    ("--checkpoint.dir", "checkpoint.dir", ("--checkpoint.interval", "0", "--checkpoint.no_save_final")),
])
def test_folders_that_cannot_be_written_are_refused_before_training(tmp_path, flag, field, extra):
    (tmp_path / "a_file").write_text("")
    for folder in (tmp_path / "a_file", tmp_path / "a_file" / "sub"):
        with pytest.raises(ConfigError, match=re.escape(f"{field}: cannot create or write the folder {folder} "
                                                        "(a file is in the way); choose a folder")):
            check_output_dirs(output_dirs_cfg(tmp_path, flag, str(folder), *extra))


@pytest.mark.slow
def test_unwritable_checkpoint_folder_exits_at_start_up(tmp_path):
    (tmp_path / "a_file").write_text("")
    out = run_forked(train.main, ["--checkpoint.dir", str(tmp_path / "a_file"), "--train.steps", "1",
                                  "--train.output_dir", str(tmp_path / "out")])
    assert out.returncode == 2
    assert f"checkpoint.dir: cannot create or write the folder {tmp_path / 'a_file'}" in out.stderr
    assert "Traceback" not in out.stderr and "step" not in out.stderr


def test_toml_numbers_are_coerced_where_a_float_is_expected(tmp_path):
    path = tmp_path / "ok.toml"
    path.write_text('[optim]\nlr = 1\nbetas = [0.9, 1]\n[memory]\nlimit_gib = 40\n')
    cfg = load_toml(path)
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float) and cfg.optim.betas == (0.9, 1.0)
    assert cfg.memory.limit_gib == 40.0


def test_the_last_of_two_config_files_is_the_one_read(tmp_path):
    """As for every other flag, the last --config wins (a wrapper script's --config, then the user's), and the
    settings read are those of the file that cfg.config names."""
    first, last = tmp_path / "first.toml", tmp_path / "last.toml"
    first.write_text("[train]\nsteps = 7\n")
    last.write_text("[train]\nsteps = 9\n")
    for argv in (["--config", str(first), "--config", str(last)], ["--config", str(first), f"--config={last}"]):
        cfg = parse_args(argv)
        assert (cfg.config, cfg.train.steps) == (last, 9)


def test_config_file_path_expands_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "run.toml").write_text("[train]\nsteps = 7\n")
    assert parse_args(["--config=~/run.toml"]).train.steps == 7  # no shell expands ~ after =


def test_a_config_key_in_a_toml_file_is_refused_not_ignored(tmp_path):
    (tmp_path / "base.toml").write_text("[train]\nsteps = 7\n")
    _, message = toml_error(tmp_path, 'config = "base.toml"\n[train]\nseq_len = 64\n')
    assert "unknown key 'config'; valid keys: model, data, train" in message
