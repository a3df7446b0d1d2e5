"""Data: shards, sample content and order, world-size independent steps, resume, errors (CPU, seconds)."""

import json
import multiprocessing
import os
import pickle
import resource
import subprocess
import sys
import threading
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from fsdp_trainer import train
from fsdp_trainer.config import ConfigError, DataConfig
from fsdp_trainer.data import (BYTE_EOS, DataError, SampleOrder, StepSampler, SyntheticTokens, build_dataloader,
                               build_dataset, check_enough_samples, load_shards, samples_per_step, stdlib_shards,
                               stop_workers, write_atomic, write_shard)

from helpers import run_forked

SEQ_LEN = 8
NUM_SAMPLES = 40
VOCAB = 1000


def write_arange_shards(folder: Path, num_tokens: int, sizes=(100, 0, 150), vocab_size: int = VOCAB) -> None:
    """Tokens 0, 1, 2, ... split over shards of the given sizes (the rest in a last one): window k starts with
    token k*SEQ_LEN, so a sample names itself."""
    folder.mkdir(parents=True, exist_ok=True)
    tokens = np.arange(num_tokens)
    cuts = np.cumsum(sizes)
    for i, part in enumerate(np.split(tokens, cuts)):
        write_shard(folder / f"part_{i:02d}.bin", part, vocab_size, "bytes")


@pytest.fixture
def shards(tmp_path) -> Path:
    write_arange_shards(tmp_path / "shards", NUM_SAMPLES * SEQ_LEN + 1)
    return tmp_path / "shards"


def tokens_cfg(path, **kwargs) -> DataConfig:
    return DataConfig(**{"source": "tokens", "path": str(path), "num_workers": 0, **kwargs})


def run_steps(cfg, *, b, accum, dp, steps, start_sample=0, seq_len=SEQ_LEN):
    """Per step, the window ids of all ranks together in global-index order (micro-batch, then rank, then j)."""
    dataset = build_dataset(cfg, seq_len, VOCAB)
    loaders = [iter(build_dataloader(dataset, num_workers=cfg.num_workers, micro_batch_size=b, grad_accum_steps=accum,
                                     dp_rank=r, dp_size=dp, start_sample=start_sample)) for r in range(dp)]
    result = []
    for _ in range(steps):
        ids = []
        for _ in range(accum):
            for it in loaders:
                inputs, labels = next(it)
                assert inputs.shape == labels.shape == (b, seq_len) and inputs.dtype == torch.int64
                ids += (inputs[:, 0] // seq_len).tolist()
        result.append(ids)
    return result


# ------------------------------------------------------------------------------------------------ sample content

@pytest.mark.parametrize("num_tokens", [NUM_SAMPLES * SEQ_LEN, NUM_SAMPLES * SEQ_LEN + 1, NUM_SAMPLES * SEQ_LEN + 5])
def test_windows_are_non_overlapping_and_cross_shards(tmp_path, num_tokens):
    write_arange_shards(tmp_path, num_tokens, sizes=(13, 0, 50))
    dataset = build_dataset(tokens_cfg(tmp_path), SEQ_LEN, VOCAB)
    assert dataset.num_samples == (num_tokens - 1) // SEQ_LEN
    for k in range(dataset.num_samples):
        inputs, labels = dataset.window(k)
        window = torch.arange(k * SEQ_LEN, k * SEQ_LEN + SEQ_LEN + 1)
        assert torch.equal(inputs, window[:-1]) and torch.equal(labels, window[1:])


def test_reading_holds_no_file_open_per_shard(tmp_path, monkeypatch):
    """Folders of more shards than the open-file limit (`ulimit -n`, often 1024) must be readable."""
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", lambda fd: None)  # 800 files to write: their durability is not in question here
        write_arange_shards(tmp_path, 400, sizes=(1,) * 399)
    dataset = build_dataset(tokens_cfg(tmp_path), SEQ_LEN, VOCAB)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 100, hard))
    try:
        windows = torch.cat([dataset.window(k)[0] for k in range(dataset.num_samples)])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert windows.tolist() == dataset.stream.read(0, len(windows)).tolist()


