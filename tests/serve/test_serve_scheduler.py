"""specter.serve.scheduler without a model: a scripted fake engine (one character per token id)
stands in for ``engine.generate``, honouring its ``on_tokens`` hook as the real engines do
(``StopDecoding`` ends the prompt with the tokens so far, any other exception propagates). Checked:
jobs run one at a time in arrival order on one worker thread; ``QueueFull`` with a Retry-After
estimate once ``depth`` jobs wait (the decoding job not counted); cancelling a waiting job removes
it at once and a decoding one stops at the engine's next step; every job gets exactly one terminal
event; a failing ``generate`` gives ``Failed`` and the worker lives on; ``close()``."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable

import pytest

from specter.decode.engine import GenerationResult, StopDecoding
from specter.serve.metrics import ServerMetrics
from specter.serve.scheduler import Cancelled, Delta, Done, Failed, Job, QueueFull, SamplingParams, Scheduler

EOS = 0
TERMINAL = (Done, Failed, Cancelled)
REPORT = {"engine": "from-report", "decode_tokens_per_s": 123.0, "hit_rate": 0.5, "acceptance_rate": None,
          "mean_accepted_per_step": None, "bytes_transferred": 4096, "transfer_wait_s": 0.25}


def tokens(text: str) -> list[int]:
    return [ord(c) for c in text]


class FakeEngine:
    """A batch-1 engine without a model. ``scripts`` maps a prompt (tuple of ids) to the tokens it
    generates, in order (an exception instance in the script is raised at that step); a prompt
    without a script generates its first id ``max_new_tokens`` times. With ``hold``, every step
    after the prefill waits for ``release``. Each call is logged: prompt, arguments, thread, how
    many times ``on_tokens`` ran and the exception that ended it, if any."""

    eos_token_ids = (EOS,)

    def __init__(self, scripts: dict[tuple[int, ...], list[Any]] | None = None, hold: bool = False,
                 report: dict | None = None) -> None:
        self.scripts = scripts or {}
        self.report = REPORT if report is None else report
        self.release = threading.Event()
        if not hold:
            self.release.set()
        self.blocked = threading.Event()  # set once a step waits for release
        self.calls: list[dict] = []
        self.active = self.max_active = 0
        self.closed = False
        self._lock = threading.Lock()

    def decode_text(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def close(self) -> None:
        self.closed = True

    def generate(self, prompts, max_new_tokens=None, progress=None, *, sampling=None, seed=None,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> GenerationResult:
        assert len(prompts) == 1
        prompt = list(prompts[0])
        call = {"prompt": prompt, "max_new_tokens": max_new_tokens, "sampling": sampling, "seed": seed,
                "thread": threading.current_thread(), "hooks": 0, "error": None}
        with self._lock:
            self.calls.append(call)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            script = self.scripts.get(tuple(prompt), [prompt[0]] * max_new_tokens)
            new: list[int] = []
            for item in script[:max_new_tokens]:
                if new:  # a decoding step after the prefill
                    self.blocked.set()
                    if not self.release.wait(5):
                        raise TimeoutError("the test never released the fake engine")
                if isinstance(item, BaseException):
                    raise item
                new.append(item)
                call["hooks"] += 1
                try:
                    on_tokens(0, list(new))
                except StopDecoding:
                    break
                if item == EOS:
                    break
            return GenerationResult(texts=[self.decode_text(new)], token_ids=[new], prompt_ids=[prompt],
                                    report=dict(self.report))
        except BaseException as error:
            call["error"] = error
            raise
        finally:
            with self._lock:
                self.active -= 1


@pytest.fixture
def make_scheduler():
    """Build schedulers (real ServerMetrics) that are released and closed after the test."""
    made: list[tuple[Scheduler, FakeEngine]] = []

    def make(engine: FakeEngine, depth: int = 8, engine_name: str = "fake-engine") -> Scheduler:
        scheduler = Scheduler(engine, depth, ServerMetrics("fake-model", engine_name, depth), engine_name)
        made.append((scheduler, engine))
        return scheduler

    yield make
    for scheduler, engine in made:
        engine.release.set()
        scheduler.close(timeout=5)


def job(text: str, max_tokens: int = 4, stop: tuple[str, ...] = (), seed: int = 7) -> Job:
    """A job for a prompt of ``text`` (one id per character); build it inside the event loop."""
    return Job(prompt_ids=tokens(text), max_tokens=max_tokens, sampling=SamplingParams(), seed=seed, stop=stop)


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Yield to the loop until ``predicate()`` holds (fails after ``timeout``)."""
    deadline = time.perf_counter() + timeout
    while not predicate():
        if time.perf_counter() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.001)


