"""The bundled tiny MoE model: where it lives and how it was made (see train.py and MODEL_CARD.md)."""

from __future__ import annotations

from pathlib import Path

BUNDLED_DIR = Path(__file__).resolve().parent.parent / "data"
BUNDLED_MODELS = {"tiny-moe": BUNDLED_DIR / "tiny-moe"}


def bundled_path(name: str) -> Path:
    """Return the directory of bundled model ``name`` (as in ``model: bundled:NAME``)."""
    if name not in BUNDLED_MODELS:
        known = ", ".join(sorted(BUNDLED_MODELS))
        raise KeyError(f"unknown bundled model {name!r}; known: {known}")
    return BUNDLED_MODELS[name]
