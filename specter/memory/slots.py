"""The expert cache's device memory: its slot buffers and its slot table.

Contract:
- ``allocate_slots(store, n_slots, device, huge_pages) -> {name: [n_slots, *shape]}``: one buffer
  per parameter name of the store, in its dtype, on ``device``; with ``huge_pages`` on a CPU device
  on 2 MiB pages (``specter.memory.huge_pages.zeros``), else uninitialised.
- ``SlotTable(layers, n_experts, device)``: ``tensor`` is ``[len(layers), n_experts]`` int64 on the
  device, -1 everywhere at first, row = position of the layer in ``layers`` (``rows``), so compiled
  code can read slots without the host; ``set(key, slot)`` writes one entry (-1: absent). On a CPU
  the write goes through a NumPy view of the tensor's memory: a tensor item write took 2 us in a
  hot loop and about 30 us in the engine, once for each load and once for each eviction, on the
  verification's critical path.
"""

from __future__ import annotations

import torch

from specter.memory.huge_pages import zeros as huge_pages_zeros
from specter.memory.store import ExpertStore
from specter.policies.base import ExpertKey


def allocate_slots(store: ExpertStore, n_slots: int, device: torch.device, huge_pages: bool) -> dict[str, torch.Tensor]:
    on_huge_pages = huge_pages and device.type == "cpu"
    return {
        name: huge_pages_zeros((n_slots, *shape), store.dtype) if on_huge_pages
        else torch.empty((n_slots, *shape), dtype=store.dtype, device=device)
        for name, shape in store.param_shapes.items()
    }


class SlotTable:
    def __init__(self, layers: list[int], n_experts: int, device: torch.device) -> None:
        self.rows = {layer: row for row, layer in enumerate(layers)}
        self.tensor = torch.full((len(layers), n_experts), -1, dtype=torch.long, device=device)
        self._host = self.tensor.numpy() if self.tensor.device.type == "cpu" else None

    def set(self, key: ExpertKey, slot: int) -> None:
        if self._host is not None:
            self._host[self.rows[key[0]], key[1]] = slot
        else:
            self.tensor[self.rows[key[0]], key[1]] = slot
