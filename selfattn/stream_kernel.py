"""C++ kernels for decoding, each streaming its operand from memory once: a few rows times a
matrix (:func:`rows`), and a few causal queries per head over the KV cache (:func:`attend`).

Decoding one token multiplies one row (or a few: a batch, a speculative verification) by every
weight matrix, so a step lasts as long as the matrices take to stream from memory through the
product kernel. PyTorch's kernels stream them slower than the memory allows for some dtypes and
machines; this one widens each entry to float32 as it arrives (bfloat16 and float16 by a shift or
a conversion instruction, int8 with its per-row scale) and sums in float32. Where the CPU has
AVX512-BF16, bfloat16 rows times a bfloat16 matrix take its pair products (each bfloat16 product
is exact in float32), without widening either. On a 2-core AMD EPYC, the 121 matrices of
SmolLM2-135M, 2 threads, one process, medians of 7: one row float32 18.6 ms (28.9 GB/s; a sum of
the same bytes 17.6 ms), bfloat16 9.8 (the sum 9.2), int8 6.4; 8 rows 32.6, 14.1 (widened 26.2)
and 20.0. Since the next matrix rows are fetched while several rows compute (``products_of``), 8 rows
take 22.9, 12.3 and 16.4 ms against 32.7, 13.9 and 19.1 before, in one run (one row 12.8, 7.6
and 5.0 that day). Earlier measurements: a compiled SmolLM2 step in bfloat16 14.5 ms against 16.7 with the
loop ``torch.compile`` wrote for the CPU (the form it replaced), int8 11.1 against 16.3 with
PyTorch's ``_weight_int8pack_mm``.

The vectors are 256 bits wide in every build for a CPU with AVX2, the AVX-512 ones too: there
512-bit vectors streamed SmolLM2's matrices slower from memory (float32 20.5 ms, 26.3 GB/s; int8
18.5) and a compiled float32 SmolLM2 step took 22.5 ms against 20.1, though they were faster on a
matrix the caches held. (16-lane vectors in the AVX2 build, which GCC lowers partly to scalar moves,
took 10x the time of its 8-lane ones.)

A decoded token's attention reads the cache once too, and so does a speculative verification's (a
few causal queries at the end of the keys): :func:`attend` splits the keys into fixed runs, each
run's scores, exponentials and weighted values summed in float32 for every query row that reads its
kv head, and merges the runs after (the sdpa backend calls it for such requests on the CPU where
the build is an AVX2 or AVX-512 one, :func:`attends`; its docstring has the measurements against
SDPA).

``stream_kernel.cpp`` is compiled on first use with the machine's compiler (``$CXX`` or ``c++``;
torch.compile needs one on the CPU too), about 6 s, for the widest instruction set the CPU runs
and the compiler builds (:func:`instruction_sets`, :func:`chosen`), and kept in
:func:`selfattn._files.cache_dir`, named by a hash of the source, the flags and the torch version.
:func:`failure` says why it cannot be used (no compiler, a compile error), and the callers then
keep PyTorch's kernels. The operators are ``torch.ops.selfattn_stream_<set>.rows`` and ``.attend``:
``torch.compile`` calls them as they are, within one graph. The same library holds ``.step``, a
pre-norm decoder's whole decode step on these kernels (``decode_kernel.h``,
:mod:`selfattn.decode_kernel`).

A row's sums take the same order whatever rows come with it, so its result has the same bits
alone or among others (the C++ file says how).
"""
from __future__ import annotations

import functools
import hashlib
import os
import subprocess
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils import cpp_extension

from selfattn import _files
from selfattn.backends import _common

SOURCE = Path(__file__).with_suffix(".cpp")
HEADER = SOURCE.with_name("decode_kernel.h")  # one decode step, built into the same library (selfattn.decode_kernel)
# instruction set -> the compiler's flags for it, fastest first
FLAGS = {
    "avx512bf16": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "baseline": (),  # whatever the compiler targets by default
}
# OpenMP: ATen's parallel_for; no contraction: the kernel fuses where it means to (the C++ file says why)
COMMON = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off")
MATRIX_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)
ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def instruction_sets(capability: str | None = None, *, bf16: bool | None = None) -> tuple[str, ...]:
    """The sets of :data:`FLAGS` this CPU runs, fastest first, from torch's reading of it
    (``torch.backends.cpu.get_cpu_capability()``, or ``capability`` given) and whether it has
    AVX512-BF16 (``torch.cpu._is_avx512_bf16_supported()``, unless ``SELFATTN_NATIVE_HALF=0``
    has it taken for a CPU without, as the rest of the library does; or ``bf16`` given)."""
    capability = capability or torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        if bf16 is None:
            bf16 = torch.cpu._is_avx512_bf16_supported() and _common.multiplies_natively(torch.device("cpu"),
                                                                                          torch.bfloat16)
        return ("avx512bf16",) * bf16 + ("avx512", "avx2", "baseline")
    return {"AVX2": ("avx2", "baseline")}.get(capability, ("baseline",))


BEST = instruction_sets()[0]  # the widest set this CPU runs


def rows(w: Tensor, x: Tensor, scale: Tensor | None = None, *, isa: str | None = None) -> Tensor:
    """``x`` (N, in) times ``w`` (out, in) transposed, times ``scale`` (out,) per column when ``w``
    is int8: ``(N, out)`` in ``x``'s dtype, summed in float32. ``isa`` names the build (one of
    :func:`instruction_sets`; None: :func:`chosen`), built at the first call (:func:`failure`
    says whether it can be)."""
    isa = isa or chosen()
    return (_loaded.get(isa) or load(isa)).rows(w, x, scale)


