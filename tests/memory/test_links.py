"""Links: copies are correct; the emulated link is paced like a serial wire (its large copies spread
over the wire time); cuda on a GPU."""

from __future__ import annotations

import time

import pytest
import torch

from specter import native
from specter.errors import SpecterError
from specter.memory import stream_copy
from specter.memory.link import transfer_nbytes
from specter.memory.links import CompletedTransfer, EmulatedLink, LocalLink, register_links

torch.set_num_threads(1)

MB = 1_000_000


def pair(nbytes: int = MB) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    n = nbytes // 4
    src = {"w": torch.randn(n // 2), "b": torch.randn(n - n // 2)}
    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    return dst, src


def test_local_copies_synchronously() -> None:
    dst, src = pair(4096)
    transfer = LocalLink(copy_thread=False).submit(dst, src, slot=0)
    assert transfer.done() and transfer.nbytes == 4096
    assert transfer.wait() == 0.0
    assert all(torch.equal(dst[n], src[n]) for n in src)


def test_local_copy_thread_copies_in_order_and_overlaps_compute() -> None:
    link = LocalLink(copy_thread=True)
    try:
        assert link.overlaps_compute and link.describe()["copy_thread"] is True
        dst = {"w": torch.zeros(1 << 16)}
        sources = [{"w": torch.full((1 << 16,), float(i))} for i in range(5)]
        transfers = [link.submit(dst, src, slot=0) for src in sources]
        transfers[-1].wait()
        assert all(t.done() for t in transfers)  # FIFO: the last one done means all are
        assert torch.equal(dst["w"], sources[-1]["w"])
    finally:
        link.close()
    assert not link.alive
    with pytest.raises(SpecterError, match="closed local link"):
        link.submit(dst, sources[0], slot=0)


def test_local_link_default_uses_a_spare_core_on_a_cpu_only(monkeypatch) -> None:
    from specter.memory import links

    monkeypatch.setattr(links, "_spare_core", lambda: True)
    threaded = LocalLink(device="cpu")
    assert threaded.copy_thread and threaded.overlaps_compute
    threaded.close()
    monkeypatch.setattr(links, "_spare_core", lambda: False)
    single = LocalLink(device="cpu")
    assert not single.copy_thread and not single.overlaps_compute
    assert not LocalLink(device="meta").copy_thread  # not a CPU: synchronous (the cuda link is the asynchronous one)
    with pytest.raises(SpecterError, match="copy_thread"):
        LocalLink(copy_thread=True, device="meta")
    with pytest.raises(SpecterError, match="true or false"):
        LocalLink(copy_thread="yes")


def test_local_copy_thread_hands_a_failed_copy_to_wait() -> None:
    link = LocalLink(copy_thread=True)
    try:
        transfer = link.submit({"w": torch.zeros(4)}, {"w": torch.zeros(5)}, slot=0)
        with pytest.raises(SpecterError, match="expert transfer failed"):
            transfer.wait(timeout=5.0)
    finally:
        link.close()


def test_emulated_copies_are_correct_and_in_order() -> None:
    link = EmulatedLink(gbps=10.0, latency_us=0.0)
    try:
        dst = {"w": torch.zeros(256)}
        sources = [{"w": torch.full((256,), float(i))} for i in range(5)]
        transfers = [link.submit(dst, src, slot=0) for src in sources]
        for transfer in transfers:
            transfer.wait()
        assert torch.equal(dst["w"], sources[-1]["w"])
    finally:
        link.close()


def test_emulated_is_paced_to_bandwidth_and_latency() -> None:
    link = EmulatedLink(gbps=0.5, latency_us=100.0)
    try:
        pairs = [pair(MB) for _ in range(4)]
        start = time.perf_counter()
        transfers = [link.submit(dst, src, slot=i) for i, (dst, src) in enumerate(pairs)]
        blocked = [t.wait() for t in transfers]
        elapsed = time.perf_counter() - start
        expected = 4 * link.duration_s(MB)
        assert expected == pytest.approx(4 * (100e-6 + MB / 0.5e9))
        assert elapsed >= expected - 1e-4
        assert sum(blocked) <= elapsed + 1e-6  # (a scheduler pause may shorten any one wait: no lower bound)
        assert all(b >= 0 for b in blocked)
        assert all(t.done() and t.wait() == 0.0 for t in transfers)
        assert all(torch.equal(dst[n], src[n]) for dst, src in pairs for n in src)
    finally:
        link.close()


@pytest.mark.skipif(not native.available(), reason="paced copies are a native op")
def test_emulated_paces_a_large_copy_over_its_wire_time_unless_told_not_to() -> None:
    link = EmulatedLink(gbps=0.04, latency_us=0.0)  # 8 MiB: 210 ms on the wire
    try:
        for paced in (True, False):
            link.paced = paced
            src, dst = {"w": torch.randn(1 << 21)}, {"w": torch.zeros(1 << 21)}
            transfer = link.submit(dst, src, 0)
            time.sleep(0.05)
            copied = (dst["w"] == src["w"]).float().mean().item()
            assert not transfer.done()
            assert 0.0 < copied < 1.0 if paced else copied == 1.0  # unpaced: one burst, then the wait
            transfer.wait()
            assert torch.equal(dst["w"], src["w"])
    finally:
        link.close()


@pytest.mark.skipif(not native.available(), reason="paced copies are a native op")
def test_emulated_paces_only_links_slower_than_memory_copies(monkeypatch) -> None:
    calls = []
    real = stream_copy.paced_copy
    monkeypatch.setattr(stream_copy, "paced_copy",
                        lambda dst, src, seconds: (calls.append(([t.numel() for t in src], seconds)),
                                                   real(dst, src, seconds)))
    for gbps in (0.25, EmulatedLink.PACED_MAX_GBPS * 2):  # 0.25 GB/s: 25 ms on the wire, time left under load
        link = EmulatedLink(gbps=gbps, latency_us=0.0)
        try:
            src = {"a": torch.randn(1 << 19), "small": torch.randn(64), "b": torch.randn(1 << 20)}
            dst = {name: torch.zeros_like(t) for name, t in src.items()}
            link.submit(dst, src, 0).wait()
            assert all(torch.equal(dst[name], src[name]) for name in src)
        finally:
            link.close()
        if gbps == 0.25:  # the two large tensors in one paced call, in order, over the wire time left
            assert len(calls) == 1 and calls[0][0] == [1 << 19, 1 << 20]
            assert 0 < calls[0][1] <= link.duration_s(transfer_nbytes(src))
    assert len(calls) == 1  # the fast link copied at once


def test_copy_thread_links_still_open_are_closed_at_exit_after_their_copies() -> None:
    from specter.memory import links

    link = EmulatedLink(gbps=0.1, latency_us=0.0)
    dst, src = pair(4 * MB)  # 40 ms on the wire
    transfer = link.submit(dst, src, 0)
    assert link in links._OPEN
    links._close_open_links()  # what the interpreter runs at exit, before it finalizes
    assert transfer.done() and not link.alive and link not in links._OPEN
    assert all(torch.equal(dst[n], src[n]) for n in src)


@pytest.mark.parametrize("make", [lambda: EmulatedLink(gbps=1.0), lambda: LocalLink(copy_thread=True)])
def test_a_copy_thread_link_dropped_without_close_stops_its_worker(make) -> None:
    import gc

    link = make()
    dst, src = pair(4096)
    link.submit(dst, src, 0).wait()
    worker = link._worker
    del link
    gc.collect()
    worker.join(timeout=5.0)
    assert not worker.is_alive()  # it held the link: the thread lived until the interpreter's exit
    assert all(torch.equal(dst[n], src[n]) for n in src)


def test_emulated_idle_link_does_not_bank_time() -> None:
    link = EmulatedLink(gbps=1.0, latency_us=2000.0)
    try:
        dst, src = pair(4096)
        link.submit(dst, src, 0).wait()
        time.sleep(0.01)
        start = time.perf_counter()
        link.submit(dst, src, 0).wait()
        assert time.perf_counter() - start >= 0.002 - 1e-4
    finally:
        link.close()


def test_emulated_close_stops_the_worker_and_refuses_work() -> None:
    link = EmulatedLink(gbps=1.0)
    dst, src = pair(4096)
    pending = link.submit(dst, src, 0)
    link.close()
    assert not link.alive
    assert pending.done()
    link.close()
    with pytest.raises(SpecterError):
        link.submit(dst, src, 0)


def test_emulated_reports_copy_errors_on_wait() -> None:
    link = EmulatedLink(gbps=1.0)
    try:
        transfer = link.submit({"w": torch.zeros(3)}, {"w": torch.zeros(4)}, 0)
        with pytest.raises(SpecterError, match="transfer failed"):
            transfer.wait()
        assert link.alive
    finally:
        link.close()


@pytest.mark.parametrize("options", [{"gbps": 0.0}, {"gbps": -1.0}, {"gbps": 1.0, "latency_us": -5.0}])
def test_emulated_rejects_bad_options(options: dict[str, float]) -> None:
    with pytest.raises(SpecterError):
        EmulatedLink(**options)


def test_describe_labels_emulation() -> None:
    link = EmulatedLink(gbps=0.5, latency_us=50.0)
    try:
        assert link.describe() == {"kind": "emulated", "gbps": 0.5, "latency_us": 50.0, "emulated": True}
    finally:
        link.close()
    assert LocalLink(copy_thread=False).describe() == {"kind": "local", "gbps": None, "latency_us": None,
                                                      "emulated": False, "copy_thread": False}


def test_builtins_register_through_the_hook() -> None:
    registered: dict[str, object] = {}
    register_links(lambda name, factory: registered.__setitem__(name, factory))
    assert sorted(registered) == ["cuda", "disk", "emulated", "local"]
    assert isinstance(registered["local"](copy_thread=False).submit({}, {}, 0), CompletedTransfer)


@pytest.mark.gpu
def test_cuda_link_copies_and_orders_after_release() -> None:
    from specter.memory.links import CudaLink

    link = CudaLink()
    src = {"w": torch.randn(1 << 20).pin_memory()}
    dst = {"w": torch.zeros(1 << 20, device="cuda")}
    transfer = link.submit(dst, src, slot=0)
    assert transfer.wait() >= 0.0
    assert transfer.done()
    assert torch.equal(dst["w"].cpu(), src["w"])
    total = dst["w"].sum()
    link.release_slot(0)
    other = {"w": torch.randn(1 << 20).pin_memory()}
    link.submit(dst, other, slot=0).wait()
    assert torch.allclose(total.cpu(), src["w"].sum(), rtol=1e-4)
    assert torch.equal(dst["w"].cpu(), other["w"])
    link.close()


@pytest.mark.parametrize("make", [lambda: LocalLink(copy_thread=True), lambda: EmulatedLink(2.0)],
                         ids=["local-copy-thread", "emulated"])
def test_a_close_racing_a_submit_never_strands_the_transfer(make) -> None:
    """A submit still reading its source (a disk expert is read for its size) when another thread
    closes the link: either the copy is queued ahead of the stop and completes, or the submit is
    refused as closed; never a transfer behind the stop that no worker will run."""
    import threading
    from collections.abc import Mapping

    class SlowSource(Mapping):
        def __init__(self, tensors: dict, gate: threading.Event) -> None:
            self.tensors, self.gate = tensors, gate

        def __getitem__(self, name):
            self.gate.wait(5)
            return self.tensors[name]

        def __iter__(self):
            return iter(self.tensors)

        def __len__(self) -> int:
            return len(self.tensors)

    link, gate, out = make(), threading.Event(), {}
    dst = {"w": torch.zeros(1024)}

    def submit() -> None:
        try:
            out["transfer"] = link.submit(dst, SlowSource({"w": torch.ones(1024)}, gate), 0)
        except SpecterError as error:
            out["error"] = error

    submitter = threading.Thread(target=submit)
    submitter.start()
    time.sleep(0.05)  # the submitter is reading its source
    closer = threading.Thread(target=link.close)
    closer.start()
    time.sleep(0.05)
    gate.set()
    submitter.join(5)
    closer.join(5)
    if "transfer" in out:
        out["transfer"].wait(timeout=2)  # raises TransferTimeout if stranded
        assert torch.equal(dst["w"], torch.ones(1024))
    else:
        assert "closed" in str(out["error"])
    assert not closer.is_alive() and not link.alive
