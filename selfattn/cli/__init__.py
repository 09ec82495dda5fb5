"""The ``selfattn`` command: one thin dispatcher over sub-commands.

Each sub-command is a module of this package, ``selfattn.cli.<command>``, exposing
``add_arguments(parser)`` and ``main(args) -> int``: it parses, calls the library, prints.
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

# name -> (module, one-line help); a module is imported only when its command runs.
COMMANDS = {  # name -> one-line help; the module is selfattn.cli.<name>
    "demo": "the seed's worked example, computed live: shape walk, parameters, causality",
    "check": "audit causality: every backend x option, a tiny GPT and its KV cache, or your module",
    "train": "train a GPT on text (built-in corpus or --data); torchrun for DDP/FSDP; --resume",
    "sample": "stream text (or a chat answer) from a trained run, a transformers folder or a GGUF file",
    "eval": "a model's loss and perplexity on a text file, over sliding windows as transformers' guide reads it",
    "heads": "attention maps and ranked head roles (previous-token, induction) of a model",
    "induction": "train a 2-layer attention-only GPT until induction heads form; 4 heads vs 1",
    "scaling": "why scores are scaled by 1/sqrt(head_dim): the softmax at init, three scalings",
    "explore": "one self-contained HTML page: head view, model view, head roles, next-token predictions",
    "export": "write a folder transformers loads (AutoModelForCausalLM, pipeline) or a GGUF file llama.cpp runs",
    "calibrate": "time auto's candidate backends on this machine and keep the fastest for auto to follow",
    "serve": "an OpenAI-compatible HTTP server (chat, completions, streaming) that batches requests continuously",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser; only the chosen sub-command's module is imported (``--help`` imports none)."""
    parser = argparse.ArgumentParser(prog="selfattn", description="Causal multi-head self-attention from scratch.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, help_text in COMMANDS.items():
        if name != chosen:
            sub.add_parser(name, help=help_text)
            continue
        mod = importlib.import_module(f"selfattn.cli.{name}")
        p = sub.add_parser(name, help=help_text, description=(mod.__doc__ or help_text).strip().split("\n\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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


TEXT_FLAGS = ("prompt", "chat", "text")  # flags whose value is text a tokenizer reads


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
