"""Lookahead: a near-Belady cache policy driven by the scheduler's lookahead buffer.

Contract: ``on_hints`` receives the keys the coming verification pass is predicted to need, in
the order it will need them (layer order, then confidence). ``choose_victim`` evicts the
candidate whose next predicted use is furthest away: first any key with no predicted use at all
(least recently used among those), then the hinted key needed last. ``admit_prefetch`` refuses a
prefetch that would evict a key needed sooner than the one being fetched. With no hints it is LRU.
"""

from __future__ import annotations

from typing import Sequence

from specter.policies.base import ExpertKey, Hint, require_candidates
from specter.policies.lru import LRUPolicy

NEVER = float("inf")


class LookaheadPolicy(LRUPolicy):
    name = "lookahead"

    def __init__(self) -> None:
        super().__init__()
        self._next_use: dict[ExpertKey, int] = {}

    def on_hints(self, hints: Sequence[Hint]) -> None:
        self._next_use = {}
        for position, (key, _score) in enumerate(hints):
            self._next_use.setdefault(key, position)

    def next_use(self, key: ExpertKey) -> float:
        return self._next_use.get(key, NEVER)

    def choose_victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        require_candidates(candidates)
        return max(candidates, key=lambda k: (self.next_use(k), -self._last_use.get(k, 0)))

    def admit_prefetch(self, key: ExpertKey, score: float, victim: ExpertKey) -> bool:
        return self.next_use(victim) >= self.next_use(key)
