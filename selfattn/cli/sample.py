"""Generate text from a trained model, printed to the terminal token by token as it is produced.

``--ckpt`` takes a run folder of ``selfattn train`` (its newest checkpoint), one checkpoint
file (``ckpt-*.safetensors``, or a ``torch.save`` state dict ``.pt`` beside the run's
``config.json``), a local folder written by ``transformers``' ``save_pretrained`` (GPT-2,
Llama, Mistral, Qwen2, ...; one without a tokenizer selfattn reads is refused, saying so), or a
GGUF file (see :mod:`selfattn.io.loading`). Nothing is downloaded.

``--prompt`` continues a text; ``--chat`` asks a chat model a question: the model's chat template
writes it as the user's message, followed by what starts the assistant's answer, and the answer
is printed. Either way generation stops at the model's end-of-text token (eos) when it has one.
A chat and its answer must fit the model's context: one that does not is refused, as sliding the
context (below) would cut the template's start.

``--speculative`` decodes speculatively (:mod:`selfattn.generation.speculative`): the same text (greedy) or
the same distribution of texts (sampling), in fewer forwards when the drafts are right. ``lookup``
drafts by prompt lookup, ``self:N`` with the model's first N layers, ``draft:PATH`` with a smaller
model of the same vocabulary (any ``--ckpt`` kind of path).

``--quantize int8`` decodes with weight-only int8 (:mod:`selfattn.generation.int8`): a quarter of
float32's bytes per token read, at an accuracy cost that ``python -m benchmarks int8`` measures.
On the CPU each decode step is one call of the C++ decode kernel by default
(:mod:`selfattn.generation.kernel_step`, every family of floats but gpt-oss's experts). ``--compile``
(:func:`~selfattn.generation.compile_decode`) lays the weights out for the kernel first, so that its steps
equal the eager ones to the bit, and decodes what the kernel does not serve through ``torch.compile`` graphs
(elsewhere than the CPU, every step), the speculative forwards and a draft model's included.

Tokens are turned into bytes one at a time and decoded incrementally, so a character whose
UTF-8 bytes span several tokens is printed whole once its last byte arrives. Past the
model's ``block_size`` the context slides: it is cut to its last half and read again.

The model runs on ``--device`` in ``--dtype`` (a draft model too). ``--seed`` seeds the sampler,
0 by default as every command's: the same command prints the same text; another seed, another text.
"""
from __future__ import annotations

import argparse
import sys

import torch

from selfattn._util import validate as _validate
from selfattn.cli import flags
from selfattn.generation import compile_decode, decode_layout
from selfattn.generation.sampling import check_sampling
from selfattn.generation.speculative import Speculative
from selfattn.generation.text import new_tokens, text_pieces
from selfattn.io.loading import load

EXAMPLE = "selfattn sample --ckpt runs/tiny --prompt 'The ' --max-new-tokens 200 --seed 1"


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_model(p)
    p.add_argument("--prompt", default="", metavar="TEXT",
                   help="text to continue; empty: start from a newline (GPT-2: from <|endoftext|>, others: bos)")
    p.add_argument("--chat", default=None, metavar="TEXT",
                   help="a message to a chat model, written with its chat template; prints its answer")
    p.add_argument("--max-new-tokens", type=int, default=300, metavar="N", help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 = greedy; higher = more random")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the k most likely tokens only")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="nucleus: sample among the fewest tokens holding this probability")
    flags.add_seed(p, "seed of the sampler: same seed, same text")
    p.add_argument("--speculative", default=None, metavar="HOW",
                   help="speculative decoding, the same text in fewer forwards: lookup (prompt lookup), self:N "
                        "(the model's first N layers draft) or draft:PATH (a smaller model, the same vocabulary)")
    flags.add_speed(p)
    p.add_argument("--compile", action="store_true",
                   help="decode compiled, --speculative's forwards too: the weights laid out for the decode kernel "
                        "(the CPU's default) and torch.compile graphs for the steps it does not serve, after "
                        "compiling for seconds")


