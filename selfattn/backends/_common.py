"""Helpers the backends share: GQA's key/value sharing, the dense mask, half-precision dtypes
and whether a device multiplies them natively."""
from __future__ import annotations

import os

import torch
from torch import Tensor

from selfattn.masks import Mask


def repeat_kv(x: Tensor, n_head: int) -> Tensor:
    """GQA: share each of Hkv key/value heads with H / Hkv query heads. (B, Hkv, S, D) -> (B, H, S, D)."""
    B, Hkv, S, D = x.shape
    if Hkv == n_head:
        return x
    return x[:, :, None].expand(B, Hkv, n_head // Hkv, S, D).reshape(B, n_head, S, D)


def dense_mask(mask: Mask, T: int, S: int, device) -> tuple[Tensor, Tensor | None]:
    """The dense boolean mask ``(B or 1, 1, T, S)`` for backends that take one, and the rows
    that can see nothing ``(B, 1, T, 1)`` (None when there can be none).

    Empty rows are un-masked here so the softmax stays finite (no NaN, in forward or
    backward); the caller zeroes their output with ``out.masked_fill(empty, 0)``.
    """
    allowed = mask.dense(T, S, device)
    if not mask.may_have_empty_rows:
        return allowed, None
    empty = ~allowed.any(dim=-1, keepdim=True)  # (B, 1, T, 1)
    return allowed | empty, empty


def half(dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16)


def _env_native_half() -> bool | None:
    value = os.environ.get("SELFATTN_NATIVE_HALF", "")
    if value not in ("", "0", "1"):
        raise ValueError(f"SELFATTN_NATIVE_HALF must be 0, 1 or unset, got {value!r}")
    return None if value == "" else value == "1"


_native_half_cpu = _env_native_half()  # None: ask the CPU


def assume_native_half(native: bool | None) -> bool | None:
    """Decide for the CPU whether it multiplies half precision natively: True as a CPU with
    AVX512-BF16/AMX, False as one with AVX2 alone, None to ask the CPU again (the default). The
    environment variable ``SELFATTN_NATIVE_HALF=1`` or ``=0`` sets it at import. Every choice that
    follows it (tiled's tile dtype, ``auto``'s rule 6, the benchmarks' default dtypes) can so be
    run, and tested, either way on any machine. Returns the setting it replaced."""
    if native is not None and not isinstance(native, bool):
        raise TypeError(f"assume_native_half takes True, False or None, got {native!r}")
    global _native_half_cpu
    before, _native_half_cpu = _native_half_cpu, native
    return before


def multiplies_natively(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``device`` multiplies ``dtype`` matrices at least at its float32 rate: always for
    float32 and float64; half precision on CUDA (bfloat16 where the GPU has it), and on a CPU
    with AVX512-BF16 or AMX for bfloat16, AMX-FP16 for float16 (or as :func:`assume_native_half`
    says). Elsewhere a half-precision matmul is an emulation: on a 2-core AVX2 EPYC a bfloat16
    (512, 64) @ (64, 512) ran at 1.3 GFLOP/s against float32's 95, so half tiles are better
    multiplied in float32 there."""
    if not half(dtype):
        return True
    if device.type == "cpu" and _native_half_cpu is not None:
        return _native_half_cpu
    if device.type == "cuda":
        return dtype == torch.float16 or torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        if dtype == torch.bfloat16:
            return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        return torch.cpu._is_amx_fp16_supported()
    return False
