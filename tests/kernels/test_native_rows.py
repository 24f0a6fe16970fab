"""Specter's grouped float32 rows kernel: each row group against its own weight, exactly the
float64 reference to float32 rounding; what it refuses; when it serves."""

from __future__ import annotations

import pytest
import torch

from specter import native
from specter.kernels import native_rows
from specter.testing.marks import needs_native
from specter.testing.reference import grouped_rows as reference


@needs_native
@pytest.mark.parametrize("counts", [[1], [0, 2, 0, 1], [5, 0, 3], [8, 1, 0, 0, 6], [0, 0, 0, 9]])
@pytest.mark.parametrize("k", [16, 48, 256])
def test_every_group_meets_its_own_weight(counts: list[int], k: int) -> None:
    gen = torch.Generator().manual_seed(len(counts) * 100 + k)
    w = torch.randn(len(counts), 40, k, generator=gen)
    ends = torch.tensor(counts).cumsum(0)
    x = torch.randn(int(ends[-1]), k, generator=gen)
    out = native_rows.grouped_rows(x, w, ends)
    assert out.shape == (x.shape[0], 40) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(x, w, ends), rtol=1e-5, atol=1e-4)


@needs_native
@pytest.mark.parametrize("counts", [[2], [1], [1, 3, 0, 4], [7, 5]])
@pytest.mark.parametrize("n", [40, 42, 3])
def test_long_rows_read_four_weight_rows_at_a_time_with_any_remainder(counts: list[int], n: int) -> None:
    # K >= 1024 takes the four-weight-rows path; n % 4 != 0 leaves a tail
    k = 1024
    gen = torch.Generator().manual_seed(n * 10 + len(counts))
    w = torch.randn(len(counts), n, k, generator=gen)
    ends = torch.tensor(counts).cumsum(0)
    x = torch.randn(int(ends[-1]), k, generator=gen)
    out = native_rows.grouped_rows(x, w, ends)
    torch.testing.assert_close(out.double(), reference(x, w, ends), rtol=1e-5, atol=1e-3)


@needs_native
@pytest.mark.parametrize("k", [256, 4096])
def test_a_rows_result_does_not_depend_on_how_many_rows_share_its_weight(k: int) -> None:
    # verification batches a token with others routed to its expert; a decode step runs it alone:
    # the kernel gives that row the same bits either way (short and long rows alike)
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(1, 64, k, generator=gen)
    x = torch.randn(9, k, generator=gen)
    alone = torch.cat([native_rows.grouped_rows(x[i : i + 1], w, torch.tensor([1])) for i in range(9)])
    for rows in range(2, 10):
        together = native_rows.grouped_rows(x[:rows], w, torch.tensor([rows]))
        assert torch.equal(together, alone[:rows]), f"{rows} rows sharing a [64, {k}] weight"


@needs_native
@pytest.mark.parametrize(("k", "n"), [(256, 40), (1024, 42), (4096, 64)])
def test_the_avx512_forms_give_every_row_the_avx2_bits(k: int, n: int) -> None:
    # groups of 1-12 rows (one pass, a remainder, two passes of eight), short and long weight rows
    # (n % 4 != 0 leaves long rows a tail of single weight rows)
    if not native_rows.wide_rows():
        pytest.skip("this CPU has no AVX-512F/DQ/VL: only the AVX2 forms run")
    gen = torch.Generator().manual_seed(k + n)
    counts = [1, 2, 3, 4, 5, 7, 8, 9, 12]
    w = torch.randn(len(counts), n, k, generator=gen)
    ends = torch.tensor(counts).cumsum(0)
    x = torch.randn(int(ends[-1]), k, generator=gen)
    try:
        assert native_rows.wide_rows(False) is False
        narrow = native_rows.grouped_rows(x, w, ends)
    finally:
        assert native_rows.wide_rows(True) is True
    wide = native_rows.grouped_rows(x, w, ends)
    assert torch.equal(wide, narrow)
    torch.testing.assert_close(wide.double(), reference(x, w, ends), rtol=1e-5, atol=1e-3)


def _cpu_vendor() -> str | None:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("vendor_id")), None)
    except OSError:
        return None


@needs_native
def test_short_rows_take_four_rows_a_pass_on_amd_and_eight_elsewhere() -> None:
    vendor = _cpu_vendor()
    if vendor is None:
        pytest.skip("no /proc/cpuinfo vendor to check the default against")
    assert native_rows.short_pass_rows() == (4 if vendor == "AuthenticAMD" else 8)


