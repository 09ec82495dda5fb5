"""What this machine's processor runs, asked lazily: a leaf, importing nothing of the package.

:func:`instruction_sets` names the builds of the C++ kernels this CPU can run, fastest first;
:func:`multiplies_natively` says whether a device multiplies half precision at its float32 rate
(which several choices follow: tiled's tile dtype, ``auto``'s rules, the kernels' AVX512-BF16
build, the benchmarks' dtypes); :func:`assume_native_half` (or ``SELFATTN_NATIVE_HALF=0/1``)
decides it, so every such choice runs, and is tested, either way on any machine.

Nothing here is asked at import. PyTorch's CPU probes beyond ``get_cpu_capability`` are private
(``torch.cpu._is_avx512_bf16_supported`` and its kin): each is called through :func:`_cpu_has`,
which answers False where a version of torch lacks it or it fails.
"""
from __future__ import annotations

import functools
import os

import torch

# instruction set -> the compiler's flags for it, fastest first (selfattn.kernels.build compiles with them)
FLAGS = {
    "avx512bf16": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "baseline": (),  # whatever the compiler targets by default
}


def _cpu_has(probe: str) -> bool:
    """``torch.cpu.<probe>()`` (a private probe of torch), False where torch lacks it or it fails."""
    fn = getattr(torch.cpu, probe, None)
    try:
        return bool(fn()) if callable(fn) else False
    except (RuntimeError, AttributeError):
        return False


def _env_native_half() -> bool | None:
    value = os.environ.get("SELFATTN_NATIVE_HALF", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"SELFATTN_NATIVE_HALF must be 0, 1 or unset, got {value!r}")
    return None if value == "" else value == "1"


_native_half_cpu = _env_native_half()  # None: ask the CPU (an environment variable, read at import: no probe)


def assume_native_half(native: bool | None) -> bool | None:
    """Decide for the CPU whether it multiplies half precision natively: True as a CPU with
    AVX512-BF16/AMX, False as one with AVX2 alone, None to ask the CPU again (the default). The
    environment variable ``SELFATTN_NATIVE_HALF=1`` or ``=0`` sets it at import. Returns the
    setting it replaced."""
    if native is not None and not isinstance(native, bool):
        raise TypeError(f"assume_native_half takes True, False or None, got {native!r}")
    global _native_half_cpu
    before, _native_half_cpu = _native_half_cpu, native
    return before


def multiplies_natively(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``device`` multiplies ``dtype`` matrices at least at its float32 rate: always for
    float32 and float64; half precision on CUDA (bfloat16 where the GPU has it), and on a CPU
    with AVX512-BF16 or AMX for bfloat16, AMX-FP16 for float16 (or as :func:`assume_native_half`
    says). Elsewhere a half-precision matmul is an emulation, many times slower than float32's
    (``docs/benchmarks.md``), so half tiles are better multiplied in float32 there."""
    if dtype not in (torch.float16, torch.bfloat16):
        return True
    if device.type == "cpu" and _native_half_cpu is not None:
        return _native_half_cpu
    if device.type == "cuda":
        return dtype == torch.float16 or torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        if dtype == torch.bfloat16:
            return _cpu_has("_is_avx512_bf16_supported") or _cpu_has("_is_amx_tile_supported")
        return _cpu_has("_is_amx_fp16_supported")
    return False


def instruction_sets(capability: str | None = None, *, bf16: bool | None = None) -> tuple[str, ...]:
    """The sets of :data:`FLAGS` this CPU runs, fastest first, from torch's reading of it
    (``torch.backends.cpu.get_cpu_capability()``, or ``capability`` given) and whether it has
    AVX512-BF16 (and :func:`multiplies_natively` agrees, so ``SELFATTN_NATIVE_HALF=0`` takes it for
    a CPU without; or ``bf16`` given)."""
    capability = capability or torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        if bf16 is None:
            bf16 = _cpu_has("_is_avx512_bf16_supported") and multiplies_natively(torch.device("cpu"), torch.bfloat16)
        return ("avx512bf16",) * bf16 + ("avx512", "avx2", "baseline")
    return {"AVX2": ("avx2", "baseline")}.get(capability, ("baseline",))


@functools.cache
def best() -> str:
    """The widest set this CPU runs (asked once)."""
    return instruction_sets()[0]
