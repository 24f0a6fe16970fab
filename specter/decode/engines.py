"""The built-in engines, registered as plugins of kind ``engine``.

Contract: an engine factory is called as ``factory(recipe=..., parts=...)`` (it takes the context
keywords it names) with ``parts`` a ``specter.build.EngineParts``, and returns a
``specter.decode.engine.Engine``. Heavy imports (accelerate for ``hf-offload``) happen inside the
factory, so listing plugins stays cheap.
"""

from __future__ import annotations

from specter.hookspecs import Register, hookimpl


def resident(parts):
    from specter.decode.engine import ResidentEngine

    return ResidentEngine(parts.recipe, parts.resident_model, parts.tokenizer, parts.device, parts.path)


def ondemand(parts):
    from specter.decode.engine import OffloadedEngine

    return OffloadedEngine(*parts.offloaded)


def router_lookahead(parts):
    from specter.decode.speculative import RouterLookaheadEngine

    return RouterLookaheadEngine(*parts.offloaded, predictor=parts.predictor("router-lookahead"),
                                 prefetch_mode=parts.recipe.offload.prefetch)


def specter_engine(parts):
    from specter.decode.speculative import SpecterEngine, build_draft

    recipe, layers, store = parts.recipe, parts.offloaded.layers, parts.offloaded.store
    spec = recipe.speculation
    draft = build_draft(layers, store, parts.device, spec.draft.group_size, huge_pages=parts.huge_pages)
    return SpecterEngine(*parts.offloaded, predictor=parts.predictor(), governor=parts.governor(), draft=draft,
                         plain_predictor=parts.predictor("router-lookahead"),
                         prefetch_mode=recipe.offload.prefetch)


def hf_offload(parts):
    from specter.decode.hf_offload import build_hf_offload

    return build_hf_offload(parts.recipe, parts.path, parts.tokenizer, parts.device, parts.dtype)


@hookimpl
def register_engines(register: Register) -> None:
    register("resident", resident)
    register("ondemand", ondemand)
    register("router-lookahead", router_lookahead)
    register("specter", specter_engine)
    register("hf-offload", hf_offload)
