"""Programmable attention: ALiBi, soft-capping, learned sinks, sink tokens, prefix-LM, and user
mask_mod / score_mod, each against an independent statement of it, then every backend against
math in float64 (outputs and gradients) with GQA, a cache (T < S), windows, padding and documents."""
import itertools
import types

import pytest
import torch

from selfattn import attention
from selfattn.backends import flex
from selfattn.masks import FULL, HIDDEN, Mask
from selfattn.scores import alibi_slopes

from helpers.parity import F64, HEADS, assert_close_all, forward_backward, make_case

transformers = pytest.importorskip("transformers")


def _qkv(B=2, H=4, Hkv=2, T=20, S=None, D=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k, v = (torch.randn(B, Hkv, S, D, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v


# --- each built-in against an independent statement ----------------------------------------------

@pytest.mark.parametrize("H", [1, 3, 5, 8, 12, 16])
def test_alibi_slopes_are_blooms(H):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    bloom = build_alibi_tensor(torch.ones(1, 2), H, torch.float32)  # (H, 1, 2): slope * position
    assert torch.allclose(alibi_slopes(H), bloom[:, 0, 1], rtol=0, atol=1e-7)


def test_alibi_equals_blooms_bias_under_the_softmax():
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    q, k, v = _qkv(B=1, H=4, Hkv=4, T=12)
    slopes = alibi_slopes(4).double()
    bloom = build_alibi_tensor(torch.ones(1, 12), 4, torch.float64).view(1, 4, 1, 12)  # slope * j: a row shift away
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2)) * 8 ** -0.5 + bloom
    want = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v
    torch.testing.assert_close(attention(q, k, v, alibi_slopes=slopes, backend="math"), want, rtol=1e-12, atol=1e-12)


def test_softcap_equals_gemma2s_eager_attention():
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    q, k, v = _qkv(B=2, H=4, Hkv=2, T=10)
    q = q * 6  # large scores, where the cap bends them
    additive = torch.zeros(10, 10, dtype=torch.float64).masked_fill(~torch.ones(10, 10).tril().bool(), -1e30)
    module = types.SimpleNamespace(num_key_value_groups=2, training=False)
    want, _ = eager_attention_forward(module, q, k, v, additive[None, None], scaling=8 ** -0.5, softcap=5.0)
    got = attention(q, k, v, softcap=5.0, backend="math").transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # Gemma 2's eager softmax runs in float32
    assert not torch.allclose(got, attention(q, k, v, backend="math").transpose(1, 2))  # the cap did bend


def test_learned_sinks_equal_gpt_oss_eager_attention():
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v = _qkv(B=2, H=4, Hkv=2, T=9)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    additive = torch.zeros(9, 9, dtype=torch.float64).masked_fill(~torch.ones(9, 9).tril().bool(), -1e30)
    module = types.SimpleNamespace(num_key_value_groups=2, training=False, sinks=sinks)
    want, want_w = eager_attention_forward(module, q, k, v, additive[None, None], scaling=8 ** -0.5)
    got, weights = attention(q, k, v, sinks=sinks, backend="math", return_weights=True)
    torch.testing.assert_close(got.transpose(1, 2), want, rtol=1e-12, atol=1e-12)
    assert (weights.sum(-1) < 1).all()  # the sink holds the rest of each row's weight


def test_sink_tokens_and_prefix_follow_their_rules():
    m = Mask(window=3, sink_tokens=2).dense(8, 8)[0, 0]
    for p, j in itertools.product(range(8), range(8)):
        assert m[p, j] == (j <= p and (j > p - 3 or j < 2)), (p, j)
    prefix = Mask(prefix_len=torch.tensor([3, 0])).dense(6, 6)[:, 0]
    for b, P in enumerate((3, 0)):
        for p, j in itertools.product(range(6), range(6)):
            assert prefix[b, p, j] == (j <= max(p, P - 1)), (b, p, j)


# --- user functions against FlexAttention's own forward --------------------------------------------

def _user_functions():
    bias = torch.linspace(-1, 1, 64, dtype=torch.float64)

    def mask_mod(b, h, q_idx, kv_idx):  # a dilated pattern that also depends on the head
        return ((q_idx - kv_idx) % 2 == 0) | (h == 0)

    def score_mod(score, b, h, q_idx, kv_idx):  # a relative-position bias
        return score + bias.to(score.dtype)[(q_idx - kv_idx).clamp(0, 63)]
    return mask_mod, score_mod


@pytest.mark.skipif(flex.available(torch.device("cpu")) is not None, reason="needs a C++ compiler for flex")
@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_user_functions_equal_flexattention_forward():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask_mod, score_mod = _user_functions()
    q, k, v = _qkv(B=1, H=2, Hkv=2, T=40, S=48, D=16, dtype=torch.float32)
    off = 48 - 40  # FlexAttention numbers queries 0..T-1; ours sit at S - T + i

    def theirs_mask(b, h, q_idx, kv_idx):
        return (q_idx + off >= kv_idx) & mask_mod(b, h, q_idx + off, kv_idx)

    block = create_block_mask(theirs_mask, 1, 2, 40, 48, device="cpu")
    with torch._dynamo.config.patch(recompile_limit=64):
        want = torch.compile(flex_attention)(q, k, v, block_mask=block,
                                             score_mod=lambda s, b, h, qi, ki: score_mod(s, b, h, qi + off, ki))
    got = attention(q.double(), k.double(), v.double(), mask_mod=mask_mod, score_mod=score_mod, backend="math")
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-5)


