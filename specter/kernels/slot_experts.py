"""Full-precision routed experts addressed by index, written so that inductor fuses them.

Contract:
- ``gather_experts(x [T, H], ids [T, k], weights [T, k], gate_up [N, 2I, H], down [N, H, I],
  apply_gate) -> [T, H]`` in x's dtype: for every (token, slot) pair, expert ``ids[t, j]`` of the
  stacked tensors (a layer's own experts, or the cache's slot buffers) computes
  ``down @ apply_gate(gate_up @ x)``, scaled by ``weights[t, j]`` (the product promoted as the
  eager kernels promote it: float32 where the weights are, as Mixtral's and DeepSeek's; the model's
  dtype where they are in it) and summed over the k pairs. The products are written as
  broadcast-multiply-and-sum over ``gate_up[ids]``, which inductor lowers to one reduction loop
  that reads the chosen experts' rows in place: no weight copy, no data-dependent shape, so new
  ``ids`` (new cache contents) never recompile. Each pair reads its expert, so the cost grows with
  T*k: meant for decode and verification.
- ``slots_for(table_row [E], top_k_index [T, k]) -> (slots [T, k], missing [] bool)``: the cache
  slot of every chosen expert, read from the device slot table (-1 = not resident). Absent
  experts are pointed at slot 0 so the result is always safe to index with; ``missing`` says
  whether there were any (the caller then discards what it computed).
- ``gather_biased_experts(x, ids, weights, gate_up [N, H, 2I], down [N, I, H], apply_gate,
  gate_up_bias [N, 2I], down_bias [N, H])``: the same for GPT-OSS's layout, ``[in, out]`` weights
  with biases (``x @ gate_up + bias``; ``apply_gate`` the module's own, which reads the interleaved
  gate/up columns).
Gated experts only: ``gather_experts`` the [out, in] layout without biases (Mixtral, Qwen2/3-MoE,
OLMoE, PhiMoE, DeepSeek).
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor

ApplyGate = Callable[[Tensor], Tensor]  # [..., 2I] -> [..., I]


def gather_experts(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor, apply_gate: ApplyGate
) -> Tensor:
    h = (x[:, None, None, :] * gate_up[ids]).sum(-1)  # [T, k, 2I]
    a = apply_gate(h)  # [T, k, I]
    y = (a[:, :, None, :] * down[ids]).sum(-1)  # [T, k, H]
    return (y * weights[..., None]).sum(1).to(x.dtype)  # [T, H]; products promote as the eager kernels' do


def gather_biased_experts(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor, apply_gate: ApplyGate,
    gate_up_bias: Tensor, down_bias: Tensor,
) -> Tensor:
    h = (x[:, None, :, None] * gate_up[ids]).sum(-2) + gate_up_bias[ids]  # [T, k, 2I]
    a = apply_gate(h)  # [T, k, I]
    y = (a[:, :, :, None] * down[ids]).sum(-2) + down_bias[ids]  # [T, k, H]
    return (y * weights[..., None]).sum(1).to(x.dtype)  # [T, H]; products promote as the eager kernels' do


def slots_for(table_row: Tensor, top_k_index: Tensor) -> tuple[Tensor, Tensor]:
    slots = table_row[top_k_index]  # [T, k]
    missing = (slots < 0).any()
    return slots.clamp(min=0), missing
