"""A model's loss and perplexity on a text file, or on the assistant's tokens of a chat file.

``--ckpt`` takes any path ``selfattn sample`` takes: a run folder of ``selfattn train``, a
checkpoint file, a local folder written by ``transformers``' ``save_pretrained`` or a GGUF file
(see :mod:`selfattn.io.loading`). ``--data`` is a UTF-8 text file, tokenized with the model's own
tokenizer.

The text is read in contexts of ``--context`` tokens (default: the model's ``block_size``), one
starting every ``--stride`` tokens (default: ``--context``, disjoint contexts), as transformers'
perplexity guide reads it with its sliding window (:mod:`selfattn.training.evaluate`): each context
predicts the tokens past the previous one's end, so a smaller stride gives each token more context,
for more forwards.

A ``--data`` file whose name ends in ``.jsonl`` is chat data (:mod:`selfattn.training.chat`): one
conversation a line, each rendered with the model's chat template, read whole in one forward, and
only the assistant's tokens predicted (what fine-tuning on it trains); a conversation longer than
the model's ``block_size`` is refused, naming its line. ``--context`` and ``--stride`` are for text.

The model runs on ``--device`` in ``--dtype``, with ``--quantize int8`` on weight-only int8 (what
``selfattn sample --quantize int8`` decodes with: the perplexity says what it costs) and on
``--threads`` threads. Prints the loss in nats per predicted token and, last, the perplexity, its
exponential.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from selfattn._util import validate as _validate
from selfattn.cli import flags
from selfattn.io.loading import Loaded, load
from selfattn.training import chat
from selfattn.training.data import read_corpus
from selfattn.training.evaluate import masked_perplexity, perplexity

EXAMPLE = "selfattn eval --ckpt runs/tiny --data README.md --context 128 --stride 64"


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_model(p)
    flags.add_speed(p)
    p.add_argument("--data", required=True, metavar="FILE", default=argparse.SUPPRESS,
                   help="a UTF-8 text file, tokenized with the model's tokenizer; or a .jsonl chat file "
                        "({\"messages\": [...]} a line): the loss over the assistant's tokens")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="tokens one forward reads; unset: the model's block_size")
    p.add_argument("--stride", type=int, default=None, metavar="N",
                   help="tokens from one context's start to the next, at most --context; unset: --context "
                        "(disjoint contexts); smaller: more context per token, more forwards")


def main(args: argparse.Namespace) -> int:
    check_flags(args)  # before the model is loaded: seconds
    if chat.is_chat_data(args.data):
        return main_chat(args)
    text = read_text(args.data)
    device = _validate.device(args.device)
    loaded = load(args.ckpt, **flags.base_of(args))
    context = loaded.model.config.block_size if args.context is None else args.context
    if args.stride is not None and args.stride > context:
        raise ValueError(f"--stride {args.stride} is larger than the model's block_size {context}, the default "
                         f"--context; pass a smaller --stride")
    ids = loaded.require_tokenizer().encode(text)
    if len(ids) < 2:
        raise ValueError(f"--data {args.data!r} is {len(ids)} token(s) long with the tokenizer of {loaded.source}; "
                         f"a perplexity needs at least 2")
    model = flags.speed_up(args, loaded.model.to(device, flags.dtype(args)))
    result = perplexity(model, ids, context=context, stride=args.stride)
    print_model(loaded, device, args)
    print(f"  {args.data}: {len(ids):,} tokens, {result.tokens:,} predicted")
    print(f"  {result.contexts:,} context{'s' * (result.contexts != 1)} of up to {result.context} tokens, "
          f"stride {result.stride}")
    print(f"loss {result.loss:.6g}")
    print(f"perplexity {result.perplexity:.6g}")
    return 0


def main_chat(args: argparse.Namespace) -> int:
    """``selfattn eval`` on a chat file: the loss over the assistant's tokens, one conversation a forward."""
    conversations = chat.read_conversations(args.data)  # before the model is loaded
    device = _validate.device(args.device)
    loaded = load(args.ckpt, **flags.base_of(args))
    encoded = chat.encode_all(conversations, loaded.require_tokenizer(), loaded.require_chat(), where=args.data,
                              block_size=loaded.model.config.block_size)
    model = flags.speed_up(args, loaded.model.to(device, flags.dtype(args)))
    result = masked_perplexity(model, [(e.ids, e.targets()) for e in encoded])
    print_model(loaded, device, args)
    print(f"  {args.data}: {len(encoded):,} conversations, {sum(len(e.ids) for e in encoded):,} tokens, "
          f"{result.tokens:,} assistant tokens predicted")
    print(f"loss {result.loss:.6g}")
    print(f"perplexity {result.perplexity:.6g}")
    return 0


def print_model(loaded: Loaded, device, args: argparse.Namespace) -> None:
    """The first line of the report: the model, where it runs, in which dtype and weights."""
    cfg = loaded.model.config
    print(f"selfattn eval: {loaded.source}: {cfg.n_layer} layers x {cfg.n_head} heads, C={cfg.n_embd}, "
          f"{loaded.model.num_params() / 1e6:.2f}M parameters, on {device} in {args.dtype}"
          + (", weights int8" if args.quantize == "int8" else ""))


def check_flags(args: argparse.Namespace) -> None:
    """The flags' values that need no model, checked before it is loaded."""
    flags.check_threads(args)
    if chat.is_chat_data(args.data) and (args.context is not None or args.stride is not None):
        raise ValueError(f"--context and --stride read a text in sliding contexts; the chat file {args.data!r} is "
                         f"read one whole conversation a forward: drop them")
    for flag in ("context", "stride"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag} must be a positive number of tokens, got {value}")
    if args.context is not None and args.stride is not None and args.stride > args.context:
        raise ValueError(f"--stride {args.stride} is larger than --context {args.context}: the tokens between two "
                         f"contexts would never be predicted")


def read_text(path: str) -> str:
    """The text of the file ``path``; a ValueError naming it for a folder, a missing, empty, device
    or non-UTF-8 file."""
    if Path(path).is_dir():
        raise ValueError(f"--data {path!r} is a folder; give a text file")
    return read_corpus(path)[0]
