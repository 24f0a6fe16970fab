"""The bundled tiny MoE model: where it lives and how it was made (see train.py and MODEL_CARD.md).

``bundled:tiny-moe`` ships inside the package. ``bundled:tiny-moe-x{m}`` (m a power of two,
e.g. ``tiny-moe-x16``) is the same model with every routed expert widened m times, built on
first use into the user's cache directory (``specter.bundled.widen``).
"""

from __future__ import annotations

from pathlib import Path

BUNDLED_DIR = Path(__file__).resolve().parent.parent / "data"
BUNDLED_MODELS = {"tiny-moe": BUNDLED_DIR / "tiny-moe"}
WIDENED_EXAMPLE = "tiny-moe-x16"


def known_names() -> str:
    return ", ".join([*sorted(BUNDLED_MODELS), "tiny-moe-x{m} (m a power of two, e.g. tiny-moe-x16)"])


def is_bundled(name: str) -> bool:
    """Whether ``name`` names a bundled model (raises ValueError for a bad widening factor)."""
    from specter.bundled.widen import parse_factor

    return name in BUNDLED_MODELS or parse_factor(name) is not None


def bundled_path(name: str) -> Path:
    """Return the directory of bundled model ``name`` (as in ``model: bundled:NAME``); a widened
    model is built on first use."""
    from specter.bundled.widen import materialize, parse_factor

    if name in BUNDLED_MODELS:
        return BUNDLED_MODELS[name]
    factor = parse_factor(name)
    if factor is None:
        raise KeyError(f"unknown bundled model {name!r}; known: {known_names()}")
    return materialize(factor)
