"""Links for the cache's state-machine tests: transfers that complete only when the test says
(or when waited for), so in-flight copies are observable, and the ``disk`` link behind such a
gate, asserting that no expert is read twice while a read of it is in flight.

Contract: ``ManualLink`` records the last transfer per slot and asserts that no second copy
enters a slot while one is in flight; ``ManualTransfer.complete()`` copies; ``wait()`` completes
and counts a blocked wait of ``SIMULATED_WAIT_S``. ``GatedDiskLink`` starts real disk reads at
once and lets the cache see them finish only on ``complete()`` or ``wait()``.
"""

from __future__ import annotations

from specter.memory.disk_store import DiskLink
from specter.memory.link import Link, Tensors, Transfer
from specter.policies.base import ExpertKey

SIMULATED_WAIT_S = 0.001


class ManualTransfer(Transfer):
    """Copies only when completed by the test, or when waited for (a blocking wait)."""

    def __init__(self, link: "ManualLink", dst: Tensors, src: Tensors, slot: int) -> None:
        self.link, self.dst, self.src, self.slot = link, dst, src, slot
        self.nbytes = sum(t.numel() * t.element_size() for t in src.values())
        self.completed = False

    def done(self) -> bool:
        return self.completed

    def wait(self) -> float:
        if self.completed:
            return 0.0
        self.complete()
        self.link.blocked_waits += 1
        return SIMULATED_WAIT_S

    def complete(self) -> None:
        if not self.completed:
            for name, tensor in self.src.items():
                self.dst[name].copy_(tensor)
            self.completed = True


class ManualLink(Link):
    kind = "manual"

    def __init__(self) -> None:
        self.last_transfer: dict[int, ManualTransfer] = {}
        self.blocked_waits = 0

    def submit(self, dst: Tensors, src: Tensors, slot: int) -> Transfer:
        previous = self.last_transfer.get(slot)
        assert previous is None or previous.completed, f"second copy into slot {slot} while one is in flight"
        transfer = ManualTransfer(self, dst, src, slot)
        self.last_transfer[slot] = transfer
        return transfer

    def pending(self) -> list[ManualTransfer]:
        return [t for t in self.last_transfer.values() if not t.completed]

    def slot_copy_complete(self, slot: int) -> bool:
        transfer = self.last_transfer.get(slot)
        return transfer is None or transfer.completed


class GatedTransfer(ManualTransfer):
    """A real disk read, started at once on the disk link's threads, that the cache sees finished
    only when the test completes it (or waits for it): thread timing never changes the machine's
    course, so hypothesis can replay it, while the bytes still come from the file."""

    def __init__(self, link: "GatedDiskLink", read: Transfer, src: Tensors, slot: int) -> None:
        super().__init__(link, {}, src, slot)
        self.read = read

    def complete(self) -> None:
        if not self.completed:
            self.read.wait()
            self.completed = True


class GatedDiskLink(ManualLink):
    """The ``disk`` link behind a gate, asserting that no expert is read twice while a read of it
    is in flight (as the cache sees it)."""

    kind = "gated-disk"

    def __init__(self) -> None:
        super().__init__()
        self.disk = DiskLink(workers=2)
        self.in_flight: dict[ExpertKey, GatedTransfer] = {}

    def submit(self, dst: Tensors, src: Tensors, slot: int) -> Transfer:
        previous = self.last_transfer.get(slot)
        assert previous is None or previous.completed, f"second copy into slot {slot} while one is in flight"
        key = (src.layer, src.expert)
        reading = self.in_flight.get(key)
        assert reading is None or reading.completed, f"{key} read from disk twice at once"
        transfer = GatedTransfer(self, self.disk.submit(dst, src, slot), src, slot)
        self.last_transfer[slot] = self.in_flight[key] = transfer
        return transfer

    def close(self) -> None:
        self.disk.close()
