"""specter.config.unused: the keys ``--set`` overrides set that the chosen built-in engine never
reads, with the reason; ``python -m specter.run`` warns about each on stderr (a recipe file's own
keys are not judged: one file often serves several engines)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specter.config import load_recipe
from specter.config.unused import override_keys, unused_settings

REPO = Path(__file__).resolve().parents[2]


def test_override_keys_are_the_keys_set_and_a_mappings_leaves() -> None:
    assert override_keys(["speculation.governor.k=3", " max_new_tokens = 4", "offload.link={kind: local, gbps: 1}",
                          "offload.cache_policy.options={a: 1}", "sampling={}", "prompt=[broken"]) == {
        "speculation.governor.k", "max_new_tokens", "offload.link.kind", "offload.link.gbps",
        "offload.cache_policy.options", "sampling", "prompt"}


@pytest.mark.parametrize("engine, keys, unused", [
    ("resident", ["offload.expert_budget", "speculation.governor.k", "max_new_tokens", "compile"],
     ["offload.expert_budget", "speculation.governor.k"]),
    ("ondemand", ["offload.expert_budget", "speculation.draft.group_size"], ["speculation.draft.group_size"]),
    ("router-lookahead", ["speculation.predictor.name", "offload.prefetch"], ["speculation.predictor.name"]),
    ("specter", ["offload.expert_budget", "speculation.governor.k", "offload.link.gbps"], []),
    ("hf-offload", ["offload.expert_budget", "offload.experts_on", "offload.direct_io", "offload.link.kind",
                    "offload.cache_policy.name", "speculation.governor.k"],
     ["offload.cache_policy.name", "offload.direct_io", "offload.link.kind", "speculation.governor.k"]),
])
def test_each_built_in_engine_flags_only_what_it_never_reads(engine, keys, unused) -> None:
    recipe = load_recipe({"engine": engine})
    found = unused_settings(recipe, keys)
    assert [key for key, _ in found] == unused
    assert all(reason for _, reason in found)


def test_pacing_keys_count_only_for_the_emulated_link() -> None:
    keys = ["offload.link.gbps", "offload.link.latency_us"]
    for kind, flagged in (("local", keys), ("emulated", []), ("auto", [])):
        recipe = load_recipe({"engine": "ondemand", "offload": {"link": {"kind": kind}}})
        assert [key for key, _ in unused_settings(recipe, keys)] == flagged, kind


@pytest.mark.parametrize("engine", ["ondemand", "router-lookahead", "specter", "hf-offload"])
def test_direct_io_counts_only_for_experts_on_disk(engine) -> None:
    for experts_on, flagged in (("host", ["offload.direct_io"]), ("disk", [])):
        recipe = load_recipe({"engine": engine, "offload": {"experts_on": experts_on}})
        assert [key for key, _ in unused_settings(recipe, ["offload.direct_io"])] == flagged, experts_on


def test_an_engine_that_is_not_built_in_may_read_any_key() -> None:
    recipe = load_recipe({"engine": "no-such-plugin"}, check_plugins=False)
    assert unused_settings(recipe, ["offload.expert_budget", "speculation.governor.k"]) == []


def test_the_cli_warns_about_each_unused_key_and_still_runs(capsys, monkeypatch) -> None:
    from specter.run import main

    monkeypatch.chdir(REPO)
    assert main(["recipes/quickstart.yaml", "--set", "offload.expert_budget=0.25", "--set", "max_prompts=1",
                 "--set", "max_new_tokens=2", "--quiet"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "warning: offload.expert_budget has no effect: engine resident keeps every expert on the device and "\
           "does not speculate" in err
    assert main(["recipes/offload-ondemand.yaml", "--set", "engine=resident", "--set", "max_prompts=1",
                 "--set", "max_new_tokens=2", "--quiet"]) == 0
    assert "warning" not in capsys.readouterr().err  # the file's offload keys, switched off by engine: no warning
