"""The prefetch scheduler: turns expert predictions into ordered prefetches under the budget.

Contract (the three phases of MoE-SpeQ), per speculation round:
1. ``begin_round()``; predictions arrive through ``add(layer, experts, confidences)``. A predicted
   expert already in the cache is protected (no prefetch may evict it) and needs nothing else.
2. ``pump()`` (called at every layer the draft runs) issues pending prefetches in the order the
   verification pass will need them — layer order, then confidence — keeping at most
   ``max_in_flight`` transfers queued on the link, so a late, earlier-layer prediction still
   overtakes an early, later-layer one.
3. ``flush()`` just before verification issues every remaining predicted expert that the cache
   can place now. What it cannot place (the round's experts exceed the cache) stays pending.
4. Streaming: ``advance(layer)``, called as verification reaches each MoE layer, lifts the
   protection of the round's experts of the layers already verified (they are not needed again
   this round), narrows the hints to what is still ahead and issues pending prefetches of later
   layers into the slots that frees, in need order, keeping enough spare slots for the current
   layer's own demand loads (its predictions that never got a slot: too late to prefetch). So
   the experts of layer L+1 stream into slots freed by layers before L while layer L computes,
   and a prefetch refused at flush is retried before its layer needs it.
5. Two tiers: every prediction not in the cache is also handed to the link's ``stage`` the moment
   it arrives, so a host tier below the device (``specter.memory.host_tier``) starts reading it
   from the disk before a device slot is free for it.
``end_round(used)`` compares what was predicted with what the target used, counts the
predictions never placed (``not_admitted``), then lifts the protection. Every predicted expert
of a layer not yet verified is protected, so a prefetch never evicts an expert the rest of the
pass needs; the cache policy also receives the ordered buffer as hints.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Sequence

from specter.plugins import call_plugin
from specter.policies.base import ExpertKey


@dataclass
class SchedulerStats:
    rounds: int = 0
    predicted: int = 0  # distinct (layer, expert) predicted, summed over rounds
    used: int = 0  # distinct (layer, expert) the target used in those rounds
    predicted_and_used: int = 0
    cached_at_prediction: int = 0  # phase 1: already in the cache when predicted
    issued_while_drafting: int = 0  # phase 2
    issued_at_flush: int = 0  # phase 3
    not_admitted: int = 0  # predictions the cache could not place before the round ended
    streamed: int = 0  # prefetches issued by advance() into slots freed during verification

    def recall(self) -> float | None:
        return self.predicted_and_used / self.used if self.used else None

    def precision(self) -> float | None:
        return self.predicted_and_used / self.predicted if self.predicted else None


class PrefetchScheduler:
    def __init__(self, cache, max_in_flight: int = 2) -> None:
        self.cache = cache
        self.max_in_flight = max_in_flight
        self.stats = SchedulerStats()
        self._predicted: dict[ExpertKey, float] = {}
        self._pending: dict[ExpertKey, float] = {}
        self._active = False
        self._frontier = -1  # the MoE layer verification has reached this round
        self.issue_s = 0.0  # seconds spent issuing prefetches (a synchronous link copies here)

    def begin_round(self) -> None:
        self._predicted.clear()
        self._pending.clear()
        self._active = True
        self._frontier = -1

    def add(self, layer: int, experts: Sequence[int], confidences: Sequence[float]) -> None:
        if not self._active:
            return
        new_keys = []
        n_experts = self.cache.store.n_experts
        if layer not in self.cache.store.layers:
            raise ValueError(f"predicted layer {layer} is not an MoE layer of this model")
        for expert, confidence in zip(experts, confidences):
            key = (layer, int(expert))
            if not 0 <= key[1] < n_experts:
                raise ValueError(f"predicted expert {key[1]} of layer {layer} is out of range 0..{n_experts - 1}")
            if key not in self._predicted:
                new_keys.append(key)
                if self.cache.contains(key):
                    self.stats.cached_at_prediction += 1
                else:
                    self._pending[key] = float(confidence)
                    if self.cache.link.stages:  # a host tier starts reading it now
                        self.cache.link.stage(self.cache.store.expert(*key))
            self._predicted[key] = max(self._predicted.get(key, 0.0), float(confidence))
        if new_keys:
            self.cache.protect(new_keys)

    def ordered(self, keys: Iterable[ExpertKey]) -> list[ExpertKey]:
        return sorted(keys, key=lambda k: (k[0], -self._predicted.get(k, 0.0), k[1]))

    def _issue(self, limit: int | None, reserve: int = 0) -> int:
        """Issue pending prefetches in need order, leaving ``reserve`` spare slots for demand
        loads; a key the cache cannot place stays pending."""
        issued = 0
        for key in self.ordered(self._pending):
            if limit is not None and self.cache.in_flight >= limit:
                break
            if reserve and self.cache.spare_slots() <= reserve:
                break
            if key[0] < self._frontier:
                del self._pending[key]  # its layer is already verified
                continue
            if self.cache.contains(key):
                del self._pending[key]
                continue
            started = time.perf_counter()
            placed = self.cache.prefetch(key[0], key[1], self._predicted[key])
            self.issue_s += time.perf_counter() - started
            if placed:
                del self._pending[key]
                issued += 1
        return issued

    def _send_hints(self) -> None:
        ahead = [k for k in self.ordered(self._predicted) if k[0] >= self._frontier]
        call_plugin("cache_policy", self.cache.policy, "on_hints", [(key, self._predicted[key]) for key in ahead])

    def pump(self) -> None:
        if self._pending:
            self._send_hints()  # the policy judges this round's prefetches by this round's buffer
            self.stats.issued_while_drafting += self._issue(self.max_in_flight)

    def flush(self) -> None:
        self._send_hints()
        if self._pending:
            self.stats.issued_at_flush += self._issue(None)

    def advance(self, layer: int) -> None:
        """Verification has reached MoE layer ``layer``: free the verified layers' experts for
        streaming and issue what was pending (see the module docstring)."""
        if not self._active or layer <= self._frontier:
            return
        self._frontier = layer
        too_late = [k for k in self._pending if k[0] <= layer]  # the layer's own misses load on demand
        for key in too_late:
            del self._pending[key]
        self.stats.not_admitted += len(too_late)
        done = [k for k in self._predicted if k[0] < layer]
        if done:
            self.cache.unprotect(done)
        if self._pending:
            self._send_hints()
            self.stats.streamed += self._issue(None, reserve=len(too_late))

    def end_round(self, used: set[ExpertKey]) -> None:
        predicted = set(self._predicted)
        self.stats.not_admitted += len(self._pending)
        self.stats.rounds += 1
        self.stats.predicted += len(predicted)
        self.stats.used += len(used)
        self.stats.predicted_and_used += len(predicted & used)
        self.cache.unprotect_all()
        self._pending.clear()
        self._active = False
