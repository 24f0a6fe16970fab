"""PrefetchScheduler: the three prefetch phases, protection of predicted experts, round statistics.

The cache runs over a manual link whose copies complete only when the test says so, so what is
in flight (and therefore what ``pump`` may issue under ``max_in_flight``) is under the test's
control; the link records the order in which copies were submitted.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from held_link import N_EXPERTS, RecordingLRU, make_cache, submitted_keys, verify_round
from specter.memory.cache import SlotState
from specter.policies import LookaheadPolicy
from specter.policies.base import ExpertKey
from specter.memory.scheduler import PrefetchScheduler

torch.set_num_threads(1)


def test_phase1_cached_predictions_are_protected_counted_and_not_fetched() -> None:
    cache, link = make_cache(n_slots=4)
    cache.preload([(0, 1)])
    scheduler = PrefetchScheduler(cache, max_in_flight=4)
    assert not scheduler.in_round
    scheduler.begin_round()
    assert scheduler.in_round
    scheduler.add(0, [1, 2], [0.9, 0.5])
    assert scheduler.stats.cached_at_prediction == 1
    assert {(0, 1), (0, 2)} <= cache.protected_keys()
    scheduler.add(0, [1], [0.95])  # predicted again by a later draft position: still counted once
    assert scheduler.stats.cached_at_prediction == 1
    scheduler.pump()
    scheduler.flush()
    assert submitted_keys(cache, link) == [(0, 2)]
    assert scheduler.stats.issued_while_drafting == 1 and scheduler.stats.issued_at_flush == 0
    assert cache.stats.prefetch_issued == 1


def test_add_many_predicts_and_protects_what_the_same_adds_one_by_one_would() -> None:
    predictions = [(1, [3, 4], [0.6, 0.9]), (0, [5, 2], [0.2, 0.7]), (0, [5], [0.8])]
    states = []
    for together in (False, True):
        cache, link = make_cache(n_slots=3)
        scheduler = PrefetchScheduler(cache, max_in_flight=2)
        scheduler.begin_round()
        if together:
            scheduler.add_many(predictions)
        else:
            for prediction in predictions:
                scheduler.add(*prediction)
        scheduler.pump()
        states.append((dict(scheduler._predicted), list(scheduler._window), submitted_keys(cache, link)))
    assert states[0] == states[1]
    assert states[1][1] == [(0, 5), (0, 2), (1, 4)]  # need order, the higher confidence of (0, 5) kept


def test_phase2_pump_issues_in_layer_then_confidence_order_within_max_in_flight() -> None:
    cache, link = make_cache(n_slots=8)
    scheduler = PrefetchScheduler(cache, max_in_flight=2)
    scheduler.begin_round()
    scheduler.add(1, [3, 4], [0.6, 0.9])
    scheduler.add(0, [5, 2], [0.2, 0.7])
    scheduler.pump()
    assert submitted_keys(cache, link) == [(0, 2), (0, 5)]
    assert cache.in_flight == 2
    scheduler.pump()  # the link is full: nothing more
    assert len(link.submitted) == 2
    link.transfers[0].complete()
    scheduler.pump()  # one place free: the likelier expert of layer 1
    assert submitted_keys(cache, link, 2) == [(1, 4)]
    # a late prediction for an earlier layer overtakes the still-pending layer-1 expert
    scheduler.add(0, [0], [0.1])
    link.complete_all()
    scheduler.pump()
    assert submitted_keys(cache, link, 3) == [(0, 0), (1, 3)]
    assert scheduler.stats.issued_while_drafting == 5
    assert scheduler.stats.issued_at_flush == 0


def test_phase2_skips_keys_that_became_resident_meanwhile() -> None:
    cache, link = make_cache(n_slots=4)
    scheduler = PrefetchScheduler(cache, max_in_flight=4)
    scheduler.begin_round()
    scheduler.add(0, [3, 4], [0.9, 0.1])
    cache.acquire(0, [3])  # demand-loaded before the scheduler got to it
    cache.release(0, [3])
    scheduler.pump()
    assert submitted_keys(cache, link) == [(0, 3), (0, 4)]  # the demand load, then the one prefetch
    assert cache.stats.prefetch_issued == 1 and scheduler.stats.issued_while_drafting == 1


def test_phase3_flush_issues_every_pending_prediction_ignoring_max_in_flight() -> None:
    cache, link = make_cache(n_slots=8)
    scheduler = PrefetchScheduler(cache, max_in_flight=1)
    scheduler.begin_round()
    scheduler.add(1, [0, 1], [0.5, 0.4])
    scheduler.add(0, [2, 3], [0.3, 0.8])
    scheduler.pump()
    assert submitted_keys(cache, link) == [(0, 3)]
    scheduler.flush()
    assert submitted_keys(cache, link) == [(0, 3), (0, 2), (1, 0), (1, 1)]
    assert cache.in_flight == 4
    assert scheduler.stats.issued_while_drafting == 1 and scheduler.stats.issued_at_flush == 3
    link.complete_all()
    scheduler.pump()
    scheduler.flush()
    assert len(link.submitted) == 4  # nothing left pending, nothing fetched twice
    assert all(cache.is_ready(key) for key in [(0, 2), (0, 3), (1, 0), (1, 1)])


def test_prefetch_never_evicts_a_predicted_key() -> None:
    cache, link = make_cache(n_slots=2)
    cache.preload([(0, 0), (0, 1)])  # (0, 0) is the LRU victim
    scheduler = PrefetchScheduler(cache, max_in_flight=2)
    scheduler.begin_round()
    scheduler.add(0, [0], [0.9])  # cached, so protected
    scheduler.add(1, [3], [0.8])
    scheduler.pump()
    assert submitted_keys(cache, link) == [(1, 3)]
    assert cache.contains((0, 0)) and not cache.contains((0, 1))  # LRU alone would have evicted (0, 0)
    link.complete_all()
    scheduler.add(1, [4], [0.7])  # every resident key is now predicted: no room without evicting one
    scheduler.flush()
    assert cache.resident_keys() == [(0, 0), (1, 3)]
    assert len(link.submitted) == 1
    scheduler.end_round(set())  # never placed: counted once the round is over
    assert scheduler.stats.not_admitted == 1


def test_streaming_a_round_larger_than_the_cache() -> None:
    cache, link = make_cache(n_slots=4, layers=(0, 1, 2))
    scheduler = PrefetchScheduler(cache, max_in_flight=8)
    scheduler.begin_round()
    scheduler.add(0, [0, 1], [0.9, 0.8])
    scheduler.add(1, [2, 3], [0.7, 0.6])
    scheduler.add(2, [4, 5], [0.5, 0.4])
    scheduler.flush()
    assert submitted_keys(cache, link) == [(0, 0), (0, 1), (1, 2), (1, 3)]  # layer 2 waits for room
    link.complete_all()
    copied = []
    for layer, experts in ((0, [0, 1]), (1, [2, 3]), (2, [4, 5])):
        before = len(link.submitted)
        scheduler.advance(layer)  # what the engine does as verification reaches each MoE layer
        copied += submitted_keys(cache, link, before)
        cache.acquire(layer, experts)
        cache.release(layer, experts)
        link.complete_all()
    assert copied == [(2, 4), (2, 5)]  # streamed into layer 0's slots while layer 1 computed
    assert (cache.stats.misses, cache.stats.hits, cache.stats.prefetch_wasted) == (0, 6, 0)
    scheduler.end_round({(0, 0), (0, 1), (1, 2), (1, 3), (2, 4), (2, 5)})
    assert (scheduler.stats.streamed, scheduler.stats.not_admitted) == (2, 0)
    assert cache.protected_keys() == frozenset()


def flushed_two_a_layer_round(n_slots: int):
    """A round predicting experts 2L and 2L + 1 of MoE layers 0, 1, 2, flushed."""
    cache, link = make_cache(n_slots=n_slots, layers=(0, 1, 2))
    scheduler = PrefetchScheduler(cache, max_in_flight=8)
    scheduler.begin_round()
    for layer in (0, 1, 2):
        scheduler.add(layer, [2 * layer, 2 * layer + 1], [0.9, 0.8])
    scheduler.flush()
    return cache, link, scheduler


def test_streaming_keeps_slots_for_the_current_layers_demand_loads() -> None:
    cache, link, scheduler = flushed_two_a_layer_round(n_slots=2)
    verify_round(cache, link, scheduler, {layer: [2 * layer, 2 * layer + 1] for layer in (0, 1, 2)})
    # no slot to spare: layers 1 and 2 load on demand, and no streamed prefetch is evicted unused
    assert (cache.stats.misses, cache.stats.prefetch_wasted, scheduler.stats.streamed) == (4, 0, 0)
    scheduler.end_round(set())
    assert scheduler.stats.not_admitted == 4


def test_a_later_layers_cached_expert_yields_its_slot_to_an_earlier_layers_prediction() -> None:
    """The round needs 6 experts, the cache holds 4, two of them the last layer's from the previous
    round. Protecting those would leave layer 1's experts without a slot until verification got
    there (two demand loads); in need order they are evicted for layer 1's and stream back while
    layer 1 is verified."""
    policy = LookaheadPolicy()
    cache, link = make_cache(n_slots=4, policy=policy, layers=(0, 1, 2))
    cache.preload([(2, 4), (2, 5), (0, 5), (1, 5)])
    scheduler = PrefetchScheduler(cache, max_in_flight=8)
    scheduler.begin_round()
    scheduler.add(2, [4, 5], [0.9, 0.8])  # the draft's first position reaches the last layer first
    scheduler.add(0, [0, 1], [0.9, 0.8])
    scheduler.add(1, [2, 3], [0.7, 0.6])
    assert cache.protected_keys() == frozenset({(0, 0), (0, 1), (1, 2), (1, 3)})
    scheduler.flush()
    assert submitted_keys(cache, link) == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert not cache.contains((2, 4)) and not cache.contains((2, 5))
    before = len(link.submitted)
    verify_round(cache, link, scheduler, {0: [0, 1], 1: [2, 3], 2: [4, 5]})
    assert submitted_keys(cache, link, before) == [(2, 4), (2, 5)]
    assert (cache.stats.misses, cache.stats.hits) == (0, 6)
    scheduler.end_round({(0, 0), (0, 1), (1, 2), (1, 3), (2, 4), (2, 5)})
    assert (scheduler.stats.streamed, scheduler.stats.not_admitted) == (2, 0)


def test_a_window_key_is_never_evicted_by_a_prefetch() -> None:
    cache, link = make_cache(n_slots=3, policy=LookaheadPolicy(), layers=(0, 1, 2))
    cache.preload([(1, 0), (2, 0), (2, 1)])
    scheduler = PrefetchScheduler(cache, max_in_flight=8)
    scheduler.begin_round()
    scheduler.add(0, [3], [0.5])
    scheduler.add(1, [0], [0.5])
    scheduler.add(2, [0, 1], [0.9, 0.8])
    scheduler.flush()  # (0, 3) takes the slot of (2, 1), the key needed last
    assert cache.resident_keys() == [(0, 3), (1, 0), (2, 0)]
    assert cache.protected_keys() == frozenset({(0, 3), (1, 0), (2, 0)})


@settings(max_examples=150, deadline=None)
@given(
    n_slots=st.integers(2, 8),
    cached=st.lists(st.tuples(st.integers(0, 3), st.integers(0, N_EXPERTS - 1)), max_size=8),
    picks=st.lists(st.lists(st.integers(0, N_EXPERTS - 1), min_size=1, max_size=4), min_size=4, max_size=4),
    use_lookahead=st.booleans(),
)
def test_a_round_whose_adjacent_layers_fit_never_loads_on_demand(n_slots, cached, picks, use_lookahead) -> None:
    """Property: when every two consecutive layers' predicted experts fit in the cache together and
    each copy lands before the next draft or verification layer, verification never loads a predicted expert on demand,
    whatever the cache held before and however large the round (streaming)."""
    experts_by_layer = {layer: sorted(set(p))[: n_slots // 2] for layer, p in enumerate(picks)}
    cache, link = make_cache(n_slots, policy=LookaheadPolicy() if use_lookahead else RecordingLRU(),
                             layers=(0, 1, 2, 3))
    cache.preload(list(dict.fromkeys(cached))[-n_slots:])
    scheduler = PrefetchScheduler(cache, max_in_flight=2)
    scheduler.begin_round()
    for layer in reversed(range(4)):  # later layers first: the worst case for protection
        scheduler.add(layer, experts_by_layer[layer], [0.5] * len(experts_by_layer[layer]))
        scheduler.pump()
        link.complete_all()
    scheduler.flush()
    verify_round(cache, link, scheduler, experts_by_layer)
    scheduler.end_round({(layer, e) for layer, experts in experts_by_layer.items() for e in experts})
    assert cache.stats.misses == 0
    assert scheduler.stats.not_admitted == 0


def test_advance_lifts_protection_of_verified_layers_only() -> None:
    cache, _ = make_cache(n_slots=8, layers=(0, 1, 2))
    scheduler = PrefetchScheduler(cache)
    scheduler.begin_round()
    scheduler.add(0, [0], [0.9])
    scheduler.add(2, [1], [0.9])
    scheduler.flush()
    scheduler.advance(1)
    assert cache.protected_keys() == frozenset({(2, 1)})
    scheduler.advance(0)  # verification never goes back
    assert cache.protected_keys() == frozenset({(2, 1)})


def test_end_round_statistics_and_unprotect() -> None:
    cache, _ = make_cache(n_slots=8)
    scheduler = PrefetchScheduler(cache)
    assert scheduler.stats.recall() is None and scheduler.stats.precision() is None
    scheduler.begin_round()
    scheduler.add(0, [0, 1], [0.9, 0.8])
    scheduler.add(1, [2, 3], [0.7, 0.6])
    scheduler.add(1, [2], [0.95])  # repeated: still one distinct prediction
    scheduler.flush()
    assert len(cache.protected_keys()) == 4
    scheduler.end_round({(0, 0), (1, 2), (1, 5)})
    stats = scheduler.stats
    assert (stats.rounds, stats.predicted, stats.used, stats.predicted_and_used) == (1, 4, 3, 2)
    assert stats.precision() == pytest.approx(2 / 4)
    assert stats.recall() == pytest.approx(2 / 3)
    assert cache.protected_keys() == frozenset()
    # between rounds predictions are ignored: nothing protected, nothing fetched
    before = cache.stats.prefetch_issued
    scheduler.add(0, [5], [1.0])
    scheduler.flush()
    assert cache.protected_keys() == frozenset() and cache.stats.prefetch_issued == before
    # a second round accumulates
    scheduler.begin_round()
    scheduler.add(0, [4], [0.5])
    scheduler.end_round({(0, 4)})
    assert (stats.rounds, stats.predicted, stats.used, stats.predicted_and_used) == (2, 5, 4, 3)


def test_policy_receives_hints_in_need_order_with_highest_confidence() -> None:
    policy = RecordingLRU()
    cache, _ = make_cache(n_slots=8, policy=policy)
    scheduler = PrefetchScheduler(cache)
    scheduler.begin_round()
    scheduler.add(1, [2, 5], [0.3, 0.3])
    scheduler.add(0, [4, 1], [0.2, 0.8])
    scheduler.add(1, [2], [0.9])  # the same key again, more confident
    scheduler.flush()
    assert policy.hints == [[((0, 1), 0.8), ((0, 4), 0.2), ((1, 2), 0.9), ((1, 5), 0.3)]]


class ProbingLRU(RecordingLRU):
    """Records the hints it holds whenever the cache asks it to admit a prefetch."""

    def __init__(self) -> None:
        super().__init__()
        self.hints_at_admission: list[list[ExpertKey]] = []

    def admit_prefetch(self, key, score, victim) -> bool:
        self.hints_at_admission.append([k for k, _ in self.hints[-1]] if self.hints else [])
        return True


def test_pump_hands_the_policy_this_rounds_buffer_before_prefetching() -> None:
    """A policy that judges prefetches by their next use must see the current round's predictions
    while the draft runs (phase 2), not the previous round's."""
    policy = ProbingLRU()
    cache, link = make_cache(n_slots=2, policy=policy)
    cache.preload([(0, 0), (0, 1)])
    scheduler = PrefetchScheduler(cache, max_in_flight=2)
    scheduler.begin_round()
    scheduler.add(1, [3], [0.6])
    scheduler.pump()  # must evict, so the policy is asked
    assert policy.hints_at_admission == [[(1, 3)]]
    link.complete_all()
    scheduler.add(0, [5], [0.7])
    scheduler.pump()
    assert policy.hints_at_admission[-1] == [(0, 5), (1, 3)]


