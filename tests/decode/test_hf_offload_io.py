"""``specter.decode.hf_offload_io``: what the ``hf-offload`` engine reports of accelerate's disk reads.

Checked here without an engine: ``storage_bytes_read`` parses ``/proc/self/io`` (None where it
cannot), ``_offloaded_files`` finds the files an offload hook reads (safetensors files, or the
offload folder's ``.dat`` files, only under the hook's prefix), and ``OffloadReads`` times only
the offloaded modules' forwards, counts the storage bytes read meanwhile, drops each module's own
files from the page cache after its forward when asked (each file opened once), and reports the
``link`` entry with exact values. The engine-level figures are in ``test_hf_offload.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from specter.decode import hf_offload_io
from specter.decode.hf_offload_io import OffloadReads, _offloaded_files, storage_bytes_read

torch.set_num_threads(1)


def offload_hook(prefix: str, index, save_folder: str | None = None, offload: bool = True) -> SimpleNamespace:
    """Stands in for accelerate's ``AlignDevicesHook`` (only the attributes the module reads)."""
    loader = SimpleNamespace(index=index, save_folder=save_folder)
    return SimpleNamespace(offload=offload, weights_map=SimpleNamespace(prefix=prefix, dataset=loader))


def fake_clock(monkeypatch, times: list[float]) -> None:
    ticks = iter(times)
    monkeypatch.setattr(hf_offload_io, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))


def fake_storage(monkeypatch, values: list[int | None]) -> None:
    readings = iter(values)
    monkeypatch.setattr(hf_offload_io, "storage_bytes_read", lambda: next(readings))


def test_storage_bytes_read_takes_the_read_bytes_line(tmp_path: Path, monkeypatch) -> None:
    io = tmp_path / "io"
    io.write_text("rchar: 999\nwchar: 5\nsyscr: 3\nread_bytes: 123456\nwrite_bytes: 7\n")
    monkeypatch.setattr(hf_offload_io, "_PROC_IO", io)
    assert storage_bytes_read() == 123456


@pytest.mark.parametrize("content", [None, "rchar: 999\nwrite_bytes: 7\n", "read_bytes: lots\n"],
                         ids=["missing-file", "no-read-bytes-line", "not-a-number"])
def test_storage_bytes_read_is_none_where_the_kernel_does_not_say(tmp_path: Path, monkeypatch, content) -> None:
    io = tmp_path / "io"
    if content is not None:
        io.write_text(content)
    monkeypatch.setattr(hf_offload_io, "_PROC_IO", io)
    assert storage_bytes_read() is None


def test_storage_bytes_read_on_this_machine_is_a_count_or_none() -> None:
    value = storage_bytes_read()
    assert value is None if not Path("/proc/self/io").exists() else isinstance(value, int) and value >= 0


def test_offloaded_files_are_the_hooks_own_files_sorted_and_once(tmp_path: Path) -> None:
    index = {
        "layers.1.experts.w2": {"safetensors_file": "/ckpt/b.safetensors", "dtype": "float32"},
        "layers.1.experts.w1": {"safetensors_file": "/ckpt/a.safetensors"},
        "layers.1.experts.w3": {"safetensors_file": "/ckpt/b.safetensors"},
        "layers.1.experts.bias": {"dtype": "float32", "shape": [4]},  # saved by accelerate: a .dat file
        "layers.10.experts.w1": {"safetensors_file": "/ckpt/c.safetensors"},  # another module
        "layers.2.experts.w1": {"safetensors_file": "/ckpt/d.safetensors"},
    }
    files = _offloaded_files(offload_hook("layers.1.", index, save_folder=str(tmp_path)))
    assert files == [Path("/ckpt/a.safetensors"), Path("/ckpt/b.safetensors"), tmp_path / "layers.1.experts.bias.dat"]


