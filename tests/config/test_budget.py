"""ExpertBudget: parsing every recipe form, rejecting bad ones, resolving to a count of experts."""

from __future__ import annotations

import pytest

from specter.config import ExpertBudget, Recipe, load_recipe
from specter.errors import RecipeError, SpecterError


def error_of(raw: dict) -> str:
    with pytest.raises(SpecterError) as caught:
        load_recipe(raw)
    message = str(caught.value)
    assert len(message.splitlines()) == 1
    return message


@pytest.mark.parametrize(
    "value, budget",
    [
        (0.5, ExpertBudget("fraction", 0.5)),
        (1, ExpertBudget("fraction", 1.0)),
        ({"per_layer": 8}, ExpertBudget("per_layer", 8)),
        ({"experts": 40}, ExpertBudget("experts", 40)),
        ("2GiB", ExpertBudget("bytes", 2 * 2**30)),
        ("512MiB", ExpertBudget("bytes", 512 * 2**20)),
        ("1.5GB", ExpertBudget("bytes", 1_500_000_000)),
        ("1000000", ExpertBudget("bytes", 1_000_000)),
        ("4 kb", ExpertBudget("bytes", 4000)),
        ("10B", ExpertBudget("bytes", 10)),
    ],
)
def test_budget_parsing(value, budget):
    assert ExpertBudget.parse(value) == budget
    assert ExpertBudget.parse(budget.to_recipe_value()) == budget


@pytest.mark.parametrize(
    "value",
    [0, -1, -0.5, 1.5, 5, True, None, "", "2XB", "-1GiB", "0GiB", "0.5B", "1.5", "GiB", {"per_layer": 0},
     {"experts": -3}, {"per_layer": 2.5}, {"per_layer": 1, "experts": 1}, {"slots": 4}, [0.5]],
)
def test_bad_budgets_are_recipe_errors(value):
    message = error_of({"offload": {"expert_budget": value}})
    assert message.startswith("offload.expert_budget: ")
    assert "allowed: a fraction in (0, 1]" in message


@pytest.mark.parametrize(
    "budget, expected",
    [
        (ExpertBudget("fraction", 0.5), 16),  # 4 layers x 8 experts = 32
        (ExpertBudget("fraction", 0.3), 9),  # floor(9.6)
        (ExpertBudget("fraction", 1.0), 32),
        (ExpertBudget("fraction", 0.01), 0),  # too small: the caller decides
        (ExpertBudget("per_layer", 3), 12),
        (ExpertBudget("per_layer", 100), 32),  # capped at all experts
        (ExpertBudget("experts", 5), 5),
        (ExpertBudget("bytes", 1000), 3),  # floor(1000 / 300)
        (ExpertBudget("bytes", 299), 0),
        (ExpertBudget("bytes", 10**9), 32),
    ],
)
def test_budget_resolve(budget, expected):
    assert budget.resolve(n_layers=4, n_experts=8, expert_bytes=300) == expected


def test_budget_resolve_fraction_rounding_tolerance():
    assert ExpertBudget("fraction", 0.3).resolve(1, 10, 1) == 3
    assert ExpertBudget("fraction", 0.29).resolve(1, 100, 1) == 29


def test_budget_resolve_rejects_bad_model_sizes():
    with pytest.raises(ValueError):
        ExpertBudget("bytes", 10).resolve(2, 4, 0)
    with pytest.raises(ValueError):
        ExpertBudget("fraction", 0.5).resolve(-1, 4, 10)


def test_budget_constructed_directly_is_validated():
    with pytest.raises(RecipeError, match=r"^offload\.expert_budget: "):
        ExpertBudget("bytes", 0)
    with pytest.raises(RecipeError, match=r"^offload\.expert_budget: unknown budget kind"):
        ExpertBudget("slots", 4)


def test_sections_built_in_python_are_validated():
    recipe = Recipe(engine="ondemand", offload={"expert_budget": 0.25, "link": {"gbps": 1}})
    assert recipe.offload.link.gbps == 1.0 and recipe.offload.expert_budget.value == 0.25
    with pytest.raises(RecipeError, match=r"^offload\.link\.gbps: invalid value"):
        Recipe(offload={"link": {"gbps": -1}})


