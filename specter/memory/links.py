"""The built-in links (the contract is ``specter.memory.link``).

Built-ins, registered through the ``register_links`` hook:
- ``local``: copies at the machine's own speed, no pacing. On a CPU device with more than one core
  they run in FIFO order on a copy thread (the spare core is the "copy engine", as a GPU's DMA
  engine is: copies overlap compute, ``overlaps_compute`` True); with ``copy_thread: false``, on
  one core or on a CUDA device (where ``cuda`` is the asynchronous link) ``submit`` copies before
  it returns.
- ``emulated``: real copies done in FIFO order by a worker thread, each completing no earlier than
  ``max(submit, previous completion) + latency_us * 1e-6 + nbytes / (gbps * 1e9)``: a serial link
  of the configured bandwidth and latency, so a CPU reproduces the I/O-bound regime of a
  PCIe-attached accelerator. Its figures must be labelled emulated (``Link.emulated``). A large
  tensor's bytes are copied paced over the transfer's wire time (``stream_copy.paced_copy``), so
  the copy draws on memory at the link's rate, as a DMA engine does, not in one burst at memory
  speed; smaller tensors, links over ``PACED_MAX_GBPS`` (near memcpy's own rate) or a machine
  without the native kernels copy at once.
- ``cuda``: asynchronous copies on a side stream from pinned host memory, one event per transfer.
- ``disk``: reads of experts straight from the checkpoint on a pool of threads
  (``specter.memory.disk_store``; recipes with ``offload.experts_on: disk``).
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
import weakref

import torch

from specter.errors import SpecterError
from specter.hookspecs import Register, hookimpl
from specter.memory import stream_copy
from specter.memory.disk_store import DiskLink
from specter.memory.link import (
    CompletedTransfer, Link, Tensors, Transfer, TransferTimeout, copy_all, transfer_nbytes,
)

class ThreadTransfer(Transfer):
    """Completed by a worker thread; the only object that thread shares with the caller."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._finished = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> float:
        if self._finished.is_set():
            blocked = 0.0
        else:
            start = time.perf_counter()
            if not self._finished.wait(timeout):
                raise TransferTimeout(f"not complete after {timeout:g} s")
            blocked = time.perf_counter() - start
        if self._error is not None:
            raise SpecterError(f"expert transfer failed: {self._error}") from self._error
        return blocked

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._finished.set()


_STOP = object()
_OPEN: weakref.WeakSet = weakref.WeakSet()  # copy-thread links not yet closed


@atexit.register
def _close_open_links() -> None:
    """Stops every copy thread before the interpreter finalizes: a daemon worker returning from a
    native copy (which runs without the GIL) once finalization has begun would be ended mid-C++
    frame, and the process would abort."""
    for link in list(_OPEN):
        link.close()


class CopyThreadLink(Link):
    """Copies done in FIFO order by one worker thread; ``_due`` says when each may complete (a
    subclass paces them). ``close()`` stops the worker after the copies already submitted."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._closing = threading.Lock()  # a submit and a close never interleave: nothing queued behind the stop
        # the worker holds the link weakly: a link dropped without close() (its engine garbage) stops it
        self._worker = threading.Thread(target=_serve, args=(weakref.ref(self), self._queue),
                                        name=f"specter-{self.kind}-link", daemon=True)
        self._worker.start()
        self._stop_when_dropped = weakref.finalize(self, self._queue.put, _STOP)
        _OPEN.add(self)

    def _due(self, submitted: float, previous_completion: float, nbytes: int) -> float:
        """The earliest perf_counter time at which a copy may complete (default: at once)."""
        return 0.0

    def _copy(self, dst: Tensors, src: Tensors, due: float) -> None:
        """Copies one transfer's tensors on the worker (default: at once)."""
        copy_all(dst, src)

    def submit(self, dst: Tensors, src: Tensors, slot: int) -> Transfer:
        transfer = ThreadTransfer(transfer_nbytes(src))
        with self._closing:
            if self._closed:
                raise SpecterError(f"submit on a closed {self.kind} link")
            self._queue.put((transfer, dst, src, time.perf_counter()))
        return transfer

    def close(self) -> None:
        with self._closing:
            if self._closed:
                return
            self._closed = True
            self._stop_when_dropped.detach()
            self._queue.put(_STOP)
        self._worker.join()
        _OPEN.discard(self)

    @property
    def alive(self) -> bool:
        return self._worker.is_alive()

def _serve(link_ref: "weakref.ref[CopyThreadLink]", work: queue.SimpleQueue) -> None:
    """A copy thread's loop: each transfer in FIFO order until the stop (``close()``, or the link
    garbage: its finalizer queues the stop behind the transfers already submitted)."""
    previous_completion = 0.0
    while True:
        item = work.get()
        if item is _STOP:
            return
        transfer, dst, src, submitted = item
        link = link_ref()
        if link is None:  # dropped with copies still queued: whoever holds one of them is told, not stranded
            transfer._finish(SpecterError("the link was dropped before this copy ran"))
            continue
        due = link._due(submitted, previous_completion, transfer.nbytes)
        try:
            link._copy(dst, src, due)
        except BaseException as error:  # handed to the caller through wait()
            transfer._finish(error)
            previous_completion = time.perf_counter()
            continue
        finally:
            del link
        while (remaining := due - time.perf_counter()) > 0:
            time.sleep(remaining)
        transfer._finish()
        previous_completion = time.perf_counter()


