"""Exceptions users see. Anything deriving from ``SpecterError`` is printed by the CLI as one line
(``error: <message>``) with exit code 2 and no traceback; its message names what is wrong and
what is allowed."""

from __future__ import annotations

import reprlib


class SpecterError(Exception):
    """A user-facing error: bad recipe, missing model, unknown plugin, impossible budget."""


class RecipeError(SpecterError):
    """A recipe key is unknown, mistyped or out of range. The message starts with the dotted key."""


class UnknownPluginError(SpecterError):
    """A plugin name that no registered plugin provides; the message lists the known ones."""

    def __init__(self, kind: str, name: str, known: list[str], key: str | None = None) -> None:
        import difflib

        where = f"{key}: " if key else ""
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6) if isinstance(name, str) else []
        hint = f"did you mean {close[0]}? " if close else ""
        super().__init__(f"{where}unknown {kind} {name!r}; {hint}known: {', '.join(sorted(known)) or '(none)'}")
        self.kind, self.name, self.known = kind, name, sorted(known)


class BudgetError(SpecterError):
    """The expert budget is too small for one step, or larger than the device can hold."""


def _bounded() -> reprlib.Repr:
    limited = reprlib.Repr()
    limited.maxlevel, limited.maxstring, limited.maxother = 3, 60, 60
    limited.maxdict = limited.maxlist = limited.maxtuple = limited.maxset = limited.maxfrozenset = 6
    return limited


_BOUNDED = _bounded()


def bounded_repr(value: object) -> str:
    """``repr`` with nesting depth and sizes bounded, so a shared or huge structure (a YAML alias
    bomb in a recipe) prints in constant time. For error messages."""
    return _BOUNDED.repr(value)
