"""Exceptions users see. Anything deriving from ``SpecterError`` is printed by the CLI as one line
(``error: <message>``) with exit code 2 and no traceback; its message names what is wrong and
what is allowed."""

from __future__ import annotations


class SpecterError(Exception):
    """A user-facing error: bad recipe, missing model, unknown plugin, impossible budget."""


class RecipeError(SpecterError):
    """A recipe key is unknown, mistyped or out of range. The message starts with the dotted key."""


class UnknownPluginError(SpecterError):
    """A plugin name that no registered plugin provides; the message lists the known ones."""

    def __init__(self, kind: str, name: str, known: list[str], key: str | None = None) -> None:
        where = f"{key}: " if key else ""
        super().__init__(f"{where}unknown {kind} {name!r}; known: {', '.join(sorted(known)) or '(none)'}")
        self.kind, self.name, self.known = kind, name, sorted(known)


class BudgetError(SpecterError):
    """The expert budget is too small for one step, or larger than the device can hold."""
