"""The server end to end: a real uvicorn server on a free port (conftest), driven with the
official ``openai`` client and with raw HTTP for what that client cannot send."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import openai
import pytest

from serve_support import CHAT_MESSAGES, MAX_TOKENS, PROMPTS
from specter.errors import SpecterError

MODEL = "bundled:tiny-moe"


def extension(obj) -> dict:
    """The ``specter`` extension field of an openai-client response object."""
    return (obj.model_extra or {})["specter"]


def stream_in_thread(client, **kwargs) -> tuple[threading.Thread, dict]:
    """Run a streamed completion in a thread; the dict gets its text, chunks and finish reason."""
    out: dict = {"text": "", "chunks": 0, "finish": None, "error": None}

    def run() -> None:
        try:
            for chunk in client.completions.create(model=MODEL, stream=True, **kwargs):
                out["chunks"] += 1
                if chunk.choices:
                    out["text"] += chunk.choices[0].text
                    out["finish"] = chunk.choices[0].finish_reason or out["finish"]
        except Exception as error:  # noqa: BLE001 - the test reads it
            out["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    status, _, body = server.get("/health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok" and health["engine"] == "resident"
    status, headers, body = server.get("/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    text = body.decode()
    sample = re.compile(r'^specter_[a-z_]+\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\} (NaN|[-+0-9.eE]+|[+-]Inf)$')
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or sample.match(line), line
    for name in ("tokens_per_second", "hit_rate", "acceptance_rate", "queue_depth", "bytes_transferred_total",
                 "requests_total", "completion_tokens_total"):
        assert f"# TYPE specter_{name} " in text


def test_completion_is_the_engines_greedy_text_with_usage_and_figures(client, references):
    prompt = PROMPTS[0]
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    choice = response.choices[0]
    assert choice.text == references[prompt][16]
    assert choice.finish_reason == "length"
    assert response.object == "text_completion" and response.model == MODEL
    assert response.usage.prompt_tokens == len(references[prompt]["ids"])
    assert response.usage.completion_tokens == MAX_TOKENS
    assert response.usage.total_tokens == response.usage.prompt_tokens + MAX_TOKENS
    figures = extension(response)
    assert figures["engine"] == "resident" and figures["tokens_per_s"] > 0 and figures["ttft_s"] > 0
    assert {"hit_rate", "acceptance_rate", "bytes_transferred", "queue_wait_s"} <= set(figures)
    # the recipe's max_new_tokens and greedy sampling are the defaults; token-id prompts work too
    again = client.completions.create(model=MODEL, prompt=references[prompt]["ids"])
    assert again.choices[0].text == references[prompt][16]


def test_streamed_completion_equals_the_non_streamed_one(client, references):
    prompt = PROMPTS[1]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=64, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == references[prompt][64]
    closing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(closing) == 1 and closing[0].choices[0].finish_reason == "length"
    assert extension(closing[0])["tokens_per_s"] > 0
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 64
    assert len(chunks) > 10  # really streamed, not one blob


def test_streamed_chat_uses_the_chat_template(client, references, chat_template):
    stream = client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=MAX_TOKENS,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == references["chat"][16]
    assert chunks[-1].usage.prompt_tokens == len(references["chat"]["ids"])
    full = client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES, max_tokens=MAX_TOKENS)
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content == text
    assert extension(full)["engine"] == "resident"


def test_chat_without_a_template_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=CHAT_MESSAGES)
    assert caught.value.status_code == 400
    assert caught.value.code == "chat_template_missing"
    assert "chat template" in caught.value.message


def test_a_broken_shipped_template_is_a_500_counted_as_failed(server, client):
    prompts = server.state.prompts
    prompts.tokenizer.chat_template = "{{ messages[0]['content'] + 1 }}"  # as if the tokenizer shipped it
    failed = server.state.metrics.requests["failed"]
    try:
        with pytest.raises(openai.InternalServerError) as caught:
            client.with_options(max_retries=0).chat.completions.create(model=MODEL, messages=CHAT_MESSAGES)
    finally:
        prompts.tokenizer.chat_template = None
    assert caught.value.status_code == 500 and caught.value.code == "chat_template_invalid"
    assert "--chat-template FILE" in caught.value.message and "TypeError" in caught.value.message
    assert server.state.metrics.requests["failed"] == failed + 1
    assert not server.state.scheduler.busy and server.state.scheduler.queue_depth == 0  # nothing queued


@pytest.mark.parametrize("error, status", [(SpecterError("prompt 1: refused by the engine"), 400),
                                           (RuntimeError("boom"), 500)])
def test_a_generation_that_fails_is_counted_once_as_failed(server, monkeypatch, error, status):
    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(server.engine, "generate", failing)
    before = dict(server.state.metrics.requests)
    code, _, body = server.post("/v1/completions", {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4})
    assert code == status and str(error) in json.loads(body)["error"]["message"]
    after = server.state.metrics.requests
    assert after["failed"] == before["failed"] + 1  # by the scheduler, which ended the job
    assert after["rejected_invalid"] == before["rejected_invalid"]  # a 400 here is no rejected request


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text_and_ends_generation(client, references, generate_log, stream):
    prompt = PROMPTS[2]
    reference = references[prompt][64]
    stop = reference[12:15]
    cut = reference[:reference.index(stop)]
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=64, stop=[stop, "never-seen-stop"])
    if stream:
        thread, out = stream_in_thread(client, **{k: v for k, v in kwargs.items() if k != "model"})
        thread.join(30)
        text, finish = out["text"], out["finish"]
    else:
        response = client.completions.create(**kwargs)
        text, finish = response.choices[0].text, response.choices[0].finish_reason
    assert text == cut and finish == "stop"
    assert generate_log["calls"][-1]["tokens"] < 64  # generation was cancelled at the stop


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first


def test_concurrent_requests_queue_in_arrival_order_one_at_a_time(server, client, references, generate_log):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(4)]
    runs = []
    for index, prompt in enumerate(prompts):
        runs.append(stream_in_thread(client, prompt=prompt, max_tokens=64))
        # wait until this request is queued or decoding before the next one arrives
        server.wait_until(lambda: len(generate_log["calls"]) + server.state.scheduler.queue_depth > index)
    assert server.state.scheduler.queue_depth >= 2  # they really wait: the first is still decoding
    for thread, _ in runs:
        thread.join(60)
    assert [out["text"] for _, out in runs] == [references[p][64] for p in prompts]
    assert generate_log["max_active"] == 1
    assert [c["prompt"] for c in generate_log["calls"]] == [references[p]["ids"] for p in prompts]
    calls = generate_log["calls"]
    assert all(a["end"] <= b["start"] for a, b in zip(calls, calls[1:]))


def test_a_full_queue_answers_429_with_retry_after(server, client, generate_log):
    scheduler = server.state.scheduler
    scheduler.depth = 1
    try:
        busy, _ = stream_in_thread(client, prompt=PROMPTS[0], max_tokens=900)
        server.wait_until(lambda: scheduler.busy)
        waiting, _ = stream_in_thread(client, prompt=PROMPTS[1], max_tokens=900)
        server.wait_until(lambda: scheduler.queue_depth == 1)
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=4)
        assert caught.value.status_code == 429
        assert int(caught.value.response.headers["retry-after"]) >= 1
        assert caught.value.body["code"] == "queue_full"
    finally:
        scheduler.depth = 32
        for job in [scheduler._running, *scheduler._waiting]:  # end the long ones now
            if job is not None:
                scheduler.cancel(job)
        busy.join(30), waiting.join(30)


def test_a_client_that_disconnects_mid_stream_frees_the_engine(server, client, generate_log):
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=900, stream=True)
    received = [next(iter(stream)) for _ in range(3)]
    assert all(chunk.choices[0].text is not None for chunk in received)
    stream.close()
    closed = time.perf_counter()
    server.wait_until(lambda: not server.state.scheduler.busy, timeout=5)
    assert time.perf_counter() - closed < 1.0
    call = generate_log["calls"][-1]
    assert call["error"] is not None and call["tokens"] < 900
    # the engine is free: the next request is served at once, correctly
    assert client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4).usage.completion_tokens == 4


def test_a_queued_client_that_disconnects_leaves_the_queue(server, client, generate_log):
    scheduler = server.state.scheduler
    busy, _ = stream_in_thread(client, prompt=PROMPTS[0], max_tokens=300)
    server.wait_until(lambda: scheduler.busy)
    queued = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=300, stream=True)
    server.wait_until(lambda: scheduler.queue_depth == 1)
    queued.close()
    server.wait_until(lambda: scheduler.queue_depth == 0, timeout=2)
    if (running := scheduler._running) is not None:
        scheduler.cancel(running)  # no need to wait for the long one
    busy.join(30)
    assert len(generate_log["calls"]) == 1  # the queued request never reached the engine


def test_a_non_streamed_client_that_disconnects_cancels_its_request(server, generate_log):
    host, port = server.base_url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 900}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        server.wait_until(lambda: server.state.scheduler.busy)
    server.wait_until(lambda: not server.state.scheduler.busy, timeout=2)
    assert generate_log["calls"][-1]["tokens"] < 900


BAD_REQUESTS = [
    ("/v1/completions", b'{"model": "bundled:tiny-moe", "prompt": ', 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "word " * 1200, "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4o"}, 404, "model"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, 404, "model"),
    ("/v1/nothing-here", {}, 404, None),
]


def test_bad_requests_get_openai_errors_and_leave_the_request_in_flight_alone(server, client, references,
                                                                              generate_log):
    thread, out = stream_in_thread(client, prompt=PROMPTS[1], max_tokens=64)
    server.wait_until(lambda: server.state.scheduler.busy)
    first_sent = time.perf_counter()
    for path, body, status, param in BAD_REQUESTS:
        got, _, raw = server.post(path, body)
        error = json.loads(raw)["error"]
        assert got == status, (path, body, got, error)
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param, (body, error)
    got, _, raw = server.get("/v1/completions")
    assert got == 405 and "error" in json.loads(raw)
    too_long = json.loads(server.post("/v1/completions", {"prompt": "word " * 1200, "max_tokens": 4})[2])
    assert too_long["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    thread.join(30)
    assert out["error"] is None and out["text"] == references[PROMPTS[1]][64]
    assert len(generate_log["calls"]) == 1 and generate_log["calls"][0]["end"] > first_sent  # it was in flight


def test_api_key_is_checked_when_set(server, client):
    server.state.config.api_key = "s3cret"
    try:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        assert server.get("/metrics")[0] == 401
        assert server.get("/health")[0] == 200
        keyed = openai.OpenAI(base_url=server.base_url + "/v1", api_key="s3cret", max_retries=0)
        assert keyed.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2).usage.completion_tokens == 2
    finally:
        server.state.config.api_key = None
