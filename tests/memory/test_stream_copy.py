"""Streaming copies: the same bytes as ``Tensor.copy_`` at any alignment and length; what they
serve; the links' ``copy_all`` takes them for large host copies. Paced copies: the same bytes,
spread over their time, without the Python lock."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from specter import native
from specter.memory import stream_copy
from specter.memory.link import copy_all
from specter.testing.marks import needs_native


@needs_native
@pytest.mark.parametrize("numel", [1, 31, 128, 1000, (1 << 18) + 7])
@pytest.mark.parametrize("offset", [0, 1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_copies_every_byte_at_any_alignment(numel: int, offset: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(numel + offset)
    src = torch.randint(0, 100, (numel,), generator=gen).to(dtype)
    buffer = torch.zeros(numel + offset, dtype=dtype)
    dst = buffer[offset:]  # contiguous, not 32-byte aligned when offset > 0
    stream_copy.copy_many([dst], [src])
    assert torch.equal(dst, src) and not buffer[:offset].any()


def test_serves_large_contiguous_host_copies_of_one_dtype() -> None:
    big = torch.zeros(stream_copy.MIN_BYTES // 4, dtype=torch.float32)
    assert stream_copy.serves(big.clone(), big) == native.available()
    assert not stream_copy.serves(big[: len(big) // 2].clone(), big[: len(big) // 2])  # below MIN_BYTES
    assert not stream_copy.serves(big.clone().bfloat16(), big)  # a dtype conversion
    square = torch.zeros(1024, 1024)
    assert not stream_copy.serves(square.clone(), square.t())  # not contiguous


@needs_native
def test_copy_all_streams_every_large_copy_in_one_call_and_copies_small_ones(monkeypatch) -> None:
    calls = []
    real = stream_copy.copy_many
    monkeypatch.setattr(stream_copy, "copy_many",
                        lambda dst, src: (calls.append([t.numel() for t in src]), real(dst, src)))
    src = {"big": torch.randn(1 << 19), "small": torch.randn(64), "bigger": torch.randn(3 << 18)}
    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    copy_all(dst, src)
    assert calls == [[1 << 19, 3 << 18]]  # one native call for both large tensors
    assert all(torch.equal(dst[name], src[name]) for name in src)


@needs_native
@pytest.mark.parametrize("numel, offset", [(1, 0), (1000, 3), ((1 << 18) + 7, 1), (1 << 20, 0)])
def test_paced_copy_copies_every_byte(numel: int, offset: int) -> None:
    src = torch.randint(0, 100, (numel,), generator=torch.Generator().manual_seed(numel)).float()
    buffer = torch.zeros(numel + offset)
    stream_copy.paced_copy(buffer[offset:], src, 0.002)
    assert torch.equal(buffer[offset:], src) and not buffer[:offset].any()
    sources = [src, src.flip(0) + 1, torch.arange(offset + 1.0)]  # a list: one after another
    targets = [torch.zeros_like(t) for t in sources]
    stream_copy.paced_copy(targets, sources, 0.002)
    assert all(torch.equal(t, s) for t, s in zip(targets, sources))


@needs_native
def test_paced_copy_spreads_over_its_time_without_holding_the_python_lock() -> None:
    src = torch.randn(1 << 21)  # 8 MiB: 32 pieces
    dst = torch.zeros_like(src)
    spins, seen_partial = 0, False
    worker = threading.Thread(target=stream_copy.paced_copy, args=(dst, src, 0.3))
    started = time.perf_counter()
    worker.start()
    while worker.is_alive():
        spins += 1
        if not seen_partial and time.perf_counter() - started > 0.05:
            copied = (dst == src).float().mean().item()
            seen_partial = 0.0 < copied < 1.0  # a burst copy would be complete by now
    took = time.perf_counter() - started
    assert seen_partial and took >= 0.3 * 31 / 32 - 1e-3
    assert spins > 1000  # this thread ran while the copy slept (a held lock would stall it)
    assert torch.equal(dst, src)