async def wait_blocking(event: threading.Event, timeout: float = 5.0) -> None:
    await until(event.is_set, timeout)


async def outcome(job: Job, timeout: float = 5.0) -> list:
    """Every event of ``job`` up to its terminal one, then checks that no other event follows once
    the scheduler is done with the job."""
    events = []
    while not events or not isinstance(events[-1], TERMINAL):
        events.append(await asyncio.wait_for(job.events.get(), timeout))
    await until(lambda: job.state in ("finished", "cancelled"))
    await asyncio.sleep(0.01)  # anything the worker emitted since has reached the queue by now
    assert job.events.empty(), f"an event after the terminal one: {job.events.get_nowait()!r}"
    assert sum(isinstance(e, TERMINAL) for e in events) == 1
    return events


def text_of(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


def test_jobs_run_one_at_a_time_in_arrival_order_on_one_worker_thread(make_scheduler):
    engine = FakeEngine(hold=True)
    scheduler = make_scheduler(engine, depth=8)
    metrics = scheduler.metrics

    async def scenario() -> None:
        jobs = [job(c, max_tokens=3, seed=i) for i, c in enumerate("ABCD")]
        scheduler.submit(jobs[0])
        await wait_blocking(engine.blocked)  # A is decoding
        assert (metrics.queue_depth, metrics.busy) == (0, True)
        for waiting in jobs[1:]:
            scheduler.submit(waiting)
        assert scheduler.busy and scheduler.queue_depth == 3
        assert [j.state for j in jobs] == ["running", "waiting", "waiting", "waiting"]
        assert (metrics.queue_depth, metrics.busy) == (3, True)
        engine.release.set()
        results = [await outcome(j) for j in jobs]
        assert [r[-1] for r in results] == [Done(c * 3, "length", 1, 3, r[-1].figures) for c, r in zip("ABCD", results)]
        assert [text_of(r) for r in results] == ["AAA", "BBB", "CCC", "DDD"]
        assert all(j.state == "finished" for j in jobs)
        await until(lambda: not scheduler.busy)
        assert (metrics.queue_depth, metrics.busy) == (0, False)
        # what the engine was asked for, in arrival order, one call at a time, all on one worker
        assert [c["prompt"] for c in engine.calls] == [j.prompt_ids for j in jobs]
        assert [(c["max_new_tokens"], c["seed"]) for c in engine.calls] == [(3, 0), (3, 1), (3, 2), (3, 3)]
        assert all(c["sampling"] is j.sampling for c, j in zip(engine.calls, jobs))
        assert engine.max_active == 1
        threads = {c["thread"] for c in engine.calls}
        assert len(threads) == 1 and threading.main_thread() not in threads
        assert metrics.requests["completed"] == 4 and metrics.completion_tokens == 12 and metrics.prompt_tokens == 4

    asyncio.run(scenario())


def test_deltas_add_up_to_the_text_and_eos_ends_with_finish_stop(make_scheduler):
    engine = FakeEngine({tuple(tokens("p")): tokens("Hi") + [EOS, *tokens("never")]})
    scheduler = make_scheduler(engine)

    async def scenario() -> None:
        hello = job("p", max_tokens=10)
        scheduler.submit(hello)
        events = await outcome(hello)
        assert events[:-1] == [Delta("H", 1), Delta("i", 2)]
        done = events[-1]
        assert (done.text, done.finish_reason, done.prompt_tokens, done.completion_tokens) == ("Hi", "stop", 1, 3)

    asyncio.run(scenario())


def test_a_stop_string_cuts_the_text_and_ends_decoding_through_stop_decoding(make_scheduler):
    engine = FakeEngine({tuple(tokens("p")): tokens("ABCDEFGH")})
    scheduler = make_scheduler(engine)

    async def scenario() -> None:
        stopped = job("p", max_tokens=8, stop=("CD", "zz"))
        scheduler.submit(stopped)
        events = await outcome(stopped)
        assert events[:-1] == [Delta("A", 1), Delta("B", 2)]  # "C" held back: it could start "CD"
        done = events[-1]
        assert (done.text, done.finish_reason, done.completion_tokens) == ("AB", "stop", 4)
        call = engine.calls[0]
        assert call["hooks"] == 4 and call["error"] is None  # the engine stopped at "D", no exception out

    asyncio.run(scenario())


def test_a_held_back_tail_is_flushed_when_generation_reaches_max_tokens(make_scheduler):
    engine = FakeEngine({tuple(tokens("p")): tokens("ABC")})
    scheduler = make_scheduler(engine)

    async def scenario() -> None:
        tail = job("p", max_tokens=3, stop=("CD",))
        scheduler.submit(tail)
        events = await outcome(tail)
        assert events[:-1] == [Delta("A", 1), Delta("B", 2), Delta("C", 3)]  # "C" sent after generate returned
        assert (events[-1].text, events[-1].finish_reason, events[-1].completion_tokens) == ("ABC", "length", 3)

    asyncio.run(scenario())


def test_figures_come_from_the_report_and_the_measured_steps(make_scheduler):
    engine = FakeEngine(hold=True)
    scheduler = make_scheduler(engine, engine_name="fake-engine")
    metrics = scheduler.metrics

    async def scenario() -> None:
        first, second = job("A", max_tokens=4), job("B", max_tokens=2)
        scheduler.submit(first)
        await wait_blocking(engine.blocked)
        scheduler.submit(second)
        await asyncio.sleep(0.05)  # the second job waits at least this long
        engine.release.set()
        done_first, done_second = (await outcome(first))[-1], (await outcome(second))[-1]
        figures = done_first.figures
        assert set(figures) == {"engine", "queue_wait_s", "ttft_s", "tokens_per_s", "hit_rate", "acceptance_rate",
                                "mean_accepted_per_step", "bytes_transferred", "transfer_wait_s", "decode_s"}
        assert figures["engine"] == "fake-engine"  # the name the server was given wins over the report's
        assert (figures["tokens_per_s"], figures["hit_rate"], figures["bytes_transferred"]) == (123.0, 0.5, 4096)
        assert figures["transfer_wait_s"] == 0.25
        assert figures["acceptance_rate"] is None and figures["mean_accepted_per_step"] is None
        assert figures["ttft_s"] > 0 and figures["decode_s"] >= 0.05  # the held step is inside decode time
        assert 0 <= figures["queue_wait_s"] < figures["decode_s"]
        assert done_second.figures["queue_wait_s"] >= 0.05
        # the metrics saw both completions
        assert (metrics.prompt_tokens, metrics.completion_tokens, metrics.bytes_transferred) == (2, 6, 8192)
        assert metrics.last["tokens_per_s"] == 123.0 and metrics.last["acceptance_rate"] is None

    asyncio.run(scenario())


def test_without_a_name_or_a_reported_rate_the_figures_use_the_report_engine_and_measured_rate(make_scheduler):
    engine = FakeEngine(report={"engine": "from-report"})
    scheduler = make_scheduler(engine, engine_name="")

    async def scenario() -> None:
        many, one = job("A", max_tokens=4), job("B", max_tokens=1)
        scheduler.submit(many)
        scheduler.submit(one)
        figures = (await outcome(many))[-1].figures
        assert figures["engine"] == "from-report"
        assert figures["decode_s"] > 0 and figures["tokens_per_s"] == 3 / figures["decode_s"]
        single = (await outcome(one))[-1].figures
        assert single["tokens_per_s"] is None and single["decode_s"] == 0.0  # one token: no rate to measure

    asyncio.run(scenario())


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_a_full_queue_raises_queue_full_with_a_retry_after_estimate(make_scheduler, depth):
    engine = FakeEngine(hold=True)
    scheduler = make_scheduler(engine, depth=depth)

    async def scenario() -> None:
        running = job("R")
        scheduler.submit(running)
        await wait_blocking(engine.blocked)
        waiting = [job("W") for _ in range(depth)]
        for each in waiting:
            scheduler.submit(each)
        refused = job("X")
        with pytest.raises(QueueFull) as caught:
            scheduler.submit(refused)
        assert caught.value.depth == depth
        assert caught.value.retry_after_s == depth + 1  # no job measured yet: one second per job ahead
        assert f"{depth} request(s) already wait" in str(caught.value)
        assert scheduler.queue_depth == depth and refused.state == "new"
        engine.release.set()
        for each in (running, *waiting):
            assert isinstance((await outcome(each))[-1], Done)
        assert refused.events.empty() and len(engine.calls) == depth + 1

    asyncio.run(scenario())


def test_retry_after_follows_the_measured_job_time_with_a_floor_of_one_second(make_scheduler):
    engine = FakeEngine()
    scheduler = make_scheduler(engine, depth=2)

    async def scenario() -> None:
        for _ in range(10):  # fast jobs bring the estimate of one job's time far below a second
            quick = job("q", max_tokens=1)
            scheduler.submit(quick)
            await outcome(quick)
        engine.release.clear()
        engine.blocked.clear()
        running = job("R")
        scheduler.submit(running)
        await wait_blocking(engine.blocked)
        scheduler.submit(job("W"))
        scheduler.submit(job("W"))
        with pytest.raises(QueueFull) as caught:
            scheduler.submit(job("X"))
        assert caught.value.retry_after_s == 1  # 3 jobs ahead x well under a third of a second, rounded up to 1
        engine.release.set()

    asyncio.run(scenario())


def test_the_decoding_job_does_not_count_against_depth(make_scheduler):
    engine = FakeEngine(hold=True)
    scheduler = make_scheduler(engine, depth=0)

    async def scenario() -> None:
        alone = job("A")
        scheduler.submit(alone)  # depth 0: an idle engine still takes a job
        await wait_blocking(engine.blocked)
        assert scheduler.busy and scheduler.queue_depth == 0
        with pytest.raises(QueueFull) as caught:
            scheduler.submit(job("B"))
        assert (caught.value.depth, caught.value.retry_after_s) == (0, 1)
        scheduler.depth = 1  # settable while serving: one may now wait beside the decoding one
        assert scheduler.metrics.queue_capacity == 1
        second = job("B")
        scheduler.submit(second)
        assert scheduler.queue_depth == 1
        with pytest.raises(QueueFull):
            scheduler.submit(job("C"))
        engine.release.set()
        assert [type((await outcome(j))[-1]) for j in (alone, second)] == [Done, Done]

    asyncio.run(scenario())


def test_a_job_the_idle_worker_has_not_taken_yet_does_not_count_against_depth(make_scheduler):
    """Submitted back to back to an idle scheduler, the first job is the one to decode whether or
    not the worker has taken it yet: with depth 1 the second waits and only the third is refused."""
    engine = FakeEngine(hold=True)
    scheduler = make_scheduler(engine, depth=1)

    async def scenario() -> None:
        first, second = job("A"), job("B")
        scheduler.submit(first)
        scheduler.submit(second)  # no await between them: the worker may not have taken the first
        with pytest.raises(QueueFull):
            scheduler.submit(job("C"))
        engine.release.set()
        assert [type((await outcome(j))[-1]) for j in (first, second)] == [Done, Done]

    asyncio.run(scenario())


def test_close_counts_the_waiting_jobs_it_cancels_and_empties_the_queue_gauge(make_scheduler):
    engine = FakeEngine(hold=True)
    scheduler = make_scheduler(engine, depth=3)

    async def scenario() -> None:
        running = job("R")
        scheduler.submit(running)
        await wait_blocking(engine.blocked)
        for _ in range(2):
            scheduler.submit(job("W"))
        assert scheduler.metrics.queue_depth == 2
        scheduler.close(timeout=0.0)
        assert scheduler.metrics.requests["cancelled"] == 2 and scheduler.metrics.queue_depth == 0
        engine.release.set()
        await outcome(running)

    asyncio.run(scenario())


def test_a_negative_depth_is_refused(make_scheduler):
    with pytest.raises(ValueError, match="queue depth must be >= 0"):
        Scheduler(FakeEngine(), -1, ServerMetrics("m", "e", 0))
    scheduler = make_scheduler(FakeEngine(), depth=3)
    with pytest.raises(ValueError, match="queue depth must be >= 0"):
        scheduler.depth = -2
    assert scheduler.depth == 3 and scheduler.metrics.queue_capacity == 3


def test_cancelling_a_waiting_job_removes_it_from_the_queue_at_once(make_scheduler):
    engine = FakeEngine(hold=True)
    scheduler = make_scheduler(engine, depth=4)
    metrics = scheduler.metrics

    async def scenario() -> None:
        running, dropped, kept = job("A"), job("B"), job("C")
        scheduler.submit(running)
        await wait_blocking(engine.blocked)
        scheduler.submit(dropped)
        scheduler.submit(kept)
        scheduler.cancel(dropped)
        assert scheduler.queue_depth == 1 and dropped.state == "cancelled" and metrics.queue_depth == 1
        assert metrics.requests["cancelled"] == 1
        assert await outcome(dropped) == [Cancelled()]
        scheduler.cancel(dropped)  # idempotent: no second event, not counted twice
        assert metrics.requests["cancelled"] == 1
        engine.release.set()
        assert isinstance((await outcome(running))[-1], Done) and isinstance((await outcome(kept))[-1], Done)
        assert dropped.events.empty()
        assert [c["prompt"] for c in engine.calls] == [running.prompt_ids, kept.prompt_ids]  # B never ran

    asyncio.run(scenario())


def test_cancelling_the_decoding_job_stops_it_at_the_next_step(make_scheduler):
    engine = FakeEngine(hold=True)
    scheduler = make_scheduler(engine)
    metrics = scheduler.metrics

    async def scenario() -> None:
        long, after = job("A", max_tokens=100), job("B", max_tokens=2)
        scheduler.submit(long)
        scheduler.submit(after)
        await wait_blocking(engine.blocked)  # the prefill's token is out, the next step waits
        assert await asyncio.wait_for(long.events.get(), 5) == Delta("A", 1)
        canceller = threading.Thread(target=scheduler.cancel, args=(long,))  # from another thread
        canceller.start()
        canceller.join(5)
        assert long.state == "running" and long.cancelled  # still decoding until its next step
        engine.release.set()
        assert await outcome(long) == [Cancelled()]
        call = engine.calls[0]
        assert call["hooks"] == 2  # stopped at the very next step, not after 100
        assert call["error"] is not None and not isinstance(call["error"], StopDecoding)  # propagated out
        # the engine is free for the next job, which completes normally
        assert (await outcome(after))[-1].text == "BB"
        assert (metrics.requests["cancelled"], metrics.requests["completed"]) == (1, 1)
        assert metrics.completion_tokens == 2  # the cancelled job's tokens are not counted
        scheduler.cancel(long)
        scheduler.cancel(after)  # finished jobs are left alone
        await asyncio.sleep(0.01)
        assert long.events.empty() and after.events.empty()
        assert after.state == "finished" and not after.cancelled
        assert metrics.requests["cancelled"] == 1

    asyncio.run(scenario())


def test_a_job_cancelled_before_it_is_submitted_never_reaches_the_engine(make_scheduler):
    engine = FakeEngine()
    scheduler = make_scheduler(engine)

    async def scenario() -> None:
        early = job("A")
        scheduler.cancel(early)
        scheduler.submit(early)
        assert await outcome(early) == [Cancelled()]
        assert engine.calls == []

    asyncio.run(scenario())


def test_a_failing_generate_gives_failed_and_the_worker_lives_on(make_scheduler):
    boom, late = RuntimeError("boom"), ValueError("late")
    engine = FakeEngine({tuple(tokens("f")): [boom], tuple(tokens("g")): [*tokens("AB"), late]})
    scheduler = make_scheduler(engine)
    metrics = scheduler.metrics

    async def scenario() -> None:
        at_once, midway, fine = job("f"), job("g", max_tokens=5), job("o", max_tokens=2)
        for each in (at_once, midway, fine):
            scheduler.submit(each)
        assert await outcome(at_once) == [Failed(boom)]
        events = await outcome(midway)
        assert events == [Delta("A", 1), Delta("B", 2), Failed(late)] and events[-1].error is late
        assert (await outcome(fine))[-1].text == "oo"
        assert metrics.requests["failed"] == 2 and metrics.requests["completed"] == 1
        assert len({c["thread"] for c in engine.calls}) == 1  # the same worker thread served all three

    asyncio.run(scenario())


def test_every_job_gets_exactly_one_terminal_event_under_racing_cancels(make_scheduler):
    engine = FakeEngine()
    scheduler = make_scheduler(engine, depth=64)
    metrics = scheduler.metrics

    async def scenario() -> None:
        jobs = [job(chr(ord("a") + i % 26), max_tokens=3) for i in range(40)]
        for each in jobs:
            scheduler.submit(each)
        canceller = threading.Thread(target=lambda: [scheduler.cancel(j) for j in jobs[::2]])
        canceller.start()  # cancels race the worker: some are waiting, one may decode, some are done
        results = [await outcome(j) for j in jobs]
        canceller.join(5)
        ends = [type(r[-1]) for r in results]
        assert all(end is Done for end in ends[1::2])
        assert all(end in (Done, Cancelled) for end in ends[::2])
        assert metrics.requests["completed"] == ends.count(Done)
        assert metrics.requests["cancelled"] == ends.count(Cancelled)
        assert len(engine.calls) <= 40 and engine.max_active == 1

    asyncio.run(scenario())


def test_close_cancels_every_job_stops_the_worker_and_leaves_the_engine_open(make_scheduler):
    engine = FakeEngine(hold=True)
    scheduler = make_scheduler(engine)

    async def scenario() -> None:
        running, waiting = job("A", max_tokens=50), [job("B"), job("C")]
        scheduler.submit(running)
        await wait_blocking(engine.blocked)
        for each in waiting:
            scheduler.submit(each)
        closer = threading.Thread(target=scheduler.close, kwargs={"timeout": 5})
        closer.start()  # close() waits for the worker, which waits for the held step
        for each in waiting:
            assert await outcome(each) == [Cancelled(by_shutdown=True)]  # told at once, the server stops
        assert scheduler.queue_depth == 0
        engine.release.set()
        await until(lambda: not closer.is_alive())
        assert await outcome(running) == [Delta("A", 1), Cancelled(by_shutdown=True)]
        assert engine.calls[0]["hooks"] == 2 and len(engine.calls) == 1
        assert not engine.calls[0]["thread"].is_alive()  # the worker thread ended
        assert not engine.closed  # its owner closes the engine
        with pytest.raises(RuntimeError, match="shutting down"):
            scheduler.submit(job("D"))

    asyncio.run(scenario())


def test_closing_an_idle_scheduler_is_prompt(make_scheduler):
    engine = FakeEngine()
    scheduler = make_scheduler(engine)

    async def scenario() -> None:
        warm = job("A", max_tokens=1)
        scheduler.submit(warm)
        await outcome(warm)

    asyncio.run(scenario())
    worker = engine.calls[0]["thread"]
    started = time.perf_counter()
    scheduler.close(timeout=5)
    assert time.perf_counter() - started < 1.0 and not worker.is_alive()


def test_the_terminal_event_comes_after_the_bookkeeping(make_scheduler):
    """A client holding its answer sees the engine free and its request counted (the worker used to
    emit ``Done`` first: a request answered 200 could still be missing from ``completed``)."""
    boom = RuntimeError("boom")
    engine = FakeEngine({tuple(tokens("f")): [boom]})
    scheduler = make_scheduler(engine)
    metrics = scheduler.metrics
    original = metrics.count_request

    def slow_count(outcome_name: str) -> None:
        time.sleep(0.05)  # an event emitted before the count would be read before it lands
        original(outcome_name)

    metrics.count_request = slow_count
    seen = []

    async def scenario() -> None:
        for text, outcome_name in (("o", "completed"), ("f", "failed")):
            each = job(text, max_tokens=2)
            scheduler.submit(each)
            while not isinstance(event := await asyncio.wait_for(each.events.get(), 5), TERMINAL):
                pass
            seen.append((type(event).__name__, scheduler.busy, metrics.requests[outcome_name]))  # at arrival

    asyncio.run(scenario())
    assert seen == [("Done", False, 1), ("Failed", False, 1)]
