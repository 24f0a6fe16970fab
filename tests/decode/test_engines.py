"""The built-in engine plugins (``specter.decode.engines``): the five names and their factories,
each factory's wiring of ``EngineParts`` into its engine (checked with recording stand-ins for the
engine classes), the context the registry hands them, that listing them imports no engine module,
and, on the tiny random Mixtral, that each offloaded engine is built from the very parts it is given.
Decoding and reports are in test_engine.py and test_speculative.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specter.build import EngineParts, OffloadedParts
from specter.config import load_recipe
from specter.decode import engines
from specter.decode.engine import Engine, OffloadedEngine, ResidentEngine
from specter.decode.speculative import RouterLookaheadEngine, SpecterEngine
from specter.errors import SpecterError
from specter.plugins import registry
from specter.predictors.draft import DraftPredictor
from specter.predictors.router_lookahead import RouterLookaheadPredictor

BUILTINS = ["resident", "ondemand", "router-lookahead", "specter", "hf-offload"]


pytestmark = pytest.mark.usefixtures("clean_plugins")


class Recorded:
    """What a stand-in engine class or builder was called with."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.args, self.kwargs = args, kwargs


def fake_parts(prefetch: str = "lazy", group_size: int = 32, huge: bool = False) -> SimpleNamespace:
    """``EngineParts``' attributes as sentinels; ``predictor``/``governor`` record their calls."""
    recipe = SimpleNamespace(offload=SimpleNamespace(prefetch=prefetch),
                             speculation=SimpleNamespace(draft=SimpleNamespace(group_size=group_size)))
    offloaded = OffloadedParts(recipe, "model", "tokenizer", "device", Path("/ckpt"), ["layer0", "layer1"], "store",
                               "cache", "link")
    asked: list[str | None] = []

    def predictor(name: str | None = None) -> tuple[str, str | None]:
        asked.append(name)
        return ("predictor", name)

    return SimpleNamespace(recipe=recipe, resident_model="resident-model", tokenizer="tokenizer", device="device",
                           path=Path("/ckpt"), dtype="dtype", huge_pages=huge, offloaded=offloaded,
                           predictor=predictor, asked=asked, governor=lambda: "governor")


# ----------------------------------------------------------------------------- registration


def test_register_engines_registers_the_five_builtins_with_their_factories() -> None:
    registered: list[tuple[str, object]] = []
    engines.register_engines(lambda name, factory: registered.append((name, factory)))
    assert registered == [("resident", engines.resident), ("ondemand", engines.ondemand),
                          ("router-lookahead", engines.router_lookahead), ("specter", engines.specter_engine),
                          ("hf-offload", engines.hf_offload)]


def test_the_registry_serves_the_builtin_engines_from_this_module() -> None:
    plugins = registry()
    assert set(BUILTINS) <= set(plugins.names("engine"))
    assert {name: plugins.get("engine", name) for name in BUILTINS} == {
        "resident": engines.resident, "ondemand": engines.ondemand, "router-lookahead": engines.router_lookahead,
        "specter": engines.specter_engine, "hf-offload": engines.hf_offload}
    assert {plugins.source("engine", name) for name in BUILTINS} == {"builtin (specter.decode.engines)"}


def test_listing_the_engines_imports_no_engine_module() -> None:
    code = ("import sys\n"
            "from specter.plugins import registry\n"
            "names = registry().names('engine')\n"
            "heavy = ('accelerate', 'transformers', 'specter.decode.engine', 'specter.decode.speculative',\n"
            "         'specter.decode.hf_offload')\n"
            "print(','.join(names)); print(','.join(m for m in heavy if m in sys.modules))\n")
    env = {**os.environ, "SPECTER_PLUGINS": ""}  # built-ins only
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    names, imported = done.stdout.splitlines()
    assert names.split(",") == sorted(BUILTINS)
    assert imported == ""


# ----------------------------------------------------------------------------- wiring


def test_resident_gets_the_recipe_dense_model_tokenizer_device_and_path(monkeypatch) -> None:
    monkeypatch.setattr("specter.decode.engine.ResidentEngine", Recorded)
    parts = fake_parts()
    made = engines.resident(parts)
    assert made.args == (parts.recipe, "resident-model", "tokenizer", "device", Path("/ckpt")) and made.kwargs == {}


def test_ondemand_gets_the_offloaded_parts_in_order(monkeypatch) -> None:
    monkeypatch.setattr("specter.decode.engine.OffloadedEngine", Recorded)
    parts = fake_parts()
    made = engines.ondemand(parts)
    assert made.args == tuple(parts.offloaded) and made.kwargs == {}
    assert parts.asked == []  # no predictor


