"""``scripts/cache_replay.py``'s eviction rules on request sequences whose copy counts are known
by hand: least recently used, the round's own requests known, the whole future known (MIN)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import specter

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cache_replay.py"
spec = importlib.util.spec_from_file_location("cache_replay", SCRIPT)
cache_replay = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cache_replay)

A, B, C = (0, 0), (0, 1), (0, 2)


def test_a_cycle_one_longer_than_the_pool_misses_every_time_under_lru_but_not_under_min() -> None:
    requests = [{A}, {B}, {C}, {A}, {B}, {C}]
    assert cache_replay.replay(requests, 2, [], "lru", layers=1) == 6
    assert cache_replay.replay(requests, 2, [], "min", layers=1) == 4  # c evicts b (a is needed first), b evicts a
    # one request a round: nothing of the round is ahead, so the round rule is LRU
    assert cache_replay.replay(requests, 2, [], "round", layers=1) == 6


def test_the_round_rule_sees_only_its_own_round() -> None:
    # rounds of three groups: in the second round a evicts c (needed last in the round), not b
    requests = [{A}, {B}, {C}, {A}, {B}, {C}]
    assert cache_replay.replay(requests, 2, [], "round", layers=3) == 5


def test_a_layers_experts_are_needed_together_and_never_evict_each_other() -> None:
    # c is the least recently used, but b's copy may not evict it: c is needed with b
    assert cache_replay.replay([{B, C}], 2, [C, A], "lru", layers=1) == 1
    assert cache_replay.replay([{A, B}, {C}, {A, B}], 2, [], "min", layers=1) == 4  # c evicts one; it comes back


def test_rounds_join_the_experts_each_layer_needs_across_their_tokens() -> None:
    decode = [[torch.tensor([[1, 2]]), torch.tensor([[0, 3]])], [torch.tensor([[2, 5]]), torch.tensor([[3, 4]])]]
    assert cache_replay.rounds(decode, 2) == [{(0, 1), (0, 2), (0, 5)}, {(1, 0), (1, 3), (1, 4)}]
    assert cache_replay.rounds(decode, 1) == [{(0, 1), (0, 2)}, {(1, 0), (1, 3)}, {(0, 2), (0, 5)}, {(1, 3), (1, 4)}]


def test_the_pool_starts_with_the_prefills_last_experts() -> None:
    prefill = [torch.tensor([[0, 1], [2, 1]]), torch.tensor([[3, 0]])]
    assert cache_replay.warm(prefill, 3) == [(0, 1), (1, 3), (1, 0)]


@pytest.mark.parametrize("budget", (0.25, 0.5))
def test_the_rules_replay_the_rounds_a_speculative_engine_verified(tiny_mixtral, budget) -> None:
    recipe = {"model": str(tiny_mixtral), "engine": "specter", "threads": 1, "max_new_tokens": 12,
              "prompts": ["The cache holds", "Experts stream in"], "check_lossless": False,
              "offload": {"expert_budget": budget, "link": {"kind": "local"}},
              "speculation": {"governor": {"name": "fixed", "k": 3, "options": {}}}}
    with specter.load(recipe) as engine:
        per_prompt, copies, tokens = cache_replay.record_verified_rounds(engine)
        assert engine.scheduler.begin_round.__self__ is engine.scheduler  # the hooks are removed again
        capacity, layers = engine.cache.capacity, len(engine.cache.store.layers)
    assert len(per_prompt) == 2 and tokens == 2 * 11
    for requests, initial in per_prompt:
        assert requests and len(requests) % layers == 0  # a set per MoE layer per round
        assert [next(iter(group))[0] for group in requests[:layers]] == sorted(engine.cache.store.layers)
        assert 0 < len(initial) <= capacity
    floor = sum(cache_replay.replay(r, capacity, i, "min", layers) for r, i in per_prompt)
    assert 0 < floor <= copies  # no schedule copies fewer than MIN for the requests it served


def test_a_pool_of_no_slots_starts_empty() -> None:
    prefill = [torch.tensor([[0, 1], [2, 1]]), torch.tensor([[3, 0]])]
    assert cache_replay.warm(prefill, 0) == []  # not the whole prefill ([-0:] is everything)
    assert cache_replay.warm(prefill, 10) == [(0, 0), (0, 2), (0, 1), (1, 3), (1, 0)]


def test_a_layer_needing_more_experts_than_the_pool_is_refused_with_a_reason() -> None:
    # the engine streams such a layer in waves; the rules here cannot replay it (was an IndexError)
    with pytest.raises(ValueError, match="needs 3 experts at once, more than the 2 slots"):
        cache_replay.replay([{A, B, C}], 2, [], "lru", layers=1)
