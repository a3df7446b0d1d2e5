"""The prepare tool: text files into token shards, and what it leaves when it fails (CPU, seconds)."""

import json
import subprocess
import sys

import pytest

from fsdp_trainer import data
from fsdp_trainer.config import ConfigError, DataConfig
from fsdp_trainer.data import BYTE_EOS, UNFINISHED, build_dataset, load_shards, write_atomic
from fsdp_trainer.tools import prepare as prepare_tool
from fsdp_trainer.tools.prepare import main, prepare


def test_prepare_round_trip(tmp_path, capsys):
    inputs = tmp_path / "in"
    (inputs / "sub").mkdir(parents=True)
    (inputs / "a.txt").write_text("héllo\nworld", encoding="utf-8")
    lines = [json.dumps({"text": "ünï"}), "", json.dumps({"text": "two", "id": 2})]
    (inputs / "c.jsonl").write_text("\n".join(lines) + "\n")
    (inputs / "sub" / "b.txt").write_text("")
    (inputs / "skip.md").write_text("not an input")
    extra = tmp_path / "z.txt"
    extra.write_text("last!")
    main([str(inputs), str(extra), str(tmp_path / "out"), "--shard-tokens", "7"])

    docs = ["héllo\nworld", "ünï", "two", "last!"]  # folder files sorted (a, c, sub/b: empty, left out), then z.txt
    expected = []
    for i, doc in enumerate(docs):
        expected += ([BYTE_EOS] if i else []) + list(doc.encode("utf-8"))
    stream = load_shards(str(tmp_path / "out"))
    assert stream.read(0, len(stream)).tolist() == expected
    assert len(expected) == 28 and [s.num_tokens for s in stream.shards] == [7, 7, 7, 7]
    meta = json.loads((tmp_path / "out" / "shard_00000.json").read_text())
    assert meta == {"dtype": "uint16", "num_tokens": 7, "vocab_size": 257, "tokenizer": "bytes"}
    assert not list((tmp_path / "out").glob(".*"))  # every temporary file was renamed into place
    assert not (tmp_path / "out" / UNFINISHED).exists()
    assert f"{len(expected):,} tokens" in capsys.readouterr().out


