"""The decode kernel: a decoder's step (Llama's, GPT-2's, Gemma's and the families between) as one
C++ call gives the model's own logits and caches, in every build this CPU runs, and serves
compile_decode where it can."""
import copy
import dataclasses
import os
import re
import subprocess

import pytest
import torch
from torch._dynamo.utils import counters

from selfattn.config import GPTConfig
from selfattn.generation import compile_decode, decode_layout, generate, kernel_step
from selfattn.generation.compiled import compiled_of
from selfattn.generation.int8 import quantize_int8
from selfattn.generation.kernel_step import KernelStep, unsupported
from selfattn.generation.layout import FEW, RowLinear
from selfattn.generation.speculative import Speculative
from selfattn.generation.steps import Steps
from selfattn.kernels import build, features, matvec
from selfattn.model import GPT
from tests.helpers.models import assert_same_logits, left_pad, scrambled, small

LLAMA = {"pos": "rope", "norm": "rmsnorm", "mlp_kind": "swiglu", "intermediate_size": 48, "head_dim": 16,
         "n_kv_head": 2, "tie_embeddings": False, "block_size": 300}
GPT2 = {"pos": "learned", "norm": "layernorm", "mlp_kind": "gelu", "bias": True, "n_kv_head": None, "head_dim": None,
        "intermediate_size": None, "tie_embeddings": True}  # over LLAMA: GPTConfig's defaults, with biases
VARIANTS = {
    "gqa": LLAMA,
    "tied-mqa": LLAMA | {"n_kv_head": 1, "tie_embeddings": True},
    "partial-rotary-llama3": LLAMA | {"rope_dims": 8, "rope_base": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}},
    "qwen2-qkv-biases": LLAMA | {"qkv_bias": True},
    "gpt2": GPT2,
    "layernorm-geglu-erf-no-positions": LLAMA | {"pos": "none", "norm": "layernorm", "mlp_kind": "geglu",
                                                 "gelu_approximate": "none"},
    # the blocks of the other families, as data: norms around the sublayers, q/k norms, windows over rolling caches
    "gemma3": LLAMA | {"norm_position": "sandwich", "norm_offset": 1.0, "norm_weight_in_float32": True,
                       "qk_norm": "head", "embedding_scale": 8.0, "mlp_kind": "geglu", "gelu_approximate": "tanh",
                       "attn_scale": 0.3, "rope_base": 1e6, "window": 16, "window_layers": [True, False],
                       "window_rope_base": 10000.0},
    "gemma2": LLAMA | {"norm_position": "sandwich", "norm_offset": 1.0, "norm_weight_in_float32": True,
                       "mlp_kind": "geglu", "gelu_approximate": "tanh", "softcap": 1.5, "logit_softcap": 2.0,
                       "window": 16, "window_layers": [False, True]},
    "olmo2": LLAMA | {"norm_position": "post", "qk_norm": "projection", "norm_weight_in_float32": True},
    "qwen3": LLAMA | {"qk_norm": "head"},
    "bloom": GPT2 | {"pos": "none", "alibi": True, "embedding_norm": True},
    "sinks-streaming-window": LLAMA | {"sinks": True, "window": 12, "sink_tokens": 3},
    "gpt-oss": LLAMA | {"mlp_kind": "moe", "n_experts": 4, "experts_per_token": 2, "expert_clamp": 1.5,
                        "sinks": True, "qkv_bias": True, "proj_bias": True, "window": 16,
                        "window_layers": [True, False],
                        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
}
EXPERTS = VARIANTS["gpt-oss"] | {"window": None, "window_layers": None}  # (a windowed model has no graphs)


def compiles(isa: str) -> bool:
    """Whether the compiler takes ``isa``'s flags (an old one has no -mavx512bf16): a check that costs
    milliseconds at collection, where building every set would hold up both workers; the tests build."""
    cxx = [os.environ.get("CXX", "c++"), *build.FLAGS[isa], "-x", "c++", "-fsyntax-only", "-"]
    return subprocess.run(cxx, input="", capture_output=True).returncode == 0


