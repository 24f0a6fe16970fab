"""The experts kept on disk: a store that reads from the checkpoint, and the ``disk`` link.

Contract:
- ``DiskStore(disk, n_experts)`` answers what ``ExpertStore`` answers (``layers``, ``n_experts``,
  ``param_shapes``, ``dtype``, ``expert_bytes``, ``expert(layer, e)``, ``stacked(layer)``) without
  holding experts in memory: ``expert`` returns a ``DiskSource``, a read-only mapping of the
  expert's tensors that reads them from disk the first time they are looked at (so any link, even
  ``local``, copies from it), and that the ``disk`` link reads straight into a cache slot.
  ``stacked`` reads a whole layer in the store's layout (``blocked``: the disk tier's), ``standard``
  in the standard layout (used once, to quantise the INT4 draft), ``reference(layer, e)`` one
  expert's tensors (what ``verify_copies`` checks a copy against); all three read through a
  ``DiskExperts.detached()`` reader, so the link's read figures count none of it.
- ``DiskLink(workers=4, device=None)`` (plugin ``disk``): ``submit`` hands the read of a
  ``DiskSource`` into the slot to a pool of ``workers`` threads (several reads in flight, real
  I/O, nothing emulated) and returns a transfer done when the bytes are in the slot; a source
  that is not on disk is copied synchronously. ``describe()`` adds the disk's read mode, bytes
  read and seconds spent reading, so reports state whether the page cache was bypassed.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Iterator, Mapping

import torch

from specter.errors import SpecterError
from specter.memory.disk import DiskExperts
from specter.memory.store import check_key, expert_nbytes
from specter.memory.link import CompletedTransfer, Link, Tensors, Transfer, TransferTimeout, copy_all, transfer_nbytes


class DiskSource(Mapping[str, torch.Tensor]):
    """One expert on disk, as a mapping of its tensors (read on first access)."""

    def __init__(self, disk: DiskExperts, layer: int, expert: int) -> None:
        self.disk, self.layer, self.expert = disk, layer, expert
        self._tensors: dict[str, torch.Tensor] | None = None

    def read_into(self, dst: Tensors) -> None:
        self.disk.read_into(dict(dst), self.layer, self.expert)

    def _loaded(self) -> dict[str, torch.Tensor]:
        if self._tensors is None:
            self._tensors = self.disk.read(self.layer, self.expert)
        return self._tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._loaded()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.disk.param_shapes)

    def __len__(self) -> int:
        return len(self.disk.param_shapes)


class DiskStore:
    """Experts served from the checkpoint on disk (see the module docstring)."""

    pinned = False

    def __init__(self, disk: DiskExperts, n_experts: int) -> None:
        self.disk = disk
        self._n_experts = n_experts

    @property
    def layers(self) -> list[int]:
        return sorted(self.disk.layers)

    @property
    def n_experts(self) -> int:
        return self._n_experts

    @property
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.disk.param_shapes)

    @property
    def dtype(self) -> torch.dtype:
        return self.disk.dtype

    @property
    def expert_bytes(self) -> int:
        return expert_nbytes(self.param_shapes, self.dtype)

    @property
    def total_bytes(self) -> int:
        return self.expert_bytes * self._n_experts * len(self.layers)

    def expert(self, layer: int, expert: int) -> DiskSource:
        check_key(self.layers, self._n_experts, layer, expert)
        return DiskSource(self.disk, layer, expert)

    @property
    def blocked(self) -> bool:
        return self.disk.blocked

    def reference(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        check_key(self.layers, self._n_experts, layer, expert)
        with self.disk.detached() as reader:
            return reader.read(layer, expert)

    def stacked(self, layer: int) -> dict[str, torch.Tensor]:
        return self._read_layer(layer, self.blocked)

    def standard(self, layer: int) -> dict[str, torch.Tensor]:
        return self._read_layer(layer, False)

    def _read_layer(self, layer: int, blocked: bool) -> dict[str, torch.Tensor]:
        out = {name: torch.empty((self._n_experts, *shape), dtype=self.dtype) for name, shape in self.param_shapes.items()}
        with self.disk.detached() as reader:  # not the link's reads: its figures and files stay untouched
            for expert in range(self._n_experts):
                reader.read_into({name: tensor[expert] for name, tensor in out.items()}, layer, expert, blocked)
        return out


class FutureTransfer(Transfer):
    def __init__(self, future: concurrent.futures.Future, nbytes: int) -> None:
        self.nbytes = nbytes
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> float:
        if self._future.done():
            self._future.result()
            return 0.0
        started = time.perf_counter()
        try:
            self._future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:  # the builtin TimeoutError: a failed read may raise it too
            if self._future.done():
                raise
            raise TransferTimeout(f"not complete after {timeout:g} s") from None
        return time.perf_counter() - started


class DiskLink(Link):
    """Reads experts from the checkpoint into cache slots on a pool of threads."""

    kind = "disk"

    def __init__(self, workers: int = 4, device: str | torch.device | None = None) -> None:
        if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= 64:
            raise ValueError(f"workers must be an integer in 1..64, got {workers!r}")
        if device is not None and torch.device(device).type != "cpu":
            raise SpecterError("offload.link.kind: 'disk' reads into host-memory caches (device: cpu); on a GPU "
                               "keep the experts in host memory")
        self.workers = workers
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="specter-disk")
        self._disks: set = set()
        self._closed = False

    def submit(self, dst: Tensors, src: Tensors, slot: int) -> Transfer:
        if self._closed:
            raise SpecterError("submit on a closed disk link")
        if isinstance(src, DiskSource):
            self._disks.add(src.disk)
            return FutureTransfer(self._pool.submit(src.read_into, dst), src.disk.expert_file_bytes(src.layer, src.expert))
        copy_all(dst, src)
        return CompletedTransfer(transfer_nbytes(src))

    def reset_counters(self) -> None:
        for disk in self._disks:
            disk.reset_counters()

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True)
        for disk in self._disks:
            disk.close()

    def describe(self) -> dict[str, object]:
        described = super().describe()
        disk = next(iter(self._disks), None)
        if disk is not None:
            described.update(disk.figures())
        described["workers"] = self.workers
        return described
