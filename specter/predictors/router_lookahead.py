"""The ``router-lookahead`` predictor: layer L's hidden state through layer L+1's router.

Contract: when the target computes MoE layer L, the hidden state entering its experts is passed
through the next MoE layer's router weights (plus its bias, if any); the top-k experts of those
logits, with their softmax probabilities as confidence, are prefetched at once for layer L+1
(layer L's own routed experts protected meanwhile: ``PrefetchScheduler.reading``).
No speculation is needed: it works with plain decoding (engine ``router-lookahead``) and as an
extra source of hints during verification. It cannot predict the first MoE layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specter.predictors.base import Predictor


class RouterLookaheadPredictor(Predictor):
    name = "router-lookahead"
    needs_draft = False

    def bind(self, scheduler, layers) -> None:
        super().bind(scheduler, layers)
        order = sorted(layers)
        self._next = {order[i]: layers[order[i + 1]] for i in range(len(order) - 1)}

    def predict_next(self, layer: int, hidden: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """(next layer, expert ids [T, k], confidences [T, k]) or None for the last MoE layer."""
        following = self._next.get(layer)
        if following is None or following.router is None:
            return None
        router = following.router
        logits = F.linear(hidden.to(router.weight.dtype), router.weight, getattr(router, "bias", None))  # [T, E]
        probs = logits.float().softmax(dim=-1)
        confidence, experts = probs.topk(following.top_k, dim=-1)
        return following.layer, experts, confidence

    def observe(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, mode: str) -> None:
        if mode != "target" or self.scheduler is None:
            return
        predicted = self.predict_next(layer, hidden)
        if predicted is None:
            return
        next_layer, experts, confidence = predicted
        ids = torch.cat([top_k_index.flatten(), experts.flatten().to(top_k_index.dtype)]).tolist()  # one transfer
        routed = top_k_index.numel()
        self.scheduler.reading(layer, ids[:routed])  # not evicted by the prefetch below
        self.scheduler.add(next_layer, ids[routed:], confidence.flatten().tolist())
        self.scheduler.flush()
