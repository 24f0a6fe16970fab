"""OpenAI response objects and server-sent events, for both endpoints.

Contract: ``Shapes(kind, model)`` (kind ``"completion"`` or ``"chat"``) builds, for one response
id, the JSON objects OpenAI's API returns: ``full(done)`` for a non-streamed response (with
``usage`` and the ``specter`` extension field), and for ``stream: true`` the chunks ``opening()``
(chat only: the assistant role), ``delta(text)``, ``closing(done)`` (empty delta, the finish
reason and the ``specter`` field) and ``usage_chunk(done)`` (empty ``choices``, ``usage``; sent
when ``stream_options.include_usage`` asks for it). ``sse(obj)`` encodes one event and ``SSE_DONE``
is the stream's last event, ``data: [DONE]``.
"""

from __future__ import annotations

import json
import secrets
import time

from specter.serve.scheduler import Done

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


class Shapes:
    def __init__(self, kind: str, model: str) -> None:
        if kind not in ("completion", "chat"):
            raise ValueError(f"kind must be 'completion' or 'chat', got {kind!r}")
        self.kind, self.model = kind, model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _envelope(self, chunk: bool) -> dict:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, done: Done) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": done.text},
                      "logprobs": None, "finish_reason": done.finish_reason}
        else:
            choice = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": done.finish_reason}
        return {**self._envelope(False), "choices": [choice], "usage": usage(done), "specter": done.figures}

    def _chunk(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
        if self.kind == "chat":
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._envelope(True), "choices": [choice]}

    def opening(self) -> dict | None:
        return self._chunk("", None, role=True) if self.kind == "chat" else None

    def delta(self, text: str) -> dict:
        return self._chunk(text, None)

    def closing(self, done: Done) -> dict:
        return {**self._chunk(None, done.finish_reason), "specter": done.figures}

    def usage_chunk(self, done: Done) -> dict:
        return {**self._envelope(True), "choices": [], "usage": usage(done)}
