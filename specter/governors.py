"""Speculation governors: who picks k, the number of tokens drafted per speculative step.

Contract: the engine creates one governor per run through the plugin registry
(``registry().create("governor", name, options, k=recipe.speculation.governor.k)``; factories
take the context keywords they name, see ``specter.plugins``), then alternates ``next_k()``
before each draft phase and ``observe(drafted, accepted, **timings)`` after each verification.
``next_k`` returns an int in ``1..MAX_K``. ``accepted`` counts accepted draft tokens (the bonus
token excluded), so ``0 <= accepted <= drafted``. ``timings`` are seconds named by phase (for
example ``draft_s``, ``verify_s``, ``io_wait_s``); a governor ignores names it does not use.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from specter.hookspecs import Register, hookimpl

MAX_K = 16


class Governor(ABC):
    """Picks the draft length of the next speculative step from what past steps showed."""

    @abstractmethod
    def next_k(self) -> int:
        """Draft tokens for the next step, in ``1..MAX_K``."""

    @abstractmethod
    def observe(self, drafted: int, accepted: int, **timings: float) -> None:
        """Record one verified step: ``accepted`` of ``drafted`` draft tokens were kept."""


def check_k(k: object) -> int:
    """Return ``k`` if it is an int in ``1..MAX_K``; raise ``ValueError`` otherwise."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise ValueError(f"k must be an integer in 1..{MAX_K}, got {k!r}")
    return k


def check_observation(drafted: int, accepted: int) -> None:
    """Raise ``ValueError`` unless ``0 <= accepted <= drafted`` (both ints)."""
    if not (isinstance(drafted, int) and isinstance(accepted, int) and 0 <= accepted <= drafted):
        raise ValueError(f"need 0 <= accepted <= drafted, got drafted={drafted!r}, accepted={accepted!r}")


class FixedGovernor(Governor):
    """Always drafts ``k`` tokens, whatever the acceptance."""

    def __init__(self, k: int = 4) -> None:
        self.k = check_k(k)

    def next_k(self) -> int:
        return self.k

    def observe(self, drafted: int, accepted: int, **timings: float) -> None:
        check_observation(drafted, accepted)

    def __repr__(self) -> str:
        return f"FixedGovernor(k={self.k})"


@hookimpl
def register_governors(register: Register) -> None:
    register("fixed", FixedGovernor)
