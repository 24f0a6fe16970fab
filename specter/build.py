"""The composition root: a validated recipe in, a ready engine out.

Contract: ``build_engine(recipe)`` sets the run's threads and seed, resolves the device, the
checkpoint and the tokenizer, and asks the plugin registry for the recipe's engine (kind
``engine``), handing the factory an ``EngineParts``: the pieces every engine is assembled from,
each built on first request (the dense model on the device, the offloaded model with its host
store, the cache policy, the link and the expert cache sized by ``offload.expert_budget``, the
predictor and the governor). With ``huge_pages`` on a CPU device where Linux allows them, the
models' large weights, the host store, the cache slots (and ``specter``'s INT4 draft) lie on 2 MiB
pages. With ``compile: true`` the engine gets its compiled steps here, so decode timings exclude
compilation; without, a ``specter`` engine gets its lean eager draft step where the model allows
(``specter.compile.lean_draft``). Nothing below this module imports it;
entry points (``specter.api``, the CLIs) call it.
"""

from __future__ import annotations

import os
from functools import cached_property
from typing import NamedTuple
from pathlib import Path

import torch

from specter.compile.lean_draft import use_lean_draft
from specter.decode.engine import Engine
from specter.errors import SpecterError
from specter.model.compat import require_supported_transformers
from specter.model.loader import DTYPES, checkpoint_dir, load_model, load_tokenizer
from specter.decode.governor import Governor
from specter.memory.budget import budget_slots
from specter.memory import huge_pages
from specter.memory.cache import ExpertCache
from specter.memory.store import ExpertStore
from specter.memory.link import Link
from specter.policies.base import CachePolicy
from specter.predictors.base import Predictor
from specter.plugins import registry


