"""The host tier between the disk and the device cache (``offload.host_budget``): reads from the
checkpoint into at most ``capacity`` host buffers, device copies from them, staged reads ahead of
the copies, never a read issued twice while it is in flight, never the budget exceeded, and the
engines' greedy tokens identical to ``resident`` through both tiers."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import specter
from specter.errors import RecipeError, SpecterError
from specter.memory.disk import CheckpointIndex, DiskExperts
from specter.memory.disk_store import DiskSource
from specter.memory.host_tier import HostTierLink
from specter.memory.link import Transfer
from specter.memory.links import EmulatedLink, LocalLink
from specter.model.layout import moe_layers
from specter.policies.lru import LRUPolicy

PROMPTS = [[1, 17, 93, 4, 250, 31, 8, 66, 140, 7]]


@pytest.fixture(scope="module")
def disk(tiny_mixtral):
    model = specter.load({"model": str(tiny_mixtral), "engine": "resident", "device": "cpu"}).model
    experts = DiskExperts(CheckpointIndex(tiny_mixtral), moe_layers(model), torch.float32, direct=False)
    yield experts
    experts.close()


def slot(disk) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape) for name, shape in disk.param_shapes.items()}


def assert_holds(dst, disk, layer, expert) -> None:
    for name, tensor in disk.read(layer, expert).items():
        assert torch.equal(dst[name], tensor), f"slot holds the wrong bytes for {(layer, expert)}"


def test_a_held_expert_is_copied_from_host_memory_without_reading_the_disk(disk):
    tier = HostTierLink(LocalLink(copy_thread=False), capacity=3, policy=LRUPolicy())
    dst = slot(disk)
    tier.submit(dst, DiskSource(disk, 0, 5), 0).wait()
    assert_holds(dst, disk, 0, 5)
    read_before = disk.bytes_read
    again = slot(disk)
    tier.submit(again, DiskSource(disk, 0, 5), 1).wait()
    assert disk.bytes_read == read_before  # the host copy served it
    assert_holds(again, disk, 0, 5)
    described = tier.describe()["host_tier"]
    assert described["host_hits"] == 1 and described["disk_reads"] == 1 and described["held"] == 1
    tier.close()


def test_a_staged_read_is_not_read_again_when_its_copy_is_asked(disk):
    tier = HostTierLink(LocalLink(copy_thread=False), capacity=2, policy=LRUPolicy())
    tier.stage(DiskSource(disk, 1, 3))
    tier.stage(DiskSource(disk, 1, 3))  # already on its way: nothing new
    dst = slot(disk)
    tier.submit(dst, DiskSource(disk, 1, 3), 0).wait()
    assert_holds(dst, disk, 1, 3)
    stats = tier.describe()["host_tier"]
    assert stats["disk_reads"] == 1 and stats["staged"] == 1 and stats["staged_used"] == 1
    tier.close()


class GateLink(LocalLink):
    """Device copies that finish only once the test opens the gate (a busy buffer stays busy
    however the threads are scheduled)."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def submit(self, dst, src, slot):
        gate, parent = self.gate, super()

        class Gated(Transfer):
            nbytes = 0

            def done(self) -> bool:
                return gate.is_set()

            def wait(self, timeout=None) -> float:
                gate.wait()
                parent.submit(dst, src, slot)
                return 0.0

        return Gated()


def test_the_budget_evicts_by_policy_and_a_busy_buffer_is_never_taken(disk):
    link = GateLink()  # the first copy keeps its buffer busy until the gate opens
    tier = HostTierLink(link, capacity=1, policy=LRUPolicy())
    first, second = slot(disk), slot(disk)
    copy_first = tier.submit(first, DiskSource(disk, 0, 1), 0)
    copy_second = tier.submit(second, DiskSource(disk, 0, 2), 1)  # the only buffer is busy: read through
    link.gate.set()
    copy_first.wait()
    copy_second.wait()
    assert_holds(first, disk, 0, 1)
    assert_holds(second, disk, 0, 2)
    stats = tier.describe()["host_tier"]
    assert stats["not_kept"] == 1 and stats["held"] == 1
    third = slot(disk)
    tier.submit(third, DiskSource(disk, 0, 3), 2).wait()  # the buffer is free now: evict (0, 1)
    assert_holds(third, disk, 0, 3)
    assert tier.describe()["host_tier"]["evictions"] == 1
    tier.close()


