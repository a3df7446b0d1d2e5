"""Fault injection on real gloo groups: a hung or crashed rank ends the job quickly, naming the rank; a
non-finite step is never applied and never checkpointed."""

from __future__ import annotations

import datetime
import importlib
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional
from unittest import mock

import pytest
import torch

from fsdp_trainer.config import parse_args

from helpers import TINY_FLAGS, blames, checkout_env, launch_fault, processes_with, run_ranks

REPO = Path(__file__).resolve().parents[1]
TINY = [*TINY_FLAGS, "--data.source", "synthetic"]
# Seconds within which a job with a hung or crashed rank must end, start-up included: ample on two busy cores, yet
# short of the 120 s (dist.timeout_s's default) that a job whose timeout or crash went unnoticed would wait at least.
ENDS_WITHIN = 100


def launch(fault: str, rank: str, step: int, tmp_path: Path, *flags: str, nproc: int = 2, timeout: float = 180,
           env: Optional[dict[str, str]] = None, torchrun: bool = False):
    """The tiny model with `flags`, writing to tmp_path, and `fault` injected (helpers.launch_fault)."""
    return launch_fault(fault, rank, step, *TINY, "--train.output_dir", str(tmp_path), *flags, nproc=nproc,
                        timeout=timeout, env=env, torchrun=torchrun)


def suspect(rank: int, why: str) -> str:
    """The watchdog's report naming `rank`, a process of this host, and why, as a regular expression."""
    return rf"suspect rank\(s\): {rank} on host {re.escape(socket.gethostname())} \(pid \d+\): {re.escape(why)}"


# dist.timeout_s of the tests that end a rank from outside: a job must end within it + 15 s of the rank's last step.
TIMEOUT_S = 4


@pytest.mark.slow
@pytest.mark.parametrize("fault,rank,env", [
    ("freeze", 1, {}),
    ("die", 1, {}),
    ("die", 0, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),  # as the launch scripts set: the store dies with rank 0
], ids=["frozen_rank_1", "killed_rank_1", "killed_rank_0_with_the_store"])
def test_a_frozen_or_killed_rank_ends_the_job_on_time_and_the_last_lines_name_it(tmp_path, fault, rank, env):
    """SIGSTOP (neither its steps nor its watchdog run, and torchrun's SIGTERM waits) or SIGKILL to a rank as its
    step 4 begins: every process of the job has ended within dist.timeout_s + 15 s, and both the watchdog's last
    report and torchrun's summary at the end name that rank, with its host and pid."""
    mark = {"FSDP_TRAINER_TEST_JOB": str(tmp_path)}
    proc, _ = launch(fault, str(rank), 4, tmp_path, "--train.steps", "1000", "--dist.timeout_s", str(TIMEOUT_S),
                     "--checkpoint.interval", "0", "--checkpoint.no_save_final", env={**env, **mark}, torchrun=True)
    ended = time.time()
    signalled = re.search(r"SIG(STOP|KILL) at ([0-9.]+) to pid ([0-9]+)", proc.stderr)
    assert signalled and proc.returncode != 0, proc.stderr[-3000:]
    at, pid = float(signalled[2]), int(signalled[3])
    assert ended - at < TIMEOUT_S + 15, (ended - at, proc.stderr[-3000:])
    assert processes_with("FSDP_TRAINER_TEST_JOB", str(tmp_path)) == []
    reports = [line for line in proc.stderr.splitlines() if "suspect rank(s): " in line]
    assert f"suspect rank(s): {rank} on host {socket.gethostname()} (pid {pid})" in reports[-1], proc.stderr[-3000:]
    assert blames(proc.stderr, rank, pid), proc.stderr[-3000:]


@pytest.mark.slow
def test_a_hung_rank_ends_the_job_within_the_timeout_naming_it(tmp_path):
    proc, elapsed = launch("hang", "1", 3, tmp_path, "--train.steps", "6", "--dist.timeout_s", "5",
                           "--checkpoint.interval", "0", "--checkpoint.no_save_final")
    assert proc.returncode != 0
    assert re.search(suspect(1, "busy outside any collective or GPU sync, at faulty_step (fault_worker.py"),
                     proc.stderr), proc.stderr[-3000:]
    assert elapsed < ENDS_WITHIN, elapsed  # 5 s timeout + start-up + torchrun tear-down


