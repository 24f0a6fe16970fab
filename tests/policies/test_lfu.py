"""LFU evicts the least used candidate, breaking ties by least recent use."""

from __future__ import annotations

from specter.policies import LFUPolicy


def loaded(policy: LFUPolicy, uses: dict[tuple[int, int], int]) -> LFUPolicy:
    for key, n in uses.items():
        policy.on_insert(key)
        for _ in range(n):
            policy.on_access(key)
    return policy


def test_evicts_least_frequently_used() -> None:
    policy = loaded(LFUPolicy(), {(0, 0): 3, (0, 1): 1, (0, 2): 2})
    assert policy.choose_victim([(0, 0), (0, 1), (0, 2)]) == (0, 1)


def test_ties_go_to_least_recently_used() -> None:
    policy = loaded(LFUPolicy(), {(0, 0): 2, (0, 1): 2, (0, 2): 2})
    policy.on_access((0, 0))
    policy.on_access((0, 1))
    policy.on_access((0, 2))
    policy.on_access((0, 0))
    policy.on_access((0, 1))
    policy.on_access((0, 2))
    policy.on_access((0, 1))
    policy.on_access((0, 0))
    # counts: (0,0)=5, (0,1)=5, (0,2)=4 -> (0,2); among (0,0) and (0,1), (0,1) is older
    assert policy.choose_victim([(0, 0), (0, 1), (0, 2)]) == (0, 2)
    assert policy.choose_victim([(0, 0), (0, 1)]) == (0, 1)


def test_unused_prefetch_goes_first() -> None:
    policy = loaded(LFUPolicy(), {(0, 0): 1})
    policy.on_insert((0, 1))
    assert policy.choose_victim([(0, 0), (0, 1)]) == (0, 1)


def test_counts_forgotten_on_evict_unless_history() -> None:
    for history, expected in [(False, 0), (True, 4)]:
        policy = loaded(LFUPolicy(history=history), {(0, 0): 4})
        policy.on_evict((0, 0))
        policy.on_insert((0, 0))
        assert policy.uses((0, 0)) == expected
