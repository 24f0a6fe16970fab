"""The plugin registry: built-ins, runtime plugins, entry points and the SPECTER_PLUGINS
allowlist, broken plugins, duplicates, unknown names and plugin creation."""

from __future__ import annotations

import re

import importlib.metadata
import sys
import types

import pytest

from specter import plugins
from specter.errors import SpecterError, UnknownPluginError
from specter.decode.governors import FixedGovernor
from specter.hookspecs import hookimpl
from specter.plugins import (
    PluginLoadWarning,
    format_plugin_list,
    get_plugin_manager,
    register_plugin,
    registry,
    reset_plugins,
)
from specter.predictors import NonePredictor
from specter.config import load_recipe


class FakeEntryPoint:
    """Quacks like importlib.metadata.EntryPoint."""

    def __init__(self, name: str, load, dist_name: str | None = "specter-fake-dist") -> None:
        self.name = name
        self.value = f"fake_module_{name}:plugin"
        self.group = "specter"
        self.dist = types.SimpleNamespace(name=dist_name) if dist_name else None
        self._load = load

    def load(self):
        return self._load()


def plugin_module(name: str, policy_name: str) -> types.ModuleType:
    module = types.ModuleType(name)

    @hookimpl
    def register_cache_policies(register):
        register(policy_name, lambda: "policy")

    module.register_cache_policies = register_cache_policies
    return module


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    """A fresh manager per test, with no installed entry points unless a test provides some."""
    monkeypatch.delenv("SPECTER_PLUGINS", raising=False)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kwargs: [])
    reset_plugins()
    yield
    reset_plugins()


def use_entry_points(monkeypatch, *entry_points) -> None:
    def fake_entry_points(**kwargs):
        assert kwargs == {"group": "specter"}
        return list(entry_points)

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    reset_plugins()


class MyPolicies:
    @hookimpl
    def register_cache_policies(self, register):
        register("my-policy", MyPolicy)


class MyPolicy:
    def __init__(self, capacity: int = 8) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity


def test_builtins_are_registered_through_the_hooks():
    plugins_now = registry()
    assert "fixed" in plugins_now.names("governor")
    assert "none" in plugins_now.names("predictor")
    assert plugins_now.get("governor", "fixed") is FixedGovernor
    assert plugins_now.get("predictor", "none") is NonePredictor
    assert plugins_now.source("governor", "fixed") == "builtin (specter.decode.governors)"
    assert set(plugins.KINDS) == {"cache_policy", "link", "predictor", "governor", "engine"}
    assert {"resident", "ondemand", "router-lookahead", "specter", "hf-offload"} <= set(plugins_now.names("engine"))


def test_manager_is_built_once_until_reset():
    manager = get_plugin_manager()
    assert get_plugin_manager() is manager
    assert registry() is registry()
    reset_plugins()
    assert get_plugin_manager() is not manager


