"""Export a model to a folder that Hugging Face transformers loads, offline.

``--ckpt`` takes anything ``load`` reads: a run folder of ``selfattn train`` (its newest
checkpoint; a LoRA run's adapters merged into its base), one checkpoint file, a transformers
folder or a GGUF file. ``--out`` receives ``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer files (with the source's chat template), so that
``AutoModelForCausalLM.from_pretrained(DIR)``, ``AutoTokenizer.from_pretrained(DIR)`` and
``pipeline("text-generation", model=DIR)`` work, and ``selfattn sample --ckpt DIR`` reads it back.
The model is written as GPT-2 where GPT-2 can say it, else as the first family that can (see
:mod:`selfattn.io.export`). ``--adapter`` writes a LoRA run's adapters alone, as a ``peft`` folder.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from selfattn import lora
from selfattn.families import writing
from selfattn.io.export import PROBE_TOKENS, Special, check_target, export
from selfattn.io.loading import load


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, metavar="PATH", default=argparse.SUPPRESS,
                   help="run folder, checkpoint file, local folder saved by transformers, or GGUF file")
    p.add_argument("--out", required=True, metavar="DIR", default=argparse.SUPPRESS,
                   help="the folder to write (created; must be empty unless --force; never a run folder)")
    p.add_argument("--force", action="store_true",
                   help="replace --out when it exists and is not empty (a run folder is refused even so)")
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run: write its adapters alone, as a peft folder for the base model in transformers "
                        "(adapter_config.json, adapter_model.safetensors), instead of the merged model")


def main(args: argparse.Namespace) -> int:
    out = Path(args.out).absolute()
    check_target(out, args.force, flags=True)  # before the load: a large model takes a while
    if args.adapter:
        return _adapter(args.ckpt, out, args.out)
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


def _adapter(ckpt: str, out: Path, given: str) -> int:
    """``--adapter``: the LoRA run ``ckpt``'s adapters as a peft folder ``out``, named as the family
    of its base names its modules."""
    loaded = load(ckpt, merge=False)
    if loaded.base is None:
        raise ValueError(f"--adapter: {loaded.source} is not a LoRA run (selfattn train --init-from BASE --lora-rank R "
                         f"makes one); export it without --adapter")
    family = loaded.family or (writing.folder_config(loaded.model.config) or (None,))[0]
    if family is None:
        raise ValueError(f"--adapter: no transformers family of {', '.join(writing.ARCHS)} computes the base model "
                         f"{loaded.base}, so peft has no module names for its adapters")
    lora.save_peft(loaded.model, out, family, base_model=str(loaded.base))
    settings = lora.lora_settings(loaded.model)
    print(f"selfattn export: the LoRA adapters of {loaded.source} -> {given} (peft, {family}, rank "
          f"{settings['rank']}, alpha {settings['alpha']:g}, {len(lora.lora_modules(loaded.model))} linears)")
    print(f'  load it: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), "{given}"), BASE being '
          f"{loaded.base} as a transformers folder" + ("" if loaded.base.is_dir() else
                                                        f" (selfattn export --ckpt {loaded.base} --out BASE)"))
    return 0


def _describe(path: Path) -> str:
    size = path.stat().st_size
    return f"{path.name} ({size / 1e6:.1f} MB)" if size >= 1e6 else path.name
