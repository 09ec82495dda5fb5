"""GGML's quantised blocks to float32, in PyTorch: the types GGUF files mostly hold, vectorised over every
block at once (and over the CPU's cores), in place where it can, where the ``gguf`` package loops over rows in NumPy.

:func:`dequantize` reads F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K with the
arithmetic of ggml's own ``dequantize_row_*`` (``ggml-quants.c``: each scale and minimum made a float32
product first, in its order), so a value equals llama.cpp's to the bit; any other type goes to
``gguf.quants``. The layouts (bytes of one block, values it holds):

- Q8_0 (34, 32): a float16 scale d, 32 int8 q: ``d * q``;
- Q4_0 (18, 32) / Q4_1 (20, 32): d (and a minimum m), 16 bytes of nibbles, low ones the first 16 values:
  ``d * (q - 8)`` / ``d * q + m``;
- Q5_0 (22, 32) / Q5_1 (24, 32): as Q4, and 32 fifth bits in a little-endian uint32 (bit j: value j);
  ``d * (q - 16)`` / ``d * q + m``;
- Q4_K (144, 256) / Q5_K (176, 256): d and dmin, 12 bytes of eight 6-bit scales and minima, (Q5_K: 32 bytes
  of fifth bits,) 128 bytes of nibbles: each 64 values, 32 bytes' low nibbles then their high ones, with
  their own scale and minimum: ``d * scale * q - dmin * min``;
- Q6_K (210, 256): 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d: ``d * scale * (q - 32)``.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import Tensor


def dequantize(raw: np.ndarray, qtype) -> Tensor:
    """The float32 values of ``raw``, the bytes of whole blocks of ``qtype`` (a ``gguf.GGMLQuantizationType``)
    as the ``gguf`` reader holds a tensor, flat (the caller gives them the tensor's shape)."""
    import gguf

    name = qtype.name
    if name in ("F32", "F16"):
        return torch.from_numpy(raw.astype(np.float32)).reshape(-1)
    if name == "BF16":  # bfloat16 stored as uint16
        return _tensor(raw).reshape(-1).view(torch.bfloat16).float()
    if name not in _BLOCKS:
        return torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(-1))
    _, size = gguf.GGML_QUANT_SIZES[qtype]  # (values, bytes) of a block
    u8 = _tensor(raw).reshape(-1, size)  # (blocks, bytes)
    return _BLOCKS[name](u8).reshape(-1)


def _tensor(raw: np.ndarray) -> Tensor:
    """``raw`` as a uint8 tensor without a copy (a read-only memory map: never written to)."""
    raw = np.ascontiguousarray(raw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the non-writable array
        return torch.from_numpy(raw.view(np.uint8))


def _half(u8: Tensor, at: int) -> Tensor:
    """The float16 at byte ``at`` of each block (``u8``: its bytes), as float32: (blocks, 1)."""
    return u8[:, at:at + 2].contiguous().view(torch.float16).float()


_SHIFTS = torch.arange(8, dtype=torch.uint8)


def _nibbles(qs: Tensor) -> Tensor:
    """Bytes (..., n) to 2n values: the low nibbles, then the high ones."""
    return torch.cat([qs & 0xF, qs >> 4], -1)


def _bits(qh: Tensor) -> Tensor:
    """Bytes (blocks, n) to their bits, lowest first: (blocks, n, 8)."""
    return (qh.unsqueeze(-1) >> _SHIFTS) & 1


def _fifth_bits(qh: Tensor) -> Tensor:
    """Four bytes of a little-endian uint32 (blocks, 4) to its 32 bits, bit j the j-th: (blocks, 32)."""
    return _bits(qh).reshape(-1, 32)


def _q8_0(u8: Tensor) -> Tensor:
    return u8[:, 2:].view(torch.int8).float().mul_(_half(u8, 0))


def _q4_0(u8: Tensor) -> Tensor:
    return _nibbles(u8[:, 2:]).float().sub_(8).mul_(_half(u8, 0))


def _q4_1(u8: Tensor) -> Tensor:
    return _nibbles(u8[:, 4:]).float().mul_(_half(u8, 0)).add_(_half(u8, 2))


def _q5_0(u8: Tensor) -> Tensor:
    q = _nibbles(u8[:, 6:]) | (_fifth_bits(u8[:, 2:6]) << 4)
    return q.float().sub_(16).mul_(_half(u8, 0))


def _q5_1(u8: Tensor) -> Tensor:
    q = _nibbles(u8[:, 8:]) | (_fifth_bits(u8[:, 4:8]) << 4)
    return q.float().mul_(_half(u8, 0)).add_(_half(u8, 2))


def _scales_k(s: Tensor) -> tuple[Tensor, Tensor]:
    """The eight 6-bit scales and minima packed in 12 bytes (ggml's ``get_scale_min_k4``): (blocks, 8) each."""
    scale = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], 1)
    low = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], 1)
    return scale, low


def _k_quant(u8: Tensor, q: Tensor) -> Tensor:
    """``d * scale * q - dmin * min`` over the eight 32-value groups of a K-quant block; q: (blocks, 256)."""
    scale, low = _scales_k(u8[:, 4:16])
    d = (_half(u8, 0) * scale.float()).unsqueeze(-1)  # (blocks, 8, 1): a float32 product first, as ggml
    m = (_half(u8, 2) * low.float()).unsqueeze(-1)
    return q.float().reshape(-1, 8, 32).mul_(d).sub_(m).reshape(-1, 256)


def _k_nibbles(qs: Tensor) -> Tensor:
    """128 bytes to 256 values: four runs of 32 bytes, each its low nibbles then its high ones."""
    return _nibbles(qs.reshape(-1, 4, 32)).reshape(-1, 256)


def _q4_k(u8: Tensor) -> Tensor:
    return _k_quant(u8, _k_nibbles(u8[:, 16:]))


def _q5_k(u8: Tensor) -> Tensor:
    high = _bits(u8[:, 16:48]).transpose(1, 2).reshape(-1, 256)  # bit g of byte l: value 32 g + l
    return _k_quant(u8, _k_nibbles(u8[:, 48:]) | (high << 4))


def _q6_k(u8: Tensor) -> Tensor:
    ql = u8[:, :128].reshape(-1, 2, 1, 64)  # (blocks, half, 1, two runs of 32 bytes)
    low = torch.cat([ql & 0xF, ql >> 4], 2).reshape(-1, 2, 4, 32)  # (blocks, half, 2 nibble + run, byte)
    qh = u8[:, 128:192].reshape(-1, 2, 1, 32)
    high = torch.cat([qh, qh >> 2, qh >> 4, qh >> 6], 2) & 3  # the same order
    q = low | (high << 4)  # value 32 (2 nibble + run) + byte of each half
    scales = u8[:, 192:208].view(torch.int8).float().reshape(-1, 16, 1)  # a scale per 16 values
    return q.reshape(-1, 16, 16).float().sub_(32).mul_(_half(u8, 208).unsqueeze(-1) * scales).reshape(-1, 256)


_BLOCKS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q4_K": _q4_k,
           "Q5_K": _q5_k, "Q6_K": _q6_k}
