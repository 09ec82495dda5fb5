"""KV-cache decoding equals the full forward; generate streams, samples and stops correctly."""
import re
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from selfattn.generation import decode_layout, generate, kernel_step, layout, steps
from selfattn.generation.layout import FEW, RowLinear
from selfattn.generation.sampling import greedy, next_token, top_k_filter, top_p_filter
from selfattn.generation.steps import KernelSteps, Steps, steps_of
from selfattn.interp import hooks
from selfattn.kernels import features, matvec
from selfattn.kv_cache import KVCache, RollingKVCache

from helpers.models import BACKENDS, PAIRS, VARIANTS, assert_same_logits, left_pad, scrambled, small

INF = float("inf")
SPLITS = {"token-by-token": [5] + [1] * 11, "chunks": [4, 3, 1, 5, 3]}  # prefill, then the rest; 16 tokens


def decode(model, idx, splits, mask=None, cache=None):
    """Logits ``(B, T, V)`` from feeding idx through a KV cache in pieces of the given sizes."""
    cache = model.new_cache(idx.shape[0]) if cache is None else cache
    out, start = [], 0
    for n in splits:
        m = None if mask is None else mask[:, :start + n]
        out.append(model(idx[:, start:start + n], attention_mask=m, cache=cache)[0])
        start += n
    assert start == idx.shape[1]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("variant, backend", PAIRS)
def test_cached_decoding_equals_full_forward(variant, backend, split):
    model = scrambled(small(backend=backend, **VARIANTS[variant]))
    idx = torch.randint(0, 61, (2, 16))
    full, _ = model(idx)
    cached = decode(model, idx, SPLITS[split])
    assert_same_logits(cached, full)
    assert torch.equal(cached.argmax(-1), full.argmax(-1))  # the greedy choice at every step


def test_the_logits_bound_catches_a_hidden_key():
    """Control: cached decoding whose mask hides the first token, a real mistake, is outside the
    bound that cached and full logits are held to."""
    model = scrambled(small(**VARIANTS["rope"]))
    idx = torch.randint(0, 61, (2, 16))
    full, _ = model(idx)
    hidden = torch.ones(2, 16, dtype=torch.long)
    hidden[:, 0] = 0
    wrong = decode(model, idx, SPLITS["token-by-token"], hidden)
    with pytest.raises(AssertionError):
        assert_same_logits(wrong[:, 1:], full[:, 1:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["learned", "rope-gqa-window-bias"])
def test_cached_decoding_with_left_padding(variant, backend):
    model = scrambled(small(backend=backend, **VARIANTS[variant]))
    idx, mask = left_pad([torch.randint(1, 61, (n,)) for n in (16, 9, 12)])
    full, _ = model(idx, attention_mask=mask)
    cached = decode(model, idx, SPLITS["token-by-token"], mask)
    real = mask.bool()
    assert_same_logits(cached[real], full[real])


@pytest.mark.parametrize("backend", BACKENDS)
def test_unused_cache_slots_are_never_read(backend):
    model = scrambled(small(backend=backend, **VARIANTS["rope-gqa-window-bias"]))
    idx = torch.randint(0, 61, (2, 10))
    full, _ = model(idx)
    cache = model.new_cache(2)
    for layer in cache:
        layer.k.fill_(float("nan"))
        layer.v.fill_(float("nan"))
    cached = decode(model, idx, [3, 1, 4, 2], cache=cache)
    assert torch.isfinite(cached).all()
    assert_same_logits(cached, full)
    layer = cache[0]  # negative control: one NaN slot made live poisons the next step
    if isinstance(layer, RollingKVCache):  # (this windowed variant decodes through a rolling cache)
        layer.k[:, :, layer._slots(torch.tensor([layer.length - 1]))] = float("nan")
    else:
        layer.length = 11
    assert torch.isnan(model(idx[:, :1], cache=cache)[0]).any()


def test_cache_reset_reuses_memory():
    model = scrambled(small())
    idx = torch.randint(0, 61, (1, 8))
    cache = model.new_cache(1, max_len=8)
    first = decode(model, idx, [8], cache=cache)
    with pytest.raises(ValueError, match="cache overflow: 8 cached"):
        model(idx[:, :1], cache=cache)
    storage = cache[0].k.data_ptr()
    for layer in cache:
        layer.reset()
    assert cache[0].length == 0
    assert torch.equal(decode(model, idx, [8], cache=cache), first)
    assert cache[0].k.data_ptr() == storage and cache[0].length == 8


def test_new_cache_and_bad_caches():
    model = scrambled(small(n_kv_head=2))
    cache = model.new_cache(3)
    assert len(cache) == 2 and all(isinstance(c, KVCache) for c in cache)
    assert cache[0].k.shape == (3, 2, 24, 8) and cache[0].k.dtype == torch.float32
    assert model.double().new_cache(1, max_len=5)[1].v.shape == (1, 2, 5, 8)
    assert model.new_cache(1)[0].k.dtype == torch.float64
    with pytest.raises(ValueError, match="max_len=25 exceeds block_size=24"):
        model.new_cache(1, max_len=25)
    with pytest.raises(ValueError, match="batch_size must be a positive int, got 0"):
        model.new_cache(0)
    idx = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="cache is for batch 3, torch.float32"):
        model(idx, cache=cache)
    with pytest.raises(TypeError, match="list of 2 KVCache"):
        model(idx, cache=model.new_cache(2)[:1])


