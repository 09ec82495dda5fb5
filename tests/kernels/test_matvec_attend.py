"""The C++ kernel of a few causal queries' attention over a cache (``matvec.attend``: a decoded
token, a speculative verification): every build this CPU runs against a float64 softmax, for every
cache dtype, grouped heads, query counts, head sizes and key counts that leave every remainder, cache
views; the same bits on any number of threads; a peaked softmax (the exponential's range); one
compiled graph; and the errors it names."""
import re

import pytest
import torch

from selfattn.kernels import features, matvec
from selfattn.kernels.matvec import ROW_DTYPES

ISAS = features.instruction_sets()
# (B, H, Hkv, T, S, D): GQA and MHA, one key, keys past the 128 of a task and short of 16, D short of 16 and
# past it; T queries: one, a verification's few (one of them across a run's end), as many as the keys
SHAPES = [(1, 9, 3, 1, 512, 64), (2, 6, 3, 1, 37, 16), (1, 4, 4, 1, 300, 64), (3, 4, 1, 1, 1, 7),
          (1, 2, 2, 1, 129, 70), (2, 8, 2, 1, 16, 128), (1, 5, 5, 1, 257, 96), (1, 9, 3, 5, 512, 64),
          (2, 6, 3, 8, 133, 16), (1, 3, 1, 16, 16, 32), (1, 2, 2, 3, 3, 7), (2, 4, 2, 7, 260, 64)]
# a half-precision output rounds once: a few of its ulps; float32 sums a few roundings
TOL = {torch.float32: 2e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


def exact(q, k, v, scale):  # (B, H, T, D) in float64: query t sees keys 0 .. S - T + t
    g, (T, S) = q.shape[1] // k.shape[1], (q.shape[2], k.shape[2])
    k, v = (t.double().repeat_interleave(g, dim=1) for t in (k, v))
    scores = (q.double() @ k.transpose(-1, -2)) * scale  # (B, H, T, S)
    seen = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    return scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v


def cache_views(B, Hkv, S, D, dtype):
    """k and v as a cache returns them: the first S slots of a longer buffer, rows contiguous."""
    kv = torch.randn(B, Hkv, S + 5, 2 * D).to(dtype)
    return kv[:, :, :S, :D], kv[:, :, :S, D:]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ROW_DTYPES)
def test_the_kernel_is_the_float64_attention_summed_in_float32(isa, dtype):
    for B, H, Hkv, T, S, D in SHAPES:
        q = torch.randn(B, H, T, D).to(dtype)
        k, v = cache_views(B, Hkv, S, D, dtype)
        out = matvec.attend(q, k, v, D ** -0.5, isa=isa)
        assert out.dtype == dtype and out.shape == q.shape
        error = (out.double() - exact(q, k, v, D ** -0.5)).abs().max().item()
        assert error < TOL[dtype], ((B, H, Hkv, T, S, D), error)


def test_a_wrong_weighting_fails_the_same_tolerance():  # control: the comparison can fail
    q = torch.randn(1, 4, 3, 64)
    k, v = cache_views(1, 2, 200, 64, torch.float32)
    out = matvec.attend(q, k, v, 0.125)
    assert (out.double() - exact(q, k, v, 0.125)).abs().max() < TOL[torch.float32]
    assert (out.double() - exact(q, k, v, 0.126)).abs().max() > TOL[torch.float32]  # another scale
    assert (matvec.attend(q, k, v[:, [1, 0]], 0.125) - out).abs().max() > TOL[torch.float32]  # another head's v
    shifted = exact(q, k[:, :, :-1], v[:, :, :-1], 0.125)  # every query one key short
    assert (out[:, :, :2].double() - shifted[:, :, :2]).abs().max() > TOL[torch.float32]


def test_a_peaked_softmax_keeps_its_tiny_weights():  # scores 0 to -300: exponentials down to the clamp
    q = torch.zeros(1, 2, 1, 16)
    q[..., 0] = 1.0
    k, v = cache_views(1, 1, 300, 16, torch.float32)
    k[..., 0] = -torch.arange(300.0)  # key j scores -j: weights e^-j, the sum about 1.58
    out = matvec.attend(q, k, v, 1.0)
    torch.testing.assert_close(out.double(), exact(q, k, v, 1.0), rtol=0, atol=2e-6)


def test_the_bits_do_not_depend_on_the_threads():
    q = torch.randn(2, 9, 1, 64)
    k, v = cache_views(2, 3, 700, 64, torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = matvec.attend(q, k, v, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(matvec.attend(q, k, v, 0.125), alone)


def test_a_compiled_function_calls_the_kernel_within_one_graph():
    q = torch.randn(1, 4, 1, 32)
    k, v = cache_views(1, 2, 50, 32, torch.float32)
    compiled = torch.compile(lambda q, k, v: matvec.attend(q, k, v, 0.2) * 2, fullgraph=True)
    assert torch.equal(compiled(q, k, v), matvec.attend(q, k, v, 0.2) * 2)


def test_the_kernel_names_what_it_cannot_attend():
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 3, 5, 8)
    with pytest.raises(RuntimeError, match=re.escape("H a multiple of Hkv, got [1, 4, 1, 8], [1, 3, 5, 8]")):
        matvec.attend(q, k, k, 1.0)
    with pytest.raises(RuntimeError, match=re.escape("0 < T <= S and H a multiple of Hkv, got [1, 4, 6, 8]")):
        matvec.attend(torch.randn(1, 4, 6, 8), k[:, :2], k[:, :2], 1.0)  # more queries than keys
    with pytest.raises(RuntimeError, match="k and v of one dtype, got Float and BFloat16"):
        matvec.attend(q, k[:, :2], k[:, :2].bfloat16(), 1.0)
    with pytest.raises(RuntimeError, match="a cache of Double"):
        matvec.attend(q, k[:, :2].double(), k[:, :2].double(), 1.0)
