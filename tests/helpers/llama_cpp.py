"""llama.cpp's programs as the tests' oracles (``llama-tokenize``): ``make llama-cpp``, a prerequisite of
``make test``, builds them into the user's cache (:data:`benchmarks.assets.LLAMA_CPP_BIN`; ``$LLAMA_CPP_BIN``:
another folder); its converter (``convert_hf_to_gguf.py``) runs from the source it unpacks beside them
(:data:`benchmarks.assets.LLAMA_CPP_SRC`)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import assets, llama_cpp

from helpers.needs import needs


@needs("llama_cpp")
def program(name: str) -> Path:
    """The program's path; the test fails, saying how to build it, when it is absent."""
    path, why = llama_cpp.program(name)
    if path is None:
        pytest.fail(f"{why} (`make llama-cpp`, a prerequisite of `make test`, builds llama.cpp's programs)",
                    pytrace=False)
    return path


def tokenize(model: Path, text: str, folder: Path, *, bos: bool = True, pieces: bool = False) -> list[int] | bytes:
    """llama.cpp's ids of ``text`` (read verbatim from a file in ``folder``), control tokens written in
    it parsed as such, with the model's bos when ``bos``; ``pieces``: its output that lists each id with
    its piece (``"%6d -> '<piece bytes>'\\n"`` a token) instead."""
    file = folder / "prompt.txt"
    file.write_bytes(text.encode("utf-8"))
    command = [str(program("llama-tokenize")), "-m", str(model), "-f", str(file), "--no-escape",
               "--log-disable", *([] if bos else ["--no-bos"]), *([] if pieces else ["--ids"])]
    done = subprocess.run(command, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    if pieces:
        return done.stdout
    return [int(i) for i in done.stdout.decode().strip().strip("[]").split(",") if i.strip()]


SOURCE = assets.LLAMA_CPP_SRC  # llama.cpp's source, as `make llama-cpp` unpacks it


@needs("llama_cpp")
def source(path: str) -> Path:
    """The file ``path`` of llama.cpp's source (its converter, a vocabulary it ships); the test fails,
    saying how to get it, when it is absent."""
    if not (SOURCE / path).is_file():
        pytest.fail(f"{SOURCE / path} is missing: run `make llama-cpp` (a prerequisite of `make test`), which "
                    f"unpacks llama.cpp's source there", pytrace=False)
    return SOURCE / path


# runs the converter on (folder, out) pairs in one process: torch's import and the converter's take most of its time
_CONVERT_ALL = """
import os, runpy, sys
converter, *pairs = sys.argv[1:]
sys.path.insert(0, os.path.dirname(converter))  # where `python convert_hf_to_gguf.py` finds its package
for folder, out in zip(pairs[::2], pairs[1::2]):
    sys.argv = [converter, folder, "--outfile", out, "--outtype", "f32"]
    try:
        runpy.run_path(converter, run_name="__main__")
    except (Exception, SystemExit) as e:  # its sys.exit(1) too: on to the next folder
        print(f"{folder}: {e!r}", flush=True)  # its log (stderr) says more
"""


def convert(jobs: list[tuple[Path, Path]]) -> str:
    """For each ``(folder, out)`` of ``jobs``, the GGUF file (float32 tensors) that llama.cpp's own converter,
    ``convert_hf_to_gguf.py``, writes of the ``transformers`` folder, at ``out``: one after another in one process,
    with the source's own ``gguf`` package, offline. Returns the folders it failed on and the end of its log, for
    the message of a test whose folder it did not convert (no file at ``out``)."""
    env = dict(os.environ, PYTHONPATH=str(SOURCE / "gguf-py"), HF_HUB_OFFLINE="1")
    pairs = [str(p) for job in jobs for p in job]
    done = subprocess.run([sys.executable, "-c", _CONVERT_ALL, str(source("convert_hf_to_gguf.py")), *pairs],
                          capture_output=True, timeout=600, env=env)
    return done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")[-2000:]


def complete(path, prompt: str, n: int = 24, context: int = 128) -> bytes:
    """llama.cpp's greedy continuation of ``prompt`` on the file ``path``: the bytes it prints
    (:func:`benchmarks.llama_cpp.complete`, on 2 threads)."""
    return llama_cpp.complete(program("llama-completion"), path, prompt, n, threads=2, context=context, timeout=120)