@needs_native
def test_every_pass_size_gives_the_avx2_bits() -> None:
    # short weight rows (K < 1024) in passes of 1-8 rows, groups of 1-12 rows
    if not native_rows.wide_rows():
        pytest.skip("this CPU has no AVX-512F/DQ/VL: only the AVX2 forms run")
    gen = torch.Generator().manual_seed(11)
    counts = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12]
    w = torch.randn(len(counts), 24, 256, generator=gen)
    ends = torch.tensor(counts).cumsum(0)
    x = torch.randn(int(ends[-1]), 256, generator=gen)
    default = native_rows.short_pass_rows()
    try:
        assert native_rows.wide_rows(False) is False
        narrow = native_rows.grouped_rows(x, w, ends)
        assert native_rows.wide_rows(True) is True
        for rows in range(1, 9):
            assert native_rows.short_pass_rows(rows) == rows
            assert torch.equal(native_rows.grouped_rows(x, w, ends), narrow), f"passes of {rows} rows"
    finally:
        native_rows.wide_rows(True)
        native_rows.short_pass_rows(default)
    for bad in (0, 9):
        with pytest.raises(ValueError, match="1 to 8"):
            native_rows.short_pass_rows(bad)


@needs_native
def test_software_prefetch_never_changes_the_bits() -> None:
    # groups of 1-9 rows over short and long weight rows (the one-row, AVX2 and AVX-512 forms)
    assert native_rows.prefetch_min_rows() == native_rows.PREFETCH_MIN_ROWS
    gen = torch.Generator().manual_seed(3)
    counts = [1, 2, 3, 4, 5, 9]
    ends = torch.tensor(counts).cumsum(0)
    x = torch.randn(int(ends[-1]), 1024, generator=gen)
    weights = [torch.randn(len(counts), n, k, generator=gen) for n, k in ((40, 256), (42, 1024))]
    outputs = []
    try:
        for rows in (1, 1000):  # every group prefetches / none does
            assert native_rows.prefetch_min_rows(rows) == rows
            outputs.append([native_rows.grouped_rows(x[:, : w.shape[-1]].contiguous(), w, ends) for w in weights])
    finally:
        native_rows.prefetch_min_rows(native_rows.PREFETCH_MIN_ROWS)
    assert all(torch.equal(a, b) for a, b in zip(*outputs))
    with pytest.raises(ValueError, match="at least 1"):
        native_rows.prefetch_min_rows(0)


@needs_native
def test_bad_shapes_are_refused_with_the_reason() -> None:
    w = torch.randn(2, 8, 32)
    with pytest.raises(RuntimeError, match="ends\\[-1\\] must equal"):
        native_rows.grouped_rows(torch.randn(3, 32), w, torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="non-decreasing"):
        native_rows.grouped_rows(torch.randn(3, 32), w, torch.tensor([4, 3]))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        native_rows.grouped_rows(torch.randn(3, 24), torch.randn(2, 8, 24), torch.tensor([1, 3]))


def test_serves_only_float32_cpu_weights_it_can_tile(monkeypatch) -> None:
    x = torch.randn(2, 32)
    monkeypatch.setattr(native, "available", lambda: True)
    assert native_rows.serves(x, torch.randn(3, 8, 32), torch.randn(3, 32, 16))
    assert not native_rows.serves(x, torch.randn(3, 8, 24))  # K not a multiple of 16
    assert not native_rows.serves(x.bfloat16(), torch.randn(3, 8, 32).bfloat16())
    assert not native_rows.serves(x, torch.randn(3, 32, 8).transpose(1, 2))  # not contiguous
    assert not native_rows.serves(x, torch.randn(3, 8, 32), torch.empty(3, 32, 16, device="meta"))  # off the CPU
    monkeypatch.setattr(native, "available", lambda: False)
    assert not native_rows.serves(x, torch.randn(3, 8, 32))


@needs_native
def test_compiled_graphs_call_it_as_an_extern_kernel() -> None:
    torch._dynamo.reset()
    w, ends = torch.randn(3, 8, 32), torch.tensor([1, 1, 4])
    compiled = torch.compile(lambda x: native_rows.grouped_rows(x * 2, w, ends), fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 32)
    torch.testing.assert_close(compiled(x), native_rows.grouped_rows(x * 2, w, ends))


