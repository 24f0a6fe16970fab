"""Grouped float32 rows through Specter's native kernel (``csrc/grouped_rows.cpp``).

Contract:
- ``serves(x, *weights) -> bool``: the kernel can compute ``x`` against these stacked weights: a
  CPU, float32 throughout, contiguous weights whose last dimension (K) is a multiple of 16, and
  Specter's native kernels available (``specter.native``; built on first call).
- ``grouped_rows(x [P, K], w [S, N, K], ends [S] int64, blocked=False) -> [P, N]``: rows ``ends[s-1] ..
  ends[s]`` of ``x`` times ``w[s]^T`` (``ends`` non-decreasing, ending at P; empty groups cost
  nothing). Each weight row is read once for all the rows of its group, float32 FMA accumulators
  per row (a different summation order from BLAS: equal to rounding, not bit for bit); a row's
  result does not depend on how many rows its group has (one token verified with others gets the
  bits it would get alone). ``torch.ops.specter_native.grouped_rows``, with a fake implementation
  for compiled graphs. ``blocked``: ``w`` is stored blocked, computed by ``blocked_rows`` instead
  (``torch.ops.specter_native.blocked_rows``; N % 16 == 0).
- ``normed_rows(h [1, K], norm_weight [K], eps, weights) -> (normed [1, K], [1, sum N_i])``: an
  RMS norm of one row (float32, ``normed = h * rsqrt(mean(h^2) + eps) * norm_weight``; the sum of
  squares in a different order from PyTorch's), then each [N_i, K] weight on it, outputs side by
  side (``specter_native::normed_rows``): the draft step's norm-and-projections in one call.
- ``glu_expert_pairs(out [P, H], x [T, H], gate_up [S, 2I, H], down [S, H, I], weights [P], top_k,
  groups, starts, pairs, blocked=False)``: pairs ``p = t * top_k + j`` (P = T * top_k); for the
  i-th expert ``g`` of ``groups``, its pairs ``pairs[starts[i]:starts[i + 1]]`` (their tokens' rows
  of ``x`` in that order), ``(down[g] @ (silu(gate) * up)) * weights[p]`` with ``[gate | up] =
  gate_up[g] @ x[t]``,
  written into rows ``p`` of ``out`` (others untouched): a verification wave of any number of
  experts in one call, straight from the layer's routing, the bits of ``grouped_rows``, PyTorch's
  silu and mul called one by one on the same rows. With ``blocked`` (both weights stored blocked,
  ``specter.model.expert_layout``) the rows go through ``blocked_rows``' kernel instead, whose
  bits ``grouped_rows(..., blocked=True)`` gives.
- ``draft_qkv`` / ``draft_attend_route`` (``layer_serves`` must hold): the lean draft step's
  attention half of a layer for one token, in two calls around the K/V write (their contract:
  ``csrc/draft_layer.cpp``); ``draft_layer``: the whole layer in one call, the K/V write, the
  attention half and the routed experts' INT4 sum (``int4_native.glu_token``) added to the
  residual, the same arithmetic as those calls. Eager only (no fake implementations).
- ``wide_rows(enabled=None) -> bool``: whether groups of two rows or more run the kernel's AVX-512
  forms (on by default where the CPU has AVX-512F/DQ/VL; one row always runs the AVX2 form).
  They give every row the AVX2 form's bits, lane for lane, and read a weight row once for up to
  eight rows (AVX2: three or four; short weight rows, K < 1024, ``short_pass_rows`` a pass);
  ``enabled`` switches them on or off process-wide (tests, A/B timings); returns whether they run
  now.
- ``short_pass_rows(rows=None) -> int``: the most rows one pass of the AVX-512 form takes over a
  short weight row (K < 1024: a gated MLP's up projection); more go in further passes that re-read
  the weight row from L1. Four on AMD CPUs (there five to eight rows a pass ran 4-42% slower than
  passes of four: ``csrc/grouped_rows.cpp``), eight elsewhere; ``rows`` (1-8) sets it process-wide
  (tests, A/B timings). It never changes a result's bits.
- ``prefetch_min_rows(rows=None) -> int``: the fewest rows sharing a weight row for which the
  float32 kernels prefetch that row in software (``PREFETCH_MIN_ROWS`` by default; fewer are left
  to the hardware prefetcher: decode steps, most verification waves, the draft's norms and
  projections; the forms that read four long weight rows side by side never prefetch in
  software, measured slower with it at 2-24 rows); ``rows`` sets it process-wide (A/B timings). It
  never changes a result's bits.
Why: on this project's CPU (one thread) MKL's ``x @ W^T`` for an [8192, 256] fp32 weight ran at
6.2 GB/s for one row but 2.8-3.3 GB/s for 2-5 rows (it packs the weight first), and
``torch._grouped_mm`` over six experts of 1-2 rows each took 2.6 ms per expert's 12 MiB; this
kernel 1.7 ms (7.4-7.8 GB/s; ``scripts/bench_expert_kernel.py`` times both forms). The AVX-512
forms, switched per run in one process (widened model, one thread, 2026-12-05): verification's
compute per expert read 1.021 -> 0.996 ms at 50% on ``local`` with k = 16 compiled (1.015x tok/s),
1.182 -> 1.141 at 25% ``local`` with k = 32 compiled (1.014x), 1.351 -> 1.328 at 25% on an emulated
2 GB/s with k = 16 compiled (0.999x, link-bound); 50% ``local`` with k = 8 eager, rounds of about
two rows an expert: 1.041 -> 1.038 (0.998x).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specter import native

ALIGN = 16  # K must be a multiple of this (two 8-float vectors per step)
# One thread, 2026-12-06, AMD EPYC VM, engines taking turns in one process (four runs each): widened
# model, 50% `local`, tok/s from software prefetch from one row to from four: `resident` eager
# 1.12x, compiled 1.27x; `specter` k = 4 eager 1.15x, compiled 1.14x, k = 8 compiled 1.10x, the
# roofline compiled 1.12x, k = 32 0.99-1.04x; the bundled model (its experts in the L3) 0.98-1.10x
# (eight runs). Kernel alone: csrc/rows_math.h.
PREFETCH_MIN_ROWS = 4


def serves(x: Tensor, *weights: Tensor) -> bool:
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return False
    if any(w.device.type != "cpu" or w.dtype != torch.float32 or not w.is_contiguous() or w.shape[-1] % ALIGN
           for w in weights):
        return False
    return native.available()


def grouped_rows(x: Tensor, w: Tensor, ends: Tensor, blocked: bool = False) -> Tensor:
    """``x [P, K] @ w[group]^T`` per row group (see the module docstring); ``serves`` must hold.
    ``blocked``: ``w`` is stored blocked (``blocked_rows``), read by that kernel."""
    if blocked:
        return torch.ops.specter_native.blocked_rows(x.contiguous(), w, ends)
    return torch.ops.specter_native.grouped_rows(x.contiguous(), w, ends)


def glu_expert_pairs(out: Tensor, x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, top_k: int,
                     groups: list[int], starts: list[int], pairs: list[int], blocked: bool = False) -> None:
    """The gated MLP of expert ``groups[i]`` on its pairs ``pairs[starts[i]:starts[i + 1]]`` into
    those rows of ``out`` (see the module docstring); ``serves`` must hold for ``x``, ``gate_up``
    and ``down``. ``blocked``: both weights are stored blocked, read by ``blocked_rows``' kernel."""
    torch.ops.specter_native.glu_expert_pairs(out, x.contiguous(), gate_up, down, weights, top_k, groups, starts, pairs,
                                              blocked)


