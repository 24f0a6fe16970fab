"""``budget_slots``: the slots an expert budget buys for a model (resolved with the model's sizes,
at most all of its experts), and the one-line ``BudgetError`` naming the key, the budget, the slots
and the least budget that works when they are fewer than one decode step needs of a layer."""

from __future__ import annotations

import pytest

from specter.config import ExpertBudget
from specter.errors import BudgetError, SpecterError
from specter.memory.budget import budget_slots

N_LAYERS, N_EXPERTS, EXPERT_BYTES, TOP_K = 2, 8, 1536, 2  # 16 experts in all, 24,576 bytes


class RecordingBudget:
    """A budget that resolves to a fixed count and records what it was asked with."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.asked: list[tuple[int, int, int]] = []

    def resolve(self, n_layers: int, n_experts: int, expert_bytes: int) -> int:
        self.asked.append((n_layers, n_experts, expert_bytes))
        return self.slots

    def describe(self) -> str:
        return f"a recorded {self.slots}"


def slots_for(budget: object, top_k: int = TOP_K, **kw) -> int:
    return budget_slots(budget, N_LAYERS, N_EXPERTS, EXPERT_BYTES, top_k, **kw)


@pytest.mark.parametrize("budget, expected", [
    (ExpertBudget("fraction", 0.25), 4),
    (ExpertBudget("fraction", 0.3), 4),  # floor(4.8)
    (ExpertBudget("per_layer", 3), 6),
    (ExpertBudget("experts", 5), 5),
    (ExpertBudget("bytes", 5 * EXPERT_BYTES - 1), 4),  # floor of bytes / expert_bytes
], ids=["fraction", "fraction-floored", "per_layer", "experts", "bytes-floored"])
def test_each_kind_of_budget_buys_its_resolved_slots(budget: ExpertBudget, expected: int) -> None:
    assert slots_for(budget) == expected


@pytest.mark.parametrize("budget", [
    ExpertBudget("fraction", 0.125), ExpertBudget("per_layer", 1), ExpertBudget("experts", 2),
    ExpertBudget("bytes", 2 * EXPERT_BYTES),
], ids=["fraction", "per_layer", "experts", "bytes"])
def test_a_budget_of_exactly_one_step_is_enough(budget: ExpertBudget) -> None:
    assert slots_for(budget) == TOP_K


@pytest.mark.parametrize("budget", [
    ExpertBudget("fraction", 1.0), ExpertBudget("per_layer", 9), ExpertBudget("experts", 100),
    ExpertBudget("bytes", 10**9),
], ids=["fraction", "per_layer", "experts", "bytes"])
def test_a_budget_beyond_every_expert_buys_all_of_them(budget: ExpertBudget) -> None:
    assert slots_for(budget) == N_LAYERS * N_EXPERTS


def test_the_budget_is_resolved_with_the_models_sizes_and_capped_by_budget_slots_itself() -> None:
    budget = RecordingBudget(1000)
    assert slots_for(budget) == 16
    assert budget.asked == [(N_LAYERS, N_EXPERTS, EXPERT_BYTES)]


def test_fewer_slots_than_one_step_is_a_one_line_budget_error_with_the_least_budget_that_works() -> None:
    with pytest.raises(BudgetError) as info:
        slots_for(ExpertBudget("experts", 1))
    assert str(info.value) == (
        "offload.expert_budget: 1 experts gives 1 expert slot(s) (1,536 bytes each), but one decode step needs "
        "2 experts of a layer at once; use at least 2 experts (12.5% of 16, 3,072 bytes)")
    assert isinstance(info.value, SpecterError)  # the CLI prints it as one line


@pytest.mark.parametrize("budget, top_k, gives, least", [
    (ExpertBudget("fraction", 0.1), 2, "0.1 of all experts gives 1 expert slot(s)",  # floor(1.6)
     "2 experts (12.5% of 16, 3,072 bytes)"),
    (ExpertBudget("bytes", EXPERT_BYTES - 1), 1, "1535 bytes (1.43e-06 GiB) gives 0 expert slot(s)",
     "1 expert (6.2% of 16, 1,536 bytes)"),
    (ExpertBudget("per_layer", 1), 4, "1 experts per layer gives 2 expert slot(s)",
     "4 experts (25.0% of 16, 6,144 bytes)"),
], ids=["fraction", "bytes-below-one-expert", "per_layer-below-top_k"])
def test_the_error_describes_the_budget_the_slots_it_gives_and_the_least_that_works(
        budget: ExpertBudget, top_k: int, gives: str, least: str) -> None:
    with pytest.raises(BudgetError) as info:
        slots_for(budget, top_k=top_k)
    experts = "1 expert" if top_k == 1 else f"{top_k} experts"
    assert str(info.value) == (f"offload.expert_budget: {gives} (1,536 bytes each), but one decode step needs "
                               f"{experts} of a layer at once; use at least {least}")


def test_the_error_names_the_key_it_is_given() -> None:
    with pytest.raises(BudgetError) as info:
        slots_for(ExpertBudget("bytes", 1000), top_k=1, key="offload.host_budget")
    assert str(info.value).startswith("offload.host_budget: 1000 bytes (9.31e-07 GiB) gives 0 expert slot(s)")
    assert slots_for(ExpertBudget("bytes", 1536), top_k=1, key="offload.host_budget") == 1
