"""Generate text from a trained model, streamed to the terminal as it is produced.

``--ckpt`` takes a run folder of ``selfattn train`` (its newest checkpoint), one checkpoint
file (``ckpt-*.safetensors``, or a ``torch.save`` state dict ``.pt`` beside the run's
``config.json``), or a local GPT-2 folder written by ``transformers``' ``save_pretrained``
(weights through :func:`selfattn.hf.load_gpt2`, tokenizer from the folder's
``tokenizer.json`` or ``vocab.json`` + ``merges.txt``). Nothing is downloaded.

Tokens are turned into bytes one at a time and decoded incrementally, so a character whose
UTF-8 bytes span several tokens is printed whole once its last byte arrives. Past the
model's ``block_size`` the context slides: it is cut to its last half and read again.
"""
from __future__ import annotations

import argparse
import codecs
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from selfattn import checkpoint
from selfattn.data import BPETokenizer, ByteTokenizer, tokenizer_from_spec
from selfattn.model import GPT, GPTConfig

_GPT2_EOT = "<|endoftext|>"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, metavar="PATH", default=argparse.SUPPRESS,
                   help="run folder, checkpoint file, or local GPT-2 folder saved by transformers")
    p.add_argument("--prompt", default="", metavar="TEXT",
                   help="text to continue; empty: start from a newline (GPT-2: from <|endoftext|>)")
    p.add_argument("--max-new-tokens", type=int, default=300, metavar="N", help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 = greedy; higher = more random")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the k most likely tokens only")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="nucleus: sample among the fewest tokens holding this probability")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="seed of the sampler: same seed, same text")
    p.add_argument("--device", default="auto", help="'auto' (CUDA if available, else CPU) or a torch device")


def main(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    model, tokenizer, start = load(args.ckpt)
    model.to(device).eval().decode_layout()  # inference only: the weight order batch-1 decoding reads fastest
    ids = tokenizer.encode(args.prompt) if args.prompt else [start]
    generator = torch.Generator(device)
    if args.seed is None:
        generator.seed()
    else:
        generator.manual_seed(args.seed)
    sys.stdout.write(args.prompt)
    tokens = stream(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, generator=generator)
    for piece in text_pieces(tokenizer, tokens):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def load(ckpt: str) -> tuple[GPT, ByteTokenizer | BPETokenizer, int]:
    """(model on the CPU, its tokenizer, the token that starts an empty prompt) from ``ckpt``."""
    path = Path(ckpt)
    if path.is_dir() and _is_transformers_folder(path):
        return _load_gpt2(path)
    if path.is_dir():
        found = checkpoint.latest(path)
        if found is None:
            raise ValueError(f"{str(path)!r} holds no checkpoint (ckpt-*.safetensors) and no transformers config.json")
        path = found
    weights, meta = checkpoint.read_weights(path)
    if meta is None:  # a bare state dict: the run's config.json beside it describes the model
        meta = _run_config(path.parent)
    tokenizer = tokenizer_from_spec(meta["tokenizer"])
    model = GPT(GPTConfig(**meta["model"]))
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise ValueError(f"{path}: weights do not fit the configured model: {' '.join(str(e).split())[:300]}") from None
    return model, tokenizer, tokenizer.encode("\n")[0]


def stream(model: GPT, ids: list[int], max_new_tokens: int, **sampling) -> Iterator[int]:
    """New tokens one at a time after ``ids``; the context slides past ``block_size``."""
    block = model.config.block_size
    context = list(ids)
    device = model.wte.weight.device
    remaining = max_new_tokens
    while remaining > 0:
        if len(context) >= block:
            context = context[-(block // 2):]  # keep the last half; the model reads it afresh
        n = min(remaining, block - len(context) + 1)  # the last new token is never fed back
        for token in model.generate(torch.tensor([context], device=device), n, **sampling):
            context.append(int(token))
            yield context[-1]
        remaining -= n


def text_pieces(tokenizer, tokens) -> Iterator[str]:
    """One string per token: the characters its bytes complete (possibly ""), then whatever an
    unfinished character at the end decodes to. Invalid UTF-8 becomes U+FFFD."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for token in tokens:
        yield decoder.decode(tokenizer.token_bytes(token))
    tail = decoder.decode(b"", final=True)
    if tail:
        yield tail


def _is_transformers_folder(path: Path) -> bool:
    config = path / "config.json"
    return config.is_file() and "model_type" in json.loads(config.read_text())


def _load_gpt2(path: Path) -> tuple[GPT, BPETokenizer, int]:
    from selfattn.hf import load_gpt2

    try:
        import tokenizers
    except ImportError as e:
        raise ImportError("reading a GPT-2 tokenizer needs 'tokenizers': pip install 'selfattn[train]'") from e
    if (path / "tokenizer.json").is_file():
        tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    elif (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
        tok = tokenizers.Tokenizer(tokenizers.models.BPE.from_file(str(path / "vocab.json"), str(path / "merges.txt")))
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tokenizers.decoders.ByteLevel()
    else:
        raise ValueError(f"{str(path)!r} has no tokenizer.json (or vocab.json + merges.txt) beside its weights")
    tokenizer = BPETokenizer(tok)
    start = tok.token_to_id(_GPT2_EOT)
    if start is None:
        start = tokenizer.encode("\n")[0]
    return load_gpt2(path), tokenizer, start


def _run_config(folder: Path) -> dict:
    """The model config and tokenizer of the run in ``folder``, from its config.json."""
    try:
        run = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"a bare state dict needs the run's config.json beside it; none in {str(folder)!r}") from None
    kind = run["train"]["tokenizer"]
    spec = {"kind": "byte"} if kind == "byte" else {"kind": "bpe", "json": (folder / "tokenizer.json").read_text()}
    return {"model": run["model"], "tokenizer": spec}
