"""ExpertCache: a fixed number of device slots holding full-precision experts, filled over a link.

Contract (the slots, their states, the slot table and the queries: ``specter.memory.slot_book``):
- ``acquire(layer, experts)`` returns the slots of those experts, in order, READY and pinned: every
  copy into them is complete, and no eviction or prefetch touches them until ``release``
  (``wait=False``: pinned, their copies started, some LOADING: see ``await_any``). Misses
  are loaded on demand, evicting (through the policy) unpinned keys: FREE slots first, then
  unprotected READY keys, then protected ones, then keys still loading (after waiting for them).
  More distinct experts than ``capacity`` raise ``BudgetError``; so do more misses than there are
  unpinned slots (a caller holding earlier steps' slots), and fewer than one slot.
- ``prefetch`` never blocks and never evicts a pinned, protected or loading key.
- All state lives on the caller's thread. A link may complete transfers on another thread; the
  cache only reads ``Transfer.done()`` there, promoting finished LOADING slots in ``poll()``.
- Faults: every wait on a transfer has a deadline (``transfer_timeout_s``); a transfer still
  incomplete then is a ``SpecterError`` naming the expert and the link (a stalled link), the copy
  left in flight for a later wait. A transfer whose copy failed, or (with ``verify_copies``) whose
  bytes arrived wrong (checksums of the slot against the host store), is reloaded once by a direct
  copy from the store (``stats.reloads``) with one warning per run; a reload that fails or is
  wrong too, or more than ``copy_repair.MAX_RELOADS`` of them in one cache's life, is a
  ``SpecterError`` naming the link. A copy that could not start, or whose reload failed, frees its
  slot (once unpinned): the key is loaded afresh when next asked for, never handed out unwritten.
  An ``acquire`` that raises gives back the pins it took.
- ``stats``: the counters (``specter.memory.stats.CacheStats`` defines them); ``preload`` is a warm
  start and is not counted. ``reset_stats()`` starts them afresh: a prefetch issued before it
  counts as neither used nor wasted after it.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from specter.errors import BudgetError, SpecterError
from specter.memory.copy_repair import CopyRepair
from specter.memory.link import Link, Transfer, TransferTimeout, copy_all, wait_for
from specter.memory.slot_book import SlotBook, SlotState
from specter.memory.stats import CacheStats
from specter.memory.store import ExpertStore
from specter.plugins import call_plugin
from specter.policies.base import CachePolicy, ExpertKey


class ExpertCache(SlotBook):
    def __init__(
        self,
        store: ExpertStore,
        n_slots: int,
        device: torch.device | str,
        link: Link,
        policy: CachePolicy,
        transfer_timeout_s: float | None = 60.0,
        verify_copies: bool = False,
        huge_pages: bool = False,
    ) -> None:
        if n_slots < 1:
            raise BudgetError(f"offload.expert_budget: the cache needs at least 1 slot, got {n_slots}")
        super().__init__(store, n_slots, device, policy, huge_pages)
        self.link = link
        self.transfer_timeout_s = transfer_timeout_s
        self.verify_copies = verify_copies
        self._repair = CopyRepair(store)
        self.stats = CacheStats()
        self._loading: dict[int, Transfer] = {}
        self._broken: set[int] = set()  # LOADING slots whose copy and repair failed: freed when unpinned

    def reset_stats(self) -> None:
        """Fresh counters: prefetches still unused count neither as used nor as wasted in them."""
        self.stats = CacheStats()
        self._unused_prefetches.clear()

    # ----- queries that poll -------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Transfers issued and not yet complete (polls first)."""
        self.poll()
        return len(self._loading)

    def is_ready(self, key: ExpertKey) -> bool:
        self.poll()
        slot = self._slot_of.get(key)
        return slot is not None and self._state[slot] is SlotState.READY

    # ----- the step's side ---------------------------------------------------------------------

    def acquire(self, layer: int, experts: Sequence[int], wait: bool = True) -> list[int]:
        keys = list(dict.fromkeys(self._key(layer, int(e)) for e in experts))
        if len(keys) > self.capacity:
            raise BudgetError(
                f"a step of layer {layer} needs {len(keys)} distinct experts but the cache holds "
                f"{self.capacity}; acquire them in chunks of at most {self.capacity}"
            )
        self.poll()
        present = [k for k in keys if k in self._slot_of]
        missing = [k for k in keys if k not in self._slot_of]
        present_slots = {self._slot_of[k] for k in present}
        claimable = sum(
            1 for s in range(self.n_slots) if self._pins[s] == 0 and s not in present_slots
        )
        if len(missing) > claimable:
            raise BudgetError(
                f"layer {layer} needs {len(missing)} new experts but only {claimable} of "
                f"{self.n_slots} slots are unpinned; release earlier steps first"
            )
        to_wait: list[int] = []
        pinned: list[int] = []  # this call's pins: given back if it fails, so a failed step holds none
        try:
            for key in present:
                slot = self._slot_of[key]
                self._pins[slot] += 1
                pinned.append(slot)
                if key in self._unused_prefetches:
                    self._unused_prefetches.discard(key)
                    self.stats.prefetch_used += 1
                    if self._state[slot] is SlotState.LOADING:
                        self.stats.prefetch_late += 1
                if self._state[slot] is SlotState.LOADING:
                    to_wait.append(slot)
                call_plugin("cache_policy", self.policy, "on_access", key)
            for key in missing:
                slot = self._claim_slot_for_demand()
                self._start_load(key, slot)
                self._pins[slot] += 1
                pinned.append(slot)
                self.stats.demand_loads += 1
                call_plugin("cache_policy", self.policy, "on_access", key)
                to_wait.append(slot)
            for slot in to_wait if wait else ():
                self._finish_load(slot)
        except BaseException:
            for slot in pinned:
                self._unpin(slot)
            raise
        self.stats.acquired_keys += len(keys)
        self.stats.hits += len(present)
        self.stats.misses += len(missing)
        return [self._slot_of[self._key(layer, int(e))] for e in experts]

    def await_any(self, layer: int, experts: Sequence[int]) -> list[int]:
        """Of those acquired experts (``acquire(..., wait=False)``), the ones READY once one is (if
        none is, the copy submitted first among them is waited for)."""
        slots = {self._slot_of[self._key(layer, int(e))]: int(e) for e in experts}
        self.poll()
        if all(self._state[slot] is SlotState.LOADING for slot in slots):
            self._finish_load(next(slot for slot in self._loading if slot in slots))
        return [e for slot, e in slots.items() if self._state[slot] is SlotState.READY]

    def release(self, layer: int, experts: Sequence[int]) -> None:
        keys = list(dict.fromkeys(self._key(layer, int(e)) for e in experts))
        slots = []
        for key in keys:
            slot = self._slot_of.get(key)
            if slot is None or self._pins[slot] == 0:
                raise SpecterError(f"release of expert {key} that is not acquired")
            slots.append(slot)
        for slot in slots:
            self._unpin(slot)

    def _unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self.link.release_slot(slot)
            if slot in self._broken:
                self._drop(slot)

    # ----- the scheduler's side ----------------------------------------------------------------

    def prefetch(self, layer: int, expert: int, score: float = 0.0) -> bool:
        """Start loading ``(layer, expert)`` if absent and room can be made without blocking or
        evicting a pinned or protected key; whether a transfer was issued."""
        key = self._key(layer, int(expert))
        if key in self._slot_of:
            return False
        self.poll()
        slot = self._first_free_slot()
        if slot is None:
            candidates = self._evictable(protected_too=False)
            if not candidates:
                return False
            victim = call_plugin("cache_policy", self.policy, "choose_victim", candidates)
            self._check_victim(victim, candidates)
            if not call_plugin("cache_policy", self.policy, "admit_prefetch", key, score, victim):
                return False
            slot = self._evict(victim)
        self._start_load(key, slot)
        self.stats.prefetch_issued += 1
        self._unused_prefetches.add(key)
        return True

    def poll(self) -> None:
        """Promote every LOADING slot whose transfer has completed to READY."""
        for slot in [s for s, t in self._loading.items() if t.done()]:
            self._finish_load(slot)

    def drain(self) -> None:
        """Wait for every transfer in flight (counted as transfer wait)."""
        for slot in list(self._loading):
            self._finish_load(slot)

    def preload(self, keys: Iterable[ExpertKey]) -> None:
        """Fill slots synchronously (warm start); evicts unpinned keys if needed. Not counted."""
        for layer, expert in keys:
            key = self._key(int(layer), int(expert))
            if key in self._slot_of:
                continue
            slot = self._first_free_slot()
            if slot is None:
                candidates = self._evictable(protected_too=True)
                if not candidates:
                    raise BudgetError(f"preload of {key}: every one of the {self.n_slots} slots is pinned")
                slot = self._evict(call_plugin("cache_policy", self.policy, "choose_victim", candidates), counted=False)
            copy_all(self.slot_views(slot), self.store.expert(*key))
            self._occupy(key, slot)
            self._mark_ready(slot)

    # ----- internals ---------------------------------------------------------------------------

    def _claim_slot_for_demand(self) -> int:
        slot = self._first_free_slot()
        if slot is not None:
            return slot
        candidates = self._evictable(protected_too=False) or self._evictable(protected_too=True)
        if not candidates:
            for loading in [s for s in self._loading if self._pins[s] == 0]:
                self._finish_load(loading)
            candidates = self._evictable(protected_too=False) or self._evictable(protected_too=True)
        if not candidates:
            raise BudgetError("no unpinned slot left for a demand load")
        victim = call_plugin("cache_policy", self.policy, "choose_victim", candidates)
        self._check_victim(victim, candidates)
        return self._evict(victim)

    def _check_victim(self, victim: ExpertKey, candidates: Sequence[ExpertKey]) -> None:
        if victim not in candidates:
            name = getattr(self.policy, "name", "") or type(self.policy).__name__
            raise SpecterError(f"offload.cache_policy.name: cache policy {name!r} returned {victim!r} from "
                               f"choose_victim(), which is not one of the candidates it was given")

    def _evict(self, victim: ExpertKey, counted: bool = True) -> int:
        slot = self._slot_of[victim]
        assert self._pins[slot] == 0 and self._state[slot] is SlotState.READY
        if counted:
            self.stats.evictions += 1
            self.stats.prefetch_wasted += victim in self._unused_prefetches
        self._forget(slot)
        return slot

    def _start_load(self, key: ExpertKey, slot: int) -> None:
        self._occupy(key, slot)
        self._state[slot] = SlotState.LOADING
        try:
            self._loading[slot] = self.link.submit(self.slot_views(slot), self.store.expert(*key), slot)
        except BaseException as error:  # no copy started: the slot is free again, not LOADING with no transfer
            self._drop(slot)
            if isinstance(error, SpecterError) or not isinstance(error, Exception):
                raise
            raise SpecterError(f"offload.link.kind: link {self.link.kind!r} failed to start the copy of expert "
                               f"{key}: {type(error).__name__}: {error}") from error
        self.stats.bytes_transferred += self.store.expert_bytes

    def _finish_load(self, slot: int) -> None:
        """Wait for the slot's transfer (if still loading), check it, and mark it READY. A wait that
        times out (or is interrupted) leaves the transfer in place, still LOADING, for a later wait;
        a failed copy whose repair fails too frees the slot (its bytes are unknown)."""
        transfer = self._loading.get(slot)
        if transfer is None:
            return
        key = self._key_in[slot]
        try:
            waited = wait_for(transfer, self.transfer_timeout_s)
        except TransferTimeout:
            raise SpecterError(
                f"offload.transfer_timeout_s: the copy of expert {key} over link {self.link.kind!r} did not "
                f"complete within {self.transfer_timeout_s:g} s; the link is stalled"
            ) from None
        except Exception as error:
            del self._loading[slot]
            self._reload(slot, f"link {self.link.kind!r} failed copying expert {key}: {type(error).__name__}: {error}")
        else:
            del self._loading[slot]
            self.stats.transfer_wait_s += waited
            if self.verify_copies and not self._intact(slot):
                self._reload(slot, f"expert {key} arrived wrong over link {self.link.kind!r} (checksum mismatch)")
        self._mark_ready(slot)

    def _reload(self, slot: int, why: str) -> None:
        """Copy the slot's expert straight from the host store, once; if that fails as well, the
        error is raised and the slot freed (at once, or when its last pin is given back): its key
        loads afresh when next asked for."""
        key = self._key_in[slot]
        assert key is not None
        self.stats.reloads += 1
        try:
            self._repair.reload(self.slot_views(slot), key, why, self.verify_copies)
        except BaseException:
            if self._pins[slot]:
                self._broken.add(slot)
            else:
                self._drop(slot)
            raise

    def _drop(self, slot: int) -> None:
        """Forget a LOADING slot's key without a copy in flight (it never started, or failed)."""
        assert self._key_in[slot] is not None and slot not in self._loading
        self._broken.discard(slot)
        self._forget(slot)

    def _intact(self, slot: int) -> bool:
        key = self._key_in[slot]
        assert key is not None
        return self._repair.intact(self.slot_views(slot), key)
