"""specter.serve.protocol: request bodies are type-checked strictly, out-of-range and
unsupported values are refused naming the field, unknown fields are ignored."""

from __future__ import annotations

import json

import pytest

from specter.serve.protocol import ApiError, ChatRequest, CompletionRequest, parse


def completion(**fields) -> CompletionRequest:
    return parse(json.dumps({"prompt": "x", **fields}).encode(), CompletionRequest)


def refused(model, body: bytes | dict) -> ApiError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(ApiError) as caught:
        parse(raw, model)
    assert caught.value.status == 400
    assert set(caught.value.body()["error"]) == {"message", "type", "param", "code"}
    return caught.value


@pytest.mark.parametrize("prompt, expected", [
    ("def f():", "def f():"), (["def f():"], "def f():"), ([5, 6, 7], [5, 6, 7]), ([[5, 6]], [5, 6]),
])
def test_a_prompt_is_text_or_token_ids(prompt, expected):
    assert completion(prompt=prompt).single_prompt() == expected


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [[1], [2]]}, "prompt"),
    ({"prompt": [-1]}, "prompt"), ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"), ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"), ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"prompt": "x", "stop": ""}, "stop"),
    ({"prompt": "x", "seed": 2**70}, "seed"), ({"prompt": "x", "logprobs": 2}, "logprobs"),
    ({"prompt": "x", "echo": True}, "echo"), ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"), ({"prompt": "x", "logit_bias": {"1": 2}}, "logit_bias"),
])
def test_bad_completion_fields_are_refused_naming_the_field(body, param):
    assert refused(CompletionRequest, body).param == param


def test_unknown_fields_are_ignored_and_defaults_are_empty():
    request = completion(some_vendor_field={"a": 1}, user="me", presence_penalty=0, n=1)
    assert request.max_tokens is None and request.temperature is None and request.stop_strings() == ()
    assert completion(stop="\n").stop_strings() == ("\n",)
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage


def test_malformed_bodies_say_what_is_wrong():
    assert "malformed JSON" in refused(CompletionRequest, b'{"prompt": ').message
    assert "JSON object" in refused(CompletionRequest, b"[1]").message
    assert "empty" in refused(CompletionRequest, b"  ").message
    assert refused(CompletionRequest, b"{}").message == "prompt: is required"


def test_chat_messages_are_checked_and_flattened():
    raw = {"messages": [{"role": "system", "content": "s"},
                        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
           "max_completion_tokens": 7}
    request = parse(json.dumps(raw).encode(), ChatRequest)
    assert request.conversation() == [{"role": "system", "content": "s"}, {"role": "user", "content": "ab"}]
    assert request.max_tokens == 7
    assert refused(ChatRequest, {"messages": []}).param == "messages"
    assert refused(ChatRequest, {"messages": [{"role": "robot", "content": "x"}]}).param == "messages.0.role"
    assert refused(ChatRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}).param == "tools"
    user = [{"role": "user", "content": "x"}]
    for field, value in (("functions", [{}]), ("tool_choice", "required"), ("top_logprobs", 3), ("logprobs", True)):
        assert refused(ChatRequest, {"messages": user, field: value}).param == field  # the field sent
    both = parse(json.dumps({"messages": user, "max_tokens": 4, "max_completion_tokens": 2}).encode(), ChatRequest)
    assert both.max_tokens == 2  # OpenAI's current name wins
    image = parse(json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
                  ChatRequest)
    with pytest.raises(ApiError, match="only text parts"):
        image.conversation()