def test_begin_round_forgets_the_previous_rounds_pending_predictions() -> None:
    cache, link = make_cache(n_slots=8)
    scheduler = PrefetchScheduler(cache, max_in_flight=1)
    scheduler.begin_round()
    scheduler.add(0, [0, 1, 2], [0.9, 0.8, 0.7])
    scheduler.pump()
    scheduler.end_round(set())
    scheduler.begin_round()
    scheduler.add(1, [0], [0.5])
    link.complete_all()
    scheduler.flush()
    assert submitted_keys(cache, link) == [(0, 0), (1, 0)]
    assert cache.state(cache.slot_of((1, 0))) is SlotState.LOADING


def test_a_layers_early_wave_frees_its_slots_for_the_window_at_once() -> None:
    cache, link, scheduler = flushed_two_a_layer_round(n_slots=4)
    assert submitted_keys(cache, link) == [(0, 0), (0, 1), (1, 2), (1, 3)]
    link.transfers[0].complete()  # (0, 0) has arrived, (0, 1) is still copying
    scheduler.advance(0)
    cache.acquire(0, [0, 1], wait=False)
    assert cache.await_any(0, [0, 1]) == [0]
    cache.release(0, [0])
    before = len(link.submitted)
    scheduler.computed(0, [0])  # verification computed (0, 0) ahead of (0, 1)
    assert submitted_keys(cache, link, before) == [(2, 4)]  # into (0, 0)'s slot, before layer 1 runs
    assert (0, 0) not in cache.protected_keys() and scheduler.stats.streamed == 1
    assert cache.await_any(0, [1]) == [1]  # none ready: the first copy submitted among them is waited for
    cache.release(0, [1])
    scheduler.end_round({(0, 0), (0, 1)})
    assert scheduler.stats.predicted == 6  # an expert computed early is still counted as predicted


