"""The host tier: a budgeted set of experts in host memory between the disk and the device cache.

Contract: ``HostTierLink(device_link, capacity, policy, workers=4, pin=False)`` is the link of a
device cache whose store is a ``DiskStore`` (``offload.experts_on: disk`` with
``offload.host_budget``). It holds at most ``capacity`` experts in host buffers (pinned when
``pin``, for a CUDA device link), chosen by ``policy`` (a cache-policy plugin instance of its own:
the same plugins serve both tiers). ``submit(dst, src, slot)`` for a ``DiskSource``:
- the expert is in the host tier: ``device_link`` copies it from its host buffer (a host hit);
- it is being read into the host tier (staged ahead): one of the ``workers`` threads waits for
  that read, then hands the copy to ``device_link`` (the read is never issued twice);
- otherwise a buffer is taken (free, or evicted by ``policy`` among experts no copy is reading and
  no read is filling) and a worker reads the expert from the disk into it, then copies it to the
  device: two stages, one transfer. When every buffer is busy the read goes into a temporary
  buffer that is not kept (the budget is never exceeded); asks for the same expert while that
  read is in flight copy from it too.
``stage(src)`` starts the disk-to-host read of an expert predicted to be needed, with no device
copy and no device slot: the prefetch scheduler stages every prediction the moment it arrives,
so disk reads run ahead of host-to-device copies, which wait for device slots. A read error
reaches the caller through the transfer's ``wait()`` and the buffer is released, never kept (a
failed staged read is never counted among the staged reads later used).
``describe()`` is the device link's entry plus the disk's read figures (``io``, ``bytes_read``,
``busy_s``, ``read_gbps``) and ``host_tier`` (capacity, experts held, host hits, disk reads,
staged reads, staged reads later used, evictions, reads not kept).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import Counter
from dataclasses import asdict, dataclass

import torch

from specter.errors import SpecterError
from specter.memory.disk_store import DiskSource, FutureTransfer
from specter.memory.link import Link, Tensors, Transfer
from specter.policies.base import CachePolicy, ExpertKey


@dataclass
class HostTierStats:
    host_hits: int = 0
    disk_reads: int = 0
    staged: int = 0
    staged_used: int = 0
    evictions: int = 0
    not_kept: int = 0


class HostTierLink(Link):
    """A host-memory expert tier in front of a device link (see the module docstring)."""

    stages = True

    def __init__(self, device_link: Link, capacity: int, policy: CachePolicy, workers: int = 4,
                 pin: bool = False) -> None:
        if capacity < 1:
            raise ValueError(f"the host tier needs at least one expert, got capacity {capacity}")
        self.device_link, self.capacity, self.policy, self.pin = device_link, capacity, policy, pin
        self.kind, self.gbps, self.latency_us = device_link.kind, device_link.gbps, device_link.latency_us
        self.emulated = device_link.emulated
        self.stats = HostTierStats()
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="specter-host-tier")
        self._lock = threading.Lock()
        self._free: list[dict[str, torch.Tensor]] = []
        self._allocated = 0
        self._held: dict[ExpertKey, dict[str, torch.Tensor]] = {}  # read complete
        self._reading: dict[ExpertKey, concurrent.futures.Future] = {}  # read in flight, buffer reserved
        self._copying: list[tuple[ExpertKey, Transfer]] = []  # device copies reading a held buffer
        self._waiting: Counter[ExpertKey] = Counter()  # submits waiting for a read, then copying
        self._passing: dict[ExpertKey, concurrent.futures.Future] = {}  # reads into buffers not kept
        self._staged_unused: set[ExpertKey] = set()
        self._disk = None
        self._closed = False

    # ----- the tier ---------------------------------------------------------------------------

    def _new_buffer(self, src: DiskSource) -> dict[str, torch.Tensor]:
        # written by the worker threads, outside the engine's inference mode: a normal tensor
        with torch.inference_mode(False):
            return {name: torch.empty(shape, dtype=src.disk.dtype, pin_memory=self.pin)
                    for name, shape in src.disk.param_shapes.items()}

    def _busy(self) -> set[ExpertKey]:
        self._copying = [(key, t) for key, t in self._copying if not t.done()]
        return {key for key, _ in self._copying} | {key for key, n in self._waiting.items() if n}

    def _take_buffer(self, src: DiskSource) -> dict[str, torch.Tensor] | None:
        """A buffer for a new read (lock held): free, newly allocated, or evicted; None if all busy."""
        if self._free:
            return self._free.pop()
        if self._allocated < self.capacity:
            self._allocated += 1
            return self._new_buffer(src)
        busy = self._busy()
        candidates = [key for key in self._held if key not in busy]
        if not candidates:
            return None
        victim = self.policy.choose_victim(candidates)
        self.policy.on_evict(victim)
        self._staged_unused.discard(victim)
        self.stats.evictions += 1
        return self._held.pop(victim)

    def _read(self, key: ExpertKey, src: DiskSource, buffer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        try:
            src.read_into(buffer)
        except BaseException:
            with self._lock:
                self._reading.pop(key, None)
                self._free.append(buffer)
                self._staged_unused.discard(key)  # a failed staging serves nothing: not counted as used
            raise
        with self._lock:
            self._reading.pop(key, None)
            self._held[key] = buffer
            self.policy.on_insert(key)
        return buffer

    def _start_read(self, key: ExpertKey, src: DiskSource) -> concurrent.futures.Future | None:
        """The future of ``key``'s read into the tier (lock held), started if need be; None when
        no buffer can take it."""
        if key in self._reading:
            return self._reading[key]
        buffer = self._take_buffer(src)
        if buffer is None:
            return None
        self.stats.disk_reads += 1
        future = self._pool.submit(self._read, key, src, buffer)
        self._reading[key] = future
        return future

    def stage(self, src: Tensors) -> None:
        if not isinstance(src, DiskSource):
            return
        self._disk = src.disk
        key = (src.layer, src.expert)
        with self._lock:
            if key in self._held or key in self._reading or key in self._passing:
                return
            if self._start_read(key, src) is not None:
                self.stats.staged += 1
                self._staged_unused.add(key)

    # ----- the link contract ------------------------------------------------------------------

    def submit(self, dst: Tensors, src: Tensors, slot: int) -> Transfer:
        if self._closed:
            raise SpecterError(f"submit on a closed host tier ({self.kind} link)")
        if not isinstance(src, DiskSource):
            return self.device_link.submit(dst, src, slot)
        self._disk = src.disk
        key = (src.layer, src.expert)
        nbytes = src.disk.expert_file_bytes(src.layer, src.expert)
        with self._lock:
            if key in self._staged_unused:
                self._staged_unused.discard(key)
                self.stats.staged_used += 1
            held = self._held.get(key)
            if held is not None:
                self.stats.host_hits += 1
                self.policy.on_access(key)
                transfer = self.device_link.submit(dst, held, slot)
                self._copying.append((key, transfer))
                return transfer
            passing = self._passing.get(key)
            read = None if passing is not None else self._start_read(key, src)
            if read is not None:
                self._waiting[key] += 1
            elif passing is None:  # every buffer busy: read into one that is not kept
                self.stats.not_kept += 1
                self.stats.disk_reads += 1
                passing = self._passing[key] = self._pool.submit(self._read_through, key, src)
        if read is None:
            return FutureTransfer(self._pool.submit(self._copy_from, passing, dst, slot), nbytes)
        return FutureTransfer(self._pool.submit(self._copy_after, read, key, dst, slot), nbytes)

    def _copy_after(self, read: concurrent.futures.Future, key: ExpertKey, dst: Tensors, slot: int) -> None:
        try:
            buffer = read.result()
            with self._lock:
                self.policy.on_access(key)
                transfer = self.device_link.submit(dst, buffer, slot)
                self._copying.append((key, transfer))
        finally:
            with self._lock:
                self._waiting[key] -= 1
        transfer.wait()

    def _read_through(self, key: ExpertKey, src: DiskSource) -> dict[str, torch.Tensor]:
        try:
            buffer = self._new_buffer(src)
            src.read_into(buffer)
            return buffer  # never written again: copies of it may read it at any time
        finally:
            with self._lock:
                self._passing.pop(key, None)

    def _copy_from(self, read: concurrent.futures.Future, dst: Tensors, slot: int) -> None:
        self.device_link.submit(dst, read.result(), slot).wait()

    def release_slot(self, slot: int) -> None:
        self.device_link.release_slot(slot)

    def reset_counters(self) -> None:
        self.stats = HostTierStats()
        self.device_link.reset_counters()
        if self._disk is not None:
            self._disk.reset_counters()

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True)
        self.device_link.close()
        if self._disk is not None:
            self._disk.close()

    def describe(self) -> dict[str, object]:
        described = self.device_link.describe()
        if self._disk is not None:
            described.update(self._disk.figures())
        with self._lock:
            held = len(self._held)
        described["host_tier"] = {"capacity": self.capacity, "held": held, **asdict(self.stats)}
        return described

