"""Settling a buffer's pages: slow pieces get fresh memory at the same addresses with the same bytes,
the slow pages are held apart; slow draws are refused; small buffers and a switched-off run are left
alone. Which pieces read slow is faked (a rate per address); one test times real reads."""

from __future__ import annotations

import sys

import pytest
import torch

from specter.memory import huge_pages, page_placement

PIECE = page_placement.PIECE_BYTES
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mremap is Linux's")


@pytest.fixture
def fresh_state(monkeypatch):
    """Module state of a new process; the quarantine this test filled is freed after it."""
    monkeypatch.setattr(page_placement, "_region_rates", [])
    monkeypatch.setattr(page_placement, "_totals", dict.fromkeys(page_placement._totals, 0))
    monkeypatch.setattr(page_placement, "_quarantine", [])
    monkeypatch.setattr(page_placement, "_failure", None)
    monkeypatch.setattr(page_placement, "_paused", False)
    monkeypatch.delenv("SPECTER_SETTLE_PAGES", raising=False)
    yield
    page_placement.release()


@pytest.fixture
def region():
    """A 2 MiB-aligned, written 48 MiB anonymous region (six pieces), each piece's bytes distinct."""
    mapping = page_placement._Range(6 * PIECE, writable=True)
    tensor = mapping.tensor()
    tensor.view(torch.int32).copy_(torch.arange(tensor.numel() // 4, dtype=torch.int32))
    yield tensor
    mapping.unmap()


def fake_rates(monkeypatch, slow_addresses: set[int], draws_slow: bool = False,
               slow_at_first: frozenset[int] = frozenset()) -> None:
    """Pieces at ``slow_addresses`` read 9.5 GiB/s, the region's others 12 (those at
    ``slow_at_first`` 9.5 in the first passes only); fresh draws 12, or 9 when ``draws_slow``.
    Addresses outside the region (draws) are told apart by a set the fake fills."""
    region_addresses: set[int] = set()

    def rates(pieces, passes=page_placement.PASSES):
        if not region_addresses:
            region_addresses.update(p.data_ptr() for p in pieces)
        out = []
        for piece in pieces:
            address = piece.data_ptr()
            if address in region_addresses:
                first = passes == page_placement.FIRST_PASSES and len(pieces) == len(region_addresses)
                rate = 9.5 if address in slow_addresses or (first and address in slow_at_first) else 12.0
            else:
                rate = 9.0 if draws_slow else 12.0
            out.append([rate] * passes)
        return out

    monkeypatch.setattr(page_placement, "_read_rates", rates)


@linux_only
def test_slow_pieces_get_fresh_pages_at_the_same_addresses_with_the_same_bytes(fresh_state, region, monkeypatch):
    before = region.clone()
    base = region.data_ptr()
    slow = {base + PIECE, base + 4 * PIECE}
    fake_rates(monkeypatch, slow)
    settled = page_placement.settle(region)
    assert (settled.pieces, settled.slow, settled.swapped) == (6, 2, 2)
    assert settled.rate_gibps == 12.0 and settled.typical_gibps == 12.0
    assert region.data_ptr() == base and torch.equal(region, before)
    # the slow pages moved into the quarantine, bytes and all
    held = [r.tensor() for r in page_placement._quarantine]
    assert len(held) == 2
    assert sorted(bytes(h[:64].numpy()) for h in held) == sorted(
        bytes(before[i * PIECE:i * PIECE + 64].numpy()) for i in (1, 4))
    assert page_placement.stats()["quarantined_bytes"] == 2 * PIECE and page_placement.stats()["swapped"] == 2


@linux_only
def test_a_piece_slow_only_in_the_first_passes_keeps_its_pages(fresh_state, region, monkeypatch):
    base = region.data_ptr()
    fake_rates(monkeypatch, {base}, slow_at_first=frozenset({base + 2 * PIECE}))
    settled = page_placement.settle(region)
    assert (settled.slow, settled.swapped) == (1, 1) and len(page_placement._quarantine) == 1


@linux_only
def test_slow_draws_are_refused_and_the_piece_keeps_its_pages(fresh_state, region, monkeypatch):
    before = region.clone()
    fake_rates(monkeypatch, {region.data_ptr()}, draws_slow=True)
    settled = page_placement.settle(region)
    assert (settled.slow, settled.swapped) == (1, 0)
    assert torch.equal(region, before)
    assert len(page_placement._quarantine) == page_placement.TRIES  # each slow draw held apart


@linux_only
def test_a_region_wholly_slower_than_the_regions_before_it_is_caught(fresh_state, region, monkeypatch):
    page_placement._region_rates.extend([12.0, 12.0, 12.0])
    fake_rates(monkeypatch, {region.data_ptr() + i * PIECE for i in range(6)})
    settled = page_placement.settle(region)
    assert settled.rate_gibps == 9.5 and settled.typical_gibps == 12.0
    assert (settled.slow, settled.swapped) == (6, 6)


@linux_only
def test_the_quarantine_stops_at_its_cap_and_lets_further_slow_pages_go(fresh_state, region, monkeypatch):
    monkeypatch.setattr(page_placement, "QUARANTINE_MAX_BYTES", PIECE)
    before = region.clone()
    base = region.data_ptr()
    fake_rates(monkeypatch, {base, base + 2 * PIECE})
    settled = page_placement.settle(region)
    assert settled.swapped == 2 and len(page_placement._quarantine) == 1
    assert torch.equal(region, before)


@linux_only
def test_a_failed_move_is_undone_and_stops_settling_for_the_process(fresh_state, region, monkeypatch, caplog):
    before = region.clone()
    fake_rates(monkeypatch, {region.data_ptr() + 3 * PIECE})
    real_move, calls = page_placement._move, []

    def move(source, length, destination):
        calls.append((source, destination))
        if len(calls) == 2:  # the draw onto the slow piece's address
            raise OSError(12, "mremap failed")
        real_move(source, length, destination)

    monkeypatch.setattr(page_placement, "_move", move)
    assert page_placement.settle(region).pieces == 0
    assert len(calls) == 3 and calls[2] == (calls[0][1], calls[0][0])  # the slow pages moved back
    assert torch.equal(region, before) and page_placement._quarantine == []
    assert "page placement off" in caplog.text
    assert page_placement.settle(region).pieces == 0 and len(calls) == 3


@linux_only
def test_small_regions_and_a_switched_off_run_are_left_alone(fresh_state, region, monkeypatch):
    calls = []
    monkeypatch.setattr(page_placement, "_read_rates", lambda pieces, passes=0: calls.append(pieces))
    assert page_placement.settle(region[: page_placement.MIN_BYTES - 1]).pieces == 0
    assert calls == []
    assert page_placement.enabled()
    with page_placement.disabled():
        assert not page_placement.enabled()
        if huge_pages.supported():
            tensor = huge_pages.zeros((page_placement.MIN_BYTES // 4,), torch.float32)
            assert huge_pages.is_huge(tensor) and calls == [] and page_placement.stats()["regions"] == 0
    assert page_placement.enabled()
    monkeypatch.setenv("SPECTER_SETTLE_PAGES", "0")
    assert not page_placement.enabled()
    if huge_pages.supported():
        tensor = huge_pages.zeros((page_placement.MIN_BYTES // 4,), torch.float32)
        assert huge_pages.is_huge(tensor) and calls == [] and page_placement.stats()["regions"] == 0


@linux_only
def test_real_reads_settle_a_region_and_keep_its_values(fresh_state, region):
    before = region.clone()
    settled = page_placement.settle(region)
    assert settled.pieces == 6 and settled.rate_gibps > 0 and 0 <= settled.swapped <= settled.slow <= 6
    assert torch.equal(region, before)
    assert page_placement.stats()["regions"] == 1


def test_the_quarantine_cap_is_a_gib_or_a_twentieth_of_the_machine(monkeypatch):
    assert 0 < page_placement.QUARANTINE_MAX_BYTES <= 1 << 30
    sizes = {"SC_PHYS_PAGES": 2 << 20, "SC_PAGE_SIZE": 4096}  # an 8 GiB machine
    monkeypatch.setattr(page_placement.os, "sysconf", lambda name: sizes[name])
    assert page_placement._quarantine_cap() == (8 << 30) // 20
    sizes["SC_PHYS_PAGES"] = 64 << 20  # 256 GiB
    assert page_placement._quarantine_cap() == 1 << 30
