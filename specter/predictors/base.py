"""The expert-predictor interface: who tells the prefetch scheduler what the target needs next.

Contract: a predictor is created once per engine through the plugin registry, then
``bind(scheduler, layers)`` hands it the engine's ``PrefetchScheduler`` and its MoE layers
(``{layer index: specter.layout.MoELayer}``). The engine calls ``observe(layer, hidden,
top_k_index, top_k_weights, mode)`` every time an MoE layer routes tokens — ``mode`` is
``"draft"`` while the INT4 draft runs and ``"target"`` during prefill, decode and verification —
and the predictor feeds ``scheduler.add(layer, experts, confidences)`` (then ``pump()`` to start
transfers as bandwidth allows, or ``flush()`` to issue everything now). ``needs_draft`` says
whether the predictor only works inside the speculative (``specter``) engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from specter.layout import MoELayer
    from specter.scheduler import PrefetchScheduler


class BasePredictor:
    name = "base"
    needs_draft = False

    def __init__(self) -> None:
        self.scheduler: PrefetchScheduler | None = None
        self.layers: dict[int, MoELayer] = {}

    def bind(self, scheduler: PrefetchScheduler, layers: dict[int, MoELayer]) -> None:
        self.scheduler = scheduler
        self.layers = layers

    def observe(self, layer: int, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, mode: str) -> None:
        """One MoE layer's routing: ``hidden`` [T, H] entering its experts, ``top_k_index`` and
        ``top_k_weights`` [T, top_k]. The default predicts nothing."""
