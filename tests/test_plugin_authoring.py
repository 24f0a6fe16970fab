"""Mistakes a new plugin author makes, and what Specter tells them.

Each test is one thing a third-party author did while following docs/plugins.md: a misspelt hook
name or a forgotten ``@hookimpl`` (pluggy alone ignores both silently), registering the same
object twice, a recipe naming a plugin that a disabled package or ``SPECTER_PLUGINS`` kept out,
several option typos at once, a plugin class that sets no ``name``, looking for a plugin's options.
The last test checks that ``specter.hookspecs.CONTEXT_KEYWORDS`` (what option checks and
``--list-plugins`` rely on) is what ``specter.build`` really offers each kind.
"""

from __future__ import annotations

import importlib.metadata
import types
import warnings

import pytest
import torch

from specter.decode.governor import Governor
from specter.errors import SpecterError, UnknownPluginError
from specter.hookspecs import CONTEXT_KEYWORDS, hookimpl
from specter.memory.link import CompletedTransfer, Link, copy_all, transfer_nbytes
from specter.plugins import PluginLoadWarning, format_plugin_list, register_plugin, registry, reset_plugins
from specter.policies.base import CachePolicy

torch.set_num_threads(1)


class FakeEntryPoint:
    """Quacks like an installed ``importlib.metadata.EntryPoint`` of distribution ``dist_name``."""

    def __init__(self, name: str, plugin: object, dist_name: str = "audit-dist") -> None:
        self.name, self.value, self.group = name, f"audit_{name}", "specter"
        self.dist = types.SimpleNamespace(name=dist_name)
        self._plugin = plugin

    def load(self) -> object:
        return self._plugin


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    monkeypatch.delenv("SPECTER_PLUGINS", raising=False)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kwargs: [])
    reset_plugins()
    yield
    reset_plugins()


def use_entry_points(monkeypatch, *entry_points: FakeEntryPoint) -> None:
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kwargs: list(entry_points))
    reset_plugins()


class Fifo(CachePolicy):
    name = "audit-fifo"

    def __init__(self, spare_hinted: bool = True) -> None:
        self.spare_hinted = spare_hinted

    def choose_victim(self, candidates):
        return candidates[0]


class Misspelt:
    @hookimpl
    def register_cache_policy(self, register):  # the hook is register_cache_policies
        register("audit-fifo", Fifo)


class Unmarked:
    def register_cache_policies(self, register):  # no @hookimpl
        register("audit-fifo", Fifo)


class Good:
    @hookimpl
    def register_cache_policies(self, register):
        register("audit-fifo", Fifo)


class Clashing:
    @hookimpl
    def register_cache_policies(self, register):
        register("lru", Fifo)
        register("audit-other", Fifo)


@pytest.mark.parametrize("plugin, expected", [
    (Misspelt(), "@hookimpl register_cache_policy is not a Specter hook; did you mean register_cache_policies?"),
    (Unmarked(), "register_cache_policies is not marked with @specter.hookspecs.hookimpl"),
    (types.ModuleType("empty_plugin"), "it implements none of the hooks"),
])
def test_an_entry_point_that_would_register_nothing_is_skipped_saying_why(monkeypatch, plugin, expected):
    use_entry_points(monkeypatch, FakeEntryPoint("mine", plugin))
    with pytest.warns(PluginLoadWarning, match=expected):
        plugins = registry()
    assert "audit-fifo" not in plugins.names("cache_policy")
    assert any(expected in line and "audit-dist (entry point mine)" in line for line in plugins.skipped)


@pytest.mark.parametrize("plugin, expected", [
    (Misspelt(), "is not a Specter hook; did you mean register_cache_policies?"),
    (Unmarked(), "is not marked with @specter.hookspecs.hookimpl"),
])
def test_register_plugin_refuses_an_object_that_would_register_nothing(plugin, expected):
    with pytest.raises(SpecterError, match=expected):
        register_plugin(plugin)
    register_plugin(Good())  # the refused object left nothing behind
    assert "audit-fifo" in registry().names("cache_policy")


