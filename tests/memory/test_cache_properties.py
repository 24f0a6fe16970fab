"""Properties of ExpertCache under random sequences of acquire / release / prefetch / protect /
complete operations over a link whose copies land only when the test says (``held_link``).

After every operation: at most ``n_slots`` keys, keys and slots one-to-one, the slot table equal
to the READY keys' slots, ``hits + misses == acquired_keys``, every acquired slot holding its
expert's bytes, and ``spare_slots()`` equal to the slots a prefetch may take (FREE ones and READY,
unpinned, unprotected ones), which the test checks both by counting and by prefetching: with a
policy that admits every prefetch, a prefetch of an absent key is issued exactly when a slot is
spare, and never evicts a pinned, protected or loading key. ``preload`` (a warm start) may evict
any unpinned READY key, protected ones too, and refuses only when none is left.
"""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, given, settings

from held_link import N_EXPERTS, make_cache, spare_by_count
from specter.errors import BudgetError
from specter.memory.cache import ExpertCache, SlotState
from specter.policies import LFUPolicy, LRUPolicy

torch.set_num_threads(1)

LAYERS = (0, 1)

keys = st.tuples(st.sampled_from(LAYERS), st.integers(0, N_EXPERTS - 1))
operations = st.lists(st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from(LAYERS), st.lists(st.integers(0, N_EXPERTS - 1), min_size=1, max_size=4)),
    st.tuples(st.just("release"), st.integers(0, 10)),
    st.tuples(st.just("prefetch"), keys),
    st.tuples(st.just("protect"), st.lists(keys, max_size=3)),
    st.tuples(st.just("unprotect_all")),
    st.tuples(st.just("complete")),
    st.tuples(st.just("poll")),
    st.tuples(st.just("preload"), st.lists(keys, min_size=1, max_size=3)),
), min_size=1, max_size=40)



def check_invariants(cache: ExpertCache, pins: Counter) -> None:
    resident = cache.resident_keys()
    assert len(resident) <= cache.n_slots
    assert sorted(k for s in range(cache.n_slots) if (k := cache.key_in(s)) is not None) == resident
    expected_table = torch.full_like(cache.slot_table, -1)
    for key in resident:
        slot = cache.slot_of(key)
        assert cache.key_in(slot) == key
        if cache.state(slot) is SlotState.READY:
            expected_table[cache.table_rows[key[0]], key[1]] = slot
    assert torch.equal(cache.slot_table, expected_table), "slot table disagrees with the cache's keys"
    assert cache.pinned_keys() == set(pins)
    stats = cache.stats
    assert stats.hits + stats.misses == stats.acquired_keys
    assert stats.misses == stats.demand_loads
    assert cache.spare_slots() == spare_by_count(cache), "spare_slots() is not what a prefetch may take"


def holds(cache: ExpertCache, key, slot: int) -> bool:
    return all(torch.equal(cache.slots[name][slot], tensor) for name, tensor in cache.store.expert(*key).items())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_slots=st.integers(1, 5), lfu=st.booleans(), ops=operations)
def test_random_operations_keep_the_cache_consistent(n_slots: int, lfu: bool, ops) -> None:
    cache, link = make_cache(n_slots, policy=LFUPolicy() if lfu else LRUPolicy(), layers=LAYERS)
    held: list[tuple[int, list[int]]] = []
    pins: Counter = Counter()
    for op in ops:
        kind = op[0]
        if kind == "acquire":
            _, layer, experts = op
            try:
                slots = cache.acquire(layer, experts)
            except BudgetError:
                check_invariants(cache, pins)  # a refusal leaves no pin behind
                continue
            for expert, slot in zip(experts, slots):
                assert cache.key_in(slot) == (layer, expert) and cache.state(slot) is SlotState.READY
                assert holds(cache, (layer, expert), slot), f"slot {slot} does not hold {(layer, expert)}"
            held.append((layer, experts))
            pins.update({(layer, e) for e in experts})
        elif kind == "release" and held:
            layer, experts = held.pop(op[1] % len(held))
            cache.release(layer, experts)
            pins.subtract({(layer, e) for e in experts})
            pins = +pins
        elif kind == "prefetch":
            key = op[1]
            before = {k: cache.state(cache.slot_of(k)) for k in cache.resident_keys()}
            protected, pinned = cache.protected_keys(), cache.pinned_keys()
            spare = spare_by_count(cache)
            issued = cache.prefetch(*key)
            if key in before:
                assert not issued
            else:  # LRU and LFU admit every prefetch: issued exactly when a slot is spare
                assert issued == (spare > 0), f"prefetch {issued} with {spare} spare slots"
            for evicted in set(before) - set(cache.resident_keys()):
                assert evicted not in pinned and evicted not in protected, f"prefetch evicted {evicted}"
                assert before[evicted] is SlotState.READY, f"prefetch evicted {evicted} mid-copy"
        elif kind == "protect":
            cache.protect(op[1])
        elif kind == "unprotect_all":
            cache.unprotect_all()
        elif kind == "complete":
            link.complete_all()
            cache.poll()
        elif kind == "poll":
            cache.poll()
        elif kind == "preload":  # a warm start: may evict any unpinned READY key, protected or not
            try:
                cache.preload(op[1])
            except BudgetError:
                assert not any(cache.state(s) is SlotState.FREE
                               or (cache.state(s) is SlotState.READY and cache.pin_count(s) == 0)
                               for s in range(cache.n_slots)), "preload refused with an unpinned READY slot"
            else:
                assert cache.contains(op[1][-1])
        check_invariants(cache, pins)
    for layer, experts in held:
        for expert in experts:
            assert holds(cache, (layer, expert), cache.slot_of((layer, expert)))
