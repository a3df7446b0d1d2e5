"""Checkpoints: sharded save and load through torch.distributed.checkpoint (DCP), atomic commit, retention,
resume on any world size or mesh, preemption, and the list and verify commands. Moving weights to and from a
Hugging Face model (convert, checkpoint.init_from) is weights.py's.

Runbook:
    # resume: run the same command again (--checkpoint.resume auto takes the newest complete checkpoint)
    torchrun --nproc_per_node=8 -m fsdp_trainer.train --config configs/llama3_8b.toml
    # ... on another number of GPUs or another mesh: DCP reshards; the data continue at the saved sample count
    torchrun --nproc_per_node=4 -m fsdp_trainer.train --config configs/llama3_8b.toml --train.grad_accum_steps 2
    # preempt: SIGTERM or SIGUSR1 to the training processes (every rank, or just one: they agree) finishes the
    # step in progress and one more (the ranks' vote is read a step late, to need no sync), saves, waits for the
    # save and exits 0 (during start-up: exits 0 before the first step, having nothing new to save); a second
    # signal exits at once. Signal the ranks, not torchrun:
    # torchrun dies of SIGUSR1, and passes SIGTERM on but kills the ranks 30 s later, saved or not. So start
    # `bash launch/relay_signals.sh torchrun ...` and signal that script, or on each node signal torchrun's
    # children, once they have logged: `pkill -USR1 -P <torchrun's pid>` (`pkill -f fsdp_trainer.train` matches
    # torchrun itself too). In a rank's first seconds, while it imports torch, a signal still kills it.
    python -m fsdp_trainer.tools.checkpoints list outputs/checkpoints
    python -m fsdp_trainer.tools.checkpoints verify outputs/checkpoints/step_00000200        # e.g. after copying it
    python -m fsdp_trainer.tools.convert to-hf outputs/checkpoints/step_00000200 exported/   # a Hugging Face Llama
    python -m fsdp_trainer.train --checkpoint.init_from hf:exported/ ...                     # fine-tune from those

Layout of <checkpoint.dir>/step_00000200/:
    .metadata            DCP's index of every tensor chunk; rank 0 writes it after every rank has written its data
    __<rank>_<n>.distcp  each rank's shards of the model and optimizer state, and its RNG states
    config.toml          the resolved config of the run that saved it, written first: export reads the model's
                         settings from it (resume needs none of it)
    trainer_state.json   written last, by rank 0, once DCP finished: its presence marks the checkpoint committed.
                         Holds the size and CRC32 of every .distcp file and of .metadata (checked while a load
                         reads them) and a CRC32 of its own other contents (checked when it is read), step, consumed_samples, tokens_seen, skipped_steps (non-finite), LR-scheduler and
                         grad-scaler state, world size, seq_len, the data's identity, and started_from (the
                         --checkpoint.resume path that began this run, kept by every resume since, if one was
                         named).
A folder without trainer_state.json is an interrupted save: resume skips it, and retention or the next save of its
step deletes it. A committed checkpoint whose trainer_state.json cannot be used (unreadable, another format) is an
error at resume and is never deleted: only its owner can tell whether it was damaged or written by another version.

Changing the global batch (ranks, micro-batch, accumulation) on resume is allowed: the first new step starts at
the saved consumed_samples, so no sample is skipped or repeated. Changing train.seq_len is not: the sample count
indexes windows of the saved length.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import random
import re
import shutil
import signal
import threading
import time
import tomllib
import warnings
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._state_dict_utils import _copy_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from fsdp_trainer.config import Config, ConfigError, checkpoint_root, from_dict, mesh_shape, model_flag, to_toml
from fsdp_trainer.data import fsync_folder, samples_per_step, write_atomic
from fsdp_trainer.distributed import ATTEMPT, BACKSTOP_S, DistInfo, cores_per_rank, logger, spans
from fsdp_trainer.models.llama import Transformer, model_args_from_config

MARKER = "trainer_state.json"
CHECKSUMS = "checksums"  # the marker's {file name: [size, CRC32]} of the .distcp files and .metadata
# The marker's CRC32 of its other keys, serialized canonically: a digit changed in consumed_samples would resume at
# another sample, and nothing else would notice.
MARKER_SUM = "marker_crc32"
NO_CHECKSUMS = "it has no checksums (saved with --checkpoint.no_checksums, or by an older fsdp_trainer)"
CONFIG = "config.toml"
FORMAT = 1
MODEL_CLASS = "model_class"  # the trainer state's record of the model's class, as "module.QualName"
WEIGHTS_ONLY = "weights_only"  # in the trainer state of a model imported by tools.convert: no optimizer state yet
LLAMA_CLASS = f"{Transformer.__module__}.{Transformer.__qualname__}"
# What resume and `list` read from trainer_state.json; a marker without one of them is not a usable checkpoint.
_REQUIRED = ("step", "consumed_samples", "tokens_seen", "world_size", "mesh", "global_batch", "scheduler", "saved_at")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# DCP's CheckpointException derives from BaseException, so `except Exception` would let it through.
DCP_ERRORS = (Exception, CheckpointException)
# Set in the c10d store by each rank once its part of a save is on storage: a save whose exchange timed out names the
# ranks without it. Per torchrun restart, as the watchdog's reports are.
WRITTEN = f"fsdp_trainer/written/{ATTEMPT}/{{step}}/{{rank}}"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message names it, the problem and what to do."""


@dataclass
class Progress:
    """Where training stands: with the tensors, all a resumed run needs to continue exactly."""

    step: int = 0
    consumed_samples: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0  # non-finite steps never applied, as of the last save or resume

    def advance(self, samples: int, seq_len: int) -> None:
        """Count one finished optimizer step of `samples` samples of `seq_len` tokens."""
        self.step += 1
        self.consumed_samples += samples
        self.tokens_seen += samples * seq_len


# ------------------------------------------------------------------------------------------- folders on disk

def step_dir(root: Path, step: int) -> Path:
    """The folder of the checkpoint of `step` under `root`."""
    return Path(root) / f"step_{step:08d}"


def model_class(model: nn.Module) -> type:
    """The model's own class, not the subclass fully_shard swaps in (FSDPGPT2 for GPT2)."""
    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def own_model_class(state: dict) -> Optional[str]:
    """The class a checkpoint's model was, by its trainer state, if it is a team's own (train.main's model_fn):
    config.toml's --model.* settings then describe a Llama preset that was never trained. None for fsdp_trainer's
    Llama, and for checkpoints saved before the class was recorded."""
    saved = state.get(MODEL_CLASS)
    return saved if saved not in (None, LLAMA_CLASS) else None


def read_trainer_state(path: Path) -> dict:
    """The trainer state (step, counters, scheduler...) of a complete checkpoint."""
    return json.loads((Path(path) / MARKER).read_text())


def incomplete_reason(path: Path) -> Optional[str]:
    """Why `path` is no committed checkpoint, to follow "it" (it has no .metadata...), or None once committed.
    Only the marker, written last, commits a save: a folder without one holds nothing worth keeping, so resume
    skips it and saves delete it. A committed checkpoint may still be unusable: see unusable_reason."""
    path = Path(path)
    if not path.is_dir():
        return "does not exist" if not path.exists() else "is not a folder"
    if (path / MARKER).exists():
        return None
    if not (path / ".metadata").is_file():
        return "has no .metadata: not every rank had finished writing when the save was interrupted"
    return f"has no {MARKER}: the save was interrupted before rank 0 committed it"


def unusable_reason(path: Path) -> Optional[str]:
    """Why the committed checkpoint `path` cannot be used, to follow "it", or None if it can. Unlike an interrupted
    save, such a checkpoint is an error, never skipped or deleted: it may be the run's newest, damaged since, or
    written by another version of fsdp_trainer that can still resume it."""
    return _read_marker(path)[1]


