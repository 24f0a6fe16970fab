"""``CacheStats``: every counter the cache's docstring defines starts at zero; ``hit_rate`` is hits
over lookups and ``prefetch_precision`` used over issued prefetches (0.0 before any); ``as_dict`` is a
snapshot of every counter plus the hit rate, from which the stats can be rebuilt."""

from __future__ import annotations

import dataclasses

import pytest

from specter.memory.stats import CacheStats

COUNTERS = ["acquired_keys", "hits", "misses", "demand_loads", "prefetch_issued", "prefetch_used", "prefetch_late",
            "prefetch_wasted", "evictions", "reloads", "bytes_transferred", "transfer_wait_s"]


def test_new_stats_have_every_documented_counter_at_zero() -> None:
    stats = CacheStats()
    assert [field.name for field in dataclasses.fields(stats)] == COUNTERS
    assert all(getattr(stats, name) == 0 for name in COUNTERS)
    assert isinstance(stats.transfer_wait_s, float)
    assert stats.hit_rate() is None and stats.prefetch_precision() is None  # nothing to divide by


@pytest.mark.parametrize("hits, misses, expected", [(3, 1, 0.75), (0, 5, 0.0), (4, 0, 1.0), (1, 2, 1 / 3)])
def test_hit_rate_is_hits_over_hits_and_misses(hits: int, misses: int, expected: float) -> None:
    assert CacheStats(hits=hits, misses=misses).hit_rate() == pytest.approx(expected, abs=0, rel=1e-12)


@pytest.mark.parametrize("issued, used, expected", [(4, 3, 0.75), (5, 0, 0.0), (2, 2, 1.0)])
def test_prefetch_precision_is_used_over_issued(issued: int, used: int, expected: float) -> None:
    stats = CacheStats(prefetch_issued=issued, prefetch_used=used, prefetch_late=used, prefetch_wasted=issued - used)
    assert stats.prefetch_precision() == pytest.approx(expected, abs=0, rel=1e-12)


def test_the_rates_read_only_their_own_counters() -> None:
    stats = CacheStats(acquired_keys=10, hits=1, misses=3, demand_loads=7, prefetch_issued=8, prefetch_used=2,
                       prefetch_late=5, prefetch_wasted=1)
    assert stats.hit_rate() == 0.25
    assert stats.prefetch_precision() == 0.25


def test_as_dict_is_every_counter_in_order_then_the_hit_rate() -> None:
    stats = CacheStats(acquired_keys=8, hits=6, misses=2, demand_loads=2, prefetch_issued=3, prefetch_used=1,
                       prefetch_late=1, prefetch_wasted=2, evictions=4, reloads=1, bytes_transferred=5000,
                       transfer_wait_s=0.5)
    figures = stats.as_dict()
    assert figures == {"acquired_keys": 8, "hits": 6, "misses": 2, "demand_loads": 2, "prefetch_issued": 3,
                       "prefetch_used": 1, "prefetch_late": 1, "prefetch_wasted": 2, "evictions": 4, "reloads": 1,
                       "bytes_transferred": 5000, "transfer_wait_s": 0.5, "hit_rate": 0.75}
    assert list(figures) == [*COUNTERS, "hit_rate"]
    assert CacheStats(**{name: figures[name] for name in COUNTERS}) == stats


def test_as_dict_is_a_snapshot() -> None:
    stats = CacheStats(hits=1, misses=1)
    figures = stats.as_dict()
    stats.hits += 2
    figures["misses"] = 99
    assert figures["hits"] == 1 and figures["hit_rate"] == 0.5
    assert stats.misses == 1 and stats.as_dict()["hit_rate"] == 0.75


def test_stats_subtract_and_add_counter_by_counter():
    later = CacheStats(hits=7, misses=3, demand_loads=2, prefetch_issued=5)
    earlier = CacheStats(hits=4, misses=1, demand_loads=2, prefetch_issued=1)
    assert later - earlier == CacheStats(hits=3, misses=2, demand_loads=0, prefetch_issued=4)
    assert (later - earlier) + earlier == later
