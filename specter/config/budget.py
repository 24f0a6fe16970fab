"""``offload.expert_budget``: how many full-precision experts the device cache may hold, as a
fraction, a count per layer, a total count or a byte size; ``ExpertBudget.resolve`` turns it into
slots for a given model."""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, ClassVar, Mapping

from specter.config.schema import _BYTE_SIZE, _BYTE_UNITS, _FRACTION_TOLERANCE, _error, _show, _type_name
from specter.errors import RecipeError

# ----------------------------------------------------------------------------- expert budget


@dataclass(frozen=True)
class ExpertBudget:
    """How many full-precision experts the device cache may hold.

    ``kind`` is ``fraction`` (of all experts, in (0, 1]), ``per_layer`` (slots per MoE layer),
    ``experts`` (slots in total) or ``bytes`` (a byte budget). ``resolve`` turns any of them into
    a total slot count for a given model.
    """

    kind: str
    value: float | int
    KINDS: ClassVar[tuple[str, ...]] = ("fraction", "per_layer", "experts", "bytes")
    KEY: ClassVar[str] = "offload.expert_budget"
    ALLOWED: ClassVar[str] = (
        'a fraction in (0, 1], {per_layer: N}, {experts: N} (N >= 1), or a byte size such as '
        '"2GiB", "512MiB", "1.5GB", "1000000" (KB/MB/GB = 10^3.., KiB/MiB/GiB = 2^10..)'
    )

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            kinds = ", ".join(self.KINDS)
            raise _error(self.KEY, f"unknown budget kind {_show(self.kind)}; allowed: {kinds}")
        if self.kind == "fraction":
            is_number = isinstance(self.value, (int, float)) and not isinstance(self.value, bool)
            if not (is_number and 0 < self.value <= 1):
                raise _error(
                    self.KEY, f"fraction must be in (0, 1], got {_show(self.value)}; allowed: {self.ALLOWED}"
                )
            object.__setattr__(self, "value", float(self.value))
        elif not (isinstance(self.value, int) and not isinstance(self.value, bool) and self.value >= 1):
            unit = "bytes" if self.kind == "bytes" else "N"
            raise _error(
                self.KEY,
                f"{self.kind} {unit} must be an integer >= 1, got {_show(self.value)}; allowed: {self.ALLOWED}",
            )

    @classmethod
    def parse(cls, value: Any, key: str = KEY) -> ExpertBudget:
        """Parse a recipe value: a number, ``{per_layer: N}``, ``{experts: N}`` or a byte string."""

        def fail(problem: str, advice: str = "") -> RecipeError:
            got = f"{_type_name(value)} {_show(value)}"
            return _error(key, f"{problem}, got {got}; {advice}allowed: {cls.ALLOWED}")

        if isinstance(value, ExpertBudget):
            return value
        if isinstance(value, bool) or value is None:
            raise fail("expected a budget")
        if isinstance(value, (int, float)):
            if not 0 < value <= 1:
                advice = "for a byte count write a string, for a count {experts: N}; "
                raise fail("a number is a fraction of all experts and must be in (0, 1]",
                           advice if isinstance(value, int) and value > 1 else "")
            return cls("fraction", float(value))
        if isinstance(value, Mapping):
            if len(value) != 1 or next(iter(value)) not in ("per_layer", "experts"):
                raise fail("a mapping budget must have exactly one key, per_layer or experts")
            ((kind, count),) = value.items()
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise fail(f"{kind} must be an integer >= 1")
            return cls(kind, count)
        if isinstance(value, str):
            match = _BYTE_SIZE.fullmatch(value)
            if match is None:
                raise fail("not a byte size")
            number, unit = match.groups()
            if unit is None and "." in number:
                raise fail("a byte count without a unit must be a whole number")
            n_bytes = int(Decimal(number) * _BYTE_UNITS[(unit or "b").lower()])
            if n_bytes < 1:
                raise fail("a byte budget must be at least 1 byte")
            return cls("bytes", n_bytes)
        raise fail("expected a budget")

    def resolve(self, n_layers: int, n_experts: int, expert_bytes: int) -> int:
        """Total expert slots for a model with ``n_layers`` MoE layers of ``n_experts`` experts.

        Rounding: fraction -> floor(fraction * n_layers * n_experts) (with a 1e-9 tolerance, so 0.3
        of 10 experts is 3); bytes -> floor(bytes / expert_bytes). The result is capped at
        ``n_layers * n_experts`` (more slots than experts are useless) and is never negative; it
        may be 0 or too small for one step: the caller decides whether it is enough.
        """
        for name, number in (("n_layers", n_layers), ("n_experts", n_experts), ("expert_bytes", expert_bytes)):
            if isinstance(number, bool) or not isinstance(number, int) or number < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {number!r}")
        total = n_layers * n_experts
        if self.kind == "fraction":
            slots = math.floor(self.value * total + _FRACTION_TOLERANCE)
        elif self.kind == "per_layer":
            slots = self.value * n_layers
        elif self.kind == "experts":
            slots = self.value
        else:
            if expert_bytes == 0:
                raise ValueError("expert_bytes must be >= 1 to resolve a byte budget")
            slots = self.value // expert_bytes
        return max(0, min(int(slots), total))

    def to_recipe_value(self) -> float | dict[str, int] | str:
        """The recipe spelling of this budget; ``ExpertBudget.parse`` of it gives it back."""
        if self.kind == "fraction":
            return self.value
        if self.kind == "bytes":
            return str(self.value)
        return {self.kind: self.value}

    def describe(self) -> str:
        """Human wording of the budget, e.g. ``0.5 of all experts`` or ``8 experts per layer``."""
        return str(self)

    def __str__(self) -> str:
        if self.kind == "fraction":
            return f"{self.value:g} of all experts"
        if self.kind == "per_layer":
            return f"{self.value} experts per layer"
        if self.kind == "experts":
            return f"{self.value} experts"
        return f"{self.value} bytes ({self.value / 2**30:.3g} GiB)"
