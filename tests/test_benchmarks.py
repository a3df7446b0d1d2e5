"""The benchmark scripts' own logic that runs without a GPU, and the scripts themselves on CPU gloo ranks."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import shlex
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from fsdp_trainer.tools.doctor import FAULT_VAR

from helpers import node_name, side_by_side

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
# Appended, never first: a script's name must not hide an installed package from every later test.
sys.path.append(str(BENCHMARKS))

from kernel_table import kernel_totals, steps_in  # noqa: E402
from memory_streams import largest_allocations, reserved_by_stream  # noqa: E402
from throughput import parse_variant  # noqa: E402

# The debug model cut down so that a run of a few steps on CPU ranks takes seconds.
SMALL = ["--model.n_layers", "2", "--train.seq_len", "64", "--train.micro_batch_size", "2"]


def test_the_benchmark_scripts_hide_no_installed_package_and_none_hides_them():
    """Test order must not matter: installed packages (transformers imports `kernels`) come before the scripts'
    folder, and no installed package takes a script's name."""
    assert sys.path.index(str(BENCHMARKS)) > max(i for i, p in enumerate(sys.path) if "site-packages" in p)
    for script in BENCHMARKS.glob("*.py"):
        assert Path(importlib.util.find_spec(script.stem).origin) == script


def test_memory_streams_splits_reserved_memory_by_stream_and_names_who_allocated():
    """A snapshot's segments summed per stream; its largest allocations per stream, each size from one place listed
    once, named by the FSDP2 and fsdp_trainer frames only."""
    def frame(path, line, name):
        return {"filename": path, "line": line, "name": name}
    reduce = [frame("/x/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 537, "foreach_reduce"),
              frame("/x/torch/nn/modules/module.py", 1, "_call_impl")]
    snapshot = {"segments": [{"stream": 0, "total_size": 3 * 2**30}, {"stream": 0, "total_size": 2**30},
                             {"stream": 7, "total_size": 2**30}],
                "device_traces": [[
                    {"action": "alloc", "stream": 7, "size": 2**30, "frames": reduce},
                    {"action": "free_completed", "stream": 7, "size": 2**30, "frames": reduce},
                    {"action": "alloc", "stream": 7, "size": 2**30, "frames": reduce},
                    {"action": "alloc", "stream": 7, "size": 2**29, "frames": reduce},
                    {"action": "alloc", "stream": 0, "size": 2**31,
                     "frames": [frame("/r/fsdp_trainer/loss.py", 27, "cross_entropy")]},
                    {"action": "alloc", "stream": 0, "size": 2**20, "frames": []}]]}
    assert reserved_by_stream(snapshot) == {0: (4 * 2**30, 2), 7: (2**30, 1)}
    where = "_fsdp_collectives.py:537:foreach_reduce"
    assert largest_allocations(snapshot, top=8) == {
        7: [(2**30, where), (2**29, where)],
        0: [(2**31, "loss.py:27:cross_entropy"), (2**20, "(no FSDP2 or fsdp_trainer frame)")]}
    assert largest_allocations(snapshot, top=1)[7] == [(2**30, where)]


def test_variant_flags_may_start_with_environment_settings():
    assert parse_variant("compiled opAC 16 NCCL CTAs=NCCL_MAX_CTAS=16 A_B=x=y --ac.mode op") == (
        "compiled opAC 16 NCCL CTAs", {"NCCL_MAX_CTAS": "16", "A_B": "x=y"}, ["--ac.mode", "op"])
    # only leading assignments are environment; a flag's value may hold '='
    assert parse_variant("eager=--ac.mode op --data.path a=b") == (
        "eager", {}, ["--ac.mode", "op", "--data.path", "a=b"])


def test_kernel_totals_group_calls_by_category_and_name():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_256x128", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_256x128", "ts": 200, "dur": 300},
        {"ph": "X", "cat": "kernel", "name": "triton_poi_fused__scaled_dot_product_cudnn_attention_mul", "ts": 0,
         "dur": 5},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 999},
    ]}
    totals = kernel_totals(trace)
    assert totals["matmul"] == {"nvjet_sm90_tst_256x128": [100, 300]}
    assert list(totals["other"]) == ["triton_poi_fused__scaled_dot_product_cudnn_attention_mul"]
    assert "attention" not in totals


def test_kernel_tables_are_per_step_of_the_trace_s_own_window():
    assert steps_in(Path("profile/trace_rank0_steps12-13.json"), None) == 2
    assert steps_in(Path("profile/trace_rank0_steps12-13.json"), 4) == 4  # --steps wins
    assert steps_in(Path("renamed.json"), None) == 1


