"""INT4 copies of a transformers MoE layer's routed experts: the resident draft experts.

Contract:
- ``Int4Experts.from_module(experts, group_size=64)`` quantizes every expert's up (gate_up or up)
  and down matrices of a transformers 5 experts module (stacked ``gate_up_proj`` / ``up_proj`` and
  ``down_proj``, [E, out, in], or [E, in, out] when ``is_transposed``) with
  ``specter.kernels.int4.quantize_int4`` in the [out, in] orientation, on the parameters' device.
  Biases are kept as they are (full precision, the module's own tensors, not copies). The module
  itself is kept by reference for ``_apply_gate`` (GPT-OSS's clamped, interleaved gate
  included), ``act_fn`` and ``post_expert_norm``; no other tensor is copied.
- ``forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` in hidden's
  dtype: transformers' expert math (``batched_mm_experts_forward``) with INT4 matmuls. Eagerly,
  tokens are grouped by expert (one matmul per expert hit, ``forward_grouped``); a single token
  (a draft step) runs its k experts directly: on ``cpu-native``, where the experts are
  transformers' default SiLU-gated MLP (``fused_token``), the whole weighted sum in one native
  call (``int4_native.glu_token``: a draft step of the widened model 2.65 against 3.02 ms with
  ``forward_gather``'s row ops, one thread, rounds alternating in one process, medians of 100);
  else on ``cpu-native`` through the native row op, one call per
  matrix for all k experts (``forward_gather``; 1.20-1.33 ms against 1.38-1.51 ms per step of the
  widened model's four layers, one thread), elsewhere one matmul per expert matrix, changing
  dtype once per layer (``forward_one_token``). Under torch.compile ``forward`` takes
  ``forward_static`` (no data-dependent Python, fixed shapes, ``fullgraph=True`` works): one token
  through ``forward_fused_token`` where that serves (the native op as an extern kernel), else it
  picks by shape: ``forward_gather`` (one single-row matmul pair per (token, slot); on the
  cpu-int4pack backend through the custom op ``specter::int4_rows``, which reads each chosen
  expert's packed weights in place, elsewhere from a gathered copy of them) when T*k <= E, else
  ``forward_masked`` (every expert over all T tokens, weighted by its routing weight, 0 where not
  chosen). Measured on
  CPU, one thread, inductor: with T*k <= E gather was 1.1-5.6x faster than masked (tied for
  3.5 MB experts at T*k = E); with T*k > E (8 experts, top-2, T=8) masked was 1.05x (small
  experts) to 1.9x (3.5 MB experts) faster. Under ``dynamic=True`` the gather graph
  specializes on T (one graph per T <= E/k).
- ``nbytes``: bytes of the INT4 weights, scales and kept biases.
- ``quantize_model_experts(model, group_size) -> {layer index: Int4Experts}`` for every experts
  module (3-D ``gate_up_proj`` or ``up_proj`` and ``num_experts``) under ``...layers.<i>...``.
Expert-parallel sentinels (ids >= num_experts) are not supported.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from specter.kernels import int4_native
from specter.kernels.grouped_experts import is_silu_glu
from specter.kernels.int4 import Backend, Int4Weight, int4_matmul, kernel_dtype, quantize_int4, shared_backend
from specter.kernels.int4_rows import IN_PLACE_BACKENDS, rows_in_place


def _out_in(weight: Tensor, transposed: bool) -> Tensor:
    """``weight`` as [E, out, in] (a view; stored [E, in, out] if ``transposed``)."""
    return weight.detach().transpose(1, 2) if transposed else weight.detach()


def _stacked_int4(
    weight: Tensor, transposed: bool, group_size: int, backend: Backend
) -> tuple[list[Int4Weight], Tensor, Tensor]:
    """Quantizes ``weight [E, out, in]`` ([E, in, out] if transposed), one expert at a time.

    Returns E Int4Weights whose tensors are views into the returned stacked packed [E, ...] and
    scales [E, ...] tensors."""
    w = _out_in(weight, transposed)  # [E, N, K]
    num_experts, n, k = w.shape
    per_expert = [quantize_int4(w[e], group_size, backend) for e in range(num_experts)]
    packed = torch.stack([p.packed for p in per_expert])  # [E, ...]
    scales = torch.stack([p.scales for p in per_expert])  # [E, ...]
    views = [Int4Weight(backend, (n, k), group_size, packed[e], scales[e]) for e in range(num_experts)]
    return views, packed, scales


def _restacked(views: list[Int4Weight], packed: Tensor, scales: Tensor) -> list[Int4Weight]:
    return [Int4Weight(w.backend, w.shape, w.group_size, packed[e], scales[e]) for e, w in enumerate(views)]


class Int4Experts:
    """Resident INT4 experts of one MoE layer (see the module docstring)."""

    def __init__(
        self, module: nn.Module, up: tuple[list[Int4Weight], Tensor, Tensor],
        down: tuple[list[Int4Weight], Tensor, Tensor], up_bias: Tensor | None, down_bias: Tensor | None,
    ) -> None:
        self.module = module
        self.has_gate: bool = module.has_gate
        self.up, self.up_packed, self.up_scales = up  # E views; their stacked [E, ...] storage
        self.down, self.down_packed, self.down_scales = down
        self.num_experts = len(self.up)
        self.up_bias, self.down_bias = up_bias, down_bias  # [E, 2I or I], [E, H] or None
        has_post_norm = getattr(module, "has_post_expert_norm", False)
        self.post_norm: nn.Module | None = module.post_expert_norm if has_post_norm else None
        self.fused_token = self.backend == "cpu-native" and _plain_silu_glu(self)

    @classmethod
    def from_module(cls, module: nn.Module, group_size: int = 64, backend: Backend | None = None) -> Int4Experts:
        if getattr(module, "_is_expert_parallel", False):
            raise ValueError("Int4Experts does not support expert-parallel experts modules")
        up_name = "gate_up_proj" if module.has_gate else "up_proj"
        transposed = bool(getattr(module, "is_transposed", False))
        weights = getattr(module, up_name), module.down_proj
        if backend is None:  # one backend for both: every path reads the two through the up's
            backend = shared_backend([tuple(_out_in(w, transposed).shape[1:]) for w in weights], group_size,
                                     weights[0].device)
        up = _stacked_int4(weights[0], transposed, group_size, backend)
        down = _stacked_int4(weights[1], transposed, group_size, backend)
        has_bias = bool(getattr(module, "has_bias", False))
        up_bias = getattr(module, f"{up_name}_bias").detach() if has_bias else None
        down_bias = module.down_proj_bias.detach() if has_bias else None
        return cls(module, up, down, up_bias, down_bias)

    def move_storage(self, place: Callable[[Tensor], Tensor]) -> None:
        """The stacked packed weights and scales replaced by ``place(tensor)`` (the same values in
        other memory, e.g. ``huge_pages.rehome``), the per-expert views rebuilt on them."""
        self.up_packed, self.up_scales = place(self.up_packed), place(self.up_scales)
        self.down_packed, self.down_scales = place(self.down_packed), place(self.down_scales)
        self.up = _restacked(self.up, self.up_packed, self.up_scales)
        self.down = _restacked(self.down, self.down_packed, self.down_scales)

    @property
    def backend(self) -> Backend:
        return self.up[0].backend

    @property
    def group_size(self) -> int:
        return self.up[0].group_size

    @property
    def nbytes(self) -> int:
        held = [self.up_packed, self.up_scales, self.down_packed, self.down_scales, self.up_bias, self.down_bias]
        return sum(t.nbytes for t in held if t is not None)

    def __call__(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return self.forward(hidden, top_k_index, top_k_weights)

    def forward(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            return self.forward_static(hidden, top_k_index, top_k_weights)
        return self.forward_grouped(hidden, top_k_index, top_k_weights)

    def _activate(self, up_out: Tensor) -> Tensor:
        # [t, 2I] -> [t, I] (gated) or [t, I] -> [t, I]
        return self.module._apply_gate(up_out) if self.has_gate else self.module.act_fn(up_out)

    def _expert(self, e: int, x: Tensor) -> Tensor:
        """Expert ``e`` on ``x [t, H]`` -> [t, H] (before post norm and routing weight)."""
        h = self.up[e].linear(x)  # [t, 2I]
        if self.up_bias is not None:
            h = h + self.up_bias[e].to(h.dtype)
        y = self.down[e].linear(self._activate(h))  # [t, H]
        if self.down_bias is not None:
            y = y + self.down_bias[e].to(y.dtype)
        return y

    def _combine(self, expert_out: Tensor, top_k_weights: Tensor, dtype: torch.dtype) -> Tensor:
        """``expert_out [T*k, H]`` in (token, slot) order -> weighted sum over slots [T, H]."""
        if self.post_norm is not None:
            expert_out = self.post_norm(expert_out)
        num_tokens, top_k = top_k_weights.shape
        weighted = expert_out * top_k_weights.reshape(-1, 1).to(expert_out.dtype)  # [S, H]
        return weighted.view(num_tokens, top_k, -1).sum(dim=1).to(dtype)  # [T, H]

    def forward_one_token(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """Eager path of a single token (every draft step): no sorting or scatter, and the
        activations change dtype once per layer rather than once per expert (the kernels' bf16
        in and out; the activation function and the weighted sum in float32): each of the k
        experts is one up and one down matmul, the rest runs once over all k rows."""
        experts = top_k_index[0].tolist()
        dtype = kernel_dtype(self.backend, hidden.dtype)
        x = hidden.to(dtype)  # [1, H]
        h = torch.cat([self.up[e].linear(x) for e in experts]).float()  # [k, 2I or I]
        if self.up_bias is not None:
            h = h + self.up_bias[experts].float()
        a = self._activate(h).to(dtype)  # [k, I]
        y = torch.cat([self.down[e].linear(a[slot : slot + 1]) for slot, e in enumerate(experts)]).float()  # [k, H]
        if self.down_bias is not None:
            y = y + self.down_bias[experts].float()
        if self.post_norm is not None:
            y = self.post_norm(y)
        return (top_k_weights[0].float() @ y)[None].to(hidden.dtype)  # [1, H]

    @property
    def glu_token_weights(self) -> tuple[tuple[Tensor, Tensor, int], tuple[Tensor, Tensor, int]]:
        """(up, down) as ``int4_native.glu_token`` takes them: (packed, scales, group size) each."""
        return ((self.up_packed, self.up_scales, self.up[0].group_size),
                (self.down_packed, self.down_scales, self.down[0].group_size))

    def forward_fused_token(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """One token's whole SiLU-gated sum in one native call (``fused_token`` must hold)."""
        return int4_native.glu_token(hidden, *self.glu_token_weights, top_k_index[0],
                                     top_k_weights[0]).to(hidden.dtype)

    def forward_grouped(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """Eager path: the (token, slot) pairs sorted by expert, one matmul per expert hit."""
        if hidden.shape[0] == 1:
            if self.fused_token:
                return self.forward_fused_token(hidden, top_k_index, top_k_weights)
            if self.backend == "cpu-native":  # one native call per matrix for the k experts
                return self.forward_gather(hidden, top_k_index, top_k_weights)
            return self.forward_one_token(hidden, top_k_index, top_k_weights)
        top_k = top_k_index.shape[-1]
        expert_ids = top_k_index.reshape(-1)  # [S]
        order = torch.argsort(expert_ids, stable=True)  # [S]
        counts = torch.bincount(expert_ids, minlength=self.num_experts).tolist()
        rows = hidden[order // top_k]  # [S, H], grouped by expert
        outs: list[Tensor] = []
        start = 0
        for e, count in enumerate(counts):
            if count:
                outs.append(self._expert(e, rows[start : start + count]))
                start += count
        grouped = torch.cat(outs)  # [S, H]
        expert_out = torch.empty_like(grouped)
        expert_out[order] = grouped  # back to (token, slot) order
        return self._combine(expert_out, top_k_weights, hidden.dtype)

    def forward_static(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """Compile path (fixed shapes, no data-dependent control flow): one token through
        ``forward_fused_token`` where it serves, else ``forward_gather`` when the T*k (token,
        slot) pairs are no more than the experts, else ``forward_masked``."""
        if self.fused_token and hidden.shape[0] == 1:  # an extern kernel in a compiled graph
            return self.forward_fused_token(hidden, top_k_index, top_k_weights)
        if top_k_index.numel() <= self.num_experts:
            return self.forward_gather(hidden, top_k_index, top_k_weights)
        return self.forward_masked(hidden, top_k_index, top_k_weights)

    def forward_masked(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """Every expert over all tokens, weighted by its routing weight (0 where not chosen):
        E matmul pairs of T rows."""
        num_tokens = hidden.shape[0]
        # [T, E]: each token's routing weight per expert
        dense = torch.zeros(num_tokens, self.num_experts, dtype=top_k_weights.dtype, device=hidden.device)
        dense = dense.scatter_add(1, top_k_index, top_k_weights)
        out = torch.zeros(num_tokens, hidden.shape[-1], dtype=torch.float32, device=hidden.device)  # [T, H]
        for e in range(self.num_experts):
            y = self._expert(e, hidden)  # [T, H]
            if self.post_norm is not None:
                y = self.post_norm(y)
            out = out + y.float() * dense[:, e : e + 1].float()
        return out.to(hidden.dtype)

    def forward_gather(self, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """Static variant: one single-row matmul pair per (token, slot), the chosen experts'
        packed weights read in place (``specter::int4_rows``) on the cpu-int4pack backend, else
        gathered by index (a copy each). A compiled draft step on a CPU with the gathered copies
        took 28 ms on the widened model against 9 ms in place (one thread)."""
        top_k = top_k_index.shape[-1]
        expert_ids = top_k_index.reshape(-1)  # [S]
        x = hidden.repeat_interleave(top_k, dim=0)  # [S, H]
        if self.backend in IN_PLACE_BACKENDS:
            return self._rows_in_place(x, expert_ids, top_k_weights, hidden.dtype)
        up_packed, up_scales = self.up_packed[expert_ids], self.up_scales[expert_ids]  # [S, ...]
        down_packed, down_scales = self.down_packed[expert_ids], self.down_scales[expert_ids]  # [S, ...]
        up, down = self.up[0], self.down[0]
        outs: list[Tensor] = []
        for s in range(expert_ids.shape[0]):
            h = int4_matmul(x[s : s + 1], up_packed[s], up_scales[s], up.backend, up.shape, up.group_size)  # [1, 2I]
            outs.append(h)
        h = torch.cat(outs)  # [S, 2I]
        if self.up_bias is not None:
            h = h + self.up_bias[expert_ids].to(h.dtype)
        h = self._activate(h)  # [S, I]
        outs = [
            int4_matmul(h[s : s + 1], down_packed[s], down_scales[s], down.backend, down.shape, down.group_size)
            for s in range(expert_ids.shape[0])
        ]
        y = torch.cat(outs)  # [S, H]
        if self.down_bias is not None:
            y = y + self.down_bias[expert_ids].to(y.dtype)
        return self._combine(y, top_k_weights, hidden.dtype)

    def _rows_in_place(self, x: Tensor, expert_ids: Tensor, top_k_weights: Tensor, dtype: torch.dtype) -> Tensor:
        """``forward_gather`` on the CPU: the (token, slot) rows ``x [S, H]`` through their experts'
        packed weights in place (``specter::int4_rows``, one opaque op per matrix, no copies)."""
        up, down = self.up[0], self.down[0]
        h = rows_in_place(x, self.up_packed, self.up_scales, expert_ids, up.group_size, up.out_features,
                          self.backend)  # [S, 2I]
        if self.up_bias is not None:
            h = h + self.up_bias[expert_ids].to(h.dtype)
        h = self._activate(h)  # [S, I]
        y = rows_in_place(h, self.down_packed, self.down_scales, expert_ids, down.group_size,
                          down.out_features, self.backend)  # [S, H]
        if self.down_bias is not None:
            y = y + self.down_bias[expert_ids].to(y.dtype)
        return self._combine(y, top_k_weights, dtype)


def _plain_silu_glu(experts: Int4Experts) -> bool:
    """Whether the experts are transformers' default SiLU-gated MLP (the gate the first half of
    gate_up, no biases, no post norm): what ``int4_native.glu_token`` computes."""
    module = getattr(experts.module, "_module", experts.module)  # through the runtime's SlotView
    return (experts.has_gate and experts.up_bias is None and experts.down_bias is None and experts.post_norm is None
            and is_silu_glu(module))


def quantize_model_experts(
    model: nn.Module, group_size: int = 64, backend: Backend | None = None
) -> dict[int, Int4Experts]:
    """INT4 copies of every routed-experts module of a transformers MoE model, by decoder layer."""
    from specter.model.layout import moe_layers

    return {info.layer: Int4Experts.from_module(info.experts, group_size, backend) for info in moe_layers(model)}
