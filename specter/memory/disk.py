"""The disk tier: experts read straight from the byte ranges of the checkpoint's own safetensors.

Contract:
- ``CheckpointIndex(directory)`` reads the header of ``model.safetensors`` or of every shard named
  by ``model.safetensors.index.json``: for each tensor its file, dtype, shape and byte range.
  Errors name the file (missing shard, bad header, a range past the end of the file, a file this
  process may not read). ``indexed_shards(directory)``: the shard files an index names (None
  without an index).
- ``DiskExperts(index, layers, dtype)`` maps every (layer, expert) of the model's routed experts
  (``specter.model.layout.MoELayer``) to the pieces of the checkpoint that make it, in either
  layout transformers writes or reads: *stacked* (``...experts.gate_up_proj`` [E, ...], one slice
  per expert) or *per expert* (``...experts.{e}.w1/w3/w2.weight``, Mixtral, or
  ``gate_proj/up_proj/down_proj``: the module's ``gate_up_proj`` is gate and up concatenated along
  the output dimension, its ``down_proj`` is w2/down). ``read(layer, expert)`` returns the
  module's tensors for that expert, on the host, in the model's dtype; ``read_into(dst, layer,
  expert)`` writes them into ``dst`` (a cache slot's views), blocked where ``blocked`` is set
  (``specter.model.expert_layout``: the loader sets it when the engine's experts are kept so).
  ``check(layer, reference)`` compares expert 0 with the loaded model's own tensors, so a mapping
  that would be wrong is refused.
- ``detached()``: a reader of the same mapping with files and counters of its own, closed by its
  ``with`` block (or ``close()``). Reads that are not a link's (the mapping check, a layer read
  whole by ``DiskStore.stacked`` / ``standard`` to quantise the draft) go through one, so the
  counters below hold only what the links read (and the cache's copy checks and repairs, through
  ``DiskSource``), and a ``DiskExperts`` has a file open only once a link has read through it
  (the link's ``close()`` closes it; a reader collected unclosed closes its files too).
- Reads: one ``os.preadv`` per contiguous run of bytes (an expert's tensors are usually adjacent),
  through ``O_DIRECT`` when ``direct`` (page cache bypassed: honest disk figures; the read is
  widened to 4 KiB alignment into a page-aligned buffer) or, where the filesystem refuses
  ``O_DIRECT``, buffered reads followed by ``POSIX_FADV_DONTNEED`` on the range (pages dropped
  after each read; every read whose direct attempt the filesystem refused is retried so, however
  many workers met the refusal at once). ``direct=False`` allows the page cache (what a
  memory-mapped file gets). ``mode`` says which one is in effect. A short read or an I/O error
  raises ``SpecterError`` naming the file and the tensor. Reads are thread-safe (no shared file
  offsets).
- ``bytes_read`` counts what was read through this reader and ``busy_s`` the wall time during
  which at least one read was in flight, so ``bytes_read / busy_s`` is the bandwidth the disk
  delivered; ``figures()`` gives them (with ``mode``) as the links' report entries.
"""

from __future__ import annotations

import copy
import json
import mmap
import os
import re
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from specter.errors import SpecterError
from specter.memory.blocked_layout import block_rows_into

ALIGN = 4096
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8}
_GATE_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


@dataclass(frozen=True)
class TensorRange:
    """Where one tensor of the checkpoint lives."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class CheckpointIndex:
    """Every tensor of a safetensors checkpoint (single file or sharded), by name."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        files = indexed_shards(self.directory)
        if files is None:
            files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise SpecterError(f"model: {self.directory} has no safetensors files for the disk tier")
        self.tensors: dict[str, TensorRange] = {}
        for file in files:
            self.tensors.update(read_header(file))

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)


INDEX_NAME = "model.safetensors.index.json"