BUILDS = [isa for isa in features.instruction_sets() if compiles(isa)]


def llama(seed: int = 0, **config) -> GPT:
    torch.manual_seed(seed)
    return decode_layout(scrambled(small(**(LLAMA | config))), one_row="matvec", few_rows="matvec")


def steps(model: GPT, step, idx, prompt: int, n: int, rollback: int = 0):
    """(logits (B, n, V), caches) of ``step`` fed ``idx`` ``(B, prompt + n)`` one token at a time after the prompt."""
    cache = model.new_cache(idx.shape[0], prompt + n, rollback=rollback)
    with torch.inference_mode():
        model.hidden(idx[:, :prompt], None, cache, 0)
        logits = torch.cat([step(idx[:, p:p + 1], cache, p) for p in range(prompt, prompt + n)], 1)
    return logits, cache


def eager_step(model: GPT):
    return lambda idx, cache, past: Steps(model).step(idx, None, cache, past)[:, None]


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_kernel_steps_give_the_models_logits_and_caches(isa, variant):
    model = llama(1, **VARIANTS[variant])
    idx = torch.randint(61, (2, 150), generator=torch.Generator().manual_seed(1))  # past 128 keys: two runs
    ours, our_cache = steps(model, KernelStep(model, isa=isa), idx, 140, 10)
    theirs, their_cache = steps(model, eager_step(model), idx, 140, 10)
    assert_same_logits(ours, theirs)
    for a, b in zip(our_cache, their_cache):
        assert a.length == b.length == 150
        assert_same_logits(a.k, b.k), assert_same_logits(a.v, b.v)  # up to the order of the products' sums


WINDOWED = ["gemma3", "gemma2", "sinks-streaming-window", "gpt-oss"]


@pytest.mark.parametrize("variant", WINDOWED)
def test_a_rolling_cache_with_spare_slots_shows_each_query_its_window_alone(variant):
    """Slots kept for a rollback hold positions the window no longer sees: the kernel hides them by
    position, in single steps and in a verification of several tokens that wraps the ring."""
    model = llama(8, **VARIANTS[variant])
    idx = torch.randint(61, (2, 60), generator=torch.Generator().manual_seed(8))
    ours, our_cache = steps(model, KernelStep(model), idx, 40, 10, rollback=4)
    theirs, _ = steps(model, eager_step(model), idx, 40, 10, rollback=4)
    assert_same_logits(ours, theirs)
    with torch.inference_mode():  # 5 tokens at once: as many as the caches roll back, plus one
        for c in our_cache:
            c.truncate(45)
        many = KernelStep(model)(idx[:, 45:50], our_cache, 45)  # (B, 5, V)
        eager_cache = model.new_cache(2, 50, rollback=4)
        model.hidden(idx[:, :45], None, eager_cache, 0)
        assert_same_logits(many, model.logits(model.hidden(idx[:, 45:50], None, eager_cache, 45)))
        assert [c.positions().tolist() for c in our_cache] == [c.positions().tolist() for c in eager_cache]
    blind = KernelStep(model)  # control: each query shown every slot the ring holds
    original = kernel_step._layer
    try:
        kernel_step._layer = lambda cache, rope: (0, *original(cache, rope)[1:])
        wrong, _ = steps(model, blind, idx, 40, 10, rollback=4)
    finally:
        kernel_step._layer = original
    assert (wrong - theirs).abs().max() > 1e-2


def test_a_rolling_cache_is_served_as_many_tokens_as_it_rolls_back_plus_one():
    model = llama(**VARIANTS["gemma3"])
    step = KernelStep(model)
    assert step.serves(None, model.new_cache(1, 40, rollback=3), 4)
    assert not step.serves(None, model.new_cache(1, 40, rollback=3), 5)  # the fifth overwrites a key the first sees
    assert not step.serves(None, llama(window=12).new_cache(1, 40), 1)  # another model's caches


