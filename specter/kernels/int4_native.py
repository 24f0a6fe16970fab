"""Specter's own INT4 CPU kernel (``csrc/int4_gemv.cpp``): built once per machine, used by the
``cpu-native`` backend of ``specter.kernels.int4``.

Contract:
- ``available() -> bool`` builds the kernel on first call (``torch.utils.cpp_extension.load``
  with a C++ compiler and ninja, a dependency; about 15 s, then cached in torch's extensions
  directory) and says whether it is usable: the CPU has AVX2 and the build (with ``-mavx2
  -mfma``) succeeded. ``unavailable_reason()`` says why not (None when available). The
  environment variable ``SPECTER_NATIVE_INT4=0`` turns it off. Nothing is built at import.
- ``pack(q [N, K] int8 in [-8, 7]) -> uint8 [N, K/2]``: per 64-value chunk of a row, 32 bytes,
  byte j = u[j] | u[j + 32] << 4 with u = q + 8; ``unpack`` inverts it. K % 64 == 0.
- ``gemv(x [M, K] float32, packed, scales [N, K/group] float32, group) -> [M, N] float32``:
  ``x @ ((u - 8) * scale).T`` with x quantized to int8 per 64-value chunk inside the kernel
  (symmetric, max|x| / 127), so it differs from a float matmul by that rounding (about 0.5%
  relative on random data): for the draft, whose tokens the target verifies, not for anything
  that must equal the target. It is the dispatcher op ``torch.ops.specter_native.int4_gemv``
  with a fake implementation, so compiled graphs call it as an extern kernel.
Measured (one thread, this project's 2-core AMD EPYC VM, 48 distinct weights cycled so they
come from memory): an [8192, 256] weight 0.15 ms against 0.33 ms for PyTorch's
``_weight_int4pack_mm_for_cpu``, [256, 4096] 0.075 ms against 0.17 ms (``scripts/int4_kernels.py``).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger("specter.kernels")
NAME = "specter_int4_native"
CHUNK = 64  # values per int8 activation scale and per 32 packed bytes
SOURCE = Path(__file__).parent / "csrc" / "int4_gemv.cpp"
_lock = threading.Lock()
_state: dict[str, str | None] = {}  # "reason": None once built and usable, else why not


def _build() -> str | None:
    if os.environ.get("SPECTER_NATIVE_INT4", "") == "0":
        return "turned off (SPECTER_NATIVE_INT4=0)"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the CPU's vector capability is {capability}, the kernel needs AVX2"
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        _put_ninja_on_path()
        built = (Path(_get_build_directory(NAME, verbose=False)) / f"{NAME}.so").exists()
        (log.info if built else log.warning)("building Specter's INT4 CPU kernel (once per machine, about 15 s) ...")
        load(NAME, [str(SOURCE)], extra_cflags=["-O3", "-mavx2", "-mfma"],
             is_python_module=False, verbose=False)
    except Exception as error:  # no compiler, no ninja, a failed build: the int4pack kernel serves
        return f"the build failed ({type(error).__name__}: {str(error).strip().splitlines()[-1][:200]})"
    torch.library.register_fake("specter_native::int4_gemv")(_fake_gemv)
    return None


def _put_ninja_on_path() -> None:
    """torch's extension loader runs ``ninja`` from PATH; the ``ninja`` package (a dependency)
    installs it beside the interpreter, which is not on PATH when the venv is not activated."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _fake_gemv(x: Tensor, packed: Tensor, scales: Tensor, group: int) -> Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


def unavailable_reason() -> str | None:
    """Why the kernel cannot be used here (None: it can); builds it on first call."""
    with _lock:
        if "reason" not in _state:
            _state["reason"] = _build()
            if _state["reason"] is not None:
                log.info("Specter's INT4 CPU kernel is not used: %s", _state["reason"])
        return _state["reason"]


def available() -> bool:
    return unavailable_reason() is None


def pack(q: Tensor) -> Tensor:
    """``q [N, K]`` int8 in [-8, 7] -> the kernel's uint8 [N, K/2] layout (see the docstring)."""
    n, k = q.shape
    if k % CHUNK:
        raise ValueError(f"the native INT4 layout needs K % {CHUNK} == 0, got K={k}")
    u = (q.to(torch.int16) + 8).to(torch.uint8).view(n, k // CHUNK, 2, CHUNK // 2)
    return (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack(packed: Tensor) -> Tensor:
    """The kernel's uint8 [N, K/2] layout -> q [N, K] int8 in [-8, 7]."""
    n, half = packed.shape
    chunks = packed.view(n, half * 2 // CHUNK, CHUNK // 2)
    u = torch.stack([chunks & 15, chunks >> 4], dim=2)  # [N, chunks, 2, 32]
    return (u.reshape(n, half * 2).to(torch.int16) - 8).to(torch.int8)


def gemv(x: Tensor, packed: Tensor, scales: Tensor, group: int) -> Tensor:
    """``x [M, K] float32 -> [M, N] float32`` through the kernel (``available()`` must be True)."""
    return torch.ops.specter_native.int4_gemv(x, packed, scales, group)
