"""Plugin hook specifications (pluggy project name ``specter``) and what each kind is offered.

Contract: each hook receives a ``register`` callable and calls it once per plugin it provides,
as ``register(name: str, factory: Callable[..., object])``. Built-in plugins register through
these same hooks; third-party packages expose a module (or object) with ``@hookimpl`` functions
under the ``specter`` entry-point group. Factories are called with the plugin's recipe options as
keyword arguments, plus the context keywords of their kind (``CONTEXT_KEYWORDS``) that their
signature names, and return the plugin object whose interface the hook's docstring names.

The tables beside the hooks: each kind's hook (``HOOK_BY_KIND``), recipe key
(``RECIPE_KEY_BY_KIND``), context keywords and naming attribute. How a factory is called and how a
registered object is checked: ``specter.plugin_factories``.
"""

from __future__ import annotations

from typing import Callable

import pluggy

PROJECT_NAME = "specter"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[[str, Callable[..., object]], None]

HOOK_BY_KIND = {
    "cache_policy": "register_cache_policies",
    "link": "register_links",
    "predictor": "register_predictors",
    "governor": "register_governors",
    "engine": "register_engines",
}
KINDS = tuple(HOOK_BY_KIND)
RECIPE_KEY_BY_KIND = {
    "cache_policy": "offload.cache_policy.name", "link": "offload.link.kind",
    "predictor": "speculation.predictor.name", "governor": "speculation.governor.name", "engine": "engine",
}
# What the engine offers each kind's factory besides its options (docs/plugins.md, the table);
# specter.build passes exactly these. They are never options.
CONTEXT_KEYWORDS: dict[str, tuple[str, ...]] = {
    "cache_policy": (),
    "link": ("device",),
    "predictor": ("n_experts", "top_k"),
    "governor": ("k", "n_experts", "top_k", "cache_slots_per_layer"),
    "engine": ("recipe", "parts"),
}
# The attribute that names a plugin object in reports and errors ("name" for the other kinds).
NAME_ATTRIBUTE = {"link": "kind"}


@hookspec
def register_cache_policies(register: Register) -> None:
    """Register cache policies: factories returning a ``specter.policies.base.CachePolicy``."""


@hookspec
def register_links(register: Register) -> None:
    """Register links (host-to-device movers): factories returning a ``specter.memory.link.Link``."""


@hookspec
def register_predictors(register: Register) -> None:
    """Register expert predictors: factories returning a ``specter.predictors.base.Predictor``."""


@hookspec
def register_governors(register: Register) -> None:
    """Register speculation governors: factories returning a ``specter.decode.governor.Governor``."""


@hookspec
def register_engines(register: Register) -> None:
    """Register engines: factories taking ``recipe`` and ``parts`` (a ``specter.build.EngineParts``)
    and returning a ``specter.decode.engine.Engine``."""
