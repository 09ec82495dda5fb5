"""Every backend against the math oracle, the mask predicate, and the SelfAttention options."""
import functools
import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from selfattn import KVCache, Mask, SelfAttention, allowed, attention, backends
from selfattn.backends import tiled
from selfattn.rope import apply_rope, rope_angles

from helpers.parity import F64, HEADS, MASK_KINDS, assert_close_all, assert_flash_rule, forward_backward, make_case

BACKENDS = ("sdpa", "tiled")  # compared with "math", the oracle
ALL_BACKENDS = ("math",) + BACKENDS


# --- the parity matrix, float64 ---------------------------------------------------------------

def _case_id(case):
    heads, mask, T, extra, D = case
    return f"{heads}-{mask}-T{T}-S{T + extra}-D{D}"


CASES = list(itertools.product(HEADS, MASK_KINDS, (1, 17, 97, 257), (0, 19), (8, 16, 64)))


@functools.lru_cache(maxsize=4)
def _exact(case):
    """The case's float64 inputs and the math backend's (out, dq, dk, dv) on them."""
    heads, mask, T, extra, D = case
    (q, k, v, grad), kwargs = make_case(*HEADS[heads], T, T + extra, D, mask)
    return (q, k, v, grad), kwargs, forward_backward("math", q, k, v, grad, **kwargs)


@pytest.mark.parametrize("case,backend", list(itertools.product(CASES, BACKENDS)),
                         ids=[f"{_case_id(c)}-{b}" for c, b in itertools.product(CASES, BACKENDS)])
def test_parity_float64(case, backend):
    inputs, kwargs, want = _exact(case)
    assert_close_all(forward_backward(backend, *inputs, **kwargs), want, **F64)


# --- low precision: the FlashAttention rule against a same-dtype math reference ---------------

REL_FLOOR = {torch.float32: 1e-6, torch.bfloat16: 8e-3}  # about 8 ulp and 1 ulp of max|x|
LOWP_CASES = list(itertools.product(REL_FLOOR, BACKENDS, ("MHA", "GQA"), ("causal", "padding", "all"),
                                    (97, 257), (0, 19), (16, 64)))


@pytest.mark.parametrize("dtype,backend,heads,mask,T,extra,D", LOWP_CASES,
                         ids=[f"{str(d)[6:]}-{b}-{h}-{m}-T{T}-S{T + e}-D{D}" for d, b, h, m, T, e, D in LOWP_CASES])
def test_parity_low_precision(dtype, backend, heads, mask, T, extra, D):
    H, Hkv = HEADS[heads]
    inputs64, kwargs = make_case(H, Hkv, T, T + extra, D, mask)
    exact = forward_backward("math", *inputs64, **kwargs)
    inputs, kwargs = make_case(H, Hkv, T, T + extra, D, mask, dtype=dtype)
    same_dtype_math = forward_backward("math", *inputs, **kwargs)
    got = forward_backward(backend, *inputs, **kwargs)
    assert all(t.dtype == dtype for t in got)
    assert_flash_rule(got, same_dtype_math, exact, rel_floor=REL_FLOOR[dtype])


# --- negative controls: the checkers fail on a wrong mask -------------------------------------

def _top_left_causal(q, k, v, grad):
    """PyTorch's is_causal=True with T < S: the diagonal aligned top-left, the classic cache bug."""
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), grad))


def test_negative_control_float64_checker_catches_top_left_alignment():
    (q, k, v, grad), _ = make_case(4, 4, 17, 36, 16, "causal")
    want = forward_backward("math", q, k, v, grad)
    assert_close_all(forward_backward("sdpa", q, k, v, grad), want, **F64)  # the right one passes
    with pytest.raises(AssertionError, match="out: max error"):
        assert_close_all(_top_left_causal(q, k, v, grad), want, **F64)


def test_negative_control_float64_checker_catches_window_off_by_one():
    (q, k, v, grad), _ = make_case(4, 2, 33, 33, 16, "window")
    want = forward_backward("math", q, k, v, grad, window=5)
    for wrong in (4, 6):
        with pytest.raises(AssertionError, match="max error"):
            assert_close_all(forward_backward("tiled", q, k, v, grad, window=wrong), want, **F64)