def _read_marker(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """(the trainer state, None) of the committed checkpoint `path` if it can be used, else (None, unusable_reason)."""
    try:
        state = read_trainer_state(path)
    except (OSError, ValueError) as err:
        return None, f"has an unreadable {MARKER} ({type(err).__name__}: {err})"
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        return None, f"has a {MARKER} that is not format {FORMAT} (written by another version of fsdp_trainer?)"
    missing = [key for key in _REQUIRED if key not in state]
    if missing:
        return None, (f"has a {MARKER} without {', '.join(missing)} (edited, or written by another version of "
                      "fsdp_trainer?)")
    if MARKER_SUM in state and state[MARKER_SUM] != _marker_sum(state):
        return None, (f"has a {MARKER} that differs from what the save wrote (its {MARKER_SUM} does not match: "
                      f"damaged since, or edited; if edited on purpose, delete its \"{MARKER_SUM}\" line)")
    if not (Path(path) / ".metadata").is_file():  # rank 0 commits only after DCP wrote it: removed since
        return None, f"has a {MARKER} but no .metadata (deleted after the save?)"
    return state, None


def write_marker(path: Path, state: dict, sums: Optional[dict[str, list[int]]]) -> None:
    """Commit the checkpoint at `path`: its marker, holding the trainer state and its files' checksums (None: none
    recorded)."""
    state = {**state, CHECKSUMS: sums and dict(sorted(sums.items()))}
    if sums is not None:
        state[MARKER_SUM] = _marker_sum(state)
    marker = json.dumps(state, indent=1) + "\n"
    write_atomic(path / MARKER, lambda f: f.write(marker.encode()))


def _marker_sum(state: dict) -> int:
    return zlib.crc32(json.dumps({k: v for k, v in state.items() if k != MARKER_SUM}, sort_keys=True).encode())


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Every step_* folder under root, oldest first, complete or not."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def _is_complete(path: Path) -> bool:
    """Whether `path` is a committed and usable checkpoint."""
    return incomplete_reason(path) is None and unusable_reason(path) is None


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """The committed and usable checkpoints under root, oldest first."""
    return [(step, path) for step, path in list_checkpoints(root) if _is_complete(path)]


def committed_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """The committed checkpoints under root, usable or not, oldest first: those no save may overwrite."""
    return [(step, path) for step, path in list_checkpoints(root) if incomplete_reason(path) is None]


class Checkpoint(NamedTuple):
    """A committed checkpoint found usable, with the trainer state read from its marker then. What loads it reads
    that state from here: read again, the marker could say otherwise than what was checked."""

    path: Path
    state: dict


def find_latest(root: Path) -> tuple[Optional[Checkpoint], list[tuple[Path, str]]]:
    """The newest complete checkpoint under root (or None), and the newer incomplete ones passed over, with why.
    A CheckpointError if the newest committed one is unusable: passing over it would resume from an older one,
    and the run's later saves would then land next to it."""
    skipped = []
    for _, path in reversed(list_checkpoints(root)):
        reason = incomplete_reason(path)
        if reason is None:
            return check_usable(path), skipped
        skipped.append((path, reason))
    return None, skipped


def check_usable(path: Path) -> Checkpoint:
    """The committed checkpoint `path`; a CheckpointError naming it, its problem and the ways on if it is unusable."""
    state, problem = _read_marker(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} cannot be used: it {problem}. Nothing was deleted; "
                              f"{ways_past(path)}")
    return Checkpoint(Path(path), state)


def ways_past(path: Path) -> str:
    """What to do about the committed but unusable or corrupt checkpoint `path`. For a run's step_* folder, both
    ways work as written: resume refuses a run that would save where newer committed checkpoints lie, so either
    `path` leaves its folder's step_* names, or the run saves to another folder."""
    path = Path(path)
    match = _STEP_DIR.match(path.name)
    if match is None:  # a copy, say: no run resumes from it or deletes it by itself, and renaming it does nothing
        return "use another checkpoint"
    older = [p for step, p in list_checkpoints(path.parent) if step < int(match.group(1))]
    # Newest first, reading markers only until one is usable: resume computes this before it knows of any problem.
    previous = next((p for p in reversed(older) if _is_complete(p)), None)
    aside = f"rename it (mv {path} {path}.unusable: resume and retention see only folders named step_<number>)"
    if previous is None:
        return f"{aside}, and --checkpoint.resume auto starts fresh: there is no earlier complete checkpoint"
    return (f"{aside}, and --checkpoint.resume auto takes the previous complete checkpoint, {previous}; or keep "
            f"it there and resume from that one into a new folder: --checkpoint.resume {previous} "
            "--checkpoint.dir <new folder>")


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
    if _STEP_DIR.match(path.name) or (path / ".metadata").exists() or (path / MARKER).exists():
        reason = incomplete_reason(path)
        if reason is not None:
            complete = complete_checkpoints(path.parent)
            hint = f"the newest complete one there is {complete[-1][1]}" if complete else "there is no complete one"
            raise CheckpointError(f"{flag} {path}: not a complete checkpoint: it {reason}; {hint}")
        return check_usable(path)
    latest, _ = find_latest(path)
    if latest is None:
        raise CheckpointError(f"{flag} {path}: holds no complete checkpoint (a step_* folder with {MARKER})"
                              f"{_export_hint(path)}")
    return latest


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


# --------------------------------------------------------------------------------- checking before loading

def read_metadata(checkpoint: Checkpoint, fix: str, checksums: bool = True) -> Metadata:
    """DCP's index of a checkpoint; a CheckpointError naming the folder and `fix` if it cannot be read or, with
    `checksums`, differs from what the save wrote (a changed size in it still unpickles, and would be taken for
    another model's shape). Of a checkpoint's files, only this one is checked before it is used: checked() leaves
    it out."""
    path, state = checkpoint
    saved = (state.get(CHECKSUMS) or {}).get(".metadata") if checksums else None
    if saved and (problem := _problem(path, ".metadata", saved, threading.Event())):
        raise _corrupt(path, [problem], fix)
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # a truncated or foreign file fails in pickle, in torch or in the OS
        raise CheckpointError(f"checkpoint {path}: its .metadata cannot be read ({type(err).__name__}: {err}), so "
                              f"the checkpoint is corrupt; {fix}") from None


def dcp_cause(err: BaseException) -> str:
    """DCP's error in one line: the first failing rank's exception. DCP's own message is a traceback per rank,
    and its first line names only the ranks."""
    failures = getattr(err, "failures", None)
    if not failures:
        return f"{type(err).__name__}: {err}"
    rank, (exc, _) = min(failures.items())
    message = str(exc).strip()
    return f"rank {rank}: {type(exc).__name__}" + (f": {message}" if message else "")


def load_dcp(state: dict, path: Path, group: Optional[dist.ProcessGroup], fix: str) -> None:
    """Fill `state` in place from the checkpoint at `path`, resharded by DCP, on every rank of `group` (None: in
    this process alone); a CheckpointError naming the folder, the first failing rank's error, the files shorter
    than the index says, and `fix` if a file cannot be read."""
    try:
        if group is None:
            with warnings.catch_warnings():  # DCP warns that no_dist loads in one process: that is the point
                warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
                dcp.load(state, checkpoint_id=str(path), no_dist=True)
        else:
            dcp.load(state, checkpoint_id=str(path), process_group=group)
    except DCP_ERRORS as err:  # DCP gathers every rank's read errors and raises them on all ranks
        short = _short_files(path)
        if not short and group is not None and _lost_a_peer(err):
            raise CheckpointError(f"checkpoint {path} could not be read ({dcp_cause(err)}): a rank stopped answering "
                                  "while the ranks loaded it (stuck in its reads, or gone: the watchdog's report "
                                  "names it); the files are not at fault. Resume again once that rank's storage and "
                                  "host are healthy") from err
        found = "; ".join(short) if short else "a file is corrupt or truncated"
        raise CheckpointError(f"checkpoint {path} could not be read ({dcp_cause(err)}): {found}; {fix}") from err


_PEER_LOST = re.compile(r"timed out|connection (closed|reset|refused)|broken pipe|pair closure|socket closed",
                        re.IGNORECASE)


