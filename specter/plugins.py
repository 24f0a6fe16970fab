"""The plugin registry: cache policies, links, predictors, governors and engines, found through pluggy.

Contract: ``get_plugin_manager()`` builds one ``pluggy.PluginManager`` per process (lazily) holding
the hookspecs of ``specter.hookspecs``, the built-in modules ``BUILTIN_PLUGIN_MODULES`` and the
modules of the ``specter`` entry-point group; built-ins register through the same hooks.
``registry()`` asks every hook implementation for its plugins: a ``Registry`` of
``(kind, name) -> factory``.

- ``SPECTER_PLUGINS`` (read when the manager is built): unset loads every entry point, ``""``
  none, ``"a,b"`` only those named ``a`` and ``b`` (a name no entry point has is warned about).
- A third-party plugin that fails to import, raises in a hook, marks a name that is no Specter hook,
  implements no hook, registers an invalid name or a name already taken (by a built-in or an
  earlier plugin) is skipped or disabled as a whole with one ``PluginLoadWarning`` (however often
  the registry is rebuilt) and listed under "skipped" by ``--list-plugins``. The same faults in a
  built-in raise; registering the identical factory again is ignored.
- ``Registry.get`` of an unknown name raises ``UnknownPluginError`` listing the known names and,
  where it applies, the disabled plugin providing it or the entry points ``SPECTER_PLUGINS`` left out.
- ``Registry.create`` calls the factory with the recipe options and the context keywords its
  signature names (``plugin_factories.factory_arguments``; ``check_options`` checks without creating).
  With ``expect`` it refuses an object of another type, and names one whose ``name`` (a link:
  ``kind``) is still ``expect``'s default after the registered name, so reports and errors do.
- ``register_plugin(obj)`` adds a plugin object at runtime (the same object again: nothing
  happens; an object that is no Specter plugin: ``SpecterError``); ``reset_plugins()`` forgets
  the manager, runtime registrations included, so tests start clean and see new env vars.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import threading
import warnings
from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Any, Callable

import pluggy

from specter import hookspecs, plugin_factories
from specter.plugin_factories import _one_line
from specter.errors import SpecterError, UnknownPluginError
from specter.hookspecs import CONTEXT_KEYWORDS, HOOK_BY_KIND, KINDS, NAME_ATTRIBUTE

BUILTIN_PLUGIN_MODULES = (
    "specter.policies", "specter.memory.links", "specter.predictors", "specter.decode.governors", "specter.decode.engines",
)
ENTRY_POINT_GROUP = "specter"
ALLOWLIST_ENV = "SPECTER_PLUGINS"
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
    """Plugins by kind and name, built by ``registry()``, read-only afterwards; ``skipped``: why each
    plugin was skipped, ``disabled``: ``(kind, name) -> source`` of what disabled plugins offered,
    ``left_out``: the entry points ``SPECTER_PLUGINS`` did not load."""

    def __init__(self, entries: dict[str, dict[str, PluginEntry]], skipped: list[str],
                 disabled: dict[tuple[str, str], str] | None = None, left_out: list[str] | None = None) -> None:
        self._entries = entries
        self.skipped = list(skipped)
        self.disabled = dict(disabled or {})
        self.left_out = list(left_out or [])

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
        """The factory of plugin ``name``; ``UnknownPluginError`` (naming ``key``, and why a name
        a third-party plugin would provide is missing) if none."""
        plugins = self._kind(kind)
        if name not in plugins:
            error = UnknownPluginError(kind, name, list(plugins), key=key)
            hint = self.why_missing(kind, name)
            if hint:
                error.args = (f"{error.args[0]}; {hint}",)
            raise error
        return plugins[name].factory

    def why_missing(self, kind: str, name: str) -> str:
        """Why a third-party plugin may be missing ``name`` (``""`` when nothing says): a disabled
        plugin offered it, ``SPECTER_PLUGINS`` left entry points out, or plugins were skipped."""
        if (kind, name) in self.disabled:
            return f"{self.disabled[kind, name]} provides it but is disabled (--list-plugins says why, under skipped)"
        allow = os.environ.get(ALLOWLIST_ENV)
        if allow is not None and self.left_out:
            return (f"{ALLOWLIST_ENV}={allow!r} left out the entry points {', '.join(self.left_out)}; "
                    f"add the one providing it")
        if self.skipped:
            return f"{len(self.skipped)} third-party plugin(s) were skipped (--list-plugins says why)"
        return ""

    def source(self, kind: str, name: str) -> str:
        """Where plugin ``name`` came from (built-in module or distribution)."""
        self.get(kind, name)
        return self._entries[kind][name].source

    def options(self, kind: str, name: str) -> str:
        """The options plugin ``name`` takes, as ``a=1, b`` (``any``; ``""`` for none or unknown)."""
        return plugin_factories.describe_options(self.get(kind, name), CONTEXT_KEYWORDS[kind])

    def check_options(self, kind: str, name: str, options: dict[str, Any] | None, key: str | None = None) -> None:
        """The checks ``create`` makes of ``options`` (unknown, engine-set, unbindable), against
        the context keywords the engine offers ``kind``, without calling the factory."""
        context = dict.fromkeys(CONTEXT_KEYWORDS.get(kind, ()))
        plugin_factories.factory_arguments(kind, name, self.get(kind, name, key=key), dict(options or {}), context, key)

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
        where = f"{key}: " if key else ""
        factory = self.get(kind, name, key=key)
        kwargs = plugin_factories.factory_arguments(kind, name, factory, dict(options or {}), context, key)
        try:
            made = factory(**kwargs)
        except ValueError as exc:
            raise SpecterError(_one_line(f"{where}{kind} {name!r} rejected its options: {exc}")) from None
        except SpecterError:
            raise
        except Exception as exc:
            raise SpecterError(_one_line(f"{where}{kind} plugin {name!r} ({self.source(kind, name)}) failed while "
                                         f"starting: {type(exc).__name__}: {exc}")) from exc
        if expect is None:
            return made
        if not isinstance(made, expect):
            raise SpecterError(f"{where}{kind} plugin {name!r} returned a {type(made).__name__}, which is not a "
                               f"{expect.__module__}.{expect.__qualname__}; subclass it")
        attribute = NAME_ATTRIBUTE.get(kind, "name")
        if getattr(made, attribute, None) == getattr(expect, attribute, None):
            try:  # left at the base class's default: name it as the recipe does
                setattr(made, attribute, name)
            except AttributeError:
                pass
        return made


_lock = threading.RLock()
_manager: pluggy.PluginManager | None = None
_registry: Registry | None = None
_sources: dict[str, str] = {}
_builtin_names: set[str] = set()
_load_problems: list[str] = []  # found while building the manager
_left_out: list[str] = []  # entry points SPECTER_PLUGINS did not load
_warned: set[str] = set()


def _warn(message: str, into: list[str] | None = None) -> None:
    """Record ``message`` (in ``into``, else the load problems) and warn about it once per manager."""
    message = _one_line(message)
    (_load_problems if into is None else into).append(message)
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, PluginLoadWarning, stacklevel=3)


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
    value = os.environ.get(ALLOWLIST_ENV)
    allowed = None if value is None else {name.strip() for name in value.split(",") if name.strip()}
    try:
        entry_points = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    except Exception as exc:  # a broken installation must not stop the run
        _warn(f"cannot list entry points of group {ENTRY_POINT_GROUP!r}: {type(exc).__name__}: {exc}")
        return
    seen = set()
    for entry_point in entry_points:
        if allowed is not None and entry_point.name not in allowed:
            _left_out.append(entry_point.name)
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
        problem = plugin_factories.hook_problem(manager, plugin)
        if problem is not None:
            manager.unregister(plugin)
            _warn(f"skipped plugin {source}: {problem}")
            continue
        _sources[plugin_name] = source
    for name in sorted((allowed or set()) - seen):
        _warn(f"{ALLOWLIST_ENV} names {name!r}, but no entry point of group {ENTRY_POINT_GROUP!r} does"
              f"{_allowlist_hint(name, entry_points)}")


def _allowlist_hint(name: str, entry_points: list) -> str:
    """What ``SPECTER_PLUGINS`` probably meant by ``name``: a distribution's entry points, or a
    close entry-point name."""
    of_dist = [ep.name for ep in entry_points if getattr(getattr(ep, "dist", None), "name", None) == name]
    if of_dist:
        return f"; {name!r} is a distribution: name its entry points instead ({', '.join(of_dist)})"
    close = difflib.get_close_matches(name, [ep.name for ep in entry_points], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


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

    Returns its pluggy name; registering the same object again returns it and does nothing. An
    object that is no Specter plugin (``plugin_factories.hook_problem``), a hook with a wrong signature
    or a ``name`` already taken raise ``SpecterError``. The registry is rebuilt on its next use.
    """
    global _registry
    with _lock:
        manager = get_plugin_manager()
        if manager.is_registered(plugin):
            return str(manager.get_name(plugin))
        label = getattr(plugin, "__name__", None) or f"{type(plugin).__module__}.{type(plugin).__qualname__}"
        wanted = name or manager.get_canonical_name(plugin)
        if manager.has_plugin(wanted):
            raise SpecterError(f"register_plugin({label}): the name {wanted!r} is taken by "
                               f"{_sources.get(wanted, wanted)}; pass another name=, or call reset_plugins() first")
        try:
            plugin_name = manager.register(plugin, name=name)
        except (ValueError, pluggy.PluginValidationError) as exc:
            raise SpecterError(_one_line(f"register_plugin({label}): {exc}")) from None
        if plugin_name is None:
            raise SpecterError(f"plugin {label} is blocked and cannot be registered")
        problem = plugin_factories.hook_problem(manager, plugin)
        if problem is not None:
            manager.unregister(plugin)
            raise SpecterError(f"register_plugin({label}): {problem}")
        _sources[plugin_name] = f"registered at runtime ({label})"
        _registry = None
        return plugin_name


