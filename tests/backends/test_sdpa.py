"""The sdpa backend's decoded token and few causal queries on the CPU: the matvec kernel where it
builds; where it does not, a half-precision decoded token in float32 where this CPU measured it faster."""
import time

import pytest
import torch
import torch.nn.functional as F

from selfattn import attention
from selfattn.backends import sdpa
from selfattn.generation import compile_decode, decode_layout, generate, steps
from selfattn.kernels import features, matvec
from tests.helpers.models import scrambled, small


def _decoded_token(dtype, keys=40):
    return (torch.randn(2, h, n, 16, dtype=dtype) for h, n in ((6, 1), (3, keys), (3, keys)))  # (B, H, T, D)


@pytest.fixture
def no_kernel(monkeypatch):
    """A machine where the one-query kernel does not serve (no compiler, no AVX2)."""
    monkeypatch.setattr(matvec, "attends", lambda: False)


@pytest.fixture
def kernel_calls(monkeypatch) -> list:
    """The dtypes of the queries the kernel attends, as it is called; the kernel serving whatever
    build this CPU runs (the baseline one too, which serves only in tests: see matvec.ATTENDS)."""
    monkeypatch.setattr(matvec, "attends", lambda: True)
    calls, attend = [], matvec.attend
    monkeypatch.setattr(matvec, "attend", lambda q, *args, **kw: calls.append(q.dtype) or attend(q, *args, **kw))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_decoded_token_attends_in_the_kernel_and_matches_the_oracle(kernel_calls, dtype):
    q, k, v = _decoded_token(dtype)
    out = attention(q, k, v, backend="sdpa")
    assert kernel_calls == [dtype] and out.dtype == dtype
    exact = attention(q.double(), k.double(), v.double(), backend="math")
    tol = 2e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=tol)


def test_a_few_causal_queries_at_the_end_of_the_keys_attend_in_the_kernel_and_match_the_oracle(kernel_calls):
    q, k, v = _decoded_token(torch.float32)
    for T in range(2, sdpa.FEW_QUERIES + 1):  # a speculative verification
        few = torch.randn(2, 6, T, 16)
        exact = attention(few.double(), k.double(), v.double(), backend="math")
        torch.testing.assert_close(attention(few, k, v, backend="sdpa").double(), exact, rtol=0, atol=2e-6)
    assert kernel_calls == [torch.float32] * (sdpa.FEW_QUERIES - 1)


def test_only_few_plain_causal_queries_without_a_gradient_or_dropout_attend_in_the_kernel(kernel_calls):
    q, k, v = _decoded_token(torch.float32)
    for request, kernel in ((dict(), True),
                            (dict(q=q.repeat(1, 1, 2, 1)), True),  # two queries, causal
                            (dict(q=q.repeat(1, 1, sdpa.FEW_QUERIES + 1, 1)), False),  # more than a few
                            (dict(q=q.repeat(1, 1, 2, 1), causal=False), False),  # two that see every key
                            (dict(q=q.repeat(1, 1, 2, 1), window=30), False),  # a window short of the keys
                            (dict(window=8), False),  # one query, a mask: not every key
                            (dict(window=40), True),  # one query whose window reaches every key
                            (dict(alibi_slopes=torch.rand(6)), False),  # a bias
                            (dict(dropout_p=0.5), False),
                            (dict(q=q.clone().requires_grad_()), False),  # a gradient to take
                            (dict(q=q.double(), k=k.double(), v=v.double()), False)):  # a dtype it does not read
        kernel_calls.clear()
        args = {"q": q, "k": k, "v": v} | request
        attention(args.pop("q"), args.pop("k"), args.pop("v"), backend="sdpa", **args)
        assert kernel_calls == [torch.float32] * kernel, list(request)
    with torch.no_grad():  # no gradient taken: the kernel
        attention(q.clone().requires_grad_(), k, v, backend="sdpa")
    assert kernel_calls == [torch.float32]


