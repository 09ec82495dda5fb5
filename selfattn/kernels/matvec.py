"""C++ kernels for decoding's matrix-vector products, each reading its operand from memory once: a
few rows times a matrix (:func:`rows`), and a few causal queries per head over the KV cache
(:func:`attend`: scores, then weights times values, two matrix-vector products per query row).

Decoding one token multiplies one row (or a few: a batch, a speculative verification) by every
weight matrix, so a step lasts as long as the matrices take to stream from memory through the
product kernel. PyTorch's kernels stream them slower than the memory allows for some dtypes and
machines (``docs/benchmarks.md``, "The product forms of decoding"); this one widens each entry to
float32 as it arrives (bfloat16 and float16 by a shift or a conversion instruction, int8 with its
per-row scale) and sums in float32. Where the CPU has AVX512-BF16, bfloat16 rows times a bfloat16
matrix take its pair products (each bfloat16 product is exact in float32), without widening either.
With several rows, the next group of matrix rows is fetched while the rows compute.

The vectors are 256 bits wide in every build for a CPU with AVX2, the AVX-512 ones too: 512-bit
vectors streamed the matrices slower from memory, though they were faster on a matrix the caches
held (``matvec.h`` says more).

A decoded token's attention reads the cache once too, and so does a speculative verification's (a
few causal queries at the end of the keys): :func:`attend` splits the keys into fixed runs, each
run's scores, exponentials and weighted values summed in float32 for every query row that reads its
kv head, and merges the runs after (the sdpa backend calls it for such requests on the CPU where
the build is an AVX2 or AVX-512 one, :func:`attends`).

The library is built on first use (:mod:`selfattn.kernels.build`) for the widest instruction set the
CPU runs and the compiler builds (:func:`chosen`); :func:`failure` says why it cannot be used (no
compiler, a compile error), and the callers then keep PyTorch's kernels. The operators are
``torch.ops.selfattn_matvec_<set>.rows``, ``.attend`` and ``.step`` (a decoder's whole decode
step, :mod:`selfattn.generation.kernel_step`): ``torch.compile`` calls them as they are,
within one graph.

A row's sums take the same order whatever rows come with it, so its result has the same bits
alone or among others (``matvec.h`` says how).
"""
from __future__ import annotations

import functools
import subprocess
from typing import Any

import torch
from torch import Tensor

from selfattn.kernels import build, features

MATRIX_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)
ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rows(w: Tensor, x: Tensor, scale: Tensor | None = None, *, isa: str | None = None) -> Tensor:
    """``x`` (N, in) times ``w`` (out, in) transposed, times ``scale`` (out,) per column when ``w``
    is int8: ``(N, out)`` in ``x``'s dtype, summed in float32. ``isa`` names the build (one of
    :func:`~selfattn.kernels.features.instruction_sets`; None: :func:`chosen`), built at the first
    call (:func:`failure` says whether it can be)."""
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
    too old for AVX512-BF16 still builds AVX-512), or the widest set when none does; asked once."""
    if not _chosen:
        sets = features.instruction_sets()
        _chosen.append(next((isa for isa in sets if failure(isa) is None), sets[0]))
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


# the builds whose attend beat PyTorch's SDPA over a cache in memory (docs/benchmarks.md, "The product forms of
# decoding"); the baseline build's did not
ATTENDS = ("avx512bf16", "avx512", "avx2")


@torch.compiler.assume_constant_result  # traced, a graph holds the answer it had then
def attends() -> bool:
    """Whether :func:`attend` serves here: the kernel builds (:func:`failure` is None) for a set of
    :data:`ATTENDS`. Built and loaded at the first ask."""
    return failure() is None and chosen() in ATTENDS


_loaded: dict[str, Any] = {}  # isa -> its operators (torch.ops.selfattn_matvec_<isa>), once loaded


def load(isa: str) -> Any:
    """The operators built for ``isa`` (``.rows``, ``.attend``, ``.step``), compiled (or found in
    the cache, :func:`selfattn.kernels.build.library`) and loaded, once a process."""
    if isa not in _loaded:
        torch.ops.load_library(str(build.library(isa)))
        namespace = build.namespace(isa)
        torch.library.register_fake(f"{namespace}::rows")(_fake_rows)
        torch.library.register_autograd(f"{namespace}::rows", _backward, setup_context=_save)
        torch.library.register_fake(f"{namespace}::attend")(_fake_attend)
        _loaded[isa] = getattr(torch.ops, namespace)
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
