"""The cache-policy interface: which resident expert to evict.

Contract: an ``ExpertCache`` tells its policy about every key it inserts (``on_insert``), every
use of a key by a running step (``on_access``, after ``on_insert`` for a demand load) and every
eviction (``on_evict``). When it needs room it calls ``choose_victim(candidates)`` with a non-empty
sequence of evictable keys (never pinned ones) and evicts the key returned, which must be one of
them. Before a prefetch evicts, it asks ``admit_prefetch(key, score, victim)``: a policy may refuse
to trade a victim it values for a speculative key (the default admits).

Lookahead hints: ``on_hints(hints)`` receives the scheduler's current lookahead buffer as
``(key, score)`` pairs in the order the keys are expected to be needed (earliest first; a key may
repeat, its first position is its next use), ``score`` being the predictor's confidence in
``[0, 1]``. Each call replaces the previous hints. That is enough for a near-Belady policy: evict
the candidate whose next hinted use is furthest away, or absent. Policies that ignore hints
inherit the no-op.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

ExpertKey = tuple[int, int]
"""(layer, expert): the layer in the model's own numbering, the expert's index in that layer."""

Hint = tuple[ExpertKey, float]


class CachePolicy(ABC):
    name: str = ""

    def on_insert(self, key: ExpertKey) -> None:
        """``key`` now occupies a slot (its copy may still be in flight)."""

    def on_access(self, key: ExpertKey) -> None:
        """A running step uses ``key``."""

    def on_evict(self, key: ExpertKey) -> None:
        """``key`` left the cache."""

    def on_hints(self, hints: Sequence[Hint]) -> None:
        """The current lookahead buffer, earliest need first; replaces earlier hints."""

    def admit_prefetch(self, key: ExpertKey, score: float, victim: ExpertKey) -> bool:
        """Whether a prefetch of ``key`` (predictor score ``score``) may evict ``victim``."""
        return True

    @abstractmethod
    def choose_victim(self, candidates: Sequence[ExpertKey]) -> ExpertKey:
        """One of ``candidates`` (non-empty, all evictable) to evict."""


def require_candidates(candidates: Sequence[ExpertKey]) -> None:
    if not candidates:
        raise ValueError("choose_victim needs at least one candidate")
