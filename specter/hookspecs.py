"""Plugin hook specifications (pluggy project name ``specter``).

Contract: each hook receives a ``register`` callable and calls it once per plugin it provides,
as ``register(name: str, factory: Callable[..., object])``. Built-in plugins register through
these same hooks; third-party packages expose a module with ``@hookimpl`` functions under the
``specter`` entry-point group. Factories are called with the plugin's recipe options as keyword
arguments and return the plugin object whose interface the hook's docstring names.
"""

from __future__ import annotations

from typing import Callable

import pluggy

PROJECT_NAME = "specter"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[[str, Callable[..., object]], None]


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
