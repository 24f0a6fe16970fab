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