# --- every backend against math in float64 ---------------------------------------------------------

RULES = {
    "alibi": lambda H, B, S, g: {"alibi_slopes": alibi_slopes(H).double()},
    "softcap": lambda H, B, S, g: {"softcap": 2.0},
    "sinks": lambda H, B, S, g: {"sinks": torch.randn(H, generator=g, dtype=torch.float64)},
    "sink-tokens": lambda H, B, S, g: {"window": 5, "sink_tokens": 3},
    "prefix": lambda H, B, S, g: {"prefix_len": torch.randint(0, S + 1, (B,), generator=g)},
    "mask_mod": lambda H, B, S, g: {"mask_mod": _user_functions()[0]},
    "score_mod": lambda H, B, S, g: {"score_mod": _user_functions()[1]},
    "all-scores": lambda H, B, S, g: {"alibi_slopes": alibi_slopes(H).double(), "softcap": 3.0,
                                      "sinks": torch.randn(H, generator=g, dtype=torch.float64),
                                      "score_mod": _user_functions()[1]},
}
BASES = ("causal", "window", "padding", "docs")  # the rule combined with these (prefix needs causal, no window)


def _case(rule, base, heads, T, S):
    (q, k, v, grad), kwargs = make_case(*HEADS[heads], T, S, 8, base)
    g = torch.Generator().manual_seed(T * 7 + S)
    extra = RULES[rule](HEADS[heads][0], 2, S, g)
    if rule == "prefix" and ("window" in kwargs or kwargs.get("causal") is False):
        return None
    if rule == "sink-tokens" and kwargs.get("causal") is False:
        return None
    if "window" in extra and "window" in kwargs:
        extra = dict(extra, window=kwargs["window"])
    return (q, k, v, grad), {**kwargs, **extra}


CASES = [c for c in itertools.product(RULES, BASES, ("MHA", "GQA"), ((17, 17), (9, 30)))
         if _case(c[0], c[1], c[2], *c[3]) is not None]


@pytest.mark.parametrize("rule,base,heads,TS", CASES, ids=[f"{r}-{b}-{h}-T{t}-S{s}" for r, b, h, (t, s) in CASES])
def test_tiled_matches_math_float64_outputs_and_gradients(rule, base, heads, TS):
    (q, k, v, grad), kwargs = _case(rule, base, heads, *TS)
    want = forward_backward("math", q, k, v, grad, **kwargs)
    assert_close_all(forward_backward("tiled", q, k, v, grad, **kwargs), want, **F64)


