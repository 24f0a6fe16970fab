"""The hand-written schema machinery behind recipes: fields with a type, default, one-line doc and
rule (``_field``), coercion with one-line errors naming the dotted key (``_coerce``), frozen
sections that validate themselves (``_Section``) and building them from mappings with
"did you mean" hints (``_from_mapping``). Private to ``specter.config``."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from dataclasses import field, fields
from typing import Any, Callable, ClassVar, Mapping, Sequence

from specter.errors import RecipeError, bounded_repr

_SAFE_KEY = re.compile(r"[A-Za-z0-9_\-]+")
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
_BYTE_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?|\.[0-9]+)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
_BYTE_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_FRACTION_TOLERANCE = 1e-9


# ----------------------------------------------------------------------------- error helpers


def display_key(key: object) -> str:
    """How a key (or key path segment) appears in messages: plain when simple, repr otherwise."""
    if isinstance(key, str) and _SAFE_KEY.fullmatch(key):
        return key
    return repr(key)


def _plain(text: str) -> str:
    return text if text.isprintable() else repr(text)


MAX_DEPTH = 32  # nesting levels a recipe value may have
MAX_NODES = 100_000  # values (containers and scalars) a recipe may hold, a shared one counted where it appears


def _show(value: object, limit: int = 60) -> str:
    """A bounded excerpt of ``repr(value)``: never walks more than a few levels or items, so an
    aliased structure (a YAML alias bomb) prints in constant time."""
    shown = bounded_repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def check_bounded(value: object, key: str = "recipe") -> None:
    """Refuse data nested deeper than ``MAX_DEPTH`` or holding more than ``MAX_NODES`` values. A
    shared (YAML-aliased) value counts every time it appears, as it will when the recipe is written
    out (``to_dict``, a report's JSON): nine aliases of nine aliases seven levels deep are 4.8
    million values, not 63. The walk stops at the first value past either bound, so it is bounded
    too (a cycle ends at ``MAX_DEPTH``)."""
    visited = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _error(key, f"nested deeper than {MAX_DEPTH} levels; allowed: plain data of bounded size")
        visited += 1
        if visited > MAX_NODES:
            raise _error(key, f"holds more than {MAX_NODES:,} values (a shared value counted wherever it "
                              f"appears); allowed: plain data of bounded size")
        if isinstance(item, Mapping):
            stack.extend((child, depth + 1) for pair in item.items() for child in pair)
        elif isinstance(item, (list, tuple, set)):
            stack.extend((child, depth + 1) for child in item)


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _error(key: str, text: str) -> RecipeError:
    return RecipeError("\\n".join(f"{key}: {text}".splitlines()))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _suggest(word: object, choices: Sequence[str], prefix: str = "") -> str:
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean {_join(prefix, close[0])}? " if close else ""


# ----------------------------------------------------------------------------- field rules


def _field(
    doc: str,
    default: Any = dataclasses.MISSING,
    *,
    factory: Callable[[], Any] | None = None,
    check: Callable[[Any], bool] | None = None,
    allowed: str | None = None,
    parse: Callable[[Any, str], Any] | None = None,
    type_name: str | None = None,
    choices: Sequence[object] = (),
) -> Any:
    metadata = {
        "doc": doc, "check": check, "allowed": allowed, "parse": parse, "type_name": type_name,
        "choices": tuple(choices),
    }  # fmt: skip
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _at_least(low: float, what: str = "an integer") -> dict[str, Any]:
    return {"check": lambda v: v is None or v >= low, "allowed": f"{what} >= {_number(low)}"}


def _between(low: float, high: float, what: str, *, low_open: bool = False) -> dict[str, Any]:
    def check(value: Any) -> bool:
        return value is None or ((value > low) if low_open else (value >= low)) and value <= high

    opening = "(" if low_open else "["
    return {"check": check, "allowed": f"{what} in {opening}{_number(low)}, {_number(high)}]"}


def _one_of(*choices: object) -> dict[str, Any]:
    return {"check": lambda v: v in choices, "allowed": ", ".join(str(c) for c in choices), "choices": choices}


def _non_empty(what: str) -> dict[str, Any]:
    return {"check": lambda v: v is None or len(v) > 0, "allowed": f"a non-empty {what}"}


def _type_word(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        words = [_type_word(a) for a in typing.get_args(hint) if a is not type(None)]
        return " or ".join(words + ["null"])
    if origin is list:
        return "a list of strings"
    if hint is dict or origin is dict:
        return "a mapping of option names to values"
    if isinstance(hint, type) and issubclass(hint, _Section):
        return "a mapping"
    words = {str: "a string", int: "an integer", float: "a number", bool: "a boolean (true or false)"}
    return words.get(hint, getattr(hint, "__name__", str(hint)))


def _type_label(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_label(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "None"
    if origin is list:
        return "list[str]"
    if hint is dict or origin is dict:
        return "dict"
    return hint.__name__


def _coerce(value: Any, hint: Any, key: str, allowed: str) -> Any:
    """Return ``value`` converted to ``hint`` (int -> float, tuple -> list, mapping -> section)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
        origin = typing.get_origin(hint)
    if isinstance(hint, type) and issubclass(hint, _Section):
        if isinstance(value, hint):
            return value
        if value is None or isinstance(value, Mapping):
            return _from_mapping(hint, value)
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                number = math.inf
            if not math.isfinite(number):
                raise _error(key, f"expected a finite number, got {_show(value)}; allowed: {allowed}")
            return number
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin is list:
        if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
            return list(value)
    elif hint is dict or origin is dict:
        if isinstance(value, Mapping) and all(isinstance(name, str) for name in value):
            return dict(value)
    else:
        raise TypeError(f"recipe schema: unsupported field type {hint!r} at {key}")
    scalar = isinstance(value, (bool, int, float))
    quote_hint = " (quote it to make it a string)" if hint is str and scalar else ""
    raise _error(
        key,
        f"expected {_type_word(hint)}, got {_type_name(value)} {_show(value)}{quote_hint}; "
        f"allowed: {allowed}",
    )


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _schema_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in fields(cls) if not f.metadata.get("internal")]


