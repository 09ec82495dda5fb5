"""GGML's quantised blocks dequantised in PyTorch equal the ``gguf`` package's NumPy reading of the same bytes
to the bit, for every type done here and for one left to ``gguf`` (random blocks, finite scales)."""
import gguf
import numpy as np
import pytest
import torch

from selfattn.formats import ggml_blocks

Q = gguf.GGMLQuantizationType
SCALES = {Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2],
          Q.Q6_K: [208], Q.Q2_K: [80, 82]}  # the bytes of each block's float16 scales and minima


def random_blocks(qtype, rows: int = 6, values: int = 512) -> np.ndarray:
    """``rows`` rows of random blocks of ``qtype``, their float16 scales drawn in [-1, 1] (no NaN, no inf)."""
    rng = np.random.default_rng(int(qtype))
    if qtype == Q.BF16:  # the upper halves of float32 values
        return rng.standard_normal((rows, values)).astype(np.float32).view(np.uint16)[:, 1::2].copy().view(np.uint8)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * values // block, size), dtype=np.uint8)
    for at in SCALES.get(qtype, []):
        raw[:, at:at + 2] = rng.uniform(-1, 1, (len(raw), 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [*SCALES, Q.BF16], ids=lambda q: q.name)
def test_every_type_equals_the_gguf_packages_reading_to_the_bit(qtype):
    raw = random_blocks(qtype)
    ours = ggml_blocks.dequantize(raw, qtype)
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(-1))
    assert ours.dtype == torch.float32 and ours.shape == (6 * 512,) and torch.isfinite(ours).all()
    assert torch.equal(ours, theirs) and theirs.abs().max() > 0


def test_float_types_are_their_values():
    values = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float16)
    assert torch.equal(ggml_blocks.dequantize(values, Q.F16), torch.from_numpy(values.astype(np.float32)).reshape(-1))


def test_the_check_catches_the_nibbles_in_another_order(monkeypatch):  # control
    raw = random_blocks(Q.Q4_0)
    monkeypatch.setattr(ggml_blocks, "_nibbles", lambda qs: torch.stack([qs & 0xF, qs >> 4], -1).flatten(-2))
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, Q.Q4_0).reshape(-1))
    assert not torch.equal(ggml_blocks.dequantize(raw, Q.Q4_0), theirs)
