"""Export a model to a folder that Hugging Face transformers loads, or a GGUF file that llama.cpp runs, offline.

``--ckpt`` takes anything ``load`` reads: a run folder of ``selfattn train`` (its newest
checkpoint; a LoRA run's adapters merged into its base), one checkpoint file, a transformers
folder or a GGUF file. ``--out`` receives ``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer files (with the source's chat template), so that
``AutoModelForCausalLM.from_pretrained(DIR)``, ``AutoTokenizer.from_pretrained(DIR)`` and
``pipeline("text-generation", model=DIR)`` work, and ``selfattn sample --ckpt DIR`` reads it back.
The model is written as GPT-2 where GPT-2 can say it, else as the first family that can (see
:mod:`selfattn.io.export`). ``--adapter`` writes a LoRA run's adapters alone, as a ``peft`` folder with the
tokenizer, pointing at its base as a transformers folder (the base itself, or the base written into ``--out``'s
``base/`` when it is a GGUF file or a run), so that ``AutoPeftModelForCausalLM.from_pretrained(DIR)`` loads it.
A LoRA run whose base moved takes its new place as ``--base PATH``.

``--out FILE.gguf`` (its folders created) writes a GGUF file that llama.cpp runs instead
(:mod:`selfattn.io.gguf_export`): the first family llama.cpp has an architecture for that says the model (Llama,
Qwen2, Qwen3, Gemma 2, Gemma 3, OLMo 2, Phi-3, BLOOM, GPT-2: a run of the default block too; gpt-oss), its
matrices in ``--type`` (default f32, exact for any source: our models compute in float32; f16, bf16 and q8_0 are
smaller), read back and checked.
A file of another type than f32 states its perplexity cost: the perplexity of the file read back and of the
source on the first :data:`PPL_TOKENS` tokens of ``--ppl-data`` (default: the built-in corpus).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from selfattn import lora
from selfattn._util import files as _files
from selfattn._util.jsonfile import json_object
from selfattn.cli import flags
from selfattn.families import writing
from selfattn.formats.gguf_write import TYPES
from selfattn.io.export import PROBE_TOKENS, Special, check_target, export, write_tokenizer
from selfattn.io.loading import Loaded, is_transformers_folder, load
from selfattn.training import checkpoint
from selfattn.training.data import read_corpus
from selfattn.training.evaluate import perplexity

PPL_TOKENS = 512  # tokens a GGUF file's perplexity cost is measured on
BASE = "base"  # --adapter: the subfolder the base is written into when it is no transformers folder
EXAMPLE = "selfattn export --ckpt runs/tiny --out exported/tiny"


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_ckpt(p)
    p.add_argument("--out", required=True, metavar="FOLDER|FILE.gguf", default=argparse.SUPPRESS,
                   help="the folder to write (created; must be empty unless --force; never a run folder), or "
                        "the file to write when the name ends in .gguf: a GGUF file llama.cpp runs")
    p.add_argument("--force", action="store_true",
                   help="replace --out when it exists and is not empty (a run folder is refused even so)")
    p.add_argument("--type", choices=TYPES, default=None,
                   help="a GGUF file's matrix type (1-D tensors, biases, a router stay f32); unset: f32, exact")
    p.add_argument("--ppl-data", default=None, metavar="FILE",
                   help="a GGUF file not in f32: the text its perplexity cost is measured on (its first "
                        f"{PPL_TOKENS} tokens); unset: the built-in corpus")
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run: write its adapters alone, as a peft folder for the base model in transformers "
                        "(adapter_config.json, adapter_model.safetensors, the tokenizer; the base written into "
                        "base/ unless it is a transformers folder), instead of the merged model")


def main(args: argparse.Namespace) -> int:
    out = Path(args.out).absolute()
    if out.suffix == ".gguf":
        return _gguf(args, out)
    for flag in ("type", "ppl_data"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')} is for a GGUF file (--out FILE.gguf); --out {args.out!r} "
                             f"is a folder")
    check_target(out, args.force, flags=True)  # before the load: a large model takes a while
    if args.adapter:
        return _adapter(args, out)
    loaded = load(args.ckpt, **flags.base_of(args))
    if out == loaded.source or out in loaded.source.absolute().parents:
        raise ValueError(f"--out {args.out!r} holds the model being exported ({loaded.source}); choose another folder")
    done = export(loaded.model, loaded.require_tokenizer(), out, force=args.force, special=Special.of(loaded))
    cfg = loaded.model.config
    print(f"selfattn export: {loaded.source} -> {args.out}")
    print(f"  {done.architecture}: {cfg.n_layer} layers x {cfg.n_head} heads, C={cfg.n_embd}, "
          f"vocab {cfg.vocab_size}, context {cfg.block_size}, {loaded.model.num_params() / 1e6:.2f}M parameters")
    print("  " + "  ".join(_describe(out / name) for name in done.files))
    print(f"  logits of the export vs ours: max |difference| {done.logits_error:.1e} on "
          f"{min(PROBE_TOKENS, cfg.block_size)} tokens")
    print(f'  load it: AutoModelForCausalLM.from_pretrained("{args.out}"), '
          f'AutoTokenizer.from_pretrained("{args.out}")')
    return 0


def _gguf(args: argparse.Namespace, out: Path) -> int:
    """``--out FILE.gguf``: the model as a GGUF file llama.cpp runs, and what its type costs."""
    from selfattn.io.gguf_export import export_gguf

    if args.adapter:
        raise ValueError("--adapter writes a peft folder; a GGUF file (--out FILE.gguf) holds the merged model")
    if out.is_dir():
        raise ValueError(f"--out {args.out!r} is a folder; name the GGUF file to write")
    if out.exists() and not args.force:
        raise ValueError(f"--out {args.out!r} exists; pass --force to replace it")
    try:  # before the load: its folders are created (as a folder export's are), and must be writable
        _files.writable_folder(out.parent)
    except ValueError as e:
        raise ValueError(f"--out {args.out!r}: {e}") from None
    kind = args.type or "f32"
    if kind == "f32" and args.ppl_data is not None:
        raise ValueError("--ppl-data measures what a --type other than f32 costs; f32 costs nothing")
    text = None if kind == "f32" else read_corpus(args.ppl_data)  # before the load: a bad file is seconds sooner
    loaded = load(args.ckpt, **flags.base_of(args))
    if out == loaded.source.absolute():
        raise ValueError(f"--out {args.out!r} is the model being exported; choose another file")
    done = export_gguf(loaded.model, loaded.require_tokenizer(), out, type=kind, special=Special.of(loaded),
                       source=loaded.source)
    cfg, w = loaded.model.config, done.written
    print(f"selfattn export: {loaded.source} -> {args.out}")
    print(f"  llama.cpp's {w.architecture} ({w.model_type}): {cfg.n_layer} layers x {cfg.n_head} heads, "
          f"C={cfg.n_embd}, vocab {cfg.vocab_size}, context {cfg.block_size}, "
          f"{loaded.model.num_params() / 1e6:.2f}M parameters" + ("; no biases in the model, written as zeros (its "
                                                                  "architecture needs them)" if w.zero_biases else ""))
    print(f"  {_describe(out)}: " + ", ".join(f"{n} {kind}" for kind, n in w.types.items()) +
          f" tensors; tokenizer {w.tokenizer}" + ("" if loaded.eos else "; no end-of-text token declared (llama.cpp "
                                                   "stops at its default one, id 11 for gpt2 and 2 for llama)"))
    print(f"  logits of the file (read back, float32) vs ours: max |difference| {done.logits_error:.1e} on "
          f"{min(PROBE_TOKENS, cfg.block_size)} tokens")
    if text is not None:
        _perplexity_cost(loaded, done.model, *text)
    print(f'  run it: llama-completion -m {args.out} -p "..." -no-cnv')
    return 0


def _perplexity_cost(loaded: Loaded, written, text: str, what: str) -> None:
    """Print the perplexity of ``written`` (the file read back) and of the source on the first
    :data:`PPL_TOKENS` tokens of ``text`` (``what``: where it came from)."""
    ids = loaded.require_tokenizer().encode(text[:PPL_TOKENS * 16])[:PPL_TOKENS]  # at most 16 characters a token
    if len(ids) < 2:
        raise ValueError(f"--ppl-data {what} is {len(ids)} token(s) long; a perplexity needs 2")
    context = min(len(ids), loaded.model.config.block_size)
    source, file = (perplexity(model, ids, context=context).perplexity for model in (loaded.model, written))
    print(f"  perplexity on {len(ids)} tokens of {what}: {file:.4f} (the source: {source:.4f}; "
          f"{(file / source - 1) * 100:+.3f}%)")


def _adapter(args: argparse.Namespace, out: Path) -> int:
    """``--adapter``: the LoRA run's adapters as a peft folder ``out``, named as the family of its base
    names its modules, with the tokenizer's files, and pointing at its base as a transformers folder
    (``base_model_name_or_path``, absolute): the base itself when it is one, else the base written as one
    into ``out/base``; so ``AutoPeftModelForCausalLM.from_pretrained(out)`` loads it in one step, offline."""
    loaded = load(args.ckpt, merge=False, **flags.base_of(args))
    if loaded.base is None:
        raise ValueError(f"--adapter: {loaded.source} is not a LoRA run (selfattn train --init-from BASE --lora-rank R "
                         f"makes one); export it without --adapter")
    family = loaded.family or (writing.folder_config(loaded.model.config) or (None,))[0]
    if family is None:
        raise ValueError(f"--adapter: no transformers family of {', '.join(writing.ARCHS)} computes the base model "
                         f"{loaded.base}, so peft has no module names for its adapters")
    if _is_transformers_folder(loaded.base):
        base, wrote = loaded.base.absolute(), None
    else:  # a GGUF file, a run: written as the folder transformers reads, beside the adapters
        source = load(loaded.base)
        wrote = export(source.model, source.require_tokenizer(), out / BASE, force=args.force,
                       special=Special.of(source))
        base = wrote.path
        family = json_object(base / "config.json")["model_type"]  # the module names peft finds there
    lora.save_peft(loaded.model, out, family, base_model=str(base))
    write_tokenizer(loaded.require_tokenizer(), out, block_size=loaded.model.config.block_size,
                    special=Special.of(loaded))
    settings = lora.lora_settings(loaded.model)
    print(f"selfattn export: the LoRA adapters of {loaded.source} -> {args.out} (peft, {family}, rank "
          f"{settings['rank']}, alpha {settings['alpha']:g}, {len(lora.lora_modules(loaded.model))} linears), "
          f"with the tokenizer")
    if wrote is None:
        print(f"  its base: {base}, the transformers folder it was trained on (base_model_name_or_path)")
    else:
        print(f"  its base: {loaded.base}, written as a transformers folder into {Path(args.out) / BASE} "
              f"({wrote.architecture}; base_model_name_or_path {base})")
    print(f'  load it: AutoPeftModelForCausalLM.from_pretrained("{args.out}"), '
          f'AutoTokenizer.from_pretrained("{args.out}")')
    return 0


def _is_transformers_folder(path: Path) -> bool:
    """A folder ``transformers`` loads as it is: a ``config.json`` naming a model_type, and no run's checkpoint."""
    return path.is_dir() and is_transformers_folder(path) and checkpoint.latest(path) is None and \
        not (path / checkpoint.BEST).exists()


def _describe(path: Path) -> str:
    size = path.stat().st_size
    return f"{path.name} ({size / 1e6:.1f} MB)" if size >= 1e6 else path.name
