"""Cache policies: the interface (``base``) and the built-ins ``lru``, ``lfu`` and ``lookahead``, registered
through the ``register_cache_policies`` hook like any third-party policy."""

from __future__ import annotations

from specter.hookspecs import Register, hookimpl
from specter.policies.base import CachePolicy, ExpertKey, Hint
from specter.policies.lfu import LFUPolicy
from specter.policies.lookahead import LookaheadPolicy
from specter.policies.lru import LRUPolicy

__all__ = ["CachePolicy", "ExpertKey", "Hint", "LFUPolicy", "LookaheadPolicy", "LRUPolicy"]


@hookimpl
def register_cache_policies(register: Register) -> None:
    register("lru", LRUPolicy)
    register("lfu", LFUPolicy)
    register("lookahead", LookaheadPolicy)
