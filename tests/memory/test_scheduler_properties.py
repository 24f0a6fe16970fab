"""Properties of PrefetchScheduler over one or two random rounds (predictions of random experts of four
MoE layers, added in random order between pumps, then verification layer by layer; copies landing between
steps or not), on the ``held_link`` cache:

- the cache's protected set is exactly the window: the first ``capacity`` predictions ahead of the
  frontier, in need order (never more than ``capacity`` keys, so demand loads always find room);
- a prefetch never evicts a protected or pinned key;
- in a held round (``begin_round(hold_last_read=True)``) the previous round's reads are protected
  as well until ``flush``, which leaves exactly the window protected;
- streaming (``advance(layer)``) issues only keys of layers after ``layer``: a key of the current
  layer is too late and loads on demand;
- streaming leaves the current layer's own demand loads their slots: once it has issued anything,
  at least as many slots are spare as the layer has predictions missing (``not_admitted``).
"""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, given, settings

from held_link import N_EXPERTS, RecordingLRU, make_cache, submitted_keys, spare_by_count
from specter.memory.cache import ExpertCache
from specter.memory.scheduler import PrefetchScheduler
from specter.policies import LookaheadPolicy

torch.set_num_threads(1)

LAYERS = (0, 1, 2, 3)



def window(scheduler: PrefetchScheduler, predicted: dict, frontier: int, done: set) -> frozenset:
    ahead = [k for k in sorted(predicted, key=lambda k: (k[0], -predicted[k], k[1]))
             if k[0] >= frontier and k not in done]
    return frozenset(ahead[: scheduler.cache.capacity])


class Watch:
    """Runs one scheduler call and checks that no prefetch it made evicted a protected or pinned key."""

    def __init__(self, cache: ExpertCache) -> None:
        self.cache = cache

    def __call__(self, call, *args):
        cache = self.cache
        before = set(cache.resident_keys())
        pinned = cache.pinned_keys()
        call(*args)
        protected = cache.protected_keys()  # the set the call's prefetches worked under
        for evicted in before - set(cache.resident_keys()):
            assert evicted not in protected and evicted not in pinned, f"a prefetch evicted {evicted}"


confidences = st.floats(0.05, 1.0)
layer_predictions = st.lists(st.tuples(st.integers(0, N_EXPERTS - 1), confidences), min_size=1, max_size=4)


round_strategy = st.fixed_dictionaries({
    "predictions": st.lists(st.tuples(st.sampled_from(LAYERS), layer_predictions), min_size=1, max_size=8),
    "land": st.lists(st.booleans(), min_size=8, max_size=8),
    "used": st.lists(st.lists(st.integers(0, N_EXPERTS - 1), min_size=1, max_size=3), min_size=4, max_size=4),
    "hold": st.booleans(),
    "land_verify": st.lists(st.booleans(), min_size=4, max_size=4),  # copies land before the next layer
})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_slots=st.integers(1, 6),
    preloaded=st.lists(st.tuples(st.sampled_from(LAYERS), st.integers(0, N_EXPERTS - 1)), max_size=6),
    rounds=st.lists(round_strategy, min_size=1, max_size=2),
    lookahead=st.booleans(),
)
def test_random_rounds_keep_the_window_protected_and_stream_only_later_layers(
        n_slots, preloaded, rounds, lookahead) -> None:
    cache, link = make_cache(n_slots, policy=LookaheadPolicy() if lookahead else RecordingLRU(), layers=LAYERS)
    cache.preload(list(dict.fromkeys(preloaded))[-n_slots:])
    scheduler = PrefetchScheduler(cache, max_in_flight=2)
    watch = Watch(cache)
    last_read: frozenset = frozenset()
    for r in rounds:
        run_round(cache, link, scheduler, watch, r, last_read if r["hold"] else frozenset())
        last_read = frozenset((layer, e) for layer in LAYERS for e in r["used"][layer][: n_slots])


def run_round(cache, link, scheduler, watch, r, held) -> None:
    n_slots = cache.n_slots
    predicted: dict = {}
    scheduler.begin_round(hold_last_read=r["hold"])
    for i, (layer, pairs) in enumerate(r["predictions"]):
        experts, scores = [e for e, _ in pairs], [c for _, c in pairs]
        scheduler.add(layer, experts, scores)
        for e, c in pairs:
            predicted[(layer, e)] = max(c, predicted.get((layer, e), 0.0))
        # while drafting a held round, the previous round's reads are protected too
        assert cache.protected_keys() == window(scheduler, predicted, -1, set()) | held
        watch(scheduler.pump)
        if r["land"][i]:
            link.complete_all()
    watch(scheduler.flush)
    assert cache.protected_keys() == window(scheduler, predicted, -1, set()), "flush left the wrong keys protected"
    for layer in LAYERS:
        start, streamed, late = len(link.submitted), scheduler.stats.streamed, scheduler.stats.not_admitted
        watch(scheduler.advance, layer)
        assert cache.protected_keys() == window(scheduler, predicted, layer, set())
        issued = submitted_keys(cache, link, start)
        assert all(k[0] > layer for k in issued), f"advance({layer}) issued {issued}"
        missing_now = scheduler.stats.not_admitted - late
        if scheduler.stats.streamed > streamed:
            assert spare_by_count(cache) >= missing_now, \
                f"streaming left {spare_by_count(cache)} spare slots for {missing_now} demand loads of layer {layer}"
        experts = r["used"][layer][: n_slots]
        slots = cache.acquire(layer, experts)
        assert [cache.key_in(s) for s in slots] == [(layer, e) for e in experts]
        cache.release(layer, experts)
        if r["land_verify"][layer]:
            link.complete_all()
    scheduler.end_round({(layer, e) for layer in LAYERS for e in r["used"][layer][: n_slots]})
    assert cache.protected_keys() == frozenset()
