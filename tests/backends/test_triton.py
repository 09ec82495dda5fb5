"""The Triton backend: its refusals here, its kernels in a child process under the interpreter.

``TRITON_INTERPRET=1`` must be set before Triton is imported, so the kernel checks
(``tests/backends/triton_checks.py``) run in a fresh Python process; this file fails with the
child's output when any of them fails. The refusals need no kernel run: a CPU tensor
without the interpreter is exactly the case they must refuse.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.cli import run as bench
from selfattn import attention
from selfattn.masks import Mask

from helpers.extras import needs_triton

ROOT = Path(__file__).resolve().parents[2]


@needs_triton
@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_kernels_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/backends/triton_checks.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=900)
    report = child.stdout[-8000:] + child.stderr[-4000:]
    assert child.returncode == 0, f"tests/backends/triton_checks.py failed (exit {child.returncode}):\n{report}"
    assert " passed" in child.stdout and " failed" not in child.stdout, report


def test_missing_triton_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    monkeypatch.delitem(sys.modules, "selfattn.backends.triton", raising=False)
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ImportError, match=r"pip install 'selfattn\[triton\]'"):
        attention(q, q, q, backend="triton")


@needs_triton
@pytest.mark.parametrize("change,match", [
    (lambda q: q.double(), "dtype torch.float64 is not supported"),
    (lambda q: torch.randn(1, 2, 4, 256), "head dim D=256 is not supported"),
])
def test_refuses_dtype_and_head_dim(change, match):
    q = change(torch.randn(1, 2, 4, 16))
    with pytest.raises(ValueError, match=match):
        attention(q, q, q, backend="triton")


@needs_triton
def test_refuses_dropout():
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match=r"dropout is not implemented .*dropout_p=0.1"):
        attention(q, q, q, dropout_p=0.1, backend="triton")


@needs_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs CPU tensors")
def test_refuses_cpu_tensors_without_the_interpreter():
    from selfattn.backends import triton as triton_backend

    q = torch.randn(1, 2, 4, 16)
    for call in (lambda: attention(q, q, q, backend="triton"),
                 lambda: triton_backend.run(q, q, q, Mask(), scale=0.25)):
        with pytest.raises(ValueError, match=r"tensors on cpu need a GPU.*TRITON_INTERPRET=1"):
            call()


def test_gpu_suite_counts_the_causal_half_and_needs_a_gpu(capsys):
    from benchmarks import triton_gpu

    assert triton_gpu.visible_pairs(4, 4, causal=True) == 4 + 3 + 2 + 1
    assert triton_gpu.visible_pairs(2, 5, causal=True) == 4 + 5  # a cache: the queries sit at positions 3, 4
    assert triton_gpu.visible_pairs(5, 5, causal=True, window=2) == 1 + 2 + 2 + 2 + 2
    assert triton_gpu.visible_pairs(3, 5, causal=False) == 15
    assert triton_gpu.attention_flops(1, 2, 8, 8, 16, causal=False, backward=True) == 3.5 * 4 * 2 * 16 * 64
    case = (1, 2, 1, 64, 80, 16, "bf16", {"window": 8, "padding": True})  # the GPU gate's check, run on the CPU
    row = triton_gpu.check_parity(case, torch.device("cpu"), "tiled")
    assert row["ok"] and row["backend"] == "tiled" and [t["name"] for t in row["tensors"]] == ["out", "dq", "dk", "dv"]
    if not torch.cuda.is_available():
        assert bench(["triton", "--device", "cpu", "--out", "unused"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "needs a CUDA GPU" in err
