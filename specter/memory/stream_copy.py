"""Large CPU-to-CPU copies with streaming stores (Specter's native ``csrc/stream_copy.cpp``).

Contract:
- ``serves(dst, src) -> bool``: the native copy can do ``dst.copy_(src)``: both on the CPU,
  contiguous, the same dtype and shape, at least ``MIN_BYTES``, and Specter's native kernels
  available (``specter.native``).
- ``copy_many(dsts, srcs)``: ``dst.copy_(src)`` for each pair (``serves`` must hold for each),
  one after another, in one native call (a copy thread takes Python's lock back once, not once a
  tensor); the bytes are equal, the destinations are written around the caches.
- ``paced_copy(dst, src, seconds)``: the same copy (or copies: lists of tensors, one after another)
  in 256 KiB pieces spread over ``seconds`` from the call (a piece starts no earlier than its
  offset's share of all the bytes times ``seconds``, at once when behind), in one native call,
  so it returns a little before ``seconds`` have passed; no Python lock is held meanwhile. A piece
  on time uses ordinary stores (the expert lands in the caches just before the wave that awaits it
  reads it), one behind time streams (a link faster than memcpy). For the emulated link's copies
  (``serves`` must hold).
Why: on a CPU device the links' expert copies (12 MiB on the widened model) share the memory with
decoding. With ordinary stores each destination line is read before it is written and lands in
the cache, evicting what compute keeps there. Measured on this project's CPU (one thread,
``scripts/copy_contention.py``-style /tmp script, 8 MiB tensors): 16.9 GB/s streaming against
11.6 GB/s with ``Tensor.copy_``, and small matmuls plus a streaming read beside a busy copy
thread took 1.8-1.9 ms against 2.1 ms (0.72-0.77 ms alone).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specter import native

MIN_BYTES = 1 << 20  # below this a copy's destination fits the caches and ordinary stores serve


def serves(dst: Tensor, src: Tensor) -> bool:
    if dst.device.type != "cpu" or src.device.type != "cpu" or dst.dtype != src.dtype or dst.shape != src.shape:
        return False
    if src.nbytes < MIN_BYTES or not (dst.is_contiguous() and src.is_contiguous()):
        return False
    return native.available()


def copy_many(dst: list[Tensor], src: list[Tensor]) -> None:
    torch.ops.specter_native.stream_copy(dst, src)


def paced_copy(dst: Tensor | list[Tensor], src: Tensor | list[Tensor], seconds: float) -> None:
    dsts, srcs = ([dst], [src]) if isinstance(dst, Tensor) else (list(dst), list(src))
    torch.ops.specter_native.paced_copy(dsts, srcs, max(0.0, float(seconds)))
