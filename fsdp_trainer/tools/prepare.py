"""Tokenize text into token shards for `--data.source tokens`.

    python -m fsdp_trainer.tools.prepare books/ chats.jsonl data/shards                 # byte-level tokens
    python -m fsdp_trainer.tools.prepare books/ data/shards --tokenizer tokenizer.json  # a Hugging Face tokenizer
    python -m fsdp_trainer.train --data.source tokens --data.path data/shards

Inputs are .txt files (one document each), .jsonl files (a "text" field per line), or folders of them. Documents
are joined with the tokenizer's end-of-document token (256 for bytes) and cut into shard_NNNNN.bin + .json files.
"""

import argparse
import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Optional, Sequence

import numpy as np

from fsdp_trainer.data import BYTE_EOS, BYTE_VOCAB_SIZE, UNFINISHED, fsync_folder, shard_files, write_shard

DEFAULT_SHARD_TOKENS = 100_000_000
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")


class _Encoder(NamedTuple):
    name: str
    vocab_size: int
    eos: int
    encode: Callable[[bytes], np.ndarray]


def _byte_encoder() -> _Encoder:
    return _Encoder("bytes", BYTE_VOCAB_SIZE, BYTE_EOS, lambda doc: np.frombuffer(doc, np.uint8))


def _hf_encoder(path: str) -> _Encoder:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("--tokenizer needs the optional `tokenizers` package: pip install tokenizers") from None
    if not Path(path).is_file():
        raise ValueError(f"--tokenizer {path}: no such file (expected a Hugging Face tokenizer.json)")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as err:  # the tokenizers package raises a bare Exception for a file it cannot parse
        raise ValueError(f"--tokenizer {path}: not a Hugging Face tokenizer.json that this tokenizers package can "
                         f"read ({err}); pass the tokenizer.json saved with the model's tokenizer") from None
    # A document's text is text: "<|endoftext|>" written in it (code, a page about tokenizers) must not become the
    # separator, or any other special token, and cut the document in two.
    tokenizer.encode_special_tokens = True
    eos = next((tokenizer.token_to_id(t) for t in EOS_NAMES if tokenizer.token_to_id(t) is not None), None)
    if eos is None:
        raise ValueError(f"--tokenizer {path}: has none of the end-of-document tokens {', '.join(EOS_NAMES)}")

    def encode(doc: bytes) -> np.ndarray:
        ids = tokenizer.encode(doc.decode("utf-8"), add_special_tokens=False).ids
        return np.array(ids, dtype=np.uint32)

    # The largest id + 1, not get_vocab_size()'s count of tokens: ids can have holes (a trimmed vocabulary, special
    # tokens pinned high), and a count that understates them picks uint16 for ids that need uint32.
    vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    return _Encoder(str(Path(path).resolve()), vocab_size, eos, encode)


class _ShardWriter:
    """Joins documents with the end-of-document token and cuts the stream into shards of shard_tokens tokens."""

    def __init__(self, out_dir: Path, vocab_size: int, tokenizer: str, eos: int, shard_tokens: int,
                 log: Callable[[str], None]):
        self.out_dir, self.vocab_size, self.tokenizer, self.shard_tokens, self.log = (
            out_dir, vocab_size, tokenizer, shard_tokens, log)
        self.separator = np.array([eos], dtype=np.uint32 if eos >= 2**16 else np.uint16)
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.written: list[tuple[Path, int]] = []

    def add(self, doc: np.ndarray) -> None:
        if self.pending or self.written:
            self.pending.append(self.separator)
            self.pending_tokens += 1
        self.pending.append(doc)
        self.pending_tokens += len(doc)
        if self.pending_tokens >= self.shard_tokens:
            self._flush(final=False)

    def _path(self, number: int) -> Path:
        return self.out_dir / f"shard_{number:05d}.bin"

    def _flush(self, final: bool) -> None:
        stream = np.concatenate(self.pending) if self.pending else np.empty(0, np.uint16)
        cut = 0
        while len(stream) - cut >= self.shard_tokens or (final and cut < len(stream)):
            chunk = stream[cut:cut + self.shard_tokens]
            path = self._path(len(self.written))
            write_shard(path, chunk, self.vocab_size, self.tokenizer)
            self.log(f"wrote {path} ({len(chunk):,} tokens)")
            self.written.append((path, len(chunk)))
            cut += len(chunk)
        self.pending = [stream[cut:]] if cut < len(stream) else []
        self.pending_tokens = len(stream) - cut

    def close(self) -> list[tuple[Path, int]]:
        """Write what is left; returns every shard written, with its token count."""
        self._flush(final=True)
        return self.written

    def remove(self) -> None:
        """Delete every shard written, and the one being written when a failure stopped it, if it got that far."""
        for number in range(len(self.written) + 1):
            for suffix in (".json", ".bin"):  # the sidecar first: it is what stands for a shard
                self._path(number).with_suffix(suffix).unlink(missing_ok=True)