def attend(q: Tensor, k: Tensor, v: Tensor, scale: float, *, isa: str | None = None) -> Tensor:
    """Attention of a few queries at the end of the keys: ``q`` ``(B, H, T, D)``, the last T of the
    S positions of ``k`` and ``v`` ``(B, Hkv, S, D)`` (H a multiple of Hkv: grouped queries read
    their kv head), causal (query t sees keys 0 .. S - T + t; one query sees every key), softmax of
    the scores times ``scale``, summed in float32: ``(B, H, T, D)`` in ``q``'s dtype. The cache is
    read once, k and v as they are stored (float32, bfloat16 or float16; rows contiguous). No gradient."""
    isa = isa or chosen()
    return (_loaded.get(isa) or load(isa)).attend(q, k, v, scale)


_chosen: list[str] = []  # chosen()'s answer, once asked


@torch.compiler.assume_constant_result  # a graph that calls rows() runs the build chosen when it was traced
def chosen() -> str:
    """The build :func:`rows` runs: the widest set this CPU runs that builds here (a compiler
    too old for AVX512-BF16 still builds AVX-512), or :data:`BEST` when none does; asked once."""
    if not _chosen:
        _chosen.append(next((isa for isa in instruction_sets() if failure(isa) is None), BEST))
    return _chosen[0]


@functools.cache
def failure(isa: str | None = None) -> str | None:
    """Why the kernel for ``isa`` (None: :func:`chosen`'s, the widest set that builds, or the
    widest set's reason when none does) cannot run here, in one line (None when it can: it is
    then built and loaded). Asked once per process: a compiler that failed is not run again."""
    if isa is None:
        return failure(chosen())
    try:
        load(isa)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return None


# the builds whose attend beat PyTorch's SDPA on the EPYC of the sdpa backend's docstring. One float32 query of
# SmolLM2's heads, 30 layers' caches in turn, us a layer (AVX-512, AVX2 and baseline builds against SDPA): over 512
# keys 35, 33 and 49 against 48, over 2048 (from memory) 197, 203 and 257 against 247 (the baseline's bfloat16, 64
# over 512 keys, beat SDPA's 278, but hardly the float32 path the backend takes there)
ATTENDS = ("avx512bf16", "avx512", "avx2")


@torch.compiler.assume_constant_result  # traced, a graph holds the answer it had then
def attends() -> bool:
    """Whether :func:`attend` serves here: the kernel builds (:func:`failure` is None) for a set of
    :data:`ATTENDS`. Built and loaded at the first ask."""
    return failure() is None and chosen() in ATTENDS


_loaded: dict[str, Any] = {}  # isa -> its operators (torch.ops.selfattn_stream_<isa>), once loaded


def load(isa: str) -> Any:
    """The operators built for ``isa`` (``.rows``, ``.attend``), compiled (or found in the cache)
    and loaded, once a process."""
    if isa not in FLAGS:
        raise ValueError(f"isa must be one of {', '.join(map(repr, FLAGS))}, got {isa!r}")
    if isa not in _loaded:
        torch.ops.load_library(str(_build(isa)))
        name = f"{_namespace(isa)}::rows"
        torch.library.register_fake(name)(_fake_rows)
        torch.library.register_autograd(name, _backward, setup_context=_save)
        torch.library.register_fake(f"{_namespace(isa)}::attend")(_fake_attend)
        _loaded[isa] = getattr(torch.ops, _namespace(isa))
    return _loaded[isa]


def _fake_rows(w: Tensor, x: Tensor, scale: Tensor | None) -> Tensor:  # the shape torch.compile traces with
    return x.new_empty(x.shape[0], w.shape[0])


def _fake_attend(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _save(ctx, inputs: tuple, output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    """The gradients of ``y = x · (scale ·) wᵀ``: ``grad · w`` for the rows, ``gradᵀ · x`` for a
    float matrix (an int8 one takes none)."""
    w, x, scale = ctx.saved_tensors
    weight = w.to(grad.dtype) if scale is None else w.to(grad.dtype) * scale.to(grad.dtype)[:, None]  # (out, in)
    dw = (grad.t() @ x.to(grad.dtype)).to(w.dtype) if ctx.needs_input_grad[0] else None  # (out, N) @ (N, in)
    dx = (grad @ weight).to(x.dtype) if ctx.needs_input_grad[1] else None  # (N, out) @ (out, in)
    return dw, dx, None


def _namespace(isa: str) -> str:
    return f"selfattn_stream_{isa}"


def _command(isa: str, output: Path) -> list[str]:
    torch_lib = Path(torch.__file__).parent / "lib"
    return [os.environ.get("CXX", "c++"), *COMMON, *FLAGS[isa], f"-DSELFATTN_NAMESPACE={_namespace(isa)}",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(f"-I{p}" for p in cpp_extension.include_paths()),
            str(SOURCE), "-o", str(output), f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]


def _build(isa: str) -> Path:
    """The shared library for ``isa``: from the cache when the same source, flags and torch built
    it, else compiled into a temporary beside it and renamed (a concurrent build loses nothing)."""
    command = _command(isa, Path("OUT"))
    sources = SOURCE.read_bytes() + HEADER.read_bytes()
    key = hashlib.sha256(sources + " ".join(command).encode() + torch.__version__.encode()).hexdigest()
    library = _files.cache_dir() / "kernels" / f"stream_kernel-{isa}-{key[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    tmp = library.with_name(f".{library.name}.tmp-{os.getpid()}")
    try:
        done = subprocess.run(_command(isa, tmp), capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()[-1:]
            raise RuntimeError(f"compiling {SOURCE.name} for {isa} failed: {errors[0] if errors else done.returncode}")
        os.replace(tmp, library)
    finally:
        tmp.unlink(missing_ok=True)
    return library
