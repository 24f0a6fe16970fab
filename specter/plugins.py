"""The plugin registry: cache policies, links, predictors and governors, found through pluggy.

Contract: ``get_plugin_manager()`` builds one ``pluggy.PluginManager`` per process (lazily, on
first use) holding the hookspecs of ``specter.hookspecs``, the built-in modules
``BUILTIN_PLUGIN_MODULES`` and the modules of the ``specter`` entry-point group. Built-ins
register through the same hooks as third-party packages. ``registry()`` asks every hook
implementation for its plugins and returns a ``Registry`` of ``(kind, name) -> factory``.

- ``SPECTER_PLUGINS`` (read when the manager is built) restricts the entry points loaded:
  unset loads all, ``""`` none, ``"a,b"`` only the entry points named ``a`` and ``b``.
- An entry point that fails to load, or whose hook implementation raises, is skipped with a
  ``PluginLoadWarning``; a built-in that fails is a bug and raises.
- Names are unique per kind. A third-party plugin that registers a name already taken (by a
  built-in or an earlier plugin) or an invalid name is disabled as a whole, with a
  ``PluginLoadWarning`` that names both sources; ``--list-plugins`` lists it under "skipped".
  The same faults in a built-in raise ``SpecterError``; registering the identical factory again
  is ignored.
- ``Registry.create`` calls ``factory(**context, **options)``: every option must be a parameter
  of the factory, while the engine's context keywords are *offered*, each factory receiving only
  those its signature names (all of them if it takes ``**kwargs``).
- ``register_plugin(obj)`` adds a plugin object at runtime; ``reset_plugins()`` forgets the
  manager, runtime registrations included, so tests start clean and see new env vars.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import threading
import warnings
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Any, Callable

import pluggy

from specter import hookspecs
from specter.errors import SpecterError, UnknownPluginError, bounded_repr

BUILTIN_PLUGIN_MODULES = (
    "specter.policies", "specter.memory.links", "specter.predictors", "specter.decode.governors", "specter.decode.engines",
)
ENTRY_POINT_GROUP = "specter"
ALLOWLIST_ENV = "SPECTER_PLUGINS"
HOOK_BY_KIND = {
    "cache_policy": "register_cache_policies",
    "link": "register_links",
    "predictor": "register_predictors",
    "governor": "register_governors",
    "engine": "register_engines",
}
KINDS = tuple(HOOK_BY_KIND)
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")


class PluginLoadWarning(UserWarning):
    """A third-party plugin could not be loaded or failed while registering; it was skipped."""


@dataclass(frozen=True)
class PluginEntry:
    """One registered plugin: its kind, name, factory and where it came from."""

    kind: str
    name: str
    factory: Callable[..., object]
    source: str


class Registry:
    """Plugins by kind and name; built by ``registry()``, read-only afterwards."""

    def __init__(self, entries: dict[str, dict[str, PluginEntry]], skipped: list[str]) -> None:
        self._entries = entries
        self.skipped = list(skipped)

    def _kind(self, kind: str) -> dict[str, PluginEntry]:
        if kind not in self._entries:
            raise ValueError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KINDS)}")
        return self._entries[kind]

    def names(self, kind: str) -> list[str]:
        """Registered names of ``kind``, sorted."""
        return sorted(self._kind(kind))

    def entries(self, kind: str) -> list[PluginEntry]:
        """Registered plugins of ``kind``, sorted by name."""
        plugins = self._kind(kind)
        return [plugins[name] for name in sorted(plugins)]

    def get(self, kind: str, name: str, key: str | None = None) -> Callable[..., object]:
        """The factory of plugin ``name``; ``UnknownPluginError`` (naming ``key``) if none."""
        plugins = self._kind(kind)
        if name not in plugins:
            raise UnknownPluginError(kind, name, list(plugins), key=key)
        return plugins[name].factory

    def source(self, kind: str, name: str) -> str:
        """Where plugin ``name`` came from (built-in module or distribution)."""
        self.get(kind, name)
        return self._entries[kind][name].source

    def create(
        self,
        kind: str,
        name: str,
        options: dict[str, Any] | None = None,
        key: str | None = None,
        expect: type | None = None,
        **context: Any,
    ) -> object:
        """Instantiate plugin ``name`` with the recipe ``options`` and the context it accepts.

        ``key`` is the recipe section the plugin comes from (``offload.cache_policy``); every
        error names it. An option the factory does not name is an error even when it takes
        ``**kwargs``, unless it sets ``accepts_any_options = True``; so is a factory that raises
        (one line naming the plugin) or, with ``expect``, returns an object of another type.
        """
        options = dict(options or {})
        where = f"{key}: " if key else ""
        factory = self.get(kind, name, key=key)
        reserved = sorted(set(options) & set(context))
        if reserved:
            raise SpecterError(
                f"{where}option {reserved[0]!r} of {kind} {name!r} is set by the engine; remove it"
            )
        signature = _signature(factory)
        accepted = _named_parameters(signature, context)
        unknown = [option for option in options if accepted is not None and option not in accepted]
        if unknown and not getattr(factory, "accepts_any_options", False):
            raise SpecterError(
                _one_line(f"{where}unknown option {bounded_repr(unknown[0])} for {kind} {name!r}; "
                          f"accepted options: {', '.join(accepted or []) or '(none)'}")
            )
        kwargs = {**_offered(signature, context), **options}
        try:
            if signature is not None:  # without a readable signature the call below is the check
                signature.bind(**kwargs)
        except TypeError as exc:
            raise SpecterError(_one_line(f"{where}bad options {bounded_repr(options)} for {kind} {name!r} "
                                         f"({exc}); accepted options: {', '.join(accepted or []) or '(none)'}")) from None
        try:
            made = factory(**kwargs)
        except ValueError as exc:
            raise SpecterError(_one_line(f"{where}{kind} {name!r} rejected its options: {exc}")) from None
        except SpecterError:
            raise
        except Exception as exc:
            raise SpecterError(_one_line(f"{where}{kind} plugin {name!r} ({self.source(kind, name)}) failed while "
                                         f"starting: {type(exc).__name__}: {exc}")) from exc
        if expect is not None and not isinstance(made, expect):
            raise SpecterError(f"{where}{kind} plugin {name!r} returned a {type(made).__name__}, which is not a "
                               f"{expect.__module__}.{expect.__qualname__}; subclass it")
        return made


def _signature(factory: Callable[..., object]) -> inspect.Signature | None:
    """The factory's signature, None when it cannot be read (some builtins)."""
    try:
        return inspect.signature(factory)
    except (TypeError, ValueError):
        return None