@pytest.mark.slow
@pytest.mark.parametrize("interval", [0, 3], ids=["in_the_vote", "in_a_save"])
def test_a_stalled_rank_is_named_by_ranks_that_wait_for_it_in_the_vote_or_a_save(tmp_path, interval):
    """As under NCCL, the healthy rank does not wait inside the step for the stalled one: it runs ahead into the
    stop/save vote (interval 0; watched, and reported as waiting) or into a save that waits for the stalled rank
    (interval 3; not timed out, but reported as checkpointing). Neither may be called dead."""
    proc, elapsed = launch("stall", "1", 3, tmp_path, "--train.steps", "6", "--train.log_every", "6",
                           "--dist.timeout_s", "5", "--checkpoint.interval", str(interval),
                           "--checkpoint.no_save_final")
    assert proc.returncode != 0
    ahead = 4 if interval == 0 else 3  # the vote of step 3 is read after step 4; the save of step 3 waits
    assert re.search(suspect(1, f"finished step 2 while others finished step {ahead}."), proc.stderr), \
        proc.stderr[-3000:]
    assert "sent no report" not in proc.stderr
    assert elapsed < ENDS_WITHIN, elapsed


@pytest.mark.slow
def test_ranks_whose_steps_end_later_answer_the_first_timed_out_rank_at_once(tmp_path):
    """The stalled rank's last step ended a whole (3 s) step before the healthy rank's, so it times out first, and
    the healthy one would time out only after it had reported and ended the job: the healthy rank answers its alarm,
    and is neither called dead nor suspected."""
    proc, elapsed = launch("stall_slow", "1", 3, tmp_path, "--train.steps", "6", "--train.log_every", "6",
                           "--dist.timeout_s", "5", "--checkpoint.interval", "0", "--checkpoint.no_save_final")
    assert proc.returncode != 0
    assert re.search(suspect(1, "finished step 2 while others finished step ") + r"[34]\.", proc.stderr), \
        proc.stderr[-3000:]
    assert "sent no report" not in proc.stderr
    assert elapsed < ENDS_WITHIN, elapsed


