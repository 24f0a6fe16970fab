"""Synthetic machines for the roofline governor's tests: round time and acceptance are known, so
the best k is known too: round(k) = host + (k+1) * draft + verify(k+1), verify(T) = per_expert *
distinct(T) + io(T), and each draft position is accepted with probability p (seeded, so runs
are reproducible). ``drive`` runs a governor on one, ``fixed_rate`` a fixed k."""

from __future__ import annotations

import math
import random

from specter.decode.roofline import RooflineGovernor
from specter.decode.roofline_fit import distinct_experts


class Machine:
    def __init__(self, p: float, io_per_expert: float, per_expert: float = 1e-3, draft: float = 2e-3, host=2e-4):
        self.p, self.io, self.per_expert, self.draft, self.host = p, io_per_expert, per_expert, draft, host
        self.rng = random.Random(0)

    def round(self, k: int) -> tuple[int, dict]:
        accepted = 0
        while accepted < k and self.rng.random() < self.p:
            accepted += 1
        experts = distinct_experts(k + 1, 16, 2) * 4
        verify = experts * (self.per_expert + self.io * (0.3 if k else 1.0))  # drafting hides some I/O
        steps = k + 1 if k else 0
        timings = {"draft_s": steps * self.draft, "flush_s": 0.0, "verify_s": verify, "host_s": self.host,
                   "draft_steps": steps}
        timings["round_s"] = sum(timings[n] for n in ("draft_s", "verify_s", "host_s"))
        return accepted, timings

    def best_k(self, k_max: int = 8) -> int:
        def rate(k):
            expected = sum(self.p ** i for i in range(1, k + 1))
            return (1 + expected) / self.round(k)[1]["round_s"]
        return max(range(k_max + 1), key=rate)


def drive(governor: RooflineGovernor, machine: Machine, rounds: int, log: list | None = None) -> list[int]:
    chosen = []
    for _ in range(rounds):
        k = governor.next_k()
        accepted, timings = machine.round(k)
        governor.observe(drafted=k, accepted=accepted, **timings)
        chosen.append(k)
        if log is not None:
            log.append((1 + accepted, timings["round_s"]))
    return chosen


def fixed_rate(machine: Machine, k: int, rounds: int = 200) -> float:
    tokens = seconds = 0.0
    for _ in range(rounds):
        accepted, timings = machine.round(k)
        tokens, seconds = tokens + 1 + accepted, seconds + timings["round_s"]
    return tokens / seconds


def settled(chosen: list[int]) -> int:
    tail = chosen[-24:]
    return max(set(tail), key=tail.count)