def test_a_prompt_of_more_rows_than_the_products_stream_for_is_left_to_blas():
    model = llama()
    step = KernelStep(model)
    assert step.serves(None, model.new_cache(1, 40), FEW) and step.serves(None, model.new_cache(2, 40), FEW // 2)
    assert not step.serves(None, model.new_cache(1, 40), FEW + 1)
    assert not step.serves(None, model.new_cache(2, 40), FEW // 2 + 1)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["gqa", "gpt2", "gemma3", "bloom", "gpt-oss"])
def test_half_precision_steps_round_no_worse_than_eager(isa, dtype, variant):
    """Each rounding held against the float32 model: the kernel's error at most twice eager's plus 2%
    of the logits' range (the rule of the low-precision tests)."""
    reference = llama(2, **VARIANTS[variant])
    model = decode_layout(llama(2, **VARIANTS[variant]).to(dtype), one_row="matvec", few_rows="matvec")
    idx = torch.randint(61, (1, 40), generator=torch.Generator().manual_seed(2))
    exact, _ = steps(reference, eager_step(reference), idx, 30, 10)
    ours, _ = steps(model, KernelStep(model, isa=isa), idx, 30, 10)
    eager, _ = steps(model, eager_step(model), idx, 30, 10)
    err = {name: (x.float() - exact).abs().max().item() for name, x in (("kernel", ours), ("eager", eager))}
    assert ours.dtype == dtype and err["kernel"] <= 2 * err["eager"] + 0.02 * exact.abs().max().item(), err


@pytest.mark.parametrize("variant", ["gqa", "gpt2", "gemma3"])
@pytest.mark.parametrize("layout", ["matvec", "linear"])
def test_int8_weights_step_as_the_quantised_model(variant, layout):
    """Quantised after a layout for another one-row form too, which stores the embedding in columns."""
    model = quantize_int8(decode_layout(llama(3, **VARIANTS[variant]), one_row=layout, few_rows=layout))
    assert layout == "matvec" or not model.wte.weight.is_contiguous()
    idx = torch.randint(61, (3, 20), generator=torch.Generator().manual_seed(3))
    assert_same_logits(steps(model, KernelStep(model), idx, 12, 8)[0], steps(model, eager_step(model), idx, 12, 8)[0])


def test_a_model_quantised_between_generations_decodes_as_it_is_now():
    """The kernel gathers the weights once per cache (a generation's): the next cache reads them anew."""
    model, eager = llama(3), llama(3)
    step = KernelStep(model)
    idx = torch.randint(61, (1, 16), generator=torch.Generator().manual_seed(3))
    assert_same_logits(steps(model, step, idx, 10, 6)[0], steps(eager, eager_step(eager), idx, 10, 6)[0])
    quantize_int8(model), quantize_int8(eager)
    ours, theirs = steps(model, step, idx, 10, 6)[0], steps(eager, eager_step(eager), idx, 10, 6)[0]
    assert_same_logits(ours, theirs)
    assert not torch.equal(ours, steps(llama(3), eager_step(llama(3)), idx, 10, 6)[0])  # control: int8 changed them


@pytest.mark.parametrize("variant", ["gqa", "gpt2"])
def test_compile_decode_generates_through_the_kernel_without_a_graph(variant):
    eager, compiled = llama(4, **VARIANTS[variant]), compile_decode(llama(4, **VARIANTS[variant]))
    assert compiled_of(compiled).kernel is not None
    idx = torch.randint(61, (2, 9), generator=torch.Generator().manual_seed(4))
    before = counters["stats"]["unique_graphs"]
    for sample in ({"temperature": 0.0}, {"temperature": 0.9, "top_k": 20}):
        runs = [torch.stack(list(generate(m, idx, 30, generator=torch.Generator().manual_seed(5), **sample)), 1)
                for m in (eager, compiled)]
        assert torch.equal(runs[1], runs[0])
    assert counters["stats"]["unique_graphs"] == before


@pytest.mark.parametrize("variant", WINDOWED)
def test_compile_decode_runs_a_windowed_model_on_the_kernel_and_the_rest_eagerly(variant):
    """No graph follows a rolling cache: the kernel decodes, and a padded batch and the prefill step
    eagerly; greedy, sampled, padded and speculative tokens all equal eager decoding's."""
    eager, compiled = llama(9, **VARIANTS[variant]), compile_decode(llama(9, **VARIANTS[variant]))
    assert compiled_of(compiled).kernel is not None and not compiled_of(compiled).graphs
    before = counters["stats"]["unique_graphs"]
    idx = torch.randint(61, (2, 9), generator=torch.Generator().manual_seed(9))
    for sample in ({"temperature": 0.0}, {"temperature": 0.9, "top_k": 20}):  # 40 tokens: past the windows
        runs = [torch.stack(list(generate(m, idx, 40, generator=torch.Generator().manual_seed(5), **sample)), 1)
                for m in (eager, compiled)]
        assert torch.equal(runs[1], runs[0])
    padded, mask = left_pad([torch.randint(61, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 8)])
    runs = [torch.stack(list(generate(m, padded, 20, temperature=0.0, attention_mask=mask))) for m in (eager, compiled)]
    assert torch.equal(runs[1], runs[0])
    prompt = idx[:1, :6].repeat(1, 4)  # text to look up
    specs = [Speculative("lookup", k=2, max_k=6, ngram=1) for _ in range(2)]
    runs = [torch.stack(list(generate(m, prompt, 30, speculative=spec, temperature=0.0)), 1)
            for m, spec in zip((eager, compiled), specs)]
    assert torch.equal(runs[1], runs[0]) and specs[1].stats == specs[0].stats and specs[0].stats.drafted > 0
    assert counters["stats"]["unique_graphs"] == before  # nothing compiled a graph


def test_a_model_training_with_dropout_steps_as_it_is():
    model = compile_decode(llama(dropout=0.1))
    assert compiled_of(model).kernel.serves(None, [])
    model.train()
    assert not compiled_of(model).kernel.serves(None, [])  # dropout is drawn: the graph's step, not the kernel's


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_padded_rows_step_through_the_graph_as_eager():
    eager, compiled = llama(5), compile_decode(llama(5))
    idx, mask = left_pad([torch.randint(61, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 8)])
    assert not compiled_of(compiled).kernel.serves(torch.ones(2, 9, dtype=torch.bool), [])
    runs = [torch.stack(list(generate(m, idx, 10, temperature=0.0, attention_mask=mask))) for m in (eager, compiled)]
    assert torch.equal(runs[1], runs[0])


@pytest.mark.parametrize(("change", "why"), [
    (lambda m: quantize_int8(llama(**EXPERTS)), "its experts are not stored in rows of torch.float32 "
                                                "(decode_layout() stores them so; an int8"),
    (lambda m: _set(m := llama(**EXPERTS), m.blocks[1].mlp.down_proj, "data",
                    m.blocks[1].mlp.down_proj.data.contiguous()), "its experts are not stored in rows"),
    (lambda m: llama(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                   "original_max_position_embeddings": 32}), "layer 0 rotates by longrope"),
    (lambda m: _set(m, m.blocks[1].attn, "score_mod", lambda s, b, h, q, k: s), "layer 1 has a mask or score rule"),
    (lambda m: _set(m, m.blocks[1].ln_2, "eps", 1e-3), "its norms are not all RMSNorm or all LayerNorm"),
    (lambda m: _without_norm_weights(llama(**GPT2)), "its norms are not all RMSNorm or all LayerNorm (with a weight)"),
    (lambda m: _set(m, m.blocks[0].attn, "rope_dims", 8), "its layers rotate different channels"),
    (lambda m: m.double(), "the model is torch.float64"),
    (lambda m: decode_layout(m, one_row="mv"), "its one-row products are not the matvec kernel's (mv"),
    (lambda m: scrambled(small(**LLAMA)), "its one-row products are not the matvec kernel's (nn.Linear"),
])
def test_models_it_cannot_run_are_named_with_the_reason(change, why):
    model = change(llama())
    assert why in unsupported(model)
    with pytest.raises(ValueError, match=f"^the decode kernel cannot run this model: .*{re.escape(why)}"):
        KernelStep(model)
    if any(type(m) is RowLinear for m in model.modules()):
        assert compiled_of(compile_decode(model)).kernel is None  # its steps stay graphs


def _without_norm_weights(model: GPT) -> GPT:
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.weight = m.bias = None
    return model


def _set(model: GPT, module, name: str, value) -> GPT:
    setattr(module, name, value)
    return model


@pytest.mark.parametrize("variant", ["gqa", "gemma3"])  # gemma3: no graph to fall back on
def test_compile_decode_alone_gives_the_kernel_where_it_serves(variant):  # the one call of the fast path
    eager = scrambled(small(**VARIANTS[variant]))
    fast = compile_decode(copy.deepcopy(eager))  # not laid out: compile_decode lays the weights out itself
    assert compiled_of(fast).kernel is not None
    idx = torch.randint(61, (1, 7), generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.stack(list(generate(fast, idx, 12, temperature=0))),
                       torch.stack(list(generate(eager, idx, 12, temperature=0))))


def test_every_config_field_is_handled_by_the_kernel():
    fields = [f.name for f in dataclasses.fields(GPTConfig)]
    assert sorted(kernel_step.HANDLED) == sorted(fields)  # a new field must be placed


def test_without_the_kernels_build_compile_decode_keeps_graphs(monkeypatch):
    model = llama()
    monkeypatch.setattr(matvec, "failure", lambda isa=None: "no C++ compiler found")
    assert unsupported(model) == "the kernel did not build here (no C++ compiler found)"
    assert compiled_of(compile_decode(model)).kernel is None


@pytest.mark.parametrize("isa", BUILDS)
def test_several_tokens_at_once_give_the_models_logits(isa):
    """A speculative verification: T tokens a row, causal among themselves, after the cached ones."""
    model = llama(6)
    idx = torch.randint(61, (2, 135), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        caches = model.new_cache(2, 140), model.new_cache(2, 140)
        for cache in caches:
            model.hidden(idx[:, :125], None, cache, 0)  # the 5 fed tokens straddle the keys' first run of 128
        ours = KernelStep(model, isa=isa)(idx[:, 125:130], caches[0], 125)  # (B, 5, V)
        theirs = model.logits(model.hidden(idx[:, 125:130], None, caches[1], 125))
    assert ours.shape == (2, 5, 61) and caches[0][1].length == 130
    assert_same_logits(ours, theirs)


def test_speculative_verifications_run_on_the_kernel_with_the_eager_tokens():
    eager, compiled = llama(7), compile_decode(llama(7))
    prompt = torch.randint(61, (1, 6), generator=torch.Generator().manual_seed(7)).repeat(1, 4)  # text to look up
    before = counters["stats"]["unique_graphs"]
    for sample in ({"temperature": 0.0}, {"temperature": 0.9, "top_k": 20}):
        specs = [Speculative("lookup", k=2, max_k=6, ngram=1) for _ in range(2)]
        runs = [torch.stack(list(generate(m, prompt, 20, speculative=spec, generator=torch.Generator().manual_seed(8),
                                            **sample)), 1) for m, spec in zip((eager, compiled), specs)]
        assert torch.equal(runs[1], runs[0])
        assert specs[1].stats == specs[0].stats and specs[0].stats.drafted > 0
    assert counters["stats"]["unique_graphs"] == before  # every forward was the kernel's
