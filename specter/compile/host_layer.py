"""A fused graph's call back to the host at each MoE layer: the host makes the layer's experts
resident (waiting only for their own transfers) and tells the graph where they are.

Contract:
- ``register(callback) -> handle`` keeps a weak reference to a bound method
  ``callback(row, x [T, H], top_k_index [T, k], top_k_weights [T, k]) -> table_row [E] int64``,
  a fresh tensor (the slot of every expert of MoE row ``row``, -1 where absent), as
  ``ExpertCache.slot_table[row]`` reads once the host has done what the layer needs.
- ``LayerHost(runtime)``: the compiled decoder's host (registered; ``handle``). Inside
  ``with host.live():`` (one fused cache step) each call releases the previous row's experts,
  tells the runtime's observers, acquires the row's experts (``ExpertCache.acquire``: waits for
  their transfers, loads misses) and returns the slot table row; the last row is released when
  the block ends. Outside it (warm-up on scratch inputs) a call only reads the table.
  ``fits(num_tokens)``: whether every layer of a step over that many tokens can be acquired at
  once (tokens x top-k <= cache slots); the decoder runs other steps layered. Should a row still
  need more experts than the cache holds, it is not acquired: the graph sees them missing and the
  step reruns layered (its observers then see the step's earlier layers a second time).
- ``layer_slots(x, top_k_index, top_k_weights, row, handle, n_experts) -> [n_experts] int64``
  (``torch.ops.specter_host.layer_slots``): an opaque custom op, so inductor runs it as an
  extern call in graph order; ``handle`` is a 0-d int64 tensor, so the graphs of engines with
  different hosts are shared instead of recompiled per handle value. Its inputs depend on the
  previous layer's output and its result feeds this layer's experts, so the host runs after
  layer ``row - 1``'s experts were computed and before layer ``row``'s are read. The callback receives clones of its inputs (it may keep
  them: inductor reuses a graph's buffers).
Why: a fused cache step used to wait for every transfer in flight before it started (the graph
could only read READY slots); with this call each layer waits only for its own experts, so
transfers still overlap the earlier layers, as on the layered path. CPU only: a CUDA graph
cannot call the host.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Callable, Iterator

import torch
from torch import Tensor

LayerCallback = Callable[[int, Tensor, Tensor, Tensor], Tensor]
_callbacks: dict[int, weakref.WeakMethod] = {}
_handles = itertools.count(1)


def register(callback: LayerCallback) -> int:
    handle = next(_handles)
    _callbacks[handle] = weakref.WeakMethod(callback)
    return handle


def unregister(handle: int) -> None:
    _callbacks.pop(handle, None)


@torch.library.custom_op("specter_host::layer_slots", mutates_args=())
def layer_slots(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, row: int, handle: Tensor,
                n_experts: int) -> Tensor:
    reference = _callbacks.get(int(handle))
    callback = reference() if reference is not None else None
    if callback is None:
        raise RuntimeError(f"specter_host::layer_slots: no host registered under handle {int(handle)}")
    table_row = callback(row, x.clone(), top_k_index.clone(), top_k_weights.clone())
    if table_row.shape != (n_experts,) or table_row.dtype != torch.long:
        raise RuntimeError(f"specter_host::layer_slots: the host returned {tuple(table_row.shape)} "
                           f"{table_row.dtype}, expected ({n_experts},) int64")
    return table_row


@layer_slots.register_fake
def _(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, row: int, handle: Tensor, n_experts: int) -> Tensor:
    return top_k_index.new_empty(n_experts, dtype=torch.long)


class LayerHost:
    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.cache = runtime.cache
        self.top_k = max(layer.top_k for layer in runtime.layers.values())
        self.handle = torch.tensor(register(self.__call__))  # a tensor: see layer_slots
        self._live = False
        self._held: tuple[int, list[int]] | None = None  # (row, experts) acquired by the last call

    def fits(self, num_tokens: int) -> bool:
        return num_tokens * self.top_k <= self.cache.capacity

    @contextlib.contextmanager
    def live(self) -> Iterator[None]:
        self._live = True
        try:
            yield
        finally:
            self._live = False
            self._release_held()

    def __call__(self, row: int, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        if self._live:
            self._release_held()
            for observe in self.runtime.observers:
                observe(row, x, top_k_index, top_k_weights, self.runtime.mode)
            experts = top_k_index.unique().tolist()
            if len(experts) <= self.cache.capacity:
                self.cache.acquire(row, experts)
                self._held = (row, experts)
        return self.cache.slot_table[row].clone()

    def _release_held(self) -> None:
        if self._held is not None:
            row, experts = self._held
            self._held = None
            self.cache.release(row, experts)
