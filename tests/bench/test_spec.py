"""The bench recipe: sweeps validate with errors naming the key; plain run recipes bench as one cell."""

from __future__ import annotations

import pytest

from specter.bench.spec import DEFAULT_ENGINES, SAME_MEMORY, load_bench
from specter.errors import RecipeError


def bench(**sweep) -> dict:
    return {"title": "t", "run": {"model": "bundled:tiny-moe", "max_new_tokens": 4}, "sweep": sweep}


def test_a_plain_run_recipe_is_one_cell_with_the_default_engines():
    spec = load_bench("recipes/specter.yaml")
    assert spec.engines == DEFAULT_ENGINES
    assert spec.budgets == (0.5,) and list(spec.links) == ["auto"] and spec.compile == (False,)
    assert spec.k == () and spec.governors == ("roofline",)  # the recipe's own governor
    assert load_bench("recipes/specter.yaml", ["speculation.governor.name=fixed"]).k == (4,)
    assert spec.title == "specter"


def test_the_bench_recipes_load_with_two_budgets_two_links_and_both_compile_modes():
    engines = {"resident", "ondemand", SAME_MEMORY, "router-lookahead", "specter"}
    for path in ("recipes/bench-proxy.yaml", "recipes/bench-bundled.yaml"):
        spec = load_bench(path)
        assert len(spec.budgets) == 2 and len(spec.links) == 2 and spec.compile == (False, True)
        assert engines <= set(spec.engines)
    bundled = load_bench("recipes/bench-bundled.yaml")
    assert "hf-offload" in bundled.engines
    gbps = sorted(link["gbps"] for link in bundled.links.values())
    assert gbps[1] == pytest.approx(10 * gbps[0])  # two emulated links, one 10x faster
    proxy = load_bench("recipes/bench-proxy.yaml")  # a plain local link and a slow emulated one
    assert sorted(link["kind"] for link in proxy.links.values()) == ["auto", "local"]


def test_the_disk_bench_recipes_load_with_their_tiers():
    disk = load_bench("recipes/bench-disk.yaml")
    assert disk.recipe.offload.experts_on == "disk" and disk.recipe.offload.host_budget is None
    assert "hf-offload" in disk.engines
    tiers = load_bench("recipes/bench-tiers.yaml")
    assert tiers.recipe.offload.experts_on == "disk" and tiers.recipe.offload.host_budget.value == 0.5
    assert [link["kind"] for link in tiers.links.values()] == ["emulated"]


def test_cell_recipes_carry_the_cells_budget_link_and_mode():
    spec = load_bench(bench(budgets=[0.25], links={"slow": {"kind": "emulated", "gbps": 0.5, "latency_us": 5}}))
    recipe = spec.cell_recipe("specter", 0.25, "slow", True, ["speculation.governor.k=2"])
    assert recipe.engine == "specter" and recipe.compile is True and recipe.check_lossless is False
    assert recipe.offload.expert_budget.value == 0.25
    assert (recipe.offload.link.kind, recipe.offload.link.gbps, recipe.offload.link.latency_us) == ("emulated", 0.5, 5)
    assert recipe.speculation.governor.k == 2


def test_overrides_reach_the_run_recipe_and_the_sweep():
    spec = load_bench(bench(), ["max_new_tokens=7"], {"k": [1, 2], "repeats": 3})
    assert spec.recipe.max_new_tokens == 7 and spec.k == (1, 2) and spec.repeats == 3


@pytest.mark.parametrize("sweep, key", [
    ({"engines": ["ondemand", "warp"]}, "sweep.engines[1]"),
    ({"engines": ["ondemand", SAME_MEMORY]}, "sweep.engines"),
    ({"budgets": [0.5, -1]}, "sweep.budgets[1]"),
    ({"budgets": []}, "sweep.budgets"),
    ({"links": {"x": {"gbps": -2}}}, "sweep.links.x"),
    ({"links": {"x": 3}}, "sweep.links.x"),
    ({"k": [0]}, "sweep.k"),
    ({"compile": ["yes"]}, "sweep.compile"),
    ({"repeats": 0}, "sweep.repeats"),
    ({"warmup_tokens": 0}, "sweep.warmup_tokens"),  # the help says at least 1; 0 warmed up one token anyway
    ({"repeets": 2}, "sweep.repeets"),
    ({"k": [2], "twins": ["specter k=4"]}, "sweep.twins[0]"),
    ({"engines": ["ondemand"], "twins": ["ondemand", "router-lookahead"]}, "sweep.twins[1]"),
    ({"twins": "specter k=4"}, "sweep.twins"),
])
def test_mistakes_name_the_key(sweep, key):
    with pytest.raises(RecipeError) as error:
        load_bench(bench(**sweep))
    assert str(error.value).startswith(key + ":")