def resolve_device(spec: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; a CUDA device this torch cannot see is refused."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecterError(f"device: {spec} requested but this torch build sees no CUDA device; use device: cpu or auto")
    return device


def make_link(recipe, device: torch.device, store=None):
    """The recipe's link plugin (``auto``: disk where ``experts_on`` is disk without a host tier,
    else cuda on a CUDA device, else emulated), bound to ``device``. With ``offload.host_budget``
    it is the host-to-device link of a ``HostTierLink`` sized for ``store`` (which must then be
    given), which reads the disk."""
    spec, offload = recipe.offload.link, recipe.offload
    tiered = offload.host_budget is not None
    kind = spec.kind
    if kind == "auto":
        on_disk = offload.experts_on == "disk" and not tiered
        kind = "disk" if on_disk else "cuda" if device.type == "cuda" else "emulated"
    if tiered and kind == "disk":
        raise SpecterError("offload.link.kind: with offload.host_budget the host tier reads the disk and "
                           "offload.link is the host-to-device link: use auto, cuda, emulated or local")
    if not tiered and kind == "disk" and offload.experts_on != "disk":
        raise SpecterError("offload.link.kind: the disk link reads experts from the checkpoint: use it with "
                           "offload.experts_on: disk (and only it)")
    if not tiered and kind != "disk" and offload.experts_on == "disk":
        raise SpecterError(f"offload.link.kind: {kind!r} copies from host memory, but offload.experts_on is disk "
                           "with no host tier: use disk or auto (or set offload.host_budget for a host tier "
                           "in front of the disk)")
    if kind == "cuda" and device.type != "cuda":
        raise SpecterError(f"offload.link.kind: 'cuda' needs a CUDA device, but the device is {device}; use emulated or local")
    link = registry().create("link", kind, spec.factory_options(kind), key="offload.link.kind", expect=Link,
                             device=device)
    if not tiered:
        return link
    from specter.memory.host_tier import HostTierLink

    capacity = budget_slots(offload.host_budget, len(store.layers), store.n_experts, store.expert_bytes, 1,
                            key="offload.host_budget")
    return HostTierLink(link, capacity, _cache_policy(recipe), pin=device.type == "cuda" and offload.pin_memory)


def _cache_policy(recipe) -> CachePolicy:
    policy = recipe.offload.cache_policy
    return registry().create("cache_policy", policy.name, policy.options, key="offload.cache_policy.name",
                             expect=CachePolicy)


class OffloadedParts(NamedTuple):
    """The arguments of ``OffloadedEngine``, in order (``OffloadedEngine(*parts.offloaded)``)."""

    recipe: object
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    path: Path
    layers: list
    store: object
    cache: ExpertCache
    link: Link


def slots_for_budget(recipe, store, top_k: int) -> int:
    return budget_slots(recipe.offload.expert_budget, len(store.layers), store.n_experts, store.expert_bytes, top_k)


class EngineParts:
    """What an engine factory assembles an engine from; every part is built on first access.

    ``recipe``, ``device``, ``dtype``, ``path`` (checkpoint directory), ``tokenizer`` are ready;
    ``resident_model`` loads every weight on the device; ``offloaded`` loads the dense weights on
    the device and the experts into a host store, with a cache of ``offload.expert_budget`` slots
    behind the recipe's link and cache policy: an ``OffloadedParts``, the arguments of
    ``OffloadedEngine``. ``predictor(name=None)`` and
    ``governor()`` create the recipe's speculation plugins (``top_k``/``n_experts`` offered, and
    to a governor ``cache_slots_per_layer``: the cache's slots over the MoE layers).
    """

    def __init__(self, recipe) -> None:
        self.recipe = recipe
        self.device = resolve_device(recipe.device)
        self.dtype = DTYPES[recipe.dtype]
        self.path: Path = checkpoint_dir(recipe.model_path())
        self.tokenizer = load_tokenizer(self.path, recipe.trust_remote_code)

    def _load_options(self) -> dict:
        recipe = self.recipe
        return dict(dtype=self.dtype, device=self.device, allow_pickle=recipe.allow_pickle,
                    trust_remote_code=recipe.trust_remote_code)

    @property
    def huge_pages(self) -> bool:
        """Weights, host experts and cache slots on 2 MiB pages (``huge_pages``, CPU devices)."""
        return self.recipe.huge_pages and self.device.type == "cpu" and huge_pages.supported()

    @cached_property
    def resident_model(self) -> torch.nn.Module:
        model, _, _ = load_model(self.path, **self._load_options())
        if self.huge_pages:
            huge_pages.rehome_module(model)
        return model

    @cached_property
    def offloaded(self) -> OffloadedParts:
        recipe = self.recipe
        model, layers, store = load_model(self.path, keep_experts_on_host=True, pin_memory=recipe.offload.pin_memory,
                                          experts_on_disk=recipe.offload.experts_on == "disk",
                                          direct_io=recipe.offload.direct_io, **self._load_options())
        n_slots = slots_for_budget(recipe, store, max(m.top_k for m in layers))
        if self.huge_pages:
            huge_pages.rehome_module(model)  # the weights outside the experts
            if isinstance(store, ExpertStore):
                store.move_storage(huge_pages.rehome)
        link = make_link(recipe, self.device, store)
        policy = _cache_policy(recipe)
        verify = recipe.offload.verify_copies or os.environ.get("SPECTER_VERIFY_COPIES", "") not in ("", "0")
        cache = ExpertCache(store, n_slots, self.device, link, policy,
                            transfer_timeout_s=recipe.offload.transfer_timeout_s, verify_copies=verify,
                            huge_pages=self.huge_pages)
        return OffloadedParts(recipe, model, self.tokenizer, self.device, self.path, layers, store, cache, link)

    def _shape(self) -> dict:
        layers, store = self.offloaded.layers, self.offloaded.store
        return {"n_experts": store.n_experts, "top_k": max(m.top_k for m in layers)}

    def predictor(self, name: str | None = None):
        spec = self.recipe.speculation.predictor
        if name is not None:
            return registry().create("predictor", name, {}, key="engine", expect=Predictor, **self._shape())
        return registry().create("predictor", spec.name, spec.options, key="speculation.predictor.name",
                                 expect=Predictor, **self._shape())

    def governor(self):
        spec = self.recipe.speculation.governor
        slots_per_layer = self.offloaded.cache.capacity / len(self.offloaded.layers)
        return registry().create("governor", spec.name, spec.options, key="speculation.governor.name",
                                 expect=Governor, k=spec.k, cache_slots_per_layer=slots_per_layer, **self._shape())


def build_engine(recipe) -> Engine:
    """The recipe's engine, loaded, its caches sized, compiled and warmed up if asked."""
    require_supported_transformers()
    torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    parts = EngineParts(recipe)
    engine = registry().create("engine", recipe.engine, {}, key="engine", expect=Engine, recipe=recipe, parts=parts)
    use_lean_draft(engine)  # before compiling: a compiled engine on a CPU drafts with it too
    if recipe.compile:
        from specter.compile.attach import compile_engine

        compile_engine(engine)
    return engine