@pytest.mark.slow
def test_plan_accuracy_runs_each_row_through_the_throughput_runner(monkeypatch, tmp_path, capsys):
    """The matrix script calls throughput.run_variant as that function is now, and reports both errors."""
    import inspect

    import plan_accuracy
    import results
    import throughput

    calls = []

    def fake_run_variant(*args, **kwargs):
        inspect.signature(throughput.run_variant).bind(*args, **kwargs)  # raises on a stale call
        calls.append(args)
        return {"variant": args[0], "planned_peak_gib": 10.0, "measured_peak_gib": 8.0,
                "planned_reserved_gib": 11.0, "mem_reserved_gib": 11.0, "tokens_per_s_per_gpu": 5.0,
                "forward_backward_ms": 900.0}

    monkeypatch.setattr(plan_accuracy, "run_variant", fake_run_variant)
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(plan_accuracy.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(sys, "argv", ["plan_accuracy.py", "--row", "1 tiny=configs/debug.toml --ac.mode op"])
    plan_accuracy.main()
    assert [c[0] for c in calls] == ["tiny"] and calls[0][2] == ["--ac.mode", "op"]
    assert "peak: planned  10.00 GiB, measured   8.00 GiB, +25.0%" in capsys.readouterr().out
    data = json.loads(next(tmp_path.glob("*/plan_accuracy.json")).read_text())
    assert data["gpus"] == 1
    # From step 0 on, its rates and step times would count compilation: the rows hold memory only.
    assert "tokens_per_s_per_gpu" not in data["rows"][0] and "forward_backward_ms" not in data["rows"][0]


def _recorded(gpus: int, *flags: str) -> str:
    return shlex.join(["python3", "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", "-m",
                       "fsdp_trainer.train", "--config", "configs/llama3_8b.toml", "--train.steps", "3",
                       "--train.output_dir", "/tmp/x", *flags])


@pytest.mark.slow  # write_results asks git for the commit
def test_plan_accuracy_held_out_table_marks_fitted_and_held_out_rows_and_the_band_they_set(monkeypatch, tmp_path,
                                                                                           capsys):
    """--heldout runs its rows on one GPU, 3 steps each, and writes one table: the recorded configurations (fitted)
    and its own (held-out), with both errors, each set's worst, and the band the held-out rows set: their worst error
    either way, rounded up to half a percent."""
    import plan_accuracy
    import results

    fitted = {"set": "fitted", "name": "recorded", "gpu": "NVIDIA H200", "gpus": 4, "command": _recorded(4),
              "planned_peak_gib": 9.7, "measured_peak_gib": 10.0, "peak_error_pct": -3.0}
    measured = {"a": (10.0, 10.0, 11.0, 11.0), "b": (10.3, 10.0, 11.0, 11.47)}  # planned, measured peak; reserved

    def fake_run_variant(name, env, flags, args, workdir):
        assert (args.steps, args.nproc) == (3, 1)
        keys = ("planned_peak_gib", "measured_peak_gib", "planned_reserved_gib", "mem_reserved_gib")
        return {"variant": name, "command": _recorded(1, *flags), **dict(zip(keys, measured[name]))}

    monkeypatch.setattr(plan_accuracy, "fitted_rows", lambda: [fitted])
    monkeypatch.setattr(plan_accuracy, "HELD_OUT", ["1 a=configs/debug.toml --ac.mode op",
                                                    "1 b=configs/debug.toml --ac.mode full"])
    monkeypatch.setattr(plan_accuracy, "run_variant", fake_run_variant)
    monkeypatch.setattr(plan_accuracy.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(plan_accuracy.torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["plan_accuracy.py", "--heldout"])
    plan_accuracy.main()
    data = json.loads(next(tmp_path.glob("*/plan_heldout.json")).read_text())
    assert [(r["set"], r["name"]) for r in data["rows"]] == [("fitted", "recorded"), ("held-out", "a"),
                                                             ("held-out", "b")]
    b = data["rows"][2]
    assert b["gpu"] == "NVIDIA H100 80GB HBM3" and b["peak_error_pct"] == pytest.approx(3.0)
    assert b["reserved_error_pct"] == pytest.approx(100 * (11 / 11.47 - 1))  # -4.1%: a band of 4.5%, not 4%
    worst = data["summary"]["worst"]
    assert worst["held-out reserved"]["name"] == "b" and worst["fitted peak"]["error_pct"] == -3.0
    assert data["summary"]["error_band"] == 0.045
    out = capsys.readouterr().out
    assert "worst held-out peak error over 2 configurations: +3.0% (b, NVIDIA H100 80GB HBM3)" in out
    assert "error band the held-out rows set: ±4.5%" in out


def test_plan_accuracy_refuses_a_held_out_row_a_recorded_result_holds(monkeypatch, capsys):
    """Spelled differently (the 8B config's own ac.mode op left out, flags in another order), still the run a
    recorded result measured: not held out, refused before any run."""
    import plan_accuracy

    recorded = {"set": "fitted", "name": "seen", "gpu": "NVIDIA H200", "gpus": 1,
                "command": _recorded(1, "--ac.mode", "op", "--model.n_layers", "4", "--parallel.no_compile")}
    monkeypatch.setattr(plan_accuracy, "fitted_rows", lambda: [recorded])
    monkeypatch.setattr(plan_accuracy, "HELD_OUT", [
        "1 new=configs/llama3_8b.toml --model.n_layers 4 --ac.mode full --parallel.no_compile",
        "1 again=configs/llama3_8b.toml --parallel.no_compile --model.n_layers 4"])
    monkeypatch.setattr(plan_accuracy, "run_variant", lambda *args: pytest.fail("ran"))
    monkeypatch.setattr(sys, "argv", ["plan_accuracy.py", "--heldout"])
    with pytest.raises(SystemExit, match=r"^not held out: again \(a recorded result holds the same configuration\)$"):
        plan_accuracy.main()


@pytest.mark.slow
def test_write_results_records_the_run_gpus_environment_commit_and_a_command_that_reruns_it(monkeypatch, tmp_path):
    import results

    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # changes nothing the results say: not recorded
    argv = ["benchmarks/throughput.py", "--variant", "a b=--ac.mode op"]
    monkeypatch.setattr(sys, "argv", argv)
    data = json.loads(results.write_results("t", [{"variant": "a b"}], gpus=3).read_text())
    assert data["gpus"] == 3 and "gpu_count_visible" not in data
    assert data["environment"]["NCCL_ALGO"] == "Ring" and "OMP_NUM_THREADS" not in data["environment"]
    assert shlex.split(data["command"]) == [f"{k}={v}" for k, v in data["environment"].items()] + [sys.executable,
                                                                                                     *argv]
    assert data["git"] == results.git_revision()
    monkeypatch.setenv("GIT_DIR", str(tmp_path))  # not a repository: the revision is unknown, not an error
    assert json.loads(results.write_results("t", [], gpus=1).read_text())["git"] is None


@pytest.mark.slow
def test_a_recorded_command_runs_in_a_shell_with_its_settings():
    """A setting's value may hold spaces (gpu_check.sh's PROFILE_RUNS): quoted whole, a shell would take the
    setting for the command."""
    from runs import command_line

    line = command_line([sys.executable, "-c", "import os; print(os.environ['RUNS'])"], {"RUNS": "a:b c:d"})
    assert subprocess.run(["bash", "-c", line], capture_output=True, text=True).stdout == "a:b c:d\n"


@pytest.mark.slow
def test_the_recorded_commit_says_when_the_code_that_ran_differs_from_it(tmp_path):
    from results import git_revision

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "sweep.json").write_text("{}")
    git("add", "a.py", "benchmarks")
    git("commit", "-qm", "a")
    (tmp_path / "untracked.json").write_text("{}")
    (results / "sweep.json").write_text('{"rows": []}')  # a sweep rewriting its committed results
    clean = git_revision(tmp_path / "benchmarks")
    assert len(clean) == 40
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_revision(tmp_path / "benchmarks") == clean + "-modified"
    # A copy of the scripts unpacked inside that checkout is none of its commits.
    (tmp_path / "unpacked" / "benchmarks").mkdir(parents=True)
    assert git_revision(tmp_path / "unpacked" / "benchmarks") is None


@pytest.mark.slow
def test_a_tree_unpacked_from_git_archive_records_the_archived_commit(tmp_path):
    from results import git_revision

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path / "repo",
                              check=True, capture_output=True).stdout

    project = Path(__file__).resolve().parent.parent
    for name in (".gitattributes", "benchmarks/archived_commit.txt"):  # this project's, as committed with it
        (tmp_path / "repo" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "repo" / name).write_text((project / name).read_text())
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "a")
    assert git_revision(tmp_path / "repo" / "benchmarks") == git("rev-parse", "HEAD").decode().strip()
    (tmp_path / "unpacked").mkdir()
    subprocess.run(["tar", "-x", "-C", str(tmp_path / "unpacked")], input=git("archive", "HEAD"), check=True)
    assert git_revision(tmp_path / "unpacked" / "benchmarks") == git("rev-parse", "HEAD").decode().strip()
    # A plain copy keeps the stamp unsubstituted and names no commit.
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "archived_commit.txt").write_text((project / "benchmarks/archived_commit.txt").read_text())
    assert git_revision(tmp_path / "copy") is None