def reset_plugins() -> None:
    """Forget the manager, registry and runtime registrations; the next use rebuilds them."""
    global _manager, _registry
    with _lock:
        _manager = None
        _registry = None
        for state in (_sources, _builtin_names, _load_problems, _left_out, _warned):
            state.clear()


def _collect(manager: pluggy.PluginManager, problems: list[str],
             disabled: dict[tuple[str, str], str]) -> dict[str, dict[str, PluginEntry]]:
    """Call each hook implementation on its own, so every registration knows its source.

    Built-ins go first. A plugin that raises while registering, registers an invalid name or a
    name another plugin already has is disabled as a whole (all its registrations), with a
    ``PluginLoadWarning`` and its message in ``problems`` (and what it offered in ``disabled``);
    for a built-in any of these is a bug and raises."""
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
                _warn(f"skipped plugin {source}: {hook_name} raised {type(exc).__name__}: {exc}", problems)
                failed.add(impl.plugin_name)
    entries: dict[str, dict[str, PluginEntry]] = {kind: {} for kind in KINDS}
    ordered = sorted(offers, key=lambda plugin: plugin not in _builtin_names)
    for plugin_name in ordered:
        source = _sources.get(plugin_name, plugin_name)
        problem = None if plugin_name in failed else next(
            filter(None, (_problem(entries, kind, name, factory, source) for kind, name, factory in offers[plugin_name])),
            None)
        if problem is not None and plugin_name in _builtin_names:
            raise SpecterError(problem)
        if problem is not None or plugin_name in failed:
            if problem is not None:
                _warn(f"disabled plugin {source}: {problem}", problems)
            disabled.update({(kind, name): source for kind, name, _ in offers[plugin_name] if isinstance(name, str)})
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
        remedy = ("rename yours" if source.startswith("registered at runtime")
                  else f"uninstall one, or restrict external plugins with {ALLOWLIST_ENV}")
        return f"{kind} {name!r} is registered twice, by {existing.source} and by {source}; {remedy}"
    return None


