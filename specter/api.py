"""The public Python API for people who embed Specter.

Contract:
- ``load(recipe, overrides=())`` takes a recipe path, a dict, or a ``Recipe`` and returns a
  ready ``Engine``; ``engine.generate(prompts)`` returns texts, token ids and the report.
  ``overrides`` (here and in ``run_recipe``) is a list of ``"dotted.key=value"`` strings, one such
  string, or None (none).
- ``run_recipe(recipe, overrides=())`` does what ``python -m specter.run`` does: generate for the
  recipe's prompts and, for greedy runs of a non-resident engine with ``check_lossless``, compare
  the tokens with the ``resident`` engine's and set ``report["lossless"]``; the engine is let go
  of (collected, and CUDA's cached blocks freed) before the reference loads, and where the whole
  model does not fit the device (``torch.OutOfMemoryError``) the check is skipped with a warning:
  ``lossless`` None and ``lossless_skipped`` saying why.
- ``offload(model, expert_budget=..., link=..., cache_policy=...)`` turns an already loaded
  transformers MoE model into an offloaded one in place (accelerate style): experts move to a
  host store, a device cache serves them, and the user's own ``model.generate`` keeps working
  with the same greedy tokens. Returns an ``OffloadHandle`` (cache stats, ``remove()``). While
  offloaded, ``model.save_pretrained`` saves the real expert weights (from the host store),
  ``model.set_experts_implementation`` is refused (call ``remove()`` first), gradients flow to
  the inputs (expert weights are frozen), and a user's ``torch.compile`` of the model treats the
  offloaded experts as opaque (a graph break; no guards on the cache's bookkeeping).
  ``offload`` refuses, with a ``SpecterError`` naming the argument and leaving the model as it
  was, anything but a ``torch.nn.Module``, a ``link`` that is neither a name nor a dict, and a
  model whose experts are already offloaded (by ``offload`` or an engine): call the earlier
  handle's ``remove()`` first. ``remove()`` is idempotent: later calls do nothing (so a stale
  handle never undoes a newer offload of the same model).
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import torch

from specter.build import build_engine
from specter.decode.engine import Engine, GenerationResult
from specter.config import Recipe, load_recipe
from specter.errors import SpecterError, bounded_repr


def as_recipe(recipe: str | Path | dict | Recipe, overrides: Sequence[str] | str | None = ()) -> Recipe:
    overrides = () if overrides is None else overrides
    if isinstance(overrides, Mapping):
        example = [f"{key}={value}" for key, value in list(overrides.items())[:2]]
        raise SpecterError(f"overrides: expected a list of 'dotted.key=value' strings (or one such string, or "
                           f"None), got a dict; write {bounded_repr(example)}")
    if isinstance(recipe, Recipe):
        return load_recipe(recipe, overrides) if overrides else recipe
    return load_recipe(recipe, overrides)


def load(recipe: str | Path | dict | Recipe, overrides: Sequence[str] | str | None = ()) -> Engine:
    return build_engine(as_recipe(recipe, overrides))


def first_mismatch(a: list[list[int]], b: list[list[int]]) -> dict | None:
    for prompt, (x, y) in enumerate(zip(a, b)):
        for position, (s, t) in enumerate(zip(x, y)):
            if s != t:
                return {"prompt": prompt, "position": position, "tokens": [s, t]}
        if len(x) != len(y):
            return {"prompt": prompt, "position": min(len(x), len(y)), "tokens": None}
    return None


def run_recipe(
    recipe: str | Path | dict | Recipe, overrides: Sequence[str] | str | None = (),
    progress: Callable[[str], None] | None = None,
) -> GenerationResult:
    recipe = as_recipe(recipe, overrides)
    say = progress or (lambda message: None)
    prompts = recipe.resolved_prompts()
    say(f"loading {recipe.model} for engine {recipe.engine} ...")
    engine = build_engine(recipe)
    try:
        def step(index: int, total: int, tokens: int) -> None:
            if tokens % 16 == 0 or tokens == recipe.max_new_tokens:
                say(f"[{recipe.engine}] prompt {index + 1}/{total}: {tokens}/{recipe.max_new_tokens} tokens")
        result = engine.generate(prompts, progress=step)
    finally:
        engine.close()
    if recipe.engine != "resident" and recipe.check_lossless and recipe.sampling.temperature == 0:
        device = torch.device(getattr(engine, "device", "cpu"))
        del engine  # its weights, cache slots and draft go before the whole model loads beside them
        _free_memory(device)
        say("checking losslessness against the resident engine ...")
        try:
            reference_engine = build_engine(as_recipe(recipe, ["engine=resident", "compile=false"]))  # eager
            try:
                reference = reference_engine.generate(prompts)
            finally:
                reference_engine.close()
        except torch.OutOfMemoryError as error:  # the whole model does not fit where the experts were offloaded from
            _free_memory(device)
            reason = f"the resident reference did not fit on {device}: {' '.join(str(error).split())[:200]}"
            say(f"warning: lossless check skipped: {reason}")
            result.report["lossless"] = None
            result.report["lossless_skipped"] = reason
            return result
        mismatch = first_mismatch(result.token_ids, reference.token_ids)
        result.report["lossless"] = mismatch is None
        result.report["lossless_first_mismatch"] = mismatch
        result.report["resident_decode_tokens_per_s"] = reference.report["decode_tokens_per_s"]
    return result


def _free_memory(device: torch.device) -> None:
    """Collect what was let go of and, on CUDA, hand the allocator's cached blocks back."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class OffloadHandle:
    model: torch.nn.Module
    runtime: object
    cache: object
    store: object
    link: object
    removed: bool = field(default=False, init=False)  # remove() ran: later calls do nothing

    @property
    def stats(self):
        return self.cache.stats

    @contextlib.contextmanager
    def real_experts(self) -> Iterator[None]:
        """For the duration, the model's expert parameters are the host store's experts (on the
        host, in the standard layout: ``store.standard``) instead of the empty placeholders;
        ``save_pretrained`` runs inside this."""
        placeholders = {}
        for info in self.runtime.layers.values():
            for name, tensor in self.store.standard(info.layer).items():
                placeholders[(info.layer, name)] = getattr(info.experts, name)
                setattr(info.experts, name, torch.nn.Parameter(tensor, requires_grad=False))
        try:
            yield
        finally:
            for info in self.runtime.layers.values():
                for name in self.store.stacked(info.layer):
                    setattr(info.experts, name, placeholders[(info.layer, name)])

    def _save_pretrained(self, *args, **kwargs):
        with self.real_experts():
            return type(self.model).save_pretrained(self.model, *args, **kwargs)

    def _refuse_switch(self, *args, **kwargs):
        raise SpecterError("this model's experts are offloaded by specter; call the offload handle's remove() "
                           "before set_experts_implementation")

    def _guard(self) -> None:
        self.model.save_pretrained = self._save_pretrained
        self.model.set_experts_implementation = self._refuse_switch

    def _unguard(self) -> None:
        for name in ("save_pretrained", "set_experts_implementation"):
            self.model.__dict__.pop(name, None)

    def remove(self) -> None:
        """Undo ``offload``: put the host experts back into the model on its device and restore
        the model's own experts implementation. The device cache is freed with the handle.
        Idempotent: a second call does nothing (even after the model was offloaded again)."""
        from specter.experts.runtime import uninstall

        if self.removed:
            return
        self.removed = True
        self._unguard()
        uninstall(self.model)
        for info in self.runtime.layers.values():
            device = next(p.device for p in info.experts.parameters())
            for name, tensor in self.store.standard(info.layer).items():
                setattr(info.experts, name, torch.nn.Parameter(tensor.to(device), requires_grad=False))
        self.link.close()


