"""The K-major blocked layout of a stacked weight, as tensor reshapes (no kernels).

Contract:
- ``block(w [S, N, K] or [N, K]) -> same shape``: a contiguous copy whose memory holds each weight
  as [N / 16, K, 16] (the 16 outputs of a block side by side for each k); N % 16 == 0.
  ``unblock(wb)`` inverts it (``unblock(block(w))`` equals ``w``). The shape is kept, so a blocked
  tensor can stand where the weight stood, but only ``specter.kernels.blocked_rows``' kernel reads
  it right.
- ``block_in_place(w)``: ``w``'s values rewritten blocked in its own storage (pinned or huge pages
  stay so), through one temporary copy.
- ``block_rows_into(dst, src)``: ``src`` [n, K] (a weight's rows ``r0 .. r0 + n`` with ``r0`` and
  ``n`` multiples of 16) written blocked into ``dst``, the flat span those rows take in the blocked
  weight (``n * K`` elements): one strided copy, no temporary (the disk tier's reads, piece by piece).
Which experts are kept so: ``specter.model.expert_layout``.
"""

from __future__ import annotations

from torch import Tensor

BLOCK = 16


def block(w: Tensor) -> Tensor:
    *lead, n, k = w.shape
    if n % BLOCK:
        raise ValueError(f"block: N = {n} is not a multiple of {BLOCK}")
    return w.reshape(*lead, n // BLOCK, BLOCK, k).transpose(-1, -2).contiguous().view(w.shape)


def block_in_place(w: Tensor) -> None:
    w.copy_(block(w))


def unblock(wb: Tensor) -> Tensor:
    *lead, n, k = wb.shape
    if n % BLOCK:
        raise ValueError(f"unblock: N = {n} is not a multiple of {BLOCK}")
    return wb.contiguous().view(*lead, n // BLOCK, k, BLOCK).transpose(-1, -2).reshape(wb.shape)


def block_rows_into(dst: Tensor, src: Tensor) -> None:
    n, k = src.shape
    if n % BLOCK or dst.numel() != n * k:
        raise ValueError(f"block_rows_into: {n} rows of {k} into {dst.numel()} elements (rows must be a multiple "
                         f"of {BLOCK})")
    dst.view(n // BLOCK, k, BLOCK).copy_(src.view(n // BLOCK, BLOCK, k).transpose(1, 2))
