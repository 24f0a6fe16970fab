"""specter.serve.responses: the exact JSON objects of both endpoints (non-streamed response and
every streamed chunk), one id and creation time per response, the server-sent-event encoding,
and that each object validates as the matching type of the official ``openai`` client."""

from __future__ import annotations

import re
import time

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from specter.serve.responses import SSE_DONE, Shapes, sse, usage
from specter.serve.scheduler import Done

MODEL = "bundled:tiny-moe"
FIGURES = {"engine": "specter", "queue_wait_s": 0.01, "ttft_s": 0.2, "tokens_per_s": 40.0, "hit_rate": 0.9}
DONE = Done(text="return n", finish_reason="length", prompt_tokens=5, completion_tokens=3, figures=FIGURES)


def envelope(shapes: Shapes, obj: str) -> dict:
    return {"id": shapes.id, "object": obj, "created": shapes.created, "model": MODEL}


def test_sse_is_one_compact_utf8_data_line_per_event():
    assert sse({"text": "é → 世\nnext", "n": [1, 2], "none": None}) == \
        'data: {"text":"é → 世\\nnext","n":[1,2],"none":null}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_usage_adds_up_the_tokens():
    assert usage(DONE) == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


@pytest.mark.parametrize("kind, prefix", [("completion", "cmpl-"), ("chat", "chatcmpl-")])
def test_each_response_has_its_own_id_and_one_creation_time(kind, prefix):
    before = int(time.time())
    shapes = Shapes(kind, MODEL)
    after = int(time.time())
    assert re.fullmatch(re.escape(prefix) + "[0-9a-f]{24}", shapes.id)
    assert before <= shapes.created <= after
    assert Shapes(kind, MODEL).id != shapes.id
    objects = [shapes.full(DONE), shapes.delta("x"), shapes.closing(DONE), shapes.usage_chunk(DONE)]
    assert {(o["id"], o["created"], o["model"]) for o in objects} == {(shapes.id, shapes.created, MODEL)}


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kind must be 'completion' or 'chat'"):
        Shapes("embedding", MODEL)


def test_a_full_completion():
    shapes = Shapes("completion", MODEL)
    assert shapes.full(DONE) == {
        **envelope(shapes, "text_completion"),
        "choices": [{"index": 0, "text": "return n", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
        "specter": FIGURES,
    }


def test_a_full_chat_completion():
    shapes = Shapes("chat", MODEL)
    stopped = Done("ok", "stop", 2, 1, {})
    assert shapes.full(stopped) == {
        **envelope(shapes, "chat.completion"),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "logprobs": None,
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
        "specter": {},
    }


def test_the_completion_stream_chunks():
    shapes = Shapes("completion", MODEL)
    chunk = envelope(shapes, "text_completion")
    assert shapes.opening() is None  # completions have no role chunk
    assert shapes.delta("ret") == {**chunk, "choices": [{"index": 0, "text": "ret", "logprobs": None,
                                                         "finish_reason": None}]}
    assert shapes.closing(DONE) == {**chunk, "choices": [{"index": 0, "text": "", "logprobs": None,
                                                          "finish_reason": "length"}], "specter": FIGURES}
    assert shapes.usage_chunk(DONE) == {**chunk, "choices": [],
                                        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}


def test_the_chat_stream_chunks():
    shapes = Shapes("chat", MODEL)
    chunk = envelope(shapes, "chat.completion.chunk")

    def choice(delta: dict, finish: str | None) -> list[dict]:
        return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]

    assert shapes.opening() == {**chunk, "choices": choice({"role": "assistant", "content": ""}, None)}
    assert shapes.delta("ret") == {**chunk, "choices": choice({"content": "ret"}, None)}
    assert shapes.delta("") == {**chunk, "choices": choice({"content": ""}, None)}
    assert shapes.closing(DONE) == {**chunk, "choices": choice({}, "length"), "specter": FIGURES}
    assert shapes.usage_chunk(DONE) == {**chunk, "choices": [],
                                        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}


def test_every_object_validates_as_the_openai_clients_type():
    completion, chat = Shapes("completion", MODEL), Shapes("chat", MODEL)
    full = Completion.model_validate(completion.full(DONE))
    assert (full.choices[0].text, full.choices[0].finish_reason, full.usage.total_tokens) == ("return n", "length", 8)
    # streamed completion chunks are Completion objects too (the client's type wants a finish reason, so a
    # middle chunk, whose finish_reason is null as in OpenAI's own streams, is left out here)
    closing = Completion.model_validate(completion.closing(DONE))
    assert (closing.choices[0].text, closing.choices[0].finish_reason) == ("", "length")
    assert Completion.model_validate(completion.usage_chunk(DONE)).usage.completion_tokens == 3
    message = ChatCompletion.model_validate(chat.full(DONE)).choices[0].message
    assert (message.role, message.content) == ("assistant", "return n")
    chunks = [ChatCompletionChunk.model_validate(c) for c in (chat.opening(), chat.delta("a"), chat.closing(DONE),
                                                              chat.usage_chunk(DONE))]
    assert [c.choices[0].delta.content if c.choices else None for c in chunks] == ["", "a", None, None]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[2].choices[0].finish_reason == "length"
    assert chunks[3].usage.prompt_tokens == 5