def wide_rows(enabled: bool | None = None) -> bool:
    """Whether two rows or more take the AVX-512 forms; ``enabled`` sets it first (see the module
    docstring). The native kernels must be available."""
    return bool(torch.ops.specter_native.wide_rows(-1 if enabled is None else int(enabled)))


def short_pass_rows(rows: int | None = None) -> int:
    """The most rows a pass of the AVX-512 form takes over a short weight row; ``rows`` (1-8) sets
    it first (see the module docstring). The native kernels must be available."""
    if rows is not None and not 1 <= rows <= 8:
        raise ValueError(f"short_pass_rows: rows must be 1 to 8, got {rows}")
    return int(torch.ops.specter_native.short_pass_rows(0 if rows is None else rows))


def prefetch_min_rows(rows: int | None = None) -> int:
    """The fewest rows sharing a weight row that prefetch it in software; ``rows`` (>= 1) sets it
    first (see the module docstring). The native kernels must be available."""
    if rows is not None and rows < 1:
        raise ValueError(f"prefetch_min_rows: rows must be at least 1, got {rows}")
    return int(torch.ops.specter_native.prefetch_min_rows(0 if rows is None else rows))


def normed_rows(h: Tensor, norm_weight: Tensor, eps: float, weights: list[Tensor]) -> tuple[Tensor, Tensor]:
    """The RMS-normed row and every weight on it (see the module docstring); ``serves`` must hold."""
    return torch.ops.specter_native.normed_rows(h.contiguous(), norm_weight, eps, weights)


