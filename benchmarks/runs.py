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


def command_line(cmd: list[str], env: Optional[dict[str, str]] = None) -> str:
    """The command as a shell runs it, after the environment settings it needs."""
    return shlex.join([f"{k}={v}" for k, v in (env or {}).items()] + cmd)


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


def report(stdout: str, prefix: str = RESULT) -> Optional[dict]:
    """The JSON on the last line of `stdout` that starts with `prefix`; None if there is none. The doctor's --json
    report is its last line: prefix ""."""
    lines = [line for line in stdout.strip().splitlines() if line.startswith(prefix)]
    try:
        return json.loads(lines[-1][len(prefix):])
    except (IndexError, json.JSONDecodeError):
        return None
