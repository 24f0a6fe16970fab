"""Large CPU tensors on transparent huge pages (2 MiB), for weights and expert-cache slots.

Contract:
- ``supported() -> bool``: Linux with transparent huge pages enabled as ``always`` or ``madvise``
  (``/sys/kernel/mm/transparent_hugepage/enabled``) and Python's ``mmap.MADV_HUGEPAGE``.
- ``zeros(shape, dtype) -> Tensor``: a zero-filled CPU tensor. When supported and at least
  ``MIN_BYTES``, its memory is a fresh private anonymous mapping, starts on a 2 MiB boundary and
  is advised ``MADV_HUGEPAGE`` before it is first written, so the kernel backs it with 2 MiB pages
  (with ``madvise`` defragmentation it may compact memory to find them); the zero fill faults
  every page in here, not in a timed step later. The tensor keeps its mapping (up to 2 MiB
  larger) alive; pieces of it that read slower than the rest are swapped for fresh memory
  (``specter.memory.page_placement``; ``SPECTER_SETTLE_PAGES=0`` turns that off). Otherwise
  ``torch.zeros``. ``is_huge(tensor)``: whether its storage came from ``zeros``' mappings.
- ``rehome(tensor) -> Tensor``: the tensor's values in ``zeros``' memory (settled the same way);
  the tensor itself when it is not a contiguous CPU tensor of at least ``MIN_BYTES``, already
  there, or not supported.
- ``rehome_module(module) -> int``: every parameter of the module that ``rehome`` would move gets
  its ``.data`` swapped for the copy (a tied parameter is one object: it stays tied); the bytes
  moved.
Why: a 12 MiB expert read on 4 KiB pages walks 3072 page-table entries, and in a virtual machine
each walk is a two-level one. One thread, the widened model's [8192, 256] + [256, 4096] float32
experts, 40 cycled, three rows each through ``grouped_rows``: 1.16-1.17 ms an expert on 4 KiB
pages, 0.87-0.89 ms on huge pages (this project's 2-core Xeon VM, THP ``madvise``).
"""

from __future__ import annotations

import functools
import mmap
import sys
import weakref
from pathlib import Path

import torch
from torch import Tensor, nn

from specter.memory import page_placement
from specter.memory.page_placement import HUGE_PAGE
MIN_BYTES = HUGE_PAGE  # smaller tensors span at most a page or two: nothing to gain
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_live: dict[int, int] = {}  # start address -> length of each mapping ``zeros`` made and still alive


class _Mapping(mmap.mmap):
    """A private anonymous mapping (a subclass so that its end can be watched with a weak reference)."""


@functools.cache
def supported() -> bool:
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> Tensor:
    mapped = _mapped(shape, dtype)
    return torch.zeros(shape, dtype=dtype) if mapped is None else _settled(mapped.zero_())


def _settled(tensor: Tensor) -> Tensor:
    """``tensor`` (written, on a fresh mapping) with its slow pieces swapped (``page_placement``)."""
    if page_placement.enabled():
        page_placement.settle(tensor)
    return tensor


def _mapped(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> Tensor | None:
    """An unwritten tensor on a fresh huge-page mapping, or None (too small, not supported)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if nbytes < MIN_BYTES or not supported():
        return None
    mapping = _Mapping(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping until its last view dies
    start = raw.data_ptr()
    offset = -start % HUGE_PAGE
    mapping.madvise(mmap.MADV_HUGEPAGE, offset, len(mapping) - offset)
    _live[start] = len(mapping)
    weakref.finalize(mapping, _live.pop, start, None)
    return raw[offset : offset + nbytes].view(dtype).view(shape)


def is_huge(tensor: Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() in _live


def rehome(tensor: Tensor) -> Tensor:
    if (tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.nbytes < MIN_BYTES
            or is_huge(tensor) or not supported()):
        return tensor
    home = _mapped(tensor.shape, tensor.dtype)
    assert home is not None
    return _settled(home.copy_(tensor))


def rehome_module(module: nn.Module) -> int:
    moved = 0
    for parameter in module.parameters():
        data = parameter.data  # a new tensor object at every access
        home = rehome(data)
        if home is not data:
            parameter.data = home
            moved += home.nbytes
    return moved
