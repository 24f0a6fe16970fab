"""The expert-predictor interface: who tells the prefetch scheduler what the target needs next.

Contract: a predictor is created once per engine through the plugin registry, then
``bind(scheduler, layers)`` hands it the engine's ``PrefetchScheduler`` and its MoE layers
(``{layer index: specter.model.layout.MoELayer}``). The engine calls ``observe(layer, hidden,
top_k_index, top_k_weights, mode)`` every time an MoE layer routes tokens — ``mode`` is
``"draft"`` while the INT4 draft runs and ``"target"`` during prefill, decode and verification —
and the predictor feeds ``scheduler.add(layer, experts, confidences)`` (then ``pump()`` to start
transfers as bandwidth allows, or ``flush()`` to issue everything now). ``needs_draft`` says
whether the predictor only works inside the speculative (``specter``) engine.

The whole protocol is ``Predictor``; subclass it (the engine refuses other objects) and override
what you need: ``observe`` (required in practice: the default predicts nothing), ``bind``,
``reset()`` (a new prompt starts), ``rollback(length)`` (verification kept ``length`` positions;
forget anything observed past them) and, for a predictor that drafts tokens itself instead of
the INT4 model (``drafts_tokens = True``, e.g. ``ngram``), ``propose(context_ids, k)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from specter.model.layout import MoELayer
    from specter.memory.scheduler import PrefetchScheduler


class Predictor:
    """Base of every predictor (built-in or third-party); see the module docstring."""

    name = "base"
    needs_draft = False  # works only inside the specter engine (it reads the draft's routing)
    drafts_tokens = False  # proposes the draft tokens itself through ``propose``

    def __init__(self) -> None:
        self.scheduler: PrefetchScheduler | None = None
        self.layers: dict[int, MoELayer] = {}

    def bind(self, scheduler: PrefetchScheduler, layers: dict[int, MoELayer]) -> None:
        self.scheduler = scheduler
        self.layers = layers

    def observe(self, layer: int, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, mode: str) -> None:
        """One MoE layer's routing: ``hidden`` [T, H] entering its experts, ``top_k_index`` and
        ``top_k_weights`` [T, top_k]. The default predicts nothing."""

    def reset(self) -> None:
        """A new prompt starts: forget per-sequence state. The default keeps none."""

    def rollback(self, length: int) -> None:
        """Verification kept the first ``length`` positions; drop state observed beyond them."""

    def propose(self, context_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens following ``context_ids`` (only when ``drafts_tokens``)."""
        raise NotImplementedError(f"predictor {self.name!r} sets drafts_tokens but has no propose()")


BasePredictor = Predictor  # the name used before the protocol was made explicit
