"""How the benchmarks launch their runs and read back what each reported, or why it failed."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from typing import Optional

RESULT = "RESULT "
"""The prefix of the stdout line on which a benchmark's own worker reports its result as JSON."""

NO_CHECKPOINTS = ["--checkpoint.interval", "0", "--checkpoint.resume", "none", "--checkpoint.no_save_final"]
"""Trainer flags for a run that neither resumes nor saves: a measurement starts fresh and pays for no checkpoint."""

ENV_ASSIGNMENT = re.compile(r"[A-Z_][A-Z0-9_]*=")
"""A NAME=value word before a command: a setting of the command's environment."""

# What a failed child's output says about why; torchrun ends with its own ChildFailedError and a banner, which
# say only that a child failed.
ERROR = re.compile(r"Error|error:|out of memory")
# tyro reports a bad flag in a box, not on an error line: a title ("Invalid choice", "Value error"), then the
# message, wrapped over the box's lines, up to a rule or the box's end.
TYRO_BOX = re.compile(r"^╭─ .+ ─+╮$\n(?P<body>(?:^│(?! ─).*$\n)*)", re.MULTILINE)


def torchrun(nproc: int) -> list[str]:
    # --standalone: a private rendezvous on a free port, so that runs side by side on one machine never collide.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def train_command(nproc: int, config: str, *flags: str) -> list[str]:
    return [*torchrun(nproc), "-m", "fsdp_trainer.train", "--config", config, "--metrics.no_tensorboard", *flags]


def split_environment(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """(the leading NAME=value words, the command after them), as a shell reads a command line."""
    env, rest = {}, list(words)
    while rest and ENV_ASSIGNMENT.match(rest[0]):
        key, _, value = rest.pop(0).partition("=")
        env[key] = value
    return env, rest


def command_line(cmd: list[str], env: Optional[dict[str, str]] = None) -> str:
    """The command as a shell runs it, after the environment settings it needs. Only a setting's value is quoted:
    a shell takes a quoted name (`'A=b c' cmd`) for the command itself."""
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()] + [shlex.join(cmd)])


def run(cmd: list[str], env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run a child with `env` added to ours and its output captured; show the command, then the end of its log (its
    last steps, or how it failed)."""
    print("$", command_line(cmd, env), flush=True)
    proc = subprocess.run(cmd, text=True, capture_output=True,
                          env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})
    sys.stderr.write(proc.stderr[-3000:])
    return proc


def error_line(proc: subprocess.CompletedProcess) -> str:
    """Why a child failed: tyro's message about a bad flag, else the last line of its output that names an
    error."""
    output = proc.stdout + proc.stderr
    boxes = list(TYRO_BOX.finditer(output))
    if boxes:
        lines = (line.strip("│ ") for line in boxes[-1]["body"].splitlines())
        return " ".join(line for line in lines if line)
    lines = [line.strip() for line in output.splitlines() if ERROR.search(line) and "ChildFailedError" not in line]
    return lines[-1] if lines else f"exit status {proc.returncode}, no error in its output"


def emit(result: dict) -> None:
    """Report a worker's result to the script that launched it (see `report`)."""
    print(RESULT + json.dumps(result), flush=True)


def report(stdout: str) -> Optional[dict]:
    """The JSON a worker emitted: on the last line of `stdout` that starts with RESULT; None if there is none."""
    lines = [line for line in stdout.strip().splitlines() if line.startswith(RESULT)]
    try:
        return json.loads(lines[-1][len(RESULT):])
    except (IndexError, json.JSONDecodeError):
        return None


def reported_row(proc: subprocess.CompletedProcess, row: dict) -> dict:
    """`row` with what its worker reported, and with the error if the run failed: no report, or a non-zero exit
    status after one (another rank crashed, or the shutdown did), which a successful run does not have."""
    found = report(proc.stdout) or {}
    return {**row, **found, **({"error": error_line(proc)} if proc.returncode or not found else {})}