def test_a_bench_of_one_new_token_a_prompt_is_refused_before_any_engine_is_built():
    # the first token comes from the prefill: no decode step to time, and the bench failed on a null rate
    with pytest.raises(RecipeError, match=r"^run.max_new_tokens: a bench times decoding, which needs at least 2"):
        load_bench({"title": "t", "run": {"model": "bundled:tiny-moe", "max_new_tokens": 1}, "sweep": {}})
    with pytest.raises(RecipeError, match=r"^max_new_tokens: "):
        load_bench({"model": "bundled:tiny-moe", "max_new_tokens": 1})


def test_without_k_or_governors_the_sweep_takes_the_run_recipes_governor():
    # as a plain run recipe does; before, a roofline governor set in ``run`` (or by --set) became a
    # fixed-k row without a word
    run = {"model": "bundled:tiny-moe", "max_new_tokens": 4, "speculation": {"governor": {"name": "roofline"}}}
    spec = load_bench({"title": "t", "run": run, "sweep": {"engines": ["specter"]}})
    assert spec.k == () and spec.governors == ("roofline",) and spec.row_labels() == ["specter roofline"]
    spec = load_bench(bench(engines=["specter"]), ["speculation.governor.name=roofline"])
    assert spec.row_labels() == ["specter roofline"]
    assert load_bench(bench(engines=["specter"])).row_labels() == ["specter k=4"]  # a fixed governor: its k
    assert load_bench({"title": "t", "run": run, "sweep": {"engines": ["specter"], "k": [2]}}).row_labels() == ["specter k=2"]


def test_unknown_top_level_key_and_bad_run_recipe_are_refused():
    with pytest.raises(RecipeError, match="^extra: unknown key"):
        load_bench({"run": {}, "extra": 1})
    with pytest.raises(RecipeError, match=r"^run\.max_new_tokens: invalid value -1"):
        load_bench({"run": {"max_new_tokens": -1}})


def test_twins_name_rows_of_the_sweep():
    spec = load_bench(bench(engines=["resident", "ondemand", "specter"], k=[2, 4], governors=["roofline"],
                            twins=["specter k=4", "specter roofline", "ondemand"]))
    assert spec.twins == ("specter k=4", "specter roofline", "ondemand")
    assert spec.row_labels() == ["specter k=2", "specter k=4", "specter roofline", "ondemand"]
    assert spec.as_dict()["sweep"]["twins"] == list(spec.twins)
    assert load_bench(bench()).twins == ()


def test_run_section_mistakes_are_named_under_run():
    with pytest.raises(RecipeError, match=r"^run\.max_new_token: unknown key; did you mean max_new_tokens\?"):
        load_bench({"run": {"max_new_token": 4}})
    with pytest.raises(RecipeError, match=r"^run\.offload\.cache_policy\.name: unknown cache_policy 'lru2'"):
        load_bench({"run": {"offload": {"cache_policy": {"name": "lru2"}}}})
    with pytest.raises(RecipeError, match="^max_new_token: unknown key"):  # a plain run recipe has no run section
        load_bench({"max_new_token": 4})


def test_a_yaml_syntax_error_gives_file_line_and_column(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("title: t\nrun:\n  model: [unclosed\n  seed: 0\n")
    with pytest.raises(RecipeError, match=r"^recipe: .*broken\.yaml:4:7: invalid YAML: "):
        load_bench(path)


@pytest.mark.parametrize("sweep, message", [
    ({"links": {"l": {"kind": "pcie"}}}, r"^sweep\.links\.l: offload\.link\.kind: unknown link 'pcie'"),
    ({"governors": ["rooflin"]}, r"^sweep\.governors\[0\]: .*unknown governor 'rooflin'; did you mean roofline\?"),
    ({"governors": ["roofline", "roofline"]}, r"^sweep\.governors\[1\]: 'roofline' repeats sweep\.governors\[0\]"),
    ({"budgets": [0.5, 0.5]}, r"^sweep\.budgets\[1\]: 0\.5 repeats sweep\.budgets\[0\]"),
    ({"budgets": [{"per_layer": 8}, {"per_layer": 8}]}, r"^sweep\.budgets\[1\]: "),
    ({"budgets": ["2MiB", "2097152"]}, r"^sweep\.budgets\[1\]: '2097152' repeats sweep\.budgets\[0\] \('2MiB'\)"),
    ({"k": [2, 2]}, r"^sweep\.k\[1\]: 2 repeats"),
])
def test_plugin_names_and_repeated_values_are_refused_as_the_recipe_loads(sweep, message):
    with pytest.raises(RecipeError, match=message):
        load_bench(bench(**sweep))


def test_a_title_must_name_a_file():
    with pytest.raises(RecipeError, match="^title: 'a/b' cannot name the output files"):
        load_bench({"title": "a/b", "run": {}})
    assert load_bench({"title": "bench proxy v2", "run": {}}).title == "bench proxy v2"
    assert load_bench({"title": 2024, "run": {}}).title == "2024"
