"""A sweep's expert budgets as written (``sweep.budgets``, a bench row's ``budget``): any form
``offload.expert_budget`` takes (``specter.config.budget``): a fraction of all experts,
``{per_layer: N}``, ``{experts: N}`` or a byte size such as ``"2MiB"``.

Contract: ``parse(value) -> ExpertBudget | None``: the budget a value names (``"2MiB"`` and
``"2097152"`` name one budget: ``spec`` refuses such a pair), None where it names none.
``key(value)``: a hashable stand-in for the value as written, for dict keys and sets (a fraction
and a byte string are their own key, None stays None). ``label(value)``: what tables, plots and
progress lines print: ``25%`` (any number, as a percentage), ``8 per layer``, ``40 experts``,
``2 MiB`` (a byte size in the largest unit that writes it with at most two decimals, else
``1,234,567 B``: ``byte_size(n)``), ``-`` for None, the value itself where it names no budget.
``share(value, model)``: the share of all experts the budget gives a model (a bench document's
``model``: ``n_moe_layers``, ``n_experts``, ``expert_bytes``), any number's own value even
without a model; None where the model's sizes are missing or the value names no budget.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

from specter.config.budget import ExpertBudget
from specter.errors import RecipeError

BYTE_UNITS = (("TiB", 2**40), ("TB", 10**12), ("GiB", 2**30), ("GB", 10**9), ("MiB", 2**20), ("MB", 10**6),
              ("KiB", 2**10), ("KB", 10**3))


def parse(value: Any) -> ExpertBudget | None:
    try:
        return ExpertBudget.parse(value)
    except RecipeError:
        return None


def key(value: Any) -> Hashable:
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), key(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(key(v) for v in value)
    return value if isinstance(value, Hashable) else repr(value)


def byte_size(n_bytes: int) -> str:
    fits = [(n_bytes / size, unit) for unit, size in BYTE_UNITS
            if n_bytes >= size and round(n_bytes / size, 2) == n_bytes / size]
    if not fits:
        return f"{n_bytes:,} B"
    amount, unit = min(fits)
    return f"{amount:g} {unit}"


def label(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value * 100:g}%"
    budget = parse(value)
    if budget is None:
        return str(value)
    if budget.kind == "per_layer":
        return f"{budget.value} per layer"
    if budget.kind == "experts":
        return f"{budget.value} experts"
    return byte_size(budget.value)


def share(value: Any, model: Mapping | None) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    budget = parse(value)
    if budget is None:
        return None
    sizes = [(model or {}).get(name) for name in ("n_moe_layers", "n_experts", "expert_bytes")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
        return None
    layers, experts, expert_bytes = sizes
    return budget.resolve(layers, experts, expert_bytes) / (layers * experts)