def test_tiled_small_tiles_and_sink_gradient_match_math():
    from selfattn.backends import tiled
    from selfattn.scores import Scores

    q, k, v = (t.requires_grad_() for t in _qkv(B=2, H=4, Hkv=2, T=23, S=31))
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    pad = torch.rand(2, 31, generator=torch.Generator().manual_seed(3)) > 0.3
    mask = Mask(window=7, key_padding_mask=pad)
    scores = Scores(alibi_slopes=alibi_slopes(4).double(), softcap=2.5, sinks=sinks)
    grads = {}
    for name, run in (("math", lambda: attention(q, k, v, window=7, key_padding_mask=pad, sinks=sinks, softcap=2.5,
                                                 alibi_slopes=alibi_slopes(4).double(), backend="math")),
                      ("tiled", lambda: tiled.run(q, k, v, mask, scale=8 ** -0.5, scores=scores, block_q=4,
                                                  block_k=8))):
        out = run()
        grads[name] = (out.detach(), *torch.autograd.grad(out, (q, k, v, sinks), torch.ones_like(out)))
    assert_close_all(grads["tiled"], grads["math"], names=("out", "dq", "dk", "dv", "dsinks"), **F64)


def test_gradcheck_tiled_with_every_score_rule():
    q, k, v = (t.requires_grad_() for t in _qkv(B=1, H=2, Hkv=1, T=6, S=9, D=4))
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, sinks):
        return attention(q, k, v, window=4, sink_tokens=1, alibi_slopes=alibi_slopes(2).double(), softcap=1.5,
                         sinks=sinks, score_mod=_user_functions()[1], backend="tiled")
    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


def test_sdpa_serves_alibi_and_masks_and_refuses_the_rest():
    (q, k, v, grad), kwargs = make_case(4, 2, 17, 30, 8, "padding")
    for extra in ({"alibi_slopes": alibi_slopes(4).double()}, {"prefix_len": 5}, {"mask_mod": _user_functions()[0]}):
        want = forward_backward("math", q, k, v, grad, **kwargs, **extra)
        assert_close_all(forward_backward("sdpa", q, k, v, grad, **kwargs, **extra), want, **F64)
    refused = ({"softcap": 2.0}, {"sinks": torch.zeros(4, dtype=torch.float64)}, {"score_mod": _user_functions()[1]})
    for extra in refused:
        with pytest.raises(ValueError, match="backend 'sdpa' cannot serve this request: SDPA takes a mask or an "):
            attention(q, k, v, backend="sdpa", **extra)


def test_a_learned_bias_in_a_score_mod_gets_its_gradient_from_math_and_tiled_says_why_not():
    q, k, v = (t.requires_grad_() for t in _qkv(B=1, H=2, Hkv=2, T=8))
    bias = torch.zeros(16, dtype=torch.float64, requires_grad=True)

    def learned(score, b, h, q_idx, kv_idx):
        return score + bias[(q_idx - kv_idx).clamp(0, 15)]
    attention(q, k, v, score_mod=learned, backend="math").sum().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="computes no gradient for tensors a score_mod closes over.*'math'"):
        attention(q, k, v, score_mod=learned, backend="tiled")
    with torch.no_grad():  # no gradient asked for: tiled serves it
        torch.testing.assert_close(attention(q, k, v, score_mod=learned, backend="tiled"),
                                   attention(q, k, v, score_mod=learned, backend="math"))


def test_auto_serves_every_rule():
    (q, k, v, grad), kwargs = make_case(4, 2, 17, 30, 8, "all")
    for rule in RULES:
        merged = {**kwargs, **RULES[rule](4, 2, 30, torch.Generator().manual_seed(0))}
        if rule == "prefix":
            merged.pop("window")  # a prefix takes no window
        got = forward_backward("auto", q, k, v, grad, **merged)
        assert_close_all(got, forward_backward("math", q, k, v, grad, **merged), **F64)


# --- the block map of a mask_mod -------------------------------------------------------------------