@pytest.mark.parametrize("isa", list(features.FLAGS))
def test_the_kernel_serves_where_its_build_was_measured_faster(monkeypatch, isa):
    monkeypatch.setattr(matvec, "_chosen", [isa])  # the build a CPU would run
    monkeypatch.setattr(matvec, "failure", lambda isa=None: None)  # and it builds
    assert matvec.attends() == (isa != "baseline")  # the baseline's float32: slower than SDPA
    monkeypatch.setattr(matvec, "failure", lambda isa=None: "no compiler")  # control: nothing builds
    assert not matvec.attends()


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_a_compiled_decode_step_attends_in_the_kernel_within_its_graph(kernel_calls, monkeypatch):
    model = scrambled(small(pos="rope", n_kv_head=2)).to(torch.bfloat16)
    prompt = torch.randint(61, (1, 5))
    monkeypatch.setattr(steps, "unsupported", lambda model, **kw: "the eager steps")  # not the C++ decode step
    eager = list(generate(model, prompt, 4, temperature=0))
    assert kernel_calls == [torch.bfloat16] * 3 * len(model.blocks)  # three decoded tokens, every layer
    torch._dynamo.utils.counters.clear()
    graph = decode_layout(model, one_row="mv", few_rows="linear")  # a graph's step, not the C++ decode kernel's
    assert list(generate(compile_decode(graph), prompt, 4, temperature=0)) == eager
    assert len(kernel_calls) == 2 * 3 * len(model.blocks)  # the graph took the kernel (the spy's appends replayed)
    assert not torch._dynamo.utils.counters["graph_break"]  # within one graph


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("faster", [False, True], ids=["half-faster", "float32-faster"])
def test_a_decoded_half_token_runs_as_measured_and_matches_the_oracle(monkeypatch, no_kernel, dtype, faster):
    monkeypatch.setattr(sdpa, "one_query_in_float32", lambda *request: faster)
    q, k, v = _decoded_token(dtype)
    out = attention(q, k, v, backend="sdpa")  # one query: sees every cached key
    in_float32 = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True).to(dtype)
    in_half = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert torch.equal(out, in_float32 if faster else in_half)
    exact = attention(q.double(), k.double(), v.double(), backend="math")
    torch.testing.assert_close(out.double(), exact, rtol=0, atol=2 * torch.finfo(dtype).eps)


def test_only_a_half_query_that_sees_every_key_is_cast(monkeypatch, no_kernel):
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


def test_the_measurement_is_of_the_requests_heads_and_its_keys_rounded_up_to_a_power_of_2(monkeypatch, no_kernel):
    asked = []
    monkeypatch.setattr(sdpa, "one_query_in_float32", lambda *request: asked.append(request) or False)
    for keys in (40, 64, 65):
        attention(*_decoded_token(torch.bfloat16, keys), backend="sdpa")
    assert asked == [(torch.bfloat16, 6, 3, 16, 64), (torch.bfloat16, 6, 3, 16, 64), (torch.bfloat16, 6, 3, 16, 128)]


@pytest.mark.parametrize("faster", [False, True], ids=["half-faster", "float32-faster"])
def test_a_compiled_graph_takes_the_choice_measured_before_it_compiled(monkeypatch, no_kernel, faster):
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


def test_a_compiled_decode_step_measures_its_heads_before_it_compiles(monkeypatch, no_kernel):
    monkeypatch.setattr(sdpa, "COMPILED_IN_FLOAT32", {})
    asked = []
    monkeypatch.setattr(sdpa, "one_query_in_float32", lambda *request: asked.append(request) or True)
    model = scrambled(small(pos="rope", n_kv_head=2)).to(torch.bfloat16)
    model = compile_decode(decode_layout(model, one_row="mv", few_rows="linear"))  # a graph's step
    list(generate(model, torch.randint(61, (1, 5)), 3, temperature=0))
    heads = (model.blocks[0].attn.n_head, model.blocks[0].attn.n_kv_head, model.blocks[0].attn.head_dim)
    assert asked == [(torch.bfloat16, *heads, sdpa.COMPILED_KEYS)]  # once, over COMPILED_KEYS keys
    assert sdpa.COMPILED_IN_FLOAT32 == {(torch.bfloat16, *heads): True}
