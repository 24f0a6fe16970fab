"""The module this package's ``specter`` entry point names: one ``@hookimpl`` per plugin kind.

Each hook receives ``register`` and calls it with a lowercase name and a factory; the factory's
signature is the plugin's option schema (see docs/plugins.md in the Specter repository).
"""

from __future__ import annotations

from specter.hookspecs import hookimpl

from specter_example_plugins.counting_link import CountingLink
from specter_example_plugins.fifo import FifoPolicy
from specter_example_plugins.greedy_k import GreedyKGovernor
from specter_example_plugins.previous import PreviousTokenPredictor


@hookimpl
def register_cache_policies(register) -> None:
    register("example-fifo", FifoPolicy)


@hookimpl
def register_links(register) -> None:
    register("example-counting", CountingLink)


@hookimpl
def register_predictors(register) -> None:
    register("example-previous", PreviousTokenPredictor)


@hookimpl
def register_governors(register) -> None:
    register("example-greedy-k", GreedyKGovernor)


def warm_engine(parts):
    """Engine factories are offered ``recipe`` and ``parts``; engines take no options."""
    from specter_example_plugins.warm_engine import WarmEngine  # here, so listing plugins stays cheap

    return WarmEngine(*parts.offloaded)


@hookimpl
def register_engines(register) -> None:
    register("example-warm", warm_engine)