def test_block_map_of_a_mask_mod_is_sound_and_cached():
    def blocky(b, h, q_idx, kv_idx):  # whole tiles hidden for batch row 1, head-dependent inside others
        return (kv_idx // 4 != 1) | (b == 0) & (h == 1)
    mask = Mask(mask_mod=blocky, n_head=2, batch_rows=torch.arange(2))
    kind = mask.blocks(12, 12, 4, 4).kind  # (2, 3, 3)
    dense = mask.dense(12, 12)  # (2, 2, 12, 12)
    for b, i, j in itertools.product(range(2), range(3), range(3)):
        tile = dense[b, :, i * 4:(i + 1) * 4, j * 4:(j + 1) * 4]
        assert (kind[b, i, j] == HIDDEN) == (not tile.any()) and (kind[b, i, j] == FULL) == bool(tile.all())
    assert mask.blocks(12, 12, 4, 4).kind is not kind and torch.equal(mask.blocks(12, 12, 4, 4).kind, kind)


# --- bad input -------------------------------------------------------------------------------------

_q = torch.randn(2, 4, 5, 8)


@pytest.mark.parametrize("kwargs,error,words", [
    ({"mask_mod": lambda b, h, q, k: (q - k).float()}, TypeError, ["mask_mod", "bool", "float32"]),
    ({"mask_mod": lambda b, h, q, k: torch.ones(3, 3, dtype=torch.bool)}, ValueError, ["mask_mod", "(3, 3)"]),
    ({"score_mod": lambda s, b, h, q, k: s.sum(-1)}, ValueError, ["score_mod", "shaped like"]),
    ({"mask_mod": 3}, TypeError, ["mask_mod", "callable", "int"]),
    ({"alibi_slopes": torch.ones(3)}, ValueError, ["alibi_slopes", "(H=4,)", "(3,)"]),
    ({"sinks": torch.ones(4, 1)}, ValueError, ["sinks", "(H=4,)", "(4, 1)"]),
    ({"sinks": torch.ones(4, dtype=torch.long)}, TypeError, ["sinks", "floating"]),
    ({"softcap": 0.0}, ValueError, ["softcap", "0.0"]),
    ({"softcap": float("inf")}, ValueError, ["softcap", "inf"]),
    ({"prefix_len": 6}, ValueError, ["prefix_len", "S=5", "[6]"]),
    ({"prefix_len": torch.tensor([1, 2, 3])}, ValueError, ["prefix_len", "(B=2,)", "(3,)"]),
    ({"prefix_len": 2, "window": 3}, ValueError, ["prefix_len", "window=3"]),
    ({"sink_tokens": 2}, ValueError, ["sink_tokens=2", "window"]),
    ({"sink_tokens": -1, "window": 2}, ValueError, ["sink_tokens", "-1"]),
])
def test_bad_programmable_input_is_named(kwargs, error, words):
    with pytest.raises(error) as info:
        attention(_q, _q, _q, backend="math", **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("causal", [None, 0, 1, "", "no", [], torch.tensor(True)],
                         ids=["None", "0", "1", "empty-str", "no", "empty-list", "tensor"])
def test_causal_is_a_bool_and_nothing_else(causal):
    from selfattn.distributed.ring import _Request

    with pytest.raises(TypeError, match=rf"causal must be True or False, got {type(causal).__name__} "):
        attention(_q, _q, _q, causal=causal)
    with pytest.raises(TypeError, match="causal must be True or False"):  # ring attention checks it the same way
        _Request.check(_q, _q, _q, causal, None, None, None, None, "contiguous", "tiled", 1)


def test_causal_true_and_false_are_the_two_attentions():  # control: the bools still choose
    dense = torch.ones(5, 5, dtype=torch.bool)
    for causal, visible in ((True, dense.tril()), (False, dense)):
        want = torch.softmax((_q @ _q.transpose(-2, -1) * 8 ** -0.5).masked_fill(~visible, float("-inf")), -1) @ _q
        torch.testing.assert_close(attention(_q, _q, _q, causal=causal, backend="math"), want)


BACKENDS_WITH_SCORE_MOD = ["math", "tiled", "auto"] + (["flex"] if flex.available(torch.device("cpu")) is None else [])
WRONG_RESULTS = {"bool": lambda s, b, h, q, k: s > 0, "float64": lambda s, b, h, q, k: s.double(),
                 "float16": lambda s, b, h, q, k: s.half(), "int64": lambda s, b, h, q, k: s.long(),
                 "int32": lambda s, b, h, q, k: (q - k).int()}


@pytest.mark.parametrize("backend", BACKENDS_WITH_SCORE_MOD)
@pytest.mark.parametrize("result", WRONG_RESULTS)
def test_a_score_mod_returning_another_dtype_is_one_type_error_on_every_backend(backend, result):
    q = torch.randn(2, 4, 9, 8)
    with pytest.raises(TypeError) as e:
        attention(q, q, q, score_mod=WRONG_RESULTS[result], backend=backend)
    assert str(e.value) == f"score_mod must return a tensor of its score's dtype torch.float32, got torch.{result}"


@pytest.mark.parametrize("backend", BACKENDS_WITH_SCORE_MOD)
def test_a_score_mod_returning_its_scores_dtype_runs_on_every_backend(backend):  # control of the check above
    q = torch.randn(2, 4, 33, 16)  # (head size 8 aborted the compiled flex kernel in a full suite run)

    def distance(s, b, h, q_idx, kv_idx):
        return s - 0.1 * (q_idx - kv_idx)  # int64 indices, float32 score: float32
    torch.testing.assert_close(attention(q, q, q, score_mod=distance, backend=backend),
                               attention(q, q, q, score_mod=distance, backend="math"), rtol=1e-5, atol=1e-5)
    half = q.bfloat16()  # half-precision inputs are scored in float32, and score_mod returns float32
    assert attention(half, half, half, score_mod=distance, backend="math").dtype == torch.bfloat16
    with pytest.raises(TypeError, match=r"dtype torch.float32 \(the scores of torch.bfloat16 inputs\), got "
                                        r"torch.bfloat16"):
        attention(half, half, half, score_mod=lambda s, b, h, q_idx, kv_idx: s.bfloat16(), backend="math")
    with pytest.raises(TypeError, match="score_mod must return a tensor, the modified score, got float"):
        attention(q, q, q, score_mod=lambda s, b, h, q_idx, kv_idx: 0.0, backend=backend)


@pytest.mark.parametrize("n_head, error, message", [(0, ValueError, "n_head must be a positive int, got 0"),
                                                    (-2, ValueError, "n_head must be a positive int, got -2"),
                                                    (3.5, TypeError, "n_head must be an int, got float 3.5"),
                                                    (True, TypeError, "n_head must be an int, got bool True")])
def test_alibi_slopes_of_a_head_count_that_is_none_is_named(n_head, error, message):
    with pytest.raises(error) as e:
        alibi_slopes(n_head)
    assert str(e.value) == message
    assert alibi_slopes(6).shape == (6,) and torch.isfinite(alibi_slopes(6)).all()  # control


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("name, values, shown", [("sinks", [0.0, NAN, 1.0, 0.0], "nan for head 1"),
                                                 ("sinks", [INF, 0.0, 0.0, 0.0], "inf for head 0"),
                                                 ("sinks", [0.0, 0.0, 0.0, -INF], "-inf for head 3"),
                                                 ("alibi_slopes", [0.5, 0.25, NAN, 0.1], "nan for head 2"),
                                                 ("alibi_slopes", [0.5, INF, 0.2, 0.1], "inf for head 1")])
def test_a_nan_or_infinite_slope_or_sink_is_named(name, values, shown):
    with pytest.raises(ValueError) as e:
        attention(_q, _q, _q, **{name: torch.tensor(values)})
    assert str(e.value) == f"{name} must be finite, got {shown}"
    finite = torch.tensor([v if v == v and abs(v) != INF else 30.0 for v in values])  # control: finite values run
    assert torch.isfinite(attention(_q, _q, _q, **{name: finite})).all()