def registry() -> Registry:
    """The registry of every plugin the manager knows, built once and cached."""
    global _registry
    with _lock:
        if _registry is None:
            manager = get_plugin_manager()
            problems: list[str] = []
            disabled: dict[tuple[str, str], str] = {}
            entries = _collect(manager, problems, disabled)
            _registry = Registry(entries, _load_problems + problems, disabled, _left_out)
        return _registry


def format_plugin_list() -> str:
    """Every plugin by kind with its source and, on the next line, the options it takes (what
    ``specter.run --list-plugins`` prints)."""
    plugins = registry()
    allow = os.environ.get(ALLOWLIST_ENV)
    external = "all" if allow is None else (f"only {allow}" if allow.strip() else "none")
    lines = [f"external plugins (entry-point group {ENTRY_POINT_GROUP!r}, {ALLOWLIST_ENV}): {external}"]
    for kind in KINDS:
        lines.append(f"{kind}:")
        entries = plugins.entries(kind)
        width = max((len(entry.name) for entry in entries), default=0)
        for entry in entries:
            lines.append(f"  {entry.name:<{width}}  {entry.source}")
            options = plugins.options(kind, entry.name)
            if options:
                lines.append(f"  {'':<{width}}    options: {options}")
        if not entries:
            lines.append("  (none registered)")
    if plugins.skipped:
        lines.append("skipped:")
        lines.extend(f"  {_one_line(message)}" for message in plugins.skipped)
    return "\n".join(lines)


call_plugin = plugin_factories.call_plugin  # the core (cache, scheduler, speculative engine) calls plugins through it
