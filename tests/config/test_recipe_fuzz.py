"""Fuzzing the recipe loader: any input gives a Recipe or a one-line SpecterError starting with a key path."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specter.config import Recipe, load_recipe, recipe_keys
from specter.config.loading import yaml_value
from specter.config.schema import display_key
from specter.errors import SpecterError

TOP_KEYS = [key.split(".")[0] for key in recipe_keys()]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["2GiB", "0.5", "1.5GB", "-3MiB", "yes", "bundled:tiny-moe", "bundled:", "cuda:1",
                     "specter", "ondemand", "lru", "fixed", "none", "emulated", "auto", ".", "/", "~"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.one_of(st.text(max_size=8), st.sampled_from(["per_layer", "experts", "name", "k"])),
                      children, max_size=3),
    max_leaves=6,
)
SCHEMA_NAMES = sorted({part for key in recipe_keys() for part in key.split(".")})
KEYS = st.one_of(st.sampled_from(SCHEMA_NAMES), st.text(max_size=10), st.integers(), st.none(), st.booleans())
RANDOM_TREES = st.recursive(
    VALUES,
    lambda children: st.dictionaries(KEYS, children, max_size=4),
    max_leaves=12,
)
VALID = {
    "engine": "ondemand",
    "prompts": ["a", "b"],
    "offload": {"expert_budget": 0.25, "link": {"kind": "emulated", "gbps": 1.0}, "cache_policy": {"name": "lru"}},
    "speculation": {"governor": {"name": "fixed", "k": 4}},
}
BUDGET_STRINGS = st.from_regex(r"\A[ -]?[0-9]{0,4}(\.[0-9]{0,3})?[ ]?([kKmMgGtT]?i?[bB])?\Z")
MUTANT_VALUES = st.one_of(
    VALUES,
    BUDGET_STRINGS,
    st.integers(min_value=-5, max_value=40),
    st.floats(min_value=-2, max_value=2),
)
FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def candidate_starts(raw: object, overrides: list) -> tuple[str, ...]:
    names = set(TOP_KEYS) | {"recipe"}
    if isinstance(raw, dict):
        names |= {display_key(key) for key in raw}
    for item in overrides:
        names.add(display_key(item))
        if isinstance(item, str) and "=" in item:
            dotted = item.split("=", 1)[0].strip()
            names |= {display_key(dotted), display_key(dotted.split(".")[0])}
    return tuple(f"{name}: " for name in names) + tuple(f"{name}." for name in names)


def check_outcome(raw: object, overrides: list = ()) -> None:
    overrides = list(overrides)
    try:
        recipe = load_recipe(raw, overrides)
    except SpecterError as error:
        message = str(error)
        assert len(message.splitlines()) == 1
        assert message.startswith(candidate_starts(raw, overrides)), message
        return
    assert isinstance(recipe, Recipe)
    assert load_recipe(recipe.to_dict(), check_plugins=False) == recipe


@FUZZ
@given(RANDOM_TREES)
def test_fuzz_random_trees(raw):
    check_outcome(raw)


def set_path(tree: dict, dotted: str, value: object) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = tree.get(part)
        tree[part] = child = dict(child) if isinstance(child, dict) else {}
        tree = child
    tree[leaf] = value


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(recipe_keys()), MUTANT_VALUES), min_size=1, max_size=3))
def test_fuzz_mutations_of_a_valid_recipe(mutations):
    raw = copy.deepcopy(VALID)
    for key, value in mutations:
        set_path(raw, key, value)
    check_outcome(raw)


@FUZZ
@given(
    st.lists(
        st.one_of(
            st.builds(lambda key, text: f"{key}={text}", st.sampled_from(recipe_keys()), st.text(max_size=12)),
            st.builds(lambda key, text: f"{key}={text}", st.sampled_from(recipe_keys()), BUDGET_STRINGS),
            st.text(max_size=16),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_fuzz_overrides(overrides):
    check_outcome(copy.deepcopy(VALID), overrides)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.text(max_size=80), RANDOM_TREES.map(lambda tree: yaml.safe_dump(tree, allow_unicode=True))))
def test_fuzz_yaml_text(fuzz_dir, text):
    path = fuzz_dir / "fuzz.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        raw = yaml_value(text)  # what load_recipe reads the file with
    except yaml.YAMLError:
        raw = None
    try:
        recipe = load_recipe(path)
    except SpecterError as error:
        message = str(error)
        assert len(message.splitlines()) == 1
        assert message.startswith(candidate_starts(raw, [])), message
        return
    assert isinstance(recipe, Recipe)


def test_the_fuzz_oracles_accept_valid_recipes_and_name_bad_keys():
    """The fuzz tests accept either outcome; here both are pinned: the valid recipe and valid
    overrides of it load with their values, and a bad value is refused naming its key."""
    recipe = load_recipe(copy.deepcopy(VALID))
    budget = recipe.offload.expert_budget
    assert (recipe.engine, budget.kind, budget.value) == ("ondemand", "fraction", 0.25)
    assert recipe.speculation.governor.k == 4
    changed = load_recipe(copy.deepcopy(VALID), ["offload.expert_budget=0.5", "speculation.governor.k=8"])
    assert (changed.offload.expert_budget.value, changed.speculation.governor.k) == (0.5, 8)
    with pytest.raises(SpecterError) as refused:
        load_recipe(copy.deepcopy(VALID), ["offload.expert_budget=-3"])
    assert str(refused.value).startswith("offload.expert_budget"), str(refused.value)
    check_outcome(copy.deepcopy(VALID), ["offload.expert_budget=-3"])