@pytest.mark.parametrize("variant, backend", PAIRS)
def test_greedy_generation_equals_recomputing_the_prefix(variant, backend):
    model = scrambled(small(backend=backend, **VARIANTS[variant]))
    idx = torch.randint(0, 61, (2, 5))
    steps = generate(model, idx, 8, temperature=0)
    assert iter(steps) is steps  # a lazy iterator: tokens arrive one step at a time
    tokens = list(steps)
    assert len(tokens) == 8 and all(t.shape == (2,) and t.dtype == torch.long for t in tokens)
    seq = idx
    with torch.no_grad():
        for _ in range(8):
            seq = torch.cat([seq, model(seq)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(torch.stack(tokens, 1), seq[:, 5:])


@pytest.mark.parametrize("variant", ["learned", "rope-gqa-window-bias"])
def test_padded_batch_generates_what_each_prompt_generates_alone(variant):
    model = scrambled(small(**VARIANTS[variant]))
    prompts = [torch.randint(1, 61, (n,)) for n in (2, 7, 4)]
    idx, mask = left_pad(prompts)
    batched = torch.stack(list(generate(model, idx, 9, temperature=0, attention_mask=mask)), 1)
    for i, p in enumerate(prompts):
        alone = torch.stack(list(generate(model, p[None], 9, temperature=0)), 1)
        assert torch.equal(batched[i], alone[0]), i
    unmasked = torch.stack(list(generate(model, idx, 9, temperature=0)), 1)
    assert not torch.equal(unmasked, batched)  # negative control: padding unmasked changes the output


def test_top_k_filter_on_a_hand_made_distribution():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.5], [2.0, 2.0, 1.0, 2.0, 0.0]])
    assert torch.equal(top_k_filter(logits, 2), torch.tensor([[-INF, 4.0, 3.0, -INF, -INF],
                                                             [2.0, 2.0, -INF, 2.0, -INF]]))  # ties kept
    assert torch.equal(top_k_filter(logits, 1)[0], torch.tensor([-INF, 4.0, -INF, -INF, -INF]))
    assert torch.equal(top_k_filter(logits, 5), logits) and torch.equal(top_k_filter(logits, 50), logits)