@pytest.mark.slow
def test_writing_a_profile_pauses_the_watchdog_and_a_rank_still_writing_is_named(tmp_path):
    flags = ["--train.steps", "5", "--dist.timeout_s", "3", "--profile.steps", "3:3", "--checkpoint.interval", "0",
             "--checkpoint.no_save_final"]
    proc, _ = launch("slow_profile", "all", 6, tmp_path / "slow", *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "profile of steps 3-3 written to" in proc.stderr
    proc, elapsed = launch("slow_profile", "1", 3600, tmp_path / "stuck", *flags)
    assert proc.returncode != 0
    assert re.search(suspect(1, "still writing its profile, at slow_export (fault_worker.py"), proc.stderr), \
        proc.stderr[-3000:]
    assert elapsed < ENDS_WITHIN, elapsed


class ReportStore:
    """The c10d store as Watchdog.report reads it, holding `reports` (rank: its report's fields)."""

    def __init__(self, reports: dict):
        from fsdp_trainer.tools.faults import REPORT
        self.keys = {REPORT.format(rank): json.dumps(fields) for rank, fields in reports.items()}

    def check(self, keys):
        return all(key in self.keys for key in keys)

    def get(self, key):
        return self.keys[key]


def report_of(store: ReportStore, rank: int, world_size: int, timeout: float, steady: bool = True) -> str:
    """What rank's watchdog reports from `store`: its report alone, without a thread or a group."""
    from fsdp_trainer.tools.faults import Watchdog
    watchdog = Watchdog.__new__(Watchdog)
    watchdog.rank, watchdog.world_size, watchdog.store = rank, world_size, store
    watchdog.peers = [(f"h{r}", 100 + r) for r in range(world_size)]
    watchdog.last_progress, watchdog.timeout, watchdog.steady = time.monotonic(), timeout, steady
    return watchdog.report()


def test_a_report_withdrawn_while_it_is_read_is_not_taken_for_a_dead_rank_or_a_dead_store():
    """Rank 1 leaves a checkpoint save, withdrawing its report, between rank 0's check of the key and its read."""
    from fsdp_trainer.tools.faults import REPORT

    class Store(ReportStore):
        def get(self, key):
            if key == REPORT.format(1):
                del self.keys[key]
                raise torch.distributed.DistStoreError("wait timeout")
            return self.keys[key]

    report = report_of(Store({0: [5, "waiting", "a"], 1: [5, "checkpointing", "b"]}), 0, 2, 5.0)
    assert "every rank finished step 5" in report and "sent no report" not in report, report


@pytest.mark.parametrize("busy_step,other_step,suspects", [
    (0, 0, "suspect rank(s): 0 on host h0 (pid 100): busy outside any collective or GPU sync, at loop"),  # stuck
    (4, 2, "suspect rank(s): 1 on host h1 (pid 101): finished step 2 while others finished step 4"),  # ran ahead
])
def test_a_rank_that_answers_the_alarm_busy_is_a_suspect_unless_another_is_behind(busy_step, other_step, suspects):
    """Rank 0 answered rank 1's alarm within its own timeout (its watchdog started, or its last step ended, later),
    busy outside any collective: stuck, unless rank 1 is behind it."""
    store = ReportStore({0: [busy_step, "busy", "loop", True],
                         1: [other_step, "waiting" if busy_step == other_step else "busy", "b", False]})
    assert suspects + "." in report_of(store, 1, 2, 5.0)


def test_a_rank_busy_restoring_is_the_suspect_and_the_ranks_waiting_for_it_are_listed():
    """Before the first step every rank reports step 0: a rank busy in the restore is named as such, and the ranks
    waiting in its collectives as runs of ranks; the timeout to raise is the first step's."""
    from fsdp_trainer.tools.faults import RESTORING

    reports = {r: [0, "waiting", "all_gather (distributed_c10d.py:1)", True] for r in range(5)}
    reports[2] = [0, RESTORING, "read (storage.py:7)", False]
    assert ("suspect rank(s): 2 on host h2 (pid 102): still restoring a checkpoint, at read (storage.py:7); check its "
            "storage. Rank(s) "
            "0-1, 3-4 wait in a collective or GPU sync. If start-up (a restore, compilation, the first step) is "
            "legitimately this slow, raise dist.init_timeout_s.") in report_of(ReportStore(reports), 2, 5, 6.0,
                                                                               steady=False)


@pytest.mark.parametrize("variable", [None, "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"],
                         ids=["trainer's", "user's", "user's_deprecated"])
def test_the_watchdog_s_flight_recorder_dump_does_not_overwrite_nccl_s(tmp_path, monkeypatch, variable):
    """NCCL writes its own dump to <prefix><rank> on its timeout, the prefix from the trainer or the user (under either
    name). The watchdog's dump goes beside it, under a name torchfrtrace's --prefix (a substring) tells apart."""
    from fsdp_trainer.tools.faults import DUMP_PREFIX_VARIABLES, _dump_flight_recorder, enable_flight_recorder

    environ = {k: v for k, v in os.environ.items() if k not in DUMP_PREFIX_VARIABLES}
    if variable:
        environ[variable] = str(tmp_path / "mine" / "trace_")
    monkeypatch.setattr(os, "environ", environ)  # a copy, so that nothing set here outlives the test
    enable_flight_recorder(tmp_path / "run")
    # As torch reads it: where both are set, the newer name wins.
    nccl_s = Path((environ.get("TORCH_FR_DUMP_TEMP_FILE") or environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]) + "1")
    assert nccl_s.parent == (tmp_path / "mine" if variable else tmp_path.resolve() / "run" / "flight_recorder")
    nccl_s.parent.mkdir(exist_ok=True)
    nccl_s.write_bytes(b"NCCL's")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C._distributed_c10d, "_dump_nccl_trace", lambda: b"the watchdog's", raising=False)
    ours = _dump_flight_recorder(1)
    assert nccl_s.read_bytes() == b"NCCL's" and ours.read_bytes() == b"the watchdog's"
    assert ours.parent == nccl_s.parent and ours.name == "watchdog_rank1"
    assert nccl_s.name.removesuffix("1") not in ours.name


