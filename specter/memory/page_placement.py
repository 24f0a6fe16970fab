"""Swap the slow pieces of a large huge-page buffer for fresh memory that reads at the usual rate.

Why: on this project's VM (a 2-core Xeon guest that sees one memory node) some pages read 15-20%
slower than the rest, page for page, for as long as they are held: in one run 180 of 1536 8 MiB
pieces read 9.5 GiB/s in every pass against 11.5 for the rest, and moving fresh pages to their
addresses brought each to 10.6-13.5 while the pages moved out stayed slow (design notes, stop 58).
An engine whose cache slots landed there decoded up to 18% slower than its identical twin (stop
57). A guest cannot ask where the host put its memory, but it can time it.

Contract:
- ``enabled() -> bool``: Linux with ``mremap`` (ctypes), and the environment variable
  ``SPECTER_SETTLE_PAGES`` is not ``0`` (read at every call: A/B runs flip it in one process), and
  not inside ``disabled()``.
- ``settle(region) -> Settled``: ``region`` is a contiguous CPU tensor of at least ``MIN_BYTES``
  starting on a 2 MiB boundary of a private anonymous mapping, its pages written (faulted in). Each
  whole ``PIECE_BYTES`` piece is read (``int32`` max: a streaming read on one core) ``FIRST_PASSES``
  times in turn; the pieces slow in all of them are read ``PASSES`` times in all, beside
  ``CALIBRATION`` typical pieces of the region (their rates put on the region's scale). Between
  passes over pieces that would fit the last-level cache, a process-wide ``EVICT_BELOW`` buffer is
  read. The typical rate is the median of the regions' median piece rates settled so far in this
  process, this one included (a region lying wholly on slow pages is caught too). A piece that
  reads below ``SLOW_RATIO`` x typical in every pass is replaced: fresh memory on 2 MiB pages,
  timed the same way and reading at least ``SLOW_RATIO`` x typical (up to ``TRIES`` draws; slow
  draws are held like slow pieces), receives the piece's bytes and is moved to the piece's address
  (``mremap``); the slow pages are held in a process-wide quarantine (up to
  ``QUARANTINE_MAX_BYTES``: 1 GiB, or a twentieth of the machine's memory where less), so the
  kernel does not hand them to the next buffer, else freed. The region's values never change.
  Where a system call fails (a sandbox without ``mremap``, no memory for a draw) the buffer stays
  as it was (a half-done swap is undone), a warning says why, and settling stops for the process.
- ``stats() -> dict``: process totals (regions, pieces probed, slow, swapped, quarantined bytes);
  ``release()`` frees the quarantine.
- Settling a region takes about ``FIRST_PASSES`` reads of it (about 0.06 s for 256 MiB here), plus
  eviction reads for small regions and the draws for slow pieces.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import statistics
import sys
import threading
import time
from typing import Iterator

import torch
from torch import Tensor

log = logging.getLogger("specter.memory")


def _quarantine_cap() -> int:
    """1 GiB, or a twentieth of the machine's memory where that is less."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 30
    return min(1 << 30, physical // 20)


PIECE_BYTES = 8 << 20  # four 2 MiB pages: the grain at which slow memory showed (stop 57)
MIN_BYTES = 4 * PIECE_BYTES  # smaller buffers (the bundled model's) sit largely in the LLC
PASSES = 5
FIRST_PASSES = 3  # over the whole region; the pieces slow in all three get the other two
SLOW_RATIO = 0.88  # slow pieces read 0.80-0.86x the rest; pieces of one buffer spread +-8%
TRIES = 3
CALIBRATION = 3  # pieces of the region read again beside the draws for a slow one
EVICT_BELOW = 128 << 20  # pieces of a smaller region come back from the LLC on a second pass
QUARANTINE_MAX_BYTES = _quarantine_cap()
HUGE_PAGE = 2 << 20  # a transparent huge page (``huge_pages`` maps on the same grain)
_HISTORY = 64

_PROT_NONE, _PROT_RW = 0, 3
_MAP_PRIVATE_ANONYMOUS = 0x02 | 0x20
_MAP_FAILED = ctypes.c_void_p(-1).value
_MADV_HUGEPAGE = 14
_MREMAP_MAYMOVE_FIXED = 1 | 2


@dataclasses.dataclass
class Settled:
    """What ``settle`` did to one region."""

    pieces: int = 0
    slow: int = 0
    swapped: int = 0
    rate_gibps: float | None = None  # the region's median piece rate before swapping
    typical_gibps: float | None = None  # the median region rate of this process so far
    seconds: float = 0.0


_totals = {"regions": 0, "pieces": 0, "slow": 0, "swapped": 0, "quarantined_bytes": 0, "seconds": 0.0}
_region_rates: list[float] = []
_quarantine: list["_Range"] = []  # held slow pages
_libc: ctypes.CDLL | None = None
_evict: Tensor | None = None
_failure: str | None = None  # why settling stopped in this process
_paused = False  # inside ``disabled()``
_lock = threading.Lock()  # engines built on two threads settle one region at a time


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mremap.restype = ctypes.c_void_p
        libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        _libc = libc
    return _libc


def enabled() -> bool:
    if _paused or os.environ.get("SPECTER_SETTLE_PAGES", "") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        return hasattr(_lib(), "mremap")
    except OSError:
        return False


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """``enabled()`` is False inside the block (buffers made there keep the pages they got)."""
    global _paused
    previous, _paused = _paused, True
    try:
        yield
    finally:
        _paused = previous


def stats() -> dict:
    return dict(_totals)


def release() -> None:
    """Free the quarantined pages (tests; a process keeps them for its life)."""
    with _lock:
        while _quarantine:
            _quarantine.pop().unmap()
        _totals["quarantined_bytes"] = 0


class _Range:
    """An anonymous mapping made here, aligned inside to 2 MiB: ``address`` .. ``address + length``."""

    def __init__(self, length: int, writable: bool) -> None:
        libc = _lib()
        self.length = length
        self._base_length = length + HUGE_PAGE
        base = libc.mmap(None, self._base_length, _PROT_RW if writable else _PROT_NONE, _MAP_PRIVATE_ANONYMOUS, -1, 0)
        if base in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), "mmap failed")
        self._base = base
        self.address = base + (-base % HUGE_PAGE)
        if writable:
            libc.madvise(self.address, length, _MADV_HUGEPAGE)

    def tensor(self) -> Tensor:
        return torch.frombuffer((ctypes.c_char * self.length).from_address(self.address), dtype=torch.uint8)

    def unmap(self) -> None:
        _lib().munmap(self._base, self._base_length)

    def unmap_slack(self) -> None:
        """Unmap the alignment slack around ``address`` once its pages have been moved away: never
        the moved range itself, which another thread's mapping may already occupy."""
        libc = _lib()
        if self.address > self._base:
            libc.munmap(self._base, self.address - self._base)
        end, base_end = self.address + self.length, self._base + self._base_length
        if base_end > end:
            libc.munmap(end, base_end - end)


