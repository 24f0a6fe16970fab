"""``example-fifo``: evict the expert that entered the cache first.

Option ``skip_hinted`` (default False): prefer victims the scheduler's current lookahead hints do
not name, so a FIFO cache does not throw out what the predictor just said is needed next.
"""

from __future__ import annotations

from itertools import count
from typing import Sequence

from specter.policies.base import CachePolicy, ExpertKey, Hint


class FifoPolicy(CachePolicy):
    name = "example-fifo"

    def __init__(self, skip_hinted: bool = False) -> None:
        if not isinstance(skip_hinted, bool):
            raise ValueError(f"skip_hinted must be true or false, got {skip_hinted!r}")
        self.skip_hinted = skip_hinted
        self._clock = count()
        self._entered: dict[ExpertKey, int] = {}  # key -> when it was inserted
        self._hinted: set[ExpertKey] = set()
        self.inserted = self.evicted = self.victims_chosen = 0  # counters, for tests and curiosity

    def on_insert(self, key: ExpertKey) -> None:
        self._entered[key] = next(self._clock)
        self.inserted += 1

    def on_evict(self, key: ExpertKey) -> None:
        self._entered.pop(key, None)
        self.evicted += 1

    def on_hints(self, hints: Sequence[Hint]) -> None:
        self._hinted = {key for key, _score in hints}

    def choose_victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        self.victims_chosen += 1
        pool = candidates
        if self.skip_hinted:
            pool = [key for key in candidates if key not in self._hinted] or candidates
        return min(pool, key=lambda key: self._entered.get(key, -1))
