"""Convert model weights without a training run or a GPU, one tensor in memory at a time.

    # a Hugging Face Llama folder -> the checkpoint of step 0 in a checkpoint folder (weights only)
    python -m fsdp_trainer.tools.convert from-hf Llama-3.2-1B/ outputs/checkpoints
    # a checkpoint (a step_* folder, or a checkpoint folder's newest) -> a Hugging Face Llama folder
    python -m fsdp_trainer.tools.convert to-hf outputs/checkpoints/step_00000200 exported/
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch

from fsdp_trainer.checkpoint import CheckpointError
from fsdp_trainer.config import ConfigError
from fsdp_trainer.tools.weights import export, import_hf


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fsdp_trainer.tools.convert", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("from-hf", help="a Hugging Face Llama folder -> a checkpoint of step 0 that "
                            "--checkpoint.init_from and resume take")
    p.add_argument("hf_dir", help="a folder with config.json and model.safetensors (or its shards and index)")
    p.add_argument("checkpoint_dir", help="a new checkpoint folder, for its step_00000000")
    p = commands.add_parser("to-hf", help="a checkpoint -> a Hugging Face Llama folder (config.json and "
                            "model.safetensors)")
    p.add_argument("checkpoint", help="a step_* folder, or a checkpoint folder (its newest complete checkpoint)")
    p.add_argument("out_dir", help="a folder holding no model weights yet")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast the weights (default: as saved)")
    p.add_argument("--no-checksums", dest="checksums", action="store_false",
                   help="do not check the files against the checksums the save recorded (to salvage what a damaged "
                        "checkpoint still holds)")
    args = parser.parse_args(argv)
    try:
        if args.command == "from-hf":
            import_hf(args.hf_dir, args.checkpoint_dir)
        else:
            export(args.checkpoint, args.out_dir, getattr(torch, args.dtype) if args.dtype else None,
                   checksums=args.checksums)
    except (CheckpointError, ConfigError) as err:
        parser.exit(2, f"error: {err}\n")


if __name__ == "__main__":
    main()