def test_other_json_files_beside_the_shards_are_left_alone(shards):
    """Only a shard's own sidecar is read; a tokenizer or a corpus's statistics beside the shards are not."""
    (shards / "tokenizer.json").write_text('{"model": {}}')
    (shards / "stats.json").write_text('{"num_tokens": 100, "num_documents": 3}')
    assert len(load_shards(str(shards))) == NUM_SAMPLES * SEQ_LEN + 1


def test_shards_are_read_in_the_order_of_the_numbers_in_their_names(tmp_path):
    """prepare pads shard numbers to 5 digits: shard_100000 comes after shard_99999, not before shard_10001."""
    for number, token in ((10001, 1), (99999, 2), (100000, 3), (9, 0)):
        write_shard(tmp_path / f"shard_{number:05d}.bin", np.array([token]), VOCAB, "bytes")
    assert load_shards(str(tmp_path)).read(0, 4).tolist() == [0, 1, 2, 3]


def test_a_shard_cut_short_during_the_run_is_named(tmp_path):
    write_arange_shards(tmp_path, 100, sizes=(50,))
    dataset = build_dataset(tokens_cfg(tmp_path), SEQ_LEN, VOCAB)
    (tmp_path / "part_01.bin").write_bytes((tmp_path / "part_01.bin").read_bytes()[:60])
    with pytest.raises(DataError, match=f"shard {tmp_path / 'part_01.bin'} is shorter than the 50 tokens"):
        dataset.window(dataset.num_samples - 1)


@pytest.mark.parametrize("how,reason", [("removed", "No such file or directory"), ("replaced", "Is a directory")])
def test_a_shard_removed_or_unreadable_during_the_run_is_named(tmp_path, how, reason):
    """A cleanup job or a re-sync after start-up: the trainer's one-line error, not a worker's traceback."""
    write_arange_shards(tmp_path, 100, sizes=(50,))
    dataset = build_dataset(tokens_cfg(tmp_path), SEQ_LEN, VOCAB)
    (tmp_path / "part_01.bin").unlink()
    if how == "replaced":  # opens, then fails to read
        (tmp_path / "part_01.bin").mkdir()
    with pytest.raises(DataError, match=f"cannot read shard {tmp_path / 'part_01.bin'} \\({reason}\\): it was removed "
                                        "or made unreadable after start-up; restore it and resume"):
        dataset.window(dataset.num_samples - 1)


def test_stream_pickles_without_its_data(tmp_path):
    write_arange_shards(tmp_path, 50_000, sizes=(20_000,), vocab_size=50_000)
    stream = load_shards(str(tmp_path))
    stream.read(0, 50_000)
    assert len(pickle.dumps(stream)) < 5_000  # a pickled memmap would carry all 100 kB of tokens


# --------------------------------------------------------------------------------------------------------- order

def test_order_is_a_pure_function_of_seed_and_index(shards):
    indices = list(range(3 * NUM_SAMPLES))
    forward = [SampleOrder(NUM_SAMPLES, seed=5)(g) for g in indices]
    shuffled = SampleOrder(NUM_SAMPLES, seed=5)
    backward = [shuffled(g) for g in reversed(indices)][::-1]
    assert forward == backward
    assert forward != [SampleOrder(NUM_SAMPLES, seed=6)(g) for g in indices]
    assert forward[:NUM_SAMPLES] != list(range(NUM_SAMPLES))  # shuffled at all

    a, b = (build_dataset(tokens_cfg(shards, seed=5), SEQ_LEN, VOCAB) for _ in range(2))
    for g in (77, 3, 41, 0, 119):
        assert torch.equal(a[g][0], b[g][0])
        assert a[g][0][0] // SEQ_LEN == forward[g]


@pytest.mark.parametrize("num_samples", [1, 2, 3, 5, 16, 17, 1000, 4097])
def test_order_visits_every_sample_once_per_epoch(num_samples):
    order = SampleOrder(num_samples, seed=3)
    epochs = [[order(epoch * num_samples + i) for i in range(num_samples)] for epoch in range(3)]
    assert all(sorted(epoch) == list(range(num_samples)) for epoch in epochs)
    assert num_samples < 5 or epochs[0] != epochs[1]  # each epoch its own order


