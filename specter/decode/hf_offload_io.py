"""What accelerate's disk offload reads, and how long the model waits for it (the ``hf-offload``
engine's disk figures), with the page cache allowed or dropped after each read.

Contract: ``OffloadReads.install(model, drop_pages)`` watches every module whose weights come
from disk (accelerate's ``AlignDevicesHook`` with ``offload=True``) with forward hooks around
accelerate's own: the weights are memory-mapped, and most of the reading happens as page faults
while the module computes, so the disk time cannot be told apart from the module's compute. The
time spent in those modules (load, page faults, their compute) is reported as the I/O wait, an
upper bound, and the bytes the process read from storage meanwhile (``/proc/self/io``
``read_bytes``, Linux) as the bytes the disk delivered, so ``read_gbps`` is a lower bound of the
disk's rate. With ``drop_pages`` every file the module's weights live in gets
``POSIX_FADV_DONTNEED`` after its forward, so the next forward reads them from the disk again, as
on a machine whose RAM cannot hold the offloaded weights (the comparison the disk tier is for);
the files are also flushed (``fsync``) and dropped once at ``install``: transformers has just
written the offload folder, and ``POSIX_FADV_DONTNEED`` leaves dirty pages in place, so without
the flush the first forwards would be served from memory. Without ``drop_pages`` the page cache
keeps them (what a memory-mapped file gets on a machine with RAM to spare). ``describe()`` gives
the report's ``link`` entry (``kind``, ``io``, ``bytes_read``, ``busy_s``, ``read_gbps``);
``wait_s`` is that time since ``reset()``. Accelerate releases its weights after each forward, so
nothing keeps the dropped pages mapped.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from torch import nn

_PROC_IO = Path("/proc/self/io")


def storage_bytes_read() -> int | None:
    """Bytes this process has caused to be read from storage (None where the kernel does not say)."""
    try:
        for line in _PROC_IO.read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _offloaded_files(hook) -> list[Path]:
    """The files an accelerate offload hook reads its module's weights from."""
    weights = getattr(hook, "weights_map", None)
    loader = getattr(weights, "dataset", None)
    index, folder = getattr(loader, "index", None), getattr(loader, "save_folder", None)
    prefix = getattr(weights, "prefix", "")
    if not isinstance(index, dict):
        return []
    files = set()
    for key, info in index.items():
        if not key.startswith(prefix):
            continue
        if info.get("safetensors_file"):
            files.add(Path(info["safetensors_file"]))
        elif folder is not None:
            files.add(Path(folder) / f"{key}.dat")
    return sorted(files)


class OffloadReads:
    """Counts accelerate's disk reads and wait, and drops the read pages when asked."""

    def __init__(self, drop_pages: bool) -> None:
        self.drop_pages = drop_pages and hasattr(os, "posix_fadvise")
        self.wait_s = 0.0
        self._bytes_read = 0
        self._counted = storage_bytes_read() is not None
        self._fds: dict[Path, int] = {}

    @classmethod
    def install(cls, model: nn.Module, drop_pages: bool) -> "OffloadReads":
        reads = cls(drop_pages)
        for module in model.modules():
            hook = getattr(module, "_hf_hook", None)
            if hook is not None and getattr(hook, "offload", False):
                reads._watch(module, _offloaded_files(hook))
        return reads

    def _watch(self, module: nn.Module, files: list[Path]) -> None:
        fds = [self._open(path) for path in files] if self.drop_pages else []
        started: list[tuple[float, int | None]] = []

        def before(_module, _args):
            started.append((time.perf_counter(), storage_bytes_read()))

        def after(_module, _args, _output):
            began, bytes_before = started.pop()
            self.wait_s += time.perf_counter() - began
            bytes_after = storage_bytes_read()
            if bytes_before is not None and bytes_after is not None:
                self._bytes_read += bytes_after - bytes_before
            for fd in fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)

    def _open(self, path: Path) -> int:
        """``path`` opened once, its pages written back and dropped (the folder was just written)."""
        if path not in self._fds:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # clean pages only can be dropped
            except OSError:  # a file system that cannot flush (read-only, special): its pages are clean
                pass
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return self._fds[path]

    @property
    def mode(self) -> str:
        return ("memory-mapped, pages dropped after each read" if self.drop_pages
                else "memory-mapped, page cache allowed")

    def reset(self) -> None:
        self.wait_s, self._bytes_read = 0.0, 0

    def describe(self) -> dict[str, object]:
        bytes_read = self._bytes_read if self._counted else None
        return {"kind": "accelerate-disk-offload", "io": self.mode, "bytes_read": bytes_read, "busy_s": self.wait_s,
                "read_gbps": bytes_read / self.wait_s / 1e9 if bytes_read and self.wait_s else None}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
