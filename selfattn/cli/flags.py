"""The flags more than one command takes, each defined once: one name, one meaning, one default.

- :func:`add_model`: ``--ckpt`` (and ``--base``, a LoRA run's moved base: :func:`base_of`),
  ``--device`` and ``--dtype``, for every command that loads a model;
  :func:`add_seed`: ``--seed`` (default :data:`SEED` everywhere); :func:`add_input`: ``--text`` or
  ``--random-tokens N`` and its ``--seed``, for the commands that look inside a model.
- Config dataclasses as flags (:func:`add_flags`, :func:`add_set`, :func:`given`).

A chosen field of a config dataclass becomes one flag (``n_layer`` -> ``--n-layer``) whose help is
the field's own (``metadata["help"]``, :mod:`selfattn._util.fields`); every other field is set by name with
``--set FIELD=VALUE``. Flags default to "not given", so a caller can layer values: dataclass defaults,
then a preset, then a JSON file (:func:`selfattn._util.validate.config_fields`), then what a person typed.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json

from selfattn._util.fields import help_of
from selfattn._util.validate import field_type


def add_flags(parser: argparse.ArgumentParser, cls: type, *, only: tuple[str, ...] | None = None,
              skip: tuple[str, ...] = (), title: str | None = None) -> None:
    """Add one ``--flag`` per field of the dataclass ``cls`` (those of ``only`` when given, except
    ``skip``, and none holding a list or a dict, which ``--set`` or a JSON ``--config`` sets) in its
    own group, titled ``title`` (default: the class name)."""
    group = parser.add_argument_group(title or cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip or (only is not None and f.name not in only):
            continue
        base, optional = field_type(cls, f.name)
        if base in (list, dict):
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{help_of(f)} [{f.default!r}]".strip().replace("%", "%%")  # argparse formats it
        if base is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=_flag_parser(base, optional), default=argparse.SUPPRESS,
                               metavar=base.__name__.upper() + ("|none" if optional else ""), help=help_text)


def add_set(parser: argparse.ArgumentParser, *classes: type) -> None:
    """``--set FIELD=VALUE`` (repeatable): any field of ``classes`` by name."""
    names = ", ".join(f.name for cls in classes for f in dataclasses.fields(cls))
    parser.add_argument("--set", dest="set_fields", action="append", default=[], metavar="FIELD=VALUE",
                        help=f"set any field by name (repeatable): a number, true/false, none, a string, or JSON for "
                             f"a list or a dict, e.g. --set window=256 --set sink_tokens=4. Fields: {names}")


def given(args: argparse.Namespace, cls: type) -> dict:
    """The fields of ``cls`` given on the command line, as flags or by ``--set``, as a dict; a ValueError
    names a ``--set`` of a field no class has, or a value its field cannot take."""
    out = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    fields = {f.name for f in dataclasses.fields(cls)}
    for item in getattr(args, "set_fields", []):
        name, value = _split(item)
        if name in fields:
            out[name] = _parse(cls, name, value)
    return out


def check_set(args: argparse.Namespace, *classes: type) -> None:
    """Refuse a ``--set`` whose field none of ``classes`` has, naming it (and the closest name)."""
    names = [f.name for cls in classes for f in dataclasses.fields(cls)]
    for item in getattr(args, "set_fields", []):
        name, _ = _split(item)
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            raise ValueError(f"--set {item}: no field {name!r}" + (f"; did you mean {close[0]!r}?" if close else ""))


def _split(item: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"--set takes FIELD=VALUE, got {item!r}")
    return name.strip().replace("-", "_"), value.strip()


def _parse(cls: type, name: str, text: str):
    """``text`` as the value of field ``name`` of ``cls``: by the field's type, JSON for a list or a dict."""
    base, optional = field_type(cls, name)
    if optional and text.lower() == "none":
        return None
    try:
        if base in (list, dict):
            value = json.loads(text)
            if not isinstance(value, base):
                raise ValueError
            return value
        if base is bool:
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text.lower() in ("true", "1", "yes")
        return base(text)
    except ValueError:
        want = {list: "a JSON list", dict: "a JSON object", bool: "true or false"}.get(base, base.__name__)
        raise ValueError(f"--set {name}={text}: {name} takes {want}" + (" or none" if optional else "")) from None


def _flag_parser(base: type, optional: bool):
    def parse(text: str):
        if optional and text.lower() == "none":
            return None
        return base(text)
    parse.__name__ = base.__name__  # argparse names the type in "invalid int value" errors
    return parse


CKPT_HELP = "run folder, checkpoint file, local folder saved by transformers, or GGUF file"
DEVICE_HELP = "'auto' (the accelerator if any, else the CPU) or a torch device: cpu, cuda, cuda:1, mps"
DTYPES = ("float32", "bfloat16", "float16")
SEED = 0  # every command's --seed: the same command prints the same thing; another seed, another draw


