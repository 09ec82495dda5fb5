"""llama.cpp's programs as the tests' oracles (``llama-tokenize``): ``make llama-cpp``, a prerequisite of
``make test``, builds them into .cache/llama.cpp/build/bin (``$LLAMA_CPP_BIN``: another folder); its converter
(``convert_hf_to_gguf.py``) runs from the source it unpacks into .cache/llama.cpp/src."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import llama_cpp


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


SOURCE = llama_cpp.BIN.parents[1] / "src"  # llama.cpp's source, as `make llama-cpp` unpacks it


def source(path: str) -> Path:
    """The file ``path`` of llama.cpp's source (its converter, a vocabulary it ships); the test fails,
    saying how to get it, when it is absent."""
    if not (SOURCE / path).is_file():
        pytest.fail(f"{SOURCE / path} is missing: run `make llama-cpp` (a prerequisite of `make test`), which "
                    f"unpacks llama.cpp's source there", pytrace=False)
    return SOURCE / path


def convert(folder: Path, out: Path) -> Path:
    """The GGUF file (float32 tensors) that llama.cpp's own converter, ``convert_hf_to_gguf.py``, writes of the
    ``transformers`` folder ``folder``, at ``out``; run with the source's own ``gguf`` package, offline."""
    env = dict(os.environ, PYTHONPATH=str(SOURCE / "gguf-py"), HF_HUB_OFFLINE="1")
    command = [sys.executable, str(source("convert_hf_to_gguf.py")), str(folder), "--outfile", str(out),
               "--outtype", "f32"]
    done = subprocess.run(command, capture_output=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    return out
