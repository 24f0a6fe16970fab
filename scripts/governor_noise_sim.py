"""The roofline governor on a noisy synthetic machine, against the true best fixed k.

Run: python scripts/governor_noise_sim.py [--rounds 60] [--noise 0.12] [--seeds 10] [--k-max 8]
     (pure Python, seconds, seeded)

A bench cell gives the governor 30-60 rounds per repeat on a machine whose round times move by
10% or more from round to round, and judges it against the best of eight fixed-k rows, each
itself a noisy median. This script separates the two: (1) the governor's tokens/s over a short
run on a synthetic machine (draft steps, verification per distinct expert, transfers that grow
once a round's experts exceed the cache, each round's times scaled by lognormal noise) divided
by the *true* rate of the best fixed k, for six machines (best k from 1 to 8) and ``--seeds``
seeds each; (2) how much the best of eight equally fast rows reads above their true rate when
each is the median of two runs with ``--row-noise`` relative noise (what "the best of the others"
means in bench-governor when k hardly matters).
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import statistics

from specter.decode.roofline import RooflineGovernor
from specter.decode.roofline_fit import distinct_experts

MACHINES = [  # (acceptance, transfer s per expert, experts that fit the cache over the 4 layers)
    (0.95, 4e-3, 16), (0.95, 1e-3, 20), (0.9, 2e-3, 16), (0.95, 4e-3, 40), (0.97, 5e-4, 24), (0.93, 3e-3, 12)]


class NoisyMachine:
    """Round time: (k + 1) draft steps + verification (compute per distinct expert, transfers
    partly hidden behind the draft, more transfers for experts beyond the cache) + host."""

    def __init__(self, p: float, io: float, fits: int, noise: float, seed: int) -> None:
        self.p, self.io, self.fits, self.noise = p, io, fits, noise
        self.rng = random.Random(seed)
        self.per_expert, self.draft, self.host = 2e-3, 1.5e-3, 2e-4

    def round(self, k: int, noisy: bool = True) -> tuple[int, dict]:
        accepted = 0
        while accepted < k and self.rng.random() < self.p:
            accepted += 1
        experts = distinct_experts(k + 1, 16, 2) * 4
        verify = experts * (self.per_expert + self.io * (0.3 if k else 1.0))
        verify += max(0.0, experts - self.fits) * self.io * 2
        steps = k + 1 if k else 0
        draft = steps * self.draft
        if noisy:
            verify *= math.exp(self.rng.gauss(0, self.noise))
            draft *= math.exp(self.rng.gauss(0, self.noise / 2))
        timings = {"draft_s": draft, "flush_s": 0.0, "verify_s": verify, "host_s": self.host, "draft_steps": steps}
        timings["round_s"] = draft + verify + self.host
        return accepted, timings

    def true_rate(self, k: int) -> float:
        tokens = 1 + sum(self.p ** i for i in range(1, k + 1))
        return tokens / self.round(k, noisy=False)[1]["round_s"]


def governor_ratio(p: float, io: float, fits: int, noise: float, seed: int, rounds: int, k_max: int = 8) -> float:
    machine = NoisyMachine(p, io, fits, noise, seed)
    governor = RooflineGovernor(k=4, k_max=k_max, cache_slots_per_layer=fits / 4)  # as the engine tells it
    tokens = seconds = 0.0
    for _ in range(rounds):
        k = governor.next_k()
        accepted, timings = machine.round(k)
        governor.observe(drafted=k, accepted=accepted, **timings)
        tokens, seconds = tokens + 1 + accepted, seconds + timings["round_s"]
    return tokens / seconds / max(machine.true_rate(k) for k in range(k_max + 1))


def best_of_equal_rows(row_noise: float, rows: int = 8, runs: int = 2, draws: int = 20000) -> float:
    rng = random.Random(0)
    best = [max(statistics.median(math.exp(rng.gauss(0, row_noise)) for _ in range(runs)) for _ in range(rows))
            for _ in range(draws)]
    return statistics.mean(best)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--noise", type=float, default=0.12, help="lognormal sigma of a round's verify time")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--k-max", type=int, default=8, help="the governor's k_max (the true best is over 0..k_max)")
    parser.add_argument("--row-noise", type=float, default=0.05, help="relative noise of one bench run of a row")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    if args.k_max < 1:
        parser.error("--k-max must be at least 1")
    if args.noise < 0 or args.row_noise < 0:
        parser.error("--noise and --row-noise must be at least 0")
    logging.disable(logging.WARNING)  # the governor's "speculation does not pay" lines
    ratios = []
    for p, io, fits in MACHINES:
        cell = [governor_ratio(p, io, fits, args.noise, seed, args.rounds, args.k_max) for seed in range(args.seeds)]
        best_k = max(range(args.k_max + 1), key=NoisyMachine(p, io, fits, 0.0, 0).true_rate)
        print(f"p={p} io={io * 1e3:.1f} ms/expert fits={fits}: best k {best_k}, roofline / best "
              f"median {statistics.median(cell):.3f}, min {min(cell):.3f}")
        ratios += cell
    print(f"all: roofline / true best over {args.rounds} rounds: median {statistics.median(ratios):.3f}, "
          f"10th percentile {sorted(ratios)[len(ratios) // 10]:.3f}")
    print(f"best of 8 equal rows, each the median of 2 runs with {args.row_noise:.0%} noise: "
          f"{best_of_equal_rows(args.row_noise):.3f}x their true rate on average")


if __name__ == "__main__":
    main()
