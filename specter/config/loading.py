"""Loading recipes: ``load_recipe`` (a YAML file, a mapping or a ``Recipe``, plus ``dotted.key=value``
overrides parsed as YAML), plugin-name checks against the registry, and the schema's
introspection (``recipe_keys``, ``describe`` for ``--explain``).

Every YAML Specter reads (recipe and bench files, ``--set`` values, the bench's ``--budgets``)
goes through one loader, ``RecipeLoader``: ``yaml.safe_load`` that refuses a key given twice in one
mapping and reads a number with an exponent as a float whether or not it has a decimal point
(``1e-1``, ``2e3``: YAML 1.2's rule; PyYAML's YAML 1.1 leaves them strings). ``yaml_value(text)``
parses one value with it."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from specter.config.recipe import AUTO_LINK, Recipe
from specter.errors import UnknownPluginError
from specter.config.schema import check_bounded, display_key, _error, _from_mapping, _hints, _join, _plain, _plain_data, _schema_fields, _Section, _show, _suggest, _type_label, _type_name, _type_word

# ----------------------------------------------------------------------------- loading


def load_recipe(
    source: str | Path | Mapping[str, Any] | Recipe,
    overrides: Sequence[str] = (),
    *,
    check_plugins: bool = True,
    source_dir: str | Path | None = None,
) -> Recipe:
    """Read a recipe from a YAML file path or a mapping, apply ``key=value`` overrides, validate.

    A ``Recipe`` source is re-validated with the overrides and keeps its recipe directory (which
    ``load_recipe(recipe.to_dict())`` would lose, breaking relative paths).

    Override values are parsed as YAML (``yaml_value``: ``0.25`` and ``1e-1`` are floats, ``true`` a bool,
    ``[a, b]`` a list, ``2GiB`` a string, an empty value or ``null`` None; a value YAML would read
    as a comment alone, ``# TODO``, stays that text), except that a key taking only text (``prompt``,
    ``model``, ``offload.link.kind``, ...) keeps what was typed: ``prompt=1e5`` is the text ``1e5``;
    keys under an ``options`` mapping are free-form. With
    ``check_plugins`` the names of the plugins the engine uses must be registered. ``source_dir``
    is where relative paths of a mapping source are looked up (after the current directory).
    """
    if isinstance(source, Recipe):
        raw: Any = source.to_dict()
        source_dir = source.source_dir
    elif isinstance(source, Mapping):
        check_bounded(source)
        raw = copy.deepcopy(dict(source))
        source_dir = Path(source_dir) if source_dir is not None else None
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        raw = _read_yaml(path)
        source_dir = path.resolve().parent
    else:
        got = _type_name(source)
        raise _error("recipe", f"expected a path or a mapping, got {got}; allowed: a YAML file path")
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        known = ", ".join(f.name for f in _schema_fields(Recipe))
        raise _error(
            "recipe",
            f"the top level must be a mapping of keys to values, got {_type_name(raw)} {_show(raw)}; "
            f"allowed keys: {known}",
        )
    raw = dict(raw)
    for item in [overrides] if isinstance(overrides, str) else overrides:
        _apply_override(raw, item)
    check_bounded(raw)  # the recipe as the overrides left it (a mapping source was checked before its copy too)
    recipe = _from_mapping(Recipe, raw, source_dir=source_dir)
    if check_plugins:
        check_plugin_names(recipe)
    return recipe


def check_plugin_names(recipe: Recipe) -> None:
    """Raise ``UnknownPluginError`` (naming the recipe key) for an unregistered plugin the run uses,
    and ``SpecterError`` for options its factory would refuse (``Registry.check_options``), so a typo
    is reported before the model loads.

    ``offload.link.kind: auto`` is not a plugin but a choice the engine makes, so it passes (and an
    unknown link's message lists it with the plugins).
    """
    from specter.plugins import registry

    plugins = registry()
    for choice in recipe.plugins_used():
        if (choice.kind, choice.name) == ("link", AUTO_LINK):
            continue
        try:
            plugins.get(choice.kind, choice.name, key=choice.key)
        except UnknownPluginError as error:
            if choice.kind != "link":
                raise
            rebuilt = UnknownPluginError("link", choice.name, [*error.known, AUTO_LINK], key=choice.key)
            hint = plugins.why_missing("link", choice.name)
            if hint:
                rebuilt.args = (f"{rebuilt.args[0]}; {hint}",)
            raise rebuilt from None
    sections = {"cache_policy": recipe.offload.cache_policy, "link": recipe.offload.link,
                "predictor": recipe.speculation.predictor, "governor": recipe.speculation.governor}
    for choice in recipe.plugins_used():  # options as the engine will pass them, checked before the model loads
        section = sections.get(choice.kind)
        if section is None or (choice.kind, choice.name) == ("link", AUTO_LINK):
            continue
        options = section.factory_options(choice.name) if choice.kind == "link" else section.options
        plugins.check_options(choice.kind, choice.name, options, key=choice.key)


_YAML_NULLS = ("", "~", "null", "Null", "NULL")


class RecipeLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping (YAML keeps the last one
    silently: a second ``offload:`` section would replace the first) and reads ``1e-1`` as a float."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:  # an unhashable key: safe_load's own error follows
                    continue
                if first is not key_node:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"{key!r} is given twice in one mapping (first on line "
                                    f"{first.start_mark.line + 1}); keep one", key_node.start_mark)
        return super().construct_mapping(node, deep)


RecipeLoader.add_implicit_resolver(  # PyYAML's float pattern wants a dot and a signed exponent
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def yaml_value(text: str) -> Any:
    """One YAML value (a ``--set`` value, a list of budgets) read as recipe files are."""
    return yaml.load(text, Loader=RecipeLoader)


def _read_yaml(path: Path) -> Any:
    shown = _plain(str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _error("recipe", f"no such file: {shown}; allowed: a path to a YAML recipe") from None
    except IsADirectoryError:
        raise _error("recipe", f"{shown} is a directory; allowed: a path to a YAML recipe") from None
    except UnicodeDecodeError:
        raise _error("recipe", f"{shown} is not UTF-8 text; allowed: a YAML recipe") from None
    except (OSError, ValueError) as exc:
        raise _error("recipe", f"cannot read {shown}: {exc}") from None
    try:
        return yaml_value(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{shown}:{mark.line + 1}:{mark.column + 1}" if mark is not None else shown
        problem = getattr(exc, "problem", None) or str(exc)
        raise _error("recipe", f"{where}: invalid YAML: {' '.join(str(problem).split())}") from None


def _takes_only_text(hint: Any) -> bool:
    """Whether a schema field takes text and nothing else but null (``str``, ``str | None``): an
    override of it keeps the text as typed, so ``prompt=1e5`` or ``prompt=yes`` is that text, not
    the number or bool YAML would read."""
    if hint is str:
        return True
    args = typing.get_args(hint)
    return bool(args) and str in args and all(a in (str, type(None)) for a in args)


def _apply_override(raw: dict[str, Any], item: object) -> None:
    """Set ``dotted.key=value`` in the raw recipe mapping, checking the key against the schema."""
    if not isinstance(item, str) or "=" not in item:
        raise _error(
            display_key(item),
            "an override must look like dotted.key=value (for example offload.expert_budget=0.25); "
            "allowed keys: python -m specter.run --explain",
        )
    dotted, text = item.split("=", 1)
    dotted = dotted.strip()
    try:
        value = yaml_value(text)
    except yaml.YAMLError as exc:
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        shown = _show(text)
        raise _error(display_key(dotted), f"cannot parse override value {shown} as YAML: {problem}") from None
    if value is None and text.strip() not in _YAML_NULLS:  # "# not a comment": YAML reads a comment as null
        value = text
    parts = dotted.split(".")
    section: type | None = Recipe
    node = raw
    for depth, part in enumerate(parts):
        path = ".".join(display_key(p) for p in parts[: depth + 1])
        last = depth == len(parts) - 1
        hint: Any = None
        if section is not None:
            known = {f.name: f for f in _schema_fields(section)}
            if part not in known:
                parent = section._path
                raise _error(
                    path,
                    f"unknown key (in override {_show(item)}); {_suggest(part, list(known), parent)}"
                    f"allowed keys{' under ' + parent if parent else ''}: {', '.join(known)}",
                )
            hint = _hints(section)[part]
        if last:
            node[part] = text.strip() if _takes_only_text(hint) and value is not None and not isinstance(value, str) else value
            return
        if section is not None and isinstance(hint, type) and issubclass(hint, _Section):
            next_section: type | None = hint
        elif section is None or hint is dict:
            next_section = None
        else:
            raise _error(path, f"takes a single value, not sub-keys (in override {_show(item)}); "
                               f"allowed: {path}=VALUE")
        child = node.get(part)
        if isinstance(child, _Section):
            child = child.to_dict()
        elif child is None:
            child = {}
        elif isinstance(child, Mapping):
            child = dict(child)
        else:
            raise _error(path, f"expected a mapping, got {_type_name(child)} {_show(child)} "
                               f"(in override {_show(item)}); allowed: a mapping")
        node[part] = child
        node, section = child, next_section


# ----------------------------------------------------------------------------- introspection


def _leaves(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field, Any]]:
    found = []
    for f in _schema_fields(cls):
        key = _join(prefix, f.name)
        hint = _hints(cls)[f.name]
        if isinstance(hint, type) and issubclass(hint, _Section):
            found.extend(_leaves(hint, key))
        else:
            found.append((key, f, hint))
    return found


def recipe_keys() -> list[str]:
    """Every leaf key of the schema as a dotted path, in schema order."""
    return [key for key, _, _ in _leaves(Recipe)]


def describe() -> str:
    """Every recipe key with its type, default and doc (what ``specter.run --explain`` prints)."""
    lines = []
    for key, f, hint in _leaves(Recipe):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        label = f.metadata["type_name"] or _type_label(hint)
        allowed = f.metadata["allowed"] or _type_word(hint)
        lines.append(f"{key}: {label} = {json.dumps(_plain_data(default))}")
        lines.append(f"    {f.metadata['doc']}. Allowed: {allowed}.")
    return "\n".join(lines)
