"""The continuous-batching engine without HTTP: rows that join and leave at any step boundary compute
token for token what each prompt computes alone (greedy and seeded sampling), caches that grow,
cancelled rows freed at once, a full queue refused."""
import dataclasses

import pytest
import torch

from selfattn.generation.int8 import Int8Linear, quantize_int8
from selfattn.generation.layout import FEW
from selfattn.serve import rows
from selfattn.serve.engine import Busy, Engine
from selfattn.serve.jobs import Finished, Job, Sampling
from selfattn.serve.stops import Detokenizer

from helpers.serving import EOS, Collector, chat_ids, solo, tiny, until

QUESTIONS = ["hi", "hello there", "abc", "what is a cache?", "x", "tell me more", "ok", "1 2 3"]
VARIANTS = {  # tiny models whose rows must keep their bits: positions learned or rotary, windows (rolling caches)
    "rope-gqa": {},
    "learned": {"pos": "learned", "n_kv_head": 4},
    "window": {"window": 6},
    "llama-shaped": {"norm": "rmsnorm", "mlp_kind": "swiglu", "intermediate_size": 48, "head_dim": 16,
                     "qkv_bias": True, "tie_embeddings": False},
}


def _job(loaded, ids, n, collector, **sampling) -> Job:
    return Job(ids, n, Sampling(**{"temperature": 0.0, **sampling}), loaded.eos, Detokenizer(loaded.tokenizer),
               collector)


def _staggered(engine: Engine, loaded, prompts: list[list[int]], n: int, **sampling) -> list[Collector]:
    """Submit as many prompts as there are rows together (they decode together from their first step),
    then the others one at a time, each once the one before has generated a few tokens: rows join a
    running batch at different steps, and leave at different steps."""
    collectors = [Collector() for _ in prompts]
    jobs = [_job(loaded, ids, n, c, **sampling) for ids, c in zip(prompts, collectors)]
    engine.submit(jobs[:engine.max_batch])
    for job, collector in zip(jobs[engine.max_batch:], collectors[engine.max_batch:]):
        engine.submit([job])
        collector.wait(tokens=3)
    return [c.wait() for c in collectors]


def _served(loaded, model) -> tuple[Engine, list[list[int]], list[Collector]]:
    """QUESTIONS served by an engine of ``model`` (4 rows), staggered: (the engine, the prompts, their answers)."""
    engine = Engine(model, max_batch=4, queue=8)
    engine.start()
    try:
        prompts = [chat_ids(loaded, q) for q in QUESTIONS]
        return engine, prompts, _staggered(engine, loaded, prompts, 24)
    finally:
        assert engine.stop()


@pytest.mark.parametrize("variant", VARIANTS)
def test_rows_joining_and_leaving_compute_what_each_prompt_computes_alone(variant):
    loaded = tiny(**VARIANTS[variant])
    engine, prompts, collectors = _served(loaded, loaded.model)
    for ids, collector in zip(prompts, collectors):
        assert collector.tokens == solo(engine.model, ids, 24)
        finished = collector.events[-1]
        assert isinstance(finished, Finished)
        assert finished.reason == ("stop" if collector.tokens[-1] == EOS else "length")
    assert engine.stats.most_rows == 4 and engine.stats.row_steps > engine.stats.steps  # rows did run together


def test_an_int8_model_serves_rows_as_each_prompt_decodes_alone():  # selfattn serve --quantize int8
    loaded = tiny(**VARIANTS["llama-shaped"])
    engine, prompts, collectors = _served(loaded, quantize_int8(loaded.model))
    modules = list(engine.model.modules())
    assert isinstance(engine.model.lm_head, Int8Linear) and not any(isinstance(m, torch.nn.Linear) for m in modules)
    for ids, collector in zip(prompts, collectors):
        assert collector.tokens == solo(engine.model, ids, 24)
    assert engine.stats.most_rows == 4


def test_seeded_sampling_draws_what_generate_draws_alone():
    loaded = tiny()
    engine = Engine(loaded.model, max_batch=3)
    engine.start()
    try:
        prompts = [chat_ids(loaded, q) for q in QUESTIONS[:5]]
        collectors = _staggered(engine, loaded, prompts, 16, temperature=0.9, top_p=0.95, seed=7)
    finally:
        assert engine.stop()
    for ids, collector in zip(prompts, collectors):
        generator = torch.Generator().manual_seed(7)
        assert collector.tokens == solo(engine.model, ids, 16, temperature=0.9, top_p=0.95, generator=generator)