def indexed_shards(directory: Path) -> list[Path] | None:
    """The shard files ``directory``'s safetensors index names, sorted (None when it has no index);
    an unreadable index is a ``SpecterError`` naming it."""
    index = Path(directory) / INDEX_NAME
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({Path(directory) / name for name in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise SpecterError(f"model: {index} is not a safetensors index ({error})") from None


def read_header(file: Path) -> dict[str, TensorRange]:
    """Every tensor of one safetensors file, after checking that the 8-byte header length, the
    JSON header and every tensor's byte range fit the file; a missing, truncated or corrupt file
    is a ``SpecterError`` naming it. Tensors of dtypes experts never have are left out."""
    def corrupt(reason: str) -> SpecterError:
        return SpecterError(f"model: {file} is truncated or corrupt ({reason}); re-download or re-save the checkpoint")

    try:
        size = file.stat().st_size
        with file.open("rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise corrupt(f"{size} bytes, shorter than the 8-byte header length")
            header_len = int.from_bytes(head, "little")
            if header_len > size - 8 or header_len > 100_000_000:
                raise corrupt(f"header of {header_len} bytes in a {size}-byte file")
            header = json.loads(handle.read(header_len))
    except FileNotFoundError:
        raise SpecterError(f"model: shard {file} is missing") from None
    except PermissionError:
        raise SpecterError(f"model: {file} cannot be read by this process (permission denied); make it "
                           "readable or use a copy of the checkpoint") from None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise corrupt(f"unreadable header: {error}") from None
    if not isinstance(header, dict):
        raise corrupt("the header is not a JSON object")
    base, data_bytes = 8 + header_len, size - 8 - header_len
    found = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise corrupt(f"tensor {name!r} has no valid data_offsets")
        if offsets[1] > data_bytes:
            raise corrupt(f"tensor {name!r} ends at byte {offsets[1]:,} of a {data_bytes:,}-byte data section")
        dtype = _DTYPES.get(entry.get("dtype"))
        if dtype is not None:  # other dtypes (e.g. F8 scales) are never experts: not indexed
            found[name] = TensorRange(name, file, dtype, tuple(entry["shape"]), base + offsets[0], base + offsets[1])
    return found


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor (or one expert's slice of a stacked one) and where it goes."""

    source: TensorRange
    start: int  # absolute byte range of this piece
    end: int
    shape: tuple[int, ...]
    param: str  # the module parameter it fills
    rows: slice  # the rows of that parameter's per-expert tensor it fills ([out, in] layout: dim 0)


class DiskExperts:
    """Reads the routed experts of a model from its checkpoint (see the module docstring)."""

    def __init__(self, index: CheckpointIndex, layers, dtype: torch.dtype, direct: bool = True) -> None:
        self.index = index
        self.dtype = dtype
        self.layers = {info.layer: info for info in layers}
        self.param_shapes = {name: tuple(getattr(layers[0].experts, name).shape[1:]) for name in layers[0].param_names}
        self._pieces = {info.layer: self._map_layer(info) for info in layers}
        self.direct = direct
        self.mode = "page cache allowed"
        self._direct_ok = direct and hasattr(os, "O_DIRECT")
        if direct:
            self.mode = "O_DIRECT" if self._direct_ok else "buffered + POSIX_FADV_DONTNEED"
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.busy_s = 0.0
        self._active = 0
        self._busy_since = 0.0
        self._fds: dict[tuple[Path, bool], int] = {}
        self._closer = weakref.finalize(self, _close_all, self._fds)
        self.blocked = False  # reads write each weight blocked (specter.model.expert_layout)

    def detached(self) -> "DiskExperts":
        """A reader of the same mapping and mode with files and counters of its own (see the module
        docstring); a context manager that closes it."""
        reader = copy.copy(self)
        reader._lock = threading.Lock()
        reader.bytes_read, reader.busy_s, reader._active = 0, 0.0, 0
        reader._fds = {}
        reader._closer = weakref.finalize(reader, _close_all, reader._fds)
        return reader

    def __enter__(self) -> "DiskExperts":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ----- mapping ----------------------------------------------------------------------------

    def _map_layer(self, info) -> list[list[Piece]]:
        # the layer's own names first (each regex below needs this substring): a large per-expert
        # checkpoint has tens of thousands of tensors, and scanning them all per expert took minutes
        names = [n for n in self.index.names() if f"layers.{info.layer}." in n]
        prefix = rf"(?:^|\.)layers\.{info.layer}\.(?:.*\.)?experts\."
        stacked = {param: next((n for n in names if re.search(prefix + re.escape(param) + "$", n)), None)
                   for param in info.param_names}
        if all(stacked.values()):
            return [[self._stacked_piece(self.index.tensors[stacked[p]], p, e) for p in info.param_names]
                    for e in range(info.num_experts)]
        if set(info.param_names) - {"gate_up_proj", "down_proj"} or getattr(info.experts, "is_transposed", False):
            raise SpecterError(f"model: layer {info.layer}'s experts ({', '.join(info.param_names)}) are neither "
                               "stacked in the checkpoint nor in a per-expert layout the disk tier knows")
        per_name: dict[tuple[int, str], str] = {}  # (expert, w1 / gate_proj / ...) -> the first such name
        per_expert_name = re.compile(prefix + r"(\d+)\.(\w+)\.weight$")
        for name in names:
            if match := per_expert_name.search(name):
                per_name.setdefault((int(match.group(1)), match.group(2)), name)
        per_expert = []
        for expert in range(info.num_experts):
            pieces = None
            for gate, up, down in _GATE_NAMES:
                found = [per_name.get((expert, part)) for part in (gate, up, down)]
                if all(found):
                    ranges = [self.index.tensors[n] for n in found]
                    rows = ranges[0].shape[0]
                    pieces = [self._whole(ranges[0], "gate_up_proj", slice(0, rows)),
                              self._whole(ranges[1], "gate_up_proj", slice(rows, rows + ranges[1].shape[0])),
                              self._whole(ranges[2], "down_proj", slice(0, ranges[2].shape[0]))]
                    break
            if pieces is None:
                raise SpecterError(f"model: no checkpoint tensors found for expert {expert} of layer {info.layer} "
                                   f"(looked for stacked {', '.join(info.param_names)} and per-expert w1/w3/w2 or "
                                   "gate_proj/up_proj/down_proj)")
            per_expert.append(pieces)
        return per_expert

    @staticmethod
    def _whole(source: TensorRange, param: str, rows: slice) -> Piece:
        return Piece(source, source.start, source.end, source.shape, param, rows)

    @staticmethod
    def _stacked_piece(source: TensorRange, param: str, expert: int) -> Piece:
        per_expert = source.nbytes // source.shape[0]
        start = source.start + expert * per_expert
        return Piece(source, start, start + per_expert, source.shape[1:], param, slice(0, source.shape[1]))

    def stored_dtype(self, layer: int) -> torch.dtype:
        """The dtype ``layer``'s expert 0 is stored in (its first tensor's)."""
        return self._pieces[layer][0][0].source.dtype

    def check(self, layer: int, reference: dict[str, torch.Tensor]) -> None:
        """Refuse a mapping that does not reproduce expert 0 of ``layer`` as loaded (``reference``:
        the module's per-expert tensors, [E, ...] each; read through a ``detached()`` reader)."""
        with self.detached() as reader:
            got = reader.read(layer, 0)
        for name, tensor in got.items():
            expected = reference[name][0].to(self.dtype)
            if tensor.shape != expected.shape or not torch.equal(tensor, expected):
                raise SpecterError(f"model: the disk tier's reading of {name} (layer {layer}, expert 0) differs "
                                   "from the loaded model's; this checkpoint layout is not supported on disk")

    # ----- reading ----------------------------------------------------------------------------

    def expert_file_bytes(self, layer: int, expert: int) -> int:
        return sum(piece.end - piece.start for piece in self._pieces[layer][expert])

    def read(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        out = {name: torch.empty(shape, dtype=self.dtype) for name, shape in self.param_shapes.items()}
        self.read_into(out, layer, expert)
        return out

    def read_into(self, dst: dict[str, torch.Tensor], layer: int, expert: int, blocked: bool | None = None) -> None:
        """``blocked``: write the weights blocked (None: ``self.blocked``); ``dst``'s tensors contiguous then."""
        blocked = self.blocked if blocked is None else blocked
        pieces = self._pieces[layer][expert]
        for run in _contiguous_runs(pieces):
            raw = self._read_range(run[0].source.file, run[0].start, run[-1].end, run[0].source.name)
            for piece in run:
                view = raw[piece.start - run[0].start: piece.end - run[0].start]
                tensor = torch.frombuffer(view, dtype=piece.source.dtype).view(piece.shape)
                if blocked:  # the piece's rows (a multiple of 16 at a multiple of 16) are one span blocked
                    width = tensor.shape[-1]
                    span = dst[piece.param].view(-1)[piece.rows.start * width: piece.rows.stop * width]
                    block_rows_into(span, tensor)
                else:
                    dst[piece.param][piece.rows].copy_(tensor)

    def _fd(self, file: Path, direct: bool) -> int:
        key = (file, direct)
        with self._lock:
            if key not in self._fds:
                flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
                self._fds[key] = os.open(file, flags)
            return self._fds[key]

    def _read_range(self, file: Path, start: int, end: int, tensor: str) -> memoryview:
        with self._lock:
            if self._active == 0:
                self._busy_since = time.perf_counter()
            self._active += 1
        try:
            return self._read_checked(file, start, end, tensor)
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    self.busy_s += time.perf_counter() - self._busy_since

    def _read_checked(self, file: Path, start: int, end: int, tensor: str) -> memoryview:
        direct = self._direct_ok  # this read's own choice: another worker may switch it meanwhile
        try:
            data = self._read_direct(file, start, end) if direct else self._read_buffered(file, start, end)
        except OSError as error:
            if direct and error.errno == 22:  # EINVAL: this filesystem refuses O_DIRECT (whoever saw it first)
                self._direct_ok = False
                self.mode = "buffered + POSIX_FADV_DONTNEED"
                return self._read_checked(file, start, end, tensor)
            raise SpecterError(f"disk tier: reading tensor {tensor!r} from {file} failed: {error}") from None
        if len(data) < end - start:
            raise SpecterError(f"disk tier: short read of tensor {tensor!r} from {file} ({len(data)} of "
                               f"{end - start} bytes): the file is truncated")
        with self._lock:
            self.bytes_read += end - start
        return data

    def _read_direct(self, file: Path, start: int, end: int) -> memoryview:
        lo = start - start % ALIGN
        hi = -(-end // ALIGN) * ALIGN
        buffer = mmap.mmap(-1, hi - lo)  # page-aligned, as O_DIRECT needs
        got = os.preadv(self._fd(file, True), [buffer], lo)
        return memoryview(buffer)[start - lo: min(got, end - lo)]

    def _read_buffered(self, file: Path, start: int, end: int) -> memoryview:
        fd = self._fd(file, False)
        buffer = bytearray(end - start)  # read in place: no second copy of the bytes
        got = os.preadv(fd, [buffer], start)
        if self.direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
        return memoryview(buffer)[:got]

    def figures(self) -> dict[str, object]:
        """The report's disk entries: read mode, bytes read, seconds reading, GB/s while reading."""
        return {"io": self.mode, "bytes_read": self.bytes_read, "busy_s": self.busy_s,
                "read_gbps": self.bytes_read / self.busy_s / 1e9 if self.busy_s else None}

    def reset_counters(self) -> None:
        with self._lock:
            self.bytes_read, self.busy_s = 0, 0.0

    def close(self) -> None:
        with self._lock:
            _close_all(self._fds)


def _close_all(fds: dict) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


def _contiguous_runs(pieces: list[Piece]) -> list[list[Piece]]:
    """Pieces grouped into runs of adjacent byte ranges of one file (one read each)."""
    runs: list[list[Piece]] = []
    for piece in sorted(pieces, key=lambda p: (str(p.source.file), p.start)):
        last = runs[-1][-1] if runs else None
        if last is not None and last.source.file == piece.source.file and last.end == piece.start:
            runs[-1].append(piece)
        else:
            runs.append([piece])
    return runs