@pytest.mark.slow
def test_a_watchdog_that_cannot_reach_the_store_says_so(tmp_path):
    script = """if True:
        import time
        from fsdp_trainer import distributed
        from fsdp_trainer.tools.faults import Watchdog

        class Gone:  # a c10d store whose host is down
            def __getattr__(self, name):
                def fail(*args, **kwargs):
                    raise RuntimeError("Connection reset by peer")
                return fail

        distributed.init(60)
        watchdog = Watchdog(0, 1, 2.0, 2.0, distributed.build_mesh("cpu", 1, 1))
        watchdog.store = Gone()  # before its first look, a quarter of the timeout later
        time.sleep(60)
    """
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=checkout_env())
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "(busy, at <module> (<string>:" in proc.stderr  # where this rank itself is stuck: the sleep
    assert "and the c10d store cannot be reached (Connection reset by peer)" in proc.stderr


def _group_timeouts(settings: list[tuple[float, float]]) -> list[list[list[datetime.timedelta]]]:
    """For each (dist.init_timeout_s, dist.timeout_s): the HSDP groups' timeouts before and after step 1."""
    from fsdp_trainer import distributed
    from fsdp_trainer.tools.faults import Watchdog

    distributed.init(60)
    mesh = distributed.build_mesh("cpu", 2, 2)
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
    seen = []
    for init_timeout_s, timeout_s in settings:
        with Watchdog(int(os.environ["RANK"]), 4, init_timeout_s, timeout_s, mesh) as watchdog:
            seen.append([[g._get_backend(torch.device("cpu")).options._timeout for g in groups]])
            watchdog.beat(1)
            seen[-1].append([g._get_backend(torch.device("cpu")).options._timeout for g in groups])
    return seen


@pytest.mark.slow
def test_the_hsdp_mesh_groups_get_the_watchdogs_timeouts():
    """DeviceMesh creates HSDP's sub-groups with the backend's default timeout (30 min on gloo, 10 on NCCL): the
    watchdog sets dist.init_timeout_s on them, and dist.timeout_s after step 1, each 60 s behind its own, also
    where the two are equal. The timeouts are long enough that a loaded machine never trips them."""
    settings = [(120.0, 40.0), (60.0, 60.0)]
    for seen in run_ranks(_group_timeouts, 4, settings):
        for (init_timeout_s, timeout_s), (before, after) in zip(settings, seen, strict=True):
            assert before == [datetime.timedelta(seconds=init_timeout_s + 60)] * 2
            assert after == [datetime.timedelta(seconds=timeout_s + 60)] * 2


@pytest.mark.slow
def test_a_rank_hung_in_the_first_step_is_named_before_the_group_timeout_ends_the_others(tmp_path):
    """Until step 1 is done the watchdog's timeout is dist.init_timeout_s: the process group's own timeout must
    trail it, or it ends the rank that waits for the hung one first, with a bare "Timed out", and the hung rank's
    report then calls that rank dead."""
    proc, elapsed = launch("hang", "1", 1, tmp_path, "--train.steps", "3", "--dist.init_timeout_s", "6",
                           "--dist.timeout_s", "4", "--checkpoint.interval", "0", "--checkpoint.no_save_final")
    assert proc.returncode != 0
    assert re.search(suspect(1, "busy outside any collective or GPU sync, at faulty_step (fault_worker.py"),
                     proc.stderr), proc.stderr[-3000:]
    assert "sent no report" not in proc.stderr and "Timed out" not in proc.stderr, proc.stderr[-3000:]
    assert elapsed < ENDS_WITHIN, elapsed