def test_negative_control_flash_rule_catches_a_wrong_mask(either_cpu):
    bf16 = REL_FLOOR[torch.bfloat16]
    inputs64, _ = make_case(4, 4, 33, 40, 16, "causal")
    inputs, _ = make_case(4, 4, 33, 40, 16, "causal", dtype=torch.bfloat16)
    exact, ref = forward_backward("math", *inputs64, window=7), forward_backward("math", *inputs, window=7)
    assert_flash_rule(forward_backward("tiled", *inputs, window=7), ref, exact, rel_floor=bf16)  # right: passes
    with pytest.raises(AssertionError, match="same-dtype math error"):
        assert_flash_rule(forward_backward("tiled", *inputs, window=8), ref, exact, rel_floor=bf16)
    exact, ref = forward_backward("math", *inputs64), forward_backward("math", *inputs)
    assert_flash_rule(forward_backward("sdpa", *inputs), ref, exact, rel_floor=bf16)
    with pytest.raises(AssertionError, match="same-dtype math error"):
        assert_flash_rule(_top_left_causal(*inputs), ref, exact, rel_floor=bf16)


# --- edge cases, every backend ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_fully_masked_rows_give_zeros_and_zero_finite_grads(backend, dtype, either_cpu):
    B, H, T, D = 3, 2, 21, 8
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(dtype).requires_grad_() for _ in range(3))
    pad = torch.ones(B, T, dtype=torch.bool)
    pad[0] = False  # a batch row with no real token at all
    pad[1, :6] = False  # left padding: causal queries 0..5 see nothing
    out = attention(q, k, v, key_padding_mask=pad, backend=backend)
    out.backward(torch.randn(out.shape, generator=g).to(dtype))
    empty = torch.zeros(B, T, dtype=torch.bool)
    empty[0], empty[1, :6] = True, True
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(t).all()
    assert (out.transpose(1, 2)[empty] == 0).all()  # (rows, H, D) of the empty rows
    assert (q.grad.transpose(1, 2)[empty] == 0).all()
    assert (k.grad[0] == 0).all() and (v.grad[0] == 0).all()  # keys only padding queries could see
    assert (out.transpose(1, 2)[~empty].abs().sum(-1) > 0).all()  # every other row is a real output


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_half_scores_that_overflow_float16_stay_finite_and_correct(backend, either_cpu):
    g = torch.Generator().manual_seed(2)
    B, H, T, D = 1, 2, 33, 64
    q = (torch.randn(B, H, T, D, generator=g) * 4 + 40).half()
    k = (torch.randn(B, H, T, D, generator=g) * 4 + 40).half()
    v = torch.randn(B, H, T, D, generator=g).half()
    assert torch.isinf(q @ k.transpose(-2, -1)).all()  # the naive float16 scores overflow (> 65504)
    for kwargs in ({}, {"window": 5}, {"key_padding_mask": torch.rand(B, T, generator=g) > 0.2}):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = attention(qq, kk, vv, backend=backend, **kwargs)
        out.sum().backward()
        want = attention(q.double(), k.double(), v.double(), backend="math", **kwargs)  # the same rounded inputs
        assert out.dtype == torch.float16
        torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=0)  # float16 output rounding of |v| < 5
        assert all(torch.isfinite(t.grad).all() for t in (qq, kk, vv))


def _large_scores(dtype, magnitude=4.0):
    """q, k of mean ``magnitude`` (scores near 180 in log2 units at D = 64) and v, rounded to ``dtype``."""
    g = torch.Generator().manual_seed(2)
    q, k = ((torch.randn(1, 2, 33, 64, generator=g) * 0.1 + 1) * magnitude for _ in range(2))
    return q.to(dtype), k.to(dtype), torch.randn(1, 2, 33, 64, generator=g).to(dtype)


