"""Specter's own INT4 CPU kernel (``csrc/int4_gemv.cpp``): built once per machine, used by the
``cpu-native`` backend of ``specter.kernels.int4``.

Contract:
- ``available()`` / ``unavailable_reason()``: those of ``specter.native``, which builds
  this kernel with Specter's other native kernels (``SPECTER_NATIVE_INT4=0`` turns them off).
- ``pack(q [N, K] int8 in [-8, 7]) -> uint8 [N, K/2]``: per 64-value chunk of a row, 32 bytes,
  byte j = u[j] | u[j + 32] << 4 with u = q + 8, the rows then interleaved in blocks of eight
  (``csrc/int4_blocks.h``: one 32-byte load holds four bytes of each of a block's rows);
  ``pack_scales(scales [N, G]) -> [N, G]`` float32 in the same blocks; ``unpack`` and
  ``unpack_scales`` invert them. K % 64 == 0, N % 8 == 0.
- ``gemv(x [M, K] float32, packed, scales [N, K/group] float32, group) -> [M, N] float32``:
  ``x @ ((u - 8) * scale).T`` with x quantized to int8 per 64-value chunk inside the kernel
  (symmetric, max|x| / 127), so it differs from a float matmul by that rounding (about 0.5%
  relative on random data): for the draft, whose tokens the target verifies, not for anything
  that must equal the target. It is the dispatcher op ``torch.ops.specter_native.int4_gemv``
  with a fake implementation, so compiled graphs call it as an extern kernel.
- ``rows(x [S, K], packed [E, N, K/2], scales [E, N, K/group], ids [S] int64, group) -> [S, N]``
  float32: row s through expert ``ids[s]``'s weights, each exactly ``gemv`` of that row (the
  same dot products), one dispatcher op (``specter_native::int4_rows``) for all the rows.
- ``glu_token(x [1, K], up, down, ids [S], weights [S]) -> [1, H]`` float32: one token's whole
  SiLU-gated expert sum in one op (``specter_native::int4_glu_token``): for each slot the up
  rows as ``rows``, ``silu(gate) * up`` (gate = the first half; SiLU through a vectorised exp,
  within a few ulp of PyTorch's), the down rows as ``rows`` of that, times the slot's weight,
  summed over the slots in order.
Measured (one thread, this project's 2-core AMD EPYC VM, 48 distinct weights cycled so they
come from memory, ``scripts/int4_kernels.py``): rows one at a time (before 2026-12-06) an
[8192, 256] weight 0.072-0.088 ms against 0.129-0.133 ms for PyTorch's
``_weight_int4pack_mm_for_cpu``, [256, 4096] 0.045-0.050 ms against 0.067-0.069 ms (2026-12-03);
blocks of eight rows: see ``csrc/int4_gemv.cpp``. Each weight line is prefetched ahead of its use
(``kPrefetchBytes``; on a 2-core Xeon VM in 2026-12-04 a token's two widened experts took 0.52-0.56
ms without, 0.39-0.42 ms with; design notes, stop 42).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specter.native import available, unavailable_reason

__all__ = ["available", "unavailable_reason", "pack", "unpack", "pack_scales", "unpack_scales", "gemv", "rows",
           "glu_token", "CHUNK", "BLOCK_ROWS"]

CHUNK = 64  # values per int8 activation scale and per 32 packed bytes
BLOCK_ROWS = 8  # rows interleaved together (csrc/int4_blocks.h)


def fits(n: int, k: int) -> bool:
    """Whether an [n, k] weight has the kernel's layout (K % 64 == 0, N % 8 == 0)."""
    return k % CHUNK == 0 and n % BLOCK_ROWS == 0


def _check(n: int, k: int) -> None:
    if not fits(n, k):
        raise ValueError(f"the native INT4 layout needs K % {CHUNK} == 0 and N % {BLOCK_ROWS} == 0, got N={n}, K={k}")


