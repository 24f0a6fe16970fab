"""PrefetchScheduler's modes: ``conservative`` never evicts a prediction of the round except for
the first layer ahead; ``lazy`` issues nothing while the draft runs; ``auto`` turns conservative
while rounds wait on transfers, and back."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from specter.memory.scheduler import PrefetchScheduler
from specter.policies import LookaheadPolicy
from held_link import N_EXPERTS, make_cache, submitted_keys, verify_round

torch.set_num_threads(1)


def test_conservative_keeps_a_later_layers_cached_prediction_and_copies_less() -> None:
    """The round of ``test_a_later_layers_cached_expert_yields_its_slot_to_an_earlier_layers_prediction``
    with ``mode="conservative"``: layer 0's experts (the first layer ahead) take the two slots
    nothing predicts; layer 1's wait, since the only other slots hold layer 2's predictions, and
    load on demand once layer 0 is done. Four copies instead of six, two of them demand loads."""
    copies = {}
    for conservative in (False, True):
        cache, link = make_cache(n_slots=4, policy=LookaheadPolicy(), layers=(0, 1, 2))
        cache.preload([(2, 4), (2, 5), (0, 5), (1, 5)])
        scheduler = PrefetchScheduler(cache, max_in_flight=8, mode="conservative" if conservative else "aggressive")
        scheduler.begin_round()
        scheduler.add(2, [4, 5], [0.9, 0.8])
        scheduler.add(0, [0, 1], [0.9, 0.8])
        scheduler.add(1, [2, 3], [0.7, 0.6])
        scheduler.flush()
        if conservative:
            assert submitted_keys(cache, link) == [(0, 0), (0, 1)]
            assert cache.contains((2, 4)) and cache.contains((2, 5))
        verify_round(cache, link, scheduler, {0: [0, 1], 1: [2, 3], 2: [4, 5]})
        scheduler.end_round({(0, 0), (0, 1), (1, 2), (1, 3), (2, 4), (2, 5)})
        copies[conservative] = (len(link.submitted), cache.stats.misses)
    assert copies == {False: (6, 0), True: (4, 2)}


@settings(max_examples=150, deadline=None)
@given(
    n_slots=st.integers(2, 8),
    cached=st.lists(st.tuples(st.integers(0, 3), st.integers(0, N_EXPERTS - 1)), max_size=8),
    picks=st.lists(st.lists(st.integers(0, N_EXPERTS - 1), min_size=1, max_size=4), min_size=4, max_size=4),
    order=st.permutations(range(4)),
)
def test_conservative_prefetches_evict_a_prediction_only_for_the_first_layer_ahead(n_slots, cached, picks, order):
    """Property: with ``mode="conservative"``, a prefetch (while drafting, at the flush, or streamed
    during verification) evicts a key still predicted for the round only when it loads a key of
    the first layer still ahead; verification still gets every expert it uses."""
    experts_by_layer = {layer: sorted(set(p)) for layer, p in enumerate(picks)}
    cache, link = make_cache(n_slots, policy=LookaheadPolicy(), layers=(0, 1, 2, 3))
    cache.preload(list(dict.fromkeys(cached))[-n_slots:])
    scheduler = PrefetchScheduler(cache, max_in_flight=2, mode="conservative")
    prefetch = cache.prefetch
    violations = []

    def checked_prefetch(layer: int, expert: int, score: float = 0.0) -> bool:
        ahead = set(scheduler._ahead)  # the predictions verification has not passed yet
        before = set(cache.resident_keys())
        placed = prefetch(layer, expert, score)
        evicted = (before - set(cache.resident_keys())) & ahead
        if evicted and layer != min(key[0] for key in ahead):
            violations.append(((layer, expert), evicted))
        return placed

    cache.prefetch = checked_prefetch
    scheduler.begin_round()
    for layer in order:
        scheduler.add(layer, experts_by_layer[layer], [0.5] * len(experts_by_layer[layer]))
        scheduler.pump()
        link.complete_all()
    scheduler.flush()
    for layer, experts in experts_by_layer.items():
        scheduler.advance(layer)
        if len(experts) <= n_slots:
            assert cache.acquire(layer, experts) is not None
            cache.release(layer, experts)
        link.complete_all()
    scheduler.end_round({(layer, e) for layer, experts in experts_by_layer.items() for e in experts})
    assert violations == []
    assert cache.protected_keys() == frozenset()


def test_auto_turns_conservative_while_rounds_wait_on_transfers_and_back() -> None:
    cache, _ = make_cache(n_slots=4)
    scheduler = PrefetchScheduler(cache, mode="auto")
    assert not scheduler.conservative and scheduler.wait_share == 0.0  # starts aggressive, from no wait
    scheduler._observe_wait(wait_s=0.6, round_s=1.0)  # one long wait (a round right after a prefill)
    assert not scheduler.conservative and scheduler.wait_share == pytest.approx(0.12)
    for _ in range(3):
        scheduler._observe_wait(wait_s=0.06, round_s=0.1)
    assert scheduler.conservative and scheduler.wait_share > 0.3
    scheduler._observe_wait(wait_s=0.0, round_s=0.1)
    assert scheduler.conservative and 0.2 < scheduler.wait_share < 0.3  # between the thresholds: kept
    for _ in range(3):
        scheduler._observe_wait(wait_s=0.0, round_s=0.1)
    assert not scheduler.conservative and scheduler.wait_share < 0.2
    for _ in range(20):
        scheduler._observe_wait(wait_s=0.0, round_s=0.1)
    assert not scheduler.lazy  # auto is never lazy


def test_lazy_issues_nothing_while_drafting_and_so_never_evicts_what_a_later_draft_step_predicts() -> None:
    """Four slots hold (0, 2), (1, 2), (0, 3), (1, 3), least recently used first. A first draft step
    predicts (0, 0) and (1, 0), a second (0, 2) and (1, 2). Pumping after each step evicts the
    two least recently used keys, (0, 2) and (1, 2), which the second step then needs back: four
    copies. Lazy issues at the flush, with the round known, and evicts (0, 3) and (1, 3): two."""
    copies = {}
    for mode in ("aggressive", "lazy"):
        cache, link = make_cache(n_slots=4, policy=LookaheadPolicy(), layers=(0, 1))
        cache.preload([(0, 2), (1, 2), (0, 3), (1, 3)])
        scheduler = PrefetchScheduler(cache, max_in_flight=8, mode=mode)
        scheduler.begin_round()
        for expert in (0, 2):
            scheduler.add_many([(0, [expert], [0.9]), (1, [expert], [0.9])])
            scheduler.pump()
            link.complete_all()
        if mode == "lazy":
            assert link.submitted == []  # nothing while drafting
        scheduler.flush()
        if mode == "lazy":
            assert submitted_keys(cache, link) == [(0, 0), (1, 0)]
        verify_round(cache, link, scheduler, {0: [0, 2], 1: [0, 2]})
        scheduler.end_round({(0, 0), (0, 2), (1, 0), (1, 2)})
        copies[mode] = (len(link.submitted), cache.stats.misses)
    assert copies == {"aggressive": (4, 0), "lazy": (2, 0)}


def test_auto_measures_each_round_between_begin_and_end(monkeypatch) -> None:
    cache, _ = make_cache(n_slots=4)
    scheduler = PrefetchScheduler(cache, mode="auto")
    clock = iter([10.0, 10.1])
    monkeypatch.setattr("specter.memory.scheduler.time.perf_counter", lambda: next(clock))
    scheduler.begin_round()
    cache.stats.transfer_wait_s += 0.08
    scheduler.end_round(set())
    assert scheduler.wait_share == pytest.approx(0.2 * 0.8)  # one round that waited 80% of its time


def test_an_unknown_mode_is_refused() -> None:
    cache, _ = make_cache(n_slots=4)
    with pytest.raises(ValueError, match="aggressive, conservative, lazy, auto"):
        PrefetchScheduler(cache, mode="eager")


def held_round(hold: bool, mode: str = "aggressive"):
    """Round 1 verifies layer 0's experts 0 and 1 (slots: those two and layer 1's 4 and 5, read
    before them); round 2's draft predicts layer 0's 2 and 3, then 4, then 0 again. The cache, the
    link, and the keys issued while drafting."""
    cache, link = make_cache(n_slots=4, policy=LookaheadPolicy(), layers=(0, 1))
    cache.preload([(1, 4), (1, 5), (0, 0), (0, 1)])
    scheduler = PrefetchScheduler(cache, max_in_flight=8, mode=mode)
    scheduler.begin_round()
    verify_round(cache, link, scheduler, {0: [0, 1]})
    scheduler.end_round({(0, 0), (0, 1)})
    scheduler.begin_round(hold_last_read=hold)
    for experts in ([2, 3], [4], [0]):  # one draft step each
        scheduler.add(0, experts, [0.9] * len(experts))
        scheduler.pump()
        link.complete_all()
    issued_while_drafting = submitted_keys(cache, link)
    scheduler.flush()
    return cache, link, issued_while_drafting


def test_a_draft_holds_what_the_last_round_read_until_the_flush() -> None:
    """Held: step 1's prefetches take the slots the last round did not read; step 2's expert 4
    finds only experts 0 and 1 (read last round) and waits for the flush, which evicts expert 1,
    the one the round does not predict. Not held, step 2 evicts expert 0 (least recently used),
    which step 3 predicts again: copied back, one copy more."""
    cache, link, drafting = held_round(hold=True)
    assert drafting == [(0, 2), (0, 3)]
    assert submitted_keys(cache, link) == [(0, 2), (0, 3), (0, 4)]
    assert all(cache.contains(key) for key in [(0, 0), (0, 2), (0, 3), (0, 4)])

    cache, link, drafting = held_round(hold=False)
    assert drafting == [(0, 2), (0, 3), (0, 4), (0, 0)]
    assert len(link.submitted) == 4


def test_a_conservative_scheduler_holds_nothing_more() -> None:
    """Conservative already protects every prediction of the round; the hold is not added to it:
    the same draft issues the same copies with or without it (expert 0, evicted before step 3
    predicts it, is copied back)."""
    issued = {hold: held_round(hold, mode="conservative")[2] for hold in (False, True)}
    assert issued[True] == issued[False] == [(0, 2), (0, 3), (0, 4), (0, 0)]