def test_offloaded_files_skip_dat_entries_without_a_folder_and_odd_hooks() -> None:
    index = {"m.weight": {"dtype": "float32"}, "m.bias": {"safetensors_file": "/ckpt/x.safetensors"}}
    assert _offloaded_files(offload_hook("m.", index, save_folder=None)) == [Path("/ckpt/x.safetensors")]
    assert _offloaded_files(offload_hook("m.", index=None)) == []
    assert _offloaded_files(offload_hook("m.", index=["m.weight"])) == []
    assert _offloaded_files(SimpleNamespace(offload=True)) == []  # no weights_map at all


def test_offloaded_files_of_accelerates_disk_offload(tmp_path: Path) -> None:
    from accelerate import disk_offload

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 2)))
    disk_offload(model, str(tmp_path), execution_device=torch.device("cpu"))
    assert _offloaded_files(model[0]._hf_hook) == [tmp_path / "0.bias.dat", tmp_path / "0.weight.dat"]
    assert _offloaded_files(model[1][0]._hf_hook) == [tmp_path / "1.0.bias.dat", tmp_path / "1.0.weight.dat"]
    assert all(path.is_file() for path in _offloaded_files(model[0]._hf_hook))


def test_install_times_only_the_offloaded_modules_and_counts_their_reads(monkeypatch) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    model[1]._hf_hook = offload_hook("1.", {})
    model[2]._hf_hook = offload_hook("2.", {}, offload=False)  # on the execution device: not disk
    fake_storage(monkeypatch, [0, 1_000, 6_000, 6_000, 9_000])  # install, then before/after two forwards
    fake_clock(monkeypatch, [10.0, 12.5, 20.0, 20.5])
    reads = OffloadReads.install(model, drop_pages=False)
    assert len(model[0]._forward_pre_hooks) == len(model[2]._forward_pre_hooks) == 0
    assert len(model[1]._forward_pre_hooks) == len(model[1]._forward_hooks) == 1
    model(torch.ones(1, 2))
    assert reads.wait_s == 2.5
    assert reads.describe() == {"kind": "accelerate-disk-offload", "io": "memory-mapped, page cache allowed",
                                "bytes_read": 5_000, "busy_s": 2.5, "read_gbps": 5_000 / 2.5 / 1e9}
    model(torch.ones(1, 2))
    assert reads.wait_s == 3.0 and reads.describe()["bytes_read"] == 8_000
    reads.reset()
    assert reads.wait_s == 0.0
    assert reads.describe() == {"kind": "accelerate-disk-offload", "io": "memory-mapped, page cache allowed",
                                "bytes_read": 0, "busy_s": 0.0, "read_gbps": None}


def test_bytes_are_none_where_the_kernel_does_not_count_them(monkeypatch) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    model[0]._hf_hook = offload_hook("0.", {})
    fake_storage(monkeypatch, [None, None, None])
    fake_clock(monkeypatch, [1.0, 4.0])
    reads = OffloadReads.install(model, drop_pages=False)
    model(torch.ones(1, 2))
    assert reads.describe() == {"kind": "accelerate-disk-offload", "io": "memory-mapped, page cache allowed",
                                "bytes_read": None, "busy_s": 3.0, "read_gbps": None}


