"""``example-warm``: the ``ondemand`` engine with its expert cache filled before the first prompt.

Every MoE layer gets the same share of the cache's slots, filled with its lowest-numbered
experts, so the first tokens hit instead of all missing. Built from the recipe's parts
(``specter.build.EngineParts``): the offloaded model, its host store, and the cache behind the
recipe's link and cache policy.
"""

from __future__ import annotations

from specter.decode.engine import OffloadedEngine


class WarmEngine(OffloadedEngine):
    name = "example-warm"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        per_layer = self.cache.n_slots // len(self.layers)
        self.preloaded = [(info.layer, expert) for info in self.layers for expert in range(per_layer)]
        self.cache.preload(self.preloaded)  # a warm start: not counted as transfers
