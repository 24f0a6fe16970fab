"""Specter's native CPU code (``csrc/``), built together once per machine into one extension; the
bottom layer, so that both the kernels and the memory links can use it.

Contract:
- ``available() -> bool`` builds the extension on first call (``torch.utils.cpp_extension.load``
  with a C++ compiler and ninja, a dependency; about 20 s, then cached in torch's extensions
  directory) and says whether it is usable: the CPU has AVX2 and the build (with ``-mavx2
  -mfma``) succeeded. ``unavailable_reason()`` says why not (None when available). The
  environment variable ``SPECTER_NATIVE_INT4=0`` turns the native kernels off (every caller then
  takes its PyTorch path). Nothing is built at import. ``disabled()``: a context in which
  ``available()`` is False (A/B timings; not thread-safe against concurrent model code).
- The ops, each a ``torch.ops.specter_native`` dispatcher op with a fake implementation (compiled
  graphs call them as extern kernels): ``int4_gemv``, ``int4_rows`` and ``int4_glu_token``
  (``specter.kernels.int4_native``, the INT4 draft); ``grouped_rows`` and ``normed_rows``
  (``specter.kernels.native_rows``: full-precision experts, the draft's norms and projections);
  ``glu_expert_pairs`` (``native_rows``: some experts' gated MLPs, a verification wave; it mutates
  its output and is called eagerly only, with no fake implementation); ``draft_qkv`` and
  ``draft_attend_route`` (``native_rows``: the lean draft step's attention half of a layer,
  called eagerly only, with no fake implementation);
  ``blocked_rows`` (``specter.kernels.blocked_rows``: float32 rows against K-major blocked
  weights, the experts' layout where ``specter.model.expert_layout`` chooses it);
  ``stream_copy`` and ``paced_copy`` (``specter.memory.stream_copy``, the links' large host
  copies) mutate their destinations and are not called from compiled graphs.
- A build lock (torch's ``lock`` file in the build directory) older than ``STALE_LOCK_S`` is
  a killed process's (a build takes about 20 s): it is removed with a warning, where torch would
  wait for it forever (a bench killed while it loaded the extension left one here, and the
  next run hung without a word).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

log = logging.getLogger("specter.native")
NAME = "specter_native"
SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("int4_gemv.cpp", "grouped_rows.cpp", "draft_layer.cpp", "stream_copy.cpp", "blocked_rows.cpp")]
STALE_LOCK_S = 300.0
_lock = threading.Lock()
_state: dict[str, str | None] = {}  # "reason": None once built and usable, else why not


def _build() -> str | None:
    if os.environ.get("SPECTER_NATIVE_INT4", "") == "0":
        return "turned off (SPECTER_NATIVE_INT4=0)"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the CPU's vector capability is {capability}, the kernels need AVX2"
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        _put_ninja_on_path()
        directory = Path(_get_build_directory(NAME, verbose=False))
        clear_stale_build_lock(directory)
        built = (directory / f"{NAME}.so").exists()
        (log.info if built else log.warning)("building Specter's native CPU kernels (once per machine, about 20 s) ...")
        load(NAME, [str(source) for source in SOURCES], extra_cflags=["-O3", "-mavx2", "-mfma"],
             is_python_module=False, verbose=False)
    except Exception as error:  # no compiler, no ninja, a failed build: PyTorch's kernels serve
        return f"the build failed ({type(error).__name__}: {str(error).strip().splitlines()[-1][:200]})"
    torch.library.register_fake("specter_native::int4_gemv")(_fake_gemv)
    torch.library.register_fake("specter_native::grouped_rows")(_fake_grouped_rows)
    torch.library.register_fake("specter_native::int4_rows")(_fake_int4_rows)
    torch.library.register_fake("specter_native::int4_glu_token")(_fake_int4_glu_token)
    torch.library.register_fake("specter_native::normed_rows")(_fake_normed_rows)
    torch.library.register_fake("specter_native::blocked_rows")(_fake_grouped_rows)
    return None


def clear_stale_build_lock(directory: Path, now: float | None = None) -> bool:
    """Removes ``directory``'s build lock if it is older than ``STALE_LOCK_S``; True if it did."""
    lock = directory / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        log.warning("waiting for another process's build of Specter's native kernels (%s)", lock)
        return False
    log.warning("removing a stale build lock, %.0f s old, left by an interrupted build: %s", age, lock)
    lock.unlink(missing_ok=True)
    return True


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


def _fake_int4_rows(x: Tensor, packed: Tensor, scales: Tensor, ids: Tensor, group: int) -> Tensor:
    return x.new_empty(x.shape[0], packed.shape[1])


def _fake_int4_glu_token(x: Tensor, up_packed: Tensor, up_scales: Tensor, down_packed: Tensor, down_scales: Tensor,
                         ids: Tensor, weights: Tensor, up_group: int, down_group: int) -> Tensor:
    return x.new_empty(1, down_packed.shape[1])


def _fake_normed_rows(h: Tensor, norm_weight: Tensor, eps: float, weights: list[Tensor]) -> tuple[Tensor, Tensor]:
    return h.new_empty(h.shape), h.new_empty(1, sum(w.shape[0] for w in weights))


def _fake_grouped_rows(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


def unavailable_reason() -> str | None:
    """Why the native kernels cannot be used here (None: they can); builds them on first call."""
    with _lock:
        if "reason" not in _state:
            _state["reason"] = _build()
            if _state["reason"] is not None:
                log.info("Specter's native CPU kernels are not used: %s", _state["reason"])
        return _state["reason"]


def available() -> bool:
    return unavailable_reason() is None


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """``available()`` is False inside the block; the previous state is restored after it."""
    previous = unavailable_reason()
    _state["reason"] = "switched off (native.disabled())"
    try:
        yield
    finally:
        _state["reason"] = previous


