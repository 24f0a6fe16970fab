"""The governor contract: who picks k, the number of tokens drafted per speculative step.

Contract: the engine creates one governor per run through the plugin registry
(``registry().create("governor", name, options, k=..., n_experts=..., top_k=...)``; factories
take the context keywords they name, see ``specter.plugins``), then alternates ``next_k()``
before each round and ``observe(drafted, accepted, **timings)`` after each verification.
``next_k`` returns an int in ``0..MAX_K``; 0 means a plain decoding round (one target step, with
router-lookahead prefetch); anything else makes the engine stop with an error naming the
governor (``check_next_k``). ``accepted`` counts accepted draft tokens (the bonus token
excluded), so ``0 <= accepted <= drafted``. ``timings`` are the round's measured phases:
``draft_s``, ``flush_s``, ``verify_s`` (its transfer wait included), ``verify_io_wait_s``,
``host_s``, ``round_s`` (seconds) and ``draft_steps``, ``experts_read`` (counts), and
``path_trial`` (a compiled engine tried a path it had measured slower, or not yet measured, for
this round's draft or verification: the times are the trial's) and ``cut_short`` (the engine
drafted fewer than ``next_k`` said because the generation ends after this round); a governor
ignores names it does not use. ``summary() -> dict`` is the report's ``governor`` entry (default:
its name) and covers the rounds since the last ``new_report()``, which the engine calls at the
start of every ``generate`` (what the governor learned is kept across reports). ``link_changed()``
(optional) is called when the engine starts moving experts over another link (``use_link``):
costs measured on the old link no longer hold; ``start_prompt()`` (optional) when a prompt begins.
Built-ins (``specter.decode.governors``): ``fixed`` (always k) and ``roofline``
(``specter.decode.roofline``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from specter.config.recipe import MAX_K

__all__ = ["MAX_K", "Governor", "check_k", "check_next_k", "check_observation"]


class Governor(ABC):
    """Picks the draft length of the next speculative step from what past steps showed.

    ``k_max``: the largest k ``next_k`` will return (compiled verification is sized to it)."""

    name: str = "governor"
    k_max: int = MAX_K

    @abstractmethod
    def next_k(self) -> int:
        """Draft tokens for the next round, in ``0..MAX_K`` (0: a plain decoding round)."""

    @abstractmethod
    def observe(self, drafted: int, accepted: int, **timings: float) -> None:
        """Record one verified step: ``accepted`` of ``drafted`` draft tokens were kept."""

    def new_report(self) -> None:
        """A new report starts (one ``generate`` call): ``summary()`` covers the rounds from here
        on, while what the governor has learned stays. The default keeps nothing per report."""

    def start_prompt(self) -> None:
        """A prompt begins (called just before its prefill): the next round is its first decoding
        round (the cache holds what the prefill left). The default does nothing."""

    def link_changed(self) -> None:
        """Experts move over another link from now on: round costs measured so far were of the
        old one. The default does nothing."""

    def summary(self) -> dict:
        """The report's ``governor`` entry; the default names the governor."""
        return {"name": self.name}


def check_k(k: object) -> int:
    """Return ``k`` if it is an int in ``1..MAX_K``; raise ``ValueError`` otherwise."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
        raise ValueError(f"k must be an integer in 1..{MAX_K}, got {k!r}")
    return k


def check_next_k(k: object, governor: object) -> int:
    """``k`` if it is an int in ``0..MAX_K``; else ``SpecterError`` naming the governor."""
    from specter.errors import SpecterError

    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_K:
        name = getattr(governor, "name", type(governor).__name__)
        raise SpecterError(f"speculation.governor: governor {name!r} returned k={k!r} from next_k(); "
                           f"a governor must return an integer in 0..{MAX_K}")
    return k


def check_observation(drafted: int, accepted: int) -> None:
    """Raise ``ValueError`` unless ``0 <= accepted <= drafted`` (both ints)."""
    if not (isinstance(drafted, int) and isinstance(accepted, int) and 0 <= accepted <= drafted):
        raise ValueError(f"need 0 <= accepted <= drafted, got drafted={drafted!r}, accepted={accepted!r}")
