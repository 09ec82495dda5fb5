"""The OpenAI-compatible server (``selfattn serve``): HTTP on FastAPI and uvicorn, over a scheduler
that batches requests continuously.

- :mod:`~selfattn.serve.rows`: rows that each own their cache, decoded together in one forward
  (and why a row computes the bits it would alone);
- :mod:`~selfattn.serve.engine`: the scheduler's thread: jobs join at a step boundary, leave when done;
- :mod:`~selfattn.serve.jobs`: what the server asks of the engine, and the events it hears back;
- :mod:`~selfattn.serve.stops` (text as tokens come, cut at stop strings), :mod:`~selfattn.serve.logprobs`;
- :mod:`~selfattn.serve.schemas` (what a request may say), :mod:`~selfattn.serve.prompts` (its tokens),
  :mod:`~selfattn.serve.responses` (OpenAI's JSON and events), :mod:`~selfattn.serve.errors`;
- :mod:`~selfattn.serve.channel` (a request's jobs in flight), :mod:`~selfattn.serve.auth` (the API key),
  :mod:`~selfattn.serve.app` (the routes), :mod:`~selfattn.serve.server` (uvicorn, draining on SIGTERM).

FastAPI and uvicorn are the extra ``selfattn[serve]``; only :mod:`~selfattn.serve.app` and
:mod:`~selfattn.serve.server` import them (and :mod:`~selfattn.serve.errors`, their Starlette).
"""