def _lost_a_peer(err: BaseException) -> bool:
    """Whether a load or a save failed in its (gloo) collectives, not in the files: gloo's timeouts and lost connections are
    plain RuntimeErrors, told apart only by their text. A storage fault is an OSError, whatever its text says (a
    network file system's "Connection timed out", a path holding these words)."""
    failures = getattr(err, "failures", None)
    first = min(failures.items())[1][0] if failures else err
    if isinstance(first, OSError):
        return False
    return isinstance(first, dist.DistError) or bool(_PEER_LOST.search(str(first)))


def _short_files(path: Path) -> list[str]:
    """The data files of `path` that are missing or end before the last byte its .metadata places in them. DCP's
    own error for a truncated file (an EOFError, say) names no file."""
    try:
        storage = dcp.FileSystemReader(str(path)).read_metadata().storage_data
    except Exception:  # an unreadable index fails earlier, in read_metadata, with its own message
        return []
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    short = []
    for name, size in sorted(needed.items()):
        file = Path(path) / name
        if not file.is_file():
            short.append(f"{name} is missing")
        elif (have := file.stat().st_size) < size:
            short.append(f"{name} holds {have:,} bytes where the index needs {size:,} (truncated)")
    return short


# ------------------------------------------------------------------------------------------------ checksums

class _SummingStream:
    """A file being written, keeping the size and CRC32 of what went through it."""

    def __init__(self, stream):
        self._stream, self.size, self.crc = stream, 0, 0

    def write(self, data) -> int:
        written = self._stream.write(data)
        self.size, self.crc = self.size + written, zlib.crc32(memoryview(data).cast("B")[:written], self.crc)
        return written

    def __getattr__(self, name: str):  # tell, flush, fileno (for fsync), close
        if name == "_stream":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self._stream, name)


class _WatchedFileSystem(FileSystem):
    """DCP's local file system, keeping every error raised while a file was opened or written through it, with the
    file: torch only prints those of its extra writer threads (checkpoint.write_threads but the first), and a
    write's OSError names no file."""

    def __init__(self):
        super().__init__()
        self.failures: list[tuple[str, Exception]] = []

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except Exception as err:
            self.failures.append((str(path), err))  # one append: atomic, however many threads fail at once
            raise


class _SummingFileSystem(_WatchedFileSystem):
    """_WatchedFileSystem, also keeping the size and CRC32 of each file written through it, by its name."""

    def __init__(self):
        super().__init__()
        self.sums: dict[str, list[int]] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):  # a writer's file system: it only writes
        with super().create_stream(path, mode) as stream:
            summing = _SummingStream(stream)
            yield summing
        self.sums[Path(path).name] = [summing.size, summing.crc]  # one writer thread per file: no race


class CheckpointWriter(dcp.FileSystemWriter):
    """DCP's file writer. A save fails with the first error any of its writer threads hit, naming the file: torch
    raises only the first thread's, prints the others', and would commit the checkpoint without their tensors.
    With `checksums`, it records the size and CRC32 of every file: DCP keeps none, so a shard changed on storage
    after the save (a flipped bit, a copy cut short) would load without a word. Each rank sums its files as its
    writer threads write them (an async save's background threads), and the sums travel to the coordinator with
    DCP's own write results. There, `sums` holds every file's once the save is done. `on_written` is called once
    this rank's files are on storage."""

    def __init__(self, path: str, thread_count: int, checksums: bool, on_written: Callable[[], None] = lambda: None):
        # fsync stays on: the completion marker must never reach the disk before the shards it vouches for.
        super().__init__(path, thread_count=thread_count, sync_files=True)
        self.checksums, self.on_written = checksums, on_written
        self.fs = _SummingFileSystem() if checksums else _WatchedFileSystem()
        self.sums: dict[str, list[int]] = {}

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        self.sums = {}
        self.fs.failures = []
        if self.checksums:
            self.fs.sums = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        try:
            written = super().write_data(plan, planner)  # the first thread's error comes out here, the others' not
        except Exception:
            self._raise_first_failure()
            raise
        results = written.wait()  # FileSystemWriter has written when it returns
        if len(results) != len(plan.items):
            self._raise_first_failure()
            raise RuntimeError(f"{len(plan.items) - len(results)} of this rank's {len(plan.items)} tensors were not "
                               "written: a writer thread failed outside its file (its error is printed above)")
        self.on_written()
        if not self.checksums:
            return written
        carrying: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        carrying.set_result([replace(r, storage_data=(r.storage_data, self.fs.sums[r.storage_data.relative_path]))
                             for r in results])
        return carrying

    def _raise_first_failure(self) -> None:
        """Raise the first error a writer thread hit in a file, if any, so that a failed save reads the same
        whichever thread failed. An OSError of a write names no file: it is raised again naming it, as open()'s do."""
        if not self.fs.failures:
            return
        path, err = self.fs.failures[0]
        if isinstance(err, OSError) and err.filename is None and err.errno is not None:
            raise OSError(err.errno, err.strerror, path) from err  # OSError() picks the subclass of the errno
        raise err

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if not self.checksums:
            return super().finish(metadata, results)
        plain = []  # .metadata holds DCP's own records only: any DCP reader can read the checkpoint
        for rank_results in results:
            self.sums.update((info.relative_path, sums) for info, sums in (r.storage_data for r in rank_results))
            plain.append([replace(r, storage_data=r.storage_data[0]) for r in rank_results])
        data_files = set(self.fs.sums)
        super().finish(metadata, plain)
        # The one file finish() wrote: .metadata, under another name that it then renamed. config.toml is not summed:
        # resume does not read it, and export checks it on its own (saved_config), where a replacement is welcome.
        (index,) = set(self.fs.sums) - data_files
        self.sums[".metadata"] = self.fs.sums[index]


