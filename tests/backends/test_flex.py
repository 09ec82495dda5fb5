"""The flex backend: PyTorch's FlexAttention driven by the one Mask, against the math oracle.

On this CPU build FlexAttention compiles the forward only (seconds per new shape), in float32,
float16 and bfloat16: the parity cases are few and forward-only, by the FlashAttention rule
against float64 math; the generated ``mask_mod`` is checked against the dense mask exhaustively
without compiling anything.
"""
import random

import pytest
import torch

from selfattn import Mask, SelfAttention, attention, check_causal
from selfattn.audit.parity import assert_flash_rule
from selfattn.backends import flex

from helpers.parity import HEADS, make_case

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(flex.available(CPU) is not None, reason=str(flex.available(CPU)))

CASES = [("GQA", "all", 37, 50, 16), ("MHA", "docs", 64, 64, 32), ("MQA", "window", 97, 97, 16),
         ("MHA", "padding", 33, 33, 16), ("GQA", "causal", 1, 20, 16),  # one decoding step over a cache
         ("MHA", "all", 8, 24, 16)]  # S % 16 == 8: lengths this torch's CPU kernel gets wrong without our padding


@pytest.mark.parametrize("heads,mask,T,S,D", CASES, ids=[f"{h}-{m}-T{T}-S{S}" for h, m, T, S, _ in CASES])
def test_forward_matches_math_by_the_flash_rule(heads, mask, T, S, D):
    (q, k, v, _), kwargs = make_case(*HEADS[heads], T, S, D, mask)
    exact = attention(q, k, v, backend="math", **kwargs).detach()
    (q, k, v, _), kwargs = make_case(*HEADS[heads], T, S, D, mask, dtype=torch.float32)
    with torch.no_grad():
        same = attention(q, k, v, backend="math", **kwargs)
        got = attention(q, k, v, backend="flex", **kwargs)
    assert_flash_rule([got], [same], [exact], rel_floor=1e-6, names=("out",))
    empty = exact.abs().sum(-1) == 0  # rows that see no key (left padding): exactly zeros
    assert torch.equal(got[empty], torch.zeros_like(got[empty]))


def test_mask_mod_is_the_dense_mask_on_random_layouts():
    rng = random.Random(0)
    for _ in range(100):
        B, S = rng.randint(1, 3), rng.randint(1, 40)
        T = rng.randint(1, S)
        pad = torch.rand(B, S) > 0.3
        docs = (torch.rand(B, S) < 0.2).cumsum(1)
        causal = rng.random() < 0.7
        mask = Mask(causal=causal, window=rng.choice([None, 1, 4]) if causal else None,
                    key_padding_mask=pad if rng.random() < 0.5 else None,
                    doc_ids=docs if rng.random() < 0.5 else None)
        visible = flex.mask_mod(mask, T, S)
        b, q_idx, kv_idx = torch.arange(B)[:, None, None], torch.arange(T)[None, :, None], torch.arange(S)[None, None]
        got = visible(b, 0, q_idx, kv_idx).expand(B, T, S)
        assert torch.equal(got, mask.dense(T, S)[:, 0].expand(B, T, S)), (T, S, mask)


@pytest.mark.parametrize("make,words", [
    (lambda q: {"args": (q.requires_grad_(), q, q)}, ["forward only", "'tiled'"]),
    (lambda q: {"args": (q.double(),) * 3}, ["float64"]),
    (lambda q: {"args": (q, q, q), "dropout_p": 0.1}, ["no dropout", "dropout_p=0.1"]),
])
def test_refusals_name_the_reason(make, words):
    spec = make(torch.randn(1, 2, 8, 16))
    with pytest.raises(ValueError, match="backend 'flex' cannot serve this request") as info:
        attention(*spec["args"], backend="flex", dropout_p=spec.get("dropout_p", 0.0))
    assert all(w in str(info.value) for w in words), str(info.value)


def test_block_masks_are_cached_per_mask_tensors_and_shape():
    pad = torch.ones(2, 300, dtype=torch.bool)
    first = flex.block_mask(Mask(key_padding_mask=pad), 2, 300, 300, CPU)
    assert flex.block_mask(Mask(key_padding_mask=pad), 2, 300, 300, CPU) is first  # the same tensor: a hit
    assert flex.block_mask(Mask(key_padding_mask=pad.clone()), 2, 300, 300, CPU) is not first  # another tensor
    assert flex.block_mask(Mask(key_padding_mask=pad), 2, 200, 300, CPU) is not first  # another shape
    pad[0, :200] = False  # changed in place: the cached block mask would be stale
    again = flex.block_mask(Mask(key_padding_mask=pad), 2, 300, 300, CPU)
    visible = (lambda bm: int((bm.kv_num_blocks + bm.full_kv_num_blocks)[0].sum()))  # tiles of batch row 0
    assert again is not first and visible(again) < visible(first)


def test_causality_audit_covers_flex():
    torch.manual_seed(0)
    x = torch.randn(2, 12, 32)
    for kwargs in ({}, {"window": 4, "n_kv_head": 2}):
        report = check_causal(SelfAttention(32, 4, backend="flex", **kwargs), x, method="perturb",
                              window=kwargs.get("window"))
        assert report.ok, str(report)


def test_programmable_rules_match_math_and_sinks_are_refused():
    from selfattn.scores import alibi_slopes

    bias = torch.linspace(-1, 1, 64)

    def dilated(b, h, q_idx, kv_idx):
        return ((q_idx - kv_idx) % 3 != 1) | (h == 0)

    def relative(score, b, h, q_idx, kv_idx):
        return score + bias.to(score.dtype)[(q_idx - kv_idx).clamp(0, 63)]
    requests = [dict(prefix_len=torch.tensor([5, 0]), mask_mod=dilated, alibi_slopes=alibi_slopes(4), softcap=2.0,
                     score_mod=relative),
                dict(window=6, sink_tokens=2, key_padding_mask=torch.rand(2, 40) > 0.2)]
    for kwargs in requests:
        (q, k, v, _), _ = make_case(4, 2, 33, 40, 16, "causal", dtype=torch.float32)
        exact = attention(q.double(), k.double(), v.double(), backend="math",
                          **{n: t.double() if n == "alibi_slopes" else t for n, t in kwargs.items()}).detach()
        with torch.no_grad():
            same = attention(q, k, v, backend="math", **kwargs)
            got = attention(q, k, v, backend="flex", **kwargs)
        assert_flash_rule([got], [same], [exact], rel_floor=1e-6, names=("out",))
    with pytest.raises(ValueError, match="FlexAttention has no sink logits"):
        attention(q, k, v, backend="flex", sinks=torch.zeros(4))