def _named_parameters(signature: inspect.Signature | None, context: dict[str, Any]) -> list[str] | None:
    """The option names a factory takes (its parameters, context keywords and ``self`` excluded);
    None when its signature cannot be read."""
    if signature is None:
        return None
    parameters = signature.parameters
    plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters.values() if p.kind in plain and p.name not in context and p.name != "self"]


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _offered(signature: inspect.Signature | None, context: dict[str, Any]) -> dict[str, Any]:
    """The context keywords a factory names (all of them if it takes ``**kwargs`` or its
    signature cannot be read)."""
    if signature is None:
        return dict(context)
    parameters = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(context)
    return {name: value for name, value in context.items() if name in parameters}


_lock = threading.RLock()
_manager: pluggy.PluginManager | None = None
_registry: Registry | None = None
_sources: dict[str, str] = {}
_builtin_names: set[str] = set()
_skipped: list[str] = []


def _warn(message: str) -> None:
    _skipped.append(message)
    warnings.warn(_one_line(message), PluginLoadWarning, stacklevel=3)


def _allowlist() -> set[str] | None:
    value = os.environ.get(ALLOWLIST_ENV)
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


def _register_builtins(manager: pluggy.PluginManager) -> None:
    for module_name in BUILTIN_PLUGIN_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # not written yet: the tree works while it is
            raise
        manager.register(module, name=module_name)
        _sources[module_name] = f"builtin ({module_name})"
        _builtin_names.add(module_name)


