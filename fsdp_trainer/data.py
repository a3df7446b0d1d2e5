"""Training data: token shards, the sample order, and each rank's data loader.

A shard is `<name>.bin` (little-endian uint16, or uint32 for vocabularies over 65536) plus a sidecar `<name>.json`
{"dtype", "num_tokens", "vocab_size", "tokenizer"}, made by `python -m fsdp_trainer.tools.prepare`. A folder's
shards, ordered by the numbers in their names, form one token stream of documents separated by an end-of-document token.

Sample k is the window tokens[k*L : k*L + L + 1] (inputs: the first L, labels: the last L). Global sample index g
reads sample permutation(seed, g // n)[g % n] for n samples per epoch. A step consumes global indices [base, base + G),
G = micro_batch_size x grad_accum_steps x dp_size; micro-batch m of data-parallel rank r holds base + m*dp_size*b +
r*b + [0, b). Only G decides a step's samples, so a resume from the consumed-sample count works on any number of ranks.
"""

import atexit
import hashlib
import itertools
import json
import logging
import os
import re
import signal
import sys
import sysconfig
import tempfile
import weakref
import zlib
from collections import namedtuple
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from fsdp_trainer.config import ConfigError, DataConfig

logger = logging.getLogger("fsdp_trainer")

BYTE_EOS = 256  # the byte tokenizer's end of document; its other tokens are the byte values 0..255
BYTE_VOCAB_SIZE = 257
PREPARE_HINT = "make shards with `python -m fsdp_trainer.tools.prepare <inputs...> <output_dir>`"
UNFINISHED = "PREPARE_UNFINISHED"  # in a folder prepare is writing: its shards may be only part of the data


class DataError(ConfigError):
    """Data found unusable as read; torch rebuilds one raised in a worker from its traceback: keep the message."""

    def __init__(self, message: str):
        super().__init__(message.strip().rsplit(f"{DataError.__name__}: ", 1)[-1])


