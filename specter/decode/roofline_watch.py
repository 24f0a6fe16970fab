"""How the ``roofline`` governor (``specter.decode.roofline``) reads a chosen round's measured time
against its prediction: noise, a surprise worth looking around for, a lone round far off (held
back), or a change of conditions.

Contract: ``RoundWatch.judge(measured, predicted, transition, known)`` takes a chosen round (not a
probe, a compiled path's trial or a round cut short; for those the governor calls ``drop_held()``)
and returns
- ``NOISE``: a transition (the first round at a new k pays for the cache contents the old k left,
  a cost the next round at that k does not have: on the 2 GB/s link at 50% such rounds ran up to
  2x their prediction and, taken for a change of conditions, sent the governor to calibrate
  again), or a miss no larger than ``SPREAD_MULT`` times
  the typical one (a moving average of ``|log(measured / predicted)|``: where rounds scatter, as
  on a slow link, a round as far off as they usually are is not news), or less than
  ``TIME_SURPRISE`` off;
- ``LOOK``: more than ``TIME_SURPRISE`` off (the governor looks around soon);
- ``HOLD``: more than ``CHANGE_FACTOR`` off (``changed``) a prediction that stands on the width's
  own recent steady rounds (``known``; far off an extrapolation says the fit was wrong, not that
  the machine changed), with no round held: the governor learns nothing from this round yet (its
  samples wait in ``held``), and the typical miss does not move;
- ``CHANGE``: such a round right after a held one, off the same way: conditions changed; the
  governor learns the held round's samples (``take_held()``) and then this one's.
A held round that the next round does not confirm is dropped, unlearnt.
``prediction_by_k(history)``: for the report, per k the chosen rounds' median predicted and
measured seconds and the relative error between them (probes, trials and cut rounds left out).
Why: on this VM a round now and then takes several times its usual time for reasons of its own
(widened model, 50% of the experts, emulated 20 GB/s: a k = 5 round took 140 ms against 46
predicted, its five draft steps 75 ms, 5x the rounds around it, which ran as predicted); taken as
a change of conditions, it made every width's estimate restart from the rounds after it, and the
governor went through k = 0 and k = 12-14 for the next twenty rounds before it settled.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from specter.decode.roofline_fit import Ema

TIME_SURPRISE = 0.35  # a round this far (relative) from its predicted time makes the governor look around
CHANGE_FACTOR = 2.0  # a time off by this factor (either way) means conditions changed, not noise
SPREAD_MULT = 3.0  # a round no further off than this many times the typical miss is noise

NOISE, LOOK, HOLD, CHANGE = "noise", "look", "hold", "change"


def changed(sample: float, reference: float) -> bool:
    """Whether ``sample`` is more than ``CHANGE_FACTOR`` times off ``reference``, either way."""
    return sample > CHANGE_FACTOR * reference or sample * CHANGE_FACTOR < reference


class RoundWatch:
    def __init__(self, ema: float) -> None:
        self.spread = Ema(ema)  # the typical |log(measured / predicted)| of a chosen round
        self.held: Any = None  # a lone round's samples, learnt only once the next round confirms it
        self._held_slow = False  # whether the held round ran slower than predicted
        self.holds = 0  # rounds held back so far
        self.dropped = 0  # ... of which the next round did not confirm

    def judge(self, measured: float, predicted: float, transition: bool, known: bool) -> str:
        miss = abs(math.log(measured / predicted))
        typical = self.spread.value
        unusual = typical is None or miss > SPREAD_MULT * typical
        far = not transition and known and unusual and changed(measured, predicted)
        slow = measured > predicted
        if far and self.held is not None and slow == self._held_slow:
            self.spread.update(miss)
            return CHANGE
        self.drop_held()
        if far:
            self._held_slow = slow
            self.holds += 1
            return HOLD
        self.spread.update(miss)
        if transition or not unusual:
            return NOISE
        return LOOK if abs(measured - predicted) > TIME_SURPRISE * predicted else NOISE

    def hold(self, samples: Any) -> None:
        self.held = samples

    def take_held(self) -> Any:
        held, self.held = self.held, None
        return held

    def drop_held(self) -> None:
        if self.held is not None:
            self.held = None
            self.dropped += 1


def prediction_by_k(history: list[dict]) -> dict[str, dict]:
    """Per k (a string key) of the governor's history entries (``k``, ``probe``, ``cut``,
    ``trial``, ``predicted_round_s``, ``measured_round_s``): rounds, median predicted and
    measured seconds, ``error = |predicted - measured| / measured`` of those medians, and
    ``total_error``, the same of the sums: the governor predicts a round's expected time, and
    where transfer waits make rounds' times skewed (many rounds wait nothing, a few wait long)
    the medians part even when the expectation holds."""
    per_k = {}
    for k in sorted({h["k"] for h in history}):
        pairs = [(h["predicted_round_s"], h["measured_round_s"]) for h in history
                 if h["k"] == k and h["predicted_round_s"] and h["measured_round_s"]
                 and not h["probe"] and not h["cut"] and not h["trial"]]
        if pairs:
            predicted = statistics.median(p for p, _ in pairs)
            measured = statistics.median(m for _, m in pairs)
            predicted_total, measured_total = sum(p for p, _ in pairs), sum(m for _, m in pairs)
            per_k[str(k)] = {"rounds": len(pairs), "predicted_s": predicted, "measured_s": measured,
                             "error": abs(predicted - measured) / measured,
                             "total_error": abs(predicted_total - measured_total) / measured_total}
    return per_k
