"""Specter's native INT4 CPU kernel: its switch, its layout, finding ninja (its numerics against
the other kernels are in test_int4.py)."""

from __future__ import annotations

import shutil

import pytest
import torch

from specter import native
from specter.kernels import int4_native
from specter.kernels.int4 import quantize_int4


def test_the_native_kernel_can_be_turned_off(monkeypatch) -> None:
    monkeypatch.setenv("SPECTER_NATIVE_INT4", "0")
    assert "SPECTER_NATIVE_INT4=0" in native._build()


def test_native_kernel_rejects_what_is_not_its_layout() -> None:
    with pytest.raises(ValueError, match="multiples of 64"):
        quantize_int4(torch.randn(16, 96), 32, backend="cpu-native")
    with pytest.raises(ValueError, match="K % 64"):
        int4_native.pack(torch.zeros(8, 96, dtype=torch.int8))
    with pytest.raises(ValueError, match="N % 8"):
        int4_native.pack(torch.zeros(12, 128, dtype=torch.int8))
    assert quantize_int4(torch.randn(12, 128), 64).backend != "cpu-native"  # the choice falls back


def test_the_block_layout_round_trips_and_interleaves_eight_rows() -> None:
    q = torch.randint(-8, 8, (16, 128), dtype=torch.int8)
    packed = int4_native.pack(q)
    assert torch.equal(int4_native.unpack(packed), q)
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    # block 1, chunk 1, load 2, row 3: row 11's chunk-1 bytes 8..11, low nibble u[j], high u[j + 32]
    at = ((1 * 2 + 1) * 8 + 2) * 32 + 4 * 3
    for j in range(4):
        byte = int(packed.view(-1)[at + j])
        assert byte & 15 == u[11, 64 + 8 + j] and byte >> 4 == u[11, 64 + 8 + j + 32]
    scales = torch.rand(16, 2)
    packed_scales = int4_native.pack_scales(scales)
    assert packed_scales.view(-1)[(1 * 2 + 1) * 8 + 3] == scales[11, 1]
    assert torch.equal(int4_native.unpack_scales(packed_scales), scales)


def test_the_ninja_package_is_found_when_its_directory_is_not_on_path(monkeypatch, tmp_path) -> None:
    import ninja  # a dependency: the README installs it
    monkeypatch.setenv("PATH", str(tmp_path))
    assert shutil.which("ninja") is None
    native._put_ninja_on_path()
    found = shutil.which("ninja")
    assert found is not None and found.startswith(ninja.BIN_DIR)


def _integer_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """What the kernel computes, in float64: x quantized to int8 per 64-value chunk as it does it
    (float32 scale max|x| / 127, round half to even), exact integer chunk sums, scaled per chunk."""
    m, k = x.shape
    chunks = x.view(m, k // 64, 64)
    amax = chunks.abs().amax(-1, keepdim=True)
    xq = torch.round(chunks * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))  # float32, as the kernel
    x_scale = (amax / 127.0).double()  # [M, C, 1]
    sums = torch.einsum("mcj,ncj->mnc", xq.double(), q.double().view(q.shape[0], k // 64, 64))  # exact integers
    w_scale = scales.repeat_interleave(group // 64, dim=1).double()  # [N, C]
    chunk_scale = (x_scale.squeeze(-1)[:, None, :].float() * w_scale[None].float()).double()  # float32 product
    return (sums * chunk_scale).sum(-1)


@pytest.mark.parametrize("k", [256, 2048])
@pytest.mark.parametrize("group", [64, 128])
def test_the_kernel_computes_its_integer_arithmetic_whatever_the_rows_beside(k: int, group: int) -> None:
    if not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    torch.manual_seed(0)
    n = 24  # three blocks of eight rows
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    scales = torch.rand(n, k // group) + 0.01
    x = torch.randn(3, k)
    got = int4_native.gemv(x, int4_native.pack(q), int4_native.pack_scales(scales), group)
    reference = _integer_reference(x, q, scales, group)
    torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
    changed = q.clone()
    changed[8:16:2] = torch.randint(-8, 8, (4, k), dtype=torch.int8)  # other rows of the second block
    again = int4_native.gemv(x, int4_native.pack(changed), int4_native.pack_scales(scales), group)
    assert torch.equal(again[:, 9:16:2], got[:, 9:16:2])
    float_reference = x @ ((q.float() * scales.repeat_interleave(group, dim=1)).T)
    torch.testing.assert_close(got, float_reference, rtol=0.02, atol=0.02 * float_reference.abs().max().item())


def _stacked(experts: int, n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (experts, n, k), dtype=torch.int8, generator=gen)
    packed = torch.stack([int4_native.pack(q[e]) for e in range(experts)])
    scales = torch.rand(experts, n, k // group, generator=gen) * 0.02 + 0.001
    return q, packed, torch.stack([int4_native.pack_scales(s) for s in scales])


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_one_tokens_gated_expert_sum_is_the_rows_composed(slots: int) -> None:
    if not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    hidden, width, experts = 128, 192, 6
    _, up_packed, up_scales = _stacked(experts, 2 * width, hidden, 64, seed=1)
    _, down_packed, down_scales = _stacked(experts, hidden, width, 64, seed=2)
    x = torch.randn(1, hidden)
    ids = torch.randperm(experts)[:slots]
    weights = torch.softmax(torch.randn(slots), dim=0)
    gate_up = int4_native.rows(x.expand(slots, -1), up_packed, up_scales, ids, 64)
    gate, up = gate_up.chunk(2, dim=-1)  # transformers' default gate: the first half
    down = int4_native.rows(torch.nn.functional.silu(gate) * up, down_packed, down_scales, ids, 64)
    expected = (down * weights[:, None]).sum(0, keepdim=True)
    fused = int4_native.glu_token(x, (up_packed, up_scales, 64), (down_packed, down_scales, 64), ids, weights)
    assert fused.shape == (1, hidden)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


def test_the_gated_sum_refuses_what_it_cannot_compute() -> None:
    if not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    _, up_packed, up_scales = _stacked(4, 256, 128, 64, seed=1)
    _, down_packed, down_scales = _stacked(4, 128, 128, 64, seed=2)
    up, down = (up_packed, up_scales, 64), (down_packed, down_scales, 64)
    with pytest.raises(RuntimeError, match="expert id out of range"):
        int4_native.glu_token(torch.randn(1, 128), up, down, torch.tensor([0, 4]), torch.ones(2))
    with pytest.raises(RuntimeError, match="one per id"):
        int4_native.glu_token(torch.randn(1, 128), up, down, torch.tensor([0, 1]), torch.ones(3))
    with pytest.raises(RuntimeError, match=r"\[1, K\]"):
        int4_native.glu_token(torch.randn(2, 128), up, down, torch.tensor([0, 1]), torch.ones(2))
