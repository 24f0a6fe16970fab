"""ExpertStore: the host-side copy of every routed expert of a model.

Contract: built from ``{layer_index: {param_name: stacked tensor [n_experts, ...]}}`` where layer
indices follow the model's own numbering (they may skip dense layers). Every layer carries the same
parameter names, per-expert shapes and dtype, else ``SpecterError``. ``expert(layer, e)`` returns
views (no copies) of one expert's parameters (``reference(layer, e)`` the same, for checks). With ``pin=True`` and CUDA present, the stacked
tensors are moved to page-locked memory one at a time, so that host-to-device copies can be
asynchronous while the peak extra RAM stays at one tensor. ``move_storage(place)`` re-homes the
stacked tensors the same way (huge pages on a CPU device). ``blocked``: the tensors hold each
weight in the blocked layout (``specter.model.expert_layout``; links copy bytes, so the cache
slots hold it too); ``standard(layer)`` gives a layer in the standard layout either way (the INT4
draft quantizes from it).
"""

from __future__ import annotations

import functools

from typing import Callable, Mapping

import torch

from specter.errors import SpecterError
from specter.memory.blocked_layout import unblock


class ExpertStore:
    def __init__(self, layers: Mapping[int, Mapping[str, torch.Tensor]], pin: bool = False,
                 blocked: bool = False) -> None:
        if not layers:
            raise SpecterError("ExpertStore needs at least one MoE layer")
        self._layers: dict[int, dict[str, torch.Tensor]] = {}
        reference: tuple[int, dict[str, tuple[int, ...]], torch.dtype] | None = None
        for layer in sorted(layers):
            params = dict(layers[layer])
            if not params:
                raise SpecterError(f"ExpertStore: layer {layer} has no expert parameters")
            signature = _signature(layer, params)
            if reference is None:
                reference = signature
            elif signature != reference:
                raise SpecterError(
                    f"ExpertStore: layer {layer} has experts {_describe(signature)}, "
                    f"but layer {sorted(layers)[0]} has {_describe(reference)}; all layers must match"
                )
            self._layers[layer] = params
        assert reference is not None
        self._n_experts, self._param_shapes, self._dtype = reference
        self._views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # expert() views, made once each
        self.pinned = False
        self.blocked = blocked  # the tensors hold each weight blocked (specter.model.expert_layout)
        if pin and torch.cuda.is_available():
            self.move_storage(torch.Tensor.pin_memory)
            self.pinned = True

    @property
    def layers(self) -> list[int]:
        return list(self._layers)

    @property
    def n_experts(self) -> int:
        return self._n_experts

    @property
    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._param_shapes)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @functools.cached_property
    def expert_bytes(self) -> int:
        return expert_nbytes(self._param_shapes, self._dtype)  # shapes and dtype never change

    @property
    def total_bytes(self) -> int:
        return self.expert_bytes * self._n_experts * len(self._layers)

    def expert(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        views = self._views.get((layer, expert))
        if views is None:
            check_key(self.layers, self._n_experts, layer, expert)
            views = {name: stacked[expert] for name, stacked in self._layers[layer].items()}
            self._views[(layer, expert)] = views
        return dict(views)

    def reference(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """The expert's tensors to check a copy against (``CopyRepair``): ``expert``'s views here; a
        store on disk reads them where no link's figures count the read."""
        return self.expert(layer, expert)

    def stacked(self, layer: int) -> dict[str, torch.Tensor]:
        """The stacked host tensors of one layer, ``{name: [n_experts, ...]}`` (not copies)."""
        return dict(self._layers[layer])

    def standard(self, layer: int) -> dict[str, torch.Tensor]:
        """``stacked(layer)`` in the standard layout: unblocked copies where the store is ``blocked``."""
        if not self.blocked:
            return self.stacked(layer)
        return {name: unblock(tensor) for name, tensor in self._layers[layer].items()}

    def move_storage(self, place: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Every stacked tensor replaced, one at a time, by ``place(tensor)`` (the same values in
        other memory, e.g. ``huge_pages.rehome``); ``expert`` views taken before keep the old ones."""
        for params in self._layers.values():
            for name in params:
                params[name] = place(params[name])
        self._views.clear()


def expert_nbytes(param_shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype) -> int:
    """Bytes of one expert whose parameters have these per-expert shapes and dtype."""
    item = torch.empty((), dtype=dtype).element_size()
    return sum(_numel(shape) * item for shape in param_shapes.values())


def check_key(layers: list[int], n_experts: int, layer: int, expert: int) -> None:
    """``KeyError`` for a layer the store lacks, ``IndexError`` for an expert out of range."""
    if layer not in layers:
        raise KeyError(f"layer {layer} is not an MoE layer of this store (have {layers})")
    if not 0 <= expert < n_experts:
        raise IndexError(f"expert {expert} out of range 0..{n_experts - 1}")


def _signature(
    layer: int, params: dict[str, torch.Tensor]
) -> tuple[int, dict[str, tuple[int, ...]], torch.dtype]:
    counts = {t.shape[0] if t.dim() else None for t in params.values()}
    dtypes = {t.dtype for t in params.values()}
    if len(counts) != 1 or None in counts:
        raise SpecterError(f"ExpertStore: layer {layer} params disagree on n_experts: "
                           f"{ {n: tuple(t.shape) for n, t in params.items()} }")
    if len(dtypes) != 1:
        raise SpecterError(f"ExpertStore: layer {layer} mixes dtypes {sorted(map(str, dtypes))}")
    shapes = {name: tuple(t.shape[1:]) for name, t in sorted(params.items())}
    return counts.pop(), shapes, dtypes.pop()


def _describe(signature: tuple[int, dict[str, tuple[int, ...]], torch.dtype]) -> str:
    n, shapes, dtype = signature
    return f"n={n} {shapes} {dtype}"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