def test_a_read_error_reaches_the_waiter_and_frees_the_buffer(disk, monkeypatch):
    tier = HostTierLink(LocalLink(copy_thread=False), capacity=1, policy=LRUPolicy())

    def broken(self, dst):
        raise SpecterError("disk tier: short read (injected)")

    with monkeypatch.context() as patch:
        patch.setattr(DiskSource, "read_into", broken)
        with pytest.raises(SpecterError, match="injected"):
            tier.submit(slot(disk), DiskSource(disk, 0, 4), 0).wait()
    dst = slot(disk)
    tier.submit(dst, DiskSource(disk, 0, 4), 0).wait()  # nothing wrong was kept
    assert_holds(dst, disk, 0, 4)
    tier.close()


class HostTierMachine(RuleBasedStateMachine):
    """Random stages, copies and waits against a small tier: the budget holds, a key is never read
    twice while its read is in flight, and every completed copy holds the expert's bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.tier = HostTierLink(EmulatedLink(gbps=5.0), capacity=3, policy=LRUPolicy(), workers=3)
        self.copies: list[tuple[tuple[int, int], dict, object]] = []
        self.reading: dict[tuple[int, int], int] = {}
        self.overlaps = 0
        lock = threading.Lock()
        real = DiskSource.read_into

        def counted(source, dst):
            key = (source.layer, source.expert)
            with lock:
                self.reading[key] = self.reading.get(key, 0) + 1
                self.overlaps += self.reading[key] > 1
            try:
                real(source, dst)
            finally:
                with lock:
                    self.reading[key] -= 1

        self.counted = counted

    def source(self, layer: int, expert: int) -> DiskSource:
        source = DiskSource(MACHINE_DISK, layer, expert)
        source.read_into = lambda dst, source=source: self.counted(source, dst)
        return source

    @rule(layer=st.integers(0, 1), expert=st.integers(0, 4))
    def stage(self, layer, expert):
        self.tier.stage(self.source(layer, expert))

    @rule(layer=st.integers(0, 1), expert=st.integers(0, 4))
    def copy(self, layer, expert):
        dst = slot(MACHINE_DISK)
        self.copies.append(((layer, expert), dst, self.tier.submit(dst, self.source(layer, expert), 0)))

    @rule()
    def wait_all(self):
        for key, dst, transfer in self.copies:
            transfer.wait(timeout=30)
            assert_holds(dst, MACHINE_DISK, *key)
        self.copies.clear()

    @invariant()
    def within_budget(self):
        with self.tier._lock:
            assert len(self.tier._held) + len(self.tier._reading) <= self.tier.capacity
        assert self.overlaps == 0

    def teardown(self):
        self.wait_all()
        self.tier.close()


MACHINE_DISK: DiskExperts | None = None


@pytest.fixture
def machine_disk(disk):
    global MACHINE_DISK
    MACHINE_DISK = disk
    yield disk
    MACHINE_DISK = None


def test_host_tier_state_machine(machine_disk):
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(HostTierMachine, settings=settings(
        max_examples=25, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]))


def recipe(path, engine: str, **offload) -> dict:
    return {"model": str(path), "engine": engine, "device": "cpu", "max_new_tokens": 10, "threads": 1,
            "offload": {"expert_budget": 0.25, "experts_on": "disk", "host_budget": 0.5,
                        "link": {"kind": "emulated", "gbps": 5}, **offload},
            "speculation": {"governor": {"k": 3}}}


@pytest.mark.parametrize("engine", ["ondemand", "specter"])
def test_greedy_tokens_through_disk_host_and_device_tiers_equal_resident(tiny_mixtral, engine):
    reference = specter.load({"model": str(tiny_mixtral), "engine": "resident", "device": "cpu",
                              "max_new_tokens": 10}).generate(PROMPTS).token_ids
    loaded = specter.load(recipe(tiny_mixtral, engine))
    try:
        result = loaded.generate(PROMPTS)
    finally:
        loaded.close()
    assert result.token_ids == reference
    link = result.report["link"]
    assert link["kind"] == "emulated" and link["bytes_read"] > 0 and link["io"]
    tier = link["host_tier"]
    assert tier["capacity"] == 32 and 0 < tier["held"] <= 32 and tier["disk_reads"] > 0
    if engine == "specter":
        assert tier["staged"] > 0 and tier["staged_used"] > 0  # the draft's predictions read ahead


def test_host_budget_needs_the_disk_tier_and_a_host_to_device_link(tiny_mixtral):
    with pytest.raises(RecipeError, match="offload.host_budget: a host tier sits between the disk"):
        specter.load(recipe(tiny_mixtral, "ondemand", experts_on="host"))
    with pytest.raises(SpecterError, match="with offload.host_budget the host tier reads the disk"):
        specter.load(recipe(tiny_mixtral, "ondemand", link={"kind": "disk"}))


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["ondemand", "specter"])
def test_three_tiers_on_cuda_equal_resident(tiny_mixtral, engine):
    """Disk, a pinned host tier and the GPU cache behind the cuda link: greedy tokens as resident's."""
    base = {"model": str(tiny_mixtral), "device": "cuda", "max_new_tokens": 10, "threads": 1}
    reference = specter.load({**base, "engine": "resident"}).generate(PROMPTS).token_ids
    data = recipe(tiny_mixtral, engine, link={"kind": "cuda"})
    loaded = specter.load({**data, "device": "cuda"})
    try:
        result = loaded.generate(PROMPTS)
        assert loaded.link.pin and all(buffer.is_pinned() for buffer in loaded.link._held.values()
                                       for buffer in buffer.values())
    finally:
        loaded.close()
    assert result.token_ids == reference
    assert result.report["link"]["kind"] == "cuda" and result.report["link"]["host_tier"]["disk_reads"] > 0


