"""The experts implementation Specter registers with transformers, and the runtime behind it.

Contract:
- ``use_grouped_kernel(model)`` points a model whose experts stay its own (the ``resident``
  engine) at ``specter.kernels.grouped_experts`` on a CPU, when every experts module has the
  layout it covers, so that the resident speed limit uses the same expert kernel as the offloaded
  engines, with the experts in the layout they choose (``specter.model.expert_layout``: blocked
  in place where ``chooses_blocked``); returns whether it did.
- ``install(model, runtime)`` registers the ``"specter"`` experts implementation
  (``transformers.integrations.moe.ExpertsInterface``) and points every routed-experts module of
  the model at ``runtime``; ``uninstall(model)`` restores the model's previous implementation;
  ``installed(model)`` says whether one is in.
- ``ExpertRuntime.forward(layer, module, hidden [T,H], top_k_index [T,k], top_k_weights [T,k])``
  computes one MoE layer. In ``target`` mode the full-precision experts come from device cache
  slots (loaded on demand when missing); in ``draft`` mode from the layer's resident INT4 copy.
  Every call first reports the routing to the runtime's observers (predictors, metrics):
  ``notify(layer, hidden, top_k_index, top_k_weights, mode=None)``, which the compiled paths call too.
- Slot computation runs straight from the slot tensors with expert ids remapped to slot ids: on
  a CPU, for the common gated layout, ``specter.kernels.grouped_experts`` (every needed expert
  read once for all the tokens routed to it, no per-expert Python loop, no host sync); otherwise
  transformers' own grouped-GEMM expert math (``grouped_mm_experts_forward``). Both agree with
  the model's own experts to float rounding. Slots hold the store's layout (``store.blocked``:
  blocked, ``specter.model.expert_layout``), which the slot views pass to the kernels.
- Waves (``waves``, on by default; Specter's native kernel only, where one pair's bits depend on
  its own token and expert alone): a layer whose experts are not all READY acquires them without
  waiting and computes them as their copies arrive, each wave the experts READY then; a wave's
  slots are released at once and ``on_release(layer, experts)`` (the speculative engines: the
  scheduler's ``computed``) streams the next predictions into them while the rest still copy.
  The pairs' outputs are summed over j once at the end: the same bits as one pass. A silu-gated
  GLU groups the pairs by expert from one host copy of the routing, each wave one native call
  (``PairsByExpert``), and takes that path when every expert is READY at once too (one wave);
  other gates sort them by slot (``PairsBySlot``), or run one pass when nothing copies. ``overlap_s``
  adds up the seconds of waves computed while later experts of their layer were still copying.
- ``kernel_s`` adds up the seconds spent in target-mode expert kernels (waves and one passes, the
  routing's slot lookup and the final sum left out) where the cache's slots are on a CPU, whose
  kernels return when done; None on other devices (their kernels run asynchronously).
  ``layers_computed_in_graph`` counts the target layers a compiled graph computed from the slots
  itself (``specter.compile.host_layer``'s slot rows): their kernels' time is not in ``kernel_s``.
- When a layer needs more distinct experts than the cache has slots (a long prefill), the experts
  are streamed through the slots in chunks; chunk outputs are summed per token.
- Outside inference mode with inputs that require grad, a layer computes from a copy of its slots
  (autograd saves the weights, and a later load would overwrite a slot), so gradients reach the
  inputs; the offloaded expert weights themselves are frozen. The forward is opaque to a user's
  ``torch.compile`` (``torch.compiler.disable``): a graph break, no guards on cache state.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Protocol

import torch
from torch import nn
from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

from specter.kernels.grouped_experts import (PairsByExpert, PairsBySlot, grouped_experts, is_silu_glu, supports,
                                             takes_native)
from specter.errors import SpecterError
from specter.model.expert_layout import block_module, chooses_blocked, is_blocked, mark
from specter.model.layout import MoELayer

IMPLEMENTATION_NAME = "specter"
GROUPED_IMPLEMENTATION_NAME = "specter-grouped"
RoutingObserver = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, str], None]
"""(layer, hidden [T,H], top_k_index [T,k], top_k_weights [T,k], mode "target" | "draft")"""


@torch.compiler.disable  # a user's torch.compile must not trace (and guard on) the cache's bookkeeping
def _specter_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    runtime = getattr(self, "_specter_runtime", None)
    if runtime is None:  # a module Specter does not manage: behave like the default implementation
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return runtime.forward(self._specter_layer, self, hidden_states, top_k_index, top_k_weights)


def _grouped_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The ``specter-grouped`` implementation, and the slot math of every cache step (``self`` a
    ``SlotView`` there): Specter's grouped kernel on a CPU for the layouts it covers, else
    transformers' own grouped-GEMM math."""
    if hidden_states.device.type != "cpu" or not supports(self):
        if is_blocked(self):  # transformers' math would read the blocked bits as the standard layout
            raise SpecterError(f"experts stored blocked (a CPU layout, specter.model.expert_layout) cannot be "
                               f"computed on {hidden_states.device}: build the store for the device that computes")
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return grouped_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                           self._apply_gate, is_blocked(self))