def _error_of(backend, q, k, v):
    want = attention(q.double(), k.double(), v.double(), backend="math")  # the same rounded inputs
    return (attention(q, k, v, backend=backend).double() - want).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_large_scores_keep_the_precision_of_math(backend, dtype, either_cpu):
    """Scores near 180 (log2 units), where a score rounded to bfloat16 is off by up to 0.5: every
    backend within 2x the error of math's (which takes its scores in float32), plus an ulp of v."""
    q, k, v = _large_scores(dtype)
    assert _error_of(backend, q, k, v) <= 2 * _error_of("math", q, k, v) + HALF_ULP[dtype]


HALF_ULP = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}  # at |v| ~ 1


def test_negative_control_scores_rounded_to_half_fail_the_large_score_test(monkeypatch):
    """The tiled kernel's scores rounded to bfloat16 by the CPU's matmul (as before the scores
    were multiplied in float32) are off by 0.3 on the same inputs, 40x math's error."""
    before = backends.assume_native_half(True)
    try:
        q, k, v = _large_scores(torch.bfloat16)
        bound = 2 * _error_of("math", q, k, v) + HALF_ULP[torch.bfloat16]
        assert _error_of("tiled", q, k, v) <= bound
        monkeypatch.setattr(tiled, "_exact_half_product", lambda device: True)  # scores through the half product,
        monkeypatch.setattr(tiled, "_half_product", lambda a, b: torch.bmm(a, b).float())  # rounded as on a CPU
        assert _error_of("tiled", q, k, v) > 10 * bound
    finally:
        backends.assume_native_half(before)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_non_contiguous_inputs(backend):
    B, T, S, H, Hkv, D = 2, 19, 30, 4, 2, 8
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, T, H, D, generator=g, dtype=torch.float64).transpose(1, 2)  # (B, H, T, D), strided
    kv = torch.randn(B, Hkv, 40, 2 * D, generator=g, dtype=torch.float64)  # a cache: take S of 40, half the channels
    k, v = kv[:, :, :S, :D], kv[:, :, :S, D:]  # (B, Hkv, S, D) each, non-contiguous
    for t in (q, k, v):
        assert not t.is_contiguous()
    grad = torch.randn(B, T, H, D, generator=g, dtype=torch.float64).transpose(1, 2)  # (B, H, T, D), strided
    pad = torch.rand(B, S, generator=g) > 0.2
    leaves = [t.requires_grad_() for t in (q, k, v)]
    contiguous = [t.detach().contiguous().requires_grad_() for t in leaves]
    got = forward_backward(backend, *leaves, grad, window=9, key_padding_mask=pad)
    want = forward_backward("math", *contiguous, grad.contiguous(), window=9, key_padding_mask=pad)
    assert_close_all(got, want, **F64)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("B,T,S", [(0, 5, 5), (2, 0, 0), (2, 0, 7), (0, 0, 3)])
def test_empty_batch_or_no_queries(backend, B, T, S):
    q = torch.randn(B, 4, T, 8, requires_grad=True)
    k, v = (torch.randn(B, 2, S, 8, requires_grad=True) for _ in range(2))
    out = attention(q, k, v, backend=backend, key_padding_mask=torch.ones(B, S, dtype=torch.bool))
    assert out.shape == (B, 4, T, 8)
    out.sum().backward()
    assert q.grad.shape == q.shape and (q.grad == 0).all()
    assert all(t.grad is None or (t.grad == 0).all() for t in (k, v))  # nothing attended: no gradient


# --- the mask predicate ------------------------------------------------------------------------

def test_allowed_agrees_with_dense_mask_on_random_cases():
    rng = random.Random(0)
    for _ in range(300):
        S = rng.randint(1, 12)
        T = rng.randint(1, S)
        B = rng.randint(1, 2)
        causal = rng.random() < 0.7
        window = rng.choice([None, 1, 2, 3, 5, 20]) if causal else None
        g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
        pad = torch.rand(B, S, generator=g) > 0.3 if rng.random() < 0.5 else None
        docs = torch.randint(0, 3, (B, S), generator=g) if rng.random() < 0.5 else None
        dense = Mask(causal=causal, window=window, key_padding_mask=pad, doc_ids=docs).dense(T, S)
        assert dense.dtype == torch.bool and dense.shape[1:] == (1, T, S)
        for b, i, j in itertools.product(range(B), range(T), range(S)):
            p = S - T + i  # query i sits at key index S - T + i
            want = allowed(p, j, causal=causal, window=window)
            want = want and (pad is None or bool(pad[b, j])) and (docs is None or bool(docs[b, p] == docs[b, j]))
            assert bool(dense[min(b, dense.shape[0] - 1), 0, i, j]) == want, (T, S, causal, window, b, i, j)