def test_a_staged_read_that_failed_is_not_counted_as_used(disk, monkeypatch):
    """A staged read that failed left its key marked staged-and-unused, so the expert's later copy
    (read afresh) was counted in ``staged_used`` as if the staging had served it."""
    import concurrent.futures

    tier = HostTierLink(LocalLink(copy_thread=False), capacity=2, policy=LRUPolicy())

    def broken(self, dst):
        raise SpecterError("disk tier: short read (injected)")

    with monkeypatch.context() as patch:
        patch.setattr(DiskSource, "read_into", broken)
        tier.stage(DiskSource(disk, 1, 6))
        staged = tier._reading.get((1, 6))
        if staged is not None:
            concurrent.futures.wait([staged])
    dst = slot(disk)
    tier.submit(dst, DiskSource(disk, 1, 6), 0).wait()
    assert_holds(dst, disk, 1, 6)
    stats = tier.describe()["host_tier"]
    assert stats["staged"] == 1 and stats["staged_used"] == 0 and stats["disk_reads"] == 2
    tier.close()


def test_a_closed_tier_refuses_a_submit_before_taking_a_buffer(disk):
    tier = HostTierLink(LocalLink(copy_thread=False), capacity=1, policy=LRUPolicy())
    tier.close()
    with pytest.raises(SpecterError, match="submit on a closed host tier"):
        tier.submit(slot(disk), DiskSource(disk, 0, 1), 0)
    assert tier.stats.disk_reads == 0 and tier.describe()["host_tier"]["held"] == 0