def _file_sum(path: Path, stop: threading.Event) -> list[int]:
    """[size, CRC32] of a file (up to where `stop` was set)."""
    size, crc, buffer = 0, 0, bytearray(16 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while not stop.is_set() and (n := f.readinto(buffer)):
            size, crc = size + n, zlib.crc32(view[:n], crc)
    return [size, crc]


def _problem(folder: Path, name: str, saved: list[int], stop: threading.Event) -> Optional[str]:
    """What is wrong with file `name` of a checkpoint, whose save recorded [size, CRC32] `saved`; None if nothing."""
    try:
        size, crc = _file_sum(folder / name, stop)
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as err:  # a storage fault: reported with the rest, by every rank, not as one rank's crash
        return f"{name} cannot be read ({type(err).__name__}: {err})"
    if stop.is_set():
        return None
    if size != saved[0]:
        return f"{name} holds {size:,} bytes where the save wrote {saved[0]:,}"
    if crc != saved[1]:
        return f"{name} differs from what the save wrote (CRC32 {crc:08x}, saved {saved[1]:08x})"
    return None


def _corrupt(path: Path, problems: list[str], fix: str) -> CheckpointError:
    more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
    return CheckpointError(f"checkpoint {path} is corrupt: {'; '.join(problems[:3])}{more}. The files changed after "
                           f"the save committed them (a storage fault, or a copy cut short); {fix}")


def _share(names: list[str], rank: int, world: int, saved_world: int) -> list[str]:
    """The data files of a checkpoint this rank checks: on the saving world size, those it wrote itself
    (__<rank>_*), which it also loads, so that on several nodes each file is read on the node that loads it; else
    every world-th file."""
    if world != saved_world:
        return names[rank::world]
    owner = {name: int(m.group(1)) if (m := re.match(r"__(\d+)_", name)) else 0 for name in names}
    return [name for name in names if owner[name] == rank]


@contextlib.contextmanager
def checked(checkpoint: Checkpoint, group: Optional[dist.ProcessGroup], fix: str, threads: int,
            enabled: bool = True) -> Iterator[list[str]]:
    """Check the data files of a committed checkpoint against the size and CRC32 its save recorded while the
    block reads the checkpoint: the page cache then serves one of the two reads of each file, where checking first
    would read the whole checkpoint twice. Its .metadata is read_metadata's to check, before the shapes in it are
    used: every caller has read it so. Each rank of `group` (None: this process alone) checks its share of the
    files, `threads` at a time. After the block, every rank raises a CheckpointError naming the damaged files and
    `fix` (in place of the block's own error, which such files cause), or the list yielded holds what was checked,
    to log. It stays empty for a checkpoint saved without checksums, and when not `enabled` (then nothing else
    happens either: every rank has the same setting)."""
    path, state = checkpoint
    recorded = state.get(CHECKSUMS) or {}
    if not enabled:
        yield []
        return
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    mine = _share(sorted(recorded.keys() - {".metadata"}), rank, world, state["world_size"])
    stop, report, failure = threading.Event(), [], None

    def check() -> tuple[list[str], float]:
        start = time.perf_counter()
        with ThreadPoolExecutor(max(1, threads)) as pool:  # zlib releases the GIL
            found = pool.map(lambda name: _problem(path, name, recorded[name], stop), mine)
            return [problem for problem in found if problem], time.perf_counter() - start

    with ThreadPoolExecutor(1) as pool:
        checking = pool.submit(check)
        try:
            try:
                yield report
            except DCP_ERRORS as err:  # the check decides which error to raise
                failure = err
            problems, seconds = checking.result()
        except BaseException:  # an interrupt, an exit: leave at once
            stop.set()
            raise
    try:
        if group is not None:
            everyone: list[Optional[list[str]]] = [None] * world
            dist.all_gather_object(everyone, problems, group=group)
            problems = sorted(problem for share in everyone for problem in share)
    except Exception:
        if failure is None:
            raise
        raise failure  # the group broke: the block's own error says why
    if problems:
        raise _corrupt(path, problems, fix) from failure
    if failure is not None:
        raise failure
    if recorded:
        size = sum(size for size, _ in recorded.values())
        report.append(f"{len(recorded)} files ({size / 1e9:.3f} GB) match their checksums (.metadata and "
                      f"{len(mine)} data files checked by this process in {seconds:.2f} s)")


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
    try:
        own = own_model_class(read_trainer_state(path))
    except (OSError, ValueError):
        own = None
    if own:
        return f" It holds a model of your own, {own}."
    try:
        model = tomllib.loads((Path(path) / CONFIG).read_text()).get("model", {})
    except (OSError, ValueError):
        return ""
    return " It was saved with " + " ".join(f"--model.{k} {v}" for k, v in model.items()) + "."


def saved_config(path: Path) -> Config:
    """The config of the run that saved the checkpoint `path`, from its config.toml; a CheckpointError naming the
    checkpoint and a fix if that is missing or unusable. Only export needs it, so it is no part of unusable_reason:
    resume and init_from bring their own model settings, checked against these only where they can be read."""
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


def shapeless_changes(path: Path, args, names: Sequence[str] = ("n_heads", "n_kv_heads", "rope_theta", "rope_scaling",
                                                                  "norm_eps", "tie_embeddings")) -> tuple[str, str, str]:
    """Of the model settings `names`, those that differ between the model saved in `path` (its config.toml, where it
    can be read) and `args`, as ("model.x A, ...", "model.x B, ...", "--model.x A ..."): saved, here, and the flags
    that restore the saved ones; empty strings if none differs. No tensor's shape shows them: the same projections
    cut into other heads, another RoPE or norm eps, or a tied model's one tensor under both names would load without
    a word. (max_seq_len is no such setting: it only lengthens the RoPE table.)"""
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


# ------------------------------------------------------------------------------------------------ RNG state

def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's RNG states as tensors (DCP stores tensors per rank). Each has a fixed size, since async_pinned
    copies them into host buffers sized at the first save: Python's is its version and 625 words as int64, and
    the cached second Gaussian as float64 (NaN for none)."""
    version, internal, gauss = random.getstate()
    state = {"python": torch.tensor([version, *internal], dtype=torch.int64),
             "python_gauss": torch.tensor([math.nan if gauss is None else gauss], dtype=torch.float64),
             "cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Restore what rng_state() returned (a CUDA state only when both sides have one)."""
    if state["python"].dtype == torch.uint8:  # saved by an older fsdp_trainer: JSON text
        version, internal, gauss = json.loads(state["python"].numpy().tobytes().decode())
    else:
        (version, *internal), gauss = state["python"].tolist(), state["python_gauss"].item()
        gauss = None if math.isnan(gauss) else gauss
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _rng_placeholders(metadata: Metadata, key: str, device: torch.device) -> dict[str, torch.Tensor]:
    """Empty tensors for the RNG states saved under rng.<key>, shaped and typed as saved."""
    prefix, entries = f"rng.{key}.", metadata.state_dict_metadata
    names = [k.removeprefix(prefix) for k in entries if k.startswith(prefix)]
    return {n: torch.empty(entries[prefix + n].size, dtype=entries[prefix + n].properties.dtype) for n in names
            if n != "cuda" or device.type == "cuda"}


# ----------------------------------------------------------------------------------------- preemption and votes

class StopSignals:
    """SIGTERM / SIGUSR1: the first asks for a checkpoint and a clean exit; a second exits at once (code 128+sig)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.received: Optional[str] = None
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        """Handle the stop signals from now on (Python only lets the main thread do so)."""
        if threading.current_thread() is not threading.main_thread():
            logger.warning("not running in the main thread: SIGTERM/SIGUSR1 will kill training without a checkpoint")
            return
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        """Put back the handlers that were there before install()."""
        for sig, handler in self._previous.items():
            # None: the old handler was not set from Python; the default is the closest we can restore.
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            # os._exit: no cleanup that could wait on a collective or on the save in flight.
            os.write(2, f"[rank{self.rank}] second stop signal ({name}): exiting now without a checkpoint\n".encode())
            os._exit(128 + signum)
        self.received = name
        logger.warning(f"{name}: finishing the step, then saving a checkpoint and exiting "
                       "(send it again to exit at once)")


class Votes:
    """The ranks' agreement on stopping and on time-based saves, without a GPU sync or a wait in the loop.

    A max-all-reduce of two flags on a gloo group is started after each step and read after the next one, by
    which time it has long finished; every rank reads the same result at the same step, so all act alike."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self._flags: Optional[torch.Tensor] = None
        self._work = None

    def start(self, stop: bool, save: bool) -> None:
        """Cast this rank's votes for the decision read at the next step."""
        self._flags = torch.tensor([int(stop), int(save)], dtype=torch.int32)
        self._work = dist.all_reduce(self._flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def result(self) -> tuple[bool, bool]:
        """(any rank asked to stop, rank 0 found a save due) as of the previous start(); (False, False) if none."""
        if self._work is None:
            return False, False
        self._work.wait()
        self._work = None
        stop, save = self._flags.tolist()
        return bool(stop), bool(save)


# ----------------------------------------------------------------------------------------------- save and load

@dataclass
class _Save:
    step: int
    path: Path
    future: Future
    writer: CheckpointWriter
    trainer_state: dict
    started: float
    blocked: float
    finished: Optional[float] = None


class ReusedBufferStager:
    """DCP's AsyncStager for async_pinned: copies the state into host buffers allocated at the first save and
    reused by every later one, pinned on CUDA so that the device-to-host copy runs at full speed.

    Ours because DCP's own cannot do this on both torch versions we run: torch 2.11's DefaultStager drops its
    buffers after every save, and BlockingAsyncStager's reused buffers are always pinned, which needs CUDA."""

    should_synchronize_after_execute = False  # stage() returns only once the copy is done

    def __init__(self, device: torch.device):
        self.pin = device.type == "cuda"
        self._buffers: Optional[dict] = None
        self._flat: Optional[torch.Tensor] = None

    @property
    def allocated(self) -> bool:
        return self._buffers is not None

    def allocate(self, state_dict: dict) -> None:
        """Host buffers shaped like `state_dict`: views of one flat buffer, its pages touched by many threads, then
        pinned with one cudaHostRegister. torch's `.pin_memory()` per tensor (what DCP's helper does) took 74 s for
        48 GB per rank on 2 H200s: it pins through the caching host allocator, one serialized driver call per
        tensor with sizes rounded up to a power of two. The Checkpointer asks for this once, before the first save."""
        start = time.perf_counter()
        leaves, spec = tree_flatten(state_dict)
        shards = [leaf._local_tensor if isinstance(leaf, DTensor) else leaf for leaf in leaves]
        offsets, total = [], 0
        for shard in shards:
            offsets.append(total)
            if isinstance(shard, torch.Tensor):
                total += -(-shard.numel() * shard.element_size() // 64) * 64  # 64-byte aligned for every dtype
        flat = torch.empty(total, dtype=torch.uint8)
        threads = torch.get_num_threads()  # torchrun sets 1; page faults are the cost, so use this rank's cores
        torch.set_num_threads(max(threads, cores_per_rank()))
        try:
            flat.zero_()
        finally:
            torch.set_num_threads(threads)
        if self.pin and total:
            error = int(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), total, 0))
            if error:
                raise RuntimeError(f"pinning {total / 1e9:.1f} GB of checkpoint staging memory failed (cudaError "
                                   f"{error}); use --checkpoint.async_mode async, which needs no pinned memory")
        buffers = []
        for leaf, shard, offset in zip(leaves, shards, offsets):
            if not isinstance(shard, torch.Tensor):
                buffers.append(leaf)
                continue
            view = flat[offset:offset + shard.numel() * shard.element_size()].view(shard.dtype).view(shard.shape)
            # A DTensor keeps its spec (mesh, placements, global shape) around the host shard, as DCP saves it.
            buffers.append(DTensor(view, leaf._spec, requires_grad=False) if isinstance(leaf, DTensor) else view)
        self._flat, self._buffers = flat, tree_unflatten(buffers, spec)
        logger.info(f"checkpoint staging: {total / 1e9:.1f} GB of {'pinned ' if self.pin else ''}host memory "
                    f"per rank allocated in {time.perf_counter() - start:.1f} s")

    def stage(self, state_dict: dict) -> dict:
        """The state copied into the reused host buffers (the next optimizer step may change it at once)."""
        if self._buffers is None:
            self.allocate(state_dict)
        staged = _copy_state_dict(state_dict, self._buffers, non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize()
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: stage() is synchronous."""

    def close(self) -> None:
        """Unpin and release the buffers (no save is in flight when the Checkpointer closes its stager)."""
        if self.pin and self._flat is not None and self._flat.numel():
            torch.cuda.cudart().cudaHostUnregister(self._flat.data_ptr())
        self._flat = self._buffers = None


def _data_changes(a: dict, b: dict, a_when: str, b_when: str) -> str:
    """How two data identities (data.py's identity()) differ, for an error message."""
    if a.get("kind") != b.get("kind"):
        return f"{a.get('kind')} {a_when}, {b.get('kind')} {b_when}"
    return "; ".join(f"{key} {a.get(key)} {a_when}, {b.get(key)} {b_when}"
                     for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key))


class Checkpointer:
    """Save, resume and preemption for one run. Every rank makes the same calls in the same order:

        ckpt = Checkpointer(cfg, info, model, optimizer, scheduler, scaler, signals, data=dataset.identity())
        progress = ckpt.restore()              # resume, or init_from weights, or fresh
        with ckpt.training(watchdog, before_save=guard.check):
            while progress.step < steps:
                train_step(...); progress.advance(global_batch, seq_len)
                if ckpt.after_step(progress):  # saves when due; True once the ranks agreed to stop
                    break
            ckpt.finish(progress)              # the final save, waited for

    `signals` are the process's StopSignals, installed by the caller (train.main does so first thing); without
    them, no signal stops the run. `data` is the dataset's identity() (data.py): every rank must have rank 0's,
    checkpoints keep it, and resume refuses other data unless checkpoint.allow_data_change.
    """

    def __init__(self, cfg: Config, info: DistInfo, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler, scaler=None, signals: Optional[StopSignals] = None, data: Optional[dict] = None):
        self.cfg, self.info, self.data = cfg, info, data
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.root = checkpoint_root(cfg)
        self.mode = cfg.checkpoint.async_mode
        # new_group is collective: every rank creates both here, in this order. DCP's collectives run on one
        # (from a background thread while an async save is in flight), the votes on the other, so the two never
        # interleave, and neither touches the training's (NCCL) default group. The long start-up timeout, not
        # the short one of training steps: a rank may wait here for the slowest rank's write of a large model.
        # Behind it by the watchdog's backstop, as every group is: a rank waiting in the restore for one stuck in
        # its reads must not end before the watchdog names that rank.
        timeout = datetime.timedelta(seconds=cfg.dist.init_timeout_s + BACKSTOP_S)
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.votes = Votes(dist.new_group(backend="gloo", timeout=timeout))
        self.signals = signals or StopSignals(info.rank)
        # What the loop's saves call: training() sets both.
        self.before_save: Callable[[], int] = lambda: 0
        self._paused: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        self._stager = ReusedBufferStager(info.device) if self.mode == "async_pinned" else None
        self.stopped = False
        self._pending: Optional[_Save] = None
        self._deletions: list[tuple[threading.Thread, set[Path]]] = []  # retention's, with their folders
        self._saved_step = -1
        self._started_from: Optional[str] = None  # set by restore(): see _choose_resume
        self._last_save = time.monotonic()
        self._config_toml = to_toml(cfg)
        self._model_class = model_class(model)
        self._store = dist.distributed_c10d._get_default_store()
        self._marked_step: Optional[int] = None  # this rank's last WRITTEN mark

    # -- resume ------------------------------------------------------------------------------------------
    def restore(self, load_initial_weights: Callable[[], None] = lambda: None) -> Progress:
        """Resume from a checkpoint (checkpoint.resume), else load checkpoint.init_from weights, else start
        fresh; logs which. Raises CheckpointError, on every rank, for a checkpoint that cannot be used. A
        checkpoint at or past train.steps is only checked, not loaded: there is nothing left to train.
        Exits 0 on every rank if a stop signal reached any of them during start-up: nothing new is trained, so
        nothing needs saving, and the time a preemption grants is better spent exiting than compiling."""
        self._check_ranks_read_the_same_data()
        # With the marker as rank 0 read and checked it: every rank loads by that one read.
        checkpoint, self._started_from = self._agree(self._choose_resume)
        c = self.cfg.checkpoint
        if checkpoint is not None:
            if c.init_from:
                logger.info(f"checkpoint.init_from={c.init_from} ignored: resuming from {checkpoint.path}")
            progress = self._load(checkpoint)
        else:
            self._saved_step = 0  # nothing to save before the first step
            if c.init_from:
                load_initial_weights()
                logger.info(f"initialized the model from {c.init_from}; fresh optimizer, step 0")
            progress = Progress()
        self.votes.start(stop=self.signals.received is not None, save=False)
        if self.votes.result()[0]:
            logger.info(f"stopped during start-up, at step {progress.step}, on a stop signal; nothing new to save: "
                        "run the same command to resume")
            raise SystemExit(0)
        return progress

    def _check_ranks_read_the_same_data(self) -> None:
        """A CheckpointError on every rank unless every rank's data has rank 0's identity: ranks reading other
        shards or another seed (a node-local copy of data.path, the stdlib corpus of another Python) would not
        follow one sample order, and a resume could not tell which order the saved sample count is a position in."""
        identities: list[Optional[dict]] = [None] * self.info.world_size
        dist.all_gather_object(identities, self.data, group=self.group)
        odd = [rank for rank, identity in enumerate(identities) if identity != identities[0]]
        if odd:
            changes = _data_changes(identities[0], identities[odd[0]], "on rank 0", f"on rank {odd[0]}")
            others = f"; other data also on rank(s) {', '.join(map(str, odd[1:]))}" if len(odd) > 1 else ""
            raise CheckpointError(f"rank {odd[0]} reads other data than rank 0 ({changes}{others}): give every node "
                                  "the same data.path contents (for data.source=stdlib, the same Python) and the "
                                  "same data.seed")

    def _agree(self, decide: Callable[[], Any]) -> Any:
        """Run decide() on rank 0 and hand its answer, or its error, to every rank: file listings on a shared
        file system need not look the same from every node, and no rank may go on while another stops."""
        box = [None]
        if self.info.is_main:
            try:
                box[0] = ("ok", decide())
            except CheckpointError as err:
                box[0] = ("error", str(err))
        dist.broadcast_object_list(box, src=0, group=self.group)
        kind, value = box[0]
        if kind == "error":
            raise CheckpointError(value)
        return value

    def _choose_resume(self) -> tuple[Optional[Checkpoint], Optional[str]]:
        """The checkpoint to resume from (None: start fresh), and what this run's saves record as started_from: the
        --checkpoint.resume path it was launched with (absolute), kept by every resume since, auto ones included.
        So the same command, run again after a preemption, a crash or a requeue, resumes its own newest checkpoint
        instead of refusing to mix with it, even once retention deleted the checkpoint it names."""
        resume = self.cfg.checkpoint.resume
        if resume == "none":
            self._refuse_mixing(after_step=-1, flag="--checkpoint.resume none")
            return None, None
        # A CheckpointError if the newest committed checkpoint here is unusable: whoever saved it, it is in the way
        # of every resume.
        latest, skipped = find_latest(self.root)
        if resume != "auto":
            named = os.path.abspath(os.path.expanduser(resume))  # symbolic links kept: the path as named
            # Saved by a run launched with this --checkpoint.resume: then any other run's checkpoints here are
            # older, and resume auto is safe.
            if latest is None or latest.state.get("started_from") != named:
                checkpoint = resolve(resume, "--checkpoint.resume")
                # From this folder, its earlier checkpoints are this run's past; from elsewhere, any checkpoint here
                # is another run's, which resume auto could pick, or retention delete as this run's own. Where it
                # is counts, not where a link to it is.
                here = checkpoint.path.resolve().parent == self.root.resolve()
                self._refuse_mixing(after_step=checkpoint.state["step"] if here else -1,
                                    flag=f"--checkpoint.resume {checkpoint.path}")
                return checkpoint, named
            logger.warning(f"resuming the newest checkpoint of this run, not {named}: this run began from {named} "
                           f"and saved since (to begin again from {named}, save to another --checkpoint.dir)")
        for path, reason in skipped:
            logger.warning(f"skipping {path}: it {reason}")
        if latest is None:
            logger.info(f"no complete checkpoint in {self.root}: starting fresh")
            return None, None
        return latest, latest.state.get("started_from")

    def _refuse_mixing(self, after_step: int, flag: str) -> None:
        # Unusable ones count too: a save of their step would find them in the way, and must not delete them.
        newer = [p.name for step, p in committed_checkpoints(self.root) if step > after_step]
        if newer:
            raise CheckpointError(f"{flag}: {self.root} already holds checkpoints {', '.join(newer)} that this run "
                                  "would mix with its own (resume auto would later pick them, or retention delete "
                                  "them); to continue the run that saved them, use --checkpoint.resume auto; else "
                                  "save to another --checkpoint.dir, or move them away")

    def _load(self, checkpoint: Checkpoint) -> Progress:
        path, state = checkpoint
        self._check_seq_len(path, state)
        self._check_data(path, state)
        if_corrupt = ways_past(path)  # once: it reads other checkpoints' markers
        metadata = read_metadata(checkpoint, if_corrupt, self.cfg.checkpoint.checksums)
        model_sd, optim_sd = self._state_dicts()
        fix = ("Resume with the model settings it was saved with, or start a new run with --checkpoint.resume none "
               "and another --checkpoint.dir.")
        weights_only = state.get(WEIGHTS_ONLY, False)
        check_shapes(path, metadata, tensor_shapes({"model": model_sd} if weights_only else
                                                   {"model": model_sd, "optim": optim_sd}), "model.", fix)
        self._check_model_settings(path, fix)
        # Checkpoints saved before skipped steps were counted in them have no count: none is the best guess.
        progress = Progress(state["step"], state["consumed_samples"], state["tokens_seen"],
                            state.get("skipped_steps", 0))
        self._saved_step = progress.step
        if progress.step >= self.cfg.train.steps:
            # The run is over: reading every tensor of a large model only to stop would take minutes.
            logger.info(f"{path} holds step {progress.step}")
            return progress
        start, c = time.perf_counter(), self.cfg.checkpoint
        if weights_only:  # an imported model (tools.convert): training starts from its weights, with a fresh optimizer
            with checked(checkpoint, self.group, if_corrupt, c.write_threads, enabled=c.checksums):
                load_dcp({"model": model_sd}, path, self.group, if_corrupt)
            set_model_state_dict(self.model, model_sd)
            logger.info(f"initialized the model from {path} (weights only): fresh optimizer, step 0")
            return progress
        with checked(checkpoint, self.group, if_corrupt, c.write_threads, enabled=c.checksums) as report:
            rng = self._read(path, metadata, model_sd, optim_sd, state["world_size"], if_corrupt)
        if c.checksums:
            logger.info(f"checked {path}: {report[0] if report else NO_CHECKSUMS}")
        # The checkpoint brings the optimizer's state; its settings (weight decay, betas, eps, fused) are this
        # run's, which loading the saved param groups would replace. The learning rate is the scheduler's.
        settings = [{k: v for k, v in group.items() if k not in ("params", "lr")}
                    for group in self.optimizer.param_groups]
        set_state_dict(self.model, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        for group, own in zip(self.optimizer.param_groups, settings):
            group.update(own)
        seconds, size = time.perf_counter() - start, _size_bytes(path)
        logger.info(f"loaded {path}: {size / 1e9:.3f} GB in {seconds:.2f} s ({size / 1e9 / max(seconds, 1e-9):.2f} GB/s)")
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("grad_scaler"):
            self.scaler.load_state_dict(state["grad_scaler"])
        set_rng_state(rng, self.info.device)
        self._log_resume(path, state, progress)
        return progress

    def _read(self, path: Path, metadata: Metadata, model_sd: dict, optim_sd: dict, saved_world_size: int,
              fix: str) -> dict[str, torch.Tensor]:
        """Fill the state dicts in place from `path`, resharded by DCP; returns this rank's RNG state: its own
        on the same world size, else saved rank 0's (there is no rank-to-rank correspondence then). A
        CheckpointError ending in `fix` if a file cannot be read."""
        key = f"rank{self.info.rank}" if saved_world_size == self.info.world_size else "rank0"
        target = {"model": model_sd, "optim": optim_sd,
                  "rng": {key: _rng_placeholders(metadata, key, self.info.device)}}
        load_dcp(target, path, self.group, fix)
        return target["rng"][key]

    def _check_model_settings(self, path: Path, fix: str) -> None:
        """A CheckpointError if a model setting that no tensor shape shows differs from the saved one: the resumed
        run would go on training another function than the one saved. None for a model of one's own: config.toml's
        settings are of a preset that was not trained."""
        if self._model_class is not Transformer:
            return
        then, now, flags = shapeless_changes(path, model_args_from_config(self.cfg.model))
        if then:
            raise CheckpointError(f"checkpoint {path} was saved with {then}, but this run has {now}: set {flags}. "
                                  f"{fix}")

    def _check_seq_len(self, path: Path, state: dict) -> None:
        """A CheckpointError if train.seq_len changed: sample g is a window of seq_len tokens (data.py), so the
        saved sample count would point at other windows, skipping or repeating data."""
        saved, here = state.get("seq_len"), self.cfg.train.seq_len
        if saved is not None and saved != here:  # checkpoints of older versions lack it: nothing to compare
            raise CheckpointError(
                f"checkpoint {path} was saved with train.seq_len={saved} but this run has {here}: its "
                f"{state['consumed_samples']:,} consumed samples count windows of {saved} tokens, so other "
                f"lengths would skip or repeat data. Resume with --train.seq_len {saved}, or start a new run "
                f"from its weights: --checkpoint.init_from {path} --train.output_dir <new folder>")

    def _check_data(self, path: Path, state: dict) -> None:
        """A CheckpointError if the data changed (unless checkpoint.allow_data_change): the saved sample count is a
        position in the saved data's sample order, and in another order it would skip or repeat samples."""
        saved, here = state.get("data"), self.data
        if saved is None or here is None or saved == here:  # older checkpoints lack it: nothing to compare
            return
        changes = _data_changes(saved, here, "then", "now")
        if self.cfg.checkpoint.allow_data_change:
            logger.warning(f"resuming {path} on other data ({changes}): sample {state['consumed_samples']:,} of "
                           "the new data's order comes next")
            return
        if {key for key in set(saved) | set(here) if saved.get(key) != here.get(key)} == {"order"}:
            raise CheckpointError(
                f"checkpoint {path} was saved reading the same data in another sample order ({changes}: another "
                f"version of fsdp_trainer's shuffle): its {state['consumed_samples']:,} consumed samples are a "
                "position in that order. Pass --checkpoint.allow_data_change to go on in this order from that "
                "position (until the epoch ends, some samples may repeat and others be skipped)")
        raise CheckpointError(
            f"checkpoint {path} was saved reading other data ({changes}): its {state['consumed_samples']:,} "
            "consumed samples are a position in that data's sample order. Resume with the data.source, data.path "
            "and data.seed it was saved with, or pass --checkpoint.allow_data_change to go on with the new data "
            "from that position")

    def _log_resume(self, path: Path, state: dict, progress: Progress) -> None:
        logger.info(f"resuming from {path}: step {progress.step}, {progress.consumed_samples:,} samples and "
                    f"{progress.tokens_seen:,} tokens seen (saved on {_ranks(state['world_size'])}, "
                    f"mesh {state['mesh']})")
        if state["world_size"] != self.info.world_size:
            logger.info(f"saved on {_ranks(state['world_size'])}, resuming on {_ranks(self.info.world_size)}: DCP "
                        "reshards model and optimizer; every rank restores the RNG state of saved rank 0")
        batch = self._global_batch()
        if state["global_batch"] != batch:
            logger.info(f"global batch changed from {state['global_batch']} to {batch} samples: step "
                        f"{progress.step + 1} starts at sample {progress.consumed_samples:,}")

    def _global_batch(self) -> int:
        t = self.cfg.train
        return samples_per_step(t.micro_batch_size, t.grad_accum_steps, self.info.world_size)

    # -- during training ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def training(self, paused: Callable[[], Any] = contextlib.nullcontext, before_save: Callable[[], int] = lambda: 0):
        """Around the training loop. Each save calls before_save first, the trainer's non-finite check: it raises
        to veto the save, and returns the run's count of skipped steps, which the checkpoint keeps. The watchdog
        is paused while a save blocks training, and only then: a rank that waits for the stop/save vote is
        watched, so that a peer's hang is reported by it too. If training fails inside, a save begun before the
        failure still counts once it completes."""
        self.before_save = before_save
        self._paused = paused
        try:
            yield
        except BaseException:
            self._salvage()
            raise
        finally:
            if self._stager is not None and self._pending is None:
                self._stager.close()

    def _salvage(self) -> None:
        if self._pending is None:
            return
        step = self._pending.step
        try:
            with self._paused():
                self._wait()
        except BaseException as err:  # the failure that brought us here may have taken the save down too
            logger.warning(f"the save of step {step} did not complete: {err}")

    def after_step(self, progress: Progress) -> bool:
        """Call after every step on every rank: saves when checkpoint.interval or interval_minutes say so, and
        returns True once the ranks agreed to stop (a stop signal reached one of them a step earlier)."""
        self._poll()
        if self._stager is not None and not self._stager.allocated and self._saves_planned():
            # From the first step on, AdamW's state exists and the state's shapes are final. Pinning its host
            # copy now keeps that cost out of the first save, which may be a preemption's, with a grace period.
            with self._paused():
                self._stager.allocate(self._state())
        stop, save_due = self.votes.result()
        if stop:
            self.stopped = True
            return True
        c = self.cfg.checkpoint
        if save_due or (c.interval and progress.step % c.interval == 0):
            self.save(progress)
        time_due = (self.info.is_main and c.interval_minutes > 0
                    and time.monotonic() - self._last_save >= 60 * c.interval_minutes)
        self.votes.start(stop=self.signals.received is not None, save=time_due)
        return False

    def finish(self, progress: Progress) -> None:
        """The run's last save (unless this step is saved already, or checkpoint.save_final is off and no stop
        was asked for), and the wait until every save is complete."""
        self.votes.result()  # collect the vote in flight: no collective may be left open at shutdown
        with self._paused():
            if progress.step != self._saved_step and (self.stopped or self.cfg.checkpoint.save_final):
                self.save(progress)
            self._wait()
            dist.barrier(group=self.group)  # no rank exits before rank 0 has committed
            if not self.stopped:  # a stopped run spends its grace period exiting: deletions are safe to cut short
                self._join_deletions()
        if self.stopped:
            logger.info(f"stopped at step {progress.step} on a stop signal; the checkpoint is complete: run the "
                        "same command to resume")

    def save(self, progress: Progress) -> None:
        """Save a checkpoint of this step: sync, or async (training waits only while the state is copied to host
        memory). Rank 0 commits it once complete, at a later step's after_step or at finish()."""
        with self._paused():
            progress.skipped_steps = self.before_save()
            start = time.perf_counter()
            waited = self._wait()  # one save at a time: its staging buffers get reused, and commits stay in order
            begun = time.perf_counter()
            path = step_dir(self.root, progress.step)
            self._make_room(path)
            writer = CheckpointWriter(str(path), self.cfg.checkpoint.write_threads, self.cfg.checkpoint.checksums,
                                      on_written=lambda step=progress.step: self._mark_written(step))
            future = self._write(writer)
            save = _Save(progress.step, path, future, writer, self._trainer_state(progress), begun,
                         time.perf_counter() - start)
            future.add_done_callback(lambda _: setattr(save, "finished", time.perf_counter()))
            self._pending, self._saved_step, self._last_save = save, progress.step, time.monotonic()
            if self.mode == "none":
                self._wait()  # commits it, or raises its error before it could be logged as taken
            wait_note = f" (of which {waited:.2f} s waiting for the previous save)" if waited > 0.01 else ""
            logger.info(f"checkpoint step {progress.step} ({self.mode}): training blocked {save.blocked:.2f} s"
                        f"{wait_note}")

    def _saves_planned(self) -> bool:
        """Whether this run saves other than on a stop signal."""
        c = self.cfg.checkpoint
        return bool(c.interval or c.interval_minutes or c.save_final)

    def _state(self) -> dict:
        """What each rank saves: its model and optimizer shards, and its RNG state."""
        model_sd, optim_sd = self._state_dicts()
        return {"model": model_sd, "optim": optim_sd, "rng": {f"rank{self.info.rank}": rng_state(self.info.device)}}

    def _state_dicts(self) -> tuple[dict, dict]:
        """get_state_dict's model and optimizer state dicts, without its side effect on an optimizer that has not
        stepped yet (before the first step, or after only skipped ones): torch creates the state by an AdamW step
        with zero gradients at lr 0, which moves no weight but counts a step, and Adam's bias correction would then
        run a step ahead for the rest of the run, so that the weights depended on when checkpoints were taken. The
        count goes back to 0, which leaves the state a fresh AdamW's first step creates."""
        unstepped = not self.optimizer.state
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        if unstepped:
            for state in self.optimizer.state.values():
                state["step"].zero_()  # in place: optim_sd holds these same tensors, not copies
        return model_sd, optim_sd

    def _write(self, writer: CheckpointWriter) -> Future:
        """Hand this rank's shards to DCP; the returned future completes once every rank's are on storage."""
        state = self._state()
        if self.mode != "none":
            response = dcp.async_save(state, storage_writer=writer, process_group=self.group,
                                      async_stager=self._stager)
            # torch returns an AsyncSaveResponse only for a stager that stages in the background (ours do not).
            return getattr(response, "upload_completion", response)
        done: Future = Future()
        try:
            dcp.save(state, storage_writer=writer, process_group=self.group)
        except DCP_ERRORS as err:  # _commit raises it, as it does an async save's
            done.set_exception(err)
        else:
            done.set_result(None)
        return done

    def _make_room(self, path: Path) -> None:
        """Clear what an interrupted save of this step left behind; never a complete checkpoint."""
        if self.info.is_main:
            if path.exists():
                reason = incomplete_reason(path)
                if reason is None:  # usable or not, a committed checkpoint is never deleted to make room
                    raise CheckpointError(f"{path} is a committed checkpoint already; is another run saving into "
                                          f"{self.root}? Move it away, or save to another --checkpoint.dir")
                logger.info(f"clearing {path} before saving there: it {reason}")
                _remove(path)
            path.mkdir(parents=True)
            # The folder's name on disk before its marker: retention deletes older checkpoints once it is committed,
            # and a file system that does not order metadata could keep those deletions through a power loss and
            # lose this folder.
            fsync_folder(self.root)
            # Atomic, and on disk before DCP's shards and so before the marker: a crash never commits a checkpoint
            # with an empty or partial config.toml.
            write_atomic(path / CONFIG, lambda f: f.write(self._config_toml.encode()))
        dist.barrier(group=self.group)  # nobody writes into the folder while rank 0 may still be clearing it

    def _trainer_state(self, progress: Progress) -> dict:
        return {"format": FORMAT, "step": progress.step, "consumed_samples": progress.consumed_samples,
                "tokens_seen": progress.tokens_seen, "skipped_steps": progress.skipped_steps,
                "world_size": self.info.world_size,
                "mesh": dict(zip(("dp_replicate", "dp_shard"), mesh_shape(self.cfg.parallel, self.info.world_size))),
                "global_batch": self._global_batch(), "seq_len": self.cfg.train.seq_len, "data": self.data,
                "started_from": self._started_from, "scheduler": self.scheduler.state_dict(),
                MODEL_CLASS: f"{self._model_class.__module__}.{self._model_class.__qualname__}",
                "grad_scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__}

    def _poll(self) -> None:
        if self._pending is not None and self._pending.future.done():
            with self._paused():
                self._commit()

    def _wait(self) -> float:
        """Wait for the save in flight, if any, and commit it; returns the seconds waited."""
        if self._pending is None:
            return 0.0
        start = time.perf_counter()
        self._pending.future.exception()  # waits; _commit raises what it holds
        waited = time.perf_counter() - start
        self._commit()
        return waited

    def _commit(self) -> None:
        """Rank 0 marks a finished save complete (DCP's .metadata exists, so every rank wrote its part) and
        applies retention. Done from the training thread, where an error stops training loudly."""
        save, self._pending = self._pending, None
        try:
            save.future.result()
        except DCP_ERRORS as err:  # not a CheckpointError: it is this rank's, and deserves its traceback
            raise RuntimeError(f"saving checkpoint {save.path} failed: {self._save_failure(save.step, err)}") from err
        if not self.info.is_main:
            return
        sums = save.writer.sums if save.writer.checksums else None
        if sums == {}:  # torch wrote through a copy of the writer: the checkpoint is whole, but resume cannot check it
            logger.warning(f"checkpoint {save.path}: no checksums reached rank 0; it is committed without them")
        write_marker(save.path, save.trainer_state, sums)
        size, seconds = _size_bytes(save.path), (save.finished or time.perf_counter()) - save.started
        logger.info(f"checkpoint {save.path} complete: {size / 1e9:.3f} GB in {seconds:.2f} s "
                    f"({size / 1e9 / max(seconds, 1e-9):.2f} GB/s; training blocked {save.blocked:.2f} s)")
        self._retain()

    def _mark_written(self, step: int) -> None:
        """Say that this rank's part of `step`'s save is on storage (WRITTEN), from the writer's thread, and withdraw
        the mark of its save before: the store keeps at most two per rank however long the run."""
        try:
            self._store.set(WRITTEN.format(step=step, rank=self.info.rank), "1")
            if self._marked_step is not None:
                self._store.delete_key(WRITTEN.format(step=self._marked_step, rank=self.info.rank))
            self._marked_step = step
        except Exception as err:  # noqa: BLE001 - the store lives on the rendezvous host; the save does not need it
            logger.warning(f"rank {self.info.rank}: the c10d store cannot be reached ({err}); should the save of step "
                           f"{step} fail, this rank may be named among those that did not write their part")

    def _save_failure(self, step: int, err: BaseException) -> str:
        """A failed save's cause. Where its exchange lost a peer, the ranks that had not written their part by then,
        for DCP's timeout names none: the ranks it waited for are the ones to check."""
        cause = dcp_cause(err)
        if self.info.world_size == 1 or not _lost_a_peer(err):
            return cause
        try:
            unwritten = [rank for rank in range(self.info.world_size)
                         if not self._store.check([WRITTEN.format(step=step, rank=rank)])]
        except Exception:  # noqa: BLE001 - the store may have gone with the peer: the cause alone, then
            return cause
        if not unwritten:
            return f"{cause}; every rank had written its part: a rank stopped answering in the save's last exchange"
        return (f"rank(s) {spans(unwritten)} had not written their part of it when this rank stopped waiting for "
                f"them, dist.init_timeout_s + {BACKSTOP_S} s into the save's exchange ({cause}): their storage, or "
                "the ranks themselves, hang; check those hosts. Older checkpoints are untouched")

    def _retain(self) -> None:
        """Delete complete checkpoints beyond checkpoint.keep, and incomplete ones older than the newest complete
        one, in the background: removing a large model's files takes seconds that training need not wait for.
        Called once a save is committed, when no other is in flight. Never waits for earlier deletions: only rank 0
        gets here, and the other ranks' watchdogs would take a rank 0 that waits for slow storage for a hung one."""
        self._deletions = [(thread, paths) for thread, paths in self._deletions if thread.is_alive()]
        # Folders still being deleted have lost their markers: they would be listed below as incomplete.
        deleting = set().union(*(paths for _, paths in self._deletions))
        # Unusable committed checkpoints are neither: they stay, counted against no limit, until their owner acts.
        found = [(step, path, incomplete_reason(path) is not None) for step, path in list_checkpoints(self.root)
                 if path not in deleting]
        complete = [(step, path) for step, path, incomplete in found
                    if not incomplete and unusable_reason(path) is None]
        keep = self.cfg.checkpoint.keep
        old = [(path, f"checkpoint.keep={keep}") for _, path in complete[:-keep]]
        for path, _ in old:
            # The marker goes first, at once: resume never picks these again, and a crash while deleting leaves
            # incomplete folders, never damaged complete ones. Not through a link: that marker is another folder's.
            if not path.is_symlink():
                (path / MARKER).unlink()
        # What a crash left: a save cut short, or a deletion above. A newer incomplete folder is left to the save of
        # its step, which clears it first.
        old += [(path, "incomplete, older than the newest complete checkpoint") for step, path, incomplete in found
                if incomplete and step < complete[-1][0]]
        if old:
            # A daemon: the exit of a stopped run does not wait for it (finish() waits for it otherwise).
            thread = threading.Thread(target=_delete, args=(old,), name="checkpoint-retention", daemon=True)
            thread.start()
            self._deletions.append((thread, {path for path, _ in old}))

    def _join_deletions(self) -> None:
        for thread, _ in self._deletions:
            thread.join()
        self._deletions = []


def _remove(path: Path) -> None:
    """Delete a checkpoint folder; of a link to one (a step_* link to another run's checkpoint, say), only the link:
    what it points to is another folder's, and may be the only copy of another run's checkpoint."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path)


def _delete(paths: list[tuple[Path, str]]) -> None:
    for path, why in paths:
        try:
            _remove(path)
        except OSError as err:  # what is left has no marker: the next retention deletes it as incomplete
            logger.warning(f"could not delete {path} ({why}): {err}")
        else:
            logger.info(f"deleted {path} ({why})")


# ----------------------------------------------------------------------------------------------------- CLI
