"""Specter: fast Mixture-of-Experts inference when the experts do not fit on the device.

Public API: ``specter.load(recipe)`` -> engine with ``generate(prompts)``; ``specter.run_recipe(recipe)``
(what the CLI does, with the losslessness check); ``specter.offload(model, expert_budget=...)``
for a transformers model you already loaded. See README.md.
"""

from specter.quiet import quiet_third_party
from specter.version import __version__

quiet_third_party()

__all__ = ["load", "run_recipe", "offload", "__version__"]


def __getattr__(name: str):
    if name in ("load", "run_recipe", "offload"):
        from specter import api

        return getattr(api, name)
    raise AttributeError(f"module 'specter' has no attribute {name!r}")
