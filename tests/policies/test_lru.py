"""LRU evicts the key least recently inserted or used among the candidates."""

from __future__ import annotations

import pytest

from specter.policies import LRUPolicy, register_cache_policies


def test_evicts_least_recently_used() -> None:
    policy = LRUPolicy()
    for key in [(0, 0), (0, 1), (0, 2)]:
        policy.on_insert(key)
    policy.on_access((0, 0))
    assert policy.choose_victim([(0, 0), (0, 1), (0, 2)]) == (0, 1)


def test_only_candidates_are_chosen() -> None:
    policy = LRUPolicy()
    for key in [(0, 0), (0, 1), (1, 0)]:
        policy.on_insert(key)
    assert policy.choose_victim([(0, 1), (1, 0)]) == (0, 1)


def test_insert_counts_as_recent_and_evict_forgets() -> None:
    policy = LRUPolicy()
    policy.on_insert((0, 0))
    policy.on_insert((0, 1))
    policy.on_evict((0, 0))
    policy.on_insert((0, 2))
    assert policy.choose_victim([(0, 1), (0, 2)]) == (0, 1)
    assert policy.choose_victim([(0, 0), (0, 2)]) == (0, 0)


def test_hints_are_ignored_and_prefetches_admitted() -> None:
    policy = LRUPolicy()
    policy.on_insert((0, 0))
    policy.on_insert((0, 1))
    policy.on_hints([((0, 0), 1.0)])
    assert policy.choose_victim([(0, 0), (0, 1)]) == (0, 0)
    assert policy.admit_prefetch((0, 2), 0.0, (0, 0))


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(ValueError):
        LRUPolicy().choose_victim([])


def test_builtin_policies_register_through_the_hook() -> None:
    registered: dict[str, object] = {}
    register_cache_policies(lambda name, factory: registered.setdefault(name, factory))
    assert registered["lru"] is LRUPolicy
    assert set(registered) == {"lru", "lfu", "lookahead"}