def main(args: argparse.Namespace) -> int:
    check_flags(args)  # before the model is loaded: seconds
    device = _validate.device(args.device)
    loaded = load(args.ckpt, **flags.base_of(args))
    tokenizer = loaded.require_tokenizer()
    if args.chat is not None:
        ids = tokenizer.encode(loaded.require_chat().render([{"role": "user", "content": args.chat}]))
        check_chat_fits(len(ids), args.max_new_tokens, loaded.model.max_positions)
    else:
        ids = tokenizer.encode(args.prompt, special=True) if args.prompt else [loaded.start_token]
    model = loaded.model.to(device, flags.dtype(args)).eval()
    model = decode_layout(model)  # inference only: the order batch-1 decoding reads fastest
    flags.speed_up(args, model)
    if args.compile:
        compile_decode(model)
    if args.prompt and not ids:
        raise ValueError(f"--prompt {args.prompt!r} encodes to no token with the tokenizer of {loaded.source}")
    if ids == [None]:
        raise ValueError(f"the tokenizer of {loaded.source} has no token for a newline and no <|endoftext|>, so an "
                         f"empty prompt has nothing to start from; pass --prompt TEXT")
    spec = speculation(args.speculative, model, device, len(ids) + args.max_new_tokens - 1, compile=args.compile,
                       dtype=flags.dtype(args))
    generator = torch.Generator(device).manual_seed(args.seed)
    last = args.prompt  # the last text written, to end its line if Ctrl-C cuts the text short
    try:
        sys.stdout.write(args.prompt)
        tokens = new_tokens(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, generator=generator, speculative=spec)
        for piece in text_pieces(tokenizer, until(tokens, loaded.eos)):
            sys.stdout.write(piece)
            sys.stdout.flush()
            last = piece or last
    except KeyboardInterrupt:  # "selfattn sample: interrupted" goes on a line of its own
        if last and not last.endswith("\n"):
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    sys.stdout.write("\n")
    return 0


def check_flags(args: argparse.Namespace) -> None:
    """The flags' values that need no model, checked before it is loaded."""
    flags.check_threads(args)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_sampling(args.temperature, args.top_k, args.top_p, flags=True)
    if args.chat is not None and args.prompt:
        raise ValueError("--chat and --prompt are two ways to start: pass one of them")
    if args.chat is not None and not args.chat.strip():
        raise ValueError("--chat needs a message, got an empty one")
    how = args.speculative
    if how is not None and how != "lookup" and not how.startswith(("self:", "draft:")):
        raise ValueError(f"--speculative must be lookup, self:N or draft:PATH, got {how!r}")
    if how == "draft:":
        raise ValueError("--speculative draft:: draft:PATH needs a path to the draft model")
    if how is not None and how.startswith("self:"):
        try:
            Speculative(how)  # N must be a positive int
        except ValueError as e:
            raise ValueError(f"--speculative {how}: {e}") from None


def check_chat_fits(prompt: int, new: int, context: int | None) -> None:
    """A chat of ``prompt`` tokens and ``new`` more must fit the model's ``context`` (None: no
    limit): sliding the context would cut the chat template's start, and the model would answer nothing."""
    if context is None or prompt + new - 1 <= context:  # the last new token is never fed back
        return
    room = context - prompt + 1
    fix = f"pass --max-new-tokens {room} or less" if room >= 1 else "shorten the message"
    raise ValueError(f"--chat: the chat is {prompt} tokens (its template included) and --max-new-tokens asks for "
                     f"{new} more, past the model's context of {context} tokens, which would cut the chat's "
                     f"start; {fix}")


def speculation(how: str | None, model, device, positions: int, *, compile: bool = False,
                dtype: torch.dtype = torch.float32) -> Speculative | None:
    """``--speculative``'s drafter, checked against ``model`` for ``positions`` positions (fewer
    past ``block_size``, where the context slides), or None; a draft model runs on ``device`` in
    ``dtype``, compiled with ``compile``."""
    if how is None:
        return None
    try:
        method = how
        if how.startswith("draft:"):
            method = decode_layout(load(how[len("draft:"):]).model.to(device, dtype).eval())
            if compile:
                compile_decode(method)
        spec = Speculative(method)
        spec.check(model, positions if model.max_positions is None else min(positions, model.max_positions))
    except (ValueError, TypeError) as e:
        raise ValueError(f"--speculative {how}: {e}") from None
    return spec


def until(tokens, stops: tuple[int, ...]):
    """``tokens`` up to the first of ``stops`` (left out): generation ends there."""
    for token in tokens:
        if token in stops:
            return
        yield token