def layer_serves(h: Tensor, head_dim: int, *weights: Tensor) -> bool:
    """``draft_qkv`` / ``draft_attend_route`` can run a layer with these weights on rows like
    ``h`` (``serves``, and whole 8-value vectors per head)."""
    return head_dim % 8 == 0 and h.shape[-1] % ALIGN == 0 and serves(h, *weights)


def draft_qkv(h: Tensor, input_norm: Tensor, q: Tensor, k: Tensor, v: Tensor, q_norm: Tensor | None,
              k_norm: Tensor | None, cos: Tensor, signed_sin: Tensor, head_dim: int,
              eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """One token's normed, per-head-normed (``q_norm`` / ``k_norm`` where given) and rotated q,
    k and v (see the module docstring); ``layer_serves`` must hold."""
    none = h.new_empty(0)
    return torch.ops.specter_native.draft_qkv(
        h.contiguous(), input_norm, q, k, v, none if q_norm is None else q_norm, none if k_norm is None else k_norm,
        cos, signed_sin, head_dim, eps)


def draft_attend_route(q: Tensor, keys: Tensor, values: Tensor, length: int, h: Tensor, o: Tensor,
                       post_norm: Tensor, router: Tensor, eps: float, scale: float, top_k: int, renormalize: bool,
                       more: tuple[Tensor, Tensor, int] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Attention over the cache's first ``length`` positions (then ``more``'s: (keys, values,
    length), e.g. the draft's own positions of a round), o, the residual, the post-attention norm
    and the router's choice of experts for one token (see the module docstring)."""
    more_keys, more_values, more_length = more if more is not None else (keys, values, 0)
    return torch.ops.specter_native.draft_attend_route(q, keys, values, length, more_keys, more_values, more_length,
                                                       h.contiguous(), o, post_norm, router, eps, scale, top_k,
                                                       renormalize)


def draft_layer(h: Tensor, input_norm: Tensor, q: Tensor, k: Tensor, v: Tensor, q_norm: Tensor | None,
                k_norm: Tensor | None, cos: Tensor, signed_sin: Tensor, head_dim: int, eps: float,
                write: tuple[Tensor, Tensor, int], cache: tuple[Tensor, Tensor, int],
                more: tuple[Tensor, Tensor, int] | None, o: Tensor, post_norm: Tensor, router: Tensor, scale: float,
                top_k: int, renormalize: bool, up: tuple[Tensor, Tensor, int],
                down: tuple[Tensor, Tensor, int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A whole draft layer for one token in one call (``layer_serves`` must hold): ``draft_qkv``, k
    and v written at ``write`` = (keys, values, position), ``draft_attend_route`` over ``cache`` =
    (keys, values, length) and ``more``, then the routed experts' INT4 SiLU-gated sum (``up`` /
    ``down``: packed, scales, group, as ``int4_native.glu_token``) added to the residual: (h after
    the layer [1, H], the experts' input x [1, H], top_k_weights [1, k], top_k_index [1, k])."""
    none = h.new_empty(0)
    keys, values, length = cache
    more_keys, more_values, more_length = more if more is not None else (keys, values, 0)
    return torch.ops.specter_native.draft_layer(
        h.contiguous(), input_norm, q, k, v, none if q_norm is None else q_norm, none if k_norm is None else k_norm,
        cos, signed_sin, head_dim, write[0], write[1], write[2], keys, values, length, more_keys, more_values,
        more_length, o, post_norm, router, eps, scale, top_k, renormalize, up[0], up[1], down[0], down[1], up[2],
        down[2])
