"""llama.cpp as a peer of batch-1 decoding: the anchor users pick on a CPU.

Where ``llama_cpp`` (PyPI ``llama-cpp-python``, built from source: 11 minutes on a 2-core
Xeon) is importable, :func:`decode_speed` times its greedy decoding of a GGUF file with this
process's thread count, on the same prompt tokens as ours; never a dependency of the tests.
It reads the file's weights as stored (SmolLM2's Q4_1: 4-bit blocks with a scale and a
minimum), where we decode the dequantised float (or our int8) weights: the same model, not the
same bytes per token. Built for the native CPU (llama-cpp-python 0.3.36) it crashed on every
prompt of two tokens or more on an AMX Xeon; built without AMX (``docs/benchmarks.md``) it runs.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

INSTALL = "pip install llama-cpp-python (it builds llama.cpp from source)"


def unavailable(path: str | None) -> str | None:
    """Why llama.cpp cannot decode ``path`` here, or None when it can."""
    if path is None or Path(path).suffix != ".gguf":
        return "llama.cpp reads a GGUF file; this run's model is not one"
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return f"llama_cpp is not importable: {INSTALL}"
    return None


def decode_speed(path: str, prompt: list[int], new_tokens: int, reps: int) -> dict:
    """Seconds per greedily decoded token (the median of ``reps`` runs of ``new_tokens`` steps
    after the prompt's prefill), with ``torch.get_num_threads()`` threads; and its version."""
    import llama_cpp

    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(model_path=path, n_ctx=len(prompt) + new_tokens + 1, n_threads=threads,
                          n_threads_batch=threads, n_batch=max(len(prompt), 8), verbose=False)
    times = []
    for _ in range(reps + 1):  # the first run warms up
        llm.reset()
        llm.eval(prompt)
        start = time.perf_counter()
        for _ in range(new_tokens):
            llm.eval([llm.sample(top_k=1)])
        times.append((time.perf_counter() - start) / new_tokens)
    return {"s_per_token": statistics.median(times[1:]), "threads": threads, "version": llama_cpp.__version__}