def test_registering_the_same_object_twice_is_harmless_and_a_taken_name_is_one_line():
    plugin = Good()
    first = register_plugin(plugin)
    assert register_plugin(plugin) == first
    assert "audit-fifo" in registry().names("cache_policy")
    register_plugin(Good(), name="mine")
    with pytest.raises(SpecterError) as caught:
        register_plugin(Good(), name="mine")
    label = f"{Good.__module__}.Good"
    assert str(caught.value) == (f"register_plugin({label}): the name 'mine' is taken by registered at runtime "
                                 f"({label}); pass another name=, or call reset_plugins() first")  # not pluggy's dump


def test_a_problem_is_warned_about_and_listed_once_however_often_the_registry_is_rebuilt():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        register_plugin(Clashing())
        registry()
        register_plugin(Good())  # the registry is rebuilt on its next use
        plugins = registry()
    clash = [line for line in plugins.skipped if "'lru' is registered twice" in line]
    assert len(clash) == 1 and clash[0].endswith("rename yours")
    assert len([w for w in caught if issubclass(w.category, PluginLoadWarning)]) == 1
    assert format_plugin_list().count("'lru' is registered twice") == 1


def test_an_unknown_name_a_disabled_plugin_provides_says_so():
    register_plugin(Clashing())
    with pytest.warns(PluginLoadWarning):
        plugins = registry()
    with pytest.raises(UnknownPluginError) as caught:
        plugins.get("cache_policy", "audit-other", key="offload.cache_policy.name")
    message = str(caught.value)
    assert message.startswith("offload.cache_policy.name: unknown cache_policy 'audit-other'; ")
    assert "registered at runtime" in message and "provides it but is disabled" in message


def test_an_unknown_name_says_which_entry_points_the_allowlist_left_out(monkeypatch):
    use_entry_points(monkeypatch, FakeEntryPoint("mine", Good()))
    monkeypatch.setenv("SPECTER_PLUGINS", "")
    reset_plugins()
    with pytest.raises(UnknownPluginError) as caught:
        registry().get("cache_policy", "audit-fifo", key="offload.cache_policy.name")
    assert str(caught.value).endswith("; SPECTER_PLUGINS='' left out the entry points mine; add the one providing it")


def test_an_allowlist_naming_a_distribution_names_its_entry_points(monkeypatch):
    use_entry_points(monkeypatch, FakeEntryPoint("mine", Good()))
    monkeypatch.setenv("SPECTER_PLUGINS", "audit-dist")
    reset_plugins()
    with pytest.warns(PluginLoadWarning, match=r"'audit-dist' is a distribution: name its entry points instead \(mine\)"):
        registry()


def test_every_unknown_option_is_named():
    register_plugin(Good())
    with pytest.raises(SpecterError, match=r"^offload.cache_policy.name: unknown options 'spare_hintd', 'colour' "
                                           r"for cache_policy 'audit-fifo'; accepted options: spare_hinted$"):
        registry().create("cache_policy", "audit-fifo", {"spare_hintd": True, "colour": 1},
                          key="offload.cache_policy.name")


def test_check_options_checks_a_recipe_s_options_without_creating_the_plugin():
    made = []

    def fifo(spare_hinted: bool = True, top_k: int = 2) -> Fifo:
        made.append(top_k)
        return Fifo(spare_hinted)

    class Plugins:
        @hookimpl
        def register_predictors(self, register):
            register("audit-pred", fifo)

    register_plugin(Plugins())
    plugins = registry()
    plugins.check_options("predictor", "audit-pred", {"spare_hinted": False}, key="speculation.predictor.name")
    with pytest.raises(SpecterError, match="^speculation.predictor.name: unknown option 'sparehinted'"):
        plugins.check_options("predictor", "audit-pred", {"sparehinted": False}, key="speculation.predictor.name")
    with pytest.raises(SpecterError, match="option 'top_k' of predictor 'audit-pred' is set by the engine"):
        plugins.check_options("predictor", "audit-pred", {"top_k": 1})
    with pytest.raises(SpecterError, match="option 'k' of governor 'fixed' is set by the engine"):
        plugins.check_options("governor", "fixed", {"k": 3})
    with pytest.raises(UnknownPluginError):
        plugins.check_options("governor", "nope", {})
    assert made == []


