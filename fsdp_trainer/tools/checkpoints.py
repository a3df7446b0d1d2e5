"""The checkpoint commands: list a folder's checkpoints, verify one against its checksums (`tools.convert` exports
one as a Hugging Face Llama).

    python -m fsdp_trainer.tools.checkpoints list outputs/checkpoints
    python -m fsdp_trainer.tools.checkpoints verify outputs/checkpoints/step_00000200   # e.g. after copying it

Every save records the size and CRC32 of each file it writes; verify checks them. To resume past a checkpoint list
shows as UNUSABLE, rename it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from fsdp_trainer.checkpoint import (STEP_DIR, CheckpointError, incomplete_reason, list_checkpoints, read_marker,
                                     set_aside, size_bytes)
from fsdp_trainer.config import ConfigError
from fsdp_trainer.distributed import cores_per_rank
from fsdp_trainer.tools.checksums import NO_CHECKSUMS, checked, marker_problem
from fsdp_trainer.tools.weights import read_metadata, resolve


def _list(root: str) -> None:
    if not Path(root).is_dir():
        raise CheckpointError(f"{root}: no such folder; give a checkpoint folder (<train.output_dir>/checkpoints "
                              "unless checkpoint.dir says otherwise)")
    found = list_checkpoints(Path(root))
    if not found:
        nested, parent = Path(root) / "checkpoints", Path(root).resolve().parent
        hint = f"; did you mean its checkpoints folder, {nested}?" if nested.is_dir() else ""
        if STEP_DIR.match(Path(root).resolve().name) or (Path(root) / ".metadata").exists():
            hint = f"; it is a checkpoint itself: list the folder that holds it, {parent}"
        print(f"{root}: no checkpoints (no step_* folders){hint}")
    for step, path in found:
        reason = incomplete_reason(path)
        state, problem = read_marker(path) if reason is None else (None, None)
        problem = problem or (state and marker_problem(state))
        if reason is not None:
            print(f"{path}  INCOMPLETE: it {reason}")
        elif problem:
            print(f"{path}  UNUSABLE: it {problem}")
        else:
            ranks = state["world_size"]
            print(f"{path}  complete  step {step}, {state['consumed_samples']:,} samples, "
                  f"{size_bytes(path) / 1e9:.3f} GB, saved on {ranks} rank{'s' if ranks > 1 else ''} at "
                  f"{state['saved_at']}")


def _verify(named: str) -> None:
    checkpoint = resolve(named, "checkpoint")
    aside = set_aside(checkpoint.path) if STEP_DIR.match(checkpoint.path.name) else "use another checkpoint"
    fix = f"copy it again from where it was saved; or {aside}"
    with checked(checkpoint, None, fix, threads=cores_per_rank(1)) as report:
        read_metadata(checkpoint.path, fix)
    if not report:
        raise CheckpointError(f"checkpoint {checkpoint.path}: {NO_CHECKSUMS}, so it cannot be verified")
    print(f"{checkpoint.path}: {report[0]}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fsdp_trainer.tools.checkpoints", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("list", help="list the checkpoints in a folder, complete or not (and why not)")
    p.add_argument("dir", help="a checkpoint folder (<output_dir>/checkpoints by default)")
    p = commands.add_parser("verify", help="check every file of a checkpoint against the size and CRC32 its save "
                            "recorded (after copying it, say)")
    p.add_argument("checkpoint", help="a step_* folder, or a checkpoint folder (its newest complete checkpoint)")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            _list(args.dir)
        else:
            _verify(args.checkpoint)
    except (CheckpointError, ConfigError) as err:
        parser.exit(2, f"error: {err}\n")


if __name__ == "__main__":
    main()
