"""The roofline governor's exploration: which k its first rounds visit and which k a probe tries.

Contract (pure functions but ``ProbeSchedule``; ``specter.decode.roofline`` holds the state they read):
- ``calibration_rounds(k0, k_max, widest=False)``: the k of the first rounds (and of those after
  ``link_changed()``): k0, then a plain round twice (the first, right after a drafted round, finds
  the draft's prefetches in the cache; with no plain round measured yet it is measured too, a warm
  and a cold sample), then 1, 2 and with ``widest`` k_max, once each (each a transition, which the
  verify cost counts at a fraction of a steady round; the rounds the governor chooses next measure
  their widths again).
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
- ``ProbeSchedule(every)``: when the governor probes. ``due(now, best)``: whether round ``now``
  probes instead of the chosen ``best`` (None: none yet): after ``every`` rounds, then twice as
  long each time while ``best`` stays the same (at most ``MAX_PROBE_BACKOFF`` x ``every``;
  ``OFF_PROBE_BACKOFF`` x while it is 0, speculation off: one unlucky probe must not leave a good
  draft unused for 8 x), back to ``every`` when it changes (and when it changes to 0, the next
  probe no later than ``every`` rounds on, however far the last interval had put it); ``count``
  probes so far, ``last_best`` the choice it last saw. ``soon(now)``: the next probe two rounds
  on; ``soon(now, later=False)``: no later than that; ``restart(now)``: ``every`` rounds on, as at
  the start.
Why the drafted widths once each: a cold run (the main job: one generation, the calibration
inside its timed decode) spent 0.37 s of 3.0 on the seven rounds 4, 0, 0, 1, 1, 2, 2 (19 tokens;
the bundled model on an emulated 0.15 GB/s link). Fresh engines in one process taking turns, cold
runs, the seven rounds against 4, 0, 0, 1, 2 (2026-12-06): the main job 161.4 -> 165.2 tok/s and
163.4 -> 170.5 (four runs each, two processes); ``bench-bundled``'s cells, eager, three runs each:
25% / 50% on 0.1 GB/s 1.018 / 1.021x, on 1 GB/s 1.032 / 1.044x; ``bench-governor``'s (the widened
model), two each: 25% / 50% on 2 GB/s 1.012 / 1.013x, on 20 GB/s 1.056 / 0.972x. The plain round
stays twice: without its cold sample the main job ran 2-4% faster still, but a plain round after a
drafted one would be its only sample (the warm-plain test's machine: it costs a quarter of a plain
round there).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from specter.decode.roofline_cost import STALE_HALF_LIFE

MAX_PROBE_BACKOFF = 8  # probes grow sparser (x2 each) while the best k stays put, up to 8 x probe_every
OFF_PROBE_BACKOFF = 4  # ... up to 4 x while off: one unlucky probe must not leave a good draft unused for 8 x
FAR_PROBE_RANGE = 0.8  # far probes only try a k predicted within this fraction of the best rate
OFF_PROBE_RANGE = 0.6  # ... while speculation is off (a draft that got good again must be tried)


def calibration_rounds(k0: int, k_max: int, widest: bool = False) -> list[int]:
    drafted = [c for c in dict.fromkeys((1, min(2, k_max), *((k_max,) if widest else ()))) if c != k0]
    return [k0, *([0, 0] if k0 else [0]), *drafted]


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


class ProbeSchedule:
    def __init__(self, every: int) -> None:
        self.every, self.interval, self.next, self.count = every, every, every, 0
        self.last_best: int | None = None

    def due(self, now: int, best: int | None) -> bool:
        if best != self.last_best:  # conditions moved: look around more often again
            self.interval, self.last_best = self.every, best
            if best == 0:  # speculation just went off: the next probe within ``every``, not 8 x away
                self.next = min(self.next, now + self.every)
        if now < self.next:
            return False
        self.next = now + self.interval
        backoff = OFF_PROBE_BACKOFF if best == 0 else MAX_PROBE_BACKOFF
        self.interval = min(self.interval * 2, backoff * self.every)
        self.count += 1
        return True

    def soon(self, now: int, later: bool = True) -> None:
        self.interval, self.next = self.every, (now + 2 if later else min(self.next, now + 2))

    def restart(self, now: int) -> None:
        self.interval, self.next = self.every, now + self.every