class WaitingMachine(Machine):
    """``Machine`` on a link-bound setting: each round also waits for its tokens' transfers,
    ``wait_per_token`` a verified token on average, scattered as a slow link's waits are (an
    exponential draw per round, whose spread equals its mean); the engine reports the wait
    (``verify_io_wait_s``) inside ``verify_s``."""

    def __init__(self, *args, wait_per_token: float, seed: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.wait_per_token = wait_per_token
        self.waits = random.Random(1)
        if seed is not None:  # acceptance draws from seed, wait draws from seed + 1000
            self.rng, self.waits = random.Random(seed), random.Random(seed + 1000)

    def mean_verify_s(self, width: int) -> float:
        return distinct_experts(width, 16, 2) * 4 * (self.per_expert + self.io * 0.3) + self.mean_wait_per_token(width) * width

    def mean_wait_per_token(self, tokens: int) -> float:
        return self.wait_per_token

    def round(self, k: int) -> tuple[int, dict]:
        accepted, timings = super().round(k)
        tokens = k + 1 if k else 3  # nothing drafted hides a plain round's transfers
        wait = self.waits.expovariate(1.0) * self.mean_wait_per_token(tokens) * tokens
        timings.update(verify_s=timings["verify_s"] + wait, verify_io_wait_s=wait,
                       round_s=timings["round_s"] + wait)
        return accepted, timings


class SharedStreamMachine(WaitingMachine):
    """``WaitingMachine`` where every round streams its experts through a small cache over a slow
    link (the widened model at 25% on 2 GB/s): the mean wait per token falls with the width, from
    ``first_wait`` by ``wait_fall`` a token, as the tokens of a wide round share the experts they
    stream (measured there: 20-22 ms a verified token for k = 1..8, 17 at k = 12, 15 at k = 16)."""

    def __init__(self, *args, first_wait: float = 22e-3, wait_fall: float = 0.4e-3, seed: int = 0, **kwargs) -> None:
        super().__init__(*args, wait_per_token=first_wait, seed=seed, **kwargs)
        self.first_wait, self.wait_fall = first_wait, wait_fall

    def mean_wait_per_token(self, tokens: int) -> float:
        return max(0.0, self.first_wait - self.wait_fall * tokens)


class ExpertStreamMachine(WaitingMachine):
    """``WaitingMachine`` whose rounds wait for the distinct experts their tokens read, each
    ``stream_s`` on the link (every one past a small cache streams): a round's mean wait is
    ``stream_s`` x 4 layers x ``distinct(T)``, so the wait per token keeps falling with the width as
    the tokens share experts (the widened model at 25% on 2 GB/s: verification 18-21 ms a distinct
    expert of a layer for k = 4, 8, 16 and 32, against 24.6 down to 10.4 ms a verified token)."""

    def __init__(self, *args, stream_s: float, seed: int = 0, **kwargs) -> None:
        super().__init__(*args, wait_per_token=0.0, seed=seed, **kwargs)
        self.stream_s = stream_s

    def mean_wait_per_token(self, tokens: int) -> float:
        return self.stream_s * 4 * distinct_experts(tokens, 16, 2) / tokens


def drive_prompts(governor, machine: Machine, prompts: int, new_tokens: int, log: list | None = None) -> None:
    """Generations of ``new_tokens`` tokens each, as the engine runs them: a round drafts at most
    the tokens left less one (the round's own), and one cut that way is reported ``cut_short``;
    ``governor`` may be a fixed k (an int)."""
    for _ in range(prompts):
        if not isinstance(governor, int):
            governor.start_prompt()
        left = new_tokens
        while left > 0:
            chosen = governor if isinstance(governor, int) else governor.next_k()
            k = min(chosen, left - 1)
            accepted, timings = machine.round(k)
            if not isinstance(governor, int):
                governor.observe(drafted=k, accepted=accepted, cut_short=k < chosen, **timings)
            left -= 1 + accepted
            if log is not None:
                log.append((1 + accepted, timings["round_s"]))


class ScatteredComputeMachine(Machine):
    """A compiled verification on a busy CPU (the widened model at 50% on ``local``): ``verify(T) =
    fixed + per_expert * 4 layers * distinct(T) + per_token * T``, fitted to bp82's rows (2.9 ms a
    distinct expert of a layer over four layers, 1.1 ms a token), and every round's verification
    scattered by a lognormal factor of ``sigma`` (mean 1), as a noisy machine's rounds are; each
    draft position accepted with ``p`` (bp82's acceptance by k follows p = 0.97)."""

    def __init__(self, seed: int, p: float = 0.97, sigma: float = 0.22, fixed: float = 4e-3,
                 per_expert: float = 0.725e-3, per_token: float = 1.1e-3, draft: float = 1.85e-3) -> None:
        super().__init__(p, 0.0, per_expert=per_expert, draft=draft, host=3e-4)
        self.rng, self.sigma, self.fixed, self.per_token = random.Random(seed), sigma, fixed, per_token

    def mean_verify_s(self, width: int) -> float:
        return self.fixed + self.per_expert * 4 * distinct_experts(width, 16, 2) + self.per_token * width

    def round(self, k: int) -> tuple[int, dict]:
        accepted, timings = super().round(k)
        scatter = math.exp(self.rng.gauss(0.0, self.sigma) - self.sigma ** 2 / 2)
        timings.update(verify_s=self.mean_verify_s(k + 1) * scatter, verify_io_wait_s=0.0)
        timings["round_s"] = timings["draft_s"] + timings["verify_s"] + timings["host_s"]
        return accepted, timings
