"""Which memory layout a model's full-precision experts are kept in, and putting them in it.

Contract:
- Two layouts of a stacked experts tensor [E, N, K] (``gate_up_proj`` [E, 2I, H], ``down_proj``
  [E, H, I]), the same shape and bytes: *standard* (transformers' own, each weight row by row) and
  *blocked* (``specter.memory.blocked_layout``: each weight as [N / 16, K, 16]), which only
  Specter's float32 kernels read (``native_rows.grouped_rows`` / ``glu_expert_pairs`` with
  ``blocked=True``).
- ``chooses_blocked(module, dtype, device) -> bool``: whether experts of this transformers experts
  module (its parameters' shapes; they may be on ``meta``), held in ``dtype`` and computed on
  ``device``, are kept blocked: the process-wide switch is on (``enabled``), a CPU, float32, the
  layout Specter's grouped kernel covers (``specter.model.layout.is_plain_gated``: gated, [out,
  in], no biases), exactly ``gate_up_proj`` and ``down_proj`` with 2I, H and I multiples of 16,
  one expert at least ``BLOCKED_MIN_BYTES``, and Specter's native kernels available. A pure function of the
  model and the machine: every engine of a process (``resident``'s own modules, the offloaded
  engines' shared host store and their cache slots, the disk tier's reads) decides alike, so every
  engine's experts sum in the same order and greedy tokens stay comparable bit for bit.
- ``enabled(value=None) -> bool``: the process-wide switch (on unless the environment sets
  ``SPECTER_EXPERT_LAYOUT=standard``, read at import by ``switch_from_environment``; another value
  than ``standard`` / ``auto`` warns); ``value`` sets it first (A/B timings, tests). Models and
  stores built before keep their layout.
- ``block_module(module)``: the module's ``gate_up_proj`` / ``down_proj`` rewritten blocked in place
  (their storage kept: huge pages stay huge pages) and the module marked (``is_blocked``);
  ``is_blocked(obj)``: whether a module or a ``SlotView`` holds blocked experts.
- The layout itself: ``specter.memory.blocked_layout`` (``block``, ``unblock``, ``block_rows_into``).
Why: on this project's CPU one thread reads a blocked weight for two to eight rows 12-23% faster
than the row kernels (``specter.kernels.blocked_rows``' docstring), and one row at about the same speed, so
verification's wide rounds get cheaper against a single step. Small experts (the bundled model's
0.75 MiB) stay standard: their steps are framework-bound; with the floor lowered (one process,
50% ``local``, four runs each) compiled ``resident`` ran 1.073x, eager 1.012x, but ``specter`` k = 4
0.983x eager and 1.016x compiled, within the noise (design notes, stop 67).
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from specter import native
from specter.memory.blocked_layout import BLOCK, block_in_place
from specter.model.layout import is_plain_gated

BLOCKED_MIN_BYTES = 4 << 20  # as host_layer.COMPUTES_MIN_BYTES: experts the host computes
_MARK = "_specter_blocked"
ENVIRONMENT = "SPECTER_EXPERT_LAYOUT"  # "standard": off; "auto" or unset: on


def switch_from_environment() -> bool:
    """The switch's start value: off where ``SPECTER_EXPERT_LAYOUT=standard``; a value other than
    ``standard`` / ``auto`` warns and leaves it on."""
    value = os.environ.get(ENVIRONMENT, "auto").strip().lower()
    if value not in ("auto", "standard", ""):
        warnings.warn(f"{ENVIRONMENT}={value!r} is not 'standard' or 'auto'; the blocked layout stays on", stacklevel=2)
    return value != "standard"


_enabled = [switch_from_environment()]


def enabled(value: bool | None = None) -> bool:
    if value is not None:
        _enabled[0] = bool(value)
    return _enabled[0]


def chooses_blocked(module: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    if not enabled() or torch.device(device).type != "cpu" or dtype != torch.float32 or not is_plain_gated(module):
        return False
    params = dict(module.named_parameters(recurse=False))
    if set(params) != {"gate_up_proj", "down_proj"}:
        return False
    (_, two_inter, hidden), (_, hidden_out, inter) = params["gate_up_proj"].shape, params["down_proj"].shape
    if any(size % BLOCK for size in (two_inter, hidden, hidden_out, inter)):
        return False
    expert_bytes = (two_inter * hidden + hidden_out * inter) * torch.finfo(dtype).bits // 8
    return expert_bytes >= BLOCKED_MIN_BYTES and native.available()


def block_module(module: nn.Module) -> None:
    for name in ("gate_up_proj", "down_proj"):
        block_in_place(getattr(module, name).data)
    mark(module, True)


def is_blocked(obj: object) -> bool:
    return bool(getattr(obj, _MARK, False))


def mark(obj: object, blocked: bool) -> None:
    """Say whether ``obj`` (a ``SlotView``, a module) holds blocked experts."""
    object.__setattr__(obj, _MARK, blocked)
