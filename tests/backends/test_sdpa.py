"""The sdpa backend's decoded token in half precision: float32 where this CPU measured it faster."""
import time

import pytest
import torch
import torch.nn.functional as F

from selfattn import attention
from selfattn.backends import sdpa
from tests.helpers.models import scrambled, small


def _decoded_token(dtype, keys=40):
    return (torch.randn(2, h, n, 16, dtype=dtype) for h, n in ((6, 1), (3, keys), (3, keys)))  # (B, H, T, D)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("faster", [False, True], ids=["half-faster", "float32-faster"])
def test_a_decoded_half_token_runs_as_measured_and_matches_the_oracle(monkeypatch, dtype, faster):
    monkeypatch.setattr(sdpa, "one_query_in_float32", lambda *request: faster)
    q, k, v = _decoded_token(dtype)
    out = attention(q, k, v, backend="sdpa")  # one query: sees every cached key
    in_float32 = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True).to(dtype)
    in_half = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert torch.equal(out, in_float32 if faster else in_half)
    exact = attention(q.double(), k.double(), v.double(), backend="math")
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=2 * torch.finfo(dtype).eps)


def test_only_a_half_query_that_sees_every_key_is_cast(monkeypatch):
    monkeypatch.setattr(sdpa, "one_query_in_float32", lambda *request: True)
    seen = []
    plain = sdpa._sdpa
    monkeypatch.setattr(sdpa, "_sdpa", lambda q, *args, **kw: seen.append(q.dtype) or plain(q, *args, **kw))
    q, k, v = _decoded_token(torch.bfloat16)
    for request, dtype in ((dict(), torch.float32),  # the decoded token
                           (dict(q=q.repeat(1, 1, 2, 1)), torch.bfloat16),  # two queries
                           (dict(window=8), torch.bfloat16),  # a mask: not every key
                           (dict(alibi_slopes=torch.rand(6)), torch.bfloat16),  # a bias
                           (dict(q=q.float(), k=k.float(), v=v.float()), torch.float32)):  # float32 already
        seen.clear()
        args = {"q": q, "k": k, "v": v} | request
        out = attention(args.pop("q"), args.pop("k"), args.pop("v"), backend="sdpa", **args)
        assert seen == [dtype], (list(request), seen)
        assert out.dtype == (torch.float32 if "k" in request else torch.bfloat16)


@pytest.mark.parametrize("slow", ["half", "float32"])
def test_the_measurement_picks_the_faster_precision(monkeypatch, slow):
    plain = sdpa._sdpa

    def slowed(q, *args, **kw):
        if (q.dtype == torch.float32) == (slow == "float32"):
            time.sleep(2e-3)
        return plain(q, *args, **kw)

    monkeypatch.setattr(sdpa, "_sdpa", slowed)
    sdpa.one_query_in_float32.cache_clear()
    try:
        assert sdpa.one_query_in_float32(torch.bfloat16, 6, 3, 16, 16, reps=5) == (slow == "half")
    finally:
        sdpa.one_query_in_float32.cache_clear()


def test_the_measurement_is_of_the_requests_heads_and_its_keys_rounded_up_to_a_power_of_2(monkeypatch):
    asked = []
    monkeypatch.setattr(sdpa, "one_query_in_float32", lambda *request: asked.append(request) or False)
    for keys in (40, 64, 65):
        attention(*_decoded_token(torch.bfloat16, keys), backend="sdpa")
    assert asked == [(torch.bfloat16, 6, 3, 16, 64), (torch.bfloat16, 6, 3, 16, 64), (torch.bfloat16, 6, 3, 16, 128)]


@pytest.mark.parametrize("faster", [False, True], ids=["half-faster", "float32-faster"])
def test_a_compiled_graph_takes_the_choice_measured_before_it_compiled(monkeypatch, faster):
    monkeypatch.setattr(sdpa, "COMPILED_IN_FLOAT32", {})
    monkeypatch.setattr(sdpa, "one_query_in_float32", lambda *request: faster)
    sdpa.decide_compiled(torch.bfloat16, 6, 3, 16, torch.device("cpu"))
    sdpa.decide_compiled(torch.float32, 6, 3, 16, torch.device("cpu"))  # float32: nothing to decide
    assert sdpa.COMPILED_IN_FLOAT32 == {(torch.bfloat16, 6, 3, 16): faster}
    q, k, v = _decoded_token(torch.bfloat16)
    compiled = torch.compile(lambda q, k, v: attention(q, k, v, backend="sdpa"), fullgraph=True)
    out = compiled(q, k, v)  # one graph, whatever the keys: the choice made before, not measured while tracing
    in_float32 = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True).to(torch.bfloat16)
    in_half = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, in_float32 if faster else in_half, rtol=0, atol=0)


def test_a_compiled_decode_step_measures_its_heads_before_it_compiles(monkeypatch):
    monkeypatch.setattr(sdpa, "COMPILED_IN_FLOAT32", {})
    asked = []
    monkeypatch.setattr(sdpa, "one_query_in_float32", lambda *request: asked.append(request) or True)
    model = scrambled(small(pos="rope", n_kv_head=2)).to(torch.bfloat16).compile_decode()
    list(model.generate(torch.randint(61, (1, 5)), 3, temperature=0))
    heads = (model.blocks[0].attn.n_head, model.blocks[0].attn.n_kv_head, model.blocks[0].attn.head_dim)
    assert asked == [(torch.bfloat16, *heads, sdpa.COMPILED_KEYS)]  # once, over COMPILED_KEYS keys
    assert sdpa.COMPILED_IN_FLOAT32 == {(torch.bfloat16, *heads): True}