def test_router_lookahead_gets_the_router_lookahead_predictor_and_the_prefetch_mode(monkeypatch) -> None:
    monkeypatch.setattr("specter.decode.speculative.RouterLookaheadEngine", Recorded)
    parts = fake_parts(prefetch="conservative")
    made = engines.router_lookahead(parts)
    assert made.args == tuple(parts.offloaded)
    assert made.kwargs == {"predictor": ("predictor", "router-lookahead"), "prefetch_mode": "conservative"}
    assert parts.asked == ["router-lookahead"]  # never the recipe's own predictor


@pytest.mark.parametrize("huge", [False, True])
def test_specter_gets_its_draft_the_recipes_predictor_and_governor_and_a_plain_predictor(monkeypatch,
                                                                                       huge: bool) -> None:
    monkeypatch.setattr("specter.decode.speculative.SpecterEngine", Recorded)
    monkeypatch.setattr("specter.decode.speculative.build_draft", Recorded)
    parts = fake_parts(prefetch="aggressive", group_size=128, huge=huge)
    made = engines.specter_engine(parts)
    assert made.args == tuple(parts.offloaded)
    draft = made.kwargs.pop("draft")
    assert draft.args == (["layer0", "layer1"], "store", "device", 128) and draft.kwargs == {"huge_pages": huge}
    assert made.kwargs == {"predictor": ("predictor", None), "governor": "governor",
                           "plain_predictor": ("predictor", "router-lookahead"), "prefetch_mode": "aggressive"}
    assert sorted(parts.asked, key=str) == [None, "router-lookahead"]


def test_hf_offload_gets_the_recipe_path_tokenizer_device_and_dtype(monkeypatch) -> None:
    monkeypatch.setattr("specter.decode.hf_offload.build_hf_offload", Recorded)
    parts = fake_parts()
    made = engines.hf_offload(parts)
    assert made.args == (parts.recipe, Path("/ckpt"), "tokenizer", "device", "dtype") and made.kwargs == {}


def test_the_registry_hands_a_factory_only_the_parts(monkeypatch) -> None:
    monkeypatch.setattr("specter.decode.engine.ResidentEngine", Recorded)
    parts = fake_parts()
    made = registry().create("engine", "resident", {}, key="engine", recipe="the recipe", parts=parts)
    assert isinstance(made, Recorded) and made.args[0] is parts.recipe
    with pytest.raises(SpecterError, match=r"^engine: unknown option 'k' for engine 'resident'; accepted options: "
                                           r"\(none\)$"):
        registry().create("engine", "resident", {"k": 1}, key="engine", recipe="the recipe", parts=parts)


def test_a_stand_in_that_is_not_an_engine_is_refused_as_build_engine_asks(monkeypatch) -> None:
    monkeypatch.setattr("specter.decode.engine.OffloadedEngine", Recorded)
    with pytest.raises(SpecterError, match="^engine: engine plugin 'ondemand' returned a Recorded, which is not a "
                                           "specter.decode.engine.Engine; subclass it$"):
        registry().create("engine", "ondemand", {}, key="engine", expect=Engine, parts=fake_parts())


# ----------------------------------------------------------------------------- real parts


def test_each_engine_is_built_from_the_parts_it_is_given(zoo_mixtral: str) -> None:
    recipe = load_recipe({"model": zoo_mixtral, "threads": 1, "offload": {"link": {"kind": "local"},
                          "expert_budget": 0.25, "prefetch": "lazy"}})
    parts = EngineParts(recipe)
    made = {name: registry().create("engine", name, {}, key="engine", expect=Engine, recipe=recipe, parts=parts)
            for name in ("resident", "ondemand", "router-lookahead", "specter")}
    try:
        assert [type(made[name]) for name in made] == [ResidentEngine, OffloadedEngine, RouterLookaheadEngine,
                                                      SpecterEngine]
        assert [engine.name for engine in made.values()] == ["resident", "ondemand", "router-lookahead", "specter"]
        assert made["resident"].model is parts.resident_model and made["resident"].model_path == parts.path
        for name in ("ondemand", "router-lookahead", "specter"):  # one set of offloaded parts, shared
            engine = made[name]
            assert (engine.model, engine.cache, engine.link, engine.store) == (
                parts.offloaded.model, parts.offloaded.cache, parts.offloaded.link, parts.offloaded.store)
        lookahead, spec = made["router-lookahead"], made["specter"]
        assert isinstance(lookahead.predictor, RouterLookaheadPredictor) and lookahead.scheduler.mode == "lazy"
        assert isinstance(spec.predictor, DraftPredictor) and isinstance(spec.plain_predictor, RouterLookaheadPredictor)
        assert spec.scheduler.mode == "lazy"
        assert sorted(spec.draft) == sorted(spec.runtime.layers) and len(spec.draft) == 2
        assert spec.governor.name == "fixed"
        assert next(iter(spec.draft.values())).nbytes > 0 and parts.device == torch.device("cpu")
    finally:
        for engine in made.values():
            engine.close()
