"""One engine, one request at a time: a FIFO queue in front of a single worker thread.

Contract:
- ``Scheduler(engine, depth, metrics)`` owns one daemon worker thread, the only thread that ever
  calls ``engine.generate`` (the engine is batch-1 and not thread-safe). ``submit(job)`` (called
  from the event loop) appends the job to the queue in arrival order, or raises ``QueueFull``
  (with a Retry-After estimate in seconds) when ``depth`` jobs are already waiting; the job that
  is decoding does not count against ``depth``.
- A job reports to its request through ``job.events``, an ``asyncio.Queue`` that the worker fills
  with ``loop.call_soon_threadsafe``: any number of ``Delta`` (new text, tokens so far), then
  exactly one terminal event, ``Done`` (final text, finish reason, counts, figures), ``Failed``
  (the exception) or ``Cancelled`` (``by_shutdown`` when ``close`` cancelled it). The terminal
  event comes after the job's bookkeeping (``busy``, the queue gauge, ``requests_total``), so a
  client that has its answer sees them updated.
- ``cancel(job)`` (idempotent, from any thread): a waiting job leaves the queue at once; a
  decoding job is stopped at the engine's next step (the ``on_tokens`` hook raises), so a client
  that goes away frees the engine within one decoding step. A job that already finished is left
  alone.
- ``close(timeout)`` refuses new jobs, cancels everything (waiting jobs at once, the decoding one
  at its next step, each told ``Cancelled(by_shutdown=True)``) and waits up to ``timeout`` seconds
  for the worker (0: not at all, e.g. from a signal handler); it does not close the engine (its
  owner does). Calling it again only waits.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from specter.serve.metrics import ServerMetrics
from specter.serve.textstream import TextStream

from specter.decode.engine import StopDecoding
from specter.decode.sampling import SamplingParams

__all__ = ["Cancelled", "Delta", "Done", "Failed", "Job", "QueueFull", "Scheduler", "SamplingParams"]

_ids = itertools.count(1)


@dataclass(frozen=True)
class Delta:
    text: str
    tokens: int


@dataclass(frozen=True)
class Done:
    text: str
    finish_reason: str  # "stop" (end-of-sequence token or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int
    figures: dict


@dataclass(frozen=True)
class Failed:
    error: BaseException


@dataclass(frozen=True)
class Cancelled:
    by_shutdown: bool = False  # the server stops (``close``), rather than the client went away


class QueueFull(Exception):
    def __init__(self, depth: int, retry_after_s: int) -> None:
        super().__init__(f"the server is busy: {depth} request(s) already wait for the engine; retry later")
        self.depth, self.retry_after_s = depth, retry_after_s


class _ClientGone(Exception):
    """Raised from on_tokens: the request was cancelled."""


@dataclass(eq=False)
class Job:
    """One request's generation: what to generate and where to report it."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: Any  # SamplingParams
    seed: int
    stop: tuple[str, ...] = ()
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    id: int = field(default_factory=lambda: next(_ids))
    enqueued_at: float = 0.0
    state: str = "new"  # new -> waiting -> running -> finished (or cancelled)
    _cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def emit(self, event: object) -> None:
        """Hand ``event`` to the request's coroutine (safe from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody listens any more
            pass


class Scheduler:
    def __init__(self, engine, depth: int, metrics: ServerMetrics, engine_name: str = "") -> None:
        if depth < 0:
            raise ValueError(f"queue depth must be >= 0, got {depth}")
        self.engine, self.metrics = engine, metrics
        self._depth = depth
        self.engine_name = engine_name
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: Job | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._mean_job_s = 1.0  # running estimate of one job's time, for Retry-After
        self._thread = threading.Thread(target=self._work, name="specter-engine", daemon=True)
        self._thread.start()

    # --- called from the event loop ------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the server is shutting down")
            # the job the idle worker is about to take decodes next: like the running one, it does
            # not count against depth
            counted = len(self._waiting) if self._running is not None else max(0, len(self._waiting) - 1)
            if counted >= self.depth and (self._running is not None or self._waiting):
                raise QueueFull(self.depth, self._retry_after(len(self._waiting)))
            job.loop = job.loop or asyncio.get_running_loop()
            job.enqueued_at = time.perf_counter()
            job.state = "waiting"
            self._waiting.append(job)
            self.metrics.set_queue(len(self._waiting), self._running is not None)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Cancel ``job`` (idempotent, from any thread); see the module docstring."""
        with self._cond:
            if job.state in ("finished", "cancelled") or job.cancelled:
                return
            job._cancel.set()
            if job.state == "waiting":
                self._waiting.remove(job)
                job.state = "cancelled"
                self.metrics.set_queue(len(self._waiting), self._running is not None)
                self.metrics.count_request("cancelled")
                job.emit(Cancelled())
            # a running job sees the flag at its next step; the worker emits Cancelled

    @property
    def depth(self) -> int:
        """The most jobs that may wait (settable while serving)."""
        return self._depth

    @depth.setter
    def depth(self, value: int) -> None:
        if value < 0:
            raise ValueError(f"queue depth must be >= 0, got {value}")
        self._depth = value
        self.metrics.set_capacity(value)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return self._running is not None

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            for job in list(self._waiting):
                job._cancel.set()
                job.state = "cancelled"
                self.metrics.count_request("cancelled")
                job.emit(Cancelled(by_shutdown=True))
            self._waiting.clear()
            self.metrics.set_queue(0, self._running is not None)
            if self._running is not None:
                self._running._cancel.set()
            self._cond.notify_all()
        self._thread.join(timeout)

    def _retry_after(self, waiting: int) -> int:
        return max(1, math.ceil(self._mean_job_s * (waiting + 1)))

    # --- the worker thread ---------------------------------------------------------------------
    def _next(self) -> Job | None:
        with self._cond:
            while not self._waiting and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            job = self._waiting.popleft()
            job.state = "running"
            self._running = job
            self.metrics.set_queue(len(self._waiting), True)
            return job

    def _work(self) -> None:
        while (job := self._next()) is not None:
            started = time.perf_counter()
            try:
                outcome, final = self._run(job, queue_wait_s=started - job.enqueued_at)
            except BaseException as error:  # noqa: BLE001 - reported to the request, worker lives on
                outcome, final = "failed", Failed(error)
            with self._cond:
                job.state = "finished"
                self._running = None
                self.metrics.set_queue(len(self._waiting), False)
                if outcome == "cancelled":
                    final = Cancelled(by_shutdown=self._closed)
            self.metrics.count_request(outcome)
            job.emit(final)  # after the bookkeeping: a client holding its answer sees it done
            if outcome != "cancelled":
                self._mean_job_s = 0.8 * self._mean_job_s + 0.2 * (time.perf_counter() - started)

    def _run(self, job: Job, queue_wait_s: float) -> tuple[str, object]:
        """Decode ``job``, emitting its deltas: (outcome, the terminal event for ``_work`` to emit)."""
        if job.cancelled:
            return "cancelled", Cancelled()
        engine = self.engine
        stream = TextStream(engine.decode_text, job.stop, engine.eos_token_ids)
        clock = {"start": time.perf_counter(), "first": None, "last": None, "tokens": 0}

        def on_tokens(_index: int, ids: list[int]) -> None:
            now = time.perf_counter()
            clock["first"] = clock["first"] or now
            clock["last"], clock["tokens"] = now, len(ids)
            if job.cancelled:
                raise _ClientGone()
            delta, stopped = stream.update(ids)
            if delta:
                job.emit(Delta(delta, len(ids)))
            if stopped:
                raise StopDecoding()  # the engine ends the prompt here, report included

        try:
            result = engine.generate([job.prompt_ids], job.max_tokens, sampling=job.sampling, seed=job.seed,
                                     on_tokens=on_tokens)
        except _ClientGone:
            return "cancelled", Cancelled()
        report = result.report
        completion_tokens = len(result.token_ids[0])
        delta, _ = stream.update(result.token_ids[0], final=True)  # nothing once a stop matched
        if delta:
            job.emit(Delta(delta, completion_tokens))
        finish = "stop" if stream.stopped or stream.ended_by_eos else "length"
        figures = self._figures(report, clock, queue_wait_s)
        self.metrics.observe_completion(len(job.prompt_ids), completion_tokens, figures)
        return "completed", Done(stream.text, finish, len(job.prompt_ids), completion_tokens, figures)

    def _figures(self, report: dict, clock: dict, queue_wait_s: float) -> dict:
        """The ``specter`` extension field of a response (see docs/serve.md)."""
        first, last, tokens = clock["first"], clock["last"], clock["tokens"]
        measured_tps = (tokens - 1) / (last - first) if first and last and last > first and tokens > 1 else None
        return {
            "engine": self.engine_name or report.get("engine"),
            "queue_wait_s": queue_wait_s,
            "ttft_s": (first - clock["start"]) if first else None,
            "tokens_per_s": report.get("decode_tokens_per_s") or measured_tps,
            "hit_rate": report.get("hit_rate"),
            "acceptance_rate": report.get("acceptance_rate"),
            "mean_accepted_per_step": report.get("mean_accepted_per_step"),
            "bytes_transferred": report.get("bytes_transferred"),
            "transfer_wait_s": report.get("transfer_wait_s"),
            "decode_s": (last - first) if first and last else 0.0,
        }
