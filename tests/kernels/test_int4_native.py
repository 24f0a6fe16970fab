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
        int4_native.pack(torch.zeros(4, 96, dtype=torch.int8))
    q = torch.randint(-8, 8, (8, 128), dtype=torch.int8)
    assert torch.equal(int4_native.unpack(int4_native.pack(q)), q)


def test_the_ninja_package_is_found_when_its_directory_is_not_on_path(monkeypatch, tmp_path) -> None:
    import ninja  # a dependency: the README installs it
    monkeypatch.setenv("PATH", str(tmp_path))
    assert shutil.which("ninja") is None
    native._put_ninja_on_path()
    found = shutil.which("ninja")
    assert found is not None and found.startswith(ninja.BIN_DIR)


@pytest.mark.parametrize("k", [256, 2048])  # short rows go four at a time, long ones one at a time
@pytest.mark.parametrize("group", [64, 128])
def test_a_rows_result_does_not_depend_on_the_rows_read_beside_it(k: int, group: int) -> None:
    if not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    torch.manual_seed(0)
    n = 11  # two groups of four rows and three left over
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    packed, scales = int4_native.pack(q), torch.rand(n, k // group) + 0.01
    x = torch.randn(3, k)
    together = int4_native.gemv(x, packed, scales, group)
    for i in range(n):  # row i alone, and as the first of a group of four
        assert torch.equal(int4_native.gemv(x, packed[i:i + 1].contiguous(), scales[i:i + 1].contiguous(), group)[:, 0], together[:, i])
        if i + 4 <= n:
            group_of_four = int4_native.gemv(x, packed[i:i + 4].contiguous(), scales[i:i + 4].contiguous(), group)
            assert torch.equal(group_of_four, together[:, i:i + 4])
    reference = x @ ((q.float() * scales.repeat_interleave(group, dim=1)).T)
    torch.testing.assert_close(together, reference, rtol=0.02, atol=0.02 * reference.abs().max().item())


def _stacked(experts: int, n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (experts, n, k), dtype=torch.int8, generator=gen)
    packed = torch.stack([int4_native.pack(q[e]) for e in range(experts)])
    return q, packed, torch.rand(experts, n, k // group, generator=gen) * 0.02 + 0.001


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