def add_model(parser: argparse.ArgumentParser, *, required: bool = True, dtype: bool = True,
              purpose: str | None = None) -> None:
    """``--ckpt PATH`` (``purpose``, when given, leads its help), ``--device`` and, with ``dtype``,
    ``--dtype``: the flags of a command that loads a model. ``--ckpt`` without ``required``
    defaults to None."""
    add_ckpt(parser, required=required, purpose=purpose)
    add_device(parser)
    if dtype:
        parser.add_argument("--dtype", choices=DTYPES, default="float32",
                            help="the dtype the model computes in: its weights are cast to it once loaded")


def add_ckpt(parser: argparse.ArgumentParser, *, required: bool = True, purpose: str | None = None) -> None:
    """``--ckpt PATH``: any path :func:`selfattn.io.loading.load` reads; and ``--base PATH``, where a LoRA
    run's base model is now (:func:`base_of`)."""
    parser.add_argument("--ckpt", required=required, metavar="PATH", default=argparse.SUPPRESS if required else None,
                        help=f"{purpose}: {CKPT_HELP}" if purpose else CKPT_HELP)
    add_base(parser)


def add_base(parser: argparse.ArgumentParser) -> None:
    """``--base PATH``: where a LoRA run's base model is now, when it moved (:func:`base_of`)."""
    parser.add_argument("--base", default=None, metavar="PATH",
                        help="a LoRA run's base model at its new place, when it moved (the run names its old "
                             "one); it must be the same model: its digest is checked")


def base_of(args: argparse.Namespace) -> dict:
    """The loader's keywords for ``--base``: ``{"base": PATH}`` when it is given, else none
    (``load(args.ckpt, **flags.base_of(args))``)."""
    base = getattr(args, "base", None)
    return {} if base is None else {"base": base}


def add_device(parser: argparse.ArgumentParser) -> None:
    """``--device``, default ``auto``; :func:`selfattn._util.validate.device` reads it."""
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)


def dtype(args: argparse.Namespace):
    """``--dtype``'s torch dtype."""
    import torch

    return getattr(torch, args.dtype)


def add_speed(parser: argparse.ArgumentParser) -> None:
    """``--quantize int8`` and ``--threads N``, for the commands that run a model's forwards
    (:func:`speed_up` applies them)."""
    parser.add_argument("--quantize", choices=["int8"], default=None,
                        help="weight-only int8 (per-channel scales): fewer bytes a token, slightly different numbers")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="threads torch computes on; unset: torch's default, a thread a core")


def check_threads(args: argparse.Namespace) -> None:
    """``--threads`` is a positive count, checked before the model is loaded."""
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")


def speed_up(args: argparse.Namespace, model):
    """``model`` with ``--quantize`` applied (in place), torch's threads set by ``--threads``."""
    import torch

    from selfattn.generation.int8 import quantize_int8

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return quantize_int8(model) if args.quantize == "int8" else model


def add_seed(parser: argparse.ArgumentParser, what: str) -> None:
    """``--seed N``, default :data:`SEED`; ``what`` says what it seeds."""
    parser.add_argument("--seed", type=int, default=SEED, metavar="N", help=what)


def add_input(parser: argparse.ArgumentParser, random_tokens: int) -> None:
    """What a command that looks inside a model reads: ``--text``, or ``--random-tokens N`` (default
    ``random_tokens``) distinct random tokens shown twice, drawn with ``--seed``."""
    given = parser.add_mutually_exclusive_group()
    given.add_argument("--text", default=None, metavar="TEXT",
                       help="text to look at (default: random tokens, repeated twice)")
    given.add_argument("--random-tokens", type=int, default=random_tokens, metavar="N",
                       help="without --text: N random distinct tokens, shown twice (2N positions), on which "
                            "induction heads show themselves")
    add_seed(parser, "seed of the random tokens")


def check_input(args: argparse.Namespace) -> None:
    """:func:`add_input`'s flags, before the model is loaded."""
    if args.text is None and args.random_tokens <= 0:
        raise ValueError(f"--random-tokens must be positive, got {args.random_tokens}")
    if args.text == "":
        raise ValueError("--text is empty: pass a text, or leave --text out for random tokens")


def check_random_tokens(n: int, config) -> None:
    """``n`` distinct random tokens shown twice must fit the model: 2n positions, n tokens of its vocabulary."""
    if 2 * n > config.block_size:
        raise ValueError(f"--random-tokens {n} shows {2 * n} tokens, more than the model's block_size="
                         f"{config.block_size}; pass --random-tokens {config.block_size // 2} or less")
    if n > config.vocab_size:
        raise ValueError(f"--random-tokens {n} needs {n} distinct tokens, more than the model's vocabulary of "
                         f"{config.vocab_size}; pass --random-tokens {config.vocab_size} or less")


def figure_and_top(args: argparse.Namespace, name: str):
    """``--out FILE`` (a PNG; ``name`` in the example when a folder is given), its folder checked
    writable before any work, and ``--top`` checked positive: the path to write."""
    from pathlib import Path

    from selfattn._util import files

    out = Path(args.out)
    if out.is_dir():
        raise ValueError(f"--out {args.out!r} is a folder: name the PNG to write, e.g. --out {out / name}")
    files.writable_folder(out.parent)
    if args.top <= 0:
        raise ValueError(f"--top must be positive, got {args.top}")
    return out