def test_missing_builtin_module_is_skipped_but_a_broken_one_raises(monkeypatch, tmp_path):
    monkeypatch.setattr(plugins, "BUILTIN_PLUGIN_MODULES", plugins.BUILTIN_PLUGIN_MODULES + ("specter.not_written_yet",))
    assert "fixed" in registry().names("governor")

    (tmp_path / "specter_test_broken_builtin.py").write_text("import specter_test_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins, "BUILTIN_PLUGIN_MODULES", ("specter_test_broken_builtin",))
    reset_plugins()
    with pytest.raises(ModuleNotFoundError, match="specter_test_no_such_dependency"):
        registry()
    sys.modules.pop("specter_test_broken_builtin", None)


def test_runtime_plugin_is_listed_and_usable_in_a_recipe():
    register_plugin(MyPolicies())
    assert "my-policy" in registry().names("cache_policy")
    assert "registered at runtime" in registry().source("cache_policy", "my-policy")
    offload = {"cache_policy": {"name": "my-policy"}, "link": {"kind": "auto"}}
    recipe = load_recipe({"engine": "ondemand", "offload": offload})
    assert recipe.offload.cache_policy.name == "my-policy"
    assert "my-policy" in format_plugin_list()


def test_reset_forgets_runtime_plugins():
    register_plugin(MyPolicies())
    reset_plugins()
    assert "my-policy" not in registry().names("cache_policy")


def test_entry_point_plugin_loads_by_default(monkeypatch):
    use_entry_points(monkeypatch, FakeEntryPoint("thatname", lambda: plugin_module("ep_mod", "ep-policy")))
    assert "ep-policy" in registry().names("cache_policy")
    assert registry().source("cache_policy", "ep-policy") == "specter-fake-dist (entry point thatname)"
    assert "ep-policy  specter-fake-dist (entry point thatname)" in format_plugin_list()


def test_allowlist_env_selects_entry_points(monkeypatch):
    entry_points = (
        FakeEntryPoint("thatname", lambda: plugin_module("ep_a", "ep-a")),
        FakeEntryPoint("other", lambda: plugin_module("ep_b", "ep-b")),
    )
    use_entry_points(monkeypatch, *entry_points)
    monkeypatch.setenv("SPECTER_PLUGINS", "")
    reset_plugins()
    names = registry().names("cache_policy")
    assert "ep-a" not in names and "ep-b" not in names
    assert "fixed" in registry().names("governor")  # built-ins are never filtered

    monkeypatch.setenv("SPECTER_PLUGINS", "thatname")
    reset_plugins()
    names = registry().names("cache_policy")
    assert "ep-a" in names and "ep-b" not in names

    monkeypatch.setenv("SPECTER_PLUGINS", " thatname , other ")
    reset_plugins()
    assert {"ep-a", "ep-b"} <= set(registry().names("cache_policy"))


def test_allowlist_naming_a_missing_entry_point_warns(monkeypatch):
    use_entry_points(monkeypatch, FakeEntryPoint("thatname", lambda: plugin_module("ep_a", "ep-a")))
    monkeypatch.setenv("SPECTER_PLUGINS", "thatname,ghost")
    reset_plugins()
    with pytest.warns(PluginLoadWarning, match="'ghost'"):
        names = registry().names("cache_policy")
    assert "ep-a" in names


def test_broken_entry_point_warns_and_is_skipped(monkeypatch):
    def broken():
        raise ImportError("no module named 'missing_dependency'\nsecond line")

    use_entry_points(
        monkeypatch,
        FakeEntryPoint("broken", broken),
        FakeEntryPoint("good", lambda: plugin_module("ep_good", "good-policy")),
    )
    with pytest.warns(PluginLoadWarning) as caught:
        names = registry().names("cache_policy")
    assert "good-policy" in names
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "\n" not in messages[0]
    assert "broken" in messages[0] and "ImportError" in messages[0]
    assert "skipped:" in format_plugin_list()


def test_entry_point_whose_hook_raises_warns_and_is_skipped(monkeypatch):
    module = types.ModuleType("ep_raising")

    @hookimpl
    def register_governors(register):
        register("half-done", FixedGovernor)
        raise RuntimeError("boom")

    module.register_governors = register_governors
    use_entry_points(monkeypatch, FakeEntryPoint("raising", lambda: module))
    with pytest.warns(PluginLoadWarning, match="RuntimeError: boom"):
        names = registry().names("governor")
    assert "half-done" not in names and "fixed" in names


def test_entry_point_with_a_misspelled_hook_argument_is_skipped(monkeypatch):
    module = types.ModuleType("ep_bad_signature")

    @hookimpl
    def register_governors(registrar):
        registrar("never", FixedGovernor)

    module.register_governors = register_governors
    use_entry_points(monkeypatch, FakeEntryPoint("badsig", lambda: module))
    with pytest.warns(PluginLoadWarning, match="badsig"):
        assert "never" not in registry().names("governor")


def test_a_plugin_clashing_with_a_builtin_is_disabled_naming_both_sources():
    class Shadow:
        @hookimpl
        def register_governors(self, register):
            register("fixed", lambda k: None)

        @hookimpl
        def register_cache_policies(self, register):
            register("shadow-policy", MyPolicy)

    register_plugin(Shadow())
    expected = r"governor 'fixed' is registered twice, by builtin \(specter.decode.governors\) and by registered at runtime"
    with pytest.warns(PluginLoadWarning, match=expected):
        plugins_now = registry()
    assert plugins_now.get("governor", "fixed") is FixedGovernor
    assert "shadow-policy" not in plugins_now.names("cache_policy")  # the whole plugin is off
    listing = format_plugin_list()
    assert "skipped:" in listing and "disabled plugin registered at runtime" in listing
    assert "  fixed " in listing


def test_identical_re_registration_is_ignored():
    class Again:
        @hookimpl
        def register_governors(self, register):
            register("fixed", FixedGovernor)

    register_plugin(Again())
    assert registry().get("governor", "fixed") is FixedGovernor


def test_invalid_plugin_names_are_rejected():
    class BadName:
        @hookimpl
        def register_governors(self, register):
            register("Has Spaces", FixedGovernor)

    register_plugin(BadName())
    with pytest.warns(PluginLoadWarning, match="named 'Has Spaces'"):
        assert "Has Spaces" not in registry().names("governor")


def test_unknown_names_list_the_known_ones():
    register_plugin(MyPolicies())
    with pytest.raises(UnknownPluginError) as caught:
        registry().get("cache_policy", "nope", key="offload.cache_policy.name")
    message = str(caught.value)
    assert message.startswith("offload.cache_policy.name: unknown cache_policy 'nope'; known: ")
    assert "my-policy" in message
    assert caught.value.known == registry().names("cache_policy")
    with pytest.raises(ValueError, match="unknown plugin kind"):
        registry().names("policy")


def test_create_passes_options_and_offered_context():
    register_plugin(MyPolicies())
    policy = registry().create("cache_policy", "my-policy", {"capacity": 3}, key="offload.cache_policy",
                               n_layers=4, device="cpu")
    assert isinstance(policy, MyPolicy) and policy.capacity == 3
    governor = registry().create("governor", "fixed", {}, key="speculation.governor", k=6, n_layers=4)
    assert governor.next_k() == 6
    assert isinstance(registry().create("predictor", "none", None, n_layers=4, draft=object()), NonePredictor)


def test_create_turns_bad_options_into_errors_naming_the_key():
    register_plugin(MyPolicies())
    with pytest.raises(SpecterError, match=r"^offload\.cache_policy: unknown option 'capacty' .*accepted options: capacity"):
        registry().create("cache_policy", "my-policy", {"capacty": 3}, key="offload.cache_policy")
    with pytest.raises(SpecterError, match=r"^offload\.cache_policy: cache_policy 'my-policy' rejected its options"):
        registry().create("cache_policy", "my-policy", {"capacity": 0}, key="offload.cache_policy")
    with pytest.raises(SpecterError, match=r"^speculation\.governor: option 'k' .* is set by the engine"):
        registry().create("governor", "fixed", {"k": 3}, key="speculation.governor", k=4)
    with pytest.raises(SpecterError, match=r"^speculation\.governor: governor 'fixed' rejected its options: k must be"):
        registry().create("governor", "fixed", {}, key="speculation.governor", k=99)


def test_kwargs_factories_still_report_unknown_options_unless_they_opt_out():
    def strict(**options):
        return options

    def anything(**options):
        return options

    anything.accepts_any_options = True

    class Loose:
        @hookimpl
        def register_cache_policies(self, register):
            register("strict", strict)
            register("anything", anything)

    register_plugin(Loose())
    with pytest.raises(SpecterError, match="unknown option 'histroy' for cache_policy 'strict'"):
        registry().create("cache_policy", "strict", {"histroy": True})
    assert registry().create("cache_policy", "anything", {"histroy": True}) == {"histroy": True}


def test_a_factory_that_raises_or_returns_the_wrong_type_is_one_line_naming_the_plugin():
    from specter.policies.base import CachePolicy

    def explodes():
        raise RuntimeError("boom\nsecond line")

    class Broken:
        @hookimpl
        def register_cache_policies(self, register):
            register("explodes", explodes)
            register("not-a-policy", lambda: object())

    register_plugin(Broken())
    with pytest.raises(SpecterError, match=r"^offload\.cache_policy\.name: cache_policy plugin 'explodes' .*RuntimeError: boom second line$"):
        registry().create("cache_policy", "explodes", key="offload.cache_policy.name")
    with pytest.raises(SpecterError, match="returned a object, which is not a specter.policies.base.CachePolicy"):
        registry().create("cache_policy", "not-a-policy", expect=CachePolicy)


def test_format_plugin_list_shows_kinds_names_and_sources(monkeypatch):
    monkeypatch.setenv("SPECTER_PLUGINS", "")
    reset_plugins()
    text = format_plugin_list()
    assert text.splitlines()[0].endswith(": none")
    for kind in plugins.KINDS:
        assert f"\n{kind}:\n" in text
    assert re.search(r"\n  fixed +builtin \(specter\.decode\.governors\)", text)
    assert re.search(r"\n  none +builtin \(specter\.predictors\)", text)
