"""Float32 rows against K-major blocked weights: the layout and its inverse, the float64 reference to
float32 rounding, one FMA chain over k per output, the same bits whatever a row's group or the
vector form, what it refuses and when it serves."""

from __future__ import annotations

import pytest
import torch

from specter import native
from specter.kernels import blocked_rows
from specter.testing.marks import needs_native
from specter.testing.reference import grouped_rows as reference


def weights(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_a_block_holds_its_sixteen_outputs_side_by_side_for_each_k() -> None:
    w = weights((3, 48, 20), 0)
    wb = blocked_rows.block(w)
    assert wb.shape == w.shape and wb.is_contiguous()
    tiles = wb.view(3, 3, 20, 16)  # [S, N / 16, K, 16]
    for s, b, k, lane in [(0, 0, 0, 0), (1, 2, 19, 15), (2, 1, 7, 3)]:
        assert tiles[s, b, k, lane] == w[s, b * 16 + lane, k]
    assert torch.equal(blocked_rows.unblock(wb), w)
    assert torch.equal(blocked_rows.unblock(blocked_rows.block(w[0])), w[0])  # one weight, [N, K]


def test_block_refuses_a_width_off_the_block() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        blocked_rows.block(torch.zeros(2, 40, 8))
    with pytest.raises(ValueError, match="multiple of 16"):
        blocked_rows.unblock(torch.zeros(40, 8))


@needs_native
@pytest.mark.parametrize("counts", [[1], [0, 2, 0, 1], [5, 0, 3], [8, 1, 0, 0, 6], [0, 0, 0, 13]])
@pytest.mark.parametrize("k", [16, 48, 256])
def test_every_group_meets_its_own_weight(counts: list[int], k: int) -> None:
    w = weights((len(counts), 48, k), len(counts) * 100 + k)
    ends = torch.tensor(counts).cumsum(0)
    x = weights((int(ends[-1]), k), k)
    out = blocked_rows.blocked_rows(x, blocked_rows.block(w), ends)
    assert out.shape == (x.shape[0], 48) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(x, w, ends), rtol=1e-5, atol=1e-4)


@needs_native
def test_each_output_is_one_fma_chain_over_k_in_order() -> None:
    # float32 FMA: x * w is exact in float64 and the sum rounds once to float32 (a double rounding
    # would differ only on an exact float64 tie, which random operands do not meet)
    w, x = weights((1, 32, 96), 1), weights((3, 96), 2)
    out = blocked_rows.blocked_rows(x, blocked_rows.block(w), torch.tensor([3]))
    chain = torch.zeros(3, 32, dtype=torch.float32)
    for i in range(96):
        chain = (chain.double() + x[:, i : i + 1].double() * w[0, :, i].double()).float()
    assert torch.equal(out, chain)


@needs_native
def test_a_rows_bits_do_not_depend_on_its_group() -> None:
    w = weights((1, 64, 256), 3)
    wb = blocked_rows.block(w)
    x = weights((13, 256), 4)  # past a pass of eight (AVX-512) and of six (AVX2)
    together = blocked_rows.blocked_rows(x, wb, torch.tensor([13]))
    for row in range(13):
        alone = blocked_rows.blocked_rows(x[row : row + 1], wb, torch.tensor([1]))
        assert torch.equal(alone[0], together[row]), row


@needs_native
def test_the_avx2_form_gives_the_avx512_forms_bits() -> None:
    w = weights((2, 32, 1024), 5)
    wb = blocked_rows.block(w)
    x, ends = weights((11, 1024), 6), torch.tensor([4, 11])
    was = blocked_rows.wide()
    try:
        blocked_rows.wide(False)
        assert not blocked_rows.wide()
        narrow = blocked_rows.blocked_rows(x, wb, ends)
        wide_runs = blocked_rows.wide(True)
        wide = blocked_rows.blocked_rows(x, wb, ends)
    finally:
        blocked_rows.wide(was)
    if not wide_runs:
        pytest.skip("this CPU has no AVX-512: only the AVX2 form runs")
    assert torch.equal(narrow, wide)


@needs_native
def test_software_prefetch_never_changes_a_bit() -> None:
    op = torch.ops.specter_native
    w, x, ends = weights((2, 32, 256), 7), weights((7, 256), 8), torch.tensor([3, 7])
    wb = blocked_rows.block(w)
    ahead, min_rows = op.blocked_ahead(-1), op.blocked_prefetch_min_rows(0)  # read, unchanged
    try:
        results = []
        for distance, fewest in [(0, 1), (1024, 1), (4096, 8)]:
            assert (op.blocked_ahead(distance), op.blocked_prefetch_min_rows(fewest)) == (distance, fewest)
            results.append(blocked_rows.blocked_rows(x, wb, ends))
    finally:
        op.blocked_ahead(ahead)
        op.blocked_prefetch_min_rows(min_rows)
    assert all(torch.equal(results[0], other) for other in results[1:])


@needs_native
def test_what_it_refuses() -> None:
    x, ends = torch.zeros(2, 32), torch.tensor([2])
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.specter_native.blocked_rows(x, torch.zeros(1, 40, 32), ends)
    with pytest.raises(RuntimeError, match="last dimension"):
        torch.ops.specter_native.blocked_rows(x, torch.zeros(1, 32, 16), ends)
    with pytest.raises(RuntimeError, match=r"ends\[-1\]"):
        torch.ops.specter_native.blocked_rows(x, torch.zeros(1, 32, 32), torch.tensor([1]))


def test_when_it_serves() -> None:
    x, wb = torch.zeros(2, 32), torch.zeros(1, 32, 32)
    assert blocked_rows.serves(x, wb) == native.available()
    assert not blocked_rows.serves(x, torch.zeros(1, 40, 32))  # N off the block
    assert not blocked_rows.serves(x, torch.zeros(1, 32, 16))  # K not x's
    assert not blocked_rows.serves(x.double(), wb.double())
    assert not blocked_rows.serves(x, torch.zeros(1, 32, 64)[:, :, ::2])  # not contiguous
    with native.disabled():
        assert not blocked_rows.serves(x, wb)
