"""Training data: token shards, the sample order, and each rank's data loader.

    python -m fsdp_trainer.tools.prepare books/ chats.jsonl data/shards                 # byte-level tokens
    python -m fsdp_trainer.tools.prepare books/ data/shards --tokenizer tokenizer.json  # a Hugging Face tokenizer
    python -m fsdp_trainer.train --data.source tokens --data.path data/shards

A shard is `<name>.bin` (little-endian uint16, or uint32 for vocabularies over 65536) plus a sidecar `<name>.json`
{"dtype", "num_tokens", "vocab_size", "tokenizer"}. A folder's shards form one token stream in sorted file order,
documents separated by an end-of-document token. The built-in byte tokenizer maps byte b to token b and uses 256
as the separator, so byte data needs model.vocab_size >= 257.

Sample k is the window tokens[k*L : k*L + L + 1] (inputs: the first L, labels: the last L). Global sample index g
reads sample permutation(seed, g // n)[g % n] for n samples per epoch: the order is a pure function of (seed, g).
One optimizer step consumes global indices [base, base + G) with G = micro_batch_size x grad_accum_steps x dp_size;
micro-batch m of data-parallel rank r holds base + m*dp_size*b + r*b + [0, b). Which samples a step sees depends
only on G, so a run resumed from its consumed-sample count on any number of ranks continues the same sequence.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import itertools
import os
import re
import signal
import sys
import sysconfig
import tempfile
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, NoReturn, Optional

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

from fsdp_trainer.config import ConfigError, DataConfig

logger = logging.getLogger("fsdp_trainer")

BYTE_EOS = 256
"""End-of-document token of the byte tokenizer, whose other tokens are the byte values 0..255."""
BYTE_VOCAB_SIZE = 257
_PREPARE_HINT = "make shards with `python -m fsdp_trainer.tools.prepare <inputs...> <output_dir>`"
UNFINISHED = "PREPARE_UNFINISHED"
"""The file prepare keeps in its output folder while it writes there. While it exists, the folder's complete shards
may be only the first part of the data (prepare was killed, or is still running), so load_shards refuses it."""


class DataError(ConfigError):
    """Data found unusable while training (checked as it is read: scanning it all at start-up would take too long).

    Raised in a loader worker, it reaches the training process rebuilt by torch from the worker's whole formatted
    traceback; only the message, after the last 'DataError: ', is kept, so the trainer can print it as it is."""

    def __init__(self, message: str):
        super().__init__(message.strip().rsplit(f"{DataError.__name__}: ", 1)[-1])


# ---------------------------------------------------------------------------------------------- shards on disk

def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write through a uniquely named temporary file in the same folder, then rename it into place: readers and
    concurrent writers only ever see complete files, and once this returns the file and its name are on disk, so
    a file written after it (a shard's sidecar, a checkpoint's marker) never outlives it in a crash. The temporary
    name ends in '.tmp', so no '*.bin' or '*.json' glob sees it (its leading '.' hides it from `ls`, not from glob)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes files private; shards, caches and checkpoints may be shared
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    fsync_folder(path.parent)  # the rename itself


def fsync_folder(path: Path) -> None:
    """Put a folder's entries (files created, renamed or removed in it) on disk."""
    folder = os.open(path, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


# The sidecar key by which write_shard vouches that every id of the shard is below its vocab_size.
IDS_BOUNDED = "ids_below_vocab_size"


def write_shard(bin_path: Path, tokens: np.ndarray, vocab_size: int, tokenizer: str) -> None:
    """Write one shard and its sidecar. The sidecar is written last, so its presence marks a complete shard.
    Raises ValueError for an id outside [0, vocab_size)."""
    dtype = np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")
    # The cast below wraps an id that its dtype cannot hold (70000 -> 4464 in uint16) into a shard that passes every
    # later check; an id the sidecar's vocab_size leaves out would be refused only while training.
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
        bad = int(tokens.min()) if tokens.min() < 0 else int(tokens.max())
        fix = ("pass the tokenizer's ids unchanged" if bad < 0 else
               f"pass vocab_size {bad + 1} or more (the tokenizer's largest id + 1)")
        raise ValueError(f"{bin_path}: token id {bad} is not in [0, vocab_size={vocab_size}), so the {dtype.name} "
                         f"shard would hold a wrapped id or one its sidecar rules out; {fix}")
    data = np.ascontiguousarray(tokens, dtype=dtype)
    write_atomic(bin_path, data.tofile)
    meta = {"dtype": dtype.name, "num_tokens": len(data), "vocab_size": vocab_size, "tokenizer": tokenizer,
            IDS_BOUNDED: True}
    write_atomic(bin_path.with_suffix(".json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))


@dataclass(frozen=True)
class Shard:
    """One shard file, as its sidecar describes it."""

    path: Path
    dtype: np.dtype
    num_tokens: int
    vocab_size: int
    tokenizer: str
    ids_bounded: bool  # its ids were checked below vocab_size when written (IDS_BOUNDED)


def _read_sidecar(bin_path: Path, where: str) -> Shard:
    meta_path = bin_path.with_suffix(".json")
    fix = f"re-create it ({_PREPARE_HINT})"
    if not meta_path.is_file():
        raise ConfigError(f"{where}: shard {bin_path.name} has no sidecar {meta_path.name}; {fix}")
    try:
        meta = json.loads(meta_path.read_text())
        dtype = np.dtype({"uint16": "<u2", "uint32": "<u4"}[meta["dtype"]])
        num_tokens, vocab_size, tokenizer = meta["num_tokens"], meta["vocab_size"], meta["tokenizer"]
        ids_bounded = meta.get(IDS_BOUNDED) is True
        valid = (isinstance(num_tokens, int) and num_tokens >= 0 and isinstance(vocab_size, int)
                 and vocab_size > 0 and isinstance(tokenizer, str))
    except OSError as err:
        raise ConfigError(f"{where}: cannot read sidecar {meta_path} ({err.strerror}); make it readable, or "
                          f"{fix}") from None
    except (ValueError, KeyError, TypeError):  # not JSON, not an object, a key or dtype missing or unknown
        valid = False
    if not valid:
        raise ConfigError(f"{where}: sidecar {meta_path.name} is corrupt (expected {{\"dtype\": \"uint16\"|\"uint32\", "
                          f"\"num_tokens\": N, \"vocab_size\": V, \"tokenizer\": ...}}); {fix}")
    if vocab_size > 2**16 and dtype.itemsize == 2:
        # The typical hand-written sidecar of converted uint32 data: its size check passes, and each id would be
        # read as two small ones, all inside the vocabulary.
        raise ConfigError(f"{where}: sidecar {meta_path.name} says dtype uint16, which cannot hold the ids of its "
                          f"vocab_size {vocab_size}; {fix}, or, if {bin_path.name} holds uint32 ids, set \"dtype\": "
                          f"\"uint32\" and \"num_tokens\": its size in bytes / 4 there")
    try:
        # Opened here, not first in a loader worker once the GPUs are allocated and the checkpoint is loaded.
        with open(bin_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
    except OSError as err:
        raise ConfigError(f"{where}: cannot read shard {bin_path} ({err.strerror}); make it readable, or "
                          f"{fix}") from None
    if size != num_tokens * dtype.itemsize:
        raise ConfigError(f"{where}: shard {bin_path.name} has {size} bytes but its sidecar promises {num_tokens} "
                          f"{dtype.name} tokens ({num_tokens * dtype.itemsize} bytes), so one of them is truncated "
                          f"or stale; {fix}")
    return Shard(bin_path, dtype, num_tokens, vocab_size, tokenizer, ids_bounded)


class TokenStream:
    """The tokens of a folder's shards as one sequence."""

    def __init__(self, shards: list[Shard]):
        self.shards = shards
        self.starts = np.cumsum([0] + [s.num_tokens for s in shards])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def shard_index(self, position: "int | np.ndarray") -> "np.intp | np.ndarray":
        """The index of the shard holding token `position` of the stream (an int, or an array of them)."""
        # side="right" picks the last shard starting at or before `position`, which skips empty shards.
        return np.searchsorted(self.starts, position, side="right") - 1

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream."""
        i = int(self.shard_index(start))
        parts = []
        while start < stop:
            lo, hi = start - self.starts[i], min(stop, self.starts[i + 1]) - self.starts[i]
            parts.append(_read_tokens(self.shards[i], int(lo), int(hi)))
            start += hi - lo
            i += 1
        return np.concatenate(parts)


def _read_tokens(shard: Shard, lo: int, hi: int) -> np.ndarray:
    # Each read opens the file: a memory map kept per shard would hold a descriptor, so a loader worker reading a
    # folder of more shards than `ulimit -n` (often 1024) would fail with "Too many open files".
    size = shard.dtype.itemsize
    try:
        fd = os.open(shard.path, os.O_RDONLY)
        try:
            data = os.pread(fd, (hi - lo) * size, lo * size)
        finally:
            os.close(fd)
    except OSError as err:
        raise DataError(f"cannot read shard {shard.path} ({err.strerror}): it was removed or made unreadable after "
                        "start-up; restore it and resume") from None
    if len(data) != (hi - lo) * size:
        raise DataError(f"shard {shard.path} is shorter than the {shard.num_tokens} tokens its sidecar promised at "
                        f"start-up: it changed during the run; re-create it ({_PREPARE_HINT}) and resume")
    return np.frombuffer(data, shard.dtype)


def load_shards(path: str, where: Optional[str] = None) -> TokenStream:
    """Open the shards in folder `path`; `where` names the setting that chose it, for error messages."""
    where = where or f"data.path={path}"
    root = Path(path).expanduser()
    if not root.is_dir():
        problem = "is a file" if root.exists() else "does not exist"
        raise ConfigError(f"{where}: {root} {problem}; expected a folder of token shards ({_PREPARE_HINT})")
    if (root / UNFINISHED).exists():
        raise ConfigError(f"{where}: {root / UNFINISHED} is there: the prepare writing this folder was interrupted "
                          "(or is still running), so its shards may hold only part of the data; remove the folder "
                          "and run prepare again")
    bins = sorted(_visible(root, "*.bin"), key=_numbers_in_order)
    if not bins:
        raise ConfigError(f"{where}: no token shards (<name>.bin + <name>.json) in {root}; {_PREPARE_HINT}")
    shards = [_read_sidecar(b, where) for b in bins]
    for meta_path in sorted(set(_visible(root, "*.json")) - {b.with_suffix(".json") for b in bins}):
        if _is_sidecar(meta_path):
            raise ConfigError(f"{where}: shard {meta_path.with_suffix('.bin').name} is missing, but its sidecar "
                              f"{meta_path.name} is there (an interrupted copy?): training would silently leave its "
                              f"tokens out; copy the folder again, or {_PREPARE_HINT}")
    return TokenStream(shards)


def _visible(root: Path, pattern: str) -> list[Path]:
    """The files in root matching pattern, but for hidden ones (a glob matches those too): macOS puts a '._<name>'
    file beside every file it copies to a foreign file system, which is no shard."""
    return [p for p in root.glob(pattern) if not p.name.startswith(".")]


def _numbers_in_order(path: Path) -> tuple:
    """A sort key that orders the numbers in names by value: shard_100000 after shard_99999, part_10 after part_9
    (prepare's names are zero-padded to 5 digits, and a corpus of 10T tokens has more shards than that)."""
    parts = re.split(r"(\d+)", path.name)
    return [int(part) if i % 2 else part for i, part in enumerate(parts)], path.name


def _is_sidecar(path: Path) -> bool:
    """Whether a .json file is a shard's sidecar, with every key one has, not some other file kept with the shards
    (a tokenizer.json, a corpus's statistics)."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and {"dtype", "num_tokens", "vocab_size", "tokenizer"} <= meta.keys()


def _check_stream(stream: TokenStream, where: str, seq_len: int, vocab_size: int) -> None:
    tokenizers = sorted({s.tokenizer for s in stream.shards})
    if len(tokenizers) > 1:
        raise ConfigError(f"{where}: shards come from different tokenizers ({', '.join(tokenizers)}); "
                          "keep one tokenizer per folder")
    if len(stream) == 0:
        raise ConfigError(f"{where}: the shards hold no tokens; {_PREPARE_HINT} from non-empty inputs")
    if len(stream) < seq_len + 1:
        shorter = f"lower --train.seq_len to at most {len(stream) - 1} or " if len(stream) > 1 else ""
        raise ConfigError(f"{where}: holds {len(stream)} tokens, but train.seq_len={seq_len} needs at least "
                          f"{seq_len + 1} for one sample; {shorter}add data")
    data_vocab = max(s.vocab_size for s in stream.shards)
    if data_vocab > vocab_size:
        raise ConfigError(f"{where}: tokenized with vocab_size {data_vocab} ({tokenizers[0]} tokenizer), so token "
                          f"ids reach {data_vocab - 1}, but model.vocab_size={vocab_size}; set "
                          f"--model.vocab_size {data_vocab} or larger")


# ------------------------------------------------------------------------------------------------ the samples

def _derive_seed(*parts: object) -> int:
    """A 64-bit seed that is a fixed function of `parts`, stable across processes and Python runs."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


class SampleOrder:
    """Global sample index -> sample index: epoch g // n visits all n samples in a permutation drawn from (seed,
    epoch), computed one index at a time. A stored permutation (torch.randperm) would take 8 bytes a sample in every
    loader worker of every rank, 15 GB each for 15T tokens at seq_len 8192, and seconds to draw at each epoch.

    The permutation is a Feistel network over the smallest even number of bits that holds n - 1 (a bijection of
    [0, 4**h) whatever its round function), applied again until it lands in [0, n): each sample goes to the next
    sample on its cycle of the larger permutation, so no two go to the same one, in at most four steps on average."""

    ROUNDS = 6  # four make a strong pseudo-random permutation from random round functions (Luby-Rackoff); ours hash
    KIND = "feistel"  # in the data's identity: a checkpoint saved under another order is a position in that one

    def __init__(self, num_samples: int, seed: int):
        self.num_samples, self.seed = num_samples, seed
        self.half_bits = ((num_samples - 1).bit_length() + 1) // 2 or 1
        self._epoch, self._keys = -1, ()

    def __call__(self, g: int) -> int:
        epoch, x = divmod(g, self.num_samples)
        if epoch != self._epoch:
            self._epoch = epoch
            self._keys = tuple(_derive_seed("order", self.seed, epoch, r) for r in range(self.ROUNDS))
        x = self._permute(x)
        while x >= self.num_samples:
            x = self._permute(x)
        return x

    def _permute(self, x: int) -> int:
        mask = (1 << self.half_bits) - 1
        left, right = x >> self.half_bits, x & mask
        for key in self._keys:
            left, right = right, left ^ (_mix64(right ^ key) & mask)
        return (left << self.half_bits) | right


def _mix64(z: int) -> int:
    """A 64-bit integer hash in which every input bit flips about half the output bits (SplitMix64's finalizer)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


class TokenWindows(Dataset):
    """Global sample index -> (inputs, labels), int64 [seq_len] each, from non-overlapping windows of a stream."""

    def __init__(self, stream: TokenStream, seq_len: int, seed: int, vocab_size: int, where: str = ""):
        self.stream, self.seq_len, self.vocab_size, self.where = stream, seq_len, vocab_size, where
        self.num_samples = (len(stream) - 1) // seq_len
        self.order = SampleOrder(self.num_samples, seed)
        # An id at or past its shard's own vocab_size is corrupt even where the embedding is larger (byte data
        # holding id 300 would train silently on a model of 512).
        # Only where the sidecar vouches for it: before IDS_BOUNDED, prepare --tokenizer recorded a tokenizer's count
        # of tokens, which a valid id past a hole in its ids exceeds.
        self.id_limits = np.minimum([s.vocab_size if s.ids_bounded else vocab_size for s in stream.shards],
                                    vocab_size)

    def window(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample k itself: tokens[k*seq_len : k*seq_len + seq_len + 1], split into inputs and labels."""
        start, stop = k * self.seq_len, (k + 1) * self.seq_len + 1
        window = self.stream.read(start, stop)
        # Sidecars are checked at start-up, the tokens only here, a max over one window against its shards' lowest
        # limit (each token's own is looked up only then): an id past the embedding would otherwise be an
        # IndexError on CPU, a device-side assert on GPUs.
        first, last = int(self.stream.shard_index(start)), int(self.stream.shard_index(stop - 1))
        if window.max() >= self.id_limits[first:last + 1].min():
            bad = np.flatnonzero(window >= self.id_limits[self.stream.shard_index(np.arange(start, stop))])
            if len(bad):
                self._bad_token(start + int(bad[0]))
        tokens = torch.from_numpy(window.astype(np.int64))
        return tokens[:-1], tokens[1:]

    def _bad_token(self, position: int) -> NoReturn:
        i = int(self.stream.shard_index(position))
        shard, offset = self.stream.shards[i], position - int(self.stream.starts[i])
        token = int(self.stream.read(position, position + 1)[0])
        found = f"{self.where}: token {offset:,} of shard {shard.path} is id {token}"
        if token >= shard.vocab_size:
            raise DataError(f"{found}, but its sidecar {shard.path.with_suffix('.json').name} says vocab_size "
                            f"{shard.vocab_size}, so the shard is corrupt or its sidecar wrong; re-create it "
                            f"({_PREPARE_HINT}), or, if the ids are right, set vocab_size {token + 1} or more there")
        raise DataError(f"{found}, but model.vocab_size={self.vocab_size} (its sidecar says vocab_size "
                        f"{shard.vocab_size}), so the shard is corrupt or from another tokenizer; re-create it "
                        f"({_PREPARE_HINT}), or set --model.vocab_size {token + 1} or larger if the ids are right")

    def __getitem__(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.window(self.order(g))

    def identity(self) -> dict:
        """What sample g is, besides seq_len: the seed, and the shards' names, sizes and tokenizer file name (not
        their contents, which would take minutes to hash; nor the folders of shards or tokenizer, which may move)."""
        shards = [(s.path.name, s.num_tokens, Path(s.tokenizer).name) for s in self.stream.shards]
        digest = hashlib.blake2b(json.dumps(shards).encode(), digest_size=8).hexdigest()
        return {"kind": "token shards", "order": SampleOrder.KIND, "seed": self.order.seed, "tokens": len(self.stream),
                "shards": len(shards), "shards_digest": digest}

    def __repr__(self) -> str:
        tokenizer = self.stream.shards[0].tokenizer
        return (f"{self.where}: {len(self.stream.shards)} shard(s), {len(self.stream):,} tokens ({tokenizer}), "
                f"{self.num_samples:,} samples of {self.seq_len} per epoch")


class SyntheticTokens(Dataset):
    """Global sample index g -> uniformly random tokens that are a pure function of (seed, g), for any g >= 0.

    There are no epochs: the samples are independent already, so no permutation is applied.
    """

    def __init__(self, seq_len: int, vocab_size: int, seed: int):
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed

    def __getitem__(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(_derive_seed("synthetic", self.seed, g))
        tokens = torch.randint(self.vocab_size, (self.seq_len + 1,), generator=generator)
        return tokens[:-1], tokens[1:]

    def identity(self) -> dict:
        """What sample g is, besides seq_len."""
        return {"kind": "synthetic tokens", "vocab_size": self.vocab_size, "seed": self.seed}

    def __repr__(self) -> str:
        return f"data.source=synthetic: random tokens below {self.vocab_size}, samples of {self.seq_len}"


# ---------------------------------------------------------------------------------------- the stdlib corpus

def _stdlib_files(root: Path) -> list[Path]:
    files = []
    for folder, subfolders, names in os.walk(root):
        # Third-party packages differ between machines and would swamp the standard library's own code.
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages", "__pycache__")]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(files)


def stdlib_shards(cache_dir: str, root: Optional[str] = None) -> Path:
    """The folder holding the byte-tokenized standard library (its .py files, one document each).

    Written on first use into cache_dir under a name that hashes the Python version and the file list (names and
    sizes), reused afterwards. Ranks that race to write it each write complete files under unique temporary names
    and rename them into place, so no barrier is needed and every rank reads the same tokens.
    """
    root_dir = Path(root or sysconfig.get_paths()["stdlib"])
    files = _stdlib_files(root_dir) if root_dir.is_dir() else []
    if not files:
        raise ConfigError(f"data.source=stdlib: this Python has no standard library sources in {root_dir} "
                          "(a stripped or embedded install?); use --data.source tokens or synthetic")
    listing = "\n".join(f"{p.relative_to(root_dir)} {p.stat().st_size}" for p in files)
    key = hashlib.sha256(f"{sys.version}\n{listing}".encode()).hexdigest()[:16]
    out = Path(cache_dir).expanduser() / f"stdlib-{key}"
    if (out / "shard_00000.json").is_file():
        return out
    try:
        out.mkdir(parents=True, exist_ok=True)
        logger.info(f"tokenizing {len(files)} standard library files into {out} (once)")
        separator = np.array([BYTE_EOS], np.uint16)
        tokens = np.concatenate([t for p in files for t in (separator, np.frombuffer(p.read_bytes(), np.uint8))][1:])
        write_shard(out / "shard_00000.bin", tokens, BYTE_VOCAB_SIZE, "bytes")
    except OSError as err:
        raise ConfigError(f"data.cache_dir={cache_dir}: cannot write the stdlib corpus there ({err}); "
                          "set --data.cache_dir to a writable folder") from None
    return out


# ---------------------------------------------------------------------------------------- sampler and loader

def samples_per_step(micro_batch_size: int, grad_accum_steps: int, dp_size: int) -> int:
    """The global batch G: samples one optimizer step consumes across all data-parallel ranks."""
    return micro_batch_size * grad_accum_steps * dp_size


def check_enough_samples(dataset: Dataset, micro_batch_size: int, grad_accum_steps: int, dp_size: int) -> None:
    """Raise ConfigError if one step's global batch holds more samples than an epoch of `dataset` (build_dataset's):
    each step would then read some samples twice, where the ranks are meant to read disjoint ones."""
    global_batch = samples_per_step(micro_batch_size, grad_accum_steps, dp_size)
    if not isinstance(dataset, TokenWindows) or dataset.num_samples >= global_batch:
        return  # synthetic samples never repeat
    raise ConfigError(
        f"{dataset.where}: holds {dataset.num_samples} samples of train.seq_len={dataset.seq_len} tokens, fewer than "
        f"the global batch of {global_batch} (train.micro_batch_size={micro_batch_size} x train.grad_accum_steps="
        f"{grad_accum_steps} x {dp_size} data-parallel ranks), so every step would read some samples twice; "
        f"lower --train.micro_batch_size or --train.grad_accum_steps, use fewer ranks, or add data")


class StepSampler(Sampler[list[int]]):
    """This rank's micro-batches of global sample indices, step after step, without end.

    A step covers global indices [base, base + G); micro-batch m of rank r is base + m*dp_size*b + r*b + [0, b).
    The first base is `start_sample`. A loader with workers draws from its sampler ahead of training, so the
    trainer counts consumed samples itself (the same on every rank, valid for any dp_size or batch size) and a
    resumed run starts a new sampler there.
    """

    def __init__(self, micro_batch_size: int, grad_accum_steps: int, dp_rank: int, dp_size: int,
                 start_sample: int = 0):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        self.micro_batch_size, self.grad_accum_steps = micro_batch_size, grad_accum_steps
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.start_sample = start_sample

    def __iter__(self) -> Iterator[list[int]]:
        b, dp, accum = self.micro_batch_size, self.dp_size, self.grad_accum_steps
        for base in itertools.count(self.start_sample, samples_per_step(b, accum, dp)):
            for m in range(accum):
                first = base + (m * dp + self.dp_rank) * b
                yield list(range(first, first + b))


def build_dataset(cfg: DataConfig, seq_len: int, vocab_size: int) -> Dataset:
    """The source chosen by cfg, indexed by global sample index; its repr describes it for the log. Raises
    ConfigError, naming the field and a fix, if it cannot feed a model of vocab_size with seq_len samples.
    Tokenizes the stdlib corpus if not cached."""
    if cfg.source == "synthetic":
        return SyntheticTokens(seq_len, vocab_size, cfg.seed)
    if cfg.source == "stdlib":
        path = str(stdlib_shards(cfg.cache_dir))
        where = f"data.source=stdlib (cached in {path})"
    elif cfg.source == "tokens":
        if cfg.path is None:
            raise ConfigError(f"data.path is not set, but data.source=tokens reads token shards from it: pass "
                              f"--data.path <folder> ({_PREPARE_HINT}), or use --data.source stdlib or synthetic")
        path, where = cfg.path, f"data.path={cfg.path}"
    else:
        raise ConfigError(f"data.source={cfg.source!r}: expected stdlib, tokens or synthetic")
    stream = load_shards(path, where)
    _check_stream(stream, where, seq_len, vocab_size)
    return TokenWindows(stream, seq_len, cfg.seed, vocab_size, where)


def _ignore_stop_signals(worker_id: int) -> None:
    """Loader workers leave SIGTERM/SIGUSR1 to the training process, which checkpoints before exiting.

    torchrun delivers SIGTERM to a rank's whole process group; a worker killed by it would take the rank down
    ("DataLoader worker is killed by signal") before the checkpoint. Workers still end with their parent."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def stop_workers(batches) -> None:
    """Stop the loader's worker processes now (the trainer's, whether training ended or raised)."""
    shutdown = getattr(batches, "_shutdown_workers", None)  # the multi-process iterator's own shutdown
    if shutdown is not None:
        shutdown()


_running_iterators: "weakref.WeakSet" = weakref.WeakSet()


class _Loader(StatefulDataLoader):
    """A StatefulDataLoader whose worker processes are stopped before Python's exit stops them.

    Python's exit stops leftover children with SIGTERM and then waits for them; our workers ignore SIGTERM
    (`_ignore_stop_signals`), so any iterator still referenced then (from a traceback, say) would hang the exit."""

    def _get_iterator(self):
        batches = super()._get_iterator()
        _running_iterators.add(batches)
        return batches


@atexit.register  # registered after multiprocessing's own exit handler (torch imports it), so it runs before it
def _stop_running_workers() -> None:
    for batches in list(_running_iterators):
        stop_workers(batches)


def build_dataloader(dataset: Dataset, *, num_workers: int, micro_batch_size: int, grad_accum_steps: int,
                     dp_rank: int, dp_size: int, start_sample: int = 0,
                     device_type: str = "cpu") -> StatefulDataLoader:
    """An endless loader of this rank's (inputs, labels) micro-batches of `dataset` (build_dataset's), int64
    [micro_batch_size, seq_len] each, starting at global sample index start_sample (the trainer's consumed-sample
    count when resuming), read by num_workers worker processes (0: in this process)."""
    sampler = StepSampler(micro_batch_size, grad_accum_steps, dp_rank, dp_size, start_sample)
    with warnings.catch_warnings():
        # torchdata 0.11 calls torch.set_vital, deprecated in newer torch; the warning says nothing about our run.
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return _Loader(
            dataset,
            batch_sampler=sampler,
            num_workers=num_workers,
            pin_memory=device_type == "cuda",
            persistent_workers=num_workers > 0,
            worker_init_fn=_ignore_stop_signals,
            # Its own generator for the workers' base seed: drawn from the global one, as by default, it would
            # shift the training's random stream, which a resume restores exactly, by one draw.
            generator=torch.Generator(),
            # The trainer resumes from its own consumed-sample count and never reads the loader's snapshots;
            # taking one every step (the default) costs a round trip to every worker per batch.
            snapshot_every_n_steps=2**31,
        )