class _Section:
    """Base of every recipe section: validates and normalizes its fields after ``__init__``."""

    _path: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in _schema_fields(self):
            key = _join(self._path, f.name)
            value = getattr(self, f.name)
            hint = hints[f.name]
            allowed = f.metadata["allowed"] or _type_word(hint)
            if f.metadata["parse"] is not None:
                value = f.metadata["parse"](value, key)
            else:
                value = _coerce(value, hint, key, allowed)
            check = f.metadata["check"]
            if check is not None and not check(value):
                choices = [c for c in f.metadata["choices"] if isinstance(c, str)]
                raise _error(
                    key, f"invalid value {_show(value)}; {_suggest(value, choices)}allowed: {allowed}"
                )
            object.__setattr__(self, f.name, value)
        self._check()

    def _check(self) -> None:
        """Cross-field rules; fields are already normalized when this runs."""

    def to_dict(self) -> dict[str, Any]:
        """The section as plain data (what YAML would hold); loading it back gives an equal one."""
        return {f.name: _plain_data(getattr(self, f.name)) for f in _schema_fields(self)}


def _plain_data(value: Any) -> Any:
    if isinstance(value, _Section):
        return value.to_dict()
    if hasattr(value, "to_recipe_value"):  # an ExpertBudget
        return value.to_recipe_value()
    return copy.deepcopy(value)


def _from_mapping(cls: type, raw: Mapping | None, **internal: Any) -> Any:
    """Build section ``cls`` from a mapping, rejecting unknown keys with a close-match hint."""
    path = cls._path or "recipe"
    known = [f.name for f in _schema_fields(cls)]
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise _error(
            path,
            f"expected a mapping of keys to values, got {_type_name(raw)} {_show(raw)}; "
            f"allowed keys: {', '.join(known)}",
        )
    for name in raw:
        if name not in known:
            where = f" under {cls._path}" if cls._path else ""
            raise _error(
                _join(cls._path, display_key(name)),
                f"unknown key; {_suggest(name, known, cls._path)}allowed keys{where}: {', '.join(known)}",
            )
    return cls(**raw, **internal)
