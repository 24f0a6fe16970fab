"""How plugin factories are called and registered objects checked (the registry's rules,
``specter.plugins``; the hooks and per-kind tables are ``specter.hookspecs``).

Contract:
- ``factory_arguments(kind, name, factory, options, context, key)`` checks a plugin's recipe
  options against its factory's signature (an option it does not name is an error even behind
  ``**kwargs``, unless the factory sets ``accepts_any_options = True``; every such option is
  named; a context keyword given as an option is an error) and returns the keyword arguments to
  call it with: the options and the context keywords its signature names (all of them with
  ``**kwargs``). Errors are one-line ``SpecterError``s starting with ``key``.
- ``describe_options(factory, context)`` lists the options a factory takes, for ``--list-plugins``.
- ``call_plugin(kind, plugin, method, ...)`` calls a plugin's method, turning an exception other
  than ``SpecterError`` into a one-line ``SpecterError`` naming the recipe key (``specter.plugins``
  exports it too, where the core imports it from).
- ``hook_problem(manager, plugin)`` says why a registered object is no usable Specter plugin: a
  ``@hookimpl`` whose name is no hook (a misspelling, which pluggy alone accepts silently), or no
  ``@hookimpl`` at all (hook functions left unmarked); None when it is fine.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable, Iterable

import pluggy

from specter.errors import SpecterError, bounded_repr
from specter.hookspecs import HOOK_BY_KIND, RECIPE_KEY_BY_KIND


def hook_problem(manager: pluggy.PluginManager, plugin: object) -> str | None:
    """Why ``plugin`` (already registered with ``manager``) would register nothing as meant, or None."""
    hooks = tuple(HOOK_BY_KIND.values())
    callers = manager.get_hookcallers(plugin) or []
    for caller in callers:
        if caller.name in hooks:
            continue
        if all(impl.optionalhook for impl in caller.get_hookimpls() if impl.plugin is plugin):
            continue
        close = difflib.get_close_matches(caller.name, hooks, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}? " if close else ""
        return f"@hookimpl {caller.name} is not a Specter hook; {hint}hooks: {', '.join(hooks)}"
    if callers:
        return None
    unmarked = [hook for hook in hooks if callable(getattr(plugin, hook, None))]
    if unmarked:
        return (f"{', '.join(unmarked)} is not marked with @specter.hookspecs.hookimpl, so pluggy does not "
                f"see it; decorate it")
    return f"it implements none of the hooks ({', '.join(hooks)}) with @specter.hookspecs.hookimpl"


def factory_arguments(kind: str, name: str, factory: Callable[..., object], options: dict[str, Any],
                      context: dict[str, Any], key: str | None = None) -> dict[str, Any]:
    """The keyword arguments to call ``factory`` with: ``options`` and the ``context`` keywords its
    signature names (all of them if it takes ``**kwargs``); ``SpecterError`` (one line, starting
    with ``key``) for an option that is a context keyword, one the factory does not take (all
    such named), or options that do not bind to its signature."""
    where = f"{key}: " if key else ""
    reserved = sorted(set(options) & set(context))
    if reserved:
        raise SpecterError(f"{where}option {reserved[0]!r} of {kind} {name!r} is set by the engine; remove it")
    signature = _signature(factory)
    accepted = _option_names(signature, context)
    unknown = [option for option in options if accepted is not None and option not in accepted]
    allowed = ", ".join(accepted or []) or "(none)"
    if unknown and not getattr(factory, "accepts_any_options", False):
        listed = ", ".join(bounded_repr(option) for option in unknown)
        raise SpecterError(_one_line(f"{where}unknown option{'s' if len(unknown) > 1 else ''} {listed} for {kind} "
                                     f"{name!r}; accepted options: {allowed}"))
    kwargs = {**_offered(signature, context), **options}
    try:
        if signature is not None:  # without a readable signature the call itself is the check
            signature.bind(**kwargs)
    except TypeError as exc:
        raise SpecterError(_one_line(f"{where}bad options {bounded_repr(options)} for {kind} {name!r} ({exc}); "
                                     f"accepted options: {allowed}")) from None
    return kwargs


def describe_options(factory: Callable[..., object], context: Iterable[str]) -> str:
    """``a=1, b`` for a factory taking options ``a`` (default 1) and ``b`` (required); ``any``
    for one that sets ``accepts_any_options``; ``""`` for none, or an unreadable signature."""
    signature = _signature(factory)
    if signature is None:
        return ""
    if getattr(factory, "accepts_any_options", False):
        return "any"
    names = _option_names(signature, tuple(context)) or []
    parameters = signature.parameters
    return ", ".join(name if parameters[name].default is inspect.Parameter.empty
                     else f"{name}={bounded_repr(parameters[name].default)}" for name in names)


def _signature(factory: Callable[..., object]) -> inspect.Signature | None:
    """The factory's signature, None when it cannot be read (some builtins)."""
    try:
        return inspect.signature(factory)
    except (TypeError, ValueError):
        return None


def _option_names(signature: inspect.Signature | None, context: Iterable[str]) -> list[str] | None:
    """The option names a factory takes (its parameters, context keywords and ``self`` excluded);
    None when its signature cannot be read."""
    if signature is None:
        return None
    plain = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in signature.parameters.values()
            if p.kind in plain and p.name not in context and p.name != "self"]


def _offered(signature: inspect.Signature | None, context: dict[str, Any]) -> dict[str, Any]:
    """The context keywords a factory names (all of them if it takes ``**kwargs`` or its
    signature cannot be read)."""
    if signature is None:
        return dict(context)
    parameters = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(context)
    return {name: value for name, value in context.items() if name in parameters}


def _one_line(message: str) -> str:
    """``message`` on one line (its whitespace runs made single spaces)."""
    return " ".join(message.split())


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
