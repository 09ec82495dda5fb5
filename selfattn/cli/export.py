"""Export a trained model to a folder that Hugging Face transformers loads, offline.

``--ckpt`` takes a run folder of ``selfattn train`` (its newest checkpoint), one checkpoint
file, or a local GPT-2 folder. ``--out`` receives ``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer files, so that
``AutoModelForCausalLM.from_pretrained(DIR)``, ``AutoTokenizer.from_pretrained(DIR)`` and
``pipeline("text-generation", model=DIR)`` work, and ``selfattn sample --ckpt DIR`` reads
it back. GPT-2-shaped models only (learned positions, full multi-head attention, no window,
MLP on); anything else is refused with the reason (see :mod:`selfattn.io.export`).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from selfattn.io.export import PROBE_TOKENS, Special, check_target, export
from selfattn.io.loading import load


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, metavar="PATH", default=argparse.SUPPRESS,
                   help="run folder, checkpoint file, local folder saved by transformers, or GGUF file")
    p.add_argument("--out", required=True, metavar="DIR", default=argparse.SUPPRESS,
                   help="the folder to write (created; must be empty unless --force; never a run folder)")
    p.add_argument("--force", action="store_true",
                   help="replace --out when it exists and is not empty (a run folder is refused even so)")


def main(args: argparse.Namespace) -> int:
    out = Path(args.out).absolute()
    check_target(out, args.force, flags=True)  # before the load: a large model takes a while
    loaded = load(args.ckpt)
    if out == loaded.source or out in loaded.source.absolute().parents:
        raise ValueError(f"--out {args.out!r} holds the model being exported ({loaded.source}); choose another folder")
    done = export(loaded.model, loaded.require_tokenizer(), out, force=args.force,
                  special=Special(loaded.bos, loaded.eos, loaded.chat and loaded.chat.source))
    cfg = loaded.model.config
    print(f"selfattn export: {loaded.source} -> {args.out}")
    print(f"  {done.architecture}: {cfg.n_layer} layers x {cfg.n_head} heads, C={cfg.n_embd}, "
          f"vocab {cfg.vocab_size}, context {cfg.block_size}, {loaded.model.num_params() / 1e6:.2f}M parameters"
          + ("" if cfg.bias else "; no biases in the run, written as zeros"))
    print("  " + "  ".join(_describe(out / name) for name in done.files))
    print(f"  logits of the export vs ours: max |difference| {done.logits_error:.1e} on "
          f"{min(PROBE_TOKENS, cfg.block_size)} tokens")
    print(f'  load it: AutoModelForCausalLM.from_pretrained("{args.out}"), '
          f'AutoTokenizer.from_pretrained("{args.out}")')
    return 0


def _describe(path: Path) -> str:
    size = path.stat().st_size
    return f"{path.name} ({size / 1e6:.1f} MB)" if size >= 1e6 else path.name
