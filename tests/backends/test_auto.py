"""``backend="auto"``: the rule of :mod:`selfattn.backends.auto`, and that it never picks a refusal."""
import itertools
import os
import subprocess
import sys

import pytest
import torch

from selfattn import Mask, attention
from selfattn.backends import auto, load, resolve


def _request(T=1024, S=None, B=1, H=4, D=16, grad=False, dtype=torch.float32, **mask):
    S = T if S is None else S
    q = torch.randn(B, H, T, D, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, H, S, D, dtype=dtype)
    return q, k, k.clone(), Mask(**mask)


def _choose(q, k, v, mask, dropout_p=0.0, return_weights=False):
    return resolve("auto", q=q, k=k, v=v, mask=mask, dropout_p=dropout_p, return_weights=return_weights)


def test_the_rule():
    window, docs = {"window": 64}, {"doc_ids": (torch.arange(1024) * 16 // 1024)[None]}
    assert _choose(*_request(), return_weights=True) == "math"
    assert _choose(*_request()) == "sdpa"  # plain causal
    assert _choose(*_request(causal=False)) == "sdpa"  # no mask
    assert _choose(*_request(T=1, S=1024, **window)) == "sdpa"  # a decoding step: tiny
    assert _choose(*_request(T=256, **window)) == "sdpa"  # a short sequence
    assert _choose(*_request(window=1024)) == "sdpa"  # a window as long as the sequence: plain causal
    everyone = torch.ones(1, 1024, dtype=torch.bool)
    assert _choose(*_request(causal=False, key_padding_mask=everyone)) == "sdpa"  # every tile visible: dense wins
    assert _choose(*_request(grad=True, **window)) == "tiled"  # training a window
    assert _choose(*_request(**window), dropout_p=0.1) == "tiled"  # no dropout in flex
    flex = "flex" if load("flex").available(torch.device("cpu")) is None else "tiled"
    assert _choose(*_request(**docs)) == flex  # forward with documents
    assert _choose(*_request(**window)) == flex  # forward with a short window
    assert _choose(*_request(window=auto.FLEX_WINDOW + 1)) == "tiled"  # a longer window
    assert _choose(*_request(prefix_len=torch.tensor([100]))) == "tiled"  # prefix-LM: no window at all
    left = torch.arange(1024)[None] >= 512  # (1, S): half the keys are left padding
    assert _choose(*_request(key_padding_mask=left)) == "tiled"  # tiled skips padded tiles: faster than flex
    mask_mod = lambda b, h, q_idx, kv_idx: q_idx // 256 == kv_idx // 256  # noqa: E731
    assert _choose(*_request(mask_mod=mask_mod, n_head=4, batch_rows=torch.arange(1))) == flex  # flex compiles it


def test_the_rule_for_half_precision_training_on_a_cpu(either_cpu):
    """Without native half matmuls SDPA's CPU bfloat16 backward is slow: tiled serves every mask."""
    want = "sdpa" if either_cpu else "tiled"
    for dtype in (torch.bfloat16, torch.float16):
        assert _choose(*_request(grad=True, dtype=dtype)) == want  # plain causal
        assert _choose(*_request(grad=True, dtype=dtype, causal=False)) == want  # no mask
        assert _choose(*_request(T=64, grad=True, dtype=dtype, window=8)) == want  # a short sequence
        assert _choose(*_request(grad=True, dtype=dtype, window=64)) == "tiled"  # a window: rule 4 either way
        assert _choose(*_request(dtype=dtype)) == "sdpa"  # the forward alone: SDPA's is the faster
    assert _choose(*_request(grad=True)) == "sdpa"  # float32 training: rule 2


def test_the_rule_for_score_rules():
    """ALiBi, soft-capping, sinks: the mask decides as without them; flex only forward, where it wins."""
    from selfattn.scores import Scores

    flex = "flex" if load("flex").available(torch.device("cpu")) is None else "tiled"
    alibi = Scores(alibi_slopes=torch.ones(4))
    docs = {"doc_ids": (torch.arange(1024) * 16 // 1024)[None]}
    for mask, want in (({}, "tiled"), (docs, flex), ({"window": 64}, flex), ({"window": 512}, "tiled")):
        q, k, v, m = _request(**mask)
        assert resolve("auto", q=q, k=k, v=v, mask=m, scores=alibi) == want, mask
    q, k, v, m = _request(grad=True, **docs)
    assert resolve("auto", q=q, k=k, v=v, mask=m, scores=alibi) == "tiled"  # no CPU backward in flex


@pytest.mark.parametrize("grad,dtype,dropout_p,weights,mask", list(itertools.product(
    (False, True), (torch.float32, torch.float64, torch.bfloat16), (0.0, 0.2), (False, True),
    ({}, {"window": 40}, {"key_padding_mask": "pad"}, {"doc_ids": "docs"}, {"prefix_len": "prefix"}))))
def test_auto_never_picks_a_backend_that_refuses(grad, dtype, dropout_p, weights, mask):
    T = 700
    extra = {"pad": torch.rand(2, T) > 0.5, "docs": (torch.rand(2, T) < 0.02).cumsum(1), "prefix": torch.tensor([50])}
    mask = {k: extra[v] if isinstance(v, str) else v for k, v in mask.items()}
    q, k, v, m = _request(T=T, B=2, grad=grad, dtype=dtype, **mask)
    name = _choose(q, k, v, m, dropout_p, weights)
    assert load(name).unsupported(q, k, v, m, dropout_p) is None, name
    assert not weights or name == "math"


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_compiling_backends_can_be_kept_out_of_auto():
    q, k, v, mask = _request(doc_ids=(torch.arange(1024) * 16 // 1024)[None])
    try:
        auto.allow_compile(False)
        assert _choose(q, k, v, mask) == "tiled"
        with torch.no_grad():
            torch.testing.assert_close(attention(q, k, v, doc_ids=mask.doc_ids),
                                       attention(q, k, v, doc_ids=mask.doc_ids, backend="tiled"))
    finally:
        auto.allow_compile(True)
    code = "from selfattn.backends import auto; print(auto._compile)"
    env = {**os.environ, "SELFATTN_AUTO_COMPILE": "0"}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip() == \
        "False"


def test_without_a_cpp_compiler_flex_is_unavailable_and_auto_does_without_it(monkeypatch):
    """The other side of compile availability, on any machine: no C++ compiler on PATH."""
    from selfattn.backends import flex

    docs = (torch.arange(1024) * 16 // 1024)[None]
    q, k, v, mask = _request(doc_ids=docs)  # the rule's flex case: a forward over documents
    monkeypatch.setattr(flex.shutil, "which", lambda name: None)
    assert "needs a C++ compiler" in flex.available(torch.device("cpu"))
    assert _choose(q, k, v, mask) == "tiled"
    with torch.no_grad():
        torch.testing.assert_close(attention(q, k, v, doc_ids=docs), attention(q, k, v, doc_ids=docs, backend="tiled"))
    with pytest.raises(ValueError, match="backend 'flex' cannot serve this request: .*C\\+\\+ compiler"):
        attention(q, k, v, doc_ids=docs, backend="flex")
