"""The HTTP API on a tiny model, driven by the official ``openai`` client and by raw HTTP (httpx):
answers equal to the model's own alone, streams, log-probabilities and echo, every kind of bad
request answered with OpenAI's error object naming the field, clients that leave, a full queue,
many connections at once, the API key. The server goes on answering after all of it."""
import asyncio
import dataclasses
import json

import httpx
import openai
import pytest
import torch

from helpers.serving import EOS, WAIT, chat_ids, serving, solo, tiny, until

QUESTIONS = ["hi", "hello there", "abc", "what is a cache?", "tell me more"]


@pytest.fixture(scope="module")
def served():
    """A tiny model (context 1024) served with 4 rows and 8 places in the queue: (loaded, url, engine)."""
    loaded = tiny(block_size=1024)
    with serving(loaded, max_batch=4, queue=8) as (url, engine):
        yield loaded, url, engine


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=WAIT)


def _chat(client, question: str, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": question}],
                                          **{"temperature": 0, "max_tokens": 30, **kw})


@pytest.mark.parametrize("question", QUESTIONS[:3])
def test_a_chat_answers_what_the_model_answers_alone(served, client, question):
    loaded, _, engine = served
    answer = _chat(client, question, logprobs=True)
    tokens = [entry.bytes[0] for entry in answer.choices[0].logprobs.content]  # byte tokens: each is its byte
    expected = solo(engine.model, chat_ids(loaded, question), 30)
    assert tokens == expected
    assert answer.choices[0].message.content == loaded.tokenizer.decode([t for t in expected if t != EOS])
    assert answer.choices[0].finish_reason == ("stop" if expected[-1] == EOS else "length")
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(chat_ids(loaded, question)),
                                                                          len(expected))


def test_a_streamed_chat_is_the_whole_answer_in_pieces_then_its_usage(client):
    whole = _chat(client, "stream me")
    chunks = list(_chat(client, "stream me", stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert not chunks[-1].choices and chunks[-1].usage == whole.usage


def test_a_raw_stream_is_server_sent_events_ending_with_done(served):
    body = {"prompt": "abc", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", served[1] + "/v1/completions", json=body, timeout=WAIT) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"} and chunks[-1]["choices"][0]["finish_reason"]


def _prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0][0].float(), dim=-1)  # (T, V)
    return logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]  # (T - 1,) each token given those before


def test_echo_with_max_tokens_0_gives_the_prompts_own_logprobs(served, client):
    loaded, _, engine = served
    prompt = "the quick brown fox"
    answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                       temperature=0).choices[0]
    ids = list(prompt.encode())
    assert answer.text == prompt and answer.logprobs.tokens == list(prompt) and answer.finish_reason == "length"
    assert answer.logprobs.token_logprobs[0] is None and answer.logprobs.top_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(answer.logprobs.token_logprobs[1:]), _prompt_logprobs(engine.model, ids),
                               rtol=0, atol=1e-5)
    assert all(len(top) == 1 for top in answer.logprobs.top_logprobs[1:])


def test_echo_with_one_new_token_is_what_lm_evaluation_harness_reads(served):
    """local-completions sends token ids, max_tokens 1, echo and logprobs 1, and reads token_logprobs[ctxlen:-1]:
    one entry per prompt token and one for the new token, a stop token included."""
    loaded, url, engine = served
    ids = [chat_ids(loaded, q) for q in QUESTIONS[:3]]
    body = {"model": "tiny", "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0, "seed": 1}
    choices = httpx.post(url + "/v1/completions", json=body, timeout=WAIT).json()["choices"]
    for prompt, choice in zip(ids, sorted(choices, key=lambda c: c["index"])):
        logprobs = choice["logprobs"]["token_logprobs"]
        assert len(logprobs) == len(prompt) + 1
        torch.testing.assert_close(torch.tensor(logprobs[1:-1]), _prompt_logprobs(engine.model, prompt), rtol=0,
                                   atol=1e-5)
        top = choice["logprobs"]["top_logprobs"][-1]
        assert logprobs[-1] == max(top.values())  # greedy: the new token is the most probable one


def test_several_prompts_are_several_choices_each_its_own_answer(served, client):
    loaded, _, engine = served
    ids = [chat_ids(loaded, q) for q in QUESTIONS]
    answer = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0)
    for prompt, choice in zip(ids, sorted(answer.choices, key=lambda c: c.index)):
        assert choice.text == loaded.tokenizer.decode([t for t in solo(engine.model, prompt, 12) if t != EOS])
    assert answer.usage.prompt_tokens == sum(map(len, ids))