def offload(
    model: torch.nn.Module,
    expert_budget: float | str | dict = 0.5,
    link: str | dict = "auto",
    cache_policy: str = "lru",
) -> OffloadHandle:
    from specter.memory.cache import ExpertCache
    from specter.build import make_link, slots_for_budget
    from specter.experts.runtime import ExpertRuntime, install, installed
    from specter.model.loader import split_experts
    from specter.plugins import registry
    from specter.model.compat import require_supported_transformers

    require_supported_transformers()
    if not isinstance(model, torch.nn.Module):
        raise SpecterError(f"model: expected a loaded transformers MoE model (a torch.nn.Module, e.g. from "
                           f"AutoModelForCausalLM.from_pretrained), got {type(model).__name__}")
    if installed(model):
        raise SpecterError("model: its experts are already offloaded by specter (specter.offload or an engine); "
                           "keep using that offload's handle, or call its remove() before offloading again")
    if not isinstance(link, (str, Mapping)):
        raise SpecterError(f"link: expected a link name (auto, local, emulated, cuda, ...) or a dict such as "
                           f"{{'kind': 'emulated', 'gbps': 5.0}}, got {type(link).__name__} {bounded_repr(link)}")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    link_spec = {"kind": link} if isinstance(link, str) else dict(link)
    if link_spec.get("kind") == "disk":  # make_link's own message speaks of recipe keys offload() has not
        raise SpecterError("link: 'disk' reads experts from a checkpoint on disk, for recipes with "
                           "offload.experts_on: disk (specter.load); offload() copies from host memory: use "
                           "auto, local, emulated or cuda")
    recipe = load_recipe({"offload": {"expert_budget": expert_budget, "link": link_spec,
                                      "cache_policy": {"name": cache_policy}}})
    # validate everything before the model is touched: a refused offload leaves it as it was
    from specter.model.layout import moe_layers
    from specter.memory.store import ExpertStore

    views = ExpertStore({m.layer: {n: getattr(m.experts, n).detach() for n in m.param_names} for m in moe_layers(model)})
    n_slots = slots_for_budget(recipe, views, max(m.top_k for m in moe_layers(model)))
    policy = registry().create("cache_policy", cache_policy, {}, key="cache_policy")
    the_link = make_link(recipe, device)
    # blocked where expert_layout chooses for the device that computes (the cache's, not the experts' own)
    layers, store = split_experts(model, pin=device.type == "cuda", device=device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    cache = ExpertCache(store, n_slots, device, the_link, policy)
    runtime = ExpertRuntime(layers, cache)
    install(model, runtime)
    handle = OffloadHandle(model, runtime, cache, store, the_link)
    handle._guard()
    return handle
