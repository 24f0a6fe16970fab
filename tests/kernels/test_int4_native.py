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
    import ninja  # noqa: F401  (a dependency: the README installs it)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert shutil.which("ninja") is None
    native._put_ninja_on_path()
    assert shutil.which("ninja") is not None
