"""compile_decode: one compiled graph serves every decode step, with eager decoding's tokens;
speculative decoding compiled drafts and verifies as eagerly."""
import copy

import pytest
import torch
from torch._dynamo.utils import counters

from selfattn.generation import compile_decode, decode_layout, generate
from selfattn.generation import compiled as compiled_decode
from selfattn.generation.int8 import quantize_int8
from selfattn.generation.sampling import next_token
from selfattn.generation.speculative import Speculative
from selfattn.generation.steps import Steps, steps_of
from selfattn.kernels import matvec
from selfattn.model import GPT
from tests.helpers.models import assert_same_logits, left_pad, scrambled, small

LLAMA = {"pos": "rope", "norm": "rmsnorm", "mlp_kind": "swiglu", "intermediate_size": 48, "head_dim": 16,
         "n_kv_head": 2, "qkv_bias": True, "tie_embeddings": False, "block_size": 64}
GPT2 = {"bias": True, "block_size": 64}


def twins(seed: int = 0, **config) -> tuple[GPT, GPT]:
    """(eager, compiled): one model's weights, decode_layout'ed, the second decoding compiled."""
    torch.manual_seed(seed)
    eager = decode_layout(scrambled(small(**config)), one_row="mv", few_rows="linear")  # graphs, not the kernel
    compiled = decode_layout(scrambled(small(**config)), one_row="mv", few_rows="linear")
    compiled.load_state_dict(eager.state_dict())
    return eager, compile_decode(compiled)


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_compiled_steps_give_eager_logits_and_tokens(config):
    eager, compiled = twins(**config)
    idx = torch.randint(61, (2, 7), generator=torch.Generator().manual_seed(1))  # (B, T)
    caches = eager.new_cache(2, 20), compiled.new_cache(2, 20)
    with torch.inference_mode():
        tok = idx
        for past in (0, 7, 8, 9, 10):  # the prompt eagerly, then compiled steps
            steps = Steps(eager).step, Steps(compiled).step if past == 0 else steps_of(compiled).step
            logits = [step(tok, None, cache, past) for step, cache in zip(steps, caches)]
            assert_same_logits(logits[1], logits[0])
            tok = logits[0].argmax(-1, keepdim=True)  # (B, 1)
    for sample in ({"temperature": 0.0}, {"temperature": 0.9, "top_k": 20}):
        runs = [torch.stack(list(generate(m, idx, 12, generator=torch.Generator().manual_seed(2), **sample)), 1)
                for m in (eager, compiled)]
        assert torch.equal(runs[1], runs[0])


def test_one_graph_serves_every_step_and_every_generation():
    eager, compiled = twins(**LLAMA)
    before = graphs()
    for B, T, n in ((1, 5, 9), (1, 11, 20), (1, 3, 40)):  # other prompts, other cache sizes
        idx = torch.randint(61, (B, T), generator=torch.Generator().manual_seed(T))
        assert torch.equal(torch.stack(list(generate(compiled, idx, n, temperature=0.0))),
                           torch.stack(list(generate(eager, idx, n, temperature=0.0))))
    assert graphs() - before == 1


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_without_the_dynamic_sizes_every_length_compiles_again(monkeypatch):
    """The control: the automatic rule compiles a graph for the first position, then more."""
    monkeypatch.setattr(compiled_decode, "DYNAMIC", "")
    _, compiled = twins(seed=3, **LLAMA)
    before = graphs()
    for T, n in ((5, 9), (11, 20)):
        list(generate(compiled, torch.randint(61, (1, T)), n, temperature=0.0))
    assert graphs() - before >= 3


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_a_step_follows_the_weights_but_not_other_attributes_until_compiled_again():
    eager, compiled = twins(seed=7, **LLAMA)
    idx = torch.randint(61, (1, 6), generator=torch.Generator().manual_seed(7))
    tokens = lambda m: torch.stack(list(generate(m, idx, 10, temperature=0.0)))
    before = tokens(compiled)
    with torch.no_grad():  # new values in the same tensors: the graph reads them at every step
        for m in (eager, compiled):
            for p in m.parameters():
                p.mul_(-1.5)
    assert torch.equal(tokens(compiled), tokens(eager)) and not torch.equal(tokens(eager), before)
    for m in (eager, compiled):  # new tensors (a cast): their guards hold, the step compiles again
        m.to(torch.float64)
    assert torch.equal(tokens(compiled), tokens(eager))
    for m in (eager, compiled):  # an attribute that is no tensor: as compiled, until compiled again
        for block in m.blocks:
            block.ln_1.eps = 10.0
    stale = tokens(compiled)
    assert not torch.equal(stale, tokens(eager))
    compile_decode(compiled)
    assert torch.equal(tokens(compiled), tokens(eager))