@pytest.mark.slow
def test_a_rank_hung_in_the_restore_is_named_before_the_group_timeout_ends_the_others(tmp_path):
    """The watchdog watches the restore, against dist.init_timeout_s: rank 1's reads of the checkpoint hang as it
    resumes (inside DCP, whose frames are not a wait), and it is named as restoring, rank 0 as waiting for it, with
    the watchdog's exit code. The checkpointer's groups, which rank 0 waits in, must trail it, or their own timeout
    ends rank 0 first with a bare "Timed out"."""
    from fsdp_trainer.tools.faults import BACKSTOP_S, EXIT_HANG

    proc, _ = launch("hang_restore", "1", 0, tmp_path, "--train.steps", "1")  # nothing to restore: it saves step 1
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, elapsed = launch("hang_restore", "1", 0, tmp_path, "--train.steps", "2", "--dist.init_timeout_s", "6",
                           "--dist.timeout_s", "4", torchrun=True)
    assert f"exitcode  : {EXIT_HANG}" in proc.stderr, proc.stderr[-3000:]  # torchrun's summary of the failed ranks
    assert re.search(suspect(1, "still restoring a checkpoint, at create_stream (fault_worker.py:"), proc.stderr), \
        proc.stderr[-3000:]
    assert "Rank(s) 0 wait in a collective or GPU sync. If start-up" in proc.stderr
    assert "sent no report" not in proc.stderr and "Timed out" not in proc.stderr, proc.stderr[-3000:]
    assert elapsed < 6 + BACKSTOP_S, elapsed  # start-up included


@pytest.mark.slow
def test_a_save_whose_exchange_times_out_fails_and_commits_nothing(tmp_path):
    """Rank 1's writes hang in the (async) save of step 1; rank 0 writes its part, waits in DCP's exchange until the
    checkpointer's group times out (fault_worker shortens it to dist.init_timeout_s), and fails the save in one line
    with gloo's timeout. Nothing is committed."""
    proc, elapsed = launch("hang_writes", "1", 0, tmp_path, "--train.steps", "2", "--checkpoint.interval", "1",
                           "--dist.init_timeout_s", "6")
    assert proc.returncode != 0
    from fsdp_trainer.checkpoint import MARKER, step_dir

    step_1 = step_dir(tmp_path / "checkpoints", 1)
    assert re.search(rf"saving checkpoint {re.escape(str(step_1))} failed: .*Timed out", proc.stderr), \
        proc.stderr[-3000:]
    assert not (step_1 / MARKER).exists()
    assert elapsed < ENDS_WITHIN, elapsed


@pytest.mark.slow
def test_a_restore_is_watched_not_paused_so_a_job_stuck_in_it_on_every_rank_ends(tmp_path):
    """Every rank's storage down: no rank's watchdog may wait for another's to end the job."""
    script = """if True:
        import time
        from fsdp_trainer import distributed
        from fsdp_trainer.tools.faults import RESTORING, Watchdog

        distributed.init(60)
        with Watchdog(0, 1, 2.0, 2.0, distributed.build_mesh("cpu", 1, 1)) as watchdog:
            with watchdog.doing(RESTORING):
                time.sleep(60)
    """
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=checkout_env())
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert re.search(suspect(0, "still restoring a checkpoint, at <module> (<string>:"), proc.stderr), \
        proc.stderr[-3000:]


@pytest.mark.slow
def test_a_run_with_nothing_left_to_train_stops_its_watchdog(tmp_path, capfd):
    """The watchdog starts before the restore, so the return for a finished run stops it too: left running in a
    process that goes on (a sweep calling main, a notebook), it would end that process init_timeout_s later."""
    from fsdp_trainer.train import main

    flags = [*TINY, "--train.output_dir", str(tmp_path), "--train.steps", "1", "--checkpoint.async_mode", "none"]
    main(flags)
    main(flags)  # resumes the checkpoint of step 1 of 1
    assert "step 1 of train.steps=1 is done already" in capfd.readouterr().err
    watchdogs = [thread for thread in threading.enumerate() if thread.name == "fsdp_trainer-watchdog"]
    for thread in watchdogs:
        thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in watchdogs)


