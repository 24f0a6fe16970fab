"""``CacheStats``: what an ``ExpertCache`` counted; ``a - b`` and ``a + b`` work counter by counter
(the counts of a stretch of decoding, their sums); ``hit_rate()`` and ``prefetch_precision()`` are
None where there is nothing to divide by.

Counting, per distinct key of each ``acquire``: a *hit* needed no new transfer (the key was READY
or LOADING), a *miss* started a demand load. ``prefetch_used`` counts prefetched keys acquired
before eviction (``prefetch_late`` those still loading then), ``prefetch_wasted`` those evicted
unused. Hence ``hits + misses == acquired_keys``, ``misses == demand_loads`` and
``bytes_transferred == (demand_loads + prefetch_issued) * expert_bytes``; ``reloads`` counts copies
repaired from the store, ``transfer_wait_s`` the seconds spent waiting for transfers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class CacheStats:
    acquired_keys: int = 0
    hits: int = 0
    misses: int = 0
    demand_loads: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_late: int = 0
    prefetch_wasted: int = 0
    evictions: int = 0
    reloads: int = 0
    bytes_transferred: int = 0
    transfer_wait_s: float = 0.0

    def hit_rate(self) -> float | None:
        """Hits over lookups; None where nothing was looked up (a rate of nothing, not 0)."""
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else None

    def prefetch_precision(self) -> float | None:
        """Prefetches used over prefetches issued; None where none was issued."""
        return self.prefetch_used / self.prefetch_issued if self.prefetch_issued else None

    def as_dict(self) -> dict[str, float | None]:
        return asdict(self) | {"hit_rate": self.hit_rate()}

    def __sub__(self, other: CacheStats) -> CacheStats:
        return CacheStats(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(CacheStats)})

    def __add__(self, other: CacheStats) -> CacheStats:
        return CacheStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(CacheStats)})