def test_row_caches_grow_as_rows_do(monkeypatch):
    monkeypatch.setattr(rows, "FIRST_POSITIONS", 4)  # every row starts too small for its prompt and grows 4 times
    loaded = tiny()
    engine = Engine(loaded.model, max_batch=2)
    engine.start()
    try:
        prompts = [chat_ids(loaded, q) for q in QUESTIONS[:3]]
        collectors = _staggered(engine, loaded, prompts, 60)
    finally:
        assert engine.stop()
    for ids, collector in zip(prompts, collectors):
        assert collector.tokens == solo(engine.model, ids, 60)


def _endless():
    """The tiny model with a context of 4096 and no stop token: a job of 4000 tokens runs until cancelled."""
    return dataclasses.replace(tiny(block_size=4096), eos=())


def test_a_cancelled_row_leaves_at_the_next_step_and_hears_nothing_more():
    loaded = _endless()
    engine = Engine(loaded.model, max_batch=2)
    engine.start()
    try:
        long, short = Collector(), Collector()
        job = _job(loaded, [1, 2, 3], 4000, long)
        engine.submit([job])
        long.wait(tokens=2)
        engine.cancel(job)
        until(lambda: engine.load()["rows"] == 0, "the cancelled row left")
        heard = len(long.events)
        engine.submit([_job(loaded, [4, 5], 3, short)])  # the engine goes on
        short.wait()
    finally:
        assert engine.stop()
    assert not long.done and len(long.events) == heard < 4000 and len(short.tokens) <= 3


def test_jobs_past_the_rows_and_the_queue_are_refused_all_or_none():
    loaded = _endless()
    engine = Engine(loaded.model, max_batch=1, queue=1)
    engine.start()
    try:
        running = Collector()
        first = _job(loaded, [1, 2], 4000, running)
        engine.submit([first])
        running.wait(tokens=1)
        waiting = _job(loaded, [3], 1, Collector())
        with pytest.raises(Busy, match="1 rows run and 0 jobs wait"):
            engine.submit([waiting, _job(loaded, [4], 1, Collector())])  # two do not fit: neither is queued
        engine.submit([waiting])
        with pytest.raises(Busy):
            engine.submit([_job(loaded, [5], 1, Collector())])
        engine.cancel(first)
    finally:
        assert engine.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        engine.submit([_job(loaded, [6], 1, Collector())])


def test_prompt_logprobs_alone_when_nothing_is_generated():
    loaded = tiny()
    engine = Engine(loaded.model)
    engine.start()
    try:
        collector = Collector()
        ids = chat_ids(loaded, "score me")
        engine.submit([Job(ids, 0, Sampling(), (), Detokenizer(loaded.tokenizer), collector, prompt_logprobs=2)])
        collector.wait()
    finally:
        assert engine.stop()
    prompt, finished = collector.events
    with torch.inference_mode():
        logp = torch.log_softmax(engine.model(torch.tensor([ids]))[0][0].float(), dim=-1)  # (T, V)
    expected = logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]  # (T - 1,)
    assert prompt.ids == ids and prompt.logprobs[0] is None and prompt.top[0] is None
    torch.testing.assert_close(torch.tensor(prompt.logprobs[1:]), expected, rtol=0, atol=1e-5)
    assert [a for a, _ in prompt.top[1]] == logp[0].topk(2).indices.tolist()
    assert (finished.reason, finished.prompt_tokens, finished.completion_tokens) == ("length", len(ids), 0)


@pytest.mark.parametrize("max_batch", [0, FEW + 1])
def test_max_batch_is_checked(max_batch):
    with pytest.raises(ValueError, match=f"max_batch must be an int in 1..{FEW}.*got {max_batch}"):
        Engine(tiny().model, max_batch=max_batch)


def test_rows_keep_their_bits_where_every_product_is_the_stream_form():
    assert rows.rows_keep_their_bits(Engine(tiny().model).model)
    experts = Engine(tiny(mlp_kind="moe", n_experts=4, intermediate_size=24).model).model
    assert not rows.rows_keep_their_bits(experts)  # the experts' products are plain matrix products
    assert not rows.rows_keep_their_bits(tiny().model)  # not laid out for decoding


def test_the_engine_decodes_a_selfattn_gpt_only():
    with pytest.raises(TypeError, match="selfattn GPT, got Linear"):
        Engine(torch.nn.Linear(2, 2))