def test_allowed_states_the_window_convention():
    assert [j for j in range(10) if allowed(6, j, window=3)] == [4, 5, 6]  # i - W < j <= i
    assert [j for j in range(10) if allowed(6, j, window=1)] == [6]
    assert [j for j in range(10) if allowed(6, j)] == list(range(7))
    assert [j for j in range(10) if allowed(6, j, causal=False)] == list(range(10))


# --- causality of SelfAttention, every backend and option --------------------------------------

OPTIONS = {
    "default": {}, "gqa": {"n_kv_head": 2}, "mqa": {"n_kv_head": 1}, "rope": {"rope": True},
    "window": {"window": 3}, "bias": {"bias": True}, "dropout": {"dropout": 0.3},
}


def _causality_violations(fn, x, window=None):
    """Perturb each input position t; outputs before t (or at/after t + window) must not move,
    the output at t must. Returns the violations as readable strings."""
    y = fn(x)
    bad = []
    for t in range(x.shape[1]):
        x2 = x.clone()
        x2[:, t] += 1.0
        moved = (fn(x2) - y).abs().amax(dim=(0, 2)) > 0  # (T,) per output position
        hidden = [i for i in range(x.shape[1]) if i < t or (window is not None and i >= t + window)]
        bad += [f"input {t} moved output {i}" for i in hidden if moved[i]]
        if not moved[t]:
            bad.append(f"input {t} did not move output {t}")
    return bad


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("backend", ALL_BACKENDS + ("auto",))
def test_causality_perturbation(backend, option):
    attn = SelfAttention(16, 4, backend=backend, **OPTIONS[option])
    x = torch.randn(2, 13, 16)

    def fn(inp):
        torch.manual_seed(5)  # dropout (train mode) draws the same masks for both inputs
        return attn(inp)
    assert _causality_violations(fn, x, OPTIONS[option].get("window")) == []


def test_causality_checker_negative_controls():
    q_k_v = SelfAttention(16, 4)

    def bidirectional(x):  # the same projections, causal=False: every position leaks
        q, k, v = q_k_v.qkv(x).view(2, 13, 3, 4, 4).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D)
        return attention(q, k, v, causal=False).transpose(1, 2).reshape(2, 13, 16)  # (B, T, C)
    x = torch.randn(2, 13, 16)
    assert "input 12 moved output 0" in _causality_violations(bidirectional, x)
    wide = SelfAttention(16, 4, window=4)
    assert "input 0 moved output 3" in _causality_violations(wide, x, window=3)  # a window off by one


# --- compile --------------------------------------------------------------------------------------

@pytest.mark.slow
def test_torch_compile_fullgraph_matches_eager():
    attn = SelfAttention(16, 4, backend="sdpa")
    x = torch.randn(2, 9, 16)
    compiled = torch.compile(attn, fullgraph=True)
    torch.testing.assert_close(compiled(x), attn(x), rtol=1e-5, atol=1e-6)


# --- SelfAttention options ------------------------------------------------------------------------

@pytest.mark.parametrize("C,H,Hkv", [(16, 4, 4), (16, 4, 2), (16, 4, 1), (96, 12, 3), (64, 8, 1)])
def test_gqa_parameter_count(C, H, Hkv):
    D = C // H
    attn = SelfAttention(C, H, n_kv_head=Hkv)
    assert sum(p.numel() for p in attn.parameters()) == 2 * C * C + 2 * C * Hkv * D
    assert attn.qkv.weight.shape == (C + 2 * Hkv * D, C)
    with_bias = SelfAttention(C, H, n_kv_head=Hkv, bias=True)
    assert sum(p.numel() for p in with_bias.parameters()) == 2 * C * C + 2 * C * Hkv * D + 2 * C + 2 * Hkv * D