def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write through a temporary file renamed into place: readers and racing writers see only whole files, and a
    file written after this returns (a sidecar, a checkpoint's marker) never outlives it in a crash."""
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


def write_shard(bin_path: Path, tokens: np.ndarray, vocab_size: int, tokenizer: str) -> None:
    """Write one shard, then its sidecar, whose presence marks the shard complete; ids must be in [0, vocab_size)."""
    data = np.ascontiguousarray(tokens, dtype="<u2" if vocab_size <= 2**16 else "<u4")
    write_atomic(bin_path, data.tofile)
    meta = {"dtype": data.dtype.name, "num_tokens": len(data), "vocab_size": vocab_size, "tokenizer": tokenizer}
    write_atomic(bin_path.with_suffix(".json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))


Shard = namedtuple("Shard", "path dtype num_tokens vocab_size tokenizer")  # one shard, as its sidecar describes it


def _read_sidecar(bin_path: Path, where: str) -> Shard:
    meta_path, fix = bin_path.with_suffix(".json"), f"re-create it ({PREPARE_HINT})"
    try:
        meta = json.loads(meta_path.read_text())
        with open(bin_path, "rb") as f:  # opened now, not first in a loader worker once the GPUs are allocated
            size = os.fstat(f.fileno()).st_size
        dtype = np.dtype({"uint16": "<u2", "uint32": "<u4"}[meta["dtype"]])
        num_tokens, vocab_size, tokenizer = meta["num_tokens"], meta["vocab_size"], meta["tokenizer"]
        valid = (isinstance(num_tokens, int) and num_tokens >= 0 and isinstance(vocab_size, int) and vocab_size > 0
                 and isinstance(tokenizer, str))
    except OSError as err:
        raise ConfigError(f"{where}: cannot read {err.filename} ({err.strerror}); make it readable, or {fix}") from None
    except (ValueError, KeyError, TypeError):  # not JSON, not an object, a key or dtype missing or unknown
        valid = False
    if not valid:
        raise ConfigError(f"{where}: sidecar {meta_path.name} is corrupt (expected {{\"dtype\": \"uint16\"|\"uint32\", "
                          f"\"num_tokens\": N, \"vocab_size\": V, \"tokenizer\": ...}}); {fix}")
    if vocab_size > 2**16 and dtype.itemsize == 2:  # uint32 ids would pass the size check as pairs of small ones
        raise ConfigError(f"{where}: sidecar {meta_path.name} says dtype uint16, which cannot hold the ids of its "
                          f"vocab_size {vocab_size}; {fix}, or set \"dtype\": \"uint32\" there if the ids are uint32")
    if size != num_tokens * dtype.itemsize:
        raise ConfigError(f"{where}: shard {bin_path.name} has {size} bytes but its sidecar promises {num_tokens} "
                          f"{dtype.name} tokens, so one of them is truncated or stale; {fix}")
    return Shard(bin_path, dtype, num_tokens, vocab_size, tokenizer)


class TokenStream:
    """The tokens of a folder's shards as one sequence; `where` names the setting that chose it, for errors."""

    def __init__(self, shards: list[Shard], where: str):
        self.shards, self.where = shards, where
        self.starts = np.cumsum([0] + [s.num_tokens for s in shards])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream."""
        first, end = np.searchsorted(self.starts, start, side="right") - 1, np.searchsorted(self.starts, stop)
        return np.concatenate([self._read(i, start, stop) for i in range(first, end)])

    def _read(self, i: int, start: int, stop: int) -> np.ndarray:
        """The tokens of shard i in stream positions [start, stop)."""
        shard, size = self.shards[i], self.shards[i].dtype.itemsize
        lo, hi = max(start - int(self.starts[i]), 0), min(stop, int(self.starts[i + 1])) - int(self.starts[i])
        try:
            with open(shard.path, "rb") as f:  # per read: a file kept open per shard could exceed `ulimit -n`
                data = os.pread(f.fileno(), (hi - lo) * size, lo * size)
        except OSError as err:
            raise DataError(f"{self.where}: cannot read shard {shard.path} ({err.strerror}): it was removed or made "
                            "unreadable after start-up; restore it and resume") from None
        if len(data) != (hi - lo) * size:
            raise DataError(f"{self.where}: shard {shard.path} is shorter than the {shard.num_tokens} tokens its "
                            f"sidecar promised at start-up: it changed during the run; re-create it and resume")
        tokens = np.frombuffer(data, shard.dtype)
        # An id past the embedding would be an IndexError on CPU, a device-side assert on GPUs.
        if len(tokens) and tokens.max() >= shard.vocab_size:
            k = int(np.argmax(tokens >= shard.vocab_size))
            raise DataError(f"{self.where}: token {lo + k:,} of shard {shard.path} is id {tokens[k]}, but its sidecar "
                            f"{shard.path.with_suffix('.json').name} says vocab_size {shard.vocab_size}, so the shard "
                            f"is corrupt or its sidecar wrong; re-create it ({PREPARE_HINT}), or, if the ids are "
                            f"right, set vocab_size {int(tokens[k]) + 1} or more there")
        return tokens


def shard_files(root: Path, suffix: str) -> list[Path]:
    """root's files ending in suffix, but for hidden ones (macOS copies leave a '._<name>' beside each file), in
    the order of the numbers in their names (shard_100000 after shard_99999)."""
    files = [p for p in root.glob(f"*{suffix}") if not p.name.startswith(".")]
    return sorted(files, key=lambda p: ([int(x) if i % 2 else x for i, x in enumerate(re.split(r"(\d+)", p.name))],
                                        p.name))


def load_shards(path: str, where: Optional[str] = None) -> TokenStream:
    """Open the shards in folder `path`; `where` names the setting that chose it, for error messages."""
    where, root = where or f"data.path={path}", Path(path).expanduser()
    if not root.is_dir():
        problem = "is a file" if root.exists() else "does not exist"
        raise ConfigError(f"{where}: {root} {problem}; expected a folder of token shards ({PREPARE_HINT})")
    if (root / UNFINISHED).exists():
        raise ConfigError(f"{where}: {root / UNFINISHED} is there: the prepare writing this folder was interrupted or "
                          "is running: its shards may hold part of the data; remove the folder and run prepare again")
    bins = shard_files(root, ".bin")
    if not bins:
        raise ConfigError(f"{where}: no token shards (<name>.bin + <name>.json) in {root}; {PREPARE_HINT}")
    return TokenStream([_read_sidecar(b, where) for b in bins], where)


def _derive_seed(*parts: object) -> int:
    """A 64-bit seed that is a fixed function of `parts`, stable across processes and Python runs."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


class SampleOrder:
    """Global sample index g -> sample index: epoch g // n visits all n samples in a permutation of (seed, epoch),
    computed per index (no stored permutation in every worker): a Feistel network on [0, 4**h) for the smallest h
    that holds n - 1, applied until it lands in [0, n)."""

    ROUNDS = 6  # four suffice for a pseudo-random permutation from random round functions (Luby-Rackoff)

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
    """SplitMix64's finalizer: every input bit flips about half the output bits."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


class TokenWindows(Dataset):
    """Global sample index -> (inputs, labels), int64 [seq_len] each, from non-overlapping windows of a stream."""

    def __init__(self, stream: TokenStream, seq_len: int, seed: int):
        self.stream, self.seq_len, self.where = stream, seq_len, stream.where
        self.num_samples = (len(stream) - 1) // seq_len
        self.order = SampleOrder(self.num_samples, seed)

    def window(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample k itself: tokens[k*seq_len : k*seq_len + seq_len + 1], split into inputs and labels."""
        tokens = torch.from_numpy(self.stream.read(k * self.seq_len, (k + 1) * self.seq_len + 1).astype(np.int64))
        return tokens[:-1], tokens[1:]

    def __getitem__(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.window(self.order(g))

    def identity(self) -> dict:
        """What sample g is, besides seq_len: seed, shards' names, sizes and tokenizer (hashing contents is slow)."""
        shards = [(s.path.name, s.num_tokens, Path(s.tokenizer).name) for s in self.stream.shards]
        digest = hashlib.blake2b(json.dumps(shards).encode(), digest_size=8).hexdigest()
        return {"kind": "token shards", "order": "feistel", "seed": self.order.seed, "tokens": len(self.stream),
                "shards": len(shards), "shards_digest": digest}

    def __repr__(self) -> str:
        return (f"{self.where}: {len(self.stream.shards)} shard(s), {len(self.stream):,} tokens "
                f"({self.stream.shards[0].tokenizer}), {self.num_samples:,} samples of {self.seq_len} per epoch")


class SyntheticTokens(Dataset):
    """Global sample index g -> uniformly random tokens, a pure function of (seed, g): no epochs, no permutation."""

    def __init__(self, seq_len: int, vocab_size: int, seed: int, held_out: bool = False):
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed
        self.kind = "synthetic held out" if held_out else "synthetic"  # each split's samples from seeds of its own

    def __getitem__(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(_derive_seed(self.kind, self.seed, g))
        tokens = torch.randint(self.vocab_size, (self.seq_len + 1,), generator=generator)
        return tokens[:-1], tokens[1:]

    def identity(self) -> dict:
        return {"kind": "synthetic tokens", "vocab_size": self.vocab_size, "seed": self.seed}

    def __repr__(self) -> str:
        return f"data.source=synthetic: random tokens below {self.vocab_size}, samples of {self.seq_len}"


STDLIB_HELD_OUT = 50  # one standard library file in this many, by a hash of its path, is held out (in val/)


def stdlib_shards(cache_dir: str, root: Optional[str] = None) -> Path:
    """The byte-tokenized standard library's .py files (held-out ones in val/), written once into cache_dir under a
    hash of the Python version and file list. Racing ranks each rename whole files into place: no barrier needed."""
    root_dir, files = Path(root or sysconfig.get_paths()["stdlib"]), []
    for folder, subfolders, names in os.walk(root_dir):
        # Third-party packages differ between machines and would swamp the standard library's own code.
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages", "__pycache__")]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    if not files:
        raise ConfigError(f"data.source=stdlib: this Python has no standard library sources in {root_dir}; "
                          "use --data.source tokens or synthetic")
    files.sort()
    listing = "".join(f"\n{p.relative_to(root_dir)} {p.stat().st_size}" for p in files)
    key = hashlib.sha256(f"{sys.version} held out 1/{STDLIB_HELD_OUT}{listing}".encode()).hexdigest()[:16]
    out = Path(cache_dir).expanduser() / f"stdlib-{key}"
    if (out / "shard_00000.json").is_file():
        return out
    logger.info(f"tokenizing {len(files)} standard library files into {out} (once)")
    separator = np.array([BYTE_EOS], np.uint16)
    held_out = [zlib.crc32(str(p.relative_to(root_dir)).encode()) % STDLIB_HELD_OUT == 0 for p in files]
    try:
        # The training shard last: its sidecar marks the folder complete.
        for folder, split in ((out / "val", True), (out, False)):
            docs = [np.frombuffer(p.read_bytes(), np.uint8) for p, held in zip(files, held_out) if held == split]
            if not docs:  # a handful of files may hold none out
                continue
            tokens = np.concatenate([t for doc in docs for t in (separator, doc)][1:])
            folder.mkdir(parents=True, exist_ok=True)
            write_shard(folder / "shard_00000.bin", tokens, BYTE_VOCAB_SIZE, "bytes")
    except OSError as err:
        raise ConfigError(f"data.cache_dir={cache_dir}: cannot write the stdlib corpus there ({err}); "
                          "set --data.cache_dir to a writable folder") from None
    return out


def build_dataset(cfg: DataConfig, seq_len: int, vocab_size: int, held_out: bool = False) -> Dataset:
    """The source cfg chooses (`held_out`: its held-out split), indexed by global sample index; a ConfigError naming
    the field and a fix if it cannot feed a model of vocab_size with seq_len samples."""
    if cfg.source == "synthetic":
        return SyntheticTokens(seq_len, vocab_size, cfg.seed, held_out)
    if cfg.source == "stdlib":
        path = str(stdlib_shards(cfg.cache_dir) / ("val" if held_out else ""))
        where = f"data.source=stdlib (cached in {path})"
    elif cfg.path is None:
        raise ConfigError(f"data.path is not set, but data.source=tokens reads token shards from it: pass "
                          f"--data.path <folder> ({PREPARE_HINT}), or use --data.source stdlib or synthetic")
    elif held_out:
        path = cfg.eval_path or str(Path(cfg.path) / "val")
        where = f"data.eval_path={path}"
        if not (cfg.eval_path or Path(path).expanduser().is_dir()):
            raise ConfigError(f"evaluation needs held-out data, and data.path={cfg.path} has no val/ folder: prepare "
                              "with --holdout 0.01, pass --data.eval_path <folder>, or set --eval.every 0")
    else:
        path, where = cfg.path, f"data.path={cfg.path}"
    stream = load_shards(path, where)
    tokenizers = sorted({s.tokenizer for s in stream.shards})
    if len(tokenizers) > 1:
        raise ConfigError(f"{where}: shards come from different tokenizers ({', '.join(tokenizers)}); "
                          "keep one tokenizer per folder")
    if len(stream) < seq_len + 1:
        shorter = f"lower --train.seq_len to at most {len(stream) - 1} or " if len(stream) > 1 else ""
        raise ConfigError(f"{where}: holds {len(stream)} tokens, but train.seq_len={seq_len} needs at least "
                          f"{seq_len + 1} for one sample; {shorter}add data")
    data_vocab = max(s.vocab_size for s in stream.shards)  # ids are checked against it as read
    if data_vocab > vocab_size:
        raise ConfigError(f"{where}: tokenized with vocab_size {data_vocab} ({tokenizers[0]} tokenizer), but "
                          f"model.vocab_size={vocab_size}; set --model.vocab_size {data_vocab} or larger")
    return TokenWindows(stream, seq_len, cfg.seed)


def samples_per_step(micro_batch_size: int, grad_accum_steps: int, dp_size: int) -> int:
    """The global batch G: samples one optimizer step consumes across all data-parallel ranks."""
    return micro_batch_size * grad_accum_steps * dp_size


def check_enough_samples(dataset: Dataset, micro_batch_size: int, grad_accum_steps: int, dp_size: int) -> None:
    """Raise ConfigError if one step's global batch holds more samples than an epoch of `dataset`."""
    global_batch = samples_per_step(micro_batch_size, grad_accum_steps, dp_size)
    if not isinstance(dataset, TokenWindows) or dataset.num_samples >= global_batch:
        return  # synthetic samples never repeat
    raise ConfigError(
        f"{dataset.where}: holds {dataset.num_samples} samples of train.seq_len={dataset.seq_len} tokens, fewer than "
        f"the global batch of {global_batch} (train.micro_batch_size={micro_batch_size} x train.grad_accum_steps="
        f"{grad_accum_steps} x {dp_size} data-parallel ranks), so every step would read some samples twice; "
        f"lower --train.micro_batch_size or --train.grad_accum_steps, use fewer ranks, or add data")


class StepSampler(Sampler[list[int]]):
    """This rank's micro-batches of global sample indices, step after step from `start_sample`, without end. Workers
    draw ahead of training, so the trainer counts consumed samples itself and a resume starts a new sampler there."""

    def __init__(self, micro_batch_size: int, grad_accum_steps: int, dp_rank: int, dp_size: int, start_sample=0):
        self.micro_batch_size, self.grad_accum_steps = micro_batch_size, grad_accum_steps
        self.dp_rank, self.dp_size, self.start_sample = dp_rank, dp_size, start_sample

    def __iter__(self) -> Iterator[list[int]]:
        b, dp, accum = self.micro_batch_size, self.dp_size, self.grad_accum_steps
        for base in itertools.count(self.start_sample, samples_per_step(b, accum, dp)):
            for m in range(accum):
                first = base + (m * dp + self.dp_rank) * b
                yield list(range(first, first + b))


def _ignore_stop_signals(worker_id: int) -> None:
    """torchrun SIGTERMs a rank's process group: a worker it killed would take the rank down before its checkpoint."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def stop_workers(batches) -> None:
    """Stop the loader's worker processes now (the trainer's, whether training ended or raised)."""
    if hasattr(batches, "_shutdown_workers"):  # a multi-process iterator
        batches._shutdown_workers()


_running_iterators: "weakref.WeakSet" = weakref.WeakSet()


class _Loader(DataLoader):
    """Python's exit stops leftover children with SIGTERM, which our workers ignore, then waits for them: the
    iterators are remembered so that their workers can be stopped first."""

    def _get_iterator(self):
        batches = super()._get_iterator()
        _running_iterators.add(batches)
        return batches


@atexit.register  # registered after multiprocessing's own exit handler (torch imports it), so it runs before it
def _stop_running_workers() -> None:
    for batches in list(_running_iterators):
        stop_workers(batches)


def build_dataloader(dataset: Dataset, *, num_workers: int, micro_batch_size: int, grad_accum_steps: int,
                     dp_rank: int, dp_size: int, start_sample: int = 0, device_type: str = "cpu") -> DataLoader:
    """An endless loader of this rank's (inputs, labels) micro-batches, int64 [micro_batch_size, seq_len] each,
    from global sample index start_sample (the consumed-sample count when resuming)."""
    return _Loader(
        dataset,
        batch_sampler=StepSampler(micro_batch_size, grad_accum_steps, dp_rank, dp_size, start_sample),
        num_workers=num_workers,
        pin_memory=device_type == "cuda",
        worker_init_fn=_ignore_stop_signals,
        # its own: the workers' base seed drawn from the global generator would shift the training's random stream
        generator=torch.Generator(),
    )