def _register_entry_points(manager: pluggy.PluginManager) -> None:
    allowed = _allowlist()
    if allowed == set():
        return
    try:
        entry_points = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    except Exception as exc:  # a broken installation must not stop the run
        _warn(f"cannot list entry points of group {ENTRY_POINT_GROUP!r}: {type(exc).__name__}: {exc}")
        return
    seen = set()
    for entry_point in entry_points:
        if allowed is not None and entry_point.name not in allowed:
            continue
        seen.add(entry_point.name)
        dist = getattr(getattr(entry_point, "dist", None), "name", None)
        source = f"{dist} (entry point {entry_point.name})" if dist else f"entry point {entry_point.name}"
        plugin_name = f"entrypoint:{entry_point.name}"
        try:
            plugin = entry_point.load()
            manager.register(plugin, name=plugin_name)
        except Exception as exc:
            target = getattr(entry_point, "value", "?")
            _warn(f"skipped plugin {source} = {target}: {type(exc).__name__}: {exc}")
            continue
        _sources[plugin_name] = source
    for name in sorted((allowed or set()) - seen):
        _warn(f"{ALLOWLIST_ENV} names {name!r}, but no entry point of group {ENTRY_POINT_GROUP!r} does")


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, built on first call."""
    global _manager
    with _lock:
        if _manager is None:
            manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
            manager.add_hookspecs(hookspecs)
            _register_builtins(manager)
            _register_entry_points(manager)
            _manager = manager
        return _manager


def register_plugin(plugin: ModuleType | object, name: str | None = None) -> str:
    """Register a plugin object (a module or an instance with ``@hookimpl`` methods) at runtime.

    Returns its pluggy name. The registry is rebuilt on its next use.
    """
    global _registry
    with _lock:
        manager = get_plugin_manager()
        plugin_name = manager.register(plugin, name=name)
        if plugin_name is None:
            raise SpecterError(f"plugin {plugin!r} is blocked and cannot be registered")
        label = getattr(plugin, "__name__", None) or f"{type(plugin).__module__}.{type(plugin).__qualname__}"
        _sources[plugin_name] = f"registered at runtime ({label})"
        _registry = None
        return plugin_name


def reset_plugins() -> None:
    """Forget the manager, registry and runtime registrations; the next use rebuilds them."""
    global _manager, _registry
    with _lock:
        _manager = None
        _registry = None
        _sources.clear()
        _builtin_names.clear()
        _skipped.clear()


def _collect(manager: pluggy.PluginManager) -> dict[str, dict[str, PluginEntry]]:
    """Call each hook implementation on its own, so every registration knows its source.

    Built-ins go first. A plugin that raises while registering, registers an invalid name or a
    name another plugin already has is disabled as a whole (all its registrations), with a
    ``PluginLoadWarning``; for a built-in any of these is a bug and raises."""
    offers: dict[str, list[tuple[str, object, object]]] = {}
    failed: set[str] = set()
    for kind, hook_name in HOOK_BY_KIND.items():
        for impl in getattr(manager.hook, hook_name).get_hookimpls():
            if impl.hookwrapper or impl.wrapper:
                continue
            offered = offers.setdefault(impl.plugin_name, [])
            arguments = {"register": lambda name, factory, kind=kind, into=offered: into.append((kind, name, factory))}
            try:
                impl.function(**{arg: arguments[arg] for arg in impl.argnames})
            except Exception as exc:
                if impl.plugin_name in _builtin_names:
                    raise
                source = _sources.get(impl.plugin_name, impl.plugin_name)
                _warn(f"skipped plugin {source}: {hook_name} raised {type(exc).__name__}: {exc}")
                failed.add(impl.plugin_name)
    entries: dict[str, dict[str, PluginEntry]] = {kind: {} for kind in KINDS}
    ordered = sorted(offers, key=lambda plugin: plugin not in _builtin_names)
    for plugin_name in ordered:
        if plugin_name in failed:
            continue
        source = _sources.get(plugin_name, plugin_name)
        problem = next(filter(None, (_problem(entries, kind, name, factory, source)
                                     for kind, name, factory in offers[plugin_name])), None)
        if problem is not None:
            if plugin_name in _builtin_names:
                raise SpecterError(problem)
            _warn(f"disabled plugin {source}: {problem}")
            continue
        for kind, name, factory in offers[plugin_name]:
            entries[kind].setdefault(name, PluginEntry(kind, name, factory, source))  # type: ignore[arg-type]
    return entries


def _problem(entries: dict[str, dict[str, PluginEntry]], kind: str, name: object, factory: object,
             source: str) -> str | None:
    """Why registering ``name`` would be wrong, or None."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return f"{source} registered a {kind} named {name!r}; names are lowercase letters, digits, '.', '_', '-'"
    if not callable(factory):
        return f"{source} registered {kind} {name!r} with a factory that is not callable"
    existing = entries[kind].get(name)
    if existing is not None and existing.factory is not factory:
        return (f"{kind} {name!r} is registered twice, by {existing.source} and by {source}; "
                f"uninstall one, or restrict external plugins with {ALLOWLIST_ENV}")
    return None


def registry() -> Registry:
    """The registry of every plugin the manager knows, built once and cached."""
    global _registry
    with _lock:
        if _registry is None:
            manager = get_plugin_manager()
            _registry = Registry(_collect(manager), _skipped)
        return _registry


def format_plugin_list() -> str:
    """Every plugin by kind with its source (what ``specter.run --list-plugins`` prints)."""
    plugins = registry()
    allow = os.environ.get(ALLOWLIST_ENV)
    external = "all" if allow is None else (f"only {allow}" if allow.strip() else "none")
    lines = [f"external plugins (entry-point group {ENTRY_POINT_GROUP!r}, {ALLOWLIST_ENV}): {external}"]
    for kind in KINDS:
        lines.append(f"{kind}:")
        entries = plugins.entries(kind)
        width = max((len(entry.name) for entry in entries), default=0)
        lines.extend(f"  {entry.name:<{width}}  {entry.source}" for entry in entries)
        if not entries:
            lines.append("  (none registered)")
    if plugins.skipped:
        lines.append("skipped:")
        lines.extend(f"  {_one_line(message)}" for message in plugins.skipped)
    return "\n".join(lines)


RECIPE_KEY_BY_KIND = {
    "cache_policy": "offload.cache_policy.name", "link": "offload.link.kind",
    "predictor": "speculation.predictor.name", "governor": "speculation.governor.name", "engine": "engine",
}


def call_plugin(kind: str, plugin: object, method: str, *args: Any, **kwargs: Any) -> Any:
    """``plugin.method(*args, **kwargs)``; an exception other than ``SpecterError`` becomes a
    one-line ``SpecterError`` naming the recipe key, the plugin and the method (the original
    chained behind it, which the CLI's ``--debug`` prints)."""
    try:
        return getattr(plugin, method)(*args, **kwargs)
    except SpecterError:
        raise
    except Exception as error:
        name = getattr(plugin, "name", None) or getattr(plugin, "kind", None) or type(plugin).__name__
        raise SpecterError(_one_line(f"{RECIPE_KEY_BY_KIND.get(kind, kind)}: {kind} plugin {name!r} raised "
                                     f"{type(error).__name__} in {method}(): {error}")) from error