def _check_rows(n: int) -> None:
    if n % BLOCK_ROWS:
        raise ValueError(f"the native INT4 layout needs N % {BLOCK_ROWS} == 0, got N={n}")


def pack(q: Tensor) -> Tensor:
    """``q [N, K]`` int8 in [-8, 7] -> the kernel's uint8 [N, K/2] layout (see the docstring)."""
    n, k = q.shape
    _check(n, k)
    u = (q.to(torch.int16) + 8).to(torch.uint8).view(n, k // CHUNK, 2, CHUNK // 2)
    rows = u[:, :, 0] | (u[:, :, 1] << 4)  # [N, chunks, 32]: one row's bytes, chunk by chunk
    blocks = rows.view(n // BLOCK_ROWS, BLOCK_ROWS, k // CHUNK, 8, 4)  # [block, row, chunk, load, 4 bytes]
    return blocks.permute(0, 2, 3, 1, 4).reshape(n, k // 2).contiguous()


def unpack(packed: Tensor) -> Tensor:
    """The kernel's uint8 [N, K/2] layout -> q [N, K] int8 in [-8, 7]."""
    n, half = packed.shape
    _check(n, half * 2)
    blocks = packed.view(n // BLOCK_ROWS, half * 2 // CHUNK, 8, BLOCK_ROWS, 4)  # [block, chunk, load, row, 4]
    rows = blocks.permute(0, 3, 1, 2, 4).reshape(n, half * 2 // CHUNK, CHUNK // 2)
    u = torch.stack([rows & 15, rows >> 4], dim=2)  # [N, chunks, 2, 32]
    return (u.reshape(n, half * 2).to(torch.int16) - 8).to(torch.int8)


def pack_scales(scales: Tensor) -> Tensor:
    """Scales [N, G] -> float32 [N, G] in the kernel's blocks: block b's [G, 8]."""
    n, groups = scales.shape
    _check_rows(n)
    blocks = scales.float().reshape(n // BLOCK_ROWS, BLOCK_ROWS, groups)
    return blocks.transpose(1, 2).reshape(n, groups).contiguous()


def unpack_scales(packed_scales: Tensor) -> Tensor:
    """``pack_scales``' float32 [N, G] -> the row-major scales [N, G]."""
    n, groups = packed_scales.shape
    _check_rows(n)
    return packed_scales.reshape(n // BLOCK_ROWS, groups, BLOCK_ROWS).transpose(1, 2).reshape(n, groups).contiguous()


def gemv(x: Tensor, packed: Tensor, scales: Tensor, group: int) -> Tensor:
    """``x [M, K] float32 -> [M, N] float32`` through the kernel (``available()`` must be True);
    ``packed`` and ``scales`` in its layout (``pack``, ``pack_scales``)."""
    return torch.ops.specter_native.int4_gemv(x, packed, scales, group)


def rows(x: Tensor, packed: Tensor, scales: Tensor, ids: Tensor, group: int) -> Tensor:
    """Each row of ``x [S, K]`` through its own expert's weights (``available()`` must be True)."""
    return torch.ops.specter_native.int4_rows(x.to(torch.float32).contiguous(), packed, scales, ids, group)


def glu_token(x: Tensor, up: tuple[Tensor, Tensor, int], down: tuple[Tensor, Tensor, int], ids: Tensor,
              weights: Tensor) -> Tensor:
    """One token ``x [1, K]`` through its experts ``ids [S]``, SiLU-gated, weighted by ``weights [S]``
    and summed: ``[1, H]`` float32 (``available()`` must be True). ``up`` / ``down`` are (packed,
    scales, group) of the stacked [E, 2I, K/2] and [E, H, I/2] weights."""
    (up_packed, up_scales, up_group), (down_packed, down_scales, down_group) = up, down
    return torch.ops.specter_native.int4_glu_token(
        x.to(torch.float32).contiguous(), up_packed, up_scales, down_packed, down_scales,
        ids, weights.to(torch.float32).contiguous(), up_group, down_group)
