"""ExpertCache unit behaviours: hits, misses and eviction order, prefetch rules, budgets, the slot
table, and that computing from slots equals computing from the store."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch
import torch.nn.functional as F

from specter.memory.cache import ExpertCache, SlotState
from specter.errors import BudgetError, SpecterError
from specter.memory.links import EmulatedLink, LocalLink
from specter.policies import LFUPolicy, LRUPolicy
from specter.policies.base import CachePolicy, ExpertKey
from specter.memory.store import ExpertStore

torch.set_num_threads(1)

HIDDEN, INTER = 8, 4


def make_store(layers: Sequence[int] = (0, 2), n_experts: int = 6, seed: int = 0) -> ExpertStore:
    gen = torch.Generator().manual_seed(seed)
    return ExpertStore({
        layer: {
            "gate_up_proj": torch.randn(n_experts, 2 * INTER, HIDDEN, generator=gen),
            "down_proj": torch.randn(n_experts, HIDDEN, INTER, generator=gen),
        }
        for layer in layers
    })


class RecordingLink(LocalLink):
    def __init__(self) -> None:
        self.released: list[int] = []

    def release_slot(self, slot: int) -> None:
        self.released.append(slot)


def make_cache(n_slots: int = 3, policy: CachePolicy | None = None, link=None, **store_kw) -> ExpertCache:
    return ExpertCache(make_store(**store_kw), n_slots, torch.device("cpu"), link or LocalLink(copy_thread=False),
                       policy or LRUPolicy())


def use(cache: ExpertCache, layer: int, experts: Sequence[int]) -> list[int]:
    slots = cache.acquire(layer, experts)
    cache.release(layer, experts)
    return slots


def assert_table_matches(cache: ExpertCache) -> None:
    expected = torch.full_like(cache.slot_table, -1)
    for key in cache.resident_keys():
        slot = cache.slot_of(key)
        if cache.state(slot) is SlotState.READY:
            expected[cache.store.layers.index(key[0]), key[1]] = slot
    assert torch.equal(cache.slot_table, expected)


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ gate_up.T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.T


def test_allocates_fixed_slots_once() -> None:
    cache = make_cache(n_slots=3)
    assert cache.slots["gate_up_proj"].shape == (3, 2 * INTER, HIDDEN)
    assert cache.slots["down_proj"].shape == (3, HIDDEN, INTER)
    assert cache.bytes == 3 * cache.store.expert_bytes == sum(
        t.numel() * t.element_size() for t in cache.slots.values())
    assert cache.slot_table.shape == (2, 6) and bool((cache.slot_table == -1).all())
    pointers = {n: t.data_ptr() for n, t in cache.slots.items()}
    use(cache, 0, [0, 1, 2])
    use(cache, 2, [3, 4, 5])
    assert {n: t.data_ptr() for n, t in cache.slots.items()} == pointers
    assert cache.capacity == 3


def test_lru_hits_misses_and_eviction_order() -> None:
    cache = make_cache(n_slots=2)
    use(cache, 0, [0])
    use(cache, 0, [1])
    use(cache, 0, [0])
    use(cache, 0, [2])
    assert cache.resident_keys() == [(0, 0), (0, 2)]
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (1, 3, 1)
    assert cache.stats.hit_rate() == pytest.approx(0.25)
    assert cache.stats.bytes_transferred == 3 * cache.store.expert_bytes
    assert_table_matches(cache)


def test_lfu_keeps_the_popular_expert() -> None:
    cache = make_cache(n_slots=2, policy=LFUPolicy())
    for _ in range(3):
        use(cache, 0, [0])
    use(cache, 0, [1])
    use(cache, 0, [2])
    use(cache, 0, [3])
    assert cache.resident_keys() == [(0, 0), (0, 3)]


def test_duplicates_in_a_step_count_once_and_keep_order() -> None:
    cache = make_cache(n_slots=2)
    slots = cache.acquire(0, [4, 1, 4])
    assert slots[0] == slots[2] != slots[1]
    assert cache.stats.acquired_keys == 2 and cache.stats.misses == 2
    cache.release(0, [4, 1, 4])
    assert cache.pinned_keys() == set()


def test_release_unpins_and_tells_the_link() -> None:
    link = RecordingLink()
    cache = make_cache(n_slots=2, link=link)
    first = cache.acquire(0, [0])
    again = cache.acquire(0, [0])
    assert first == again and cache.pin_count(first[0]) == 2
    cache.release(0, [0])
    assert link.released == []
    cache.release(0, [0])
    assert link.released == first
    with pytest.raises(SpecterError, match="not acquired"):
        cache.release(0, [0])


def test_budget_error_when_a_step_needs_more_than_capacity() -> None:
    cache = make_cache(n_slots=3)
    with pytest.raises(BudgetError, match="chunks of at most 3"):
        cache.acquire(0, [0, 1, 2, 3])
    slots = cache.acquire(0, [0, 1, 2, 2, 1])  # repeats ask for the same expert twice: one slot each
    assert len(set(slots)) == 3 and sorted(set(slots)) == [0, 1, 2]
    assert slots[2] == slots[3] and slots[1] == slots[4]
    assert cache.acquire(0, [0, 1, 2, 2, 1]) == slots
    assert cache.stats.acquired_keys == 6


def test_budget_error_when_unreleased_steps_hold_the_slots() -> None:
    cache = make_cache(n_slots=3)
    cache.acquire(0, [0, 1])
    with pytest.raises(BudgetError, match="unpinned"):
        cache.acquire(2, [0, 1])
    assert cache.stats.acquired_keys == 2 and cache.resident_keys() == [(0, 0), (0, 1)]
    cache.acquire(2, [0])
    cache.acquire(0, [1])


def test_prefetch_into_a_free_slot_is_then_a_hit() -> None:
    cache = make_cache(n_slots=2)
    assert cache.prefetch(0, 3, score=0.9)
    assert not cache.prefetch(0, 3)
    assert cache.contains((0, 3)) and cache.is_ready((0, 3))
    use(cache, 0, [3])
    stats = cache.stats
    assert (stats.hits, stats.misses, stats.prefetch_issued, stats.prefetch_used) == (1, 0, 1, 1)
    assert stats.prefetch_precision() == 1.0


def test_a_prefetch_from_before_a_stats_reset_is_neither_used_nor_wasted_after_it() -> None:
    # a report covers one generate call: a prefetch the last call left unused made the next call's
    # precision 5 used of 4 issued (1.25)
    cache = make_cache(n_slots=2)
    cache.prefetch(0, 1)
    cache.prefetch(0, 2)
    cache.reset_stats()
    use(cache, 0, [1])
    use(cache, 0, [3])  # evicts the other old prefetch
    stats = cache.stats
    assert (stats.prefetch_issued, stats.prefetch_used, stats.prefetch_wasted) == (0, 0, 0)
    assert (stats.hits, stats.misses, stats.evictions) == (1, 1, 1)


def test_prefetch_never_evicts_pinned_or_protected_keys() -> None:
    cache = make_cache(n_slots=1)
    cache.acquire(0, [0])
    assert not cache.prefetch(0, 1)
    cache.release(0, [0])
    cache.protect([(0, 0)])
    assert not cache.prefetch(0, 1)
    assert cache.resident_keys() == [(0, 0)]
    cache.unprotect_all()
    assert cache.prefetch(0, 1)
    assert cache.resident_keys() == [(0, 1)]
    assert cache.stats.prefetch_wasted == 0 and cache.stats.evictions == 1


def test_evicted_unused_prefetch_is_wasted() -> None:
    cache = make_cache(n_slots=1)
    cache.prefetch(0, 1)
    use(cache, 0, [2])
    assert cache.stats.prefetch_wasted == 1 and cache.stats.prefetch_used == 0


def test_demand_loads_evict_unprotected_keys_first_then_protected() -> None:
    cache = make_cache(n_slots=2)
    use(cache, 0, [0])
    use(cache, 0, [1])
    cache.protect([(0, 0)])
    use(cache, 0, [2])
    assert cache.resident_keys() == [(0, 0), (0, 2)]
    cache.protect([(0, 2)])
    use(cache, 0, [3])
    assert cache.contains((0, 3)) and len(cache.resident_keys()) == 2


def test_policy_may_refuse_a_prefetch() -> None:
    class Stubborn(LRUPolicy):
        def admit_prefetch(self, key: ExpertKey, score: float, victim: ExpertKey) -> bool:
            return score > 0.5

    cache = make_cache(n_slots=1, policy=Stubborn())
    use(cache, 0, [0])
    assert not cache.prefetch(0, 1, score=0.2)
    assert cache.prefetch(0, 1, score=0.8)


def test_policy_must_choose_among_candidates() -> None:
    class Wrong(LRUPolicy):
        def choose_victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
            return (0, 5)

    cache = make_cache(n_slots=1, policy=Wrong())
    use(cache, 0, [0])
    with pytest.raises(SpecterError, match=r"^offload\.cache_policy\.name: cache policy 'lru' returned \(0, 5\) "
                                           r"from choose_victim\(\), which is not one of the candidates it was given$"):
        cache.acquire(0, [1])


def test_policy_hears_every_insert_access_and_evict() -> None:
    events: list[tuple[str, ExpertKey]] = []

    class Listening(LRUPolicy):
        def on_insert(self, key: ExpertKey) -> None:
            events.append(("insert", key)); super().on_insert(key)

        def on_access(self, key: ExpertKey) -> None:
            events.append(("access", key)); super().on_access(key)

        def on_evict(self, key: ExpertKey) -> None:
            events.append(("evict", key)); super().on_evict(key)

    cache = make_cache(n_slots=1, policy=Listening())
    use(cache, 0, [0])
    cache.prefetch(0, 1)
    use(cache, 0, [1])
    assert events == [("insert", (0, 0)), ("access", (0, 0)), ("evict", (0, 0)),
                      ("insert", (0, 1)), ("access", (0, 1))]


def test_bad_keys_are_rejected() -> None:
    cache = make_cache()
    with pytest.raises(SpecterError, match="layer 1"):
        cache.acquire(1, [0])
    with pytest.raises(SpecterError, match="out of range"):
        cache.prefetch(0, 6)
    with pytest.raises(BudgetError):
        make_cache(n_slots=0)


def test_preload_fills_without_counting() -> None:
    cache = make_cache(n_slots=2)
    cache.preload([(0, 1), (2, 5), (0, 1)])
    assert cache.resident_keys() == [(0, 1), (2, 5)] and cache.is_ready((2, 5))
    assert cache.stats.bytes_transferred == 0
    use(cache, 2, [5])
    assert cache.stats.hits == 1
    assert_table_matches(cache)


def test_slot_table_tracks_loads_and_evictions() -> None:
    cache = make_cache(n_slots=2)
    slots = use(cache, 2, [4, 1])
    assert cache.slot_table[1, 4] == slots[0] and cache.slot_table[1, 1] == slots[1]
    use(cache, 0, [3])
    assert_table_matches(cache)
    assert int((cache.slot_table >= 0).sum()) == 2


def test_computing_from_slots_equals_computing_from_the_store() -> None:
    cache = make_cache(n_slots=3, n_experts=6)
    store = cache.store
    x = torch.randn(5, HIDDEN)
    top_k = torch.tensor([[0, 4], [4, 5], [1, 0], [5, 5], [2, 4]])
    for layer in store.layers:
        wanted = sorted(set(top_k.flatten().tolist()))
        for start in range(0, len(wanted), cache.capacity):
            chunk = wanted[start:start + cache.capacity]
            slots = cache.acquire(layer, chunk)
            for expert, slot in zip(chunk, slots):
                tokens = (top_k == expert).any(dim=1)
                from_slot = swiglu(x[tokens], cache.slots["gate_up_proj"][slot], cache.slots["down_proj"][slot])
                reference = store.expert(layer, expert)
                from_store = swiglu(x[tokens], reference["gate_up_proj"], reference["down_proj"])
                assert torch.equal(from_slot, from_store)
                row = cache.slot_table[store.layers.index(layer)]
                assert torch.equal(cache.slots["down_proj"][row[expert]], reference["down_proj"])
            cache.release(layer, chunk)


def test_emulated_link_prefetch_is_waited_for_at_acquire() -> None:
    link = EmulatedLink(gbps=0.001, latency_us=50_000.0)
    try:
        cache = make_cache(n_slots=2, link=link)
        assert cache.prefetch(0, 3)
        assert cache.contains((0, 3)) and not cache.is_ready((0, 3)) and cache.in_flight == 1
        assert int(cache.slot_table[0, 3]) == -1
        [slot] = cache.acquire(0, [3])
        assert cache.is_ready((0, 3)) and int(cache.slot_table[0, 3]) == slot and cache.in_flight == 0
        assert torch.equal(cache.slots["gate_up_proj"][slot], cache.store.expert(0, 3)["gate_up_proj"])
        assert cache.stats.prefetch_late == 1 and cache.stats.hits == 1
        assert cache.stats.transfer_wait_s > 0.01
        cache.release(0, [3])
        [other] = cache.acquire(0, [1])
        assert torch.equal(cache.slots["down_proj"][other], cache.store.expert(0, 1)["down_proj"])
        assert cache.stats.demand_loads == 1
    finally:
        link.close()


@pytest.mark.gpu
def test_cuda_cache_prefetch_and_demand_loads_match_the_store() -> None:
    from specter.memory.links import CudaLink

    store = ExpertStore({0: {"gate_up_proj": torch.randn(6, 2 * INTER, HIDDEN),
                             "down_proj": torch.randn(6, HIDDEN, INTER)}}, pin=True)
    link = CudaLink()
    cache = ExpertCache(store, 2, torch.device("cuda"), link, LRUPolicy())
    assert cache.prefetch(0, 5)
    for experts in ([5, 1], [2], [5, 3]):
        slots = cache.acquire(0, experts)
        for expert, slot in zip(experts, slots):
            assert torch.equal(cache.slots["down_proj"][slot].cpu(), store.expert(0, expert)["down_proj"])
            assert int(cache.slot_table[0, expert]) == slot
        cache.release(0, experts)
    assert cache.stats.prefetch_used == 1 and cache.stats.hits + cache.stats.misses == 5
    link.close()


def test_acquire_without_waiting_counts_as_acquire_and_await_any_returns_what_arrived() -> None:
    from held_link import make_cache as held_cache

    cache, link = held_cache(n_slots=3)
    assert cache.prefetch(0, 1)
    slots = cache.acquire(0, [1, 2], wait=False)  # (0, 1) copying since the prefetch, (0, 2) on demand
    assert all(cache.pin_count(slot) == 1 for slot in slots)
    assert [cache.state(slot) for slot in slots] == [SlotState.LOADING, SlotState.LOADING]
    assert (cache.stats.hits, cache.stats.misses, cache.stats.prefetch_late) == (1, 1, 1)
    assert cache.await_any(0, [2, 1]) == [1]  # none arrived: the first submitted is waited for, alone
    link.complete_all()
    assert cache.await_any(0, [2]) == [2]
    cache.release(0, [1, 2])
    assert cache.pinned_keys() == set()


# ----------------------------------------------------------------------------- a copy that fails


class FailingLink(LocalLink):
    """A synchronous local link whose next ``fail_submits`` submits raise and whose next
    ``fail_copies`` transfers raise when waited on."""

    def __init__(self, fail_submits: int = 0, fail_copies: int = 0) -> None:
        super().__init__(copy_thread=False)
        self.fail_submits, self.fail_copies = fail_submits, fail_copies

    def submit(self, dst, src, slot):
        if self.fail_submits:
            self.fail_submits -= 1
            raise OSError("device busy")
        if self.fail_copies:
            self.fail_copies -= 1
            return _FailedTransfer()
        return super().submit(dst, src, slot)


class _FailedTransfer:
    nbytes = 0

    def done(self) -> bool:
        return True

    def wait(self, timeout=None) -> float:
        raise SpecterError("expert transfer failed: bus error")


def assert_holds_expert(cache: ExpertCache, layer: int, expert: int) -> None:
    slot = cache.acquire(layer, [expert])[0]
    for name, tensor in cache.store.expert(layer, expert).items():
        assert torch.equal(cache.slot_views(slot)[name], tensor), name
    cache.release(layer, [expert])


def test_a_copy_that_cannot_start_leaves_no_slot_behind_and_the_next_acquire_loads_it():
    """A link whose submit raises: the acquire fails naming the link, holds no pin, and the key is
    not resident, so the next acquire copies it rather than handing out a slot never written."""
    link = FailingLink()
    cache = make_cache(n_slots=2, link=link)
    use(cache, 0, [0])
    link.fail_submits = 1
    with pytest.raises(SpecterError, match="failed to start the copy of expert \\(0, 1\\): OSError: device busy"):
        cache.acquire(0, [0, 1])  # expert 0 is a hit and gets pinned before expert 1's copy fails
    assert (0, 1) not in cache.resident_keys() and cache.pinned_keys() == set()
    assert_holds_expert(cache, 0, 1)
    assert_table_matches(cache)


def test_a_failed_copy_whose_repair_fails_too_frees_its_slot_once_unpinned():
    """The copy fails and so does the reload from the store: the error is raised, the pins of the
    acquire given back, and the slot freed, so the key loads afresh next time."""
    cache = make_cache(n_slots=2, link=FailingLink(fail_copies=1))
    broken = cache._repair.reload

    def reload(*args, **kwargs):
        cache._repair.reload = broken
        raise SpecterError("offload.link.kind: the link keeps failing")

    cache._repair.reload = reload
    with pytest.raises(SpecterError, match="the link keeps failing"):
        cache.acquire(0, [2])
    assert (0, 2) not in cache.resident_keys() and cache.pinned_keys() == set()
    assert [cache.state(s) for s in range(2)] == [SlotState.FREE, SlotState.FREE]
    assert_holds_expert(cache, 0, 2)


def test_a_wave_whose_copy_and_repair_fail_releases_cleanly():
    """The waves path acquires without waiting and releases whatever is pending when a wait
    fails: the failed key's slot is freed at that release, the others stay cached."""
    cache = make_cache(n_slots=3, link=FailingLink(fail_copies=1))
    cache._repair.reload = lambda *args, **kwargs: (_ for _ in ()).throw(SpecterError("reload failed"))
    cache.acquire(0, [1, 3], wait=False)
    with pytest.raises(SpecterError, match="reload failed"):
        cache.await_any(0, [1, 3])  # expert 1's copy is the failed one
    cache.release(0, [1, 3])
    assert cache.pinned_keys() == set() and (0, 1) not in cache.resident_keys() and (0, 3) in cache.resident_keys()


def test_a_copy_past_its_deadline_stays_in_flight_and_is_waited_for_again():
    """A wait that times out leaves the copy in flight (the slot LOADING with its transfer) and no
    pin held; the next acquire waits for it again instead of calling it a ready hit."""
    link = EmulatedLink(gbps=1.0, latency_us=300_000)  # each copy takes 0.3 s
    cache = ExpertCache(make_store(), 2, torch.device("cpu"), link, LRUPolicy(), transfer_timeout_s=0.05)
    with pytest.raises(SpecterError, match="did not complete within 0.05 s"):
        cache.acquire(0, [4])
    slot = cache.slot_of((0, 4))
    assert cache.state(slot) is SlotState.LOADING and cache.in_flight == 1 and cache.pinned_keys() == set()
    with pytest.raises(SpecterError, match="did not complete"):
        cache.acquire(0, [4])  # still copying: waited for, not handed out
    cache.transfer_timeout_s = None
    assert_holds_expert(cache, 0, 4)
    link.close()