def test_gqa_equals_mha_with_repeated_kv_weights():
    C, H, Hkv, D = 16, 4, 2, 4
    gqa = SelfAttention(C, H, n_kv_head=Hkv, backend="math").double()
    mha = SelfAttention(C, H, backend="math").double()
    wq, wk, wv = gqa.qkv.weight.split([C, Hkv * D, Hkv * D])
    repeat = lambda w: w.view(Hkv, 1, D, C).expand(Hkv, H // Hkv, D, C).reshape(H * D, C)  # (C, C)
    with torch.no_grad():
        mha.qkv.weight.copy_(torch.cat([wq, repeat(wk), repeat(wv)]))
        mha.proj.weight.copy_(gqa.proj.weight)
    x = torch.randn(2, 11, C, dtype=torch.float64)
    for backend in ALL_BACKENDS:
        gqa.backend = backend
        torch.testing.assert_close(gqa(x), mha(x), rtol=1e-12, atol=1e-12)


def test_rope_scores_depend_only_on_relative_position():
    g = torch.Generator().manual_seed(6)
    q, k = (torch.randn(2, 3, 10, 8, generator=g, dtype=torch.float64) for _ in range(2))
    pos = torch.arange(10)
    scores = []
    for shift in (0, 7, 1000):
        cos, sin = rope_angles(pos + shift, 8)
        scores.append(apply_rope(q, cos, sin) @ apply_rope(k, cos, sin).transpose(-2, -1))  # (B, H, T, T)
    torch.testing.assert_close(scores[1], scores[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(scores[2], scores[0], rtol=1e-10, atol=1e-10)
    assert not torch.allclose(scores[0], q @ k.transpose(-2, -1))  # the rotation does change the scores


def test_rope_module_is_shift_invariant_and_positions_equal_a_cache_offset():
    attn = SelfAttention(16, 4, rope=True, backend="math").double()
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    full = attn(x)
    torch.testing.assert_close(attn(x, positions=torch.arange(12) + 50), full, rtol=1e-10, atol=1e-10)
    cache = KVCache(2, 4, 12, 4, dtype=torch.float64)
    attn(x[:, :5], cache=cache)
    cached = attn(x[:, 5:], cache=cache)  # default positions: cache.length + arange(7)
    torch.testing.assert_close(cached, full[:, 5:], rtol=1e-10, atol=1e-10)
    cache.reset()
    attn(x[:, :5], cache=cache)
    explicit = attn(x[:, 5:], cache=cache, positions=torch.arange(5, 12))
    torch.testing.assert_close(explicit, cached, rtol=0, atol=0)
    cache.reset()
    attn(x[:, :5], cache=cache)
    wrong = attn(x[:, 5:], cache=cache, positions=torch.arange(7))  # the offset forgotten
    assert not torch.allclose(wrong, full[:, 5:])


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_dropout_train_vs_eval(backend):
    attn = SelfAttention(16, 4, dropout=0.5, backend=backend)
    plain = SelfAttention(16, 4, backend=backend)
    plain.load_state_dict(attn.state_dict())
    x = torch.randn(2, 9, 16)
    attn.eval()
    torch.testing.assert_close(attn(x), plain(x), rtol=0, atol=0)
    attn.train()
    a, b = attn(x), attn(x)
    assert not torch.allclose(a, b) and not torch.allclose(a, plain(x))
    torch.manual_seed(3)
    a = attn(x)
    torch.manual_seed(3)
    assert torch.equal(attn(x), a)  # reproducible from torch's generator


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_no_random_numbers_drawn_when_dropout_is_off(backend):
    x = torch.randn(2, 9, 16)
    off_in_training = SelfAttention(16, 4, backend=backend).train()
    on_in_eval = SelfAttention(16, 4, dropout=0.5, backend=backend).eval()
    for attn in (off_in_training, on_in_eval):
        state = torch.get_rng_state()
        attn(x).sum().backward()
        assert torch.equal(torch.get_rng_state(), state)


def test_bias_option():
    attn = SelfAttention(16, 4, bias=True)
    assert set(attn.state_dict()) == {"qkv.weight", "qkv.bias", "proj.weight", "proj.bias"}
    plain = SelfAttention(16, 4)
    plain.load_state_dict({k: v for k, v in attn.state_dict().items() if k.endswith("weight")})
    x = torch.randn(2, 5, 16)
    assert not torch.allclose(attn(x), plain(x))
    with torch.no_grad():
        attn.qkv.bias.zero_()
        attn.proj.bias.zero_()
    torch.testing.assert_close(attn(x), plain(x), rtol=0, atol=0)


def test_return_weights():
    attn = SelfAttention(16, 4, window=3)
    x = torch.randn(2, 8, 16)
    pad = torch.ones(2, 8, dtype=torch.bool)
    pad[1, :2] = False
    y, w = attn(x, key_padding_mask=pad, return_weights=True)
    assert w.shape == (2, 4, 8, 8)
    torch.testing.assert_close(y, attn(x, key_padding_mask=pad))
    visible = Mask(window=3, key_padding_mask=pad).dense(8, 8)  # (B, 1, T, S)
    assert (w.masked_select(~visible) == 0).all()
    row_sums = w.sum(-1)  # (B, H, T)
    has_keys = visible.any(-1).expand_as(row_sums)  # (B, H, T)
    torch.testing.assert_close(row_sums[has_keys], torch.ones_like(row_sums[has_keys]))
    assert (row_sums[~has_keys] == 0).all() and (~has_keys).sum() == 2 * 4  # batch 1, queries 0 and 1
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=f"return_weights=True needs backend 'math'.*'{backend}'"):
            SelfAttention(16, 4, backend=backend)(x, return_weights=True)


def test_unknown_backend_and_unsupported_combination(monkeypatch):
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*'math', 'sdpa', 'tiled'"):
        attention(q, q, q, backend="flash")
    monkeypatch.setattr(tiled, "unsupported", lambda q, k, v, mask, dropout_p, scores=None: f"no D={q.shape[-1]} today",
                        raising=False)
    with pytest.raises(ValueError, match="backend 'tiled' cannot serve this request: no D=4 today"):
        attention(q, q, q, backend="tiled")


def test_option_defaults_allocate_nothing_and_draw_nothing():
    torch.manual_seed(0)
    SelfAttention(16, 4)
    after_plain = torch.get_rng_state()
    torch.manual_seed(0)
    explicit = SelfAttention(16, 4, n_kv_head=None, bias=False, dropout=0.0, rope=False, rope_base=10000.0,
                             window=None, sink_tokens=None, alibi=False, softcap=None, sinks=False, mask_mod=None,
                             score_mod=None, backend="auto")
    assert torch.equal(torch.get_rng_state(), after_plain)
    assert set(explicit.state_dict()) == {"qkv.weight", "proj.weight"} and not list(explicit.buffers())
    for kwargs in ({"rope": True}, {"window": 4}, {"dropout": 0.2}, {"backend": "tiled"}, {"n_kv_head": 4},
                   {"window": 4, "sink_tokens": 2}, {"alibi": True}, {"softcap": 3.0},
                   {"mask_mod": lambda b, h, q, k: q >= k}, {"score_mod": lambda s, b, h, q, k: s}):
        torch.manual_seed(0)
        attn = SelfAttention(16, 4, **kwargs)  # options with no weights of their own allocate none
        assert torch.equal(torch.get_rng_state(), after_plain), kwargs
        assert sum(p.numel() for p in attn.parameters()) == 4 * 16 * 16 and not list(attn.buffers()), kwargs
    torch.manual_seed(0)
    sinks = SelfAttention(16, 4, sinks=True)  # learned sinks: one zero logit per head, no random draw
    assert torch.equal(torch.get_rng_state(), after_plain) and torch.equal(sinks.sinks, torch.zeros(4))
    assert set(sinks.state_dict()) == {"qkv.weight", "proj.weight", "sinks"}


# --- attention() validation ---------------------------------------------------------------------

_q = torch.randn(2, 4, 5, 8)
_kv = torch.randn(2, 2, 6, 8)


@pytest.mark.parametrize("args,kwargs,error,words", [
    (([1.0], _kv, _kv), {}, TypeError, ["q", "list"]),
    ((_q[0], _kv, _kv), {}, ValueError, ["q", "4-D", "(4, 5, 8)"]),
    ((_q, _kv, _kv[..., :7]), {}, ValueError, ["(2, 2, 6, 8)", "(2, 2, 6, 7)"]),
    ((_q.long(), _kv, _kv), {}, TypeError, ["floating", "int64"]),
    ((_q, _kv.double(), _kv), {}, TypeError, ["float32", "float64"]),
    ((_q, _kv[:, :1].expand(2, 3, 6, 8), _kv[:, :1].expand(2, 3, 6, 8)), {}, ValueError, ["H=4", "Hkv=3"]),
    ((_q, _kv[:, :, :3], _kv[:, :, :3]), {}, ValueError, ["T=5", "S=3"]),
    ((_q, _kv, _kv), {"window": 0}, ValueError, ["window", "0"]),
    ((_q, _kv, _kv), {"window": 2.5}, TypeError, ["window", "2.5"]),
    ((_q, _kv, _kv), {"window": 3, "causal": False}, ValueError, ["window=3", "causal"]),
    ((_q, _kv, _kv), {"key_padding_mask": torch.ones(2, 6)}, TypeError, ["key_padding_mask", "bool", "float32"]),
    ((_q, _kv, _kv), {"key_padding_mask": torch.ones(2, 5, dtype=torch.bool)}, ValueError,
     ["key_padding_mask", "(B=2, S=6)", "(2, 5)"]),
    ((_q, _kv, _kv), {"doc_ids": torch.zeros(2, 6)}, TypeError, ["doc_ids", "integer", "float32"]),
    ((_q, _kv, _kv), {"doc_ids": torch.zeros(1, 6, dtype=torch.long)}, ValueError, ["doc_ids", "(B=2, S=6)", "(1, 6)"]),
    ((_q, _kv, _kv), {"dropout_p": 1.0}, ValueError, ["dropout_p", "1.0"]),
    ((_q, _kv, _kv), {"dropout_p": -0.1}, ValueError, ["dropout_p", "-0.1"]),
    ((_q, _kv, _kv), {"scale": 0.0}, ValueError, ["scale", "0.0"]),
    ((_q, _kv, _kv), {"scale": "big"}, TypeError, ["scale", "'big'"]),
    ((_q, _kv, _kv), {"scale": float("nan")}, ValueError, ["scale", "nan"]),
    ((_q, _kv, _kv), {"scale": float("inf")}, ValueError, ["scale", "inf"]),
    ((_q, _kv, _kv), {"backend": "fast"}, ValueError, ["'fast'", "'math'"]),
    ((_q, _kv, _kv), {"backend": "tiled", "return_weights": True}, ValueError, ["return_weights", "'tiled'"]),
    ((_q, _kv.to("meta"), _kv.to("meta")), {}, ValueError, ["one device", "cpu", "meta"]),
])
def test_attention_validation_errors_name_their_values(args, kwargs, error, words):
    with pytest.raises(error) as info:
        attention(*args, **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_sdpa_passes_no_mask_for_a_decoded_token_and_the_dense_one_otherwise(monkeypatch):
    from selfattn.backends import sdpa
    seen, fused = [], sdpa.F.scaled_dot_product_attention
    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention",
                        lambda *a, attn_mask=None, **kw: seen.append(attn_mask) or fused(*a, attn_mask=attn_mask, **kw))
    k = torch.randn(1, 2, 9, 8, dtype=torch.float64)
    for T, window in ((1, None), (1, 4), (2, None)):
        q = torch.randn(1, 4, T, 8, dtype=torch.float64)
        out = attention(q, k, k, window=window, backend="sdpa")
        torch.testing.assert_close(out, attention(q, k, k, window=window, backend="math"), **F64)
    assert seen[0] is None and seen[1] is not None and seen[2] is not None  # the window and the 2 queries hide keys