def _spare_core() -> bool:
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return len(cores) > 1


class LocalLink(CopyThreadLink):
    """``local``: unpaced copies; on a copy thread unless ``copy_thread`` is False, the device is
    not a CPU, or the process has one core (then synchronous, ``overlaps_compute`` False)."""

    kind = "local"
    copy_thread = False
    overlaps_compute = False
    _closed = False

    def __init__(self, copy_thread: bool | None = None, device: str | torch.device | None = None) -> None:
        if copy_thread not in (None, True, False):
            raise SpecterError(f"offload.link.options.copy_thread: true or false, got {copy_thread!r}")
        on_cpu = device is None or torch.device(device).type == "cpu"
        if copy_thread and not on_cpu:
            raise SpecterError(f"offload.link.options.copy_thread: a copy thread serves a CPU device, the device "
                               f"is {device}; use the cuda link for asynchronous copies to a GPU")
        self.copy_thread = on_cpu and _spare_core() if copy_thread is None else copy_thread
        self.overlaps_compute = self.copy_thread
        if self.copy_thread:
            super().__init__()

    def submit(self, dst: Tensors, src: Tensors, slot: int) -> Transfer:
        if self.copy_thread:
            return super().submit(dst, src, slot)
        if self._closed:
            raise SpecterError("submit on a closed local link")
        copy_all(dst, src)
        return CompletedTransfer(transfer_nbytes(src))

    def close(self) -> None:
        if self.copy_thread:
            super().close()
        self._closed = True

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "copy_thread": self.copy_thread}


class EmulatedLink(CopyThreadLink):
    kind = "emulated"
    emulated = True
    paced = True  # large tensors' bytes spread over the wire time (False: copied at once, then waited)
    PACED_MAX_GBPS = 8.0  # faster links copy in one burst: a 12 MiB expert's pieces on 20 GB/s ran 2-5% slower

    def __init__(self, gbps: float, latency_us: float = 0.0) -> None:
        if not gbps or gbps <= 0:
            raise SpecterError(f"link.gbps: must be > 0 for an emulated link, got {gbps!r}")
        if latency_us < 0:
            raise SpecterError(f"link.latency_us: must be >= 0, got {latency_us!r}")
        self.gbps = float(gbps)
        self.latency_us = float(latency_us)
        super().__init__()

    def duration_s(self, nbytes: int) -> float:
        """The time the emulated wire is busy with one transfer of ``nbytes``."""
        assert self.latency_us is not None and self.gbps is not None
        return self.latency_us * 1e-6 + nbytes / (self.gbps * 1e9)

    def _due(self, submitted: float, previous_completion: float, nbytes: int) -> float:
        return max(submitted, previous_completion) + self.duration_s(nbytes)

    def _copy(self, dst: Tensors, src: Tensors, due: float) -> None:
        """Small tensors at once, then the large ones paced in one native call until ``due``."""
        paced = self.paced and self.gbps <= self.PACED_MAX_GBPS
        large = [name for name, tensor in src.items() if paced and stream_copy.serves(dst[name], tensor)]
        copy_all({name: dst[name] for name in src if name not in large},
                 {name: tensor for name, tensor in src.items() if name not in large})
        if large:
            stream_copy.paced_copy([dst[name] for name in large], [src[name] for name in large],
                                   due - time.perf_counter())


class CudaTransfer(Transfer):
    def __init__(self, event: "torch.cuda.Event", nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self._event = event
        self._device = device

    def done(self) -> bool:
        return self._event.query()

    def wait(self, timeout: float | None = None) -> float:
        torch.cuda.current_stream(self._device).wait_event(self._event)
        if self._event.query():
            return 0.0
        start = time.perf_counter()
        if timeout is None:
            self._event.synchronize()
        else:
            while not self._event.query():
                if time.perf_counter() - start > timeout:
                    raise TransferTimeout(f"not complete after {timeout:g} s")
                time.sleep(2e-5)
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
        self._closed = False

    def submit(self, dst: Tensors, src: Tensors, slot: int) -> Transfer:
        if self._closed:
            raise SpecterError("submit on a closed cuda link")
        released = self._slot_released.pop(slot, None)
        with torch.cuda.stream(self._stream):
            if released is not None:
                self._stream.wait_event(released)
            copy_all(dst, src, non_blocking=True)
            finished = torch.cuda.Event()
            finished.record(self._stream)
        return CudaTransfer(finished, transfer_nbytes(src), self.device)

    def release_slot(self, slot: int) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._slot_released[slot] = event

    def close(self) -> None:
        self._closed = True
        self._stream.synchronize()
        self._slot_released.clear()


@hookimpl
def register_links(register: Register) -> None:
    register("local", LocalLink)
    register("emulated", EmulatedLink)
    register("cuda", CudaLink)
    register("disk", DiskLink)