def test_list_plugins_shows_the_options_each_plugin_takes():
    def anything(**options):
        return options

    anything.accepts_any_options = True

    class Plugins:
        @hookimpl
        def register_cache_policies(self, register):
            register("audit-fifo", Fifo)
            register("audit-any", anything)

    register_plugin(Plugins())
    lines = format_plugin_list().splitlines()
    after = {line.split()[0]: lines[index + 1].strip() for index, line in enumerate(lines[:-1])
             if line.startswith("  ") and not line.startswith("   ")}
    assert after["audit-fifo"] == "options: spare_hinted=True"
    assert after["audit-any"] == "options: any"
    assert after["lfu"] == "options: history=False"
    assert after["roofline"].startswith("options: k_max=None,")  # k, n_experts, top_k: context, not options
    assert not after["lru"].startswith("options")
    assert not after["ondemand"].startswith("options")  # engines take none; recipe and parts are context


class Nameless(Governor):
    def __init__(self, k: int = 2) -> None:
        self.k = k

    def next_k(self) -> int:
        return self.k

    def observe(self, drafted, accepted, **timings) -> None:
        pass


class NamelessLink(Link):
    def submit(self, dst, src, slot):
        copy_all(dst, src)
        return CompletedTransfer(transfer_nbytes(src))


def test_a_plugin_that_sets_no_name_is_named_as_registered():
    class Plugins:
        @hookimpl
        def register_governors(self, register):
            register("audit-nameless", Nameless)

        @hookimpl
        def register_links(self, register):
            register("audit-link", NamelessLink)

        @hookimpl
        def register_cache_policies(self, register):
            register("audit-alias", Fifo)  # sets its own name: kept

    register_plugin(Plugins())
    governor = registry().create("governor", "audit-nameless", {}, expect=Governor, k=3)
    assert governor.name == "audit-nameless" and governor.summary() == {"name": "audit-nameless"}
    assert Nameless.name == "governor"  # the instance is named, not the class
    link = registry().create("link", "audit-link", {}, expect=Link, device=torch.device("cpu"))
    assert link.kind == "audit-link" and link.describe()["kind"] == "audit-link"
    assert registry().create("cache_policy", "audit-alias", {}, expect=CachePolicy).name == "audit-fifo"


def test_context_keywords_are_what_the_engine_offers_each_kind():
    from specter.build import build_engine
    from specter.config import load_recipe
    from specter.decode.engine import OffloadedEngine
    from specter.predictors import NonePredictor

    offered: dict[str, set[str]] = {}

    def recording(kind: str, make):
        def factory(**context):  # takes **kwargs: offered every context keyword
            offered[kind] = set(context)
            return make(context)

        return factory

    def engine(context):
        parts = context["parts"]
        parts.predictor(), parts.governor()
        return OffloadedEngine(*parts.offloaded)

    class Plugins:
        @hookimpl
        def register_cache_policies(self, register):
            register("rec-policy", recording("cache_policy", lambda context: Fifo()))

        @hookimpl
        def register_links(self, register):
            register("rec-link", recording("link", lambda context: NamelessLink()))

        @hookimpl
        def register_predictors(self, register):
            register("rec-predictor", recording("predictor", lambda context: NonePredictor()))

        @hookimpl
        def register_governors(self, register):
            register("rec-governor", recording("governor", lambda context: Nameless()))

        @hookimpl
        def register_engines(self, register):
            register("rec-engine", recording("engine", engine))

    register_plugin(Plugins())
    recipe = load_recipe({"model": "bundled:tiny-moe", "engine": "rec-engine", "device": "cpu", "threads": 1,
                          "offload": {"expert_budget": 0.5, "link": {"kind": "rec-link"},
                                      "cache_policy": {"name": "rec-policy"}},
                          "speculation": {"predictor": {"name": "rec-predictor"}, "governor": {"name": "rec-governor"}}})
    build_engine(recipe).close()
    assert offered == {kind: set(keywords) for kind, keywords in CONTEXT_KEYWORDS.items()}
