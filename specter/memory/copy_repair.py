"""Repair of faulty expert copies, for ``ExpertCache``.

Contract: ``CopyRepair(store)`` serves one cache. ``intact(dst, key)`` says whether the tensors of
``dst`` (a slot's views) hold expert ``key`` of the host store, by checksum (the store's computed
once per key, from ``store.reference``: a disk store's read counts in no link's figures). ``reload(dst, key, why, verify)`` copies the expert straight from the store into
``dst``; the first reload of the cache's life that succeeds warns (``why`` says what failed;
a reload that raises, as a disk tier's read of a truncated file does, only raises), more than
``MAX_RELOADS`` of them raise ``SpecterError`` (the link is broken), and with ``verify`` a reload
that is wrong too raises. ``total`` counts the reloads.
"""

from __future__ import annotations

import warnings

import torch

from specter.errors import SpecterError
from specter.memory.link import checksum, copy_all
from specter.memory.store import ExpertStore
from specter.policies.base import ExpertKey

MAX_RELOADS = 16  # faulty copies one cache repairs from its store before calling the link broken


class CopyRepair:
    def __init__(self, store: ExpertStore) -> None:
        self.store = store
        self.total = 0
        self._checksums: dict[ExpertKey, tuple[int, ...]] = {}
        self._warned = False

    def intact(self, dst: dict[str, torch.Tensor], key: ExpertKey) -> bool:
        if key not in self._checksums:
            self._checksums[key] = checksum(self.store.reference(*key))
        return checksum(dst) == self._checksums[key]

    def reload(self, dst: dict[str, torch.Tensor], key: ExpertKey, why: str, verify: bool) -> None:
        self.total += 1
        if self.total > MAX_RELOADS:
            raise SpecterError(f"{why}; {MAX_RELOADS} reloads already, the link is broken")
        copy_all(dst, self.store.expert(*key))  # a store that fails too (a disk tier's file gone) raises here
        if verify and not self.intact(dst, key):
            raise SpecterError(f"{why}; the reload from the store is wrong too")
        if not self._warned:  # only once a reload worked: the warning says it did
            self._warned = True
            warnings.warn(f"{why}; reloaded it directly from the store (further faults are counted in the report "
                          f"as cache reloads)", RuntimeWarning, stacklevel=3)
