"""The link contract: how expert bytes move from the host ExpertStore into device cache slots.

Contract: ``Link.submit(dst, src, slot)`` starts copying every tensor of ``src`` into the tensor of
the same name in ``dst`` (the views of cache slot ``slot``) and returns a ``Transfer``.
``Transfer.done()`` never blocks; ``Transfer.wait(timeout=None)`` blocks until the copy is
complete *and visible to the caller's compute*, returning the seconds it blocked (0.0 when it was
already done; calling it again is harmless), or raises ``TransferTimeout`` when ``timeout``
seconds pass first; a copy that failed raises its error from ``wait``. ``wait_for(transfer,
timeout)`` applies a deadline to any transfer, also one whose ``wait`` takes no timeout (that
wait then runs on a watchdog thread). ``Link.release_slot(slot)`` says compute no longer reads the
slot, so a later copy into it must not overtake those reads. ``close()`` frees the link's
resources; submitting afterwards is an error. ``copy_all``, ``checksum`` and
``CompletedTransfer`` serve link authors (the cache checks arrivals with ``checksum``); the built-in links are in ``specter.memory.links``.
"""

from __future__ import annotations

import inspect
import threading
from abc import ABC, abstractmethod
from typing import Mapping

import torch

from specter.memory import stream_copy

Tensors = Mapping[str, torch.Tensor]


class Transfer(ABC):
    """One copy in flight. ``nbytes``: the bytes it moves. A link may complete it on another
    thread; the cache only calls ``done()`` and ``wait()`` from its own."""

    nbytes: int

    @abstractmethod
    def done(self) -> bool:
        """Whether the copy has completed; never blocks."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> float:
        """Block until the copy is complete; return the seconds spent blocked. With ``timeout``,
        raise ``TransferTimeout`` if it is not complete by then."""


class Link(ABC):
    """Moves expert bytes host -> device slot (see the module docstring for the contract).

    ``kind`` names the plugin in reports; ``gbps``/``latency_us`` describe the link where it
    knows them (None otherwise); ``emulated`` must be True when its timing is paced rather than
    real, so reports label its figures; ``overlaps_compute`` is False for a link whose ``submit``
    completes the copy before returning (then prefetching early hides nothing). Factories are
    offered ``device`` (the engine's device) and receive ``offload.link.options`` (and
    ``gbps``/``latency_us`` for ``emulated``)."""

    kind: str = ""
    gbps: float | None = None
    latency_us: float | None = None
    emulated: bool = False
    overlaps_compute: bool = True  # False when ``submit`` copies before it returns (nothing to hide a copy behind)

    @abstractmethod
    def submit(self, dst: Tensors, src: Tensors, slot: int) -> Transfer:
        """Start copying ``src[name]`` into ``dst[name]`` for every name of ``src``."""

    def release_slot(self, slot: int) -> None:
        """Compute has stopped reading ``slot``; links with asynchronous compute order on it."""

    stages: bool = False  # True when ``stage`` does something (the scheduler only then calls it)

    def stage(self, src: Tensors) -> None:
        """``src`` is predicted to be needed soon: a link with a tier of its own below the device
        (``specter.memory.host_tier``) may start bringing it closer, with no slot yet; such a link
        sets ``stages``. Default: nothing."""

    def close(self) -> None:
        """Release the link's resources."""

    def reset_counters(self) -> None:
        """Forget counters that ``describe`` reports, so a report covers one ``generate`` call."""

    def describe(self) -> dict[str, object]:
        """The link's entry in a report."""
        return {"kind": self.kind, "gbps": self.gbps, "latency_us": self.latency_us,
                "emulated": self.emulated}


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


_CHECKSUM_CHUNK = 64  # words a chunk: the position-weighted sum tells chunks apart, not words within one


def checksum(tensors: Tensors) -> tuple[int, ...]:
    """A cheap content checksum of a copy's tensors: per tensor, the integer sum of its raw words
    and a position-weighted sum (each 64-word chunk's sum, then each word of the tail shorter than
    a chunk, times 1 + its index mod 251): bit flips, zeroed or stale bytes, and bytes landed at the
    wrong offset (pieces swapped or shifted by a chunk or more) change it with overwhelming
    likelihood. One pass over the words, plus a pass over the chunk sums."""
    out: list[int] = []
    for _, tensor in sorted(tensors.items()):
        words = tensor.contiguous().view(_INT_VIEW[tensor.element_size()]).reshape(-1)
        whole = words.numel() - words.numel() % _CHECKSUM_CHUNK
        parts = torch.cat([words[:whole].view(-1, _CHECKSUM_CHUNK).sum(1, dtype=torch.int64),
                           words[whole:].to(torch.int64)])
        weights = torch.arange(parts.numel(), device=parts.device, dtype=torch.int64) % 251 + 1
        out += [int(parts.sum()), int((parts * weights).sum())]  # integer sums: exact in any order
    return tuple(out)


def transfer_nbytes(src: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in src.values())


def copy_all(dst: Tensors, src: Tensors, non_blocking: bool = False) -> None:
    """``dst[name].copy_(src[name])`` for every name; large CPU-to-CPU copies stream, all of them
    in one native call (``specter.memory.stream_copy.copy_many``)."""
    streamed_dst, streamed_src = [], []
    for name, tensor in src.items():
        target = dst[name]
        if stream_copy.serves(target, tensor):
            streamed_dst.append(target)
            streamed_src.append(tensor)
        else:
            target.copy_(tensor, non_blocking=non_blocking)
    if streamed_src:
        stream_copy.copy_many(streamed_dst, streamed_src)


class CompletedTransfer(Transfer):
    """A transfer that finished before ``submit`` returned."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> float:
        return 0.0


class TransferTimeout(TimeoutError):
    """A transfer did not complete within its deadline."""


_TAKES_TIMEOUT: dict[type, bool] = {}


def wait_for(transfer: Transfer, timeout: float | None) -> float:
    """``transfer.wait()`` with a deadline of ``timeout`` seconds (None: none): the seconds
    blocked, or ``TransferTimeout``."""
    if timeout is None or transfer.done():
        return transfer.wait()
    cls = type(transfer)
    if cls not in _TAKES_TIMEOUT:
        try:
            _TAKES_TIMEOUT[cls] = "timeout" in inspect.signature(transfer.wait).parameters
        except (TypeError, ValueError):
            _TAKES_TIMEOUT[cls] = False
    if _TAKES_TIMEOUT[cls]:
        return transfer.wait(timeout=timeout)
    # a wait without a deadline of its own (it may be what completes the copy): a watchdog thread
    outcome: dict[str, object] = {}

    def wait() -> None:
        try:
            outcome["blocked"] = transfer.wait()
        except BaseException as error:  # handed back to the caller below
            outcome["error"] = error

    watchdog = threading.Thread(target=wait, name="specter-transfer-wait", daemon=True)
    watchdog.start()
    watchdog.join(timeout)
    if watchdog.is_alive():
        raise TransferTimeout(f"not complete after {timeout:g} s")
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return float(outcome["blocked"])  # type: ignore[arg-type]