def test_a_streamed_completion_with_echo_and_logprobs_is_the_whole_one_in_pieces(client):
    kw = dict(model="tiny", prompt="echo me", max_tokens=6, echo=True, logprobs=2, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True)]
    assert "".join(c.text for c in chunks) == whole.text
    assert sum((c.logprobs.token_logprobs for c in chunks if c.logprobs), []) == whole.logprobs.token_logprobs
    assert chunks[-1].finish_reason == whole.finish_reason


def test_a_stop_string_ends_the_text_before_it(client):
    text = _chat(client, "abc").choices[0].message.content  # 30 bytes of gibberish, an "A" among them
    at = next(i for i, ch in enumerate(text) if ch.isascii() and ch.isalpha())
    stop = text[at:at + 2]
    answer = _chat(client, "abc", stop=[stop, "never seen"]).choices[0]
    assert answer.message.content == text[:text.index(stop)] and answer.finish_reason == "stop"


def test_max_tokens_past_the_context_is_cut_to_it(client):
    answer = client.completions.create(model="tiny", prompt="a" * 1020, max_tokens=10 ** 9, temperature=0)
    assert answer.usage.completion_tokens <= 1024 - 1020 + 1  # the last new token is never fed back
    assert answer.choices[0].finish_reason in ("length", "stop")


TOO_LONG = {"prompt": "a" * 1025}
ERRORS = [  # (path, body as JSON or bytes, status, param, a fragment of the message)
    ("/v1/chat/completions", b'{"messages": [', 400, None, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, None, "must be a JSON object, got list"),
    ("/v1/chat/completions", b"\xff\xfe", 400, None, "not valid JSON"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages", "messages: Field required"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "Input should be a valid list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}, 400, "max_tokens",
     "max_tokens: Input should be a valid integer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n", "only n=1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400,
     "tools", "tools are not served"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 1100}]}, 400, "messages",
     "longer than the model's context of 1024 tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages",
     "message 1 has the role 'wizard', which this model's chat template does not write"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content",
     "messages[0].content: Field required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages", "message 1: content part 1 is of type 'image_url'; only text parts"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": 2 ** 80}, 400, "seed",
     "seed: Input should be less than 18446744073709551616"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400,
     "temperature", "temperature: Input should be a finite number, got NaN"),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt", "prompt: Field required"),
    ("/v1/completions", TOO_LONG, 400, "prompt", "the prompt is 1025 tokens, longer than the model's context"),
    ("/v1/completions", {"prompt": [300, 1]}, 400, "prompt", "token ids must be in [0, 256), got [300]"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "an empty list holds no prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "greater than or equal to 0"),
    ("/v1/completions", {"prompt": "x", "max_tokens": None, "echo": "yes"}, 400, "echo", "valid boolean"),
    ("/v1/completions", b"{" + b" " * (10 << 20) + b"}", 413, None, "more than the 1048576 this server reads"),
    ("/detokenize", {"tokens": [999]}, 400, "tokens", "byte token 999 is outside 0..255"),
    ("/tokenize", {}, 400, "prompt", "send one of them"),
    ("/v1/nowhere", {}, 404, None, "POST /v1/nowhere: Not Found"),
]


@pytest.mark.parametrize("path, body, status, param, fragment", ERRORS)
def test_a_request_the_server_cannot_honour_gets_an_openai_error_naming_the_field(served, path, body, status, param,
                                                                                  fragment):
    sent = dict(content=body, headers={"content-type": "application/json"}) if isinstance(body, bytes) else \
        dict(json=body)
    response = httpx.post(served[1] + path, timeout=WAIT, **sent)
    error = response.json()["error"]
    assert response.status_code == status and error["param"] == param and fragment in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_the_server_answers_well_after_every_bad_request(served, client):
    test_a_chat_answers_what_the_model_answers_alone(served, client, "abc")
    assert httpx.get(served[1] + "/v1/chat/completions", timeout=WAIT).status_code == 405


def test_text_parts_are_read_as_their_joined_text(served, client):
    parts = [{"type": "text", "text": "what is "}, {"type": "text", "text": "a cache?"}]
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}],
                                            max_tokens=8, temperature=0).choices[0].message.content
    assert answer == client.chat.completions.create(model="tiny", messages=[
        {"role": "user", "content": "what is a cache?"}], max_tokens=8, temperature=0).choices[0].message.content


def test_unknown_fields_are_ignored(served):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "user": "u1",
            "metadata": {"x": 1}, "parallel_tool_calls": False, "store": False}
    assert httpx.post(served[1] + "/v1/chat/completions", json=body, timeout=WAIT).status_code == 200