def test_computed_is_ignored_outside_a_round_and_for_verified_layers() -> None:
    cache, link = make_cache(n_slots=4, layers=(0, 1, 2))
    scheduler = PrefetchScheduler(cache, max_in_flight=8)
    scheduler.computed(0, [0])  # no round: nothing to stream
    scheduler.begin_round()
    scheduler.add(2, [4], [0.9])
    scheduler.advance(1)  # streams (2, 4)
    before, streamed = len(link.submitted), scheduler.stats.streamed
    scheduler.computed(0, [0])  # a layer already behind the frontier
    assert len(link.submitted) == before and scheduler.stats.streamed == streamed == 1


def test_a_finished_rounds_hints_do_not_steer_evictions_after_it() -> None:
    # the next prompt's prefill demand-loads outside any round; with the finished round's hints
    # still in the lookahead policy it kept (1, 0), needed by no one, and evicted (0, 3), just read
    cache, _ = make_cache(n_slots=2, policy=LookaheadPolicy(), layers=(0, 1, 2))
    cache.preload([(1, 0), (2, 0)])
    scheduler = PrefetchScheduler(cache, max_in_flight=2)
    scheduler.begin_round()
    scheduler.add_many([(1, [0], [0.9]), (2, [0], [0.9])])
    scheduler.flush()
    for layer in (1, 2):
        scheduler.advance(layer)
        cache.acquire(layer, [0])
        cache.release(layer, [0])
    scheduler.end_round({(1, 0), (2, 0)})
    for expert in (3, 4):
        cache.acquire(0, [expert])
        cache.release(0, [expert])
    assert cache.resident_keys() == [(0, 3), (0, 4)]  # least recently used first, as with no hints


def test_the_experts_a_layer_is_routed_to_stay_until_it_has_read_them() -> None:
    # a predictor that prefetches layer 1 from layer 0's routing runs before layer 0 acquires: the
    # prefetch of (1, 2) must evict (0, 1), not (0, 0), which layer 0 is about to read
    cache, link = make_cache(n_slots=2, layers=(0, 1))
    cache.preload([(0, 1), (0, 0)])  # (0, 1) the least recently used
    cache.acquire(0, [1])
    cache.release(0, [1])  # ... now (0, 0) is: LRU alone would evict it
    scheduler = PrefetchScheduler(cache, max_in_flight=2)
    scheduler.begin_round()
    scheduler.advance(0)
    scheduler.reading(0, [0])
    scheduler.add(1, [2], [0.9])
    scheduler.flush()
    assert submitted_keys(cache, link) == [(1, 2)] and cache.contains((0, 0)) and not cache.contains((0, 1))
    scheduler.advance(1)  # past layer 0: its experts no longer held
    assert (0, 0) not in cache.protected_keys()
    scheduler.end_round({(0, 0), (1, 2)})
    assert not cache.protected_keys()
