"""``example-counting``: a synchronous host-to-device copy that counts transfers and bytes.

It takes the context keyword ``device`` (the engine's device) and one option,
``verify`` (default False): compare every copied tensor with its source, a debugging aid.
"""

from __future__ import annotations

import torch

from specter.memory.link import CompletedTransfer, Link, Tensors, Transfer, copy_all, transfer_nbytes


class CountingLink(Link):
    kind = "example-counting"

    def __init__(self, device: torch.device | str = "cpu", verify: bool = False) -> None:
        if not isinstance(verify, bool):
            raise ValueError(f"verify must be true or false, got {verify!r}")
        self.device = torch.device(device)
        self.verify = verify
        self.transfers = self.bytes_moved = self.released = 0
        self.closed = False

    def submit(self, dst: Tensors, src: Tensors, slot: int) -> Transfer:
        if self.closed:
            raise RuntimeError("submit on a closed example-counting link")
        copy_all(dst, src)  # blocking: the copy is complete (and visible) when this returns
        if self.verify:
            for name, tensor in src.items():
                if not torch.equal(dst[name].cpu(), tensor.cpu()):
                    raise RuntimeError(f"example-counting: slot {slot} tensor {name!r} differs from its source")
        nbytes = transfer_nbytes(src)
        self.transfers += 1
        self.bytes_moved += nbytes
        return CompletedTransfer(nbytes)

    def release_slot(self, slot: int) -> None:
        self.released += 1  # copies are synchronous, so nothing needs ordering

    def close(self) -> None:
        self.closed = True

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "device": str(self.device), "transfers": self.transfers,
                "bytes_moved": self.bytes_moved}