def _move(source: int, length: int, destination: int) -> None:
    moved = _lib().mremap(source, length, length, _MREMAP_MAYMOVE_FIXED, destination)
    if moved != destination:
        raise OSError(ctypes.get_errno(), "mremap failed")


def _read_rates(pieces: list[Tensor], passes: int = PASSES) -> list[list[float]]:
    """Each piece's read rate (GiB/s) in each of ``passes`` passes, the pieces read in turn."""
    evict = _evict_buffer() if len(pieces) * PIECE_BYTES < EVICT_BELOW else None
    words = [piece.view(torch.int32) for piece in pieces]
    rates: list[list[float]] = [[] for _ in pieces]
    for _ in range(passes):
        if evict is not None:
            evict.max()
        for index, word in enumerate(words):
            started = time.perf_counter()
            word.max()
            rates[index].append(PIECE_BYTES / 2**30 / (time.perf_counter() - started))
    return rates


def _evict_buffer() -> Tensor:
    """``EVICT_BELOW`` bytes, written once per process: read between passes over a few pieces."""
    global _evict
    if _evict is None:
        _evict = torch.ones(EVICT_BELOW // 4, dtype=torch.int32)
    return _evict


def settle(region: Tensor) -> Settled:
    global _failure
    with _lock:
        if _failure is not None:
            return Settled()
        try:
            return _settle(region)
        except OSError as error:  # a sandbox without mremap, no memory for a draw: the buffer stays as it is
            _failure = str(error)
            log.warning("page placement off for this process: %s", _failure)
            return Settled()


def _settle(region: Tensor) -> Settled:
    started = time.perf_counter()
    data = region.reshape(-1).view(torch.uint8)
    count = data.numel() // PIECE_BYTES
    if count * PIECE_BYTES < MIN_BYTES or data.data_ptr() % HUGE_PAGE:
        return Settled()
    pieces = [data[i * PIECE_BYTES:(i + 1) * PIECE_BYTES] for i in range(count)]
    passes = _read_rates(pieces, FIRST_PASSES)
    rates = [statistics.median(r) for r in passes]
    region_rate = statistics.median(rates)
    _region_rates.append(region_rate)
    del _region_rates[:-_HISTORY]
    typical = statistics.median(_region_rates)
    floor = SLOW_RATIO * typical
    suspects = [i for i, r in enumerate(passes) if max(r) < floor]
    calibration = sorted((i for i in range(count) if i not in suspects), key=lambda i: abs(rates[i] - region_rate))
    calibration = [(pieces[i], rates[i]) for i in calibration[:CALIBRATION]]
    slow = []
    if suspects:  # the rest of the passes for the suspects alone, on the region's scale
        more = _scaled_rates([pieces[i] for i in suspects], calibration, PASSES - FIRST_PASSES)
        slow = [i for i, extra in zip(suspects, more) if max(passes[i] + extra) < floor]
    swapped = _replace([pieces[i] for i in slow], calibration, floor) if slow else 0
    result = Settled(count, len(slow), swapped, region_rate, typical, time.perf_counter() - started)
    for key, value in (("regions", 1), ("pieces", count), ("slow", len(slow)), ("swapped", swapped),
                       ("seconds", result.seconds)):
        _totals[key] += value
    return result


def _scaled_rates(pieces: list[Tensor], calibration: list[tuple[Tensor, float]], passes: int) -> list[list[float]]:
    """``pieces`` read ``passes`` times beside the ``calibration`` pieces (piece, its median rate in
    the region's passes), their rates put on the region's scale: a few pieces read between
    eviction reads come out slower than the same pieces read in a long run (0.92x for one alone)."""
    rates = _read_rates(pieces + [piece for piece, _ in calibration], passes)
    again = [statistics.median(r) for r in rates[len(pieces):]]
    scale = statistics.median(rate for _, rate in calibration) / statistics.median(again) if again else 1.0
    return [[rate * scale for rate in row] for row in rates[:len(pieces)]]


def _replace(slow: list[Tensor], calibration: list[tuple[Tensor, float]], floor: float) -> int:
    """Move fresh memory reading at least ``floor`` (on the region's scale) under each slow piece,
    its bytes copied first; how many were moved."""
    waiting, swapped, rejected, unsorted = list(slow), 0, [], []
    try:
        for _ in range(TRIES):
            if not waiting:
                break
            unsorted = [_Range(PIECE_BYTES, writable=True) for _ in waiting]
            for candidate in unsorted:
                candidate.tensor().zero_()  # fault the pages in (untouched memory reads the zero page)
            rates = [statistics.median(r) for r in _scaled_rates([c.tensor() for c in unsorted], calibration, PASSES)]
            still = []
            for piece, candidate, rate in zip(waiting, list(unsorted), rates):
                if rate >= floor:
                    candidate.tensor().copy_(piece)
                    _swap(piece.data_ptr(), candidate)
                    swapped += 1
                else:
                    rejected.append(candidate)
                    still.append(piece)
                unsorted.remove(candidate)
            waiting = still
    finally:
        for candidate in unsorted:  # a system call failed before these were judged or moved
            candidate.unmap()
        for candidate in rejected:  # slow too: held like the pieces they did not replace, while there is room
            if _room():
                _hold(candidate)
            else:
                candidate.unmap()
    return swapped


def _room() -> bool:
    return _totals["quarantined_bytes"] + PIECE_BYTES <= QUARANTINE_MAX_BYTES


def _hold(pages: _Range) -> None:
    _quarantine.append(pages)
    _totals["quarantined_bytes"] += PIECE_BYTES


def _swap(address: int, candidate: _Range) -> None:
    """Move ``candidate``'s pages to ``address``; the pages there go to the quarantine while it has
    room (else they are freed). If the second move fails the first is undone: ``address`` is never
    left unmapped."""
    keep = None
    if _room():
        keep = _Range(PIECE_BYTES, writable=False)
        try:
            _move(address, PIECE_BYTES, keep.address)
        except OSError:
            keep.unmap()
            raise
    try:
        _move(candidate.address, PIECE_BYTES, address)  # with no keep, this frees the slow pages
    except OSError:
        if keep is not None:
            _move(keep.address, PIECE_BYTES, address)
            keep.unmap_slack()
        raise
    candidate.unmap_slack()
    if keep is not None:
        _hold(keep)