def test_order_is_computed_per_index_without_storing_a_permutation():
    """A permutation of 10^12 samples would take 8 TB: the order of a trillion-sample dataset costs nothing to hold."""
    order = SampleOrder(10**12, seed=0)
    picked = [order(g) for g in (0, 1, 5 * 10**12 + 7)]
    assert all(0 <= k < 10**12 for k in picked) and len(set(picked)) == 3


def test_order_looks_uniformly_random():
    """Over 5,000 epochs each of 10 samples comes first about 500 times (binomial sd 21); in one epoch of 1,000,
    half the neighbours ascend, and samples move n/3 on average, as in a uniformly drawn permutation."""
    first = Counter(SampleOrder(10, seed=1)(10 * epoch) for epoch in range(5000))
    assert len(first) == 10 and all(400 < count < 600 for count in first.values()), first
    order = SampleOrder(1000, seed=2)
    epoch = [order(i) for i in range(1000)]
    assert 0.45 < sum(a < b for a, b in zip(epoch, epoch[1:])) / 999 < 0.55
    assert 300 < sum(abs(k - i) for i, k in enumerate(epoch)) / 1000 < 367


def test_identity_names_what_the_order_depends_on(shards, tmp_path):
    """A checkpoint keeps the dataset's identity, and resume compares it: the same shards moved elsewhere are the same
    data; another seed, or shards split or sized otherwise, are not."""
    identity = build_dataset(tokens_cfg(shards), SEQ_LEN, VOCAB).identity()
    moved = shards.rename(tmp_path / "moved")
    assert build_dataset(tokens_cfg(moved), SEQ_LEN, VOCAB).identity() == identity
    assert build_dataset(tokens_cfg(moved, seed=1), SEQ_LEN, VOCAB).identity() != identity
    write_arange_shards(tmp_path / "resplit", NUM_SAMPLES * SEQ_LEN + 1, sizes=(150, 100))
    assert build_dataset(tokens_cfg(tmp_path / "resplit"), SEQ_LEN, VOCAB).identity() != identity
    write_arange_shards(tmp_path / "longer", NUM_SAMPLES * SEQ_LEN + 2)
    assert build_dataset(tokens_cfg(tmp_path / "longer"), SEQ_LEN, VOCAB).identity() != identity
    assert SyntheticTokens(SEQ_LEN, 50, seed=1).identity() != SyntheticTokens(SEQ_LEN, 50, seed=2).identity()


def test_synthetic_is_a_pure_function_of_seed_and_index():
    a, b = SyntheticTokens(SEQ_LEN, 50, seed=1), SyntheticTokens(SEQ_LEN, 50, seed=1)
    first = [a[g][0] for g in (0, 1, 2**40)]
    assert all(torch.equal(x, b[g][0]) for x, g in zip(first, (0, 1, 2**40)))
    assert not torch.equal(first[0], first[1])
    assert not torch.equal(first[0], SyntheticTokens(SEQ_LEN, 50, seed=2)[0][0])
    inputs, labels = a[7]
    assert torch.equal(inputs[1:], labels[:-1]) and 0 <= inputs.min() and labels.max() < 50


# ---------------------------------------------------------------------------- steps and world-size independence

SPLITS_OF_8 = [(8, 1, 1), (4, 2, 1), (2, 2, 2), (2, 1, 4), (1, 2, 4)]  # (micro_batch, accum, dp): G = 8


@pytest.mark.parametrize("b,accum,dp", SPLITS_OF_8)
def test_each_step_covers_exactly_its_global_indices(b, accum, dp):
    G, start = samples_per_step(b, accum, dp), 5
    iters = [iter(StepSampler(b, accum, r, dp, start_sample=start)) for r in range(dp)]
    for step in range(3):
        per_rank = [[g for _ in range(accum) for g in next(it)] for it in iters]
        flat = [g for rank in per_rank for g in rank]
        assert len(flat) == len(set(flat)) == G  # disjoint across ranks and micro-batches
        assert set(flat) == set(range(start + step * G, start + step * G + G))


def test_micro_batch_layout():
    it = iter(StepSampler(micro_batch_size=2, grad_accum_steps=2, dp_rank=1, dp_size=2, start_sample=0))
    assert [next(it) for _ in range(3)] == [[2, 3], [6, 7], [10, 11]]


