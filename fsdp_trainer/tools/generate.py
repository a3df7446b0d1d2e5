"""Greedy sampling from a checkpoint or a Hugging Face Llama: the quickest look at what a run learned.

    python -m fsdp_trainer.tools.generate outputs/checkpoints --prompt "def main(" --tokens 100
    python -m fsdp_trainer.tools.generate hf:Llama-3.2-1B/ --tokenizer Llama-3.2-1B/tokenizer.json \\
        --prompt "The capital of France is" --tokens 20

Each new token is the most likely one, as transformers' generate(do_sample=False) picks it, computed over the whole
context again: there is no KV cache, so this is for a look, not for serving.
"""

from __future__ import annotations

import argparse
from typing import Callable, Optional, Sequence

import torch

from fsdp_trainer.checkpoint import CheckpointError
from fsdp_trainer.config import ConfigError
from fsdp_trainer.data import BYTE_EOS
from fsdp_trainer.tools.prepare import EOS_NAMES
from fsdp_trainer.models.llama import Transformer
from fsdp_trainer.tools.weights import load_model


@torch.no_grad()
def greedy(model: Transformer, ids: Sequence[int], n: int, eos: Optional[int] = None) -> list[int]:
    """The `n` tokens after `ids`, each the most likely given those before it; fewer if `eos` comes first."""
    tokens = torch.tensor([list(ids)], device=model.rope.device)
    for _ in range(n):
        next_id = model(tokens[:, -model.args.max_seq_len:])[0, -1].argmax()
        tokens = torch.cat([tokens, next_id.view(1, 1)], dim=1)
        if next_id.item() == eos:
            break
    return tokens[0, len(ids):].tolist()


def tokenizer(path: Optional[str]) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str], Optional[int]]:
    """(encode, decode, end-of-text id) of a Hugging Face tokenizer.json, or of the byte tokenizer for None."""
    if path is None:
        return (lambda text: list(text.encode()),
                lambda ids: bytes(i for i in ids if i < BYTE_EOS).decode(errors="replace"), BYTE_EOS)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("--tokenizer needs the optional `tokenizers` package: pip install tokenizers") from None
    try:
        tok = Tokenizer.from_file(path)
    except Exception as err:  # the tokenizers package raises a bare Exception for a file it cannot read
        raise ConfigError(f"--tokenizer {path}: not a Hugging Face tokenizer.json ({err})") from None
    eos = next((tok.token_to_id(name) for name in EOS_NAMES if tok.token_to_id(name) is not None), None)
    return (lambda text: tok.encode(text).ids), tok.decode, eos


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fsdp_trainer.tools.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a checkpoint (a step_* folder, or a checkpoint folder's newest), or "
                                       "hf:<folder> for a Hugging Face Llama")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--tokens", type=int, default=100, help="how many tokens to add (fewer if end-of-text comes)")
    parser.add_argument("--tokenizer", help="the model's tokenizer.json (default: bytes, as data.source stdlib and "
                                            "`data prepare` without --tokenizer make them)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    try:
        encode, decode, eos = tokenizer(args.tokenizer)
        model = load_model(args.source, args.device)
        ids = encode(args.prompt)
        if not ids or max(ids) >= model.args.vocab_size:
            raise ConfigError(f"--prompt encodes to token ids {ids[:8]}..., which a vocabulary of "
                              f"{model.args.vocab_size} cannot take; give a prompt, and the model's own tokenizer")
    except (CheckpointError, ConfigError) as err:
        parser.exit(2, f"error: {err}\n")
    print(args.prompt + decode(greedy(model, ids, args.tokens, eos)))


if __name__ == "__main__":
    main()
