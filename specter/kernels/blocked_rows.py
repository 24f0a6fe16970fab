"""Float32 rows against weights in a K-major blocked layout (Specter's native ``csrc/blocked_rows.cpp``).

Contract:
- ``block(w [S, N, K] or [N, K]) -> same shape`` and ``unblock(wb)``: the layout
  (``specter.memory.blocked_layout``): each weight as [N / 16, K, 16], the 16 outputs of a block
  side by side for each k; N % 16 == 0.
- ``serves(x, wb) -> bool``: the kernel can compute ``x`` against ``wb``: a CPU, float32, a
  contiguous [S, N, K] weight with N % 16 == 0 and K equal to x's, Specter's native kernels
  available.
- ``blocked_rows(x [P, K], wb [S, N, K] blocked, ends [S] int64) -> [P, N]``: rows ``ends[s-1] ..
  ends[s]`` of ``x`` times weight ``s`` transposed, as ``native_rows.grouped_rows`` with the
  weights blocked. Each output is one float32 FMA chain over k in order: a row's result depends
  on its values, the weight and K only, never on how many rows share its weight, and the AVX2 form
  gives the AVX-512 form's bits (a different summation order from ``grouped_rows``: equal to
  rounding, not bit for bit).
- ``wide(enabled=None) -> bool``: whether the AVX-512 form runs (where the CPU has it; on by
  default); ``enabled`` switches it process-wide (tests, A/B timings).
Why: ``grouped_rows`` sums each (row, weight row) pair across 16 lanes, loading a vector of x for
every FMA; with several rows an expert (a verification round) that compute does not hide under the
weight's stream on one core. Blocked, one weight vector serves every row with x broadcast, and the
weights stream contiguously. In place (``python scripts/blocked_rows_bench.py``, this project's
AMD EPYC VM, one thread, 40 widened experts cycled, two runs), blocked against today: [8192, 256]
at 1 / 2 / 4 / 8 rows 0.98 / 0.88-0.91 / 0.75-0.87 / 0.74-0.80 of the time, [256, 4096] 0.92-1.01 /
0.73-0.89 / 0.67-0.79 / 0.85 (design notes, stop 66). The engines keep large float32 experts blocked on a CPU
(``specter.model.expert_layout``: the host store, hence the cache slots, and ``resident``'s own
modules together, so every engine sums alike and verification keeps a single step's bits); the
kernels read them through ``native_rows.grouped_rows`` / ``glu_expert_pairs`` with ``blocked``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specter import native
from specter.memory.blocked_layout import BLOCK, block, unblock

__all__ = ["BLOCK", "block", "unblock", "serves", "blocked_rows", "wide"]

def serves(x: Tensor, wb: Tensor) -> bool:
    if x.device.type != "cpu" or wb.device.type != "cpu" or x.dtype != torch.float32 or wb.dtype != torch.float32:
        return False
    if wb.dim() != 3 or not wb.is_contiguous() or wb.shape[1] % BLOCK or wb.shape[2] != x.shape[-1]:
        return False
    return native.available()


def blocked_rows(x: Tensor, wb: Tensor, ends: Tensor) -> Tensor:
    return torch.ops.specter_native.blocked_rows(x.contiguous(), wb, ends)


def wide(enabled: bool | None = None) -> bool:
    return bool(torch.ops.specter_native.blocked_wide(-1 if enabled is None else int(enabled)))