def test_steps_do_not_depend_on_how_the_global_batch_is_split(shards):
    cfg = tokens_cfg(shards)
    reference = run_steps(cfg, b=8, accum=1, dp=1, steps=7)
    for b, accum, dp in SPLITS_OF_8[1:]:
        assert run_steps(cfg, b=b, accum=accum, dp=dp, steps=7) == reference, (b, accum, dp)


def test_epoch_boundary_neither_drops_nor_repeats(shards):
    steps = run_steps(tokens_cfg(shards), b=3, accum=1, dp=2, steps=2 * NUM_SAMPLES // 6 + 1)  # G=6 straddles epochs
    order = [i for step in steps for i in step]
    first, second = order[:NUM_SAMPLES], order[NUM_SAMPLES:2 * NUM_SAMPLES]
    assert sorted(first) == sorted(second) == list(range(NUM_SAMPLES))
    assert first != second  # each epoch its own permutation


def test_resume_on_another_world_size(shards):
    cfg, G, k = tokens_cfg(shards), 8, 3
    uninterrupted = run_steps(cfg, b=2, accum=1, dp=4, steps=k + 6)
    resumed = run_steps(cfg, b=2, accum=2, dp=2, steps=6, start_sample=k * G)
    assert [sorted(s) for s in resumed] == [sorted(s) for s in uninterrupted[k:]]
    assert sorted(uninterrupted[0]) != sorted(uninterrupted[k])  # the comparison above can tell steps apart


def test_resume_with_another_global_batch_neither_skips_nor_repeats(shards):
    """A run resumed from its consumed-sample count with another global batch, on another number of ranks, reads
    the samples an uninterrupted run would, in the same order: no sample skipped or repeated, every epoch whole."""
    cfg = tokens_cfg(shards)
    segments = [(3, 1, 2, 5), (4, 1, 3, 4), (5, 1, 1, 3), (2, 3, 2, 4)]  # (b, accum, dp, steps): G = 6, 12, 5, 12
    consumed, read = 0, []
    for b, accum, dp, steps in segments:
        for step in run_steps(cfg, b=b, accum=accum, dp=dp, steps=steps, start_sample=consumed):
            read += step
            consumed += samples_per_step(b, accum, dp)
    order = SampleOrder(NUM_SAMPLES, seed=cfg.seed)
    assert consumed == 141 and read == [order(g) for g in range(consumed)]
    assert all(sorted(read[e * NUM_SAMPLES:(e + 1) * NUM_SAMPLES]) == list(range(NUM_SAMPLES))
               for e in range(consumed // NUM_SAMPLES))


def test_a_global_batch_larger_than_the_data_is_refused(shards):
    dataset = build_dataset(tokens_cfg(shards), SEQ_LEN, VOCAB)
    check_enough_samples(dataset, micro_batch_size=5, grad_accum_steps=4, dp_size=2)  # G = 40: every sample once
    with pytest.raises(ConfigError) as info:
        check_enough_samples(dataset, micro_batch_size=7, grad_accum_steps=3, dp_size=2)
    assert str(info.value) == (
        f"data.path={shards}: holds 40 samples of train.seq_len={SEQ_LEN} tokens, fewer than the global batch of 42 "
        "(train.micro_batch_size=7 x train.grad_accum_steps=3 x 2 data-parallel ranks), so every step would read "
        "some samples twice; lower --train.micro_batch_size or --train.grad_accum_steps, use fewer ranks, or add data")
    check_enough_samples(SyntheticTokens(SEQ_LEN, VOCAB, seed=0), micro_batch_size=2**20, grad_accum_steps=1,
                         dp_size=8)


@pytest.mark.slow
def test_the_trainer_refuses_a_global_batch_larger_than_the_data_before_it_starts(shards, tmp_path):
    out = run_forked(train.main, ["--data.source", "tokens", "--data.path", str(shards), "--model.vocab_size",
                                  str(VOCAB), "--train.seq_len", str(SEQ_LEN), "--train.micro_batch_size", "41",
                                  "--train.output_dir", str(tmp_path / "run")])
    assert out.returncode == 2 and "fewer than the global batch of 41" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr


def test_sampler_lays_out_each_step_micro_batch_major_from_the_start_sample():
    # Steps of G = 2 micro-batches x 2 ranks x 2 samples = 8, from sample 4; rank 1 takes the second b of each
    # micro-batch's dp_size * b.
    sampler = iter(StepSampler(micro_batch_size=2, grad_accum_steps=2, dp_rank=1, dp_size=2, start_sample=4))
    assert [next(sampler) for _ in range(4)] == [[6, 7], [10, 11], [14, 15], [18, 19]]


@pytest.mark.slow
def test_loader_with_a_worker_matches_in_process_loading(shards):
    in_process = run_steps(tokens_cfg(shards), b=2, accum=2, dp=2, steps=12)
    with_workers = run_steps(tokens_cfg(shards, num_workers=1), b=2, accum=2, dp=2, steps=12)
    assert with_workers == in_process


def test_synthetic_loader(tmp_path):
    cfg = DataConfig(source="synthetic", num_workers=0)
    inputs, labels = next(iter(build_dataloader(build_dataset(cfg, 16, 32), num_workers=0, micro_batch_size=4,
                                                grad_accum_steps=1, dp_rank=0, dp_size=1)))
    assert inputs.shape == (4, 16) and inputs.max() < 32 and torch.equal(inputs[:, 1:], labels[:, :-1])


# --------------------------------------------------------------------------------------------------------- stdlib

def fake_stdlib(root: Path) -> list[bytes]:
    """A small tree shaped like a standard library; returns the documents the corpus must hold, in order."""
    files = {"os.py": b"import sys\n", "json/__init__.py": b"# json\n", "json/decoder.py": b"x = 1\n",
             "site-packages/third.py": b"no", "__pycache__/os.py": b"no", "README.txt": b"no"}
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(content)
    return [files["json/__init__.py"], files["json/decoder.py"], files["os.py"]]


def joined(docs: list[bytes]) -> list[int]:
    return [t for i, doc in enumerate(docs) for t in ([BYTE_EOS] if i else []) + list(doc)]


def test_stdlib_corpus_is_cached_and_keyed_by_file_list(tmp_path):
    docs = fake_stdlib(tmp_path / "lib")
    out = stdlib_shards(str(tmp_path / "cache"), root=str(tmp_path / "lib"))
    stream = load_shards(str(out))
    assert stream.read(0, len(stream)).tolist() == joined(docs)
    mtime = (out / "shard_00000.bin").stat().st_mtime_ns
    assert stdlib_shards(str(tmp_path / "cache"), root=str(tmp_path / "lib")) == out
    assert (out / "shard_00000.bin").stat().st_mtime_ns == mtime  # reused, not rewritten
    (tmp_path / "lib" / "new.py").write_text("y = 2\n")
    assert stdlib_shards(str(tmp_path / "cache"), root=str(tmp_path / "lib")) != out


def test_stdlib_corpus_survives_racing_writers(tmp_path):
    docs = fake_stdlib(tmp_path / "lib")
    results = []
    def rank():
        results.append(stdlib_shards(str(tmp_path / "cache"), str(tmp_path / "lib")))

    threads = [threading.Thread(target=rank) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and len(set(results)) == 1
    stream = load_shards(str(results[0]))
    assert stream.read(0, len(stream)).tolist() == joined(docs)
    assert not list(results[0].glob(".*"))  # every temporary file was renamed into place


@pytest.fixture(scope="module")
def real_stdlib_cache(tmp_path_factory) -> str:
    cache = tmp_path_factory.mktemp("cache")
    stdlib_shards(str(cache))
    return str(cache)


@pytest.mark.parametrize("num_workers", [0, pytest.param(1, marks=pytest.mark.slow)])  # 1: a worker process
def test_starting_the_loader_leaves_the_global_random_stream_alone(num_workers):
    """A resume restores the random state, then starts the loader: it must not draw from that state."""
    state = torch.get_rng_state()
    loader = build_dataloader(build_dataset(DataConfig(source="synthetic"), 16, 32), num_workers=num_workers,
                              micro_batch_size=2, grad_accum_steps=1, dp_rank=0, dp_size=1)
    batches = iter(loader)
    next(batches)
    assert torch.equal(torch.get_rng_state(), state)
    stop_workers(batches)


def test_real_stdlib_source(real_stdlib_cache):
    cfg = DataConfig(source="stdlib", cache_dir=real_stdlib_cache, num_workers=0)
    assert "tokens (bytes)" in repr(build_dataset(cfg, 256, 257))
    inputs, _ = next(iter(build_dataloader(build_dataset(cfg, 256, 257), num_workers=0, micro_batch_size=2,
                                           grad_accum_steps=1, dp_rank=0, dp_size=1)))
    assert inputs.max() <= BYTE_EOS


def rank_main(rank: int, shards: str, lib: str, cache: str):
    """One data-parallel rank in its own process: races for the stdlib cache, then loads its share of 3 steps."""
    stdlib_shards(cache, root=lib)
    cfg = tokens_cfg(shards)
    it = iter(build_dataloader(build_dataset(cfg, SEQ_LEN, VOCAB), num_workers=cfg.num_workers, micro_batch_size=2,
                               grad_accum_steps=1, dp_rank=rank, dp_size=2))
    return [(next(it)[0][:, 0] // SEQ_LEN).tolist() for _ in range(3)]


@pytest.mark.slow
def test_several_processes(shards, tmp_path):
    fake_stdlib(tmp_path / "lib")
    args = (str(shards), str(tmp_path / "lib"), str(tmp_path / "cache"))
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        per_rank = list(pool.map(rank_main, [0, 1], *[[a, a] for a in args]))
    expected = run_steps(tokens_cfg(shards), b=4, accum=1, dp=1, steps=3)
    assert [r0 + r1 for r0, r1 in zip(*per_rank)] == expected


# --------------------------------------------------------------------------------------------------------- errors

def corrupt(folder: Path, how: str) -> None:
    write_arange_shards(folder, 100, sizes=(50,))
    if how == "no sidecar":
        (folder / "part_01.json").unlink()
    elif how == "not json":
        (folder / "part_01.json").write_text("{oops")
    elif how == "bad dtype":
        (folder / "part_01.json").write_text(json.dumps({"dtype": "int8", "num_tokens": 50, "vocab_size": VOCAB,
                                                         "tokenizer": "bytes"}))
    elif how == "truncated":
        data = (folder / "part_01.bin").read_bytes()
        (folder / "part_01.bin").write_bytes(data[:-2])
    elif how == "broken link":
        (folder / "part_01.bin").unlink()
        (folder / "part_01.bin").symlink_to(folder / "elsewhere.bin")


@pytest.mark.parametrize("how,message", [("no sidecar", "cannot read .*part_01.json \\(No such file"), ("not json", "corrupt"),
                                         ("bad dtype", "corrupt"), ("truncated", "98 bytes"),
                                         ("broken link", "cannot read .*part_01.bin \\(No such file")])
def test_broken_shards_are_refused(tmp_path, how, message):
    corrupt(tmp_path, how)
    with pytest.raises(ConfigError, match=f"data.path={tmp_path}.*{message}"):
        build_dataset(tokens_cfg(tmp_path), SEQ_LEN, VOCAB)


def test_an_unreadable_sidecar_is_refused_with_the_fix(tmp_path, monkeypatch):
    """Like an unreadable shard: a one-line ConfigError, not a traceback on every rank. Root, who runs the tests,
    can read any file, so the read is made to fail as it does for a user without read permission."""
    write_arange_shards(tmp_path, 100, sizes=(50,))
    sidecar, real_read_text = tmp_path / "part_01.json", Path.read_text

    def read_text(path, *args, **kwargs):
        if path == sidecar:
            raise PermissionError(13, "Permission denied", str(path))
        return real_read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    message = f"data.path={tmp_path}: cannot read {sidecar} \\(Permission denied\\); make it readable, or re-"
    with pytest.raises(ConfigError, match=message):
        build_dataset(tokens_cfg(tmp_path), SEQ_LEN, VOCAB)


def test_a_uint16_sidecar_of_a_larger_vocabulary_is_refused(tmp_path):
    """Converted Llama-3 ids stored as uint32 under a hand-written uint16 sidecar pass the size check, and would be
    read as pairs of small ids, all inside the vocabulary."""
    write_shard(tmp_path / "llama3.bin", np.array([128000, 791, 4062]), 128256, "llama3")
    (tmp_path / "llama3.json").write_text(json.dumps({"dtype": "uint16", "num_tokens": 6, "vocab_size": 128256,
                                                      "tokenizer": "llama3"}))
    with pytest.raises(ConfigError, match="sidecar llama3.json says dtype uint16, which cannot hold the ids of its "
                                          "vocab_size 128256; re-create it .* set \"dtype\": \"uint32\""):
        build_dataset(tokens_cfg(tmp_path), 2, 128256)


def test_setting_errors_name_the_field(tmp_path):
    def error(cfg, seq_len=SEQ_LEN, vocab_size=VOCAB) -> str:
        with pytest.raises(ConfigError) as info:
            build_dataset(cfg, seq_len, vocab_size)
        return str(info.value)

    assert "data.path is not set" in error(DataConfig(source="tokens"))
    missing = error(tokens_cfg(tmp_path / "nope"))
    assert "data.path=" in missing and "does not exist" in missing
    (tmp_path / "empty").mkdir()
    assert "no token shards" in error(tokens_cfg(tmp_path / "empty"))
    (tmp_path / "file.bin").write_bytes(b"")
    assert "is a file" in error(tokens_cfg(tmp_path / "file.bin"))

    (tmp_path / "zero").mkdir()
    write_shard(tmp_path / "zero" / "a.bin", np.array([], np.uint16), VOCAB, "bytes")
    assert "holds 0 tokens" in error(tokens_cfg(tmp_path / "zero"))

    write_arange_shards(tmp_path / "short", 10)
    short = error(tokens_cfg(tmp_path / "short"), seq_len=16)
    assert "data.path=" in short and "holds 10 tokens" in short and "train.seq_len=16" in short and "17" in short
    assert "at most 9" in short

    write_arange_shards(tmp_path / "big_vocab", 100, vocab_size=70000)
    vocab = error(tokens_cfg(tmp_path / "big_vocab"), vocab_size=32000)
    assert "model.vocab_size=32000" in vocab and "--model.vocab_size 70000" in vocab
    assert json.loads((tmp_path / "big_vocab" / "part_00.json").read_text())["dtype"] == "uint32"

    write_arange_shards(tmp_path / "mixed", 100, sizes=(50,))
    meta = json.loads((tmp_path / "mixed" / "part_01.json").read_text())
    (tmp_path / "mixed" / "part_01.json").write_text(json.dumps({**meta, "tokenizer": "other.json"}))
    assert "different tokenizers" in error(tokens_cfg(tmp_path / "mixed"))

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert "data.cache_dir=" in error(DataConfig(source="stdlib", cache_dir=str(blocker / "cache")))


def test_stdlib_needs_257_tokens(real_stdlib_cache):
    with pytest.raises(ConfigError, match="model.vocab_size=256.*--model.vocab_size 257"):
        build_dataset(DataConfig(source="stdlib", cache_dir=real_stdlib_cache), 256, 256)


def write_false_shard(bin_path: Path, tokens: np.ndarray, vocab_size: int) -> None:
    """A uint16 byte shard whose sidecar says vocab_size, whatever its ids (as a writer of its own might)."""
    write_shard(bin_path, tokens, 2**16, "bytes")
    meta = json.loads(bin_path.with_suffix(".json").read_text())
    bin_path.with_suffix(".json").write_text(json.dumps({**meta, "vocab_size": vocab_size}))


def write_bad_token_shards(folder: Path) -> None:
    """One sample of SEQ_LEN + 1 byte tokens over two shards, whose sidecars say vocab 257, with id 60000 at token 2
    of the second shard: the sidecars pass the start-up check, the contents do not."""
    tokens = np.arange(SEQ_LEN + 1)
    tokens[6] = 60000
    folder.mkdir()
    write_false_shard(folder / "a.bin", tokens[:4], 257)
    write_false_shard(folder / "b.bin", tokens[4:], 257)


@pytest.mark.parametrize("num_workers", [0, pytest.param(1, marks=pytest.mark.slow)])  # 1: a worker process
def test_token_ids_past_the_vocabulary_are_refused_when_read(tmp_path, num_workers):
    write_bad_token_shards(tmp_path / "bad")
    cfg = tokens_cfg(tmp_path / "bad", num_workers=num_workers)
    build_dataset(cfg, SEQ_LEN, 257)  # a scan of the contents at start-up would take too long on real data
    loader = build_dataloader(build_dataset(cfg, SEQ_LEN, 257), num_workers=num_workers, micro_batch_size=1,
                              grad_accum_steps=1, dp_rank=0, dp_size=1)
    batches = iter(loader)
    try:
        with pytest.raises(DataError) as info:
            next(batches)
    finally:
        stop_workers(batches)
    message = str(info.value)  # just the message, also when a worker raised it
    assert message.startswith(f"data.path={tmp_path / 'bad'}: token 2 of shard {tmp_path / 'bad' / 'b.bin'} is id "
                              "60000, but its sidecar b.json says vocab_size 257")
    assert "python -m fsdp_trainer.tools.prepare" in message and "set vocab_size 60001 or more there" in message
    assert "Traceback" not in message


def test_ids_are_checked_against_their_shard_s_vocabulary(tmp_path):
    """Not only the model's: byte data holding id 300 would train silently on the debug model's 512 ids. build_dataset
    refuses a sidecar above the model's vocabulary, so the sidecar's bound is the smaller one."""
    tokens = np.arange(SEQ_LEN + 1)
    tokens[5] = 300
    write_false_shard(tmp_path / "a.bin", tokens, 257)
    dataset = build_dataset(tokens_cfg(tmp_path), SEQ_LEN, 512)  # byte data on the debug model's vocabulary
    with pytest.raises(DataError, match="token 5 of shard .*a.bin is id 300, but its sidecar a.json says vocab_size "
                                        "257, so the shard is corrupt or its sidecar wrong; re-create it"):
        dataset.window(0)

    write_false_shard(tmp_path / "a.bin", tokens, 400)
    assert build_dataset(tokens_cfg(tmp_path), SEQ_LEN, 400).window(0)[0].tolist() == tokens[:-1].tolist()


@pytest.mark.slow
def test_a_loader_left_running_does_not_hang_the_exit(shards):
    """Workers ignore SIGTERM, with which Python's exit stops leftover children before waiting for them: a process
    that ends while it still references a running loader (as a traceback does) must stop its workers first."""
    script = ("from fsdp_trainer.config import DataConfig\n"
              "from fsdp_trainer.data import build_dataloader, build_dataset\n"
              f"dataset = build_dataset(DataConfig(source='tokens', path={str(shards)!r}), {SEQ_LEN}, {VOCAB})\n"
              "batches = iter(build_dataloader(dataset, num_workers=2, micro_batch_size=1, grad_accum_steps=1, "
              "dp_rank=0, dp_size=1))\n"
              "next(batches)\nprint('read a batch')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "read a batch\n", out.stderr


@pytest.mark.slow
def test_bad_token_ids_end_the_run_with_the_message(tmp_path):
    write_bad_token_shards(tmp_path / "bad")
    out = run_forked(train.main, ["--data.source", "tokens", "--data.path", str(tmp_path / "bad"),
                                  "--model.vocab_size", "257", "--train.seq_len", str(SEQ_LEN),
                                  "--train.micro_batch_size", "1", "--train.steps", "1", "--checkpoint.interval", "0",
                                  "--checkpoint.no_save_final", "--eval.every", "0", "--train.output_dir",
                                  str(tmp_path / "out")])
    assert out.returncode == 2
    assert "error: [rank 0] data.path=" in out.stderr and "is id 60000" in out.stderr
    assert "Traceback" not in out.stderr


def test_write_atomic_puts_the_data_then_the_name_on_disk_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    """The contract the sidecars and checkpoint markers rely on: the file's data reach the disk before it has its
    name, and the name (the folder's entry) before write_atomic returns; a failed write leaves the old file whole
    and no temporary file behind; the file is readable by others, as shards and checkpoints are shared."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync folder" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync file")
        real_fsync(fd)

    def replace(src, dst):
        events.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = tmp_path / "marker.json"
    write_atomic(target, lambda f: f.write(b"new"))
    assert events == ["fsync file", "rename", "fsync folder"]
    assert target.read_bytes() == b"new" and target.stat().st_mode & 0o777 == 0o644

    def fail_halfway(f):
        f.write(b"par")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomic(target, fail_halfway)
    assert target.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["marker.json"]
