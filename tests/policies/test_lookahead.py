"""Lookahead: near-Belady eviction from the scheduler's hints, LRU without them."""

from __future__ import annotations

import pytest
import torch

from specter.memory.cache import ExpertCache
from specter.memory.links import LocalLink
from specter.plugins import registry
from specter.policies import LookaheadPolicy, LRUPolicy
from specter.memory.store import ExpertStore

KEYS = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]


def inserted(keys=KEYS) -> LookaheadPolicy:
    policy = LookaheadPolicy()
    for key in keys:
        policy.on_insert(key)
    return policy


def test_unhinted_keys_go_first_least_recently_used_among_them() -> None:
    policy = inserted()
    policy.on_access((0, 0))  # (0, 0) is now the most recent
    policy.on_hints([((0, 1), 0.9), ((1, 0), 0.8)])
    # unhinted: (0, 0), (0, 2), (1, 1); LRU among them: (0, 2)
    assert policy.choose_victim(KEYS) == (0, 2)
    assert policy.choose_victim([(0, 0), (1, 1), (0, 1)]) == (1, 1)
    assert policy.choose_victim([(0, 0), (0, 1)]) == (0, 0)


def test_when_every_candidate_is_hinted_the_furthest_next_use_goes() -> None:
    policy = inserted()
    policy.on_hints([((1, 1), 0.5), ((0, 2), 0.9), ((0, 0), 0.1), ((1, 1), 0.99)])
    # next uses: (1, 1) at 0 (its first position), (0, 2) at 1, (0, 0) at 2
    assert policy.choose_victim([(1, 1), (0, 2), (0, 0)]) == (0, 0)
    assert policy.choose_victim([(1, 1), (0, 2)]) == (0, 2)
    assert policy.next_use((1, 1)) == 0 and policy.next_use((0, 1)) == float("inf")


def test_new_hints_replace_old_ones() -> None:
    policy = inserted()
    policy.on_hints([((0, 0), 1.0), ((0, 1), 1.0)])
    assert policy.choose_victim([(0, 0), (0, 1)]) == (0, 1)
    policy.on_hints([((0, 1), 1.0), ((0, 0), 1.0)])
    assert policy.choose_victim([(0, 0), (0, 1)]) == (0, 0)
    policy.on_hints([])
    assert policy.choose_victim([(0, 0), (0, 1)]) == (0, 0)  # back to LRU: (0, 0) inserted first


def test_admit_prefetch_refuses_to_evict_a_key_needed_sooner() -> None:
    policy = inserted()
    policy.on_hints([((0, 1), 0.9), ((1, 0), 0.8), ((0, 2), 0.7)])
    assert not policy.admit_prefetch((0, 2), 0.7, victim=(0, 1))  # victim needed at 0, key at 2
    assert policy.admit_prefetch((0, 1), 0.9, victim=(0, 2))
    assert policy.admit_prefetch((1, 0), 0.8, victim=(1, 1))  # the victim is not needed at all
    assert policy.admit_prefetch((1, 1), 0.0, victim=(0, 0))  # neither is needed: as LRU, admit


def test_without_hints_every_prefetch_is_admitted_like_lru() -> None:
    policy = inserted()
    assert all(policy.admit_prefetch((2, 0), score, victim) for victim in KEYS for score in (0.0, 1.0))
    policy.on_hints([((0, 0), 1.0)])
    policy.on_hints([])
    assert policy.admit_prefetch((2, 0), 0.5, victim=(0, 0))


@pytest.mark.parametrize("seed", range(5))
def test_without_hints_it_is_lru(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    lookahead, lru = LookaheadPolicy(), LRUPolicy()
    resident: list[tuple[int, int]] = []
    for _ in range(200):
        key = (int(torch.randint(0, 2, (1,), generator=gen)), int(torch.randint(0, 4, (1,), generator=gen)))
        if key in resident:
            for policy in (lookahead, lru):
                policy.on_access(key)
            continue
        if len(resident) == 4:
            victim = lru.choose_victim(resident)
            assert lookahead.choose_victim(resident) == victim
            resident.remove(victim)
            for policy in (lookahead, lru):
                policy.on_evict(victim)
        resident.append(key)
        for policy in (lookahead, lru):
            policy.on_insert(key)


def test_in_a_cache_a_prefetch_keeps_the_key_needed_next() -> None:
    """Through ExpertCache: the policy steers which key a prefetch replaces, and refuses a trade."""
    gen = torch.Generator().manual_seed(0)
    store = ExpertStore({0: {"gate_up_proj": torch.randn(4, 4, 3, generator=gen),
                             "down_proj": torch.randn(4, 3, 2, generator=gen)}})
    policy = LookaheadPolicy()
    cache = ExpertCache(store, 2, torch.device("cpu"), LocalLink(copy_thread=False), policy)
    cache.preload([(0, 0), (0, 1)])  # (0, 0) is the LRU key
    policy.on_hints([((0, 0), 0.9), ((0, 2), 0.8), ((0, 1), 0.1)])
    assert cache.prefetch(0, 2, 0.8)
    assert cache.resident_keys() == [(0, 0), (0, 2)]  # (0, 1) is needed last, LRU would drop (0, 0)
    policy.on_hints([((0, 0), 0.9), ((0, 2), 0.8), ((0, 3), 0.1)])
    assert not cache.prefetch(0, 3, 0.1)  # both residents are needed before (0, 3)
    assert cache.resident_keys() == [(0, 0), (0, 2)]


def test_registered_as_lookahead() -> None:
    assert isinstance(registry().create("cache_policy", "lookahead", {}), LookaheadPolicy)
