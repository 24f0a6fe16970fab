"""Simulates the roofline governor's acceptance estimate against the one it replaced.

Run: python scripts/acceptance_estimate_sim.py [--seeds 20]   (pure Python, a few seconds, seeded)

A draft whose token at position j of a round is accepted with probability q_j (the same q at
every position, or falling with j) runs 300 rounds whose k follows a pattern (mostly k = 2 with
a k = 6 probe every 12 rounds, as a governor that settled on a small k; or always k = 6). After
the first 40 rounds, each round's estimate of the expected accepted tokens at k = 8 (what the
governor compares wide rounds by) is compared with the truth; the table prints its mean
relative error and its 10th/90th percentiles over ``--seeds`` seeds (20). The last lines change q from 0.93
to 0.3 (a prompt the draft does badly on) and back after 100 rounds of k = 4, and print how
many rounds each estimate takes until its expected accepted tokens at k = 4 stay within 0.5
of the truth for 10 rounds (median over the seeds).
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Callable

from specter.decode.acceptance_estimate import AcceptanceEstimate


class PerPositionAverages:
    """The estimate before: a moving average (step 0.1) per position, used once the position has
    20 observations, else one moving average (step 0.1) over all positions."""

    def __init__(self, k_max: int = 8, prior: float = 0.8) -> None:
        self.values: list[float | None] = [None] * (k_max + 1)
        self.counts = [0] * (k_max + 1)
        self.pooled: float | None = None
        self.prior, self.k_max = prior, k_max

    def observe(self, drafted: int, accepted: int) -> None:
        for j in range(1, min(drafted, self.k_max) + 1):
            outcome = 1.0 if j <= accepted else 0.0
            self.counts[j] += 1
            old = self.values[j]
            self.values[j] = outcome if old is None else 0.9 * old + 0.1 * outcome
            self.pooled = outcome if self.pooled is None else 0.9 * self.pooled + 0.1 * outcome
            if not outcome:
                break

    def p(self, j: int) -> float:
        if self.counts[j] >= 20:
            return self.values[j]
        return self.prior if self.pooled is None else self.pooled

    expected_accepted = AcceptanceEstimate.expected_accepted  # the same sum over its own p(j)
    expected_accepted_upto = AcceptanceEstimate.expected_accepted_upto


def truth(q: Callable[[int], float], k: int) -> float:
    total, run = 0.0, 1.0
    for j in range(1, k + 1):
        run *= q(j)
        total += run
    return total


def draw(rng: random.Random, q: Callable[[int], float], k: int) -> int:
    accepted = 0
    while accepted < k and rng.random() < q(accepted + 1):
        accepted += 1
    return accepted


def steady_errors(make, q, pattern, seeds: int = 20) -> list[float]:
    errors = []
    for seed in range(seeds):
        rng, estimate = random.Random(seed), make()
        for round_ in range(300):
            k = pattern(round_)
            estimate.observe(k, draw(rng, q, k))
            if round_ >= 40:
                errors.append((estimate.expected_accepted(8) - truth(q, 8)) / truth(q, 8))
    return errors


def rounds_to_follow(make, before: float, after: float, seeds: int = 20) -> float:
    settle = []
    for seed in range(seeds):
        rng, estimate = random.Random(seed), make()
        misses = []
        for round_ in range(200):
            q = before if round_ < 100 else after
            estimate.observe(4, draw(rng, lambda j: q, 4))
            if round_ >= 100:
                misses.append(abs(estimate.expected_accepted(4) - truth(lambda j: q, 4)) > 0.5)
        settle.append(next((i + 1 for i in range(len(misses)) if not any(misses[i + 1:i + 11])), len(misses)))
    return statistics.median(settle)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="seeds each figure is taken over")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    estimates = {"per-position averages (before)": PerPositionAverages,
                 "shrunk to the pooled (now)": lambda: AcceptanceEstimate(8)}
    patterns = {"mostly k=2": lambda r: 6 if r % 12 == 0 else 2, "always k=6": lambda r: 6}
    drafts = {"q=0.97": lambda j: 0.97, "q=0.93": lambda j: 0.93, "q=0.85": lambda j: 0.85,
              "q_j=0.97-0.03j": lambda j: 0.97 - 0.03 * j}
    print("| estimate | draft | rounds | mean abs error of E[accepted(8)] | p10 | p90 |")
    print("|---|---|---|---|---|---|")
    for name, make in estimates.items():
        for draft, q in drafts.items():
            for pattern_name, pattern in patterns.items():
                errors = sorted(steady_errors(make, q, pattern, args.seeds))
                mean_abs = statistics.mean(abs(e) for e in errors)
                print(f"| {name} | {draft} | {pattern_name} | {mean_abs:.1%} | {errors[len(errors) // 10]:+.1%} "
                      f"| {errors[9 * len(errors) // 10]:+.1%} |")
    for name, make in estimates.items():
        down, up = rounds_to_follow(make, 0.93, 0.3, args.seeds), rounds_to_follow(make, 0.3, 0.93, args.seeds)
        print(f"{name}: follows q 0.93 -> 0.3 in {down:.0f} rounds, 0.3 -> 0.93 in {up:.0f} (median)")


if __name__ == "__main__":
    main()