@pytest.mark.slow
def test_error_line_is_the_childs_error_not_torchruns_summary():
    from runs import error_line

    stderr = ("[rank0] 12:00:00 step 2/6 | loss 5.2\n"
              "error: train.micro_batch_size=0: must be at least 1\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
              "============================================================\n"
              "  error_file: <N/A>\n"
              "============================================================\n")
    assert error_line(subprocess.CompletedProcess([], 1, "", stderr)) == \
        "error: train.micro_batch_size=0: must be at least 1"
    assert error_line(subprocess.CompletedProcess([], 1, "", "=====\n")) == \
        "exit status 1, no error in its output"


# The bad flags' cases: the flags, and the error line read from tyro's message about them.
BAD_FLAGS = {"choice": (["--ac.mode", "bogus"], "invalid choice 'bogus' for argument '--ac.mode'. Expected one of "
                                                "('none', 'full', 'selective', 'op')."),
             "unknown": (["--train.stepz", "3"], "Unrecognized options: --train.stepz, 3")}


@pytest.mark.parametrize("case", BAD_FLAGS)
def test_error_line_reads_tyros_message_about_a_bad_flag(monkeypatch, capfd, case):
    """tyro draws its message in a box, wrapped over several lines, with no line that says "error:"."""
    from runs import error_line

    from fsdp_trainer import train

    monkeypatch.setenv("COLUMNS", "60")  # narrow: the message wraps
    with pytest.raises(SystemExit) as exited:
        train.main(BAD_FLAGS[case][0])
    out, err = capfd.readouterr()
    assert exited.value.code == 2 and error_line(subprocess.CompletedProcess([], 2, out, err)) == BAD_FLAGS[case][1]


def test_steady_state_counts_windows_from_warmup_on_over_all_their_steps():
    from throughput import steady_state

    rows = [{"step": 2, "tokens_per_s_per_gpu": 10.0, "forward_backward_ms": 900.0},  # compiling
            {"step": 4, "tokens_per_s_per_gpu": 1000.0, "forward_backward_ms": 40.0},  # starts at 2 < warmup 3
            {"step": 8, "tokens_per_s_per_gpu": 2000.0, "forward_backward_ms": 10.0},
            {"step": 9, "tokens_per_s_per_gpu": 1000.0, "forward_backward_ms": 20.0}]
    averaged = steady_state(rows, warmup=3)
    # 5 steps in 4/2000 + 1/1000 units of time; the ms per step are 4 steps at 10 and 1 at 20.
    assert averaged["tokens_per_s_per_gpu"] == pytest.approx(5 / (4 / 2000 + 1 / 1000))
    assert averaged["forward_backward_ms"] == pytest.approx(12.0)
    with pytest.raises(ValueError, match="no logging window starts at or after step 9"):
        steady_state(rows, warmup=9)
    # An evaluation's row after a logged step (its time already left out of the next rate) changes no window.
    evaluated = rows[:2] + [{"step": 4, "val/tokens_per_s_per_gpu": 5000.0}] + rows[2:]
    assert steady_state(evaluated, warmup=3) == averaged


def test_window_arguments_are_refused_exactly_where_no_window_would_count():
    """For each --steps, --log-every and --warmup: refused up front if, and only if, steady_state would find no
    window to average in the rows the trainer logs (every log_every steps, and the last step)."""
    import argparse

    from throughput import add_window_arguments, check_windows, steady_state

    parser = argparse.ArgumentParser()
    add_window_arguments(parser)
    for steps, log_every, warmup in itertools.product((1, 4, 5, 8), (1, 2, 3, 5), (0, 1, 2, 3, 4, 5, 8)):
        args = parser.parse_args(["--steps", str(steps), "--log-every", str(log_every), "--warmup", str(warmup)])
        logged = [{"step": s, "tokens_per_s_per_gpu": 1.0} for s in range(1, steps + 1)
                  if s % log_every == 0 or s == steps]
        try:
            steady_state(logged, warmup)
        except ValueError:
            with pytest.raises(SystemExit):
                check_windows(parser, args)
        else:
            check_windows(parser, args)


