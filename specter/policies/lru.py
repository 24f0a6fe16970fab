"""LRU: evict the candidate whose last insert or use is oldest.

An insert counts as a use, so a freshly prefetched key is the most recent. Keys the policy has
never seen (possible only if a caller bypasses the cache) are treated as the oldest.
"""

from __future__ import annotations

from itertools import count
from typing import Sequence

from specter.policies.base import CachePolicy, ExpertKey, require_candidates


class LRUPolicy(CachePolicy):
    name = "lru"

    def __init__(self) -> None:
        self._clock = count(1)
        self._last_use: dict[ExpertKey, int] = {}

    def on_insert(self, key: ExpertKey) -> None:
        self._last_use[key] = next(self._clock)

    def on_access(self, key: ExpertKey) -> None:
        self._last_use[key] = next(self._clock)

    def on_evict(self, key: ExpertKey) -> None:
        self._last_use.pop(key, None)

    def choose_victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        require_candidates(candidates)
        return min(candidates, key=lambda k: self._last_use.get(k, 0))
