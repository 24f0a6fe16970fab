"""The built-in speculation governors, registered as plugins of kind ``governor``: ``fixed``
(always k) and ``roofline`` (``specter.decode.roofline``). The contract is ``specter.decode.governor``."""

from __future__ import annotations

from specter.decode.governor import MAX_K, Governor, check_k, check_observation
from specter.decode.roofline import RooflineGovernor
from specter.hookspecs import Register, hookimpl

__all__ = ["MAX_K", "FixedGovernor", "RooflineGovernor"]


class FixedGovernor(Governor):
    """Always drafts ``k`` tokens, whatever the acceptance."""

    name = "fixed"

    def __init__(self, k: int = 4) -> None:
        self.k = self.k_max = check_k(k)

    def next_k(self) -> int:
        return self.k

    def observe(self, drafted: int, accepted: int, **timings: float) -> None:
        check_observation(drafted, accepted)

    def __repr__(self) -> str:
        return f"FixedGovernor(k={self.k})"


@hookimpl
def register_governors(register: Register) -> None:
    register("fixed", FixedGovernor)
    register("roofline", RooflineGovernor)
