"""One grouped pass over a layer's chosen experts, read in place from stacked weights (cache slots).

Contract:
- ``grouped_experts(x [T, H], ids [T, k], weights [T, k], gate_up [S, 2I, H], down [S, H, I],
  apply_gate) -> [T, H]`` in x's dtype: every (token, j) pair runs expert ``ids[t, j]`` of the
  stacked tensors, ``down @ apply_gate(gate_up @ x)``, scaled by ``weights[t, j]`` and summed over
  the k pairs, as transformers' ``grouped_mm_experts_forward`` does. Tokens routed to the same
  expert are batched, each expert's weights are read once for all of them, and the whole layer is
  two ``torch._grouped_mm`` calls plus a fixed number of index operations: no Python loop over
  tokens or experts and no device-to-host synchronisation.
- The up projection is computed transposed, ``gate_up[e] @ X_e^T`` (the 3-D x 2-D form of
  ``_grouped_mm``, groups along the token columns), and a group of a single token is given a
  second, zero column. Measured on this project's CPU (MKL, one thread, a 8 MiB [8192, 256]
  fp32 matrix): ``x @ W^T`` with 1-5 rows ran at 7-15 GB/s of weights, the transposed form with
  2-5 columns at 10-19 GB/s, and a single column falls back to a slow matrix-vector path. The down
  projection keeps the ``x @ W^T`` form (the faster one for its [H, I] shape) over the real rows.
- On a CPU in float32 where Specter's native kernels build (``specter.kernels.native_rows``), both
  projections are one ``grouped_rows`` call each over the pairs sorted by expert (no padding, no
  transposes): each expert's weight rows are read once for its 1-8 tokens at 7-8 GB/s, against
  2.6 ms per 12 MiB expert through ``_grouped_mm`` (above). Elsewhere, and when autograd records
  (the native kernel has no backward), the ``_grouped_mm`` form.
- ``blocked`` (every entry point; ``specter.model.expert_layout``): ``gate_up`` and ``down`` are
  stored blocked: the native path reads them with ``blocked_rows``' kernel (its bits), the
  ``_grouped_mm`` form (autograd, no native kernels) computes from unblocked copies.
- Numerics: float32 accumulation inside each product as in the model's own path, but a different
  summation order, so results agree with transformers' kernel to rounding, not bit for bit.
- ``PairsBySlot(x, slot_ids, weights, n_slots)``: the same pairs sorted by slot once, computed a
  set of slots at a time (``compute(slots, ...)``, as their weights arrive) and summed over j once
  (``result``): the bits of ``native_grouped_experts`` in one call, for any split of the slots
  (``takes_native`` must hold; eager only: a wave's rows have a data-dependent count).
- ``PairsByExpert(x, ids, weights, pair_experts=None)``: the same for a gate that ``is_silu_glu``
  (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek), with no tensor work before the first wave: the pairs
  are grouped by expert in host lists from one copy of ``ids`` (a layer has a few dozen; the
  caller's ``ids.reshape(-1).tolist()`` when it already has one), each wave
  (``compute(experts, slots, ...)``: those experts, whose weights are in those slots) is one native
  call (``native_rows.glu_expert_pairs``) writing its pairs' rows in place, and ``result`` sums
  over j: the bits of ``native_grouped_experts`` for any split of the experts.
- ``supports(module)``: whether a transformers experts module has the layout this kernel covers
  (gated, [out, in] weights, no biases, no post-expert norm: Mixtral, Qwen2/3-MoE, OLMoE,
  DeepSeek, PhiMoE); other layouts use transformers' own kernel.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from transformers.activations import SiLUActivation
from transformers.integrations import moe as hf_moe

from specter.kernels import native_rows
from specter.memory.blocked_layout import unblock
from specter.model.layout import is_plain_gated

_SILU_TYPES = (nn.SiLU, SiLUActivation)
_DEFAULT_APPLY_GATE = getattr(hf_moe, "_default_apply_gate", None)  # private in transformers: None if it moves

ApplyGate = Callable[[Tensor], Tensor]  # [..., 2I] -> [..., I]


supports = is_plain_gated  # (module) -> bool: see the module docstring


def grouped_experts(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor, apply_gate: ApplyGate,
    blocked: bool = False,
) -> Tensor:
    if takes_native(x, weights, gate_up, down):
        return native_grouped_experts(x, ids, weights, gate_up, down, apply_gate, blocked)
    if blocked:  # autograd, or no native kernels: the standard layout's copies
        gate_up, down = unblock(gate_up), unblock(down)
    n_tokens, top_k = ids.shape
    n_groups = gate_up.shape[0]
    pairs = ids.reshape(-1)
    sorted_ids, order = torch.sort(pairs, stable=True)  # pairs grouped by expert
    counts = torch.bincount(sorted_ids, minlength=n_groups)
    real_ends = torch.cumsum(counts, 0)
    padded = torch.where(counts == 1, 2, counts)  # a lone token gets a zero partner column
    padded_ends = torch.cumsum(padded, 0)
    rank = torch.arange(pairs.numel(), device=pairs.device) - (real_ends - counts)[sorted_ids]
    column = (padded_ends - padded)[sorted_ids] + rank  # each sorted pair's column in the padded layout

    tokens = x.new_zeros(2 * pairs.numel(), x.shape[1])  # [columns, H]; columns past the end unused
    tokens[column] = x[order // top_k]
    # tokens.T is a column-major [H, columns] view: the layout MKL's fast small-N path wants
    up = torch._grouped_mm(gate_up, tokens.T, offs=padded_ends.to(torch.int32))  # [2I, columns]
    hidden = apply_gate(up.T[column])  # [pairs, I], real columns only, in sorted order
    out = torch._grouped_mm(hidden, down.transpose(1, 2), offs=real_ends.to(torch.int32))  # [pairs, H]
    out = out * weights.reshape(-1)[order].unsqueeze(-1)  # promotes as transformers does (fp32 weights)
    unsorted = torch.empty_like(out)
    unsorted[order] = out
    return unsorted.view(n_tokens, top_k, -1).sum(dim=1).to(x.dtype)


def is_silu_glu(module: nn.Module) -> bool:
    """Whether ``module``'s gate is transformers' default (``gate, up = chunk(2)``,
    ``act_fn(gate) * up``) with a SiLU ``act_fn``: what ``native_rows.glu_expert_pairs`` computes."""
    return (_DEFAULT_APPLY_GATE is not None and getattr(type(module), "_apply_gate", None) is _DEFAULT_APPLY_GATE
            and type(getattr(module, "act_fn", None)) in _SILU_TYPES)


def takes_native(x: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor) -> bool:
    """Whether ``grouped_experts`` computes through the native kernel (``PairsBySlot``'s
    precondition): ``native_rows.serves`` and no autograd to record."""
    return native_rows.serves(x, gate_up, down) and not _needs_grad(x, weights, gate_up, down)


def _needs_grad(*tensors: Tensor) -> bool:
    """The native kernel has no backward: autograd takes the ``_grouped_mm`` form."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def native_grouped_experts(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor, apply_gate: ApplyGate,
    blocked: bool = False,
) -> Tensor:
    """``grouped_experts`` through ``native_rows.grouped_rows`` (``serves`` must hold). Static
    shapes only (the group ends come from a scatter-add over the stacked experts), so a compiled
    graph traces it whole and new ``ids`` never recompile. Each row of ``grouped_rows`` is
    computed alone, so a pair's bits depend on its own token and expert only."""
    n_tokens, top_k = ids.shape
    pairs = ids.reshape(-1)
    order = torch.sort(pairs, stable=True).indices  # pairs grouped by expert
    counts = torch.zeros(gate_up.shape[0], dtype=torch.long, device=ids.device)
    ends = counts.scatter_add(0, pairs, torch.ones_like(pairs)).cumsum(0)
    out = _sorted_pairs(x[order // top_k], weights.reshape(-1)[order].unsqueeze(-1), gate_up, down, ends, apply_gate,
                        blocked)
    unsorted = torch.zeros_like(out).index_copy(0, order, out)
    return unsorted.view(n_tokens, top_k, -1).sum(dim=1).to(x.dtype)


def _sorted_pairs(x: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor, ends: Tensor,
                  apply_gate: ApplyGate, blocked: bool) -> Tensor:
    """Pairs sorted by expert (rows ``ends[s-1] .. ends[s]`` of ``x [P, H]`` run expert ``s``),
    each scaled by its ``weights [P, 1]``: ``[P, H]``, float32."""
    hidden = apply_gate(native_rows.grouped_rows(x, gate_up, ends, blocked))  # [P, I]
    return native_rows.grouped_rows(hidden, down, ends, blocked) * weights


class PairsBySlot:
    """A layer's (token, j) pairs sorted by slot once; ``compute`` runs the pairs of some slots
    (rows gathered by a slot mask, the other slots' groups left empty), ``result`` sums over j."""

    def __init__(self, x: Tensor, slot_ids: Tensor, weights: Tensor, n_slots: int, blocked: bool = False) -> None:
        self._shape = slot_ids.shape  # [T, k]
        self._blocked = blocked
        flat = slot_ids.reshape(-1)
        self._order = torch.sort(flat, stable=True).indices
        self._sorted_slots = flat[self._order]
        self._counts = torch.zeros(n_slots, dtype=torch.long, device=flat.device).scatter_add(
            0, flat, torch.ones_like(flat))
        ends = self._counts.cumsum(0).tolist()
        self._bounds = list(zip([0, *ends[:-1]], ends))  # each slot's rows, a range of the sorted pairs
        self._x = x[self._order // self._shape[1]]
        self._weights = weights.reshape(-1)[self._order].unsqueeze(-1)
        self._dtype = x.dtype
        self._out: Tensor | None = None  # [T * k, H] in sorted order

    def compute(self, slots: list[int], gate_up: Tensor, down: Tensor, apply_gate: ApplyGate) -> None:
        """The pairs of ``slots``."""
        if len(slots) == 1:  # the slot's rows are one range, read in place
            start, end = self._bounds[slots[0]]
            ends = torch.tensor([end - start], device=self._counts.device)
            self._output(down)[start:end] = _sorted_pairs(self._x[start:end], self._weights[start:end],
                                                          gate_up[slots[0] : slots[0] + 1],
                                                          down[slots[0] : slots[0] + 1], ends, apply_gate,
                                                          self._blocked)
            return
        in_set = torch.zeros_like(self._counts, dtype=torch.bool)
        in_set[torch.tensor(slots, device=in_set.device)] = True
        rows = in_set[self._sorted_slots].nonzero().squeeze(-1)
        ends = torch.where(in_set, self._counts, 0).cumsum(0)
        out = _sorted_pairs(self._x[rows], self._weights[rows], gate_up, down, ends, apply_gate, self._blocked)
        self._output(down).index_copy_(0, rows, out)

    def _output(self, down: Tensor) -> Tensor:
        """The pairs' output buffer ``[T * k, H]`` (H from ``down``), allocated (zeros) by the first wave."""
        if self._out is None:
            self._out = self._x.new_zeros(self._x.shape[0], down.shape[1], dtype=torch.float32)
        return self._out

    def result(self) -> Tensor:
        """``[T, H]``: every pair's output summed over j (pairs never computed count as zero)."""
        assert self._out is not None, "compute() ran on no slots"
        pairs = torch.zeros_like(self._out).index_copy(0, self._order, self._out)
        return pairs.view(*self._shape, -1).sum(dim=1).to(self._dtype)


class PairsByExpert:
    """A layer's (token, j) pairs grouped by expert in host lists; ``compute`` runs some experts'
    pairs in one native call (a silu-gated GLU, ``is_silu_glu``), ``result`` sums over j."""

    def __init__(self, x: Tensor, ids: Tensor, weights: Tensor, pair_experts: list[int] | None = None,
                 blocked: bool = False) -> None:
        self._shape = ids.shape  # [T, k]
        self._blocked = blocked
        self._x = x.contiguous()
        self._weights = weights.reshape(-1).contiguous()
        self._pairs_of: dict[int, list[int]] = {}  # expert -> its pairs p = t * k + j, increasing
        for pair, expert in enumerate(ids.reshape(-1).tolist() if pair_experts is None else pair_experts):
            self._pairs_of.setdefault(expert, []).append(pair)
        self._out: Tensor | None = None  # [T * k, H] float32, pair order

    def compute(self, experts: list[int], slots: list[int], gate_up: Tensor, down: Tensor) -> None:
        """The pairs of ``experts``, whose weights are ``gate_up[slots[i]]`` and ``down[slots[i]]``."""
        if self._out is None:
            self._out = self._x.new_zeros(self._x.shape[0] * self._shape[1], down.shape[1], dtype=torch.float32)
        pairs: list[int] = []
        starts = [0]
        for expert in experts:
            pairs += self._pairs_of.get(expert, ())
            starts.append(len(pairs))
        native_rows.glu_expert_pairs(self._out, self._x, gate_up, down, self._weights, self._shape[1], slots, starts,
                                     pairs, self._blocked)

    def result(self) -> Tensor:
        """``[T, H]``: every pair's output summed over j (pairs never computed count as zero)."""
        assert self._out is not None, "compute() ran on no experts"
        return self._out.view(*self._shape, -1).sum(dim=1).to(self._x.dtype)
