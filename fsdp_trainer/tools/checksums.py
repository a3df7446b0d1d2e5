"""Checksums of checkpoint files. DCP keeps none, so a shard changed on storage after its save (a flipped bit, a copy
cut short) would load without a word. Each rank sums its files (size and CRC32) as its writer threads write them;
the sums travel to rank 0 with DCP's own write results, and the marker (trainer_state.json) records them with a
CRC32 of its own other contents. Resume, init_from, export and `verify` check them while they read the files.

train.main passes Checksums(threads) to the Checkpointer as its Storage, unless --checkpoint.no_checksums.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem

from fsdp_trainer.checkpoint import (DCP_ERRORS, MARKER, Checkpoint, CheckpointError, CheckpointWriter, Storage,
                                     set_aside)
from fsdp_trainer.distributed import logger

CHECKSUMS = "checksums"  # the marker's {file name: [size, CRC32]} of the .distcp files and .metadata
# The marker's CRC32 of its other keys: a digit changed in consumed_samples would resume at another sample.
MARKER_SUM = "marker_crc32"
NO_CHECKSUMS = "it has no checksums (saved with --checkpoint.no_checksums)"


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


class _SummingFileSystem(FileSystem):
    """DCP's local file system, keeping the size and CRC32 of each file written through it, by its name."""

    def __init__(self):
        super().__init__()
        self.sums: dict[str, list[int]] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):  # a writer's file system: it only writes
        with super().create_stream(path, mode) as stream:
            summing = _SummingStream(stream)
            yield summing
        self.sums[Path(path).name] = [summing.size, summing.crc]  # one writer thread per file: no race


class SummingWriter(CheckpointWriter):
    """The checkpoint writer, summing every file it writes; on rank 0, `sums` holds every rank's once DCP finished."""

    def __init__(self, path: str, thread_count: int):
        super().__init__(path, thread_count=thread_count)
        self.fs, self.sums = _SummingFileSystem(), {}

    def write_data(self, plan, planner) -> torch.futures.Future:
        results = super().write_data(plan, planner).wait()
        carrying: torch.futures.Future = torch.futures.Future()
        carrying.set_result([replace(r, storage_data=(r.storage_data, self.fs.sums[r.storage_data.relative_path]))
                             for r in results])
        return carrying

    def finish(self, metadata, results) -> None:
        plain = []  # .metadata holds DCP's own records only: any DCP reader can read the checkpoint
        for rank_results in results:
            self.sums.update((info.relative_path, sums) for info, sums in (r.storage_data for r in rank_results))
            plain.append([replace(r, storage_data=r.storage_data[0]) for r in rank_results])
        data_files = set(self.fs.sums)
        super().finish(metadata, plain)
        # The one file finish() wrote: .metadata, under another name that it then renamed. config.toml is not summed:
        # resume does not read it, and export checks it on its own, where a replacement is welcome.
        (index,) = set(self.fs.sums) - data_files
        self.sums[".metadata"] = self.fs.sums[index]


def marker_sum(state: dict) -> int:
    return zlib.crc32(json.dumps({k: v for k, v in state.items() if k != MARKER_SUM}, sort_keys=True).encode())


def marker_problem(state: dict) -> Optional[str]:
    """Why a marker differs from what its save wrote, to follow "it", or None."""
    if MARKER_SUM in state and state[MARKER_SUM] != marker_sum(state):
        return (f"has a {MARKER} that differs from what the save wrote (its {MARKER_SUM} does not match: damaged "
                f"since, or edited; if edited on purpose, delete its \"{MARKER_SUM}\" line)")
    return None


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
    """Check a committed checkpoint against the sums its save recorded: its marker and .metadata first, before the
    block parses them, then the data files while the block reads the checkpoint (the page cache then serves one of
    the two reads of each file). Each rank of `group` (None: this process alone) checks its share, `threads` files
    at a time. After the block, every rank raises a CheckpointError naming the damaged files and `fix` (in place of
    the block's own error, which such files cause), or the list yielded holds what was checked, to log. It stays
    empty for a checkpoint saved without checksums, and when not `enabled` (then nothing is checked)."""
    path, state = checkpoint
    recorded = state.get(CHECKSUMS) or {}
    if not enabled:
        yield []
        return
    if problem := marker_problem(state):
        raise CheckpointError(f"checkpoint {path} cannot be used: it {problem}. Nothing was deleted; {set_aside(path)}")
    if ".metadata" in recorded and (problem := _problem(path, ".metadata", recorded[".metadata"], threading.Event())):
        raise _corrupt(path, [problem], fix)  # a changed size in it still unpickles, as another model's shape
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
            except CheckpointError as err:
                if err.__cause__ is None:  # the block's own check, alike on every rank: no file is in question
                    raise
                failure = err
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


class Checksums(Storage):
    """The Checkpointer's Storage with checksums: `threads` files checked at a time per rank."""

    def __init__(self, threads: int):
        self.threads = threads

    def writer(self, path: Path, thread_count: int) -> SummingWriter:
        return SummingWriter(str(path), thread_count)

    def commit(self, state: dict, writer: SummingWriter) -> dict:
        if not writer.sums:  # torch wrote through a copy of the writer: the checkpoint is whole, but uncheckable
            logger.warning(f"checkpoint {writer.path}: no checksums reached rank 0; it is committed without them")
        state = {**state, CHECKSUMS: dict(sorted(writer.sums.items())) or None}
        return {**state, MARKER_SUM: marker_sum(state)}

    @contextlib.contextmanager
    def reading(self, checkpoint: Checkpoint, group: Optional[dist.ProcessGroup], fix: str):
        with checked(checkpoint, group, fix, self.threads) as report:
            yield
        logger.info(f"checked {checkpoint.path}: {report[0] if report else NO_CHECKSUMS}")
