"""Checkpoints: sharded DCP saves, async, atomic commit, retention, resume on any world size, preemption. It knows
no model class: it saves state dicts, each rank's RNG states and the trainer's Progress. Resume: run the same command
again. Preempt: SIGTERM or SIGUSR1 to any rank (not torchrun: see relay_signals.sh).

<checkpoint.dir>/step_00000200/ holds config.toml, DCP's shards and .metadata, and, written last by rank 0 once every
rank's files are on disk, trainer_state.json: it commits the checkpoint. A folder without it is an interrupted save.
"""

from __future__ import annotations

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
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule

from fsdp_trainer.config import Config, checkpoint_root, mesh_shape, model_flag, to_toml
from fsdp_trainer.data import fsync_folder, samples_per_step, write_atomic
from fsdp_trainer.distributed import BACKSTOP_S, DistInfo, logger

MARKER, CONFIG, FORMAT, MODEL_CLASS = "trainer_state.json", "config.toml", 1, "model_class"
WEIGHTS_ONLY = "weights_only"  # the marker's flag of a model imported by tools.convert: no optimizer state yet
DCP_ERRORS = (Exception, CheckpointException)  # DCP's derives from BaseException: `except Exception` misses it
STEP_DIR = re.compile(r"^step_(\d+)$")


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
        self.step, self.consumed_samples = self.step + 1, self.consumed_samples + samples
        self.tokens_seen += samples * seq_len


class Checkpoint(NamedTuple):  # a committed checkpoint found usable, with its trainer state as then read
    path: Path
    state: dict


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def model_class(model: nn.Module) -> type:
    """The model's own class, not the subclass fully_shard swaps in (FSDPGPT2 for GPT2)."""
    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Every step_* folder under root, oldest first, complete or not; no link: retention would delete another run's."""
    if not Path(root).is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in Path(root).iterdir()
                  if (m := STEP_DIR.match(p.name)) and p.is_dir() and not p.is_symlink())


def incomplete_reason(path: Path) -> Optional[str]:
    """Why `path` is no committed checkpoint, to follow "it", or None once its marker commits it."""
    if not Path(path).is_dir():
        return "does not exist" if not Path(path).exists() else "is not a folder"
    if (Path(path) / MARKER).exists():
        return None
    if not (Path(path) / ".metadata").is_file():
        return "has no .metadata: not every rank had finished writing when the save was interrupted"
    return f"has no {MARKER}: the save was interrupted before rank 0 committed it"


def read_marker(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """(the trainer state, None) of the committed checkpoint `path`, or (None, why it cannot be used)."""
    try:
        state = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError) as err:
        return None, f"has an unreadable {MARKER} ({type(err).__name__}: {err})"
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        return None, f"has a {MARKER} that is not format {FORMAT} (written by another version of fsdp_trainer?)"
    return state, None


def write_marker(path: Path, state: dict) -> None:
    """Commit the checkpoint at `path`: its marker, written atomically and last."""
    write_atomic(path / MARKER, lambda f: f.write((json.dumps(state, indent=1) + "\n").encode()))


def set_aside(path: Path) -> str:
    return f"rename it (mv {path} {path}.unusable) to resume from the complete checkpoint before it"