def test_the_guard_filter_drops_only_the_models_non_tensor_guards():
    entry = lambda name, kind: type("Guard", (), {"name": name, "guard_type": kind})()
    entries = [entry("model._modules['blocks']._modules['0']._modules['ln_1'].eps", "CONSTANT_MATCH"),
               entry("model", "TYPE_MATCH"),
               entry("model._modules['wte']._parameters['weight']", "TENSOR_MATCH"),
               entry("model._modules['lm_head']._parameters['weight']", "DUPLICATE_INPUT"),
               entry("mask", "CONSTANT_MATCH"), entry("cache[0].k", "TENSOR_MATCH"), entry("past", "TYPE_MATCH"),
               entry("models", "CONSTANT_MATCH"), entry("", "SHAPE_ENV")]
    assert compiled_decode._guards(entries) == [False, False, True, True, True, True, True, True, True]


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_padded_rows_and_eos_decode_as_eager():
    eager, compiled = twins(seed=4, **GPT2)
    idx, mask = left_pad([torch.randint(61, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 8, 5)])
    eos = int(torch.stack(list(generate(eager, idx, 6, temperature=0.0, attention_mask=mask)))[2, 0])
    runs = [torch.stack(list(generate(m, idx, 15, temperature=0.0, attention_mask=mask, eos_token=eos)))
            for m in (eager, compiled)]
    assert torch.equal(runs[1], runs[0]) and (runs[0] == eos).any()


@pytest.mark.parametrize("kernel", ["matvec", "int8pack"])
def test_int8_weights_decode_compiled(monkeypatch, kernel):
    eager, compiled = twins(seed=5, **LLAMA)
    if kernel == "int8pack":  # a machine where the matvec kernel does not build
        monkeypatch.setattr(matvec, "failure", lambda isa=None: "no C++ compiler found")
    quantize_int8(eager), quantize_int8(compiled)
    assert {m.kernel for m in compiled.modules() if hasattr(m, "kernel")} == {kernel}
    compile_decode(compiled)  # the int8 products compile too (int8pack's scales are a buffer)
    idx = torch.randint(61, (1, 6), generator=torch.Generator().manual_seed(5))
    assert torch.equal(torch.stack(list(generate(compiled, idx, 12, temperature=0.0))),
                       torch.stack(list(generate(eager, idx, 12, temperature=0.0))))


