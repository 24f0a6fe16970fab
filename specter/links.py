"""Links: how expert bytes move from the host ExpertStore into device cache slots.

Contract: ``Link.submit(dst, src, slot)`` starts copying every tensor of ``src`` into the tensor of
the same name in ``dst`` (the views of cache slot ``slot``) and returns a ``Transfer``.
``Transfer.done()`` never blocks; ``Transfer.wait()`` blocks until the copy is complete *and
visible to the caller's compute*, returning the seconds it blocked (0.0 when it was already
done; calling it again is harmless). ``Link.release_slot(slot)`` says compute no longer reads the
slot, so a later copy into it must not overtake those reads. ``close()`` frees the link's
resources; submitting afterwards is an error.

Built-ins, registered through the ``register_links`` hook:
- ``local``: a synchronous copy, no pacing (the device is the host, or pacing is not wanted).
- ``emulated``: real copies done in FIFO order by a worker thread, each completing no earlier than
  ``max(submit, previous completion) + latency_us * 1e-6 + nbytes / (gbps * 1e9)``: a serial link
  of the configured bandwidth and latency, so a CPU reproduces the I/O-bound regime of a
  PCIe-attached accelerator. Its figures must be labelled emulated (``Link.emulated``).
- ``cuda``: asynchronous copies on a side stream from pinned host memory, one event per transfer.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from typing import Mapping

import torch

from specter.errors import SpecterError
from specter.hookspecs import Register, hookimpl

Tensors = Mapping[str, torch.Tensor]


class Transfer(ABC):
    nbytes: int

    @abstractmethod
    def done(self) -> bool:
        """Whether the copy has completed; never blocks."""

    @abstractmethod
    def wait(self) -> float:
        """Block until the copy is complete; return the seconds spent blocked."""


class Link(ABC):
    kind: str = ""
    gbps: float | None = None
    latency_us: float | None = None
    emulated: bool = False

    @abstractmethod
    def submit(self, dst: Tensors, src: Tensors, slot: int) -> Transfer:
        """Start copying ``src[name]`` into ``dst[name]`` for every name of ``src``."""

    def release_slot(self, slot: int) -> None:
        """Compute has stopped reading ``slot``; links with asynchronous compute order on it."""

    def close(self) -> None:
        """Release the link's resources."""

    def describe(self) -> dict[str, object]:
        """The link's entry in a report."""
        return {"kind": self.kind, "gbps": self.gbps, "latency_us": self.latency_us,
                "emulated": self.emulated}


def transfer_nbytes(src: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in src.values())


def _copy_all(dst: Tensors, src: Tensors, non_blocking: bool = False) -> None:
    for name, tensor in src.items():
        dst[name].copy_(tensor, non_blocking=non_blocking)


class CompletedTransfer(Transfer):
    """A transfer that finished before ``submit`` returned."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def done(self) -> bool:
        return True

    def wait(self) -> float:
        return 0.0


class LocalLink(Link):
    kind = "local"

    def submit(self, dst: Tensors, src: Tensors, slot: int) -> Transfer:
        _copy_all(dst, src)
        return CompletedTransfer(transfer_nbytes(src))


class ThreadTransfer(Transfer):
    """Completed by a worker thread; the only object that thread shares with the caller."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._finished = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self) -> float:
        if self._finished.is_set():
            blocked = 0.0
        else:
            start = time.perf_counter()
            self._finished.wait()
            blocked = time.perf_counter() - start
        if self._error is not None:
            raise SpecterError(f"expert transfer failed: {self._error}") from self._error
        return blocked

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._finished.set()


_STOP = object()


class EmulatedLink(Link):
    kind = "emulated"
    emulated = True

    def __init__(self, gbps: float, latency_us: float = 0.0) -> None:
        if not gbps or gbps <= 0:
            raise SpecterError(f"link.gbps: must be > 0 for an emulated link, got {gbps!r}")
        if latency_us < 0:
            raise SpecterError(f"link.latency_us: must be >= 0, got {latency_us!r}")
        self.gbps = float(gbps)
        self.latency_us = float(latency_us)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._worker = threading.Thread(target=self._serve, name="specter-emulated-link", daemon=True)
        self._worker.start()

    def duration_s(self, nbytes: int) -> float:
        """The time the emulated wire is busy with one transfer of ``nbytes``."""
        assert self.latency_us is not None and self.gbps is not None
        return self.latency_us * 1e-6 + nbytes / (self.gbps * 1e9)

    def submit(self, dst: Tensors, src: Tensors, slot: int) -> Transfer:
        if self._closed:
            raise SpecterError("submit on a closed emulated link")
        transfer = ThreadTransfer(transfer_nbytes(src))
        self._queue.put((transfer, dst, src, time.perf_counter()))
        return transfer

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._worker.join()

    @property
    def alive(self) -> bool:
        return self._worker.is_alive()

    def _serve(self) -> None:
        previous_completion = 0.0
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            transfer, dst, src, submitted = item
            due = max(submitted, previous_completion) + self.duration_s(transfer.nbytes)
            try:
                _copy_all(dst, src)
            except BaseException as error:  # handed to the caller through wait()
                transfer._finish(error)
                previous_completion = time.perf_counter()
                continue
            while (remaining := due - time.perf_counter()) > 0:
                time.sleep(remaining)
            transfer._finish()
            previous_completion = time.perf_counter()


class CudaTransfer(Transfer):
    def __init__(self, event: "torch.cuda.Event", nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self._event = event
        self._device = device

    def done(self) -> bool:
        return self._event.query()

    def wait(self) -> float:
        torch.cuda.current_stream(self._device).wait_event(self._event)
        if self._event.query():
            return 0.0
        start = time.perf_counter()
        self._event.synchronize()
        return time.perf_counter() - start


class CudaLink(Link):
    """Copies on a side stream; compute orders after a copy through ``Transfer.wait`` and copies
    order after compute's last read of their slot through ``release_slot``."""

    kind = "cuda"

    def __init__(self, device: str | torch.device = "cuda") -> None:
        if not torch.cuda.is_available():
            raise SpecterError("link.kind: 'cuda' needs a CUDA device; use 'emulated' or 'local'")
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(device=self.device)
        self._slot_released: dict[int, torch.cuda.Event] = {}

    def submit(self, dst: Tensors, src: Tensors, slot: int) -> Transfer:
        released = self._slot_released.pop(slot, None)
        with torch.cuda.stream(self._stream):
            if released is not None:
                self._stream.wait_event(released)
            _copy_all(dst, src, non_blocking=True)
            finished = torch.cuda.Event()
            finished.record(self._stream)
        return CudaTransfer(finished, transfer_nbytes(src), self.device)

    def release_slot(self, slot: int) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._slot_released[slot] = event

    def close(self) -> None:
        self._stream.synchronize()
        self._slot_released.clear()


@hookimpl
def register_links(register: Register) -> None:
    register("local", LocalLink)
    register("emulated", EmulatedLink)
    register("cuda", CudaLink)
