"""``example-previous``: the target's next step needs the experts its previous token used.

While the target runs (prefill, a plain step or verification: mode ``"target"``) the predictor
remembers, per MoE layer, the experts the last position was routed to. While the draft runs
(mode ``"draft"``, engine ``specter``) it hands those experts to the prefetch scheduler for the
same layer and pumps it, so the copies overlap the draft. Consecutive tokens share many
experts, so this is a cheap, model-free prediction (no router, no draft routing).

Option ``confidence`` (default 0.5, in [0, 1]): the score the predictions carry (cache policies
see it in ``on_hints`` and ``admit_prefetch``). Context keyword ``top_k``: how many experts a
token is routed to; at most that many are predicted per layer.
"""

from __future__ import annotations

from specter.predictors.base import Predictor


class PreviousTokenPredictor(Predictor):
    name = "example-previous"

    def __init__(self, confidence: float = 0.5, top_k: int = 2) -> None:
        super().__init__()  # sets self.scheduler and self.layers; bind() fills them
        if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 <= confidence <= 1:
            raise ValueError(f"confidence must be a number in [0, 1], got {confidence!r}")
        self.confidence = float(confidence)
        self.top_k = top_k
        self._previous: dict[int, list[int]] = {}  # MoE layer -> experts of the last target position
        self.observed = self.predicted = self.resets = 0  # counters, for tests and curiosity

    def observe(self, layer, hidden, top_k_index, top_k_weights, mode) -> None:
        self.observed += 1
        if mode == "target":
            self._previous[layer] = top_k_index[-1].tolist()[: self.top_k]
            return
        experts = self._previous.get(layer)
        if mode == "draft" and experts and self.scheduler is not None:
            self.scheduler.add(layer, experts, [self.confidence] * len(experts))
            self.scheduler.pump()  # start copies while the draft is still running
            self.predicted += len(experts)

    def reset(self) -> None:
        self._previous.clear()  # a new prompt: the last prompt's routing says nothing
        self.resets += 1
