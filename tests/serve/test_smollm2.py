"""The server on a real model, SmolLM2-135M-Instruct (GGUF, loaded once): eight different chats at
once, streamed or not, each answer token for token what the model answers alone
(``selfattn sample --chat TEXT --temperature 0``) while their rows decode together; the prompt's
log-probabilities that lm-evaluation-harness reads; its tokenizer through the server."""
import asyncio

import httpx
import openai
import pytest
import torch

from selfattn.io.loading import load

from helpers.serving import WAIT, serving, solo
from helpers.smollm2 import smollm2

QUESTIONS = ["What is 2+2?", "Name a colour.", "Write a haiku about rain.", "Who wrote Hamlet?", "Say hi.",
             "What is the capital of France?", "Count to five.", "What is a cache?"]
NEW = 10  # tokens each answer may take


@pytest.fixture(scope="module")
def smol():
    loaded = load(smollm2())
    with serving(loaded, max_batch=8, queue=8) as (url, engine):
        yield loaded, url, engine


def test_eight_chats_at_once_each_answer_what_the_model_answers_alone(smol):
    loaded, url, engine = smol
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=WAIT)

    async def ask(question: str, stream: bool) -> str:
        kw = dict(model="smollm2", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=NEW)
        if not stream:
            return (await client.chat.completions.create(**kw)).choices[0].message.content
        return "".join([c.choices[0].delta.content or "" async for c in await client.chat.completions.create(
            **kw, stream=True)])

    async def all_at_once() -> list[str]:
        return await asyncio.gather(*[ask(q, i % 2 == 1) for i, q in enumerate(QUESTIONS)])

    answers = asyncio.run(all_at_once())
    assert engine.stats.most_rows >= 4  # the rows did decode together, one forward for several
    chat = loaded.require_chat()
    for question, answer in zip(QUESTIONS, answers):
        ids = loaded.tokenizer.encode(chat.render([{"role": "user", "content": question}]))
        alone = solo(engine.model, ids, NEW, stops=loaded.eos)  # what generate(model, ids, NEW, temperature=0) yields
        assert answer == loaded.tokenizer.decode([t for t in alone if t not in loaded.eos]), question


def test_the_prompts_logprobs_and_the_tokenizer_through_the_server(smol):
    loaded, url, engine = smol
    prompt = "The capital of France is Paris."
    ids = httpx.post(url + "/tokenize", json={"prompt": prompt, "add_special_tokens": False}, timeout=WAIT).json()
    assert ids["tokens"] == loaded.tokenizer.encode(prompt)
    body = {"prompt": ids["tokens"], "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    logprobs = httpx.post(url + "/v1/completions", json=body, timeout=WAIT).json()["choices"][0]["logprobs"]
    with torch.inference_mode():
        logp = torch.log_softmax(engine.model(torch.tensor([ids["tokens"]]))[0][0].float(), dim=-1)  # (T, V)
    expected = logp[:-1].gather(-1, torch.tensor(ids["tokens"][1:])[:, None])[:, 0]  # (T - 1,)
    assert len(logprobs["token_logprobs"]) == len(ids["tokens"]) + 1
    torch.testing.assert_close(torch.tensor(logprobs["token_logprobs"][1:-1]), expected, rtol=0, atol=1e-4)
    info = httpx.get(url + "/tokenizer_info", timeout=WAIT).json()
    eos = httpx.post(url + "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False},
                     timeout=WAIT).json()["tokens"]
    assert eos == [loaded.eos[0]] and "<|im_start|>" in info["chat_template"]