@pytest.mark.parametrize("script", ["throughput", "scaling"])
def test_a_warmup_no_window_outlasts_is_refused_before_any_run(script, monkeypatch, capsys):
    module = __import__(script)
    monkeypatch.setattr(module, "run_variant", lambda *args: pytest.fail("trained before refusing"))
    variants = ["--variant", "a="] if script == "throughput" else []
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--config", "configs/debug.toml", *variants, "--steps", "4",
                                      "--log-every", "2", "--warmup", "4"])
    with pytest.raises(SystemExit) as exited:
        module.main()
    assert exited.value.code == 2
    assert "--warmup 4: a logging window must start at or after it and end by --steps 4, and windows start at " \
        "multiples of --log-every 2: lower --warmup to 2 or less, or raise --steps above 4" in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_that_logged_no_window_after_warmup_is_a_failed_row_and_the_sweep_goes_on(monkeypatch, tmp_path):
    """A run that stopped early (a stop signal, say) logged fewer windows than its arguments promised."""
    import results
    import throughput

    def stopped_after_step_2(cmd, env):
        out = Path(cmd[cmd.index("--train.output_dir") + 1])
        out.mkdir(parents=True)
        (out / "metrics.jsonl").write_text(json.dumps({"step": 2, "tokens_per_s_per_gpu": 1.0}) + "\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(throughput, "run", stopped_after_step_2)
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["throughput.py", "--config", "configs/debug.toml", "--steps", "4",
                                      "--log-every", "2", "--warmup", "2", "--variant", "a=", "--variant", "b="])
    with pytest.raises(SystemExit, match="2 of 2 runs failed"):
        throughput.main()
    rows = written(tmp_path, "throughput")["rows"]
    assert [r["variant"] for r in rows] == ["a", "b"]
    assert all(r["error"].startswith("no logging window starts at or after step 2") for r in rows)


@pytest.mark.slow
def test_windows_holding_profiled_steps_are_left_out_and_the_profile_is_recorded(monkeypatch, tmp_path):
    """--profile.steps in a variant: the window of the profiled steps also holds the profiler's overhead and the
    seconds of writing its trace (on CPU ranks: 25 tokens/s there against 500-1,000 in the other windows)."""
    import results
    import throughput

    def profiled_run(cmd, env):
        out = Path(cmd[cmd.index("--train.output_dir") + 1])
        out.mkdir(parents=True)
        rates = {2: 10.0, 4: 1000.0, 6: 1000.0, 8: 20.0, 10: 1000.0}  # compiling, steady, steady, profiled, steady
        (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "tokens_per_s_per_gpu": r}) + "\n"
                                                   for s, r in rates.items()))
        stderr = ("[rank0] 14:31:16 profile of steps 7-8 written to /tmp/x/profile/trace_rank0_steps7-8.json; per "
                  "step: matmul 559.0 ms | communication 254.0 ms | exposed_communication 13.6 ms\n")
        return subprocess.CompletedProcess(cmd, 0, "", stderr)

    monkeypatch.setattr(throughput, "run", profiled_run)
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["throughput.py", "--config", "configs/debug.toml", "--steps", "10",
                                      "--log-every", "2", "--warmup", "2", "--variant", "a=--profile.steps 7:8"])
    throughput.main()
    (row,) = written(tmp_path, "throughput")["rows"]
    assert row["tokens_per_s_per_gpu"] == pytest.approx(1000.0)
    assert row["profile_ms"] == {"matmul": 559.0, "communication": 254.0, "exposed_communication": 13.6}
    with pytest.raises(ValueError, match="holds none of the profiled steps 3-10"):
        throughput.steady_state([{"step": s, "tokens_per_s_per_gpu": 1.0} for s in (2, 4, 6, 8, 10)], 2, (3, 10))