def _input_files(inputs: Sequence[str]) -> list[Path]:
    files = []
    for arg in inputs:
        path = Path(arg)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file())
        elif path.suffix in (".txt", ".jsonl") and path.is_file():
            files.append(path)
        elif path.exists():
            raise ValueError(f"{path}: expected a .txt file (one document), a .jsonl file (a \"text\" field per "
                             "line) or a folder of them")
        else:
            raise ValueError(f"{path}: no such file or folder")
    if not files:
        raise ValueError(f"no .txt or .jsonl files in {', '.join(inputs)}")
    return files


def _documents(path: Path) -> Iterator[bytes]:
    if path.suffix == ".txt":
        yield path.read_bytes()
        return
    # Lines as bytes, which json.loads decodes: a byte that is not UTF-8 is then an error naming its line.
    with path.open("rb") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)["text"].encode("utf-8")
            except (KeyError, TypeError, AttributeError):
                raise ValueError(f"{path}:{line_number}: expected a JSON object with a string \"text\" field") from None
            except ValueError as err:  # not JSON, not UTF-8, or an escaped lone surrogate ("\ud83d") in the text
                raise ValueError(f"{path}:{line_number}: not a line of UTF-8 JSON text ({err})") from None


def _is_sidecar(path: Path) -> bool:
    """Whether a .json file has every key of a sidecar (not a tokenizer.json or statistics kept beside shards)."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and {"dtype", "num_tokens", "vocab_size", "tokenizer"} <= meta.keys()


def _holds_shards(root: Path) -> bool:
    """Whether load_shards would find a shard, or a shard's sidecar, in root."""
    return bool(shard_files(root, ".bin")) or any(map(_is_sidecar, shard_files(root, ".json")))


def _held_out(doc: bytes, fraction: float) -> bool:
    """Whether --holdout puts a document in val/: by a hash of its text, so the same documents whatever the order
    or sharding of the files, and a copy of a document in the document's split."""
    return int.from_bytes(hashlib.blake2b(doc, digest_size=8).digest(), "little") < fraction * 2**64


