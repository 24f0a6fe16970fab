"""``example-greedy-k``: grow k while the draft is right, shrink it while it is wrong.

It starts at the recipe's ``speculation.governor.k`` (the context keyword ``k``). After a round
that kept every drafted token k grows by one (up to ``k_max``); after a round that kept less
than ``threshold`` of them it shrinks by one, down to 0, a plain decoding round, after which it
tries k = 1 again. Options: ``threshold`` (default 0.5, in [0, 1]) and ``k_max`` (default 8).
Timings are ignored.
"""

from __future__ import annotations

from specter.decode.governor import MAX_K, Governor


class GreedyKGovernor(Governor):
    name = "example-greedy-k"

    def __init__(self, k: int = 4, threshold: float = 0.5, k_max: int = 8) -> None:
        if isinstance(k_max, bool) or not isinstance(k_max, int) or not 1 <= k_max <= MAX_K:
            raise ValueError(f"k_max must be an integer in 1..{MAX_K}, got {k_max!r}")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
            raise ValueError(f"threshold must be a number in [0, 1], got {threshold!r}")
        self.k_max = k_max  # the engine sizes compiled verification to it
        self.k = min(k, k_max)
        self.threshold = float(threshold)
        self.rounds = self.drafted = self.accepted = 0
        self.trace: list[int] = []  # tokens drafted each round (the engine may cut k near the end)

    def next_k(self) -> int:
        return self.k

    def observe(self, drafted: int, accepted: int, **timings: float) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.trace.append(drafted)
        if drafted == 0:
            if self.k == 0:
                self.k = 1  # we chose a plain round: try speculating again
        elif accepted == drafted:
            self.k = min(self.k + 1, self.k_max)
        elif accepted < self.threshold * drafted:
            self.k = max(self.k - 1, 0)

    def summary(self) -> dict:
        """The report's ``governor`` entry."""
        rate = self.accepted / self.drafted if self.drafted else None
        return {"name": self.name, "k_max": self.k_max, "threshold": self.threshold, "rounds": self.rounds,
                "acceptance": rate, "trace": self.trace}