def test_top_p_filter_on_a_hand_made_distribution():
    probs = torch.tensor([[0.1, 0.5, 0.25, 0.15], [0.97, 0.01, 0.01, 0.01]])
    logits = probs.log()
    keep = {0.3: [[0, 1, 0, 0], [1, 0, 0, 0]],  # 0.5 alone already reaches 0.3
            0.6: [[0, 1, 1, 0], [1, 0, 0, 0]],  # 0.5 < 0.6 <= 0.75
            0.8: [[0, 1, 1, 1], [1, 0, 0, 0]],  # 0.75 < 0.8 <= 0.9
            0.95: [[1, 1, 1, 1], [1, 0, 0, 0]],
            0.975: None,  # 0.97 < 0.975 <= 0.98: one of the three tied tail tokens joins the 0.97
            1.0: [[1, 1, 1, 1], [1, 1, 1, 1]]}
    for p, expected in keep.items():
        got = top_p_filter(logits, p)
        kept = torch.isfinite(got)
        if expected is None:
            assert kept[0].all() and kept[1, 0] and kept[1].sum() == 2, kept
            continue
        assert torch.equal(kept, torch.tensor(expected, dtype=torch.bool)), (p, kept)
        assert torch.equal(got[kept], logits[kept])  # kept logits untouched


def test_sampling_follows_the_filtered_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0, -1.0]).repeat(4000, 1)  # (B=4000, V=5): many draws at once
    g = torch.Generator().manual_seed(0)

    def freq(**kw):
        return torch.bincount(next_token(logits, generator=g, **kw), minlength=5).float() / 4000

    def expected(x):
        return torch.softmax(x, -1)

    row = logits[0]
    torch.testing.assert_close(freq(), expected(row), rtol=0, atol=0.03)
    torch.testing.assert_close(freq(temperature=0.5), expected(row / 0.5), rtol=0, atol=0.03)
    torch.testing.assert_close(freq(top_k=2), expected(top_k_filter(row, 2)), rtol=0, atol=0.03)
    p = freq(top_p=0.7)  # probs 0.64, 0.24, ...: the top two tokens hold 0.88 >= 0.7
    assert p[[0, 1, 4]].sum() == 0 and abs(p[3].item() - 0.64 / 0.88) < 0.03
    assert torch.equal(next_token(logits[:3], temperature=0), torch.tensor([3, 3, 3]))
    assert torch.equal(next_token(logits[:3], top_k=1, generator=g), torch.tensor([3, 3, 3]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_greedy_picks_the_first_of_tied_maxima_in_every_dtype(dtype):
    logits = torch.randn(3, 1000).to(dtype)  # (B, V), half-precision ones compared in float32
    logits[1, [7, 400, 999]] = logits[1].max() + 1  # a three-way tie: the first wins
    logits[2, 5] = float("inf")
    picked = greedy(logits)
    assert picked.dtype == torch.int64 and torch.equal(picked, logits.double().argmax(dim=-1))
    assert picked[1] == 7 and picked[2] == 5


def test_generator_makes_sampling_reproducible():
    model = scrambled(small())
    idx = torch.randint(0, 61, (2, 4))

    def run(seed):
        return torch.stack(list(generate(model, idx, 12, temperature=1.5, top_k=20, top_p=0.95,
                                               generator=torch.Generator().manual_seed(seed))), 1)

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))


def test_eos_finishes_rows_and_the_stream():
    model = scrambled(small())
    idx = torch.randint(0, 61, (2, 4))

    def run(prompt, **kw):  # sampled, so rows are diverse; the same draws with or without eos
        g = torch.Generator().manual_seed(0)
        return torch.stack(list(generate(model, prompt, 10, temperature=2.0, generator=g, **kw)), 1)

    def first_new(row, avoid):  # (step, token) of the first token new to the row and absent from avoid
        return next((s, t) for s, t in enumerate(row.tolist()) if s > 0 and t not in row[:s] and t not in avoid)

    free = run(idx)
    stop, eos = first_new(free[0], free[1])
    got = run(idx, eos_token=eos)
    assert stop < 9 and got.shape == (2, 10)
    assert torch.equal(got[0, :stop + 1], free[0, :stop + 1]) and torch.all(got[0, stop:] == eos)  # then only eos
    assert torch.equal(got[1], free[1])  # the other row is unaffected
    stop, eos = first_new(run(idx[:1])[0], [])
    alone = run(idx[:1], eos_token=eos)
    assert alone.shape == (1, stop + 1) and alone[0, -1] == eos  # every row finished: the generator ended