def register_implementation() -> None:
    if IMPLEMENTATION_NAME not in ExpertsInterface._global_mapping:
        ExpertsInterface.register(IMPLEMENTATION_NAME, _specter_experts_forward)
    if GROUPED_IMPLEMENTATION_NAME not in ExpertsInterface._global_mapping:
        ExpertsInterface.register(GROUPED_IMPLEMENTATION_NAME, _grouped_experts_forward)


def use_grouped_kernel(model: nn.Module) -> bool:
    from specter.model.layout import moe_layers

    layers = moe_layers(model)
    if not layers or any(not supports(m.experts) or m.experts.gate_up_proj.device.type != "cpu" for m in layers):
        return False
    register_implementation()
    model.set_experts_implementation(GROUPED_IMPLEMENTATION_NAME)
    for info in layers:
        weight = info.experts.gate_up_proj
        if not is_blocked(info.experts) and chooses_blocked(info.experts, weight.dtype, weight.device):
            block_module(info.experts)
    return True


class SlotView(nn.Module):
    """Stands in for an experts module inside ``grouped_mm_experts_forward``: same flags, gate and
    activation as the real module, but its stacked tensors are the cache's slot buffers."""

    def __init__(self, module: nn.Module, slots: dict[str, torch.Tensor], blocked: bool = False) -> None:
        super().__init__()
        mark(self, blocked)  # the slots hold experts blocked (specter.model.expert_layout)
        object.__setattr__(self, "_module", module)
        self.num_experts = next(iter(slots.values())).shape[0]
        for flag in ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm"):
            setattr(self, flag, getattr(module, flag))
        self._is_expert_parallel = False
        self.act_fn = getattr(module, "act_fn", None)
        self.post_expert_norm = getattr(module, "post_expert_norm", None)
        for name, buffer in slots.items():
            object.__setattr__(self, name, buffer)

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        return self._module._apply_gate(gate_up_out)


class DraftExperts(Protocol):
    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor: ...