def test_bfloat16_compiled_rounds_no_worse_than_eager():
    """Half precision: the fused graph rounds less often, so it is held to eager's distance from
    the float32 model, not to eager's numbers."""
    torch.manual_seed(6)
    reference = scrambled(small(**LLAMA))
    eager = GPT(reference.config).eval()
    eager.load_state_dict(reference.state_dict())
    eager = decode_layout(eager.to(torch.bfloat16))
    compiled = GPT(reference.config).eval()
    compiled.load_state_dict(reference.state_dict())
    compiled = compile_decode(decode_layout(compiled.to(torch.bfloat16)))
    seq = torch.randint(61, (1, 12), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        exact = reference(seq)[0][:, 6:11]  # (1, 5, V) the float32 logits of positions 6..10
        out = {}
        for name, model in (("eager", eager), ("compiled", compiled)):
            cache = model.new_cache(1, 13)
            model.hidden(seq[:, :6], None, cache, 0)
            step = steps_of(model).step
            out[name] = torch.stack([step(seq[:, p:p + 1], None, cache, p) for p in range(6, 11)], 1).float()
    err = {name: (logits - exact).abs().max().item() for name, logits in out.items()}
    assert err["compiled"] <= 2 * err["eager"] + 0.02 * exact.abs().max().item(), err
    assert next_token(out["compiled"][:, -1], temperature=0.0).shape == (1,)


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_speculative_decoding_compiled_gives_the_eager_tokens_and_rounds():
    eager, compiled = twins(seed=7, **LLAMA)  # one compiled model for every drafter: its graphs compile once
    draft = decode_layout(scrambled(small(n_layer=1, n_embd=16, n_head=2, pos="rope")))  # a smaller model
    g = torch.Generator().manual_seed(7)
    idx, mask = left_pad([torch.randint(61, (n,), generator=g).repeat(r) for n, r in ((3, 3), (4, 2))])
    before = graphs()
    for methods in (("lookup", "lookup"), ("self:1", "self:1"), (draft, compile_decode(copy.deepcopy(draft)))):
        for sample in ({"temperature": 0.0}, {"temperature": 0.9, "top_k": 20}):
            specs = [Speculative(m, k=2, max_k=6, ngram=1) for m in methods]  # lookup drafts on random text too
            runs = [torch.stack(list(generate(model, idx, 16, attention_mask=mask, speculative=spec,
                                                    generator=torch.Generator().manual_seed(8), **sample)), 1)
                    for model, spec in zip((eager, compiled), specs)]
            assert torch.equal(runs[1], runs[0]), methods[0]
            assert specs[1].stats == specs[0].stats and specs[0].stats.drafted > 0  # the same rounds
    assert graphs() > before  # and they ran compiled


def test_several_rows_of_the_stream_form_run_its_kernel_in_a_compiled_forward(monkeypatch):
    torch.manual_seed(9)
    eager = decode_layout(scrambled(small(**LLAMA)), one_row="matvec", few_rows="matvec")
    compiled = compile_decode(copy.deepcopy(eager))
    rows = []
    kernel = matvec.rows
    monkeypatch.setattr(matvec, "rows", lambda w, x, scale=None: rows.append(len(x)) or kernel(w, x, scale))
    idx = torch.randint(61, (1, 9), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        out = {}
        for name, model in (("eager", eager), ("compiled", compiled)):
            cache = model.new_cache(1, 12)
            model.hidden(idx[:, :5], None, cache, 0)
            forward = steps_of(model).hidden
            rows.clear()
            out[name] = forward(idx[:, 5:], None, cache, 5)  # (1, 4, C): four rows through every matrix
            assert rows == [4] * sum(isinstance(m, torch.nn.Linear) for m in model.blocks.modules()), name
    assert_same_logits(out["compiled"], out["eager"])  # and each ran every matrix through the kernel


def test_a_sliding_window_layer_is_refused_where_the_kernel_cannot_run_it(monkeypatch):
    """No graph follows a rolling cache: without the decode kernel there is nothing to compile."""
    monkeypatch.setattr(matvec, "failure", lambda isa=None: "no C++ compiler found")
    with pytest.raises(ValueError, match="layer 0 slides over a window of 4 keys: .*, and the decode kernel cannot "
                                         "run it either .*no C\\+\\+ compiler found"):
        compile_decode(GPT(small(window=4)))


@pytest.mark.parametrize("graph", [False, True], ids=["kernel", "graph"])
def test_a_compiled_model_that_is_dropped_is_freed(graph):
    import gc
    import weakref

    model = scrambled(small(**LLAMA))
    if graph:
        decode_layout(model, one_row="mv", few_rows="linear")  # not the kernel's products: a graph's steps
    list(generate(compile_decode(model), torch.randint(61, (1, 4)), 3, temperature=0.0))
    assert (compiled_decode.compiled_of(model).kernel is None) == graph
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None  # its compiled steps, kept beside it, hold it weakly
