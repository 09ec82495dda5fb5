"""The C++ kernel of decoding's products: every build this CPU runs (AVX-512, AVX2, the compiler's
baseline) against a float64 product, for every matrix and row dtype and lengths that leave every
remainder; a row's bits the same alone or among others; gradients; one compiled graph; and a
machine without a compiler, where it says why and the callers keep PyTorch's kernels."""
import concurrent.futures
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from selfattn._util import files as _files
from selfattn.kernels import build, features, matvec
from selfattn.kernels.features import assume_native_half
from selfattn.kernels.matvec import MATRIX_DTYPES, ROW_DTYPES

ISAS = features.instruction_sets()  # those this CPU runs: each built and tested here
# (rows, out, in): in = 4 runs of 16 and more, leftover runs, a tail shorter than a run, shorter than one run
SHAPES = [(1, 37, 576), (5, 64, 1000), (16, 33, 7), (3, 8, 64 + 16 * 3 + 5), (7, 130, 96)]


def matrix(out: int, n_in: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = torch.randn(out, n_in)
    if dtype != torch.int8:
        return w.to(dtype), None
    scale = w.abs().amax(1) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("w_dtype", MATRIX_DTYPES)
@pytest.mark.parametrize("x_dtype", ROW_DTYPES)
def test_the_kernel_is_the_float64_product_summed_in_float32(isa, w_dtype, x_dtype):
    for n, out, n_in in SHAPES:
        w, scale = matrix(out, n_in, w_dtype)
        x = torch.randn(n, n_in).to(x_dtype)
        exact = x.double() @ w.double().t() * (1 if scale is None else scale.double())  # (n, out)
        y = matvec.rows(w, x, scale, isa=isa)
        assert y.dtype == x_dtype and y.shape == (n, out)
        # float32 sums of n_in products: a few float32 roundings; a half-precision output rounds once more
        tol = 2e-6 if x_dtype == torch.float32 else 2 ** -8 if x_dtype == torch.bfloat16 else 2 ** -11
        error = ((y.double() - exact).abs() / exact.abs().max()).max().item()
        assert error < tol, (n, out, n_in, error)
        # a row's sums take the same order alone as among others: the same bits
        assert torch.equal(torch.cat([matvec.rows(w, x[i:i + 1], scale, isa=isa) for i in range(n)]), y)


def test_float32_rows_are_not_rounded_to_a_half_dtype_on_the_way():  # control: the tolerance above is tight
    w, x = torch.randn(64, 576), torch.randn(2, 576)
    exact = x.double() @ w.double().t()
    rounded = matvec.rows(w, x.bfloat16().float())
    assert ((rounded.double() - exact).abs() / exact.abs().max()).max() > 1e-4
    assert ((matvec.rows(w, x).double() - exact).abs() / exact.abs().max()).max() < 2e-6


def test_strided_inputs_and_a_scale_of_another_dtype_give_the_same_product():
    w, scale = matrix(48, 80, torch.int8)
    x = torch.randn(80, 3).t()  # (3, 80), not contiguous
    y = matvec.rows(w, x.contiguous(), scale)
    assert torch.equal(matvec.rows(w, x, scale), y)
    bf16 = matvec.rows(w, x.contiguous(), scale.bfloat16())
    torch.testing.assert_close(bf16, matvec.rows(w, x.contiguous(), scale.bfloat16().float()), rtol=0, atol=0)


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.int8])
def test_gradients_are_those_of_the_product(w_dtype):
    w, scale = matrix(24, 40, w_dtype)
    x = torch.randn(5, 40, requires_grad=True)
    weight = w.float() * (1 if scale is None else scale[:, None])
    w_leaf = w.clone().requires_grad_(w_dtype.is_floating_point)
    grad = torch.randn(5, 24)
    matvec.rows(w_leaf, x, scale).backward(grad)
    torch.testing.assert_close(x.grad, grad @ weight, rtol=1e-5, atol=1e-5)
    if w_dtype.is_floating_point:
        torch.testing.assert_close(w_leaf.grad, grad.t() @ x.detach(), rtol=1e-5, atol=1e-5)


def test_a_compiled_function_calls_the_kernel_within_one_graph():
    w, x = torch.randn(40, 24), torch.randn(3, 24)
    compiled = torch.compile(lambda w, x: torch.relu(matvec.rows(w, x)) * 2, fullgraph=True)
    assert torch.equal(compiled(w, x), torch.relu(matvec.rows(w, x)) * 2)


def test_the_kernel_names_what_it_cannot_multiply():
    with pytest.raises(RuntimeError, match=re.escape("w (out, in) and x (N, in), got [4, 8] and [2, 7]")):
        matvec.rows(torch.randn(4, 8), torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="int8 w takes a scale, others none"):
        matvec.rows(torch.ones(4, 8, dtype=torch.int8), torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="a matrix of Double"):
        matvec.rows(torch.randn(4, 8, dtype=torch.float64), torch.randn(2, 8))
    with pytest.raises(ValueError, match="isa must be one of 'avx512bf16', 'avx512', 'avx2', 'baseline', got 'sse9'"):
        matvec.load("sse9")