def test_dropping_pages_advises_each_modules_own_files_after_its_forward(tmp_path: Path, monkeypatch) -> None:
    shared, own = tmp_path / "shared.safetensors", tmp_path / "own.safetensors"
    shared.write_bytes(b"x" * 64)
    own.write_bytes(b"y" * 64)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0]._hf_hook = offload_hook("0.", {"0.weight": {"safetensors_file": str(shared)}})
    model[1]._hf_hook = offload_hook("1.", {"1.weight": {"safetensors_file": str(shared)},
                                            "1.bias": {"safetensors_file": str(own)}})
    advised: list[tuple[int, int, int, int, bool]] = []  # (inode, offset, length, advice, module 1 started)
    started = {"module 1": False}
    model[1].register_forward_pre_hook(lambda *_: started.__setitem__("module 1", True))
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: advised.append(
        (os.fstat(fd).st_ino, offset, length, advice, started["module 1"])), raising=False)
    reads = OffloadReads.install(model, drop_pages=True)
    assert reads.mode == "memory-mapped, pages dropped after each read"
    assert reads.describe()["io"] == "memory-mapped, pages dropped after each read"
    assert sorted(reads._fds) == [own, shared]  # the shared file is opened once
    # at install each file is dropped once (after its flush: test_install_flushes_...), then after forwards
    assert sorted(entry[0] for entry in advised) == sorted([shared.stat().st_ino, own.stat().st_ino])
    advised.clear()
    model(torch.ones(1, 2))
    dontneed = os.POSIX_FADV_DONTNEED
    shared_ino, own_ino = shared.stat().st_ino, own.stat().st_ino
    # module 0 drops its file before module 1 starts, then module 1 drops both of its files
    assert advised == [(shared_ino, 0, 0, dontneed, False), (own_ino, 0, 0, dontneed, True),
                       (shared_ino, 0, 0, dontneed, True)]
    fds = list(reads._fds.values())
    reads.close()
    assert reads._fds == {}
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_without_drop_pages_no_file_is_opened_or_advised(tmp_path: Path, monkeypatch) -> None:
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"z" * 16)
    model = nn.Sequential(nn.Linear(2, 2))
    model[0]._hf_hook = offload_hook("0.", {"0.weight": {"safetensors_file": str(weights)}})
    advised: list[int] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, *_: advised.append(fd), raising=False)
    reads = OffloadReads.install(model, drop_pages=False)
    model(torch.ones(1, 2))
    assert reads._fds == {} and advised == []
    assert reads.wait_s > 0
    reads.close()


def test_drop_pages_needs_posix_fadvise(monkeypatch) -> None:
    monkeypatch.delattr(os, "posix_fadvise", raising=False)
    reads = OffloadReads(drop_pages=True)
    assert reads.drop_pages is False
    assert reads.mode == "memory-mapped, page cache allowed"


def test_real_disk_offload_forward_is_timed_and_its_dat_files_dropped(tmp_path: Path, monkeypatch) -> None:
    from accelerate import disk_offload

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    expected = model(torch.ones(1, 4))
    disk_offload(model, str(tmp_path), execution_device=torch.device("cpu"))
    advised: list[int] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, *_: advised.append(os.fstat(fd).st_ino), raising=False)
    reads = OffloadReads.install(model, drop_pages=True)
    assert sorted(path.name for path in reads._fds) == ["0.bias.dat", "0.weight.dat", "1.bias.dat", "1.weight.dat"]
    assert torch.equal(model(torch.ones(1, 4)), expected)
    inodes = {path.name: path.stat().st_ino for path in tmp_path.glob("*.dat")}
    assert sorted(advised[:4]) == sorted(inodes.values())  # at install: every file dropped once
    del advised[:4]
    assert advised == [inodes["0.bias.dat"], inodes["0.weight.dat"], inodes["1.bias.dat"], inodes["1.weight.dat"]]
    assert reads.wait_s > 0
    reads.close()


def test_install_flushes_each_file_before_dropping_it_so_the_first_forward_reads_the_disk(tmp_path: Path,
                                                                                          monkeypatch) -> None:
    """transformers has just written the offload folder: its pages are dirty, and DONTNEED leaves
    dirty pages cached, so the first forwards were served from memory (a 4-layer model's first
    forward read 0 of 604 MB). Each file is flushed, then dropped, once, at install."""
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"z" * 16)
    model = nn.Sequential(nn.Linear(2, 2))
    model[0]._hf_hook = offload_hook("0.", {"0.weight": {"safetensors_file": str(weights)}})
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync", os.fstat(fd).st_ino)))
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: calls.append(
        ("drop" if advice == os.POSIX_FADV_DONTNEED else "other", os.fstat(fd).st_ino)), raising=False)
    reads = OffloadReads.install(model, drop_pages=True)
    inode = weights.stat().st_ino
    assert calls == [("fsync", inode), ("drop", inode)]
    calls.clear()
    OffloadReads.install(nn.Sequential(nn.Linear(2, 2)), drop_pages=True).close()  # no offloaded module: nothing
    reads.close()
    assert calls == []
