"""``specter.config.loading``: what ``load_recipe`` accepts as a source (a file, a mapping, a
``Recipe``) and where each looks up relative paths, how ``dotted.key=value`` overrides merge into
the recipe (in order, into sections, free-form under ``options``, never into the caller's mapping),
its one-line source errors, and the shape of ``describe``. Schema rules, the YAML parsing of
override values and plugin-name checks are in test_recipe.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from specter.config import Recipe, describe, load_recipe, recipe_keys
from specter.config.schema import MAX_DEPTH
from specter.errors import SpecterError

TOP_LEVEL_KEYS = ("model, engine, device, dtype, threads, seed, prompt, prompts, prompts_file, max_prompts, "
                  "max_new_tokens, sampling, offload, speculation, compile, huge_pages, allow_pickle, "
                  "trust_remote_code, check_lossless")
OVERRIDE_FORM = ("an override must look like dotted.key=value (for example offload.expert_budget=0.25); "
                 "allowed keys: python -m specter.run --explain")


def error_of(source: object, overrides: object = (), **kwargs: object) -> str:
    """The one-line message ``load_recipe`` refuses ``source`` with."""
    with pytest.raises(SpecterError) as caught:
        load_recipe(source, overrides, **kwargs)  # type: ignore[arg-type]
    message = str(caught.value)
    assert len(message.splitlines()) == 1, message
    return message


# ----------------------------------------------------------------------------- sources


def test_a_file_source_looks_up_relative_paths_in_its_resolved_directory(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "p.txt").write_text("from the recipe directory\n")
    (tmp_path / "r.yaml").write_text("prompts_file: p.txt\n")
    monkeypatch.chdir(tmp_path)
    by_name = load_recipe("r.yaml")
    assert by_name.source_dir == tmp_path.resolve()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    by_path = load_recipe(tmp_path / "r.yaml")
    assert by_path.source_dir == tmp_path.resolve()
    assert by_path.resolved_prompts() == ["from the recipe directory\n"]


def test_a_mapping_source_looks_up_relative_paths_in_source_dir(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "p.txt").write_text("one prompt")
    monkeypatch.chdir(tmp_path.parent)
    recipe = load_recipe({"prompts_file": "p.txt"}, source_dir=str(tmp_path))
    assert recipe.source_dir == tmp_path and isinstance(recipe.source_dir, Path)
    assert recipe.resolved_prompts() == ["one prompt"]
    assert error_of({"prompts_file": "p.txt"}) == (
        "prompts_file: no such file: p.txt (looked in the current directory); "
        "allowed: a path to a .jsonl file or a text file")
    assert load_recipe({}).source_dir is None


def test_a_recipe_source_keeps_its_directory_over_source_dir_and_is_revalidated(tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_text("x")
    (tmp_path / "r.yaml").write_text("prompts_file: p.txt\nengine: ondemand\n")
    recipe = load_recipe(tmp_path / "r.yaml")
    again = load_recipe(recipe, ["max_new_tokens=5"], source_dir=tmp_path / "ignored")
    assert again.source_dir == tmp_path.resolve()
    assert (again.engine, again.max_new_tokens, again.prompts_file) == ("ondemand", 5, "p.txt")
    assert recipe.max_new_tokens == 64  # the source is left as it was
    assert error_of(recipe, ["threads=0"]).startswith("threads: ")


def test_overrides_never_change_the_callers_mapping() -> None:
    raw = {"engine": "ondemand", "offload": {"link": {"kind": "local", "gbps": 1.0}, "cache_policy": {"options": {}}}}
    before = copy.deepcopy(raw)
    recipe = load_recipe(raw, ["offload.link.gbps=4", "offload.cache_policy.options.decay=0.5", "engine=resident"],
                         check_plugins=False)
    assert (recipe.offload.link.gbps, recipe.engine) == (4.0, "resident")
    assert raw == before


def test_a_source_of_another_type_is_refused() -> None:
    assert error_of(3) == "recipe: expected a path or a mapping, got int; allowed: a YAML file path"
    assert error_of(None) == "recipe: expected a path or a mapping, got null; allowed: a YAML file path"
    assert error_of(["engine: ondemand"]) == "recipe: expected a path or a mapping, got list; allowed: a YAML file path"


def test_a_top_level_that_is_not_a_mapping_lists_the_allowed_keys(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("hello\n")
    assert error_of(path) == (
        f"recipe: the top level must be a mapping of keys to values, got str 'hello'; allowed keys: {TOP_LEVEL_KEYS}")


def test_file_source_errors_name_the_path(tmp_path: Path) -> None:
    assert error_of(tmp_path) == f"recipe: {tmp_path} is a directory; allowed: a path to a YAML recipe"
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"engine: caf\xe9\n")
    assert error_of(latin1) == f"recipe: {latin1} is not UTF-8 text; allowed: a YAML recipe"
    missing = tmp_path / "missing.yaml"
    assert error_of(str(missing)) == f"recipe: no such file: {missing}; allowed: a path to a YAML recipe"


def test_data_nested_too_deep_is_refused_before_validation() -> None:
    deep: list = []
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    message = error_of({"offload": {"link": {"options": {"x": deep}}}}, check_plugins=False)
    assert message == f"recipe: nested deeper than {MAX_DEPTH} levels; allowed: plain data of bounded size"


# ----------------------------------------------------------------------------- overrides


def test_overrides_apply_in_order_and_a_single_string_is_one_override() -> None:
    assert load_recipe({}, ["engine=ondemand", "engine=specter"]).engine == "specter"
    assert load_recipe({}, "engine=ondemand").engine == "ondemand"
    assert load_recipe({}, ("max_new_tokens=3",)).max_new_tokens == 3


def test_an_override_splits_at_the_first_equals_sign_and_strips_the_key() -> None:
    assert load_recipe({}, ["prompt=a=b"]).prompt == "a=b"
    assert load_recipe({}, ["  engine  = ondemand"]).engine == "ondemand"


def test_an_override_merges_into_a_section_keeping_its_other_keys() -> None:
    recipe = load_recipe({"offload": {"link": {"kind": "local", "gbps": 1.0, "latency_us": 5.0}}},
                         ["offload.link.gbps=4"])
    assert (recipe.offload.link.kind, recipe.offload.link.gbps, recipe.offload.link.latency_us) == ("local", 4.0, 5.0)
    whole = load_recipe({}, ["offload={prefetch: lazy}", "offload.pin_memory=false"])
    assert (whole.offload.prefetch, whole.offload.pin_memory) == ("lazy", False)


def test_an_override_merges_into_a_section_object_held_by_the_mapping() -> None:
    recipe = load_recipe({"offload": Recipe().offload}, ["offload.prefetch=lazy"])
    assert recipe.offload.prefetch == "lazy" and recipe.offload.link.gbps == Recipe().offload.link.gbps


def test_keys_under_options_are_free_form_at_any_depth() -> None:
    recipe = load_recipe({"offload": {"link": {"options": {"a": {"keep": 1}}}}},
                         ["offload.link.options.a.b=2", "offload.link.options.new=[1, 2]"], check_plugins=False)
    assert recipe.offload.link.options == {"a": {"keep": 1, "b": 2}, "new": [1, 2]}


@pytest.mark.parametrize("override, message", [
    ("engine", f"engine: {OVERRIDE_FORM}"),
    (3, f"3: {OVERRIDE_FORM}"),
    ("=3", f"'': unknown key (in override '=3'); allowed keys: {TOP_LEVEL_KEYS}"),
    ("prompts.x=1", "prompts: takes a single value, not sub-keys (in override 'prompts.x=1'); allowed: prompts=VALUE"),
])
def test_malformed_overrides_are_refused_naming_the_key(override: object, message: str) -> None:
    assert error_of({}, [override]) == message


def test_an_override_below_a_value_that_is_not_a_mapping_is_refused() -> None:
    assert error_of({"offload": 3}, ["offload.prefetch=auto"]) == (
        "offload: expected a mapping, got int 3 (in override 'offload.prefetch=auto'); allowed: a mapping")
    assert error_of({"offload": {"link": {"options": {"a": "x"}}}}, ["offload.link.options.a.b=1"]) == (
        "offload.link.options.a: expected a mapping, got str 'x' (in override 'offload.link.options.a.b=1'); "
        "allowed: a mapping")


def test_an_unknown_nested_key_lists_the_keys_of_its_section() -> None:
    message = error_of({}, ["speculation.governor.kk=3"])
    assert message.startswith("speculation.governor.kk: unknown key (in override 'speculation.governor.kk=3'); "
                              "did you mean speculation.governor.k? allowed keys under speculation.governor: ")
    assert message.endswith(": name, k, options")


# ----------------------------------------------------------------------------- introspection


def test_describe_gives_every_key_two_lines_in_schema_order() -> None:
    lines = describe().splitlines()
    keys = recipe_keys()
    assert len(lines) == 2 * len(keys)
    assert [line.split(": ", 1)[0] for line in lines[::2]] == keys
    for doc in lines[1::2]:
        assert doc.startswith("    ") and ". Allowed: " in doc and doc.endswith(".")
    threads = lines.index("threads: int = 1")
    assert lines[threads + 1] == "    torch.set_num_threads for the run. Allowed: an integer in [1, 1024]."
    assert "offload.link.options: dict = {}" in lines
    assert 'prompt: str | None = null' in lines


def test_recipe_keys_are_the_leaves_only() -> None:
    keys = recipe_keys()
    assert len(keys) == len(set(keys))
    assert not {"sampling", "offload", "offload.link", "speculation", "speculation.draft", "source_dir"} & set(keys)
    assert keys[:3] == ["model", "engine", "device"] and keys[-1] == "check_lossless"



def test_shared_yaml_values_count_where_they_appear(tmp_path: Path) -> None:
    """An alias of an alias (a "billion laughs" recipe) is refused by the size it has written out,
    not by its few distinct nodes; a recipe sharing a small value twice still loads."""
    levels = ['a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    levels += [f"{b}: &{b} [{', '.join(['*' + a] * 9)}]" for a, b in zip("abcdef", "bcdefg")]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("speculation:\n  governor:\n    options:\n" + "".join(f"      {line}\n" for line in levels))
    with pytest.raises(SpecterError, match=r"^recipe: holds more than 100,000 values \(a shared value"):
        load_recipe(bomb)
    shared = tmp_path / "shared.yaml"
    shared.write_text("speculation:\n  governor:\n    options:\n      a: &a [1, 2]\n      b: *a\n")
    assert load_recipe(shared, check_plugins=False).speculation.governor.options == {"a": [1, 2], "b": [1, 2]}


def test_an_override_is_held_to_the_same_bounds_as_the_recipe() -> None:
    deep = "[" * 40 + "]" * 40
    with pytest.raises(SpecterError, match=r"^recipe: nested deeper than 32 levels"):
        load_recipe({}, [f"speculation.governor.options={{x: {deep}}}"])
    assert load_recipe({}, ["speculation.governor.options={x: [[1]]}"],
                       check_plugins=False).speculation.governor.options == {"x": [[1]]}


@pytest.mark.parametrize("text, key, first_line, line", [
    ("offload:\n  expert_budget: 0.25\nmax_new_tokens: 4\noffload:\n  link: {kind: local}\n", "offload", 1, 4),
    ("max_new_tokens: 4\nmax_new_tokens: 8\n", "max_new_tokens", 1, 2),
    ("offload: {expert_budget: 0.25, expert_budget: 0.5}\n", "expert_budget", 1, 1),
])
def test_a_key_given_twice_in_a_file_is_refused_naming_both_lines(tmp_path: Path, text, key, first_line, line) -> None:
    recipe = tmp_path / "twice.yaml"
    recipe.write_text(text)  # YAML itself keeps the last value silently
    message = error_of(recipe)
    assert message.startswith(f"recipe: {recipe}:{line}:")
    assert f"'{key}' is given twice in one mapping (first on line {first_line}); keep one" in message


def test_a_merged_mapping_may_override_the_keys_it_merges(tmp_path: Path) -> None:
    from specter.config.loading import _read_yaml

    recipe = tmp_path / "merged.yaml"
    recipe.write_text("base: &base {expert_budget: 0.25, experts_on: host}\noffload:\n  <<: *base\n  expert_budget: 0.5\n")
    assert _read_yaml(recipe)["offload"] == {"expert_budget": 0.5, "experts_on": "host"}


@pytest.mark.parametrize("text, expected", [
    ("# a comment-looking prompt", "# a comment-looking prompt"),  # YAML alone would read None
    ("  #x", "  #x"),
    ("", None),
    ("null", None),
    ("~", None),
])
def test_an_override_value_yaml_reads_as_a_comment_alone_stays_text(text, expected) -> None:
    assert load_recipe({}, [f"prompt={text}"]).prompt == expected


@pytest.mark.parametrize("written, expected", [("1e-1", 0.1), ("2.5e-1", 0.25), ("-1E2", -100.0), (".5e0", 0.5),
                                               ("1.0e-1", 0.1), ("0.25", 0.25), ("7", 7), ("1e", "1e"),
                                               ("2MiB", "2MiB"), ("'1e-1'", "1e-1")])
def test_yaml_reads_an_exponent_without_a_dot_as_a_float(written, expected) -> None:
    from specter.config.loading import yaml_value

    value = yaml_value(written)  # PyYAML alone (YAML 1.1) reads 1e-1 as the string '1e-1'
    assert value == expected and type(value) is type(expected)


def test_a_budget_written_with_an_exponent_loads_from_a_file_and_an_override(tmp_path: Path) -> None:
    recipe = tmp_path / "exp.yaml"
    recipe.write_text("offload:\n  expert_budget: 1e-1\n")
    assert load_recipe(recipe).offload.expert_budget.value == pytest.approx(0.1)
    assert load_recipe({}, ["offload.expert_budget=25e-2"]).offload.expert_budget.value == pytest.approx(0.25)


@pytest.mark.parametrize("override, key, expected", [
    ("prompt=1e5", "prompt", "1e5"),  # YAML alone: the float 100000.0, refused as a prompt
    ("prompt=yes", "prompt", "yes"),
    ("prompt=42", "prompt", "42"),
    ("prompt=[a, b]", "prompt", "[a, b]"),
    ("prompt='quoted'", "prompt", "quoted"),
    ("prompt=null", "prompt", None),
    ("offload.cache_policy.name= 7 ", "offload.cache_policy.name", "7"),
])
def test_an_override_of_a_key_taking_only_text_keeps_the_text_as_typed(override, key, expected) -> None:
    recipe = load_recipe({}, [override], check_plugins=False)
    for part in key.split("."):
        recipe = getattr(recipe, part)
    assert recipe == expected


def test_an_override_of_a_key_taking_numbers_still_reads_yaml() -> None:
    recipe = load_recipe({}, ["seed=7", "sampling.temperature=1e-1", "offload.link.gbps=2"])
    assert (recipe.seed, recipe.sampling.temperature, recipe.offload.link.gbps) == (7, 0.1, 2.0)


@pytest.mark.parametrize("section, message", [
    ({"offload": {"cache_policy": {"name": "lru", "options": {"capacity": 3}}}},
     "offload.cache_policy.name: unknown option 'capacity' for cache_policy 'lru'"),
    ({"offload": {"link": {"kind": "local", "options": {"copy_thread": True, "treads": 2}}}},
     "offload.link.kind: unknown option 'treads' for link 'local'"),
    ({"speculation": {"governor": {"name": "roofline", "options": {"k_mx": 8, "alpha": 1}}}},
     "speculation.governor.name: unknown options 'k_mx', 'alpha' for governor 'roofline'"),
])
def test_a_plugin_option_its_factory_would_refuse_is_refused_when_the_recipe_loads(section, message) -> None:
    """Before the model loads (a widened model takes a minute), not when the engine creates the plugin."""
    assert error_of({"engine": "specter", **section}).startswith(message)


def test_the_options_the_engine_passes_a_link_itself_are_not_refused() -> None:
    recipe = load_recipe({"offload": {"link": {"kind": "emulated", "gbps": 2.0, "latency_us": 5}}})
    assert recipe.offload.link.gbps == 2.0