def test_models_health_and_the_tokenizer_endpoints(served, client):
    loaded, url, _ = served
    assert [m.id for m in client.models.list()] == ["tiny"]
    health = httpx.get(url + "/health", timeout=WAIT).json()
    assert health["status"] == "ok" and health["max_batch"] == 4 and health["queue"] == 8
    tokens = httpx.post(url + "/tokenize", json={"prompt": "héllo"}, timeout=WAIT).json()
    assert tokens["tokens"] == list("héllo".encode()) and tokens["count"] == 6 and tokens["max_model_len"] == 1024
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=WAIT).json()
    assert chat["tokens"] == chat_ids(loaded, "hi")
    text = httpx.post(url + "/detokenize", json={"tokens": tokens["tokens"]}, timeout=WAIT).json()
    assert text == {"prompt": "héllo"}
    info = httpx.get(url + "/tokenizer_info", timeout=WAIT).json()
    assert info["eos_token"] == chr(EOS) and info["chat_template"] == loaded.chat.source


@pytest.fixture(scope="module")
def endless():
    """The tiny model (context 4096) with no stop token, one row and no queue: a request runs until cancelled."""
    loaded = dataclasses.replace(tiny(block_size=4096), eos=())
    with serving(loaded, max_batch=1, queue=0) as (url, engine):
        yield url, engine


LONG = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 4000, "temperature": 0}


def test_a_client_that_leaves_mid_stream_frees_its_row_at_once(endless):
    url, engine = endless
    finished = engine.stats.jobs
    with httpx.stream("POST", url + "/v1/chat/completions", json={**LONG, "stream": True}, timeout=WAIT) as response:
        lines = response.iter_lines()
        assert [next(lines) for _ in range(6)]
    until(lambda: engine.load()["rows"] == 0, "the row of the client that left was freed")
    assert engine.stats.jobs == finished  # cancelled, not finished


def test_a_client_that_leaves_before_its_answer_frees_its_row(endless):
    url, engine = endless
    finished = engine.stats.jobs
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json=LONG, timeout=httpx.Timeout(WAIT, read=0.5))
    until(lambda: engine.load()["rows"] == 0, "the row of the client that left was freed")
    assert engine.stats.jobs == finished


def test_a_full_queue_answers_503_with_retry_after(endless):
    url, engine = endless
    with httpx.stream("POST", url + "/v1/chat/completions", json={**LONG, "stream": True}, timeout=WAIT) as response:
        lines = response.iter_lines()  # kept: a line iterator dropped closes the connection, and the row with it
        next(lines)
        refused = httpx.post(url + "/v1/chat/completions", json={**LONG, "max_tokens": 1}, timeout=WAIT)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "server_busy"
    until(lambda: engine.load()["rows"] == 0, "the streamed row was freed")
    assert httpx.post(url + "/v1/chat/completions", json={**LONG, "max_tokens": 2}, timeout=WAIT).status_code == 200


def test_48_connections_at_once_each_get_their_answer_or_503(served):
    loaded, url, engine = served
    expected = {q: loaded.tokenizer.decode([t for t in solo(engine.model, chat_ids(loaded, q), 16) if t != EOS])
                for q in QUESTIONS}
    asks = [QUESTIONS[i % len(QUESTIONS)] for i in range(40)]

    async def one(http: httpx.AsyncClient, question: str | None) -> tuple[str | None, httpx.Response]:
        if question is None:  # a malformed request among them
            return None, await http.post("/v1/chat/completions", content=b"{oops")
        body = {"messages": [{"role": "user", "content": question}], "max_tokens": 16, "temperature": 0,
                "stream": len(question) % 2 == 0}
        return question, await http.post("/v1/chat/completions", json=body)

    async def all_at_once():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=WAIT, limits=limits) as http:
            return await asyncio.gather(*[one(http, q) for q in asks + [None] * 8])

    answered = 0
    for question, response in asyncio.run(all_at_once()):
        if question is None:
            assert response.status_code == 400
        elif response.status_code == 503:
            assert response.headers["retry-after"] == "1"
        elif response.headers["content-type"].startswith("text/event-stream"):
            chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
            assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected[question]
            answered += 1
        else:
            assert response.json()["choices"][0]["message"]["content"] == expected[question]
            answered += 1
    assert answered >= 4 + 8  # every refusal came while every row and place was taken, by requests that succeeded
    until(lambda: engine.load()["rows"] == 0 and engine.load()["waiting"] == 0, "every row was freed")
    assert httpx.get(url + "/health", timeout=WAIT).json()["status"] == "ok"


def test_with_an_api_key_every_request_without_it_gets_401():
    with serving(tiny(), api_key="sekret") as (url, _):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            for method, path in (("GET", "/health"), ("GET", "/v1/models"), ("POST", "/v1/completions")):
                response = httpx.request(method, url + path, headers=headers, json={"prompt": "x"}, timeout=WAIT)
                assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        client = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0, timeout=WAIT)
        assert client.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens <= 2
