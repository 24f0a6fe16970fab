"""The roofline governor's exploration: which k its first rounds visit and which k a probe tries.

Contract (pure functions; ``specter.decode.roofline`` holds the state they read):
- ``calibration_rounds(k0, k_max, widest=False)``: the k of the first rounds (and of those after
  ``link_changed()``): k0, then a plain round twice (the first, right after a drafted round, finds
  the draft's prefetches in the cache; with no plain round measured yet it is measured too, a warm
  and a cold sample), then 1 twice and 2 twice (the first round at a new k is a transition, which
  the verify cost counts at a fraction of a steady round), and with ``widest`` k_max twice.
- ``probe_k(k, turn, rates, frontier, k_max, measured_at, rounds)``: the k to try instead of the
  chosen ``k``. ``turn`` (the probe's count mod 3) 1 and 2: its neighbour above, then below (k = 2
  when speculation is off: two draft positions observed per probe), within ``[0, frontier]``; turn
  0: the k whose width was measured least recently (``measured_at``: width -> the round it was
  last measured; never measured first, the nearest to ``k`` among equals) among those up to
  ``frontier`` predicted (``rates``: predicted tokens/s per k, None where unknown) within
  ``FAR_PROBE_RANGE`` of the best rate (``OFF_PROBE_RANGE`` while speculation is off: a draft that
  got good again must be tried), k = 0 first when the plain round's average is older than
  ``STALE_HALF_LIFE`` rounds at round ``rounds`` (its own average cannot follow the fit through the
  drafted widths). So widths far from the current choice are measured now and then rather than
  extrapolated.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from specter.decode.roofline_cost import STALE_HALF_LIFE

FAR_PROBE_RANGE = 0.8  # far probes only try a k predicted within this fraction of the best rate
OFF_PROBE_RANGE = 0.6  # ... while speculation is off (a draft that got good again must be tried)


def calibration_rounds(k0: int, k_max: int, widest: bool = False) -> list[int]:
    drafted = [c for c in dict.fromkeys((1, min(2, k_max), *((k_max,) if widest else ()))) if c != k0]
    return [k0, *([0, 0] if k0 else [0]), *(c for c in drafted for _ in range(2))]


def probe_k(k: int, turn: int, rates: Sequence[float | None], frontier: int, k_max: int,
            measured_at: Mapping[int, int], rounds: int) -> int:
    if turn == 0:
        best = max((r for r in rates if r is not None), default=None)
        floor = (FAR_PROBE_RANGE if k else OFF_PROBE_RANGE) * best if best is not None else None
        others = [c for c in range(frontier + 1) if c != k and (floor is None or rates[c] is None or rates[c] >= floor)]
        plain_stale = rounds - measured_at.get(1, -math.inf) > STALE_HALF_LIFE
        return min(others, key=lambda c: (not (c == 0 and plain_stale), measured_at.get(c + 1, -math.inf),
                                          abs(c - k))) if others else k
    if k == 0:
        return min(2, k_max)
    return max(0, min(frontier, k + (1 if turn == 1 else -1)))
