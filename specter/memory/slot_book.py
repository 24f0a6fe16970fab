"""SlotBook: which expert each of a cache's slots holds, in which state, with how many pins, and
the queries on them. ``specter.memory.cache.ExpertCache`` builds on it (the policy's choices, the
link's copies, the loads and their faults); every method here runs on the caller's thread.

Contract:
- Device memory is allocated once: ``slots[name]`` is ``[n_slots, *per_expert_shape]`` for every
  parameter name of the store. Contents change, shapes never; ``bytes == n_slots * expert_bytes``;
  ``fraction_held``: ``capacity`` over every expert of every layer of the store. With
  ``huge_pages`` on a CPU device the slots lie on 2 MiB pages (``specter.memory.slots``).
- A slot is FREE, LOADING (a copy is in flight into it) or READY. A key ``(layer, expert)``
  occupies at most one slot and a slot holds at most one key. ``_occupy`` gives a FREE slot a key,
  ``_mark_ready`` makes it READY, ``_forget`` frees it; the policy hears of each insert
  (``on_insert``) and each key leaving (``on_evict``).
- ``slot_table`` (``[len(store.layers), n_experts]`` long, on the device, row = position of the
  layer in ``store.layers``, ``table_rows[layer]``; ``specter.memory.slots.SlotTable``) holds the
  slot of every READY key and -1 elsewhere, so compiled code can read slots without the host.
- Protected keys (``protect``: the next step needs them) are evicted only when nothing else can
  be (``_evictable(protected_too=True)``); ``spare_slots`` counts what a prefetch could take now.
"""

from __future__ import annotations

import enum
from typing import Iterable

import torch

from specter.errors import SpecterError
from specter.memory.slots import SlotTable, allocate_slots
from specter.memory.store import ExpertStore
from specter.plugins import call_plugin
from specter.policies.base import CachePolicy, ExpertKey


class SlotState(enum.Enum):
    FREE = "free"
    LOADING = "loading"
    READY = "ready"


class SlotBook:
    def __init__(self, store: ExpertStore, n_slots: int, device: torch.device | str, policy: CachePolicy,
                 huge_pages: bool = False) -> None:
        self.store = store
        self.n_slots = n_slots
        self.device = torch.device(device)
        self.policy = policy
        self.slots = allocate_slots(store, n_slots, self.device, huge_pages)
        self._slot_views = [{name: buffer[slot] for name, buffer in self.slots.items()} for slot in range(n_slots)]
        self._table = SlotTable(store.layers, store.n_experts, self.device)
        self.slot_table = self._table.tensor
        self.table_rows: dict[int, int] = dict(self._table.rows)  # decoder layer -> its row of slot_table
        self._key_in: list[ExpertKey | None] = [None] * n_slots
        self._state: list[SlotState] = [SlotState.FREE] * n_slots
        self._pins: list[int] = [0] * n_slots
        self._slot_of: dict[ExpertKey, int] = {}
        self._protected: set[ExpertKey] = set()
        self._unused_prefetches: set[ExpertKey] = set()

    @property
    def capacity(self) -> int:
        """The most distinct experts one ``acquire`` may ask for."""
        return self.n_slots

    @property
    def bytes(self) -> int:
        return self.n_slots * self.store.expert_bytes

    @property
    def fraction_held(self) -> float:
        """The share of all the store's experts (every layer's) the cache holds at once."""
        return self.capacity / (self.store.n_experts * len(self.store.layers))

    def contains(self, key: ExpertKey) -> bool:
        return key in self._slot_of

    def resident_keys(self) -> list[ExpertKey]:
        """Keys in a slot, READY or LOADING, sorted."""
        return sorted(self._slot_of)

    def slot_of(self, key: ExpertKey) -> int | None:
        return self._slot_of.get(key)

    def key_in(self, slot: int) -> ExpertKey | None:
        return self._key_in[slot]

    def state(self, slot: int) -> SlotState:
        return self._state[slot]

    def pin_count(self, slot: int) -> int:
        return self._pins[slot]

    def pinned_keys(self) -> set[ExpertKey]:
        return {k for s, k in enumerate(self._key_in) if k is not None and self._pins[s] > 0}

    def protected_keys(self) -> frozenset[ExpertKey]:
        return frozenset(self._protected)

    def slot_views(self, slot: int) -> dict[str, torch.Tensor]:
        return dict(self._slot_views[slot])

    def protect(self, keys: Iterable[ExpertKey]) -> None:
        """Keys the next step needs: prefetches will not evict them (demand loads still may)."""
        self._protected.update((int(layer), int(e)) for layer, e in keys)

    def spare_slots(self) -> int:
        """Slots a prefetch could take now: FREE ones and READY, unpinned, unprotected ones."""
        return self._state.count(SlotState.FREE) + len(self._evictable(protected_too=False))

    def unprotect(self, keys: Iterable[ExpertKey]) -> None:
        self._protected.difference_update((int(layer), int(e)) for layer, e in keys)

    def unprotect_all(self) -> None:
        self._protected.clear()

    def _key(self, layer: int, expert: int) -> ExpertKey:
        if layer not in self._table.rows:
            raise SpecterError(f"layer {layer} is not an MoE layer of this model (have {self.store.layers})")
        if not 0 <= expert < self.store.n_experts:
            raise SpecterError(f"expert {expert} out of range 0..{self.store.n_experts - 1}")
        return (layer, expert)

    def _first_free_slot(self) -> int | None:
        for slot, state in enumerate(self._state):
            if state is SlotState.FREE:
                return slot
        return None

    def _evictable(self, protected_too: bool) -> list[ExpertKey]:
        """READY, unpinned keys (and protected ones only when asked)."""
        return [
            key for slot, key in enumerate(self._key_in)
            if key is not None
            and self._state[slot] is SlotState.READY
            and self._pins[slot] == 0
            and (protected_too or key not in self._protected)
        ]

    def _forget(self, slot: int) -> None:
        """The slot FREE, its key out of the cache and the table, the policy told."""
        key = self._key_in[slot]
        del self._slot_of[key]
        self._key_in[slot] = None
        self._state[slot] = SlotState.FREE
        self._table.set(key, -1)
        self._unused_prefetches.discard(key)
        call_plugin("cache_policy", self.policy, "on_evict", key)

    def _occupy(self, key: ExpertKey, slot: int) -> None:
        assert self._state[slot] is SlotState.FREE and self._key_in[slot] is None
        self._key_in[slot] = key
        self._slot_of[key] = slot
        call_plugin("cache_policy", self.policy, "on_insert", key)

    def _mark_ready(self, slot: int) -> None:
        key = self._key_in[slot]
        assert key is not None
        self._state[slot] = SlotState.READY
        self._table.set(key, slot)
