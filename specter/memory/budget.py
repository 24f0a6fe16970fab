"""How many expert slots an ``offload.expert_budget`` buys for a model."""

from __future__ import annotations

from specter.errors import BudgetError


def budget_slots(budget, n_layers: int, n_experts: int, expert_bytes: int, top_k: int,
                 key: str = "offload.expert_budget") -> int:
    """Experts an ``offload.expert_budget`` (a ``specter.config.ExpertBudget``) buys, at most all
    of them; ``BudgetError`` when that is fewer than one decode step needs of a layer at once."""
    total = n_layers * n_experts
    slots = min(total, budget.resolve(n_layers, n_experts, expert_bytes))
    if slots < top_k:
        experts = f"{top_k} expert{'' if top_k == 1 else 's'}"
        share = f"{top_k / total:.1%} of {total}, " if total else ""
        raise BudgetError(
            f"{key}: {budget.describe()} gives {slots} expert slot(s) "
            f"({expert_bytes:,} bytes each), but one decode step needs {experts} of a layer at once; "
            f"use at least {experts} ({share}{top_k * expert_bytes:,} bytes)"
        )
    return slots
