"""A fused graph's call back to the host at each MoE layer: the host makes the layer's experts
resident and either tells the graph where they are or computes them itself, in waves as their
copies arrive.

Contract:
- ``register(callback) -> handle`` keeps a weak reference to a bound method
  ``callback(layer, x [T, H], top_k_index [T, k], top_k_weights [T, k]) -> Tensor``.
- ``LayerHost(runtime, modules, computes=None)``: the compiled decoder's host (registered under
  ``handle``; ``computes`` says which op the graph calls; None: whether one expert of the cache's
  store, ``store.expert_bytes``, holds at least ``COMPUTES_MIN_BYTES``). Inside
  ``with host.live():`` (one fused cache step) each call tells the runtime's observers about the
  layer and
  * ``computes=False`` (``layer_slots``): releases the previous MoE layer's experts (before
    the observers hear of this one, so the scheduler's ``advance`` streams the round's next predictions
    into their slots at once, as on the eager path, where a layer's slots are free before the next
    layer starts), acquires this layer's (``ExpertCache.acquire``: waits for their transfers, loads
    misses) and returns the layer's slot table row [E] int64 (the slot of every expert, -1 where
    absent) for the graph to read (counted in the runtime's ``layers_computed_in_graph``); the
    last layer's are released when the block ends. A layer needing more
    experts than the cache holds is not acquired: the graph sees them missing and the step reruns
    layered. ``fits(num_tokens)``: whether every layer of a step over that many tokens can be
    acquired at once (tokens x top-k <= cache slots); the decoder runs other steps layered.
  * ``computes=True`` (``layer_experts``): returns the routed experts' weighted sum [T, H] as the
    eager engine computes it (``ExpertRuntime.forward``: the cache acquires the experts, the
    runtime computes them in waves as their copies arrive, more experts than the cache holds in
    chunks, and releases them). ``fits`` is always True.
  Outside ``live`` (warm-up on scratch inputs) a call touches nothing: it reads the slot table,
  or returns zeros.
- Draft steps: the fused draft graph calls ``layer_routed`` at each layer once the router has
  chosen (``draft_handle``; inside ``live``, ``draft_routed`` tells the observers), so the observers
  see each layer while the step runs, as on the lean step: the draft predictor hands a round's
  first layer to the scheduler at once when nothing is copying, then each step's layers at its
  last layer. Told after the step, a link-bound round's copies lost their head start: widened
  model, 25% on 2 GB/s, k = 8, verification waited 7-8 ms a round more (compiled 0.975x eager).
- ``layer_slots(x, top_k_index, top_k_weights, layer, handle, n_experts) -> [n_experts] int64``,
  ``layer_experts(x, top_k_index, top_k_weights, layer, handle) -> [T, H]`` and
  ``layer_routed(x, top_k_index, top_k_weights, layer, handle) -> a copy of x``
  (``torch.ops.specter_host.*``): opaque custom ops, so inductor runs them as extern calls in
  graph order; ``handle`` is a 0-d int64 tensor, so the graphs of engines with different hosts
  are shared instead of recompiled per handle value. Their inputs depend on the previous layer's
  output and their result feeds this layer's experts (or its residual add), so the host runs
  after the previous layer and before this layer's experts are used (``layer``: the decoder
  layer's index). The callback receives clones of its inputs (observers may keep them: inductor
  reuses a graph's buffers); a wrong answer's shape or dtype is a clear error.
Why: a fused cache step used to wait for every transfer in flight before it started; with
``layer_slots`` each layer waits only for its own experts, so transfers overlap the earlier
layers. With ``layer_experts`` a layer's first experts are computed while its later ones still
copy, as on the eager path, at a host cost per wave (the runtime's grouping and slot lookups:
0.1-0.25 ms a wave on this VM) that only large experts repay: the bundled model's 0.75 MiB
experts ran 8% slower that way (compiled ``ondemand``, 50% on an emulated 1 GB/s link), the
widened model's 12 MiB ones 4-8% faster (25% on 2 GB/s, 50% ``local``); a 4 MiB expert computes
in about 0.3 ms at 13 GB/s. CPU only: a CUDA graph cannot call the host. Releasing before telling
the observers (it was after): bundled model, one process, six runs each, compiled against eager
with the old order / the new: 25% on 0.1 GB/s, k = 4: 0.992x / 0.995x, hit rate 0.843 / 0.938;
25% on 1 GB/s, k = 4: 1.056x / 1.078x, hit rate 0.897 / 0.922; 50% on 1 GB/s, roofline: 0.960x /
0.994x and 1.028x / 1.014x in two processes (hit rate 0.974 / 0.996, 0.965 / 1.000); 50% on
0.1 GB/s, k = 4: 1.007x both.
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
COMPUTES_MIN_BYTES = 4 << 20  # an expert at least this large is computed by the host (see Why)


def register(callback: LayerCallback) -> int:
    handle = next(_handles)
    _callbacks[handle] = weakref.WeakMethod(callback)
    return handle


def unregister(handle: int) -> None:
    _callbacks.pop(handle, None)


def _call_host(op: str, handle: Tensor, layer: int, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    reference = _callbacks.get(int(handle))
    callback = reference() if reference is not None else None
    if callback is None:
        raise RuntimeError(f"specter_host::{op}: no host registered under handle {int(handle)}")
    return callback(layer, x.clone(), top_k_index.clone(), top_k_weights.clone())


@torch.library.custom_op("specter_host::layer_slots", mutates_args=())
def layer_slots(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, layer: int, handle: Tensor,
                n_experts: int) -> Tensor:
    table_row = _call_host("layer_slots", handle, layer, x, top_k_index, top_k_weights)
    if table_row.shape != (n_experts,) or table_row.dtype != torch.long:
        raise RuntimeError(f"specter_host::layer_slots: the host returned {tuple(table_row.shape)} "
                           f"{table_row.dtype}, expected ({n_experts},) int64")
    return table_row


@layer_slots.register_fake
def _(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, layer: int, handle: Tensor, n_experts: int) -> Tensor:
    return top_k_index.new_empty(n_experts, dtype=torch.long)


@torch.library.custom_op("specter_host::layer_experts", mutates_args=())
def layer_experts(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, layer: int, handle: Tensor) -> Tensor:
    y = _call_host("layer_experts", handle, layer, x, top_k_index, top_k_weights)
    if y.shape != x.shape or y.dtype != x.dtype:
        raise RuntimeError(f"specter_host::layer_experts: the host returned {tuple(y.shape)} {y.dtype}, "
                           f"expected {tuple(x.shape)} {x.dtype}")
    return y


@layer_experts.register_fake
def _(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, layer: int, handle: Tensor) -> Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("specter_host::layer_routed", mutates_args=())
def layer_routed(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, layer: int, handle: Tensor) -> Tensor:
    _call_host("layer_routed", handle, layer, x, top_k_index, top_k_weights)
    return x.clone()  # the draft's experts read this copy, so the call comes before them


@layer_routed.register_fake
def _(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, layer: int, handle: Tensor) -> Tensor:
    return x.new_empty(x.shape)


class LayerHost:
    def __init__(self, runtime, modules: list, computes: bool | None = None) -> None:
        self.runtime = runtime
        self.cache = runtime.cache
        self.modules = modules  # each MoE layer's experts module (``runtime.forward``'s ``module``)
        self.computes = self.cache.store.expert_bytes >= COMPUTES_MIN_BYTES if computes is None else computes
        self.top_k = max(layer.top_k for layer in runtime.layers.values())
        self.handle = torch.tensor(register(self.__call__))  # a tensor: see layer_slots
        self.draft_handle = torch.tensor(register(self.draft_routed))
        self._live = False
        self._held: tuple[int, list[int]] | None = None  # (layer, experts) acquired by the last call

    def fits(self, num_tokens: int) -> bool:
        return self.computes or num_tokens * self.top_k <= self.cache.capacity

    @contextlib.contextmanager
    def live(self) -> Iterator[None]:
        self._live = True
        try:
            yield
        finally:
            self._live = False
            self._release_held()

    def __call__(self, layer: int, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        if not self._live:
            return torch.zeros_like(x) if self.computes else self._table_row(layer)
        if self.computes:  # the observers are told inside, as on the eager path
            return self.runtime.forward(layer, self.modules[layer], x, top_k_index, top_k_weights)
        self._release_held()  # the graph is past the previous layer: its slots are free for streaming
        self.runtime.notify(layer, x, top_k_index, top_k_weights)
        self.runtime.layers_computed_in_graph += 1
        experts = sorted(set(top_k_index.reshape(-1).tolist()))
        if len(experts) <= self.cache.capacity:
            self.cache.acquire(layer, experts)
            self._held = (layer, experts)
        return self._table_row(layer)

    def _table_row(self, layer: int) -> Tensor:
        return self.cache.slot_table[self.cache.table_rows[layer]].clone()

    def draft_routed(self, layer: int, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> None:
        """A fused draft step routed layer ``layer``: the observers (the draft predictor, hence the
        scheduler's prefetches) see it now, as on the lean step, not after the step."""
        if self._live:
            self.runtime.notify(layer, x, top_k_index, top_k_weights, "draft")

    def _release_held(self) -> None:
        if self._held is not None:
            layer, experts = self._held
            self._held = None
            self.cache.release(layer, experts)