@pytest.mark.slow
def test_a_crashed_rank_ends_the_job_naming_it_with_its_traceback(tmp_path):
    proc, elapsed = launch("crash", "1", 3, tmp_path, "--train.steps", "6", "--checkpoint.interval", "0",
                           "--checkpoint.no_save_final", torchrun=True)
    assert proc.returncode != 0
    assert "injected crash" in proc.stderr
    assert "rank      : 1" in proc.stderr  # torchrun's root-cause summary, from the error file
    assert elapsed < ENDS_WITHIN, elapsed


@pytest.mark.slow
def test_a_crash_on_every_rank_ends_the_job_with_loader_workers_running(tmp_path):
    # The workers ignore SIGTERM so that a preempted rank can checkpoint; they must not keep a failed rank alive.
    proc, elapsed = launch("crash", "all", 3, tmp_path, "--train.steps", "6", "--checkpoint.interval", "0",
                           "--checkpoint.no_save_final", "--data.num_workers", "2", timeout=120, torchrun=True)
    assert proc.returncode != 0
    assert "injected crash" in proc.stderr
    assert elapsed < ENDS_WITHIN, elapsed


@pytest.mark.slow
def test_nonfinite_step_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    proc, _ = launch("nan", "all", 5, tmp_path, "--train.steps", "8", "--checkpoint.interval", "2",
                     "--checkpoint.async_mode", "none")
    assert proc.returncode != 0
    assert "non-finite loss or gradient norm at step 5" in proc.stderr, proc.stderr[-3000:]
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved[-1] == "step_00000004"  # nothing written after the bad step
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["grad_norm"])) for r in rows if r["step"] < 5)


@pytest.mark.slow
def test_a_stop_signal_during_start_up_exits_0_before_the_first_step(tmp_path):
    """SIGUSR1 to one rank while it builds its model: not killed by it, and every rank exits 0 at once, untrained
    and with nothing to save (a preemption's grace period is better spent exiting than compiling)."""
    proc, elapsed = launch("preempt", "1", 0, tmp_path, "--train.steps", "6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SIGUSR1: finishing the step" in proc.stderr
    assert "stopped during start-up, at step 0, on a stop signal; nothing new to save" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists() and not list(tmp_path.glob("checkpoints/step_*"))


@pytest.mark.slow
def test_skipped_steps_count_over_resumes(tmp_path):
    """The count of skipped steps is saved with each checkpoint and continues on resume: 1 skipped before the
    resume and 1 after exceed train.max_skipped_steps=1. Step numbers are the whole run's."""
    flags = ["--train.on_nonfinite", "skip", "--train.max_skipped_steps", "1", "--checkpoint.interval", "2",
             "--checkpoint.async_mode", "none"]
    proc, _ = launch("nan", "all", 3, tmp_path, "--train.steps", "4", *flags, nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "checkpoints/step_00000004/trainer_state.json").read_text())["skipped_steps"] == 1
    proc, _ = launch("nan", "all", 2, tmp_path, "--train.steps", "8", *flags, nproc=1)
    assert proc.returncode != 0
    assert ("2 steps with a non-finite loss or gradient norm were skipped (the first of this run at step 6), more "
            "than train.max_skipped_steps=1") in proc.stderr, proc.stderr[-3000:]
    assert "raise train.max_skipped_steps" in proc.stderr and "on_nonfinite=skip" not in proc.stderr


@pytest.mark.slow
def test_skip_mode_skips_nonfinite_steps_and_finishes_with_finite_weights(tmp_path):
    proc, _ = launch("nan", "0", 3, tmp_path, "--train.steps", "6", "--train.on_nonfinite", "skip",
                     "--checkpoint.interval", "0", "--checkpoint.async_mode", "none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["skipped_steps"] == 1
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if r["step"] != 3)


def test_a_float16_loss_scale_below_1_stops_the_run():
    """The scaler skips overflowing steps itself; a scale halved below 1 means every step overflows unscaled."""
    from fsdp_trainer.optim import NonFiniteError, NonFiniteGuard

    healthy = NonFiniteGuard(torch.device("cpu"), "stop", 10, scaler=torch.amp.GradScaler("cpu", init_scale=2.0))
    assert healthy.check() == 0
    diverged = NonFiniteGuard(torch.device("cpu"), "stop", 10, scaler=torch.amp.GradScaler("cpu", init_scale=0.5))
    with pytest.raises(NonFiniteError, match="float16 loss scale fell to 0.5"):
        diverged.check()