class ExpertRuntime:
    """Serves every MoE layer of one model from an ExpertCache (target) or INT4 experts (draft)."""

    def __init__(self, layers: list[MoELayer], cache, draft: dict[int, DraftExperts] | None = None) -> None:
        self.layers = {m.layer: m for m in layers}
        self.cache = cache
        self.draft = draft or {}
        self.mode = "target"
        self.observers: list[RoutingObserver] = []
        blocked = cache.store.blocked if cache is not None else False
        self._views = {m.layer: SlotView(m.experts, cache.slots, blocked) for m in layers} if cache is not None else {}
        self._silu_glu = {m.layer: is_silu_glu(m.experts) for m in layers}  # waves through PairsByExpert
        self.waves = True  # see _compute_in_waves; False: one wait for all of a layer's experts
        self.on_release: Callable[[int, list[int]], None] | None = None  # (layer, experts) freed mid-layer
        self.overlap_s = 0.0  # seconds of waves computed while later experts of their layer still copied
        self.kernel_s: float | None = 0.0 if cache is not None and cache.device.type == "cpu" else None
        self.layers_computed_in_graph = 0

    @contextlib.contextmanager
    def drafting(self) -> Iterator[None]:
        previous, self.mode = self.mode, "draft"
        try:
            yield
        finally:
            self.mode = previous

    def notify(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
               mode: str | None = None) -> None:
        """Tell every observer a layer's routing (``mode``: the runtime's own when None)."""
        for observe in self.observers:
            observe(layer, hidden, top_k_index, top_k_weights, mode or self.mode)

    def forward(
        self, layer: int, module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        self.notify(layer, hidden, top_k_index, top_k_weights)
        if self.mode == "draft":
            return self.draft[layer].forward(hidden, top_k_index, top_k_weights)
        return self._forward_from_slots(layer, module, hidden, top_k_index, top_k_weights)

    def _forward_from_slots(
        self, layer: int, module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        pair_experts = top_k_index.reshape(-1).tolist()  # one host copy; a set of a few dozen ints beats unique()
        needed = sorted(set(pair_experts))
        capacity = self.cache.capacity
        view = self._views[layer]
        if len(needed) <= capacity:
            if self.waves and supports(view) and takes_native(hidden, top_k_weights, view.gate_up_proj, view.down_proj):
                return self._compute_in_waves(layer, view, needed, hidden, top_k_index, top_k_weights, pair_experts)
            return self._compute_chunk(layer, view, needed, hidden, top_k_index, top_k_weights)
        output = torch.zeros_like(hidden)
        for start in range(0, len(needed), capacity):
            chunk = needed[start : start + capacity]
            in_chunk = torch.isin(top_k_index, torch.tensor(chunk, device=top_k_index.device))  # [T, k]
            rows = in_chunk.any(dim=-1).nonzero().squeeze(-1)
            weights = torch.where(in_chunk[rows], top_k_weights[rows], torch.zeros_like(top_k_weights[rows]))
            # pairs outside the chunk are pointed at the chunk's first expert with weight 0
            index = torch.where(in_chunk[rows], top_k_index[rows], torch.full_like(top_k_index[rows], chunk[0]))
            partial = self._compute_chunk(layer, view, chunk, hidden[rows], index, weights)
            output.index_add_(0, rows, partial)
        return output

    def _compute_in_waves(
        self, layer: int, view: SlotView, experts: list[int], hidden: torch.Tensor,
        top_k_index: torch.Tensor, top_k_weights: torch.Tensor, pair_experts: list[int],
    ) -> torch.Tensor:
        """The layer's experts in waves as their copies arrive: each wave computes the experts READY
        then, releases their slots and tells ``on_release`` (the scheduler streams the next keys
        into them) while the rest still copy. Each (token, j) pair is computed once and the sum
        over j taken once at the end: the same bits as one pass. A silu-gated GLU goes through
        ``PairsByExpert`` even when every expert is READY at once (one wave, one native call: fewer
        small tensor ops than the one-pass kernel's sort, gathers and scatter); other gates take
        the one-pass kernel then."""
        slots = self.cache.acquire(layer, experts, wait=False)
        pending = list(experts)
        try:
            wave = self.cache.await_any(layer, pending)
            silu_glu = self._silu_glu[layer]
            if len(wave) == len(experts) and not silu_glu:  # nothing was loading: one pass
                return self._one_pass(view, hidden, self._pair_slots(layer, experts, slots, top_k_index),
                                      top_k_weights)
            slot_of = dict(zip(experts, slots))
            if silu_glu:
                by_expert = PairsByExpert(hidden, top_k_index, top_k_weights, pair_experts, is_blocked(view))
                pairs, compute = by_expert, lambda wave: by_expert.compute(
                    wave, [slot_of[e] for e in wave], view.gate_up_proj, view.down_proj)
            else:
                by_slot = PairsBySlot(hidden, self._pair_slots(layer, experts, slots, top_k_index), top_k_weights,
                                      view.gate_up_proj.shape[0], is_blocked(view))
                pairs, compute = by_slot, lambda wave: by_slot.compute(
                    [slot_of[e] for e in wave], view.gate_up_proj, view.down_proj, view._apply_gate)
            while True:
                started = time.perf_counter()
                compute(wave)
                self._add_kernel_time(started)
                self.cache.release(layer, wave)
                pending = [e for e in pending if e not in wave]
                if not pending:
                    return pairs.result()
                if self.on_release is not None:
                    self.on_release(layer, wave)
                self.overlap_s += time.perf_counter() - started
                wave = self.cache.await_any(layer, pending)
        finally:
            if pending:
                self.cache.release(layer, pending)

    def _pair_slots(self, layer: int, experts: list[int], slots: list[int], top_k_index: torch.Tensor) -> torch.Tensor:
        """``top_k_index`` with each of ``experts`` replaced by its slot in ``slots``."""
        lookup = torch.zeros(self.layers[layer].num_experts, dtype=top_k_index.dtype, device=top_k_index.device)
        lookup[torch.tensor(experts, device=lookup.device)] = torch.tensor(slots, dtype=lookup.dtype,
                                                                            device=lookup.device)
        return lookup[top_k_index]

    def _compute_chunk(
        self, layer: int, view: SlotView, experts: list[int], hidden: torch.Tensor,
        top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        slots = self.cache.acquire(layer, experts)
        try:
            if torch.is_grad_enabled() and hidden.requires_grad:
                # autograd keeps the weights for backward, and a later load overwrites the slot:
                # compute from a copy of the slots this layer uses
                slot_ids = torch.tensor(slots, dtype=top_k_index.dtype, device=top_k_index.device)
                view = SlotView(self.layers[layer].experts,
                                {name: buffer.index_select(0, slot_ids) for name, buffer in self.cache.slots.items()},
                                is_blocked(view))
                slots = list(range(len(slots)))
            return self._one_pass(view, hidden, self._pair_slots(layer, experts, slots, top_k_index), top_k_weights)
        finally:
            self.cache.release(layer, experts)

    def _one_pass(self, view: SlotView, hidden: torch.Tensor, pair_slots: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        output = _grouped_experts_forward(view, hidden, pair_slots, top_k_weights)
        self._add_kernel_time(started)
        return output

    def _add_kernel_time(self, started: float) -> None:
        if self.kernel_s is not None:
            self.kernel_s += time.perf_counter() - started


def install(model: nn.Module, runtime: ExpertRuntime) -> None:
    register_implementation()
    model._specter_previous_experts_implementation = model.config._experts_implementation
    for info in runtime.layers.values():
        info.experts._specter_runtime = runtime
        info.experts._specter_layer = info.layer
    model.set_experts_implementation(IMPLEMENTATION_NAME)


def installed(model: nn.Module) -> bool:
    """Whether ``install`` put a runtime into ``model`` (and ``uninstall`` has not taken it out)."""
    return any(hasattr(module, "_specter_runtime") for module in model.modules())


def uninstall(model: nn.Module) -> None:
    previous = getattr(model, "_specter_previous_experts_implementation", None)
    for module in model.modules():
        if hasattr(module, "_specter_runtime"):
            del module._specter_runtime
            del module._specter_layer
    if previous is not None:
        model.set_experts_implementation(previous)
