"""The ``selfattn`` command: one thin dispatcher over sub-commands.

Each sub-command is a module of this package, ``selfattn.cli.<command>``, exposing
``add_arguments(parser)`` and ``main(args) -> int``: it parses, calls the library, prints.
Steps of the library that take a while (loading, tokenizing, exporting) show a progress bar on
stderr when it is a terminal and ``TQDM_DISABLE`` is unset (:mod:`selfattn._util.progress`).
Errors a user can fix (bad flags, bad values, missing files) are one line on stderr and exit
status 2; ``SELFATTN_DEBUG=1`` shows the traceback instead. Ctrl-C is one line too, and then the
process dies of SIGINT, as an interrupted program should (the shell reads status 130 and stops a
loop that ran it).
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import textwrap

from selfattn._util import progress

# what a user does -> {command: one-line help}; the module of a command is selfattn.cli.<command>, imported
# only when that command runs
GROUPS = {
    "use a model": {
        "sample": "generate text (or a chat answer) from a run, a transformers folder or a GGUF file",
        "eval": "a model's loss and perplexity on a text file, or on a chat file's answers",
        "serve": "an OpenAI-compatible HTTP server (chat, completions, streamed answers), batching continuously",
        "export": "write a folder transformers loads (AutoModelForCausalLM, pipeline) or a GGUF file llama.cpp runs",
    },
    "adapt it": {
        "train": "train a GPT on text, or fine-tune one (--init-from, LoRA); torchrun for DDP/FSDP; --resume",
    },
    "look inside": {
        "check": "audit causality: every backend x option, a tiny GPT and its cache, a model, or your module",
        "explore": "one self-contained HTML page: head view, model view, head roles, next-token predictions",
        "heads": "attention maps and ranked head roles (previous-token, induction) of a model",
        "lens": "the logit lens: each layer's top next tokens at chosen positions, and a heatmap",
        "patch": "activation patching: the layers, positions or heads that carry a clean prompt's answer",
        "induction": "train a 2-layer attention-only GPT until induction heads form; 4 heads vs 1",
        "scaling": "why scores are scaled by 1/sqrt(head_dim): the softmax at init, three scalings",
        "demo": "the seed's worked example, computed live: shape walk, parameters, causality",
    },
    "measure": {
        "calibrate": "time auto's candidate backends on this machine and keep the fastest for auto to follow",
    },
}
COMMANDS = {name: help_text for group in GROUPS.values() for name, help_text in group.items()}
BENCHMARKS = "python -m benchmarks SUITE: the benchmark suites (a source checkout; --help lists them)"


def _listing() -> str:
    """``selfattn --help``'s commands, grouped by what a user does."""
    lines = ["Causal multi-head self-attention from scratch.", ""]
    for group, commands in GROUPS.items():
        lines.append(f"{group}:")
        for name, help_text in commands.items():
            lines += textwrap.wrap(help_text, 112, initial_indent=f"  {name:<11}", subsequent_indent=" " * 13)
        if group == "measure":
            lines += textwrap.wrap(BENCHMARKS, 112, initial_indent="  ", subsequent_indent=" " * 13)
        lines.append("")
    return "\n".join(lines + ["selfattn COMMAND --help: a command's flags, and an example."])


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Flags with their defaults; the description and the example as written."""


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser; only the chosen sub-command's module is imported (``--help`` imports none).
    A command's help ends with its module's ``EXAMPLE``. Flags are never abbreviated: a renamed
    or misspelt flag is refused, never taken for a longer one."""
    parser = argparse.ArgumentParser(prog="selfattn", usage="selfattn [-h] COMMAND ...", description=_listing(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, help=argparse.SUPPRESS,
                                prog="selfattn")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, help_text in COMMANDS.items():
        if name != chosen:
            sub.add_parser(name)
            continue
        mod = importlib.import_module(f"selfattn.cli.{name}")
        p = sub.add_parser(name, description=(mod.__doc__ or help_text).strip().split("\n\n")[0],
                           epilog=f"example:\n  {mod.EXAMPLE}", formatter_class=_HelpFormatter, allow_abbrev=False)
        mod.add_arguments(p)
        p.set_defaults(_main=mod.main, _parser=p)  # a command with sub-commands may set its own _parser
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    name = _name(argv)
    try:
        args, unknown = build_parser(argv).parse_known_args(argv)  # imports the command, and torch: seconds
        if signal.getsignal(signal.SIGINT) is _leave_while_starting:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # started: the command cleans up on Ctrl-C
        if unknown:  # the command's usage line, not the top-level one
            args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        _check_text_flags(args)
        with progress.reporting(progress.terminal()):  # the library's long steps, on stderr when it is a terminal
            return int(args._main(args) or 0)
    except BrokenPipeError:  # the reader went away (``selfattn sample ... | head``): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush cannot fail again
        return 0
    except (ValueError, TypeError, OSError) as e:
        if os.environ.get("SELFATTN_DEBUG"):
            raise
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # also while starting up, when main() is called in a process of its own
        print(f"{name}: interrupted", file=sys.stderr)
        return INTERRUPTED


TEXT_FLAGS = ("prompt", "chat", "text", "clean", "corrupt", "answer", "wrong")  # text a tokenizer reads


def _check_text_flags(args: argparse.Namespace) -> None:
    """Refuse text flags that are not valid UTF-8 (argv's undecodable bytes reach Python as lone
    surrogates, which no tokenizer takes), naming the flag and the byte."""
    for name in TEXT_FLAGS:
        value = getattr(args, name, None)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                byte = ord(value[e.start]) - 0xDC00 if 0xDC80 <= ord(value[e.start]) <= 0xDCFF else None
                what = f"byte 0x{byte:02x}" if byte is not None else f"character {value[e.start]!r}"
                raise ValueError(f"--{name} is not valid UTF-8 text: {what} at character {e.start}") from None


INTERRUPTED = 128 + signal.SIGINT  # main()'s status after Ctrl-C: 130, what a shell reports for it


def run() -> None:
    """The ``selfattn`` script and ``python -m selfattn``: exit with ``main()``'s status.

    Ctrl-C while starting up (parsing, importing the command and torch: seconds, nothing written
    yet) prints the one line and leaves at once: a KeyboardInterrupt raised inside a library's
    import code is not always an exception that reaches ``main``; numpy retries its import and
    fails with a traceback, another import swallows it and the command runs on. After start-up,
    Ctrl-C is a KeyboardInterrupt the command cleans up after. Either way the process then dies
    of SIGINT, as an interrupted program should (the shell reads 130 and stops a loop that ran it).
    """
    signal.signal(signal.SIGINT, _leave_while_starting)
    status = main()
    if status == INTERRUPTED:
        _die_of_sigint()
    sys.exit(status)


def _name(argv: list[str]) -> str:
    return " ".join(["selfattn", *[a for a in argv if not a.startswith("-")][:1]])  # "selfattn train"


def _leave_while_starting(signum, frame) -> None:
    print(f"{_name(sys.argv[1:])}: interrupted", file=sys.stderr)
    _die_of_sigint()


def _die_of_sigint() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
