"""LFU: evict the candidate used least often; ties go to the least recently used.

Frequency counts uses (``on_access``), not inserts: a demand-loaded key starts at 1 (its insert
is followed by its use), a prefetched key at 0 until a step uses it, so an unused prefetch is
the first to go among equals. With ``history=False`` (default) a key's count is forgotten when it
is evicted ("in-cache LFU"); with ``history=True`` counts survive evictions, which suits routers
whose expert popularity is stable over a run ("perfect LFU").
"""

from __future__ import annotations

from itertools import count
from typing import Sequence

from specter.policies.base import CachePolicy, ExpertKey, require_candidates


class LFUPolicy(CachePolicy):
    name = "lfu"

    def __init__(self, history: bool = False) -> None:
        self.history = history
        self._clock = count(1)
        self._uses: dict[ExpertKey, int] = {}
        self._last_use: dict[ExpertKey, int] = {}

    def on_insert(self, key: ExpertKey) -> None:
        self._uses.setdefault(key, 0)
        self._last_use[key] = next(self._clock)

    def on_access(self, key: ExpertKey) -> None:
        self._uses[key] = self._uses.get(key, 0) + 1
        self._last_use[key] = next(self._clock)

    def on_evict(self, key: ExpertKey) -> None:
        self._last_use.pop(key, None)
        if not self.history:
            self._uses.pop(key, None)

    def uses(self, key: ExpertKey) -> int:
        return self._uses.get(key, 0)

    def choose_victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        require_candidates(candidates)
        return min(candidates, key=lambda k: (self._uses.get(k, 0), self._last_use.get(k, 0)))