def test_an_oom_names_the_part_of_the_step_it_happened_in():
    """The real train_step, with one of its calls running out of memory somewhere below it: under decorators such
    as clip_grad_norm's no_grad and the optimizer's hooks, clipping and the optimizer step were reported as the
    forward."""
    from fsdp_trainer import optim, train
    from fsdp_trainer.optim import NonFiniteGuard
    from fsdp_trainer.tools.faults import oom_phase

    cpu = torch.device("cpu")
    cfg = parse_args(["--model.vocab_size", "10"])
    model = torch.nn.Embedding(10, 10)  # logits [batch, seq, 10] of token ids
    optimizer = optim.build_optimizer(model, cfg.optim)
    scheduler = optim.build_scheduler(optimizer, cfg.optim, 100)
    batches = itertools.repeat((torch.randint(0, 10, (2, 4)), torch.randint(0, 10, (2, 4))))

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    def phase(owner, name: str, guard=None, scaler=None) -> str:
        with mock.patch.object(owner, name, oom):
            try:
                train.train_step(model, optimizer, scheduler, batches, cfg, scaler, cpu, guard)
            except torch.OutOfMemoryError as err:
                return oom_phase(err)
        raise AssertionError(f"no OOM from {name}")

    scaler = torch.amp.GradScaler("cpu")
    assert phase(model, "forward") == "forward"
    assert phase(torch.autograd, "backward") == "backward"
    assert phase(scaler, "unscale_", scaler=scaler) == "float16 unscaling"
    assert phase(optim, "get_total_norm") == "gradient clipping"
    adam = importlib.import_module("torch.optim.adam")  # AdamW.step's functional update
    assert phase(adam, "adam") == "optimizer step"
    assert phase(adam, "adam", guard=NonFiniteGuard(cpu, "stop", 0)) == "optimizer step"
    assert phase(scaler, "step", scaler=scaler) == "optimizer step"
    assert phase(optimizer, "zero_grad") == "zero_grad"
    try:
        oom()
    except torch.OutOfMemoryError as err:
        assert oom_phase(err) == "the training loop"


def test_the_failed_allocation_is_read_from_the_allocators_message():
    from fsdp_trainer.tools.faults import requested_bytes

    message = ("CUDA out of memory. Tried to allocate {}. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB "
               "is free. Including non-PyTorch memory, this process has 78.12 GiB memory in use.")
    assert requested_bytes(torch.OutOfMemoryError(message.format("2.50 GiB"))) == int(2.5 * 2**30)
    assert requested_bytes(torch.OutOfMemoryError(message.format("896.00 MiB"))) == 896 * 2**20
    assert requested_bytes(torch.OutOfMemoryError(message.format("512 bytes"))) == 512
    assert requested_bytes(torch.OutOfMemoryError("CUDA out of memory")) == 0


def test_an_oom_report_names_the_change_to_make_or_says_there_is_none(monkeypatch):
    from types import SimpleNamespace

    from fsdp_trainer.tools.faults import describe_oom

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 70 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 2**30))
    err, cuda = torch.OutOfMemoryError("CUDA out of memory"), torch.device("cuda", 0)
    report = describe_oom(err, 3, cuda, 60 * 2**30, "--ac.mode full  ->  40.9 GiB", None)
    assert report == ("rank 3: CUDA out of memory during the training loop; peak allocated 70.0 GiB of 80.0 GiB; the "
                      "memory plan predicted 60.0 GiB; suggestion: --ac.mode full  ->  40.9 GiB")
    assert describe_oom(err, 3, cuda, 60 * 2**30, None, None).endswith(
        "; no change the planner tries lowers the plan by the allocation that failed: `python -m fsdp_trainer.tools.plan` "
        "with the same flags and a smaller --gpu-memory lists what each change frees")
    assert describe_oom(err, 3, cuda, None, None, None).endswith("peak allocated 70.0 GiB of 80.0 GiB")  # no plan
