"""A manual link and a small cache for the prefetch scheduler's tests.

Contract: ``HeldLink``'s copies complete only through ``complete_all`` (or a blocking wait) and it
records the slots in submission order; ``make_cache`` builds an ``ExpertCache`` of ``N_EXPERTS``
tiny experts per layer over one; ``submitted_keys`` names the copies submitted; ``verify_round``
runs verification's per-layer ``advance`` / acquire / release on a link fast enough that every
copy lands before the next layer; ``spare_by_count`` counts the slots a prefetch may take.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specter.memory.cache import ExpertCache, SlotState
from specter.memory.link import Link, Tensors, Transfer
from specter.policies import LRUPolicy
from specter.policies.base import ExpertKey, Hint
from specter.memory.scheduler import PrefetchScheduler
from specter.memory.store import ExpertStore

N_EXPERTS = 6


class HeldTransfer(Transfer):
    def __init__(self, dst: Tensors, src: Tensors) -> None:
        self.dst, self.src = dst, src
        self.nbytes = sum(t.numel() * t.element_size() for t in src.values())
        self.completed = False

    def done(self) -> bool:
        return self.completed

    def wait(self) -> float:
        self.complete()
        return 0.0

    def complete(self) -> None:
        if not self.completed:
            for name, tensor in self.src.items():
                self.dst[name].copy_(tensor)
            self.completed = True


class HeldLink(Link):
    """Copies complete only through ``complete_all`` / ``complete(i)`` (or a blocking wait)."""

    kind = "held"

    def __init__(self) -> None:
        self.transfers: list[HeldTransfer] = []
        self.submitted: list[int] = []  # slots, in submission order

    def submit(self, dst: Tensors, src: Tensors, slot: int) -> Transfer:
        transfer = HeldTransfer(dst, src)
        self.transfers.append(transfer)
        self.submitted.append(slot)
        return transfer

    def complete_all(self) -> None:
        for transfer in self.transfers:
            transfer.complete()


class RecordingLRU(LRUPolicy):
    def __init__(self) -> None:
        super().__init__()
        self.hints: list[list[Hint]] = []

    def on_hints(self, hints: Sequence[Hint]) -> None:
        self.hints.append(list(hints))


def make_cache(n_slots: int, policy=None, layers: Sequence[int] = (0, 1)) -> tuple[ExpertCache, HeldLink]:
    gen = torch.Generator().manual_seed(0)
    store = ExpertStore({
        layer: {"gate_up_proj": torch.randn(N_EXPERTS, 4, 3, generator=gen),
                "down_proj": torch.randn(N_EXPERTS, 3, 2, generator=gen)}
        for layer in layers
    })
    link = HeldLink()
    return ExpertCache(store, n_slots, torch.device("cpu"), link, policy or RecordingLRU()), link


def submitted_keys(cache: ExpertCache, link: HeldLink, start: int = 0) -> list[ExpertKey]:
    """The keys whose copies were submitted (from the ``start``-th on), in order."""
    return [cache.key_in(slot) for slot in link.submitted[start:]]


def verify_round(cache: ExpertCache, link: HeldLink, scheduler: PrefetchScheduler,
                 experts_by_layer: dict[int, list[int]]) -> None:
    """What verification does on a link fast enough that every copy lands before the next layer:
    per MoE layer, ``advance``, then acquire and release the layer's experts."""
    link.complete_all()
    for layer, experts in experts_by_layer.items():
        scheduler.advance(layer)
        cache.acquire(layer, experts)
        cache.release(layer, experts)
        link.complete_all()


def spare_by_count(cache: ExpertCache) -> int:
    """FREE slots and READY, unpinned, unprotected ones: what a prefetch may take (counted from the
    cache's per-slot state, to check ``spare_slots()`` against)."""
    protected = cache.protected_keys()
    return sum(
        1 for s in range(cache.n_slots)
        if cache.state(s) is SlotState.FREE
        or (cache.state(s) is SlotState.READY and cache.pin_count(s) == 0 and cache.key_in(s) not in protected)
    )
