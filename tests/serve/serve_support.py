"""Constants and helpers the server tests share (imported by conftest.py and the test files)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "quickstart.yaml"
MAX_TOKENS = 16  # the recipe default the server tests run with (--set max_new_tokens=16)
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def push(self, item):\n"]
# a small chat template for the tests (the bundled model's tokenizer has none)
CHAT_TEMPLATE = ("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}# assistant:{% endif %}")
CHAT_MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "write a loop"}]
CHAT_RENDERED = "# system: be brief\n# user: write a loop\n# assistant:"  # CHAT_TEMPLATE on CHAT_MESSAGES


@dataclass
class LiveServer:
    base_url: str  # http://127.0.0.1:PORT
    app: object
    engine: object

    @property
    def state(self):
        return self.app.state.server

    def get(self, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
        return http("GET", self.base_url + path, headers=headers)

    def post(self, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict, bytes]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return http("POST", self.base_url + path, data, {"Content-Type": "application/json", **(headers or {})})

    def wait_until(self, predicate, timeout: float = 10.0) -> float:
        """Poll ``predicate()`` until true; returns the seconds it took (fails after ``timeout``)."""
        started = time.perf_counter()
        while not predicate():
            if time.perf_counter() - started > timeout:
                raise AssertionError("condition not reached in time")
            time.sleep(0.005)
        return time.perf_counter() - started


def http(method: str, url: str, data: bytes | None = None, headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def greedy(engine, prompt_ids: list[int], max_tokens: int = MAX_TOKENS) -> tuple[str, list[int]]:
    """The engine's own greedy text (end-of-sequence token dropped, as the server does) and ids."""
    ids = engine.generate([prompt_ids], max_tokens).token_ids[0]
    return visible_text(engine, ids), ids


def visible_text(engine, ids: list[int]) -> str:
    """The text of new token ids as the server shows it: a final end-of-sequence token dropped."""
    return engine.decode_text(ids[:-1] if ids and ids[-1] == engine.eos_token_id else ids)