def run_script(script: str, *args: str, results_dir: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """A benchmark script run as a user runs it, from the repository root, writing its results under results_dir."""
    return subprocess.run([sys.executable, f"benchmarks/{script}", *args], cwd=ROOT, text=True, capture_output=True,
                          timeout=timeout, env={**os.environ, "BENCH_RESULTS_DIR": str(results_dir)})


def written(results_dir: Path, name: str) -> dict:
    (path,) = results_dir.glob(f"*/{name}.json")
    return json.loads(path.read_text())


def scaling_run(tmp_path: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """test_scaling_runs_one_and_two_ranks_with_the_smallest_as_baseline's run: (its results folder, the run)."""
    return tmp_path, run_script("scaling.py", "--config", "configs/debug.toml", "--gpus", "2", "1", "--steps", "4",
                                "--log-every", "2", "--warmup", "2", "--", *SMALL, results_dir=tmp_path)


@pytest.mark.slow
def test_scaling_runs_one_and_two_ranks_with_the_smallest_as_baseline(script_run):
    results, proc = script_run.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = written(results, "scaling_debug")
    assert data["gpus"] == 2
    one, two = data["rows"]
    assert (one["gpus"], two["gpus"]) == (1, 2) and one["efficiency"] == 1.0
    assert two["efficiency"] == pytest.approx(two["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"])


@pytest.mark.slow
def test_host_adamw_times_ranks_stepping_together_on_their_share_of_the_cores(tmp_path):
    proc = run_script("host_adamw.py", "--ranks", "1", "2", "--threads", "0", "--numel", "1048576", "--steps", "2",
                      results_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = written(tmp_path, "host_adamw")["rows"]
    assert [(r["ranks"], r["threads"]) for r in rows] == [(1, "share"), (2, "share")]
    cores = len(os.sched_getaffinity(0))
    assert [r["threads_per_rank"] for r in rows] == [cores, max(1, cores // 2)]
    for r in rows:
        assert r["gb_per_s_per_rank"] == pytest.approx(28 * 1048576 / r["ms_per_step"] / 1e6, rel=0.05)
        assert r["gb_per_s_total"] == pytest.approx(r["ranks"] * r["gb_per_s_per_rank"], abs=0.11)


@pytest.mark.slow
def test_scaling_names_the_counts_it_skips(monkeypatch, tmp_path, capsys):
    import results
    import scaling

    ran = []

    def fake_run_variant(name, env, overrides, args, workdir):
        ran.append(args.nproc)
        return {"variant": name, "tokens_per_s_per_gpu": 1.0}

    monkeypatch.setattr(scaling, "run_variant", fake_run_variant)
    monkeypatch.setattr(scaling.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["scaling.py", "--config", "configs/debug.toml", "--gpus", "1", "2", "4", "8"])
    scaling.main()
    assert ran == [1, 2]
    assert "skipped --gpus 4 8: more than the 2 GPUs here" in capsys.readouterr().out


def test_ddp_gets_the_configs_ac_compile_and_compute_dtype(monkeypatch):
    import fsdp_vs_ddp

    from fsdp_trainer import distributed
    from fsdp_trainer.config import parse_args

    applied = []
    monkeypatch.setattr(fsdp_vs_ddp, "apply_ac", lambda model, blocks, mode, every: applied.append(("ac", mode)))
    monkeypatch.setattr(fsdp_vs_ddp, "apply_compile", lambda model, blocks: applied.append(("compile",)))
    cfg = parse_args(["--config", str(ROOT / "configs/debug.toml"), *SMALL, "--ac.mode", "op", "--parallel.compile",
                      "--parallel.param_dtype", "float16"])
    info = distributed.init()  # a one-rank gloo group of this process
    try:
        model, _, autocast = fsdp_vs_ddp.prepare("ddp", cfg, info)
    finally:
        distributed.shutdown()
    assert applied == [("ac", "op"), ("compile",)]
    assert autocast.fast_dtype == torch.float16  # the config's, not a fixed bf16


def fsdp_and_ddp_run(tmp_path: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """test_fsdp_and_ddp_train_alike_on_two_cpu_ranks's run: (its results folder, the run)."""
    return tmp_path, run_script("fsdp_vs_ddp.py", "--config", "configs/debug.toml", "--nproc", "2", "--steps", "3",
                                "--warmup", "1", "--", *SMALL, "--ac.mode", "full", "--train.grad_accum_steps", "2",
                                "--parallel.defer_grad_sync", results_dir=tmp_path)


@pytest.mark.slow
def test_fsdp_and_ddp_train_alike_on_two_cpu_ranks(script_run):
    """Also with gradient sync deferred to the last micro-batch, which DDP does as no_sync()."""
    results, proc = script_run.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    fsdp, ddp = written(results, "fsdp_vs_ddp")["rows"]
    assert (fsdp["mode"], ddp["mode"]) == ("fsdp", "ddp")
    assert fsdp["loss"] == pytest.approx(ddp["loss"], rel=1e-4)  # same weights, data, AC and arithmetic


def test_ddp_does_not_broadcast_its_buffers_every_forward():
    """Its only buffer, RoPE's table, is computed alike on every rank; FSDP2 does not broadcast it either."""
    import fsdp_vs_ddp

    from fsdp_trainer import distributed
    from fsdp_trainer.config import parse_args

    info = distributed.init()  # a one-rank gloo group of this process
    try:
        model, _, _ = fsdp_vs_ddp.prepare("ddp", parse_args(["--config", str(ROOT / "configs/debug.toml"), *SMALL]),
                                          info)
    finally:
        distributed.shutdown()
    assert [name for name, _ in model.named_buffers()] and not model.will_sync_module_buffers()


def loader_workers_run(tmp_path: Path) -> tuple[subprocess.CompletedProcess, str, list[str]]:
    """test_fsdp_vs_ddp_worker_leaves_no_loader_worker_running's run: (the run, its log, the command lines of the
    processes it left running)."""
    from runs import torchrun

    marker = f"FSDP_VS_DDP_TEST={tmp_path}".encode()  # in the environment of every process of this run
    with (tmp_path / "log").open("w") as log:
        proc = subprocess.run([*torchrun(2), "benchmarks/fsdp_vs_ddp.py", "--worker", "fsdp", "--config",
                               "configs/debug.toml", "--steps", "2", "--warmup", "1", "--", *SMALL,
                               "--data.num_workers", "2"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              timeout=120, env={**os.environ, "FSDP_VS_DDP_TEST": str(tmp_path)})
    left = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in environ.read_bytes().split(b"\0"):
                left.append((environ.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:  # ended meanwhile, or another user's
            pass
    return proc, (tmp_path / "log").read_text(), left


@pytest.mark.slow
def test_fsdp_vs_ddp_worker_leaves_no_loader_worker_running(script_run):
    """A loader worker ignores SIGTERM and notices only within 5 s that its rank is gone: left running, it holds the
    output pipes that the launcher (runs.run) reads to their end, delaying each run by as much. Here the ranks write
    to a file, so torchrun returns as they exit, and whatever they left is still there to find."""
    proc, log, left = script_run.result()
    assert proc.returncode == 0, log[-3000:]
    assert left == []


@pytest.mark.parametrize("flags,bf16,error", [
    (["--train.micro_batch_size", "0"], True, "train.micro_batch_size=0: must be at least 1"),  # the trainer's
    (["--parallel.cpu_offload"], True, "parallel.cpu_offload"),
    ([], False, "parallel.param_dtype=auto computes in float16"),  # a GPU without bfloat16
])
def test_fsdp_vs_ddp_refuses_a_config_before_any_run(flags, bf16, error, monkeypatch, capsys):
    """As on a GPU: on the CPU the trainer's own checks refuse float16 and CPU offload first."""
    import fsdp_vs_ddp

    monkeypatch.setattr(fsdp_vs_ddp, "run", lambda cmd: pytest.fail("launched a run"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation: bf16)
    monkeypatch.setattr(sys, "argv", ["fsdp_vs_ddp.py", "--config", str(ROOT / "configs/debug.toml"), "--", *flags])
    with pytest.raises(SystemExit) as exit_:
        fsdp_vs_ddp.main()
    assert exit_.value.code == 2 and f"error: {error}" in capsys.readouterr().err


@pytest.mark.slow
def test_fsdp_vs_ddp_counts_a_worker_that_failed_after_reporting_as_failed(monkeypatch, tmp_path):
    import fsdp_vs_ddp
    import results

    def worker(cmd):
        mode = cmd[cmd.index("--worker") + 1]
        stdout = 'RESULT {"mode": "%s", "tokens_per_s_per_gpu": 1.0}\n' % mode
        if mode == "fsdp":
            return subprocess.CompletedProcess(cmd, 0, stdout, "")
        return subprocess.CompletedProcess(cmd, 1, stdout, "RuntimeError: [rank1] hung up while shutting down\n")

    monkeypatch.setattr(fsdp_vs_ddp, "run", worker)
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["fsdp_vs_ddp.py", "--config", str(ROOT / "configs/debug.toml")])
    with pytest.raises(SystemExit, match="1 of 2 runs failed"):
        fsdp_vs_ddp.main()
    fsdp, ddp = written(tmp_path, "fsdp_vs_ddp")["rows"]
    assert "error" not in fsdp
    assert ddp == {"mode": "ddp", "tokens_per_s_per_gpu": 1.0,
                   "error": "RuntimeError: [rank1] hung up while shutting down"}


def checkpoint_io_runs(tmp_path: Path) -> tuple[Path, subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """test_checkpoint_io_loads_from_disk_and_records_a_failed_run's runs: (their folder, with and without
    checksums, with a bad flag)."""
    args = ["--config", "configs/debug.toml", "--modes", "none", "--steps", "5", "--interval", "3", "--dir",
            str(tmp_path / "ckpt"), "--", *SMALL]
    (tmp_path / "ckpt").mkdir()
    return (tmp_path, run_script("checkpoint_io.py", *args[:-len(SMALL) - 1], "--checksums", "on", "off", "--", *SMALL,
                                 results_dir=tmp_path / "ok"),
            run_script("checkpoint_io.py", *args, "--train.micro_batch_size", "0", results_dir=tmp_path / "bad"))


@pytest.mark.slow
def test_checkpoint_io_loads_from_disk_and_records_a_failed_run(script_run):
    """Saves at step 3 and the last, 5; the resume to step 6 saves nothing, though the interval divides 6. With
    checksums, the resume checks them first (timed); without, it has none to check."""
    tmp_path, proc, failed = script_run.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    summed, unsummed = written(tmp_path / "ok", "checkpoint_io_debug")["rows"]
    for row in (summed, unsummed):
        assert row["saves"] == 2 and row["load_s"] > 0 and row["load_page_cache_dropped_gb"] > 0
    assert summed["checksums"] and summed["check_s"] >= 0 and not unsummed["checksums"] and "check_s" not in unsummed
    assert unsummed["label"] == "none, 4 threads, no checksums"
    assert "checkpoint step 6" not in proc.stderr and "step 6/6" in proc.stderr  # the resumed run's log's end
    assert failed.returncode == 1
    (row,) = written(tmp_path / "bad", "checkpoint_io_debug")["rows"]
    assert row["error"] == "error: train.micro_batch_size=0: must be at least 1" and "saves" not in row


SAVED_LOG = ("[rank0] 14:00:00 checkpoint step 3 (none): training blocked 0.20 s\n"
             "[rank0] 14:00:01 checkpoint /c/step_3 complete: 0.012 GB in 0.20 s (0.06 GB/s; training blocked "
             "0.20 s)\n")
LOADED_LOG = "[rank0] 14:00:02 loaded /c/step_3: 0.012 GB in 0.10 s (0.12 GB/s)\n"
CHECKED_LOG = ("[rank0] 14:00:02 checked /c/step_3: 3 files (0.012 GB) match their checksums (.metadata and 2 data "
               "files checked by this process in 0.05 s)\n")


@pytest.mark.slow
@pytest.mark.parametrize("saved,resumed,error", [
    ("", "[rank0] no complete checkpoint in /c: starting fresh\n", "no save completed in 3 steps"),
    (SAVED_LOG, "[rank0] no complete checkpoint in /c: starting fresh\n", "resume: no checkpoint loaded"),
    (SAVED_LOG, LOADED_LOG, "resume: no checksums checked"),  # committed without sums: not a load with the check
    (SAVED_LOG, CHECKED_LOG + LOADED_LOG, None),
])
def test_checkpoint_io_fails_a_row_whose_runs_saved_loaded_or_checked_nothing(saved, resumed, error, monkeypatch,
                                                                             tmp_path):
    """Both runs exit 0: with --interval above --steps and no final save, the resume starts fresh, and the row
    held nothing but its label."""
    import argparse

    import checkpoint_io

    logs = iter([saved, resumed])
    monkeypatch.setattr(checkpoint_io, "run", lambda cmd: subprocess.CompletedProcess(cmd, 0, "", next(logs)))
    args = argparse.Namespace(nproc=1, config="configs/debug.toml", steps=3, interval=5, extra=[])
    row = checkpoint_io.measure(args, "none", 4, "on", tmp_path)
    assert row.get("error", "").startswith(error) if error else "error" not in row
    if not error:
        assert (row["save_s"], row["load_s"], row["check_s"]) == (0.2, 0.1, 0.05)


def test_page_cache_drop_flushes_each_file_before_evicting_it(monkeypatch, tmp_path):
    import checkpoint_io

    (tmp_path / "step_2").mkdir()
    for name in ("step_2/__0_0.distcp", "step_2/.metadata"):
        (tmp_path / name).write_bytes(b"x" * 1000)
    calls = []
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))))
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: calls.append(
        ("fadvise", os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice)))
    assert checkpoint_io.drop_from_page_cache(tmp_path) == 2000
    for name in ("step_2/__0_0.distcp", "step_2/.metadata"):
        path = str(tmp_path / name)
        at = calls.index(("fsync", path))
        assert calls[at + 1] == ("fadvise", path, 0, 0, os.POSIX_FADV_DONTNEED)


@pytest.mark.slow
def test_collectives_reads_the_doctors_last_line_and_records_every_failure():
    from collectives import bare_row, doctor_rows

    report = {"ok": False, "checks": [{"name": "all_reduce", "ok": True}, {"name": "all_gather", "ok": False}],
              "bandwidth": [{"op": "all_reduce", "bytes": 1024, "busbw_gbps": 1.0}]}
    # NCCL_DEBUG=INFO writes to stdout too
    doctor = subprocess.CompletedProcess([], 1, "node:1:1 [0] NCCL INFO Bootstrap\n" + json.dumps(report) + "\n", "")
    assert doctor_rows(doctor) == [{"source": "doctor", "ok": False, "failed_checks": ["all_gather"],
                                    "error": "failed checks: all_gather", "op": "all_reduce", "bytes": 1024,
                                    "busbw_gbps": 1.0}]
    crashed = subprocess.CompletedProcess([], 1, "", "RuntimeError: NCCL error: unhandled system error\n=====\n")
    assert doctor_rows(crashed) == [{"source": "doctor", "ok": False,
                                     "error": "RuntimeError: NCCL error: unhandled system error"}]
    # Every check passed, yet the doctor exited 1 (a rank that died at exit): a failed run too.
    passed = {**report, "ok": True, "checks": report["checks"][:1]}
    died = subprocess.CompletedProcess([], 1, json.dumps(passed) + "\n", "RuntimeError: rank 1 died\n")
    assert doctor_rows(died)[0]["error"] == "RuntimeError: rank 1 died"
    assert bare_row(crashed)["error"] == "RuntimeError: NCCL error: unhandled system error"
    measured = 'RESULT {"busbw_gbps": 300.0}\n'
    assert bare_row(subprocess.CompletedProcess([], 0, measured, ""))["busbw_gbps"] == 300.0
    # rank 0 reported, then the group failed
    failed = bare_row(subprocess.CompletedProcess([], 1, measured, "RuntimeError: NCCL error: remote process exited\n"))
    assert failed["busbw_gbps"] == 300.0 and failed["error"] == "RuntimeError: NCCL error: remote process exited"


def collectives_run(tmp_path: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """test_collectives_fails_when_the_doctors_checks_fail's run: (its results folder, the run)."""
    return tmp_path, subprocess.run([sys.executable, "benchmarks/collectives.py", "--nproc", "2"], cwd=ROOT, text=True,
                                    capture_output=True, timeout=120,
                                    env={**os.environ, "BENCH_RESULTS_DIR": str(tmp_path), FAULT_VAR: "wrong:rank=1"})


@pytest.mark.slow
def test_collectives_fails_when_the_doctors_checks_fail(script_run):
    """The doctor on two gloo ranks, rank 1 contributing wrong data: its row holds the checks that failed as the
    error. (On CPU the bare NCCL loop cannot run at all: its row fails too.)"""
    results, proc = script_run.result()
    assert proc.returncode == 1, proc.stderr[-3000:]
    doctor = written(results, "collectives")["rows"][0]
    assert doctor["source"] == "doctor" and not doctor["ok"]
    assert doctor["error"] == f"failed checks: {', '.join(doctor['failed_checks'])}" and doctor["failed_checks"]


def test_attention_times_each_step_from_fresh_gradients():
    import torch.nn.functional as F
    from attention import fwd_bwd

    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), None)
    once = q.grad.clone()
    fwd_bwd(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), None)
    assert torch.equal(q.grad, once)


@pytest.mark.slow
@pytest.mark.parametrize("failing", [None, "flash"])
def test_attention_fails_on_any_error_but_the_known_missing_gqa_kernel(failing, monkeypatch, tmp_path):
    """SDPA as on a GPU, run on the CPU: the memory-efficient backend has no kernel for grouped KV heads (the row's
    answer, not a failure), and the `failing` backend runs out of memory (a failure)."""
    import contextlib
    import types

    import attention
    import results

    backends = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def gpu_sdpa(q, k, v, is_causal, enable_gqa=False):
        chosen = backends[-1] if backends else None
        if chosen == attention.BACKENDS["efficient"] and enable_gqa:
            raise RuntimeError("No available kernel. Aborting execution.\n(details)")
        if failing and chosen == attention.BACKENDS[failing]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return sdpa(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa)

    @contextlib.contextmanager
    def sdpa_kernel(chosen):
        backends.extend(chosen)
        yield
        backends.pop()

    def time_ms(fn):
        fn()
        return 1.0

    randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *shape, device, **kwargs: randn(*shape, **kwargs))  # on the CPU
    monkeypatch.setattr(attention, "F", types.SimpleNamespace(scaled_dot_product_attention=gpu_sdpa))
    monkeypatch.setattr(attention, "sdpa_kernel", sdpa_kernel)
    monkeypatch.setattr(attention, "time_ms", time_ms)
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["attention.py", "--seq", "8"])
    if failing:
        with pytest.raises(SystemExit, match="2 of 8 runs failed"):
            attention.main()
    else:
        attention.main()
    rows = {(r["layout"], r["backend"]): r for r in written(tmp_path, "attention")["rows"]}
    assert rows[attention.GQA, "efficient"] == {"layout": attention.GQA, "backend": "efficient",
                                                 "no_kernel": "No available kernel. Aborting execution."}
    assert [key for key, r in rows.items() if "error" in r] == ([(attention.GQA, failing), ("expanded kv", failing)]
                                                                if failing else [])


def gpu_check(tmp_path: Path, *args: str, results_dir: Path | None = None,
              env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    """gpu_check.sh with stand-ins for nvidia-smi and python3, from an empty folder: python3 logs its arguments and
    succeeds, except that pytest and the trainer fail (the trainer out of memory), and benchmarks/results.py and
    kernel_table.py run for real. (the run, python3's calls)"""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA Test GPU'\n")
    (bin_dir / "python3").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n'
                                     'case "$*" in *pytest*) exit 1 ;;\n'
                                     '  *fsdp_trainer.train*) echo "torch.OutOfMemoryError: CUDA out of memory"; '
                                     'exit 1 ;;\n'
                                     '  benchmarks/results.py*|benchmarks/kernel_table.py*) '
                                     f'cd {ROOT} && exec {sys.executable} "$@" ;; esac\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if k not in ("BENCH_RESULTS_DIR", "PYTORCH_CUDA_ALLOC_CONF")}
    if results_dir:
        environ["BENCH_RESULTS_DIR"] = str(results_dir)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_check.sh"), *args], cwd=tmp_path, text=True,
                          env={**environ, **(env or {}), "PATH": f"{bin_dir}:{environ['PATH']}"}, capture_output=True,
                          timeout=60)
    calls = tmp_path / "calls"
    return proc, calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.slow
def test_gpu_check_runs_every_part_after_a_failure_and_exits_non_zero(tmp_path):
    """The failed part is reported, later parts still run, and one GPU gets no 2-rank collectives."""
    proc, calls = gpu_check(tmp_path, "1", "tests", "collectives")
    assert proc.returncode == 1 and "FAILED: tests" in proc.stdout
    assert [c for c in calls if "collectives.py" in c] == ["benchmarks/collectives.py --nproc 1"]


@pytest.mark.slow
def test_gpu_check_refuses_an_unknown_part_before_running_any(tmp_path):
    proc, calls = gpu_check(tmp_path, "1", "plan", "bogus")
    assert proc.returncode == 2 and "unknown part: bogus (the parts: tests collectives" in proc.stdout, proc.stdout
    assert calls == []


@pytest.mark.slow
@pytest.mark.parametrize("ngpu,counts", [("1", "1"), ("2", "1 2"), ("3", "1 2 3"), ("4", "1 2 4"), ("8", "1 2 4 8")])
def test_gpu_check_scales_weakly_up_to_the_gpus_it_was_given(ngpu, counts, tmp_path):
    proc, calls = gpu_check(tmp_path, ngpu, "small")
    assert proc.returncode == 0, proc.stdout
    (scaling,) = [c for c in calls if "scaling.py" in c]
    assert f" --gpus {counts} --steps" in scaling


def own_files_run(tmp_path: Path) -> Path:
    """test_gpu_check_s_own_files_start_with_what_the_json_files_record's run: its results folder."""
    gpu_check(tmp_path, "1", "profile", results_dir=tmp_path / "results")
    return tmp_path / "results"


@pytest.mark.slow
def test_gpu_check_s_own_files_start_with_what_the_json_files_record(script_run):
    """The header of profile_llama3_8b.log: the commit, torch and CUDA, and the environment gpu_check.sh exports
    in the command. (The stand-in python3 trains nothing, so the profile part itself fails.)"""
    from results import git_revision

    results = script_run.result()
    (log,) = results.glob("*x1/profile_llama3_8b.log")
    header = log.read_text().splitlines()[0]
    assert header.startswith("# ") and f"torch {torch.__version__}, CUDA {torch.version.cuda}" in header
    assert f"commit {git_revision()}: " in header
    command = shlex.split(header.partition(f"commit {git_revision()}: ")[2])
    assert {"NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1",
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"} <= set(command)
    assert command[-5:] == ["PROFILE_RUNS=no_compile:op compile:op", "bash", "benchmarks/gpu_check.sh", "1", "profile"]


def profile_runs(tmp_path: Path) -> Path:
    """test_gpu_check_s_profile_log_holds_this_run_only_and_why_it_failed's runs: their results folder."""
    import shutil

    runs = f"no_compile:test{os.getpid()}"
    stale = Path(f"/tmp/profile_no_compile_test{os.getpid()}/profile/trace_rank0_steps12-13.json")
    try:
        for _ in range(2):
            stale.parent.mkdir(parents=True, exist_ok=True)
            stale.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "nvjet_stale",
                                                          "ts": 0, "dur": 5}]}))
            proc, _ = gpu_check(tmp_path, "1", "profile", results_dir=tmp_path / "results",
                                env={"PROFILE_RUNS": runs})
            assert proc.returncode == 1
    finally:
        shutil.rmtree(stale.parents[1], ignore_errors=True)
    return tmp_path / "results"


