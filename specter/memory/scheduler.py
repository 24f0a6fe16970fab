"""The prefetch scheduler: turns expert predictions into ordered prefetches under the budget.

Contract (the three phases of MoE-SpeQ, plus streaming), per speculation round:
1. ``begin_round()``; predictions arrive through ``add(layer, experts, confidences)`` (or
   ``add_many`` of several such, with one window update for all). The
   round's predictions are kept in need order (layer, then confidence); the first ``capacity``
   of those not yet verified form the *window*. Every window key is protected (no prefetch may
   evict it); a window key already cached needs nothing else.
2. ``pump()`` (called as the draft's predictions arrive) issues the window's missing keys in need
   order, keeping at most ``max_in_flight`` transfers queued on the link, so a late,
   earlier-layer prediction still overtakes an early, later-layer one.
3. ``flush()`` just before verification issues every missing window key the cache can place now.
4. Streaming, when the round's predictions exceed the cache: a cached prediction outside the
   window (needed later than ``capacity`` others) is not protected, so a prefetch of a key needed
   sooner may evict it (the cache policy picks the victim; ``lookahead`` takes the one needed
   last). ``advance(layer)``, called as verification reaches each MoE layer, drops the verified
   layers from the window, which slides on to later layers, and issues their missing keys (an
   evicted later-layer key streams back) into the slots the verified layers free, in need order,
   keeping enough spare slots for the current layer's own demand loads. A key of the current
   layer still missing then is too late (it loads on demand, ``not_admitted``); a key of a later
   layer refused earlier is retried whenever a slot frees, before its layer needs it.
   ``computed(layer, experts)``: verification computed those experts before the rest of their
   layer (``ExpertRuntime``'s waves) and freed their slots; they leave the predictions ahead and
   the window's missing keys are issued into the freed slots at once.
5. Two tiers: every prediction not in the cache is also handed to the link's ``stage`` the moment
   it arrives, so a host tier below the device (``specter.memory.host_tier``) starts reading it
   from the disk before a device slot is free for it.
6. ``mode`` (``offload.prefetch``): ``aggressive`` as above; ``conservative`` trades earliness for
   fewer copies where the link, not compute, sets the pace: every prediction still ahead is
   protected (not only the window), so a prefetch never evicts a key this round is predicted to
   need, which would have to stream back; only keys of the first layer still ahead (those
   verification needs next, which would otherwise load on demand and evict such a key anyway)
   may evict predictions beyond the window. ``auto`` starts aggressive and is conservative once
   the rounds wait on transfers (a moving average, from 0, of the share of ``begin_round`` ..
   ``end_round`` spent in the cache's transfer waits) above ``AUTO_ENTER_WAIT``, until it falls
   below ``AUTO_LEAVE_WAIT`` (a round right after a prefill, which waits long, cannot decide it
   alone). ``lazy`` issues nothing while the draft runs: ``pump`` returns at once and ``flush``
   issues the window with the round's predictions complete, so a prefetch never evicts a key a
   later draft step predicts for the same round (fewer copies where the link keeps up with
   compute, and none of them beside the draft); ``auto`` never is (measured: design notes, stop 40).
7. Held while drafting (``begin_round(hold_last_read=True)``: a speculation round's draft, in any
   mode but conservative, which protects more): until ``flush`` no prefetch may evict an expert the
   previous round's verification read (``end_round``'s ``used``). The draft's later steps mostly
   predict those again; evicted by an earlier step's prefetch they would be copied back in the
   same round. A prefetch that finds no other slot waits for the flush, where the round's
   predictions are complete and only the window is protected.
8. ``reading(layer, experts)``: the experts verification routed the current layer to are
   protected until it advances past the layer (a predictor that prefetches from a layer's routing
   runs before that layer acquires its experts).
``end_round(used)`` compares what was predicted with what the target used, counts the
predictions not in the cache when their layer was reached (``not_admitted``), then lifts the
protection; ``in_round`` says whether a round is open. The cache policy also receives the round's
predictions still ahead (the window's and those after it) as hints, in need order: none once the
round ends.
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
    not_admitted: int = 0  # predictions not in the cache (not even loading) when their layer came
    streamed: int = 0  # prefetches issued by advance() into slots freed during verification

    def recall(self) -> float | None:
        return self.predicted_and_used / self.used if self.used else None

    def precision(self) -> float | None:
        return self.predicted_and_used / self.predicted if self.predicted else None


PREFETCH_MODES = ("aggressive", "conservative", "lazy", "auto")
AUTO_ENTER_WAIT = 0.3  # link-bound: every bench-governor row on a 2 GB/s link waited 0.35-0.68
AUTO_LEAVE_WAIT = 0.2  # compute-bound: on 20 GB/s 0.004-0.13; the bundled model at 25% on 1 GB/s ~0.2
AUTO_WAIT_DECAY = 0.8  # weight of the past in the moving average of the wait share, which starts at 0


class PrefetchScheduler:
    def __init__(self, cache, max_in_flight: int = 2, mode: str = "aggressive") -> None:
        if mode not in PREFETCH_MODES:
            raise ValueError(f"prefetch mode {mode!r} is not one of {', '.join(PREFETCH_MODES)}")
        self.cache = cache
        self.max_in_flight = max_in_flight
        self.mode = mode
        self.conservative = mode == "conservative"
        self.lazy = mode == "lazy"
        self.wait_share: float | None = 0.0 if mode == "auto" else None  # moving average over rounds
        self._round_started = 0.0
        self._wait_before = 0.0
        self._beyond_window: list[ExpertKey] = []  # protected only because conservative
        self.stats = SchedulerStats()
        self._predicted: dict[ExpertKey, float] = {}
        self._ahead: list[ExpertKey] = []  # predictions not yet verified, in need order
        self._window: list[ExpertKey] = []  # the first ``capacity`` of them: the protected set
        self._done: set[ExpertKey] = set()  # computed this round ahead of the rest of their layer (``computed``)
        self._active = False
        self._frontier = -1  # the MoE layer verification has reached this round
        self._ahead_version = 0  # bumped whenever ``_ahead`` changes
        self._hinted_version = -1  # the ``_ahead`` the policy last received as hints
        self.issue_s = 0.0  # seconds spent issuing prefetches (a synchronous link copies here)
        self._last_read: set[ExpertKey] = set()  # what the previous round's verification read
        self._holding = False  # the last round's reads are protected (a draft is running: point 7)
        self._reading: set[ExpertKey] = set()  # the experts the current layer was routed to (``reading``)

    @property
    def in_round(self) -> bool:
        """Between ``begin_round`` and ``end_round``."""
        return self._active

    def begin_round(self, hold_last_read: bool = False) -> None:
        self._holding = hold_last_read and not self.conservative and bool(self._last_read)
        if self._holding:
            self.cache.protect(self._last_read)
        self._predicted.clear()
        self._done.clear()
        self._ahead, self._window = [], []
        self._ahead_version += 1
        self._active = True
        self._frontier = -1
        self._round_started = time.perf_counter()
        self._wait_before = self.cache.stats.transfer_wait_s

    def add(self, layer: int, experts: Sequence[int], confidences: Sequence[float]) -> None:
        self.add_many([(layer, experts, confidences)])

    def add_many(self, predictions: Iterable[tuple[int, Sequence[int], Sequence[float]]]) -> None:
        """``add`` for several (layer, experts, confidences) at once: the window is recomputed
        once for all of them (a draft step hands over all its layers' routing together)."""
        if not self._active:
            return
        changed = False
        for layer, experts, confidences in predictions:
            changed |= self._record(layer, experts, confidences)
        if changed:
            self._protect_window()

    def _record(self, layer: int, experts: Sequence[int], confidences: Sequence[float]) -> bool:
        """Records one layer's predictions; whether any of them is new or more confident."""
        n_experts = self.cache.store.n_experts
        if layer not in self.cache.store.layers:
            raise ValueError(f"predicted layer {layer} is not an MoE layer of this model")
        changed = False
        for expert, confidence in zip(experts, confidences):
            key = (layer, int(expert))
            if not 0 <= key[1] < n_experts:
                raise ValueError(f"predicted expert {key[1]} of layer {layer} is out of range 0..{n_experts - 1}")
            previous = self._predicted.get(key)
            if previous is None:
                if self.cache.contains(key):
                    self.stats.cached_at_prediction += 1
                elif self.cache.link.stages:  # a host tier starts reading it now
                    self.cache.link.stage(self.cache.store.expert(*key))
            if previous is None or float(confidence) > previous:
                self._predicted[key] = float(confidence)
                changed = True
        return changed

    def ordered(self, keys: Iterable[ExpertKey]) -> list[ExpertKey]:
        return sorted(keys, key=lambda k: (k[0], -self._predicted.get(k, 0.0), k[1]))

    def _protect_window(self) -> None:
        """Recompute the predictions ahead and the window (the first ``capacity`` of them) after
        a prediction or the frontier changed, and make the window exactly the cache's protected
        set."""
        self._set_window([k for k in self.ordered(self._predicted) if k[0] >= self._frontier and k not in self._done])

    def _set_window(self, ahead: list[ExpertKey]) -> None:
        """``ahead`` (in need order) is the predictions ahead: the window is its first ``capacity``
        keys and the cache's protected set exactly the window and the current layer's routed
        experts (conservative: all of ``ahead``)."""
        self._ahead = ahead
        self._ahead_version += 1
        self._window = self._ahead[: self.cache.capacity]
        self.cache.unprotect_all()
        self.cache.protect(self._window)
        self.cache.protect(self._reading)
        if self._holding:
            self.cache.protect(self._last_read)
        if self.conservative:
            self._beyond_window = self._ahead[self.cache.capacity:]
            self.cache.protect(self._beyond_window)

    def _missing(self) -> list[ExpertKey]:
        """Window keys of layers after the current one that are not in the cache, in need order."""
        return [k for k in self._window if k[0] > self._frontier and not self.cache.contains(k)]

    def _issue(self, missing: list[ExpertKey], limit: int | None, reserve: int = 0) -> int:
        """Issue ``missing`` (``_missing()``) in need order, leaving ``reserve`` spare slots for
        demand loads; a key the cache cannot place now is retried at the next call."""
        issued = 0
        for key in missing:
            if limit is not None and self.cache.in_flight >= limit:
                break
            if reserve and self.cache.spare_slots() <= reserve:
                break
            started = time.perf_counter()
            placed = self._prefetch(key)
            # no slot a prefetch may take: every key after this one (in need order, none of which
            # may evict more) would be refused too
            no_room = not placed and not self._may_evict_beyond_window(key) and self.cache.spare_slots() == 0
            self.issue_s += time.perf_counter() - started
            if no_room:
                break
            issued += placed
        return issued

    def _may_evict_beyond_window(self, key: ExpertKey) -> bool:
        return bool(self.conservative and self._beyond_window and key[0] == self._ahead[0][0])

    def _prefetch(self, key: ExpertKey) -> bool:
        """Start ``key``'s copy; a conservative scheduler lets a key of the first layer ahead evict
        predictions beyond the window (it would load on demand otherwise)."""
        relax = self._may_evict_beyond_window(key)
        if relax:
            self.cache.unprotect(self._beyond_window)
        try:
            return self.cache.prefetch(key[0], key[1], self._predicted[key])
        finally:
            if relax:
                self.cache.protect(self._beyond_window)

    def _send_hints(self) -> None:
        """The predictions ahead, in need order, to the cache policy (once per change of them)."""
        if self._hinted_version == self._ahead_version:
            return
        self._hinted_version = self._ahead_version
        call_plugin("cache_policy", self.cache.policy, "on_hints",
                    [(key, self._predicted[key]) for key in self._ahead])

    def pump(self) -> None:
        if self.lazy:
            return  # flush issues the window once the round's predictions are complete
        if self.cache.in_flight >= self.max_in_flight:
            return  # nothing could be issued now; the next pump (or flush) looks again
        missing = self._missing()
        if missing:
            self._send_hints()  # the policy judges this round's prefetches by this round's buffer
            self.stats.issued_while_drafting += self._issue(missing, self.max_in_flight)

    def flush(self) -> None:
        if self._holding:  # the window stays protected: only the hold lifts (no new window, no new hints)
            self._holding = False
            self.cache.unprotect(self._last_read.difference(self._window, self._reading))
        self._send_hints()
        missing = self._missing()
        if missing:
            self.stats.issued_at_flush += self._issue(missing, None)

    def _count_late(self, up_to_layer: int | None) -> int:
        """Predictions of the layers after the frontier (up to ``up_to_layer``) not in the cache."""
        return sum(1 for k in self._predicted
                   if k[0] > self._frontier and (up_to_layer is None or k[0] <= up_to_layer)
                   and not self.cache.contains(k))

    def advance(self, layer: int) -> None:
        """Verification has reached MoE layer ``layer``: slide the window past the verified layers
        and stream their successors into the freed slots (see the module docstring)."""
        if not self._active or layer <= self._frontier:
            return
        too_late = self._count_late(layer)  # the layer's own misses load on demand
        self.stats.not_admitted += too_late
        self._frontier = layer
        self._reading = {key for key in self._reading if key[0] >= layer}
        self._protect_window()
        self._stream(reserve=too_late)

    def reading(self, layer: int, experts: Sequence[int]) -> None:
        """Verification routed MoE layer ``layer`` to ``experts`` and is about to acquire them: they
        stay protected until it advances past the layer, so a prefetch issued from the layer's own
        routing (``router-lookahead`` observes it before the acquire) cannot evict them."""
        if not self._active:
            return
        keys = {(layer, int(e)) for e in experts}
        self._reading |= keys
        self.cache.protect(keys)

    def computed(self, layer: int, experts: Sequence[int]) -> None:
        """Verification computed these experts of MoE layer ``layer`` before the rest of it (and
        released their slots): they leave the predictions ahead, and the window's missing keys
        stream into the freed slots at once."""
        if not self._active or layer < self._frontier:
            return
        done = {(layer, int(e)) for e in experts}
        self._done |= done
        # predictions and frontier unchanged since the window was computed: the keys ahead keep
        # their order, less the ones done (no re-sort)
        self._set_window([k for k in self._ahead if k not in done])
        self._stream(reserve=0)

    def _stream(self, reserve: int) -> None:
        """The window moved (frontier or keys done): issue its missing keys into whatever slots are
        free now, leaving ``reserve`` spare for demand loads."""
        missing = self._missing()
        if missing:
            self._send_hints()
            self.stats.streamed += self._issue(missing, None, reserve=reserve)

    def end_round(self, used: set[ExpertKey]) -> None:
        predicted = set(self._predicted)
        self.stats.not_admitted += self._count_late(None)
        self.stats.rounds += 1
        self.stats.predicted += len(predicted)
        self.stats.used += len(used)
        self.stats.predicted_and_used += len(predicted & used)
        self._last_read = set(used)
        self._holding = False
        self._reading = set()
        self.cache.unprotect_all()
        self._beyond_window = []
        if self.mode == "auto":
            self._observe_wait(self.cache.stats.transfer_wait_s - self._wait_before,
                               time.perf_counter() - self._round_started)
        self._predicted.clear()
        self._ahead, self._window = [], []
        self._ahead_version += 1
        self._send_hints()  # none ahead: a prefill between rounds must not evict by a finished round's hints
        self._active = False

    def _observe_wait(self, wait_s: float, round_s: float) -> None:
        """Mode auto: fold one round's transfer-wait share into the average and pick the mode."""
        if round_s <= 0:
            return
        share = min(1.0, max(0.0, wait_s / round_s))
        self.wait_share = AUTO_WAIT_DECAY * (self.wait_share or 0.0) + (1 - AUTO_WAIT_DECAY) * share
        if self.wait_share > AUTO_ENTER_WAIT:
            self.conservative = True
        elif self.wait_share < AUTO_LEAVE_WAIT:
            self.conservative = False
