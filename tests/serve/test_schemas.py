"""Requests are checked field by field, strictly, and the first fault names its field and value; fields
the server does not know are ignored, fields it cannot honour refused."""
import pytest

from selfattn.serve.errors import APIError
from selfattn.serve.schemas import ChatRequest, CompletionRequest, parse, refuse_unsupported

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body, param, message", [
    ({}, "messages", "messages: Field required"),
    ({"messages": []}, "messages", "messages: List should have at least 1 item"),
    ({"messages": "hi"}, "messages", 'messages: Input should be a valid list, got "hi"'),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "messages[0].role: Field required"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "messages[0].content: "),
    ({**CHAT, "max_tokens": "5"}, "max_tokens", 'max_tokens: Input should be a valid integer, got "5"'),
    ({**CHAT, "max_tokens": -1}, "max_tokens", "max_tokens: Input should be greater than or equal to 0, got -1"),
    ({**CHAT, "temperature": "hot"}, "temperature", 'temperature: Input should be a valid number, got "hot"'),
    ({**CHAT, "top_p": 0}, "top_p", "top_p: Input should be greater than 0"),
    ({**CHAT, "temperature": float("nan")}, "temperature", "temperature: Input should be a finite number, got NaN"),
    ({**CHAT, "seed": 2 ** 80}, "seed", "seed: Input should be less than 18446744073709551616"),
    ({**CHAT, "seed": -2 ** 64}, "seed", "seed: Input should be greater than or equal to -9223372036854775808"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "messages[0].content: Field required"),
    ({**CHAT, "stream": 1}, "stream", "stream: Input should be a valid boolean, got 1"),
    ({**CHAT, "stop": [1]}, "stop", "stop: "),  # a union: the first alternative speaks
    ({**CHAT, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "stream_options."),
])
def test_a_chat_request_is_refused_naming_the_field(body, param, message):
    with pytest.raises(APIError) as e:
        parse(ChatRequest, body)
    assert (e.value.status, e.value.param) == (400, param) and e.value.message.startswith(message)


def test_unknown_fields_are_ignored_and_known_ones_read():
    request = parse(ChatRequest, {**CHAT, "user": "me", "metadata": {"a": 1}, "stop": "x", "temperature": 0})
    assert request.stops() == ("x",) and request.temperature == 0.0 and not hasattr(request, "user")
    assert parse(CompletionRequest, {"prompt": [[1, 2], [3]], "logprobs": 1}).prompt == [[1, 2], [3]]


@pytest.mark.parametrize("schema, extra, param", [
    (ChatRequest, {"n": 2}, "n"), (ChatRequest, {"tools": [{"type": "function"}]}, "tools"),
    (ChatRequest, {"presence_penalty": 0.5}, "presence_penalty"), (ChatRequest, {"logit_bias": {"1": 2}}, "logit_bias"),
    (ChatRequest, {"response_format": {"type": "json_object"}}, "response_format"),
    (CompletionRequest, {"best_of": 2}, "best_of"), (CompletionRequest, {"suffix": "end"}, "suffix"),
])
def test_what_the_server_cannot_honour_is_refused_not_ignored(schema, extra, param):
    request = parse(schema, {**CHAT, "prompt": "p", **extra})
    with pytest.raises(APIError) as e:
        refuse_unsupported(request)
    assert e.value.param == param and e.value.message.startswith(f"{param}: ")
    refuse_unsupported(parse(schema, {**CHAT, "prompt": "p", "n": 1, "tools": [], "presence_penalty": 0}))  # defaults
