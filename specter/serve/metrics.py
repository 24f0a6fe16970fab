"""The server's running figures and their Prometheus text exposition (``GET /metrics``).

Contract: ``ServerMetrics`` is updated from the worker thread and the event loop (every method
takes its lock) and ``render()`` returns the Prometheus text format 0.0.4: ``# HELP`` and
``# TYPE`` lines, then samples. Metric names (all prefixed ``specter_``):

counters: ``requests_total{outcome}`` (completed, cancelled, failed, rejected_queue_full,
rejected_invalid), ``prompt_tokens_total``, ``completion_tokens_total``, ``decode_seconds_total``
(time from a request's first to its last new token), ``bytes_transferred_total`` (expert bytes the
offloaded engines moved to the device; 0 for ``resident``);
gauges: ``queue_depth`` (requests waiting), ``queue_capacity``, ``busy`` (1 while a request
decodes), and the last completed request's ``tokens_per_second``, ``ttft_seconds``, ``hit_rate``
and ``acceptance_rate`` (NaN while no request has reported one, or when the engine has none:
``resident`` has no cache, only ``specter`` speculates).
"""

from __future__ import annotations

import math
import threading

OUTCOMES = ("completed", "cancelled", "failed", "rejected_queue_full", "rejected_invalid")


def _number(value: float | int | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "NaN"
    if isinstance(value, float) and math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) else str(int(value))


class ServerMetrics:
    def __init__(self, model: str, engine: str, queue_capacity: int) -> None:
        self.model, self.engine = model, engine
        self._lock = threading.Lock()
        self.requests = dict.fromkeys(OUTCOMES, 0)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.decode_seconds = 0.0
        self.bytes_transferred = 0
        self.queue_depth = 0
        self.queue_capacity = queue_capacity
        self.busy = False
        self.last: dict[str, float | None] = {"tokens_per_s": None, "ttft_s": None, "hit_rate": None,
                                              "acceptance_rate": None}

    def count_request(self, outcome: str) -> None:
        with self._lock:
            self.requests[outcome] = self.requests.get(outcome, 0) + 1

    def set_queue(self, depth: int, busy: bool) -> None:
        with self._lock:
            self.queue_depth, self.busy = depth, busy

    def set_capacity(self, capacity: int) -> None:
        with self._lock:
            self.queue_capacity = capacity

    def observe_completion(self, prompt_tokens: int, completion_tokens: int, figures: dict) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            self.decode_seconds += figures.get("decode_s") or 0.0
            self.bytes_transferred += figures.get("bytes_transferred") or 0
            for key in self.last:  # a figure this request did not report shows NaN, not the one before
                self.last[key] = figures.get(key)

    def render(self) -> str:
        with self._lock:
            labels = f'model="{_escape(self.model)}",engine="{_escape(self.engine)}"'
            lines: list[str] = []

            def metric(name: str, kind: str, doc: str, samples: list[tuple[str, float | int | None]]) -> None:
                lines.append(f"# HELP specter_{name} {doc}")
                lines.append(f"# TYPE specter_{name} {kind}")
                for extra, value in samples:
                    inner = labels + ("," + extra if extra else "")
                    lines.append(f"specter_{name}{{{inner}}} {_number(value)}")

            metric("requests_total", "counter", "Requests by outcome.",
                   [(f'outcome="{o}"', n) for o, n in self.requests.items()])
            metric("prompt_tokens_total", "counter", "Prompt tokens of completed requests.",
                   [("", self.prompt_tokens)])
            metric("completion_tokens_total", "counter", "Tokens generated for completed requests.",
                   [("", self.completion_tokens)])
            metric("decode_seconds_total", "counter", "Seconds from first to last new token, summed over requests.",
                   [("", self.decode_seconds)])
            metric("bytes_transferred_total", "counter", "Expert bytes moved host to device by completed requests.",
                   [("", self.bytes_transferred)])
            metric("queue_depth", "gauge", "Requests waiting for the engine.", [("", self.queue_depth)])
            metric("queue_capacity", "gauge", "Most requests that may wait (beyond it: 429).",
                   [("", self.queue_capacity)])
            metric("busy", "gauge", "1 while a request decodes.", [("", int(self.busy))])
            metric("tokens_per_second", "gauge", "Decode tokens per second of the last completed request.",
                   [("", self.last["tokens_per_s"])])
            metric("ttft_seconds", "gauge", "Time to first token of the last completed request.",
                   [("", self.last["ttft_s"])])
            metric("hit_rate", "gauge", "Expert cache hit rate of the last completed request (decode steps).",
                   [("", self.last["hit_rate"])])
            metric("acceptance_rate", "gauge", "Draft acceptance rate of the last completed request.",
                   [("", self.last["acceptance_rate"])])
            return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
