"""How likely the draft's next token is accepted, per draft position, estimated online.

Contract: ``observe(drafted, accepted)`` after each round (positions 1..accepted were accepted,
position accepted + 1 rejected, later ones unobserved); ``p(j)`` is the estimated acceptance at
draft position j (1-based); ``expected_accepted(k) = sum_{i<=k} prod_{j<=i} p(j)``.

Each position's estimate is shrunk towards the acceptance pooled over all positions:
``p(j) = (S_j + PRIOR_STRENGTH * q) / (N_j + PRIOR_STRENGTH)``, with ``S_j`` and ``N_j`` the
position's accepted and observed counts decayed by ``POSITION_DECAY`` per observation, and ``q``
the pooled acceptance, a running mean whose step never falls below ``POOLED_EMA``. A position
the draft really finds harder pulls away from ``q`` as its own evidence grows; one with few
observations (deep positions while the governor keeps k small) follows ``q`` instead of its last
few outcomes. A fast pooled average (``FAST_EMA``) watches for a change: once the two are more
than ``SHIFT`` apart at the end of ``SHIFT_ROUNDS`` rounds in a row (a prompt the draft does
badly on, or well again), the slow one restarts from the fast one and the positions' counts are
dropped; the pooled mean then moves by 1/3, 1/4, ... of each new observation, as from a start.
``observe(..., surprised=True)`` (the caller saw the draft defy the estimate: the roofline passes a
probe that kept every draft while speculation was off) restarts it the same way.

Why (``python scripts/acceptance_estimate_sim.py``, 20 seeds): with a moving average per position
alone, the expected accepted tokens at k = 8 were 17% off on average for a draft accepted with
0.93 at every position while k stayed mostly at 2 (10% while k = 6); shrunk to the pooled
acceptance, 7.3% (6.1%). A drop of acceptance from 0.93 to 0.3 is followed in 7 rounds instead
of 24, a rise back in 10 instead of 28, and the error is smaller in every case the script
tries, a draft whose acceptance falls with the position included. Why two rounds in a row (stop
57): every round ends on its rejected position, so the fast average has just taken a 0. With a
restart as soon as the two were apart, a steady draft restarted the estimate 35 times over 20 x
200 rounds of k = 32 at acceptance 0.9 (8 now) and 13 times at k = 4 (1 now); in a governor test
two wide rounds rejected early at acceptance 0.95 restarted it at 0.69, and speculation was
switched off for a draft as good as ever. A real drop keeps the two apart round after round (it
is followed in 7 rounds, 5 before).
"""

from __future__ import annotations

POSITION_DECAY = 0.02  # per observation of a position: its counts' weight halves in ~35 observations
PRIOR_STRENGTH = 20.0  # observations' worth of weight the pooled acceptance has in a position's estimate
POOLED_EMA = 0.02  # the pooled acceptance's least step per observed position (~100 observations)
RESTART_WEIGHT = 2.0  # observations' worth of weight the old value keeps when the estimate restarts
FAST_EMA = 0.1  # the change watcher's step
SHIFT = 0.2  # fast and slow pooled averages this far apart ...
SHIFT_ROUNDS = 2  # ... at the end of this many rounds in a row: the acceptance changed


class AcceptanceEstimate:
    def __init__(self, k_max: int, prior: float = 0.8) -> None:
        self.k_max = k_max
        self.restart(prior)

    def restart(self, value: float) -> None:
        """Forget the evidence: the pooled acceptance starts from ``value`` with the weight of
        ``RESTART_WEIGHT`` observations (so the next ones move it by 1/3, 1/4, ...) and every
        position follows it until it has its own observations again."""
        self.pooled = self.fast = value
        self.count = RESTART_WEIGHT
        self.accepted = [0.0] * (self.k_max + 1)  # index j: position j (1-based), decayed counts
        self.seen = [0.0] * (self.k_max + 1)
        self.shifted_rounds = 0  # rounds in a row that ended with the fast and slow averages SHIFT apart

    def p(self, j: int) -> float:
        return (self.accepted[j] + PRIOR_STRENGTH * self.pooled) / (self.seen[j] + PRIOR_STRENGTH)

    def expected_accepted(self, k: int) -> float:
        return self.expected_accepted_upto(k)[k]

    def expected_accepted_upto(self, k: int) -> list[float]:
        """``expected_accepted(i)`` for i = 0..k, in one pass (a governor's table asks for each)."""
        totals, total, run = [0.0], 0.0, 1.0
        for j in range(1, k + 1):
            run *= self.p(j)
            total += run
            totals.append(total)
        return totals

    def observe(self, drafted: int, accepted: int, surprised: bool = False) -> None:
        """One round: positions 1..accepted accepted, accepted + 1 rejected. ``surprised``: the
        caller saw the draft defy the estimate, which then restarts from its current value."""
        if surprised and drafted:
            self.restart(self.pooled)
        for j in range(1, min(drafted, self.k_max) + 1):
            outcome = 1.0 if j <= accepted else 0.0
            self._observe_position(j, outcome)
            if not outcome:
                break
        if drafted:
            shifted = self.count * FAST_EMA >= 1 and abs(self.fast - self.pooled) > SHIFT  # the pooled mean is the slower one
            self.shifted_rounds = self.shifted_rounds + 1 if shifted else 0
            if self.shifted_rounds >= SHIFT_ROUNDS:
                self.restart(self.fast)

    def _observe_position(self, j: int, outcome: float) -> None:
        self.accepted[j] = self.accepted[j] * (1 - POSITION_DECAY) + outcome
        self.seen[j] = self.seen[j] * (1 - POSITION_DECAY) + 1
        self.count += 1
        self.pooled += max(1 / self.count, POOLED_EMA) * (outcome - self.pooled)
        self.fast += FAST_EMA * (outcome - self.fast)
