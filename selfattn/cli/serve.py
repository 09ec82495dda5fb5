"""Serve a model over HTTP with OpenAI's API, batching requests continuously (``selfattn serve``).

Any model ``--ckpt`` reads (a run, a checkpoint, a transformers folder, a GGUF file) answers
``POST /v1/chat/completions`` (written with its chat template), ``POST /v1/completions`` (with
``logprobs`` and ``echo``, what lm-evaluation-harness's ``local-completions`` reads), ``GET /v1/models``,
``GET /health``, ``POST /tokenize`` and ``POST /detokenize``; streamed with ``"stream": true``.
Requests join the running batch at the next step and leave when done: up to ``--max-batch`` decode
together, ``--queue`` more wait, and past that a request gets 503. A greedy answer is token for token
the one ``selfattn sample --chat TEXT --temperature 0`` prints. SIGTERM or Ctrl-C lets the requests
in flight finish (30 s at most) and exits 0. The model runs on ``--device`` in ``--dtype``
(``--quantize int8``: on weight-only int8; ``--threads N``: on N threads).
``docs/serve.md`` has examples and the design.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from selfattn._util import validate as _validate
from selfattn.cli import flags
from selfattn.generation.layout import FEW
from selfattn.io.loading import load

EXAMPLE = "selfattn serve --ckpt runs/tiny --port 8000 --max-batch 4"


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_model(p)
    flags.add_speed(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, metavar="N", help="port to listen on (0: a free one, printed)")
    p.add_argument("--max-batch", type=int, default=8, metavar="N", help=f"rows decoded together (1..{FEW})")
    p.add_argument("--queue", type=int, default=64, metavar="N",
                   help="requests waiting for a row; past them, 503 with Retry-After")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="every request must send 'Authorization: Bearer KEY' (else 401)")


def main(args: argparse.Namespace) -> int:
    if not 1 <= args.max_batch <= FEW:
        raise ValueError(f"--max-batch must be in 1..{FEW}, got {args.max_batch}")
    flags.check_threads(args)
    if args.queue < 0:
        raise ValueError(f"--queue must be >= 0, got {args.queue}")
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key needs a key, got an empty one")
    try:
        from selfattn.serve import server
        from selfattn.serve.app import create_app
        from selfattn.serve.engine import Engine
        from selfattn.serve.rows import rows_keep_their_bits
    except ImportError as e:  # the extra is missing: one line saying which
        raise ValueError(str(e)) from None
    device = _validate.device(args.device)
    with server.listen(args.host, args.port) as sock:  # before loading: a port in use fails at once
        loaded = load(args.ckpt, **flags.base_of(args))
        loaded.require_tokenizer()
        path = Path(args.ckpt)
        name = path.stem if path.is_file() else path.resolve().name
        model = flags.speed_up(args, loaded.model.to(device, flags.dtype(args)))
        engine = Engine(model, max_batch=args.max_batch, queue=args.queue)
        app = create_app(loaded, engine, name=name, api_key=args.api_key)
        host, port = sock.getsockname()[:2]
        print(f"selfattn serve: {name} on http://{host}:{port}/v1 (max batch {args.max_batch}, queue {args.queue}); "
              f"SIGTERM or Ctrl-C stops", flush=True)
        if not rows_keep_their_bits(engine.model):
            print("selfattn serve: note: on this device (or with a mixture of experts) rows decoded together may "
                  "round differently from one row alone, so a greedy answer may differ from `selfattn sample`'s",
                  flush=True)
        server.server(app).run(sockets=[sock])
    print("selfattn serve: stopped", flush=True)
    return 0
