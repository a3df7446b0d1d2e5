"""Peak memory and time of `python -m fsdp_trainer.tools.convert` on random weights of a preset's shape, on CPU:
a Hugging Face folder -> a checkpoint -> a Hugging Face folder, each conversion a process of its own.

    python benchmarks/convert_memory.py [--preset 8b] [--dtype bfloat16] [--shards 4] [--dir /tmp]

It writes the Hugging Face folder (`--shards` files and their index, as published models come), converts it both
ways, checks that the round trip gave back every tensor bit for bit, and records each conversion's peak resident
memory (the process's own, from wait4) beside the model's size. Needs about three times the model's size on disk in
--dir; everything written there is deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fsdp_trainer.models.llama import ModelArgs, build
from fsdp_trainer.tools.weights import hf_config, hf_names, write_safetensors
from results import exit_if_failed, print_table, write_results

GB = 1e9


def random_hf_folder(folder: Path, args: ModelArgs, dtype: torch.dtype, shards: int) -> int:
    """A Hugging Face Llama folder of random weights of `args`, written one tensor at a time; returns its bytes."""
    names = hf_names(args.n_layers)
    shapes = {names[name]: tuple(p.shape) for name, p in build(args).named_parameters()}  # tied: the embedding only
    total = sum(torch.Size(shape).numel() for shape in shapes.values()) * dtype.itemsize
    parts, size = [{}], 0
    for name, shape in shapes.items():  # about equal shards, in the parameters' order
        if size >= total * len(parts) / shards:
            parts.append({})
        parts[-1][name] = (shape, dtype)
        size += torch.Size(shape).numel() * dtype.itemsize
    folder.mkdir()
    weight_map = {}
    for i, part in enumerate(parts, 1):
        file = f"model-{i:05d}-of-{len(parts):05d}.safetensors"
        write_safetensors(folder / file, part, lambda name: torch.empty(shapes[name], dtype=dtype).normal_(std=0.02))
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(hf_config(args, dtype)))
    return total


def convert(*argv: str) -> dict:
    """One conversion in a process of its own: its seconds and peak RSS."""
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "fsdp_trainer.tools.convert", *argv])
    _, status, usage = os.wait4(child.pid, 0)
    if status:
        raise SystemExit(f"convert {' '.join(argv)} failed with status {status}")
    return {"seconds": time.perf_counter() - start, "peak_rss_gb": usage.ru_maxrss * 1024 / GB}


def same_tensors(a: Path, b: Path) -> bool:
    """Whether two Hugging Face folders hold the same tensors, bit for bit, compared one at a time."""
    from safetensors import safe_open

    def files(folder: Path) -> dict[str, Path]:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            return dict.fromkeys(f.keys(), folder / "model.safetensors")

    fa, fb = files(a), files(b)
    if fa.keys() != fb.keys():
        return False
    for name in fa:
        with safe_open(str(fa[name]), "pt") as x, safe_open(str(fb[name]), "pt") as y:
            left, right = x.get_tensor(name), y.get_tensor(name)
            if left.dtype != right.dtype or not torch.equal(left, right):
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="8b")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="a folder with room for three copies")
    args = parser.parse_args()
    model, dtype = ModelArgs.from_preset(args.preset), getattr(torch, args.dtype)
    work = Path(tempfile.mkdtemp(dir=args.dir, prefix="convert_memory."))
    rows = []
    try:
        start = time.perf_counter()
        size = random_hf_folder(work / "hf", model, dtype, args.shards)
        print(f"wrote {size / GB:.2f} GB of random {args.preset} weights in {time.perf_counter() - start:.0f} s")
        common = {"preset": args.preset, "dtype": args.dtype, "model_gb": size / GB,
                  "model_float32_gb": model.num_params() * 4 / GB, "cpus": len(os.sched_getaffinity(0)),
                  "load_average": os.getloadavg()[0]}
        rows.append({"direction": "from-hf", **common, **convert("from-hf", str(work / "hf"), str(work / "ckpt"))})
        write_results(f"convert_memory_{args.preset}", rows, gpus=0)
        rows.append({"direction": "to-hf", **common, **convert("to-hf", str(work / "ckpt"), str(work / "out"))})
        rows[-1]["round_trip_identical"] = same_tensors(work / "hf", work / "out")
        write_results(f"convert_memory_{args.preset}", rows, gpus=0)
    finally:
        shutil.rmtree(work)
    print_table(rows, [("direction", "direction", "{}"), ("model GB", "model_gb", "{:.2f}"),
                       ("peak RSS GB", "peak_rss_gb", "{:.2f}"), ("seconds", "seconds", "{:.0f}")])
    print(f"this process's peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB:.2f} GB")
    exit_if_failed(rows)


if __name__ == "__main__":
    main()