def test_prepare_refuses_bad_inputs(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"title": "no text"}\n')
    (tmp_path / "a.csv").write_text("x")
    (tmp_path / "ok.txt").write_text("x")
    with pytest.raises(ValueError, match="no such file"):
        prepare([str(tmp_path / "missing.txt")], str(tmp_path / "o1"))
    with pytest.raises(ValueError, match=".txt file"):
        prepare([str(tmp_path / "a.csv")], str(tmp_path / "o2"))
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        prepare([str(tmp_path / "bad.jsonl")], str(tmp_path / "o3"))
    prepare([str(tmp_path / "ok.txt")], str(tmp_path / "o4"), log=lambda _: None)
    with pytest.raises(ValueError, match="already holds shards"):
        prepare([str(tmp_path / "ok.txt")], str(tmp_path / "o4"))
    # The file and line of text that is not UTF-8, or that JSON escapes to a lone surrogate (half an emoji).
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match="latin1.jsonl:2: not a line of UTF-8 JSON text .*can't decode byte 0xe9"):
        prepare([str(tmp_path / "latin1.jsonl")], str(tmp_path / "o5"))
    (tmp_path / "half.jsonl").write_text('{"text": "a\\ud83db"}\n')
    with pytest.raises(ValueError, match="half.jsonl:1: not a line of UTF-8 JSON text .*surrogates not allowed"):
        prepare([str(tmp_path / "half.jsonl")], str(tmp_path / "o6"))
    (tmp_path / "e1.txt").write_text("")
    (tmp_path / "e2.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match="every document is empty"):
        prepare([str(tmp_path / "e1.txt"), str(tmp_path / "e2.jsonl")], str(tmp_path / "o7"))
    # Bad input after shards were written: they go, and the same command works once the input is fixed.
    (tmp_path / "big.txt").write_text("y" * 100)
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*\(no shards written\)"):
        prepare([str(tmp_path / "big.txt"), str(tmp_path / "bad.jsonl")], str(tmp_path / "o8"), shard_tokens=10,
                log=lambda _: None)
    assert not any((tmp_path / "o8").iterdir())
    prepare([str(tmp_path / "big.txt")], str(tmp_path / "o8"), shard_tokens=10, log=lambda _: None)


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_prepare_that_fails_midway_leaves_nothing(tmp_path, monkeypatch, failure):
    """A full disk or Ctrl-C after some shards: the shards written, the one half written and the marker all go, so
    that no folder of complete shards holding only part of the data is left, and the same command works again."""
    (tmp_path / "big.txt").write_text("y" * 100)
    writes, real_write_atomic = [], write_atomic

    def fail_on_the_third_sidecar(path, write):
        writes.append((path.name, (path.parent / UNFINISHED).exists()))
        if path.name == "shard_00002.json":
            raise failure
        real_write_atomic(path, write)

    monkeypatch.setattr(data, "write_atomic", fail_on_the_third_sidecar)
    with pytest.raises(type(failure)):
        prepare([str(tmp_path / "big.txt")], str(tmp_path / "out"), shard_tokens=10, log=lambda _: None)
    assert writes[-2:] == [("shard_00002.bin", True), ("shard_00002.json", True)] and all(m for _, m in writes)
    assert not any((tmp_path / "out").iterdir())
    monkeypatch.undo()
    prepare([str(tmp_path / "big.txt")], str(tmp_path / "out"), shard_tokens=10, log=lambda _: None)
    assert len(load_shards(str(tmp_path / "out"))) == 100


def test_of_two_prepares_into_one_folder_the_second_is_refused(tmp_path, monkeypatch):
    """Started together (on every node of a job, over shared storage): the second, arriving while the first looks
    the folder over, must not also write shard_00000... there; one would remove the other's on failure."""
    (tmp_path / "big.txt").write_text("y" * 100)
    second, real_holds_shards = [], prepare_tool._holds_shards

    def second_prepare_arrives(root):
        if not second:
            second.append(None)
            with pytest.raises(ValueError, match="holds PREPARE_UNFINISHED: a prepare into it was interrupted "
                                                 r"\(or is still running\)") as refused:
                prepare([str(tmp_path / "big.txt")], str(root), shard_tokens=10, log=lambda _: None)
            second[0] = refused
        return real_holds_shards(root)

    monkeypatch.setattr(prepare_tool, "_holds_shards", second_prepare_arrives)
    prepare([str(tmp_path / "big.txt")], str(tmp_path / "out"), shard_tokens=10, log=lambda _: None)
    assert second[0] is not None and len(load_shards(str(tmp_path / "out"))) == 100


@pytest.mark.slow
def test_a_killed_prepare_leaves_a_folder_that_is_refused(tmp_path):
    """A prepare killed after some shards (SIGKILL, the OOM killer) cannot clean up: its complete shards must not
    pass for the whole data."""
    (tmp_path / "big.txt").write_text("y" * 100)
    script = ("import os, signal\nfrom fsdp_trainer.tools.prepare import prepare\n"
              "def log(line):\n    if 'shard_00001' in line:\n        os.kill(os.getpid(), signal.SIGKILL)\n"
              f"prepare([{str(tmp_path / 'big.txt')!r}], {str(tmp_path / 'out')!r}, shard_tokens=10, log=log)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, out.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        UNFINISHED, "shard_00000.bin", "shard_00000.json", "shard_00001.bin", "shard_00001.json"]
    with pytest.raises(ConfigError, match=f"data.path={tmp_path / 'out'}: {tmp_path / 'out' / UNFINISHED} is there: "
                                          "the prepare writing this folder was interrupted .*part of the data; remove "
                                          "the folder and run prepare again"):
        build_dataset(DataConfig(source="tokens", path=str(tmp_path / "out")), 8, 1000)
    with pytest.raises(ValueError, match=f"holds {UNFINISHED}: a prepare into it was interrupted .*remove the folder"):
        prepare([str(tmp_path / "big.txt")], str(tmp_path / "out"))


def test_prepare_errors_name_the_path_and_the_fix(tmp_path):
    (tmp_path / "ok.txt").write_text("x")
    (tmp_path / "a_file").write_text("")
    for output in (tmp_path / "a_file", tmp_path / "a_file" / "out"):
        with pytest.raises(ValueError, match=f"^{output}: cannot create the output folder \\(a file is in the way\\); "
                                             "choose another output_dir$"):
            prepare([str(tmp_path / "ok.txt")], str(output))
    pytest.importorskip("tokenizers")
    (tmp_path / "tokenizer.json").write_text('{"model": {}}')
    with pytest.raises(ValueError, match=f"--tokenizer {tmp_path / 'tokenizer.json'}: not a Hugging Face "
                                         "tokenizer.json .*; pass the tokenizer.json saved with"):
        prepare([str(tmp_path / "ok.txt")], str(tmp_path / "out"), tokenizer=str(tmp_path / "tokenizer.json"))


def test_prepare_into_a_folder_of_other_files(tmp_path):
    """Files load_shards does not read (a tokenizer.json, macOS's '._<name>' copies) leave the folder free for
    prepare, and out of the data."""
    (tmp_path / "ok.txt").write_text("xyz")
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text('{"model": {}}')
    (out / "._shard_00000.bin").write_bytes(b"\0\5\0\0Mac OS X")
    (out / "._shard_00000.json").write_bytes(b"\0\5\0\0Mac OS X")
    prepare([str(tmp_path / "ok.txt")], str(out), log=lambda _: None)
    stream = load_shards(str(out))
    assert stream.read(0, len(stream)).tolist() == list(b"xyz")


def test_prepare_without_tokenizers_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail, installed or not
    (tmp_path / "ok.txt").write_text("x")
    with pytest.raises(ValueError, match="pip install tokenizers"):
        prepare([str(tmp_path / "ok.txt")], str(tmp_path / "out"), tokenizer=str(tmp_path / "tokenizer.json"))


def test_prepare_with_a_hugging_face_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    texts = ["the quick brown fox jumps over the lazy dog", "a lazy dog sleeps all day long"] * 20
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(
        vocab_size=60, special_tokens=["[UNK]", "<|endoftext|>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    for i, text in enumerate(texts[:4]):
        (tmp_path / f"doc{i}.txt").write_text(text)
    prepare([str(tmp_path / f"doc{i}.txt") for i in range(4)], str(tmp_path / "out"),
            tokenizer=str(tmp_path / "tokenizer.json"), log=lambda *a: None)
    stream = load_shards(str(tmp_path / "out"), "test")
    tokens = stream.read(0, len(stream)).tolist()
    eos = tok.token_to_id("<|endoftext|>")
    expected = []
    for i, text in enumerate(texts[:4]):
        expected += ([eos] if i else []) + tok.encode(text).ids
    assert tokens == expected

    # The separator's text inside a document is text, not a second document boundary.
    (tmp_path / "quoted.txt").write_text("the dog<|endoftext|>the fox")
    prepare([str(tmp_path / "doc0.txt"), str(tmp_path / "quoted.txt")], str(tmp_path / "quoted"),
            tokenizer=str(tmp_path / "tokenizer.json"), log=lambda *a: None)
    stream = load_shards(str(tmp_path / "quoted"), "test")
    assert stream.read(0, len(stream)).tolist().count(eos) == 1

    # A .txt file is bytes: with a tokenizer it must decode as UTF-8, never into replacement characters.
    (tmp_path / "latin1.txt").write_bytes("the caf\u00e9 dog".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt: not UTF-8 text .*byte 0xe9.*re-encode it as UTF-8"):
        prepare([str(tmp_path / "latin1.txt")], str(tmp_path / "latin1"), tokenizer=str(tmp_path / "tokenizer.json"),
                log=lambda *a: None)


def test_prepare_takes_the_vocabulary_size_from_the_largest_id(tmp_path):
    """A tokenizer whose ids have holes (a trimmed vocabulary, a special token pinned high) has fewer tokens than its
    largest id + 1: a count of 5 picked uint16, and id 70000 was stored as 4464."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"a": 0, "b": 1, "[UNK]": 2, "</s>": 3, "c": 70000}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "doc.txt").write_text("a b c")
    prepare([str(tmp_path / "doc.txt")], str(tmp_path / "out"), tokenizer=str(tmp_path / "tokenizer.json"),
            log=lambda *a: None)
    meta = json.loads((tmp_path / "out" / "shard_00000.json").read_text())
    assert (meta["vocab_size"], meta["dtype"]) == (70001, "uint32")
    stream = load_shards(str(tmp_path / "out"))
    assert stream.read(0, len(stream)).tolist() == [0, 1, 70000]
