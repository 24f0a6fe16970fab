"""``scripts/wave_bookkeeping.py``: what it times is the cache's own calls around a wave, and they
leave the cache as they found it (every slot READY and unpinned), so repeats measure the same work."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from specter.memory.cache import SlotState

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("wave_bookkeeping", ROOT / "scripts" / "wave_bookkeeping.py")
wave_bookkeeping = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wave_bookkeeping)


def test_a_waves_bookkeeping_acquires_hits_and_releases_every_expert() -> None:
    cache = wave_bookkeeping.small_cache()
    for repeat in range(12):
        assert wave_bookkeeping.wave_bookkeeping(cache, repeat) > 0
    assert cache.pinned_keys() == set()
    assert all(cache.state(slot) is SlotState.READY for slot in range(cache.n_slots))
    assert cache.stats.acquired_keys == 24 and cache.stats.hits == 24 and cache.stats.misses == 0
    assert cache.stats.bytes_transferred == 0
