"""Fixtures for the server tests: the bundled model's engine, loaded once, served by a real
uvicorn server on a free localhost port in a thread of the test process, and greedy references
computed with the same engine before the server takes it."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from serve_support import CHAT_RENDERED, CHAT_TEMPLATE, MAX_TOKENS, PROMPTS, RECIPE, LiveServer, greedy, visible_text

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def engine():
    from specter.api import load

    engine = load(str(RECIPE), overrides=[f"max_new_tokens={MAX_TOKENS}"])
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def references(engine) -> dict:
    """Greedy references for PROMPTS (max_tokens 16 and 64) and for CHAT_RENDERED, computed
    before any server owns the engine."""
    refs = {}
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        _, new_ids = greedy(engine, ids, 64)  # greedy: the first 16 of 64 tokens are the 16-token run
        refs[prompt] = {"ids": ids, 16: visible_text(engine, new_ids[:16]), 64: visible_text(engine, new_ids)}
    refs["chat"] = {"ids": engine.encode(CHAT_RENDERED), 16: greedy(engine, engine.encode(CHAT_RENDERED), 16)[0]}
    return refs


@pytest.fixture(scope="module")
def server(engine, references):
    """A real uvicorn server on a free localhost port, serving ``engine``."""
    import uvicorn

    from specter.api import as_recipe
    from specter.serve import ServeConfig, create_app

    recipe = as_recipe(str(RECIPE), [f"max_new_tokens={MAX_TOKENS}"])
    app = create_app(engine, recipe, ServeConfig(queue_depth=32))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    live = LiveServer(f"http://127.0.0.1:{port}", app, engine)
    live.wait_until(lambda: uv.started, timeout=30)
    yield live
    uv.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture
def client(server):
    """The official OpenAI client pointed at the server (no retries: a 429 must show)."""
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def generate_log(server, monkeypatch):
    """Record every ``engine.generate`` call the server makes: start/end times, prompt ids, how
    many tokens it produced and whether it was cancelled, and the most calls ever overlapping."""
    engine = server.engine
    original = engine.generate
    log = {"calls": [], "active": 0, "max_active": 0}
    lock = threading.Lock()

    def recording(prompts, max_new_tokens=None, progress=None, **kwargs):
        call = {"prompt": list(prompts[0]), "start": time.perf_counter(), "tokens": 0, "error": None}
        with lock:
            log["calls"].append(call)
            log["active"] += 1
            log["max_active"] = max(log["max_active"], log["active"])
        user_hook = kwargs.get("on_tokens")

        def on_tokens(index, ids):
            call["tokens"] = len(ids)
            user_hook(index, ids)

        kwargs["on_tokens"] = on_tokens
        try:
            return original(prompts, max_new_tokens, progress, **kwargs)
        except BaseException as error:
            call["error"] = type(error).__name__
            raise
        finally:
            call["end"] = time.perf_counter()
            with lock:
                log["active"] -= 1

    monkeypatch.setattr(engine, "generate", recording)
    yield log
    server.wait_until(lambda: not server.state.scheduler.busy and server.state.scheduler.queue_depth == 0)


@pytest.fixture
def chat_template(server):
    """The server's tokenizer gets CHAT_TEMPLATE for the test, then none again."""
    server.state.prompts.chat_template = CHAT_TEMPLATE
    yield CHAT_TEMPLATE
    server.state.prompts.chat_template = None