@pytest.mark.slow
def test_gpu_check_s_profile_log_holds_this_run_only_and_why_it_failed(script_run):
    """Run twice, each time out of memory: the log starts with the second run's header (it was appended to), holds no
    kernels of a trace an earlier run left in the run's folder, and says why the run failed (grep kept only the
    profile's lines)."""
    (log,) = script_run.result().glob("*x1/profile_llama3_8b_*.log")
    text = log.read_text()
    assert [line for line in text.splitlines() if line.startswith("# ")] == [text.splitlines()[0]]
    assert "nvjet_stale" not in text and "CUDA out of memory" in text


def clocks_run(tmp_path: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """test_gpu_check_s_clocks_log_says_why_a_run_failed's run: (its results folder, the run)."""
    try:
        proc, _ = gpu_check(tmp_path, "1", "clocks", results_dir=tmp_path / "results")
    finally:
        for ac in ("none", "op", "full"):  # the part's samples of nvidia-smi, here its stand-in's
            Path(f"/tmp/clocks_{ac}.csv").unlink(missing_ok=True)
    return tmp_path / "results", proc


@pytest.mark.slow
def test_gpu_check_s_clocks_log_says_why_a_run_failed(script_run):
    results, proc = script_run.result()
    assert proc.returncode == 1
    (log,) = results.glob("*x1/clocks_llama3_8b.txt")
    assert log.read_text().count("CUDA out of memory") == 3  # no, per-op and full AC


@pytest.fixture(scope="module")
def script_runs(request, tmp_path_factory):
    """The runs of the scripts this module's tests launch, two at a time, longest first: most of a run is one
    process importing torch or training on one core, while the other core would stay idle. Keyed by test name."""
    runs = {node_name(test): partial(run, tmp_path_factory.mktemp(test.__name__[:30]))  # named as pytest would
            for test, run in [(test_checkpoint_io_loads_from_disk_and_records_a_failed_run, checkpoint_io_runs),
                              (test_scaling_runs_one_and_two_ranks_with_the_smallest_as_baseline, scaling_run),
                              (test_fsdp_and_ddp_train_alike_on_two_cpu_ranks, fsdp_and_ddp_run),
                              (test_gpu_check_s_profile_log_holds_this_run_only_and_why_it_failed, profile_runs),
                              (test_collectives_fails_when_the_doctors_checks_fail, collectives_run),
                              (test_fsdp_vs_ddp_worker_leaves_no_loader_worker_running, loader_workers_run),
                              (test_gpu_check_s_own_files_start_with_what_the_json_files_record, own_files_run),
                              (test_gpu_check_s_clocks_log_says_why_a_run_failed, clocks_run)]}
    return side_by_side(request, runs, at_once=2)


@pytest.fixture
def script_run(script_runs, request):
    """This test's run, which script_runs made: .result() is what its function returned, or raises what it raised."""
    return script_runs[request.node.name]
