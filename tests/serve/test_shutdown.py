"""Stopping the server (``python -m specter.serve``'s Ctrl-C, ``make_server``): every open request
is told at once, not after uvicorn's grace time. A waiting request gets 503 ``shutting_down``, the
decoding one stops at its next step and gets the same (a stream as its last event, then
``[DONE]``), and the scheduler's bookkeeping is done before a client holds its answer."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

from serve_support import PROMPTS


@pytest.fixture
def slow_steps(server, monkeypatch):
    """Each decoding step of the served engine takes 20 ms more (a request decodes for seconds)."""
    engine = server.engine
    original = engine.generate
    steps = threading.Semaphore(0)  # released once a step

    def slow(prompts, max_new_tokens=None, progress=None, **kwargs):
        hook = kwargs["on_tokens"]

        def on_tokens(index, ids):
            time.sleep(0.02)
            hook(index, ids)
            steps.release()

        kwargs["on_tokens"] = on_tokens
        return original(prompts, max_new_tokens, progress, **kwargs)

    monkeypatch.setattr(engine, "generate", slow)
    return steps


def post_in_thread(server, body: dict) -> tuple[threading.Thread, dict]:
    answer: dict = {}

    def send() -> None:
        answer["status"], _, answer["body"] = server.post("/v1/completions", body)
        answer["at"] = time.perf_counter()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, answer


def test_closing_tells_the_waiting_and_the_decoding_requests_at_once(server, slow_steps):
    """Last in the module: the scheduler stays closed."""
    stream, streamed = post_in_thread(server, {"prompt": PROMPTS[0], "max_tokens": 400, "stream": True})
    for _ in range(10):  # ten steps decoded: text has streamed
        assert slow_steps.acquire(timeout=30)
    waiting, waited = post_in_thread(server, {"prompt": PROMPTS[1], "max_tokens": 8})
    server.wait_until(lambda: server.state.scheduler.queue_depth == 1)
    cancelled_before = server.state.metrics.requests["cancelled"]
    closed_at = time.perf_counter()
    server.state.scheduler.close(timeout=0)  # what Ctrl-C runs first (make_server's handle_exit)
    waiting.join(10)
    stream.join(10)
    assert not waiting.is_alive() and not stream.is_alive()
    assert waited["status"] == 503 and json.loads(waited["body"])["error"]["code"] == "shutting_down"
    assert waited["at"] - closed_at < 1.0  # at once, not after the grace time
    events = [line.removeprefix(b"data: ") for line in streamed["body"].split(b"\n\n") if line]
    assert streamed["status"] == 200 and events[-1] == b"[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == "shutting_down" and "shutting down" in last["error"]["message"]
    assert len(events) > 3  # it had streamed text before it was stopped
    assert streamed["at"] - closed_at < 2.0  # stopped at its next step
    assert server.state.metrics.requests["cancelled"] == cancelled_before + 2
    assert server.state.metrics.requests["failed"] == 0
    status, _, body = server.post("/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 4})
    assert status == 503 and json.loads(body)["error"]["code"] == "shutting_down"


def test_make_servers_exit_handler_closes_the_scheduler_before_uvicorns(engine, monkeypatch):
    from specter.api import as_recipe
    from specter.serve import ServeConfig, create_app
    from specter.serve.__main__ import make_server
    from serve_support import RECIPE

    app = create_app(engine, as_recipe(str(RECIPE)), ServeConfig())
    scheduler = app.state.server.scheduler
    seen = []
    monkeypatch.setattr(scheduler, "close", lambda timeout: seen.append(("close", timeout)))
    server = make_server(app, host="127.0.0.1", port=1, log_level="warning")
    assert server.config.timeout_graceful_shutdown == 5
    server.handle_exit(signal.SIGINT, None)
    assert seen == [("close", 0)] and server.should_exit
    monkeypatch.undo()
    scheduler.close(timeout=5)  # this app's worker thread