def prepare(inputs: Sequence[str], output_dir: str, tokenizer: Optional[str] = None,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, log: Callable[[str], None] = print,
            holdout: float = 0.0) -> list[tuple[Path, int]]:
    """Tokenize .txt files (one document each) and .jsonl files (a "text" field per line), or folders of them, into
    shards in output_dir; returns each shard written with its token count. Raises ValueError on bad inputs.
    `holdout`: the fraction of the documents written to output_dir/val instead, for evaluation.

    The folder holds the UNFINISHED marker from before the first shard until the last is on disk, so that a prepare
    killed midway (SIGKILL, the OOM killer, a power cut), which nothing can clean up after, leaves a folder that
    load_shards refuses; a failure Python sees (bad input, a full disk, Ctrl-C) removes what was written, the marker
    last, and is raised again."""
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens {shard_tokens}: must be at least 1")
    if not 0 <= holdout < 1:
        raise ValueError(f"--holdout {holdout}: must be a fraction of the documents in [0, 1), e.g. 0.01")
    files = _input_files(inputs)
    encoder = _byte_encoder() if tokenizer is None else _hf_encoder(tokenizer)
    out = Path(output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        reason = "a file is in the way" if isinstance(err, (FileExistsError, NotADirectoryError)) else err.strerror
        raise ValueError(f"{out}: cannot create the output folder ({reason}); choose another output_dir") from None
    marker = out / UNFINISHED
    # Created exclusively, before anything else is looked at: of two prepares started into one folder (on every
    # node of a job, over shared storage), one claims it and the other is refused, instead of both writing the same
    # shard names and one removing the other's on failure.
    try:
        claim = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        raise ValueError(f"{out} holds {UNFINISHED}: a prepare into it was interrupted (or is still running); "
                         "remove the folder and run prepare again") from None
    with os.fdopen(claim, "wb") as f:
        f.write(b"python -m fsdp_trainer.tools.prepare is writing this folder, or was interrupted: remove the folder "
                b"and run prepare again\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_folder(out)
    val = out / "val"
    if _holds_shards(out) or (val.is_dir() and _holds_shards(val)):
        marker.unlink()
        raise ValueError(f"{out} already holds shards, which a reader would mix with the new ones; prepare into a "
                         "folder that holds no shards yet (a new one, say)")
    writer = _ShardWriter(out, encoder.vocab_size, encoder.name, encoder.eos, shard_tokens, log)
    val_writer = _ShardWriter(val, encoder.vocab_size, encoder.name, encoder.eos, shard_tokens, log)
    if holdout:  # val/ is read on its own (data.eval_path), so it carries a marker of its own
        val.mkdir(exist_ok=True)
        (val / UNFINISHED).write_bytes((out / UNFINISHED).read_bytes())
    try:
        for path in files:
            for doc in _documents(path):
                try:
                    tokens = encoder.encode(doc)
                except UnicodeDecodeError as err:  # a tokenizer's text must be UTF-8: Latin-1 would train on U+FFFD
                    raise ValueError(f"{path}: not UTF-8 text ({err}); re-encode it as UTF-8 (iconv -t UTF-8)") \
                        from None
                if len(tokens):  # an empty document would only add a second end-of-document token
                    (val_writer if holdout and _held_out(doc, holdout) else writer).add(tokens)
        written, held = writer.close(), val_writer.close()
        if not written:
            raise ValueError(f"no text in {', '.join(inputs)}: every document is empty or held out")
        if holdout and not held:
            raise ValueError(f"--holdout {holdout} held out no document: raise it, or add documents")
    except BaseException as err:
        # The folder held no shards: what this call wrote goes, so that the same command works once the input is
        # fixed, rather than finding the folder taken.
        writer.remove()
        val_writer.remove()
        (val / UNFINISHED).unlink(missing_ok=True)
        if holdout and not any(val.iterdir()):
            val.rmdir()
        marker.unlink()
        if isinstance(err, ValueError):
            raise ValueError(f"{err} (no shards written)") from None
        raise
    # Every shard and sidecar is on disk already (write_atomic): only now may the folder pass for complete.
    (val / UNFINISHED).unlink(missing_ok=True)
    marker.unlink()
    fsync_folder(out)
    return written


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fsdp_trainer.tools.prepare",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", help=".txt files (one document each), .jsonl files (a \"text\" field "
                                                  "per line), or folders of them (searched recursively, sorted)")
    parser.add_argument("output_dir", help="folder for the shards (created; must hold no shards yet)")
    parser.add_argument("--tokenizer", help="a Hugging Face tokenizer.json (needs `pip install tokenizers`), whose "
                                            "end-of-document token separates documents, and whose special tokens "
                                            "written in a document are encoded as text; default: bytes, token 256 "
                                            "separating documents")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file")
    parser.add_argument("--holdout", type=float, default=0.0,
                        help="fraction of the documents, chosen by a hash of their text, written to <output_dir>/val "
                             "for evaluation, where the trainer looks for them (data.eval_path)")
    args = parser.parse_args(argv)
    try:
        written = prepare(args.inputs, args.output_dir, args.tokenizer, args.shard_tokens, holdout=args.holdout)
    except ValueError as err:
        parser.exit(2, f"error: {err}\n")
    meta = json.loads(written[0][0].with_suffix(".json").read_text())
    print(f"{len(written)} shard(s), {sum(n for _, n in written):,} tokens in {args.output_dir}; "
          f"vocab_size {meta['vocab_size']} ({meta['tokenizer']}): use --data.source tokens "
          f"--data.path {args.output_dir} --model.vocab_size {meta['vocab_size']} or larger")


if __name__ == "__main__":
    main()