def test_generate_runs_in_inference_mode_and_max_new_tokens_zero():
    model = scrambled(small())
    idx = torch.randint(0, 61, (1, 4))
    tok = next(generate(model, idx, 3))
    assert tok.is_inference() and not tok.requires_grad
    assert list(generate(model, idx, 0)) == []
    assert len(list(generate(model, torch.zeros(1, 20, dtype=torch.long), 5, temperature=0))) == 5  # 24 positions


@pytest.mark.parametrize("kw,words", [
    ({"temperature": -1.0}, ["temperature", "-1.0"]),
    ({"top_k": 0}, ["top_k", "0"]),
    ({"top_p": 1.5}, ["top_p", "1.5"]),
    ({"eos_token": 61}, ["eos_token", "61"]),
    ({"max_new_tokens": -1}, ["max_new_tokens", "-1"]),
    ({"max_new_tokens": 22}, ["4 tokens + 22 new", "25 positions", "block_size=24"]),
    ({"attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])}, ["left padding"]),
    ({"attention_mask": torch.ones(2, 3, dtype=torch.long)}, ["(B=2, S=4)"]),
])
def test_bad_generate_arguments_fail_at_the_call(kw, words):
    kw = {"max_new_tokens": 3, **kw}
    model = scrambled(small())
    with pytest.raises(ValueError) as info:
        generate(model, torch.zeros(2, 4, dtype=torch.long), **kw)  # no next(): checked eagerly
    assert all(w in str(info.value) for w in words), str(info.value)


def test_decode_layout_changes_strides_only():
    model = scrambled(small(**VARIANTS["rope-gqa-window-bias"]))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    idx = torch.randint(0, 61, (2, 6))
    logits, _ = model(idx)
    tokens = torch.stack(list(generate(model, idx, 10, temperature=0)), 1)
    assert decode_layout(model, one_row="mv", few_rows="linear") is model  # float32 in (in, out) columns
    w = model.blocks[0].mlp.c_fc.weight
    assert w.shape == (128, 32) and w.stride() == (1, 128) and w.t().is_contiguous()
    assert model.lm_head.weight is model.wte.weight and model.wte.weight.stride() == (1, 61)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert_same_logits(model(idx)[0], logits)
    assert torch.equal(torch.stack(list(generate(model, idx, 10, temperature=0)), 1), tokens)
    decode_layout(model, one_row="mv", few_rows="linear")  # idempotent
    assert model.blocks[0].mlp.c_fc.weight.stride() == (1, 128)


def test_generate_decodes_on_the_kernel_by_default_and_leaves_the_model_as_it_was(monkeypatch):
    model = scrambled(small(**VARIANTS["llama-shaped"])).eval()
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    classes = [type(m) for m in model.modules()]
    idx = torch.randint(0, 61, (2, 6))
    if matvec.failure() is not None:  # no kernel here: the eager steps
        assert type(steps_of(model)) is Steps
        return
    kernel = steps_of(model)
    assert type(kernel) is KernelSteps
    caches = [model.new_cache(2, 16) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            Steps(model).step(idx, None, cache, 0)
        for p in range(6, 12):  # each decode step the kernel's, the eager step's within another order of sums
            tok = torch.randint(0, 61, (2, 1))
            assert_same_logits(kernel.step(tok, None, caches[0], p), Steps(model).step(tok, None, caches[1], p))
    tokens = torch.stack(list(generate(model, idx, 12, temperature=0)), 1)
    monkeypatch.setattr(steps, "unsupported", lambda model, **kw: "control: eager")
    assert type(steps_of(model)) is Steps
    assert torch.equal(torch.stack(list(generate(model, idx, 12, temperature=0)), 1), tokens)
    assert [type(m) for m in model.modules()] == classes  # nothing swapped, laid out or copied
    assert all(v.data_ptr() == before[k][0] and torch.equal(v, before[k][1]) for k, v in model.state_dict().items())


def test_the_kernel_passes_its_steps_to_eager_ones_where_it_does_not_serve():
    model = scrambled(small(**VARIANTS["llama-shaped"], dropout=0.1)).train()  # dropout to draw
    if matvec.failure() is not None:
        return
    cache = model.new_cache(1, 8)
    assert not steps_of(model).kernel.serves(None, cache)
    assert steps_of(model.eval()).kernel.serves(None, cache)
    assert "its experts are not stored in rows" in kernel_step.unsupported(
        scrambled(small(**VARIANTS["post-norm-experts-sinks"])), as_stored=True)  # gpt-oss's, until decode_layout
    with hooks(model, {"blocks.0.hook_resid_pre": lambda t, n: None}):  # hooks fire: eager
        assert type(steps_of(model)) is Steps
    half = scrambled(small(**VARIANTS["llama-shaped"])).eval().to(torch.bfloat16)
    assert "nn.Linear in torch.bfloat16" in kernel_step.unsupported(half, as_stored=True)  # tokens would move
    assert type(steps_of(half)) is Steps and type(steps_of(decode_layout(half))) is KernelSteps  # laid out: bitwise


@pytest.mark.parametrize("isa", features.instruction_sets())  # every build this CPU runs, whichever it chose
def test_the_default_kernel_gives_the_eager_tokens_in_every_build(monkeypatch, isa):
    monkeypatch.setattr(matvec, "_chosen", [isa])
    if matvec.failure() is not None:
        return
    for seed in range(4):
        torch.manual_seed(seed)
        model = scrambled(small(**VARIANTS["llama-shaped"])).eval()
        idx = torch.randint(0, 61, (2, 6))
        assert type(steps_of(model)) is KernelSteps and steps_of(model).kernel.isa is None  # the chosen build
        tokens = torch.stack(list(generate(model, idx, 12, temperature=0)), 1)
        with monkeypatch.context() as eager:
            eager.setattr(steps, "unsupported", lambda model, **kw: "control: eager")
            assert torch.equal(torch.stack(list(generate(model, idx, 12, temperature=0)), 1), tokens), seed


def test_decode_layout_takes_the_matvec_kernel_by_rule_wherever_it_builds(monkeypatch):
    model = decode_layout(scrambled(small()))
    linears = [m for m in model.modules() if isinstance(m, RowLinear)]
    if matvec.failure() is None:  # no race: the same forms whatever the machine is doing
        assert {(m.one_row, m.few_rows) for m in linears} == {("matvec", "matvec")}
        assert all(m.weight.is_contiguous() for m in linears)  # rows, which the kernel streams
    monkeypatch.setattr(matvec, "failure", lambda isa=None: "no C++ compiler found")
    decode_layout(model)  # control: where it does not build, PyTorch's forms
    assert {(m.one_row, m.few_rows) for m in linears} == {("mv", "linear")}
    assert all(m.weight.t().is_contiguous() for m in linears)  # float32: (in, out), as mv reads it fastest


@pytest.mark.parametrize("forms", [("mv", "linear"), ("linear", "wxt"), ("wxt", "wxt"), ("matvec", "linear"),
                                   ("matvec", "wxt"), ("matvec", "matvec"), (None, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_layout_computes_the_same_whatever_products_it_takes(dtype, forms):
    model = scrambled(small(**VARIANTS["llama-shaped"])).to(dtype)
    idx = torch.randint(0, 61, (3, 6))
    logits = model(idx)[0]
    tokens = torch.stack(list(generate(model, idx[:1], 10, temperature=0)), 1)
    one_row, few_rows = forms
    decode_layout(model, one_row=one_row, few_rows=few_rows)  # None, None: by the rule
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is RowLinear for m in linears)
    assert all(m.one_row == (one_row or linears[0].one_row) and m.few_rows == (few_rows or linears[0].few_rows)
               for m in linears)  # one choice per dtype
    w = model.blocks[0].attn.qkv.weight
    in_rows = dtype != torch.float32 or linears[0].one_row == "matvec"  # BLAS forms read float32 in (in, out)
    assert w.is_contiguous() if in_rows else w.t().is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 3e-2 * logits.abs().max().item()
    torch.testing.assert_close(model(idx)[0], logits, rtol=0, atol=tol)  # 18 rows: F.linear
    torch.testing.assert_close(model(idx[:1])[0], logits[:1], rtol=0, atol=tol)  # 6 rows: the few-row form
    torch.testing.assert_close(model(idx[:1, :1])[0], logits[:1, :1], rtol=0, atol=tol)  # one row
    if dtype == torch.float32:
        assert torch.equal(torch.stack(list(generate(model, idx[:1], 10, temperature=0)), 1), tokens)


def test_decode_layout_again_after_a_cast_stores_each_dtype_in_its_order():
    model = decode_layout(scrambled(small()), one_row="mv")  # float32: (in, out)
    weights = lambda: [m.weight for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    model.to(torch.bfloat16)
    assert all(w.t().is_contiguous() and not w.is_contiguous() for w in weights())  # the cast kept (in, out)
    decode_layout(model, one_row="mv")
    assert all(w.is_contiguous() for w in weights())  # half: (out, in) rows, which mv streams fast
    decode_layout(model.float(), one_row="mv")
    assert all(w.t().is_contiguous() for w in weights())


@pytest.mark.parametrize("bias", [False, True])
def test_a_row_linear_takes_its_forms_by_the_number_of_rows(monkeypatch, bias):
    linear = RowLinear(8, 4, bias=bias)
    linear.one_row, linear.few_rows = "mv", "wxt"
    calls = []
    for name, product in dict(layout.PRODUCTS).items():
        recorded = lambda w, rows, name=name, product=product: calls.append((name, len(rows))) or product(w, rows)
        monkeypatch.setitem(layout.PRODUCTS, name, recorded)
    for shape, called in (((1, 1, 8), [("mv", 1)]), ((2, 3, 8), [("wxt", 6)]), ((1, FEW, 8), [("wxt", FEW)]),
                          ((1, FEW + 1, 8), []), ((0, 8), [])):  # more rows, or none: F.linear
        calls.clear()
        x = torch.randn(shape)
        torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias), rtol=0, atol=1e-6)
        assert calls == called, (shape, calls)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_many_half_rows_are_multiplied_in_float32_where_the_cpu_has_no_native_half(monkeypatch, dtype):
    """A prompt's products: an emulated half-precision matmul is many times slower than float32's, so
    they are widened (each product of two half values exact in float32) and rounded back once."""
    linear = RowLinear(64, 48, bias=True).to(dtype)
    x = torch.randn(3, FEW, 64).to(dtype)  # 48 rows: many
    linears = []
    linear_of_torch = F.linear
    monkeypatch.setattr(layout.F, "linear", lambda *a: linears.append(a[0].dtype) or linear_of_torch(*a))
    widened = torch.addmm(linear.bias.float(), x.reshape(-1, 64).float(), linear.weight.float().t())  # (48, 48)
    for native, computed in ((False, torch.float32), (True, dtype)):  # control: natively, in half
        monkeypatch.setattr(layout, "multiplies_natively", lambda device, d, native=native: native)
        linears.clear()
        y = linear(x)
        assert linears == [computed] and y.dtype == dtype
        torch.testing.assert_close(y.reshape(-1, 48).float(), widened, rtol=1e-2, atol=1e-2)


def slowed(form):
    product = layout.PRODUCTS[form]
    return lambda w, rows: time.sleep(2e-3) or product(w, rows)


def test_decode_layout_measures_the_matvec_kernel_with_the_matrices_in_rows(monkeypatch):
    model = scrambled(small())
    matrices = lambda: [m.weight for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    for form in ("mv", "linear", "wxt"):
        monkeypatch.setitem(layout.PRODUCTS, form, slowed(form))
    decode_layout(model, measure=True)
    assert (model.lm_head.one_row, model.lm_head.few_rows) == ("matvec", "matvec")
    assert all(w.is_contiguous() for w in matrices())  # rows, embeddings too: the kernel streams rows
    monkeypatch.setitem(layout.PRODUCTS, "matvec", slowed("matvec"))
    monkeypatch.setitem(layout.PRODUCTS, "mv", lambda w, rows: torch.mv(w, rows[0])[None])
    decode_layout(model, measure=True)  # control: mv measured fastest, the float32 matrices back in (in, out) order
    assert model.lm_head.one_row == "mv" and all(w.t().is_contiguous() for w in matrices())
    assert model.lm_head.few_rows != "matvec"  # it reads rows, which mv leaves in (in, out)
    monkeypatch.setattr(matvec, "failure", lambda isa=None: "no C++ compiler found")
    decode_layout(model, measure=True)  # control: a machine where the kernel does not build keeps PyTorch's forms
    assert model.lm_head.one_row in ("mv", "linear", "wxt") and model.lm_head.few_rows in ("linear", "wxt")
    with pytest.raises(ValueError, match=re.escape("few_rows='matvec' cannot run: its kernel did not build here "
                                                   "(no C++ compiler found); name another form")):
        decode_layout(model, few_rows="matvec")


def test_the_stream_form_multiplies_what_its_kernel_does_not_take_by_f_linear():
    model = decode_layout(scrambled(small()), one_row="matvec", few_rows="matvec")
    idx = torch.randint(0, 61, (1, 6))
    logits = model(idx)[0]
    model.double()  # float64 after the layout: no kernel for it
    torch.testing.assert_close(model(idx)[0], logits.double(), rtol=0, atol=1e-5)
    torch.testing.assert_close(model(idx[:, :1])[0], logits[:, :1].double(), rtol=0, atol=1e-5)


def test_decode_layout_measures_the_fastest_form(monkeypatch):

    model = scrambled(small())
    for form in ("mv", "linear", "matvec"):
        monkeypatch.setitem(layout.PRODUCTS, form, slowed(form))
    decode_layout(model, measure=True)
    assert (model.lm_head.one_row, model.lm_head.few_rows) == ("wxt", "wxt")
    monkeypatch.undo()
    for form in ("wxt", "mv", "matvec"):
        monkeypatch.setitem(layout.PRODUCTS, form, slowed(form))
    decode_layout(model, measure=True)  # control: the measurement follows the times
    assert (model.lm_head.one_row, model.lm_head.few_rows) == ("linear", "linear")


@pytest.mark.parametrize("kw, words", [(dict(one_row="gemv"), "one_row must be one of 'mv', 'linear', 'wxt', 'matvec'"),
                                       (dict(few_rows="mv"), "few_rows must be one of 'linear', 'wxt', 'matvec' or None"
                                                             " (measured), got 'mv'")])
def test_decode_layout_names_a_product_it_does_not_know(kw, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        decode_layout(scrambled(small()), **kw)


def test_decode_layout_stores_an_embedding_alone_in_its_dtype_without_measuring():
    model = scrambled(small())
    model.wpe.to(torch.bfloat16)  # positions in a dtype no matrix product shares
    decode_layout(model)
    assert model.wpe.weight.dtype == torch.bfloat16 and model.wpe.weight.is_contiguous()  # half: rows
    head = model.lm_head  # float32 matrices in the order of the form the rule chose
    assert head.weight.is_contiguous() == layout.stored_in_rows(head.one_row, torch.float32)
    assert head.weight.t().is_contiguous() != head.weight.is_contiguous()