def test_disabled_switches_the_native_kernels_off_for_a_block() -> None:
    before = native.unavailable_reason()
    with native.disabled():
        assert not native.available() and "disabled" in native.unavailable_reason()
        assert not native_rows.serves(torch.zeros(1, 32), torch.zeros(2, 8, 32))
    assert native.unavailable_reason() == before


@needs_native
def test_normed_rows_is_the_rms_norm_then_each_weight() -> None:
    gen = torch.Generator().manual_seed(3)
    h, norm = torch.randn(1, 64, generator=gen) * 3, torch.rand(64, generator=gen) + 0.5
    weights = [torch.randn(n, 64, generator=gen) for n in (32, 16, 5)]
    normed, joined = native_rows.normed_rows(h, norm, 1e-5, weights)
    expected = torch.nn.functional.rms_norm(h.double(), (64,), norm.double(), 1e-5)
    torch.testing.assert_close(normed.double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(joined.double(), torch.cat([expected @ w.double().T for w in weights], dim=-1),
                               rtol=1e-5, atol=1e-5)


@needs_native
def test_normed_rows_refuses_what_it_cannot_compute() -> None:
    with pytest.raises(RuntimeError, match=r"\[1, K\]"):
        native_rows.normed_rows(torch.randn(2, 64), torch.ones(64), 1e-5, [torch.randn(4, 64)])
    with pytest.raises(RuntimeError, match="norm_weight"):
        native_rows.normed_rows(torch.randn(1, 64), torch.ones(48), 1e-5, [torch.randn(4, 64)])
    with pytest.raises(RuntimeError, match=r"\[N, K\]"):
        native_rows.normed_rows(torch.randn(1, 64), torch.ones(64), 1e-5, [torch.randn(4, 48)])


@needs_native
def test_glu_expert_pairs_writes_each_listed_experts_gated_mlp_into_its_pairs_rows_only() -> None:
    gen = torch.Generator().manual_seed(5)
    hidden, inter, experts, tokens, top_k = 32, 48, 4, 5, 2
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up, down = torch.randn(experts, 2 * inter, hidden, generator=gen), torch.randn(experts, hidden, inter, generator=gen)
    weights = torch.rand(tokens * top_k, generator=gen)
    out = torch.full((tokens * top_k, hidden), 7.0)
    listed = {3: [0, 5], 1: [2, 3, 7, 9]}  # expert -> its pairs p = t * top_k + j; pairs 1, 4, 6, 8 unlisted
    native_rows.glu_expert_pairs(out, x, gate_up, down, weights, top_k, [3, 1], [0, 2, 6], [0, 5, 2, 3, 7, 9])

    def expected(expert: int, pair: int) -> torch.Tensor:
        h = gate_up[expert].double() @ x[pair // top_k].double()
        return down[expert].double() @ (torch.nn.functional.silu(h[:inter]) * h[inter:]) * float(weights[pair])

    for expert, pairs in listed.items():
        for pair in pairs:
            torch.testing.assert_close(out[pair].double(), expected(expert, pair), rtol=1e-4, atol=1e-4)
    assert bool((out[[1, 4, 6, 8]] == 7.0).all())  # not listed: untouched
    with pytest.raises(RuntimeError, match="down must be"):
        native_rows.glu_expert_pairs(out, x, gate_up, down.transpose(1, 2).contiguous(), weights, top_k, [0], [0, 1], [1])
    with pytest.raises(RuntimeError, match="weights must be"):
        native_rows.glu_expert_pairs(out, x, gate_up, down, weights[:2], top_k, [0], [0, 1], [1])
    with pytest.raises(RuntimeError, match="group 4 out of range"):
        native_rows.glu_expert_pairs(out, x, gate_up, down, weights, top_k, [experts], [0, 1], [1])
    with pytest.raises(RuntimeError, match="pair 10 out of range"):
        native_rows.glu_expert_pairs(out, x, gate_up, down, weights, top_k, [0], [0, 1], [tokens * top_k])
    with pytest.raises(RuntimeError, match="starts must run"):
        native_rows.glu_expert_pairs(out, x, gate_up, down, weights, top_k, [0], [0, 2], [1])
    with pytest.raises(RuntimeError, match="non-decreasing"):  # group 0 would read past the pairs
        native_rows.glu_expert_pairs(out, x, gate_up, down, weights, top_k, [0, 1], [0, 2, 1], [1])