def check_usable(path: Path) -> Checkpoint:
    state, problem = read_marker(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint {path} cannot be used: it {problem}. Nothing was deleted; {set_aside(path)}")
    return Checkpoint(Path(path), state)


def find_latest(root: Path) -> Optional[Checkpoint]:
    """The newest committed checkpoint under root, or None; it logs the newer incomplete ones it skips."""
    for _, path in reversed(list_checkpoints(root)):
        if (reason := incomplete_reason(path)) is None:
            return check_usable(path)
        logger.warning(f"skipping {path}: it {reason}")
    return None


def size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


def dcp_cause(err: BaseException) -> str:
    """DCP's error in one line: the first failing rank's exception (DCP's own message is a traceback per rank)."""
    if not (failures := getattr(err, "failures", None)):
        return f"{type(err).__name__}: {err}"
    rank, (exc, _) = min(failures.items())
    return f"rank {rank}: {type(exc).__name__}" + (f": {message}" if (message := str(exc).strip()) else "")


def load_dcp(state: dict, path: Path, group: Optional[dist.ProcessGroup], fix: str) -> None:
    """Fill `state` in place from `path`, resharded by DCP, on every rank of `group` (None: in this process alone)."""
    try:
        dcp.load(state, checkpoint_id=str(path), process_group=group, no_dist=group is None)
    except DCP_ERRORS as err:  # DCP gathers every rank's errors and raises them on all ranks
        raise CheckpointError(f"checkpoint {path} could not be read ({dcp_cause(err)}); {fix}") from err


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's RNG states as tensors, which DCP saves per rank (Python's cached Gaussian: NaN for none)."""
    version, internal, gauss = random.getstate()
    state = {"python": torch.tensor([version, *internal], dtype=torch.int64),
             "python_gauss": torch.tensor([math.nan if gauss is None else gauss], dtype=torch.float64),
             "cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    (version, *internal), gauss = state["python"].tolist(), state["python_gauss"].item()
    random.setstate((version, tuple(internal), None if math.isnan(gauss) else gauss))
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


class StopSignals:
    """SIGTERM / SIGUSR1: the first asks for a checkpoint and a clean exit; a second exits at once (code 128+sig)."""

    def __init__(self, rank: int):
        self.rank, self.received, self._previous = rank, None, {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():  # None: not set from Python; the default is the closest
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:  # os._exit: no cleanup that could wait on a collective or a save
            os.write(2, f"[rank{self.rank}] second stop signal ({name}): exiting now without a checkpoint\n".encode())
            os._exit(128 + signum)
        self.received = name
        logger.warning(f"{name}: finishing the step, then saving a checkpoint and exiting (again: exit at once)")


class CheckpointWriter(dcp.FileSystemWriter):
    """DCP's file writer (it fsyncs: no marker on disk before its shards), failing a save in which a writer thread
    failed: torch raises only its own thread's error, and would commit the checkpoint without the others' tensors."""

    def write_data(self, plan, planner) -> torch.futures.Future:
        written = super().write_data(plan, planner)
        if missing := len(plan.items) - len(written.wait()):
            raise RuntimeError(f"{missing} of this rank's {len(plan.items)} tensors were not written: a writer "
                               "thread failed (its error is printed above)")
        return written


class Storage:
    """How checkpoint files are written and read: DCP's file system as it is. train.main may pass a subclass
    (tools/checksums.py records each file's CRC32 in the marker and checks them while a checkpoint loads)."""

    def writer(self, path: Path, thread_count: int) -> CheckpointWriter:
        return CheckpointWriter(str(path), thread_count=thread_count)

    def commit(self, state: dict, writer: CheckpointWriter) -> dict:  # rank 0's marker, once every rank wrote
        return state

    def reading(self, checkpoint: Checkpoint, group: Optional[dist.ProcessGroup], fix: str):  # around a load
        return contextlib.nullcontext()


@dataclass
class _Save:
    path: Path
    future: Future
    writer: CheckpointWriter
    trainer_state: dict
    started: float
    finished: Optional[float] = None


class Checkpointer:
    """Save, resume and preemption for one run, as torchtitan's CheckpointManager. Every rank calls restore(), then in
    training() after_step() after each step (True once the ranks agreed to stop) and finish() for the last save.
    `data` and `model_settings` (None: a model of one's own) are compared on resume; `storage` writes and reads."""

    def __init__(self, cfg: Config, info: DistInfo, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                 scaler=None, signals: Optional[StopSignals] = None, data: Optional[dict] = None,
                 model_settings: Optional[dict] = None, storage: Optional[Storage] = None):
        self.cfg, self.info, self.data, self.model_settings = cfg, info, data, model_settings
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.root, self.mode, self.storage = checkpoint_root(cfg), cfg.checkpoint.async_mode, storage or Storage()
        # Own groups: DCP's collectives (threaded in async saves) and the votes never interleave; a long timeout, as a
        # rank may wait for the slowest one's write.
        timeout = datetime.timedelta(seconds=cfg.dist.init_timeout_s + BACKSTOP_S)
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self._vote_group, self._vote = dist.new_group(backend="gloo", timeout=timeout), None
        self.signals = signals or StopSignals(info.rank)
        self.before_save: Callable[[], int] = lambda: 0  # training() sets both
        self._paused: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        # One stager for the run, so that its host copy of the state is allocated once and reused by every save.
        self._stager = self._new_stager() if self.mode == "async_pinned" else None
        self.stopped, self._staged, self._pending, self._saved_step = False, False, None, -1
        self._last_save = time.monotonic()
        self._deletions: list[tuple[threading.Thread, set[Path]]] = []  # retention's, with their folders
        self._model_class = f"{model_class(model).__module__}.{model_class(model).__qualname__}"

    def restore(self, load_initial_weights: Callable[[], None] = lambda: None) -> Progress:
        """Resume, else load checkpoint.init_from's weights, else start fresh; exits 0 on a stop signal meanwhile."""
        choice = [None]
        if self.info.is_main:  # rank 0 chooses for all: nodes may list a shared folder differently
            try:
                choice[0] = self._choose_resume()
            except CheckpointError as err:
                choice[0] = err
        dist.broadcast_object_list(choice, src=0, group=self.group)
        if isinstance(checkpoint := choice[0], CheckpointError):
            raise checkpoint
        if checkpoint is not None:  # a rerun of an init_from run goes on from its own checkpoints
            progress = self._load(checkpoint)
        else:
            self._saved_step, progress = 0, Progress()  # nothing to save before the first step
            if self.cfg.checkpoint.init_from:
                load_initial_weights()
                logger.info(f"initialized the model from {self.cfg.checkpoint.init_from}; fresh optimizer, step 0")
        self._cast(save=False)
        if self._tally()[0]:
            logger.info(f"stopped during start-up, at step {progress.step}, on a stop signal; nothing new to save")
            raise SystemExit(0)
        return progress

    def _choose_resume(self) -> Optional[Checkpoint]:
        """This run's folder's newest checkpoint, else the one checkpoint.resume names: a rerun goes on from its own."""
        resume = self.cfg.checkpoint.resume
        if resume == "none":
            if committed := [p.name for _, p in list_checkpoints(self.root) if incomplete_reason(p) is None]:
                raise CheckpointError(f"--checkpoint.resume none, but {self.root} holds {', '.join(committed)} that "
                                      "this run would mix with its own: save to another --checkpoint.dir")
            return None
        latest = find_latest(self.root)
        if latest is None and resume != "auto":
            if (reason := incomplete_reason(Path(resume).expanduser())) is not None:
                raise CheckpointError(f"--checkpoint.resume {resume}: no complete checkpoint: it {reason}")
            return check_usable(Path(resume).expanduser())
        if latest is None:
            logger.info(f"no complete checkpoint in {self.root}: starting fresh")
        return latest

    def _load(self, checkpoint: Checkpoint) -> Progress:
        path, state = checkpoint
        self._check_run(path, state)
        progress = Progress(state["step"], state["consumed_samples"], state["tokens_seen"], state.get("skipped_steps", 0))
        self._saved_step = progress.step
        if progress.step >= self.cfg.train.steps:  # the run is over: reading a large model would take minutes
            return progress
        start, fix = time.perf_counter(), f"if its files are damaged, {set_aside(path)}"
        resharded = state["world_size"] != self.info.world_size  # then no rank is a saved one: take rank 0's RNG
        key = "rank0" if resharded else f"rank{self.info.rank}"
        saved, weights_only = self._state(rng_key=key), state.get(WEIGHTS_ONLY)  # weights_only: a fresh optimizer
        with self.storage.reading(checkpoint, self.group, fix):
            load_dcp({"model": saved["model"]} if weights_only else saved, path, self.group,
                     f"resume with the model it was saved with; {fix}")
        if weights_only:
            set_model_state_dict(self.model, saved["model"])
            logger.info(f"initialized the model from {path} (weights only): fresh optimizer, step 0")
            return progress
        # The optimizer's settings (weight decay, betas, eps) are this run's; the learning rate is the scheduler's.
        own = [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in self.optimizer.param_groups]
        set_state_dict(self.model, self.optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
        for group, settings in zip(self.optimizer.param_groups, own):
            group.update(settings)
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("grad_scaler"):
            self.scaler.load_state_dict(state["grad_scaler"])
        set_rng_state(saved["rng"][key], self.info.device)
        seconds, size = time.perf_counter() - start, size_bytes(path)
        ranks = f"; saved on {state['world_size']} ranks, resuming on {self.info.world_size}" if resharded else ""
        logger.info(f"loaded {path}: {size / 1e9:.3f} GB in {seconds:.2f} s ({size / 1e9 / max(seconds, 1e-9):.2f}"
                    f" GB/s); resuming from {path}: step {progress.step}, {progress.consumed_samples:,} samples{ranks}")
        return progress

    def _check_run(self, path: Path, state: dict) -> None:
        """Refuse another model (settings no shape shows: heads, RoPE, tying), other data or another train.seq_len."""
        saved, here = state.get("model") or {}, self.model_settings or {}
        if changed := [key for key in saved if key in here and saved[key] != here[key]]:
            then, now = (", ".join(f"model.{k} {values[k]}" for k in changed) for values in (saved, here))
            raise CheckpointError(f"checkpoint {path} was saved with {then}, but this run has {now}: set "
                                  + " ".join(model_flag(k, saved[k]) for k in changed))
        if (saved := state.get("seq_len", self.cfg.train.seq_len)) != self.cfg.train.seq_len:  # counts windows of it
            raise CheckpointError(f"checkpoint {path} was saved with train.seq_len={saved} but this run has "
                                  f"{self.cfg.train.seq_len}: resume with --train.seq_len {saved}, or start a new run "
                                  f"from its weights: --checkpoint.init_from {path} --train.output_dir <new folder>")
        if None in (saved := state.get("data"), self.data) or saved == self.data:
            return
        changes = "; ".join(f"{key} {saved.get(key)} then, {self.data.get(key)} now"
                            for key in sorted(set(saved) | set(self.data)) if saved.get(key) != self.data.get(key))
        if not self.cfg.checkpoint.allow_data_change:
            raise CheckpointError(f"checkpoint {path} was saved reading other data ({changes}); resume with that data, "
                                  "or pass --checkpoint.allow_data_change to go on with this data at the saved count")
        logger.warning(f"resuming {path} on other data ({changes}): sample {state['consumed_samples']:,} of the new "
                       "data's order comes next")

    @contextlib.contextmanager
    def training(self, paused: Callable[[], Any] = contextlib.nullcontext, before_save: Callable[[], int] = lambda: 0):
        """Around the loop: before_save vetoes a save by raising, or returns the skipped steps to keep; `paused` is
        entered while a save blocks training. A save begun before a failure still counts once it completes."""
        self.before_save, self._paused = before_save, paused
        try:
            yield
        except BaseException:
            if self._pending is not None:  # the failure that brought us here may have taken the save down too
                with self._paused(), contextlib.suppress(BaseException):
                    self._wait()
            raise
        finally:
            if self._stager is not None and self._pending is None:
                self._stager.close()

    def after_step(self, progress: Progress) -> bool:
        """After every step, on every rank: saves when due, and returns True once the ranks agreed to stop."""
        if self._pending is not None and self._pending.future.done():
            with self._paused():
                self._wait()
        c = self.cfg.checkpoint
        if self._stager is not None and not self._staged and (c.interval or c.interval_minutes or c.save_final):
            # AdamW's state has its shapes now: allocate the host copy before the first save, which may be a
            # preemption's, with a grace period to keep.
            with self._paused():
                start, self._staged = time.perf_counter(), self._stager.stage(self._state()) is not None
                logger.info(f"checkpoint staging: host memory allocated in {time.perf_counter() - start:.1f} s")
        stop, save_due = self._tally()
        if stop:
            self.stopped = True
            return True
        if save_due or (c.interval and progress.step % c.interval == 0):
            self.save(progress)
        self._cast(save=self.info.is_main and 0 < 60 * c.interval_minutes <= time.monotonic() - self._last_save)
        return False

    def _cast(self, save: bool) -> None:
        """Vote to stop (a signal) and to save (rank 0's clock): a gloo max-all-reduce, read a step later, unwaited."""
        flags = torch.tensor([int(self.signals.received is not None), int(save)], dtype=torch.int32)
        self._vote = (flags, dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._vote_group, async_op=True))

    def _tally(self) -> tuple[bool, bool]:
        """(any rank asked to stop, rank 0 found a save due), as of the last vote cast; (False, False) if none."""
        if self._vote is None:
            return False, False
        (flags, work), self._vote = self._vote, None
        work.wait()
        return bool(flags[0]), bool(flags[1])

    def finish(self, progress: Progress) -> None:
        """The last save (unless saved already, or save_final is off and no stop was asked for), waited for."""
        self._tally()  # no collective may be left open at shutdown
        with self._paused():
            if progress.step != self._saved_step and (self.stopped or self.cfg.checkpoint.save_final):
                self.save(progress)
            self._wait()
            dist.barrier(group=self.group)  # no rank exits before rank 0 has committed
            if not self.stopped:  # a stopped run spends its grace period exiting: deletions may be cut short
                for thread, _ in self._deletions:
                    thread.join()
        if self.stopped:
            logger.info(f"stopped at step {progress.step} on a stop signal; checkpoint complete: rerun to resume")

    def save(self, progress: Progress) -> None:
        """Save this step; training waits for the write (async_mode none) or the copy to host memory only."""
        with self._paused():
            progress.skipped_steps = self.before_save()
            start = time.perf_counter()
            waited = self._wait()  # one save at a time: the host copy gets reused, and commits stay in order
            begun, path = time.perf_counter(), step_dir(self.root, progress.step)
            self._make_room(path)
            writer = self.storage.writer(path, self.cfg.checkpoint.write_threads)
            future = self._write(writer)
            save = _Save(path, future, writer, self._trainer_state(progress), begun)
            future.add_done_callback(lambda _: setattr(save, "finished", time.perf_counter()))
            self._pending, self._saved_step, self._last_save = save, progress.step, time.monotonic()
            if self.mode == "none":
                self._wait()  # commits it, or raises its error before it could be logged as taken
            waiting = f" (of which {waited:.2f} s waiting for the previous save)" if waited > 0.01 else ""
            logger.info(f"checkpoint step {progress.step} ({self.mode}): training blocked "
                        f"{time.perf_counter() - start:.2f} s{waiting}")

    def _state(self, rng_key: Optional[str] = None) -> dict:
        """get_state_dict's and this rank's RNG states (under `rng_key`). An optimizer that has not stepped gets its
        state by an AdamW step at lr 0, whose count goes back to 0: bias correction would run a step ahead for good."""
        unstepped = not self.optimizer.state
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        for state in self.optimizer.state.values() if unstepped else ():
            state["step"].zero_()  # in place: optim_sd holds these same tensors
        rng = {rng_key or f"rank{self.info.rank}": rng_state(self.info.device)}
        return {"model": model_sd, "optim": optim_sd, "rng": rng}

    def _new_stager(self) -> DefaultStager:
        pin = self.info.device.type == "cuda"
        return DefaultStager(StagingOptions(pin, False, False, pin))

    def _write(self, writer: dcp.FileSystemWriter) -> Future:
        """Hand this rank's shards to DCP; the future completes once every rank's are on storage."""
        state, done = self._state(), Future()
        if self._stager is not None and not self._stager._state_dict_stager._deepcopy_dispatch:
            self._stager = self._new_stager()  # torch 2.11 closes it after each copy, for good (pytorch#183413)
        if self.mode != "none":
            return dcp.async_save(state, storage_writer=writer, process_group=self.group, async_stager=self._stager)
        try:
            dcp.save(state, storage_writer=writer, process_group=self.group)
            done.set_result(None)
        except DCP_ERRORS as err:  # _wait raises it, as it does an async save's
            done.set_exception(err)
        return done

    def _make_room(self, path: Path) -> None:
        """Clear what an interrupted save of this step left; never a committed checkpoint."""
        if self.info.is_main:
            if (reason := incomplete_reason(path)) is None:
                raise CheckpointError(f"{path} is a committed checkpoint already; is another run saving into "
                                      f"{self.root}? Move it away, or save to another --checkpoint.dir")
            if path.exists():
                logger.info(f"clearing {path} before saving there: it {reason}")
                shutil.rmtree(path)
            path.mkdir(parents=True)
            # The folder's name, then config.toml, durably on disk before DCP's shards and so before the marker.
            fsync_folder(self.root)
            write_atomic(path / CONFIG, lambda f: f.write(to_toml(self.cfg).encode()))
        dist.barrier(group=self.group)  # nobody writes into the folder while rank 0 may still be clearing it

    def _trainer_state(self, progress: Progress) -> dict:
        t, world = self.cfg.train, self.info.world_size
        return {"format": FORMAT, **vars(progress), "world_size": world,
                "mesh": dict(zip(("dp_replicate", "dp_shard"), mesh_shape(self.cfg.parallel, world))),
                "global_batch": samples_per_step(t.micro_batch_size, t.grad_accum_steps, world), "seq_len": t.seq_len,
                "data": self.data, "model": self.model_settings, MODEL_CLASS: self._model_class,
                "scheduler": self.scheduler.state_dict(),
                "grad_scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__}

    def _wait(self) -> float:
        """Wait for the save in flight, if any, and commit it here, where an error stops training; seconds waited."""
        if self._pending is None:
            return 0.0
        save, self._pending, start = self._pending, None, time.perf_counter()
        try:
            save.future.result()
        except DCP_ERRORS as err:
            raise RuntimeError(f"saving checkpoint {save.path} failed: {dcp_cause(err)}") from err
        waited = time.perf_counter() - start
        if self.info.is_main:
            write_marker(save.path, self.storage.commit(save.trainer_state, save.writer))
            size, seconds = size_bytes(save.path), (save.finished or time.perf_counter()) - save.started
            logger.info(f"checkpoint {save.path} complete: {size / 1e9:.3f} GB in {seconds:.2f} s "
                        f"({size / 1e9 / max(seconds, 1e-9):.2f} GB/s)")
            self._retain()
        return waited

    def _retain(self) -> None:
        """Delete complete checkpoints beyond checkpoint.keep and incomplete ones before the newest, in a thread: other
        ranks' watchdogs would take a rank 0 waiting for slow storage for a hung one. Unusable ones stay, uncounted."""
        self._deletions = [(thread, paths) for thread, paths in self._deletions if thread.is_alive()]
        deleting = set().union(*(paths for _, paths in self._deletions))  # markerless now: they look incomplete
        found = list_checkpoints(self.root)
        complete = [(step, path) for step, path in found if read_marker(path)[0]]
        # A newer incomplete folder is left to the save of its step, which clears it first.
        old = [(path, "incomplete, older than the newest complete checkpoint") for step, path in found
               if step < complete[-1][0] and path not in deleting and incomplete_reason(path)]
        keep = self.cfg.checkpoint.keep
        for _, path in complete[:-keep]:  # the marker first: a crash then leaves incomplete folders, not damaged ones
            (path / MARKER).unlink()
            old.append((path, f"checkpoint.keep={keep}"))
        if old:  # a daemon: a stopped run's exit does not wait for it
            thread = threading.Thread(target=_delete, args=(old,), name="checkpoint-retention", daemon=True)
            thread.start()
            self._deletions.append((thread, {path for path, _ in old}))


def _delete(paths: list[tuple[Path, str]]) -> None:
    for path, why in paths:
        try:
            shutil.rmtree(path)
        except OSError as err:  # what is left has no marker: the next retention deletes it as incomplete
            logger.warning(f"could not delete {path} ({why}): {err}")
        else:
            logger.info(f"deleted {path} ({why})")
