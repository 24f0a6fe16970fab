"""``scripts/memory_placement.py``: a buffer counts as persistently slow only when it reads below the
threshold in every repeat, against each repeat's own median (so a slow spell of the machine, which
falls on every buffer, flags none), and its reads measure whole buffers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("memory_placement", ROOT / "scripts" / "memory_placement.py")
memory_placement = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory_placement)


def test_only_a_buffer_slow_in_every_repeat_is_flagged() -> None:
    rates = [[13.0, 12.8, 13.1], [13.2, 13.0, 12.9], [11.0, 10.9, 11.2], [11.0, 13.0, 13.1], [13.1, 12.9, 13.0]]
    assert memory_placement.persistently_slow(rates, 0.9) == [2]


def test_a_slow_spell_falling_on_every_buffer_flags_none() -> None:
    rates = [[13.0, 9.0, 13.1], [13.2, 9.1, 12.9], [12.9, 8.9, 13.0]]
    assert memory_placement.persistently_slow(rates, 0.9) == []


def test_round_robin_reads_every_buffer_once_a_repeat() -> None:
    buffers = [memory_placement.new_buffer(4) for _ in range(3)]
    assert all(b.nbytes == 4 << 20 and float(b[0]) == 1.0 for b in buffers)
    rates = memory_placement.round_robin_rates(buffers, 2)
    assert len(rates) == 3 and all(len(row) == 2 and min(row) > 0 for row in rates)