@pytest.mark.parametrize("capability, bf16, sets", [
    ("AVX512", True, ("avx512bf16", "avx512", "avx2", "baseline")), ("AVX512", False, ("avx512", "avx2", "baseline")),
    ("AVX2", False, ("avx2", "baseline")), ("DEFAULT", False, ("baseline",)), ("SVE256", False, ("baseline",))])
def test_the_builds_follow_what_the_cpu_runs(capability, bf16, sets):
    assert features.instruction_sets(capability, bf16=bf16) == sets


@pytest.mark.parametrize("native", [False, True])
def test_a_cpu_taken_for_one_without_native_bfloat16_gets_no_pair_products(native):
    before = assume_native_half(native)  # SELFATTN_NATIVE_HALF=0 or 1
    try:
        pairs = "avx512bf16" in features.instruction_sets("AVX512")
    finally:
        assume_native_half(before)
    assert pairs == (native and torch.cpu._is_avx512_bf16_supported())  # never an instruction the CPU lacks


def test_the_kernel_runs_the_widest_set_that_builds_here(monkeypatch):
    either_failure = matvec.failure.__wrapped__  # for one set, or with None for any set
    monkeypatch.setattr(features, "instruction_sets", lambda: ("avx512bf16", "avx512", "baseline"))
    reasons = {"avx512bf16": "no -mavx512bf16 in this compiler", "avx512": None, "baseline": None}
    monkeypatch.setattr(matvec, "failure", lambda isa=None: reasons[isa])

    def chosen() -> str:  # asked afresh
        monkeypatch.setattr(matvec, "_chosen", [])
        return matvec.chosen()

    def any_failure() -> str | None:  # asked afresh
        monkeypatch.setattr(matvec, "_chosen", [])
        return either_failure(None)

    assert chosen() == "avx512" and any_failure() is None
    reasons.update(avx512="no compiler", baseline="no compiler")  # none builds: the widest set's reason
    assert any_failure() == "no -mavx512bf16 in this compiler"
    reasons["avx512bf16"] = None  # control: the widest set builds, and runs
    assert chosen() == "avx512bf16" and any_failure() is None


def uncached_failure(monkeypatch, tmp_path) -> str | None:
    """:func:`matvec.failure` of a fresh build into ``tmp_path``, the process's kernels untouched."""
    monkeypatch.setenv("SELFATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(matvec, "load", build.library)
    return matvec.failure.__wrapped__(features.best())


def test_without_a_compiler_the_kernel_says_why_and_builds_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    why = uncached_failure(monkeypatch, tmp_path)
    assert why is not None and "no-such-compiler" in why and "\n" not in why
    assert not built_files(tmp_path)


def built_files(folder) -> list:
    """The libraries and temporaries under ``folder`` (a build's lock file is neither)."""
    return [p for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".lock")]


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_a_compile_error_is_one_line_naming_the_source(monkeypatch, tmp_path):
    broken = tmp_path / "src" / "matvec.cpp"
    broken.parent.mkdir()
    broken.write_text("this is not C++;\n")
    monkeypatch.setattr(build, "SOURCES", (broken, build.SOURCES[1]))
    why = uncached_failure(monkeypatch, tmp_path)
    assert why.startswith(f"compiling matvec.cpp and decode.cpp for {features.best()} failed: ") and "\n" not in why
    assert not built_files(tmp_path / "kernels")  # no temporary left behind


def test_a_build_is_found_again_by_its_hash(monkeypatch):  # control of the two above: here it builds
    cache = _files.cache_dir()
    assert matvec.failure() is None
    assert uncached_failure(monkeypatch, cache) is None
    built = build.library(features.best())
    assert built.parent == cache / "kernels" and built.name.startswith(f"matvec-{features.best()}-")
    before = built.stat().st_mtime_ns
    assert build.library(features.best()) == built and built.stat().st_mtime_ns == before  # not rebuilt


def test_processes_building_one_library_at_once_compile_it_once(monkeypatch, tmp_path):
    monkeypatch.setenv("SELFATTN_CACHE_DIR", str(tmp_path))
    compiles = []

    def compiler(cmd, **kwargs):  # slow enough that the second caller arrives while the first compiles
        compiles.append(cmd)
        time.sleep(0.3)
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"library")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(build.subprocess, "run", compiler)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # a flock per open file: threads wait as processes do
        paths = list(pool.map(build.library, ["baseline", "baseline"]))
    assert paths[0] == paths[1] and paths[0].read_bytes() == b"library" and len(compiles) == 1
    paths[0].unlink()  # control: with the library gone, the next caller compiles it again
    assert build.library("baseline") == paths[0] and len(compiles) == 2
