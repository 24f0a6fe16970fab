"""The ``draft`` predictor: the INT4 draft's own routing predicts the target's experts.

Contract: while the draft runs its k steps, every MoE layer's top-k choice (and gate weight, the
confidence) for every drafted position goes into the scheduler's lookahead buffer, and the
scheduler is pumped so prefetches start while the draft is still running. Verification runs the
target over the same positions, so the draft's choice at (position, layer) predicts the
target's. Requires the speculative engine (``needs_draft``).
"""

from __future__ import annotations

import torch

from specter.predictors.base import Predictor


class DraftPredictor(Predictor):
    name = "draft"
    needs_draft = True

    def observe(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, mode: str) -> None:
        if mode != "draft" or self.scheduler is None:
            return
        self.scheduler.add(layer, top_k_index.flatten().tolist(), top_k_weights.flatten().float().tolist())
        self.scheduler.pump()
