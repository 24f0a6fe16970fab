"""The ``ngram`` predictor: prompt-lookup drafting, with the experts the copied text used last time.

Contract:
- ``propose(context_ids, k)`` finds the most recent earlier occurrence of the context's longest
  suffix n-gram (n from ``max_ngram`` down to ``min_ngram``) and proposes up to k tokens that
  followed it (fewer when the context ends first; ``[]`` when no suffix n-gram recurs). The
  speculative engine (``specter``) verifies these instead of running the INT4 draft.
- Routing memory: in ``"target"`` mode the predictor records every MoE layer's top-k experts per
  absolute position of the sequence. The engine calls ``reset()`` when a prompt starts and
  ``rollback(length)`` after cropping its KV cache to ``length`` positions, so positions stay
  those of the KV cache. A forward pass is recognised by its first MoE layer, which appends its
  T positions at the current length.
- When ``propose`` copies the tokens after a match ending at position j, verification will run the
  target over the last context token (the match's twin, j) and the copies (j+1, ...). For each
  layer, the experts recorded at those positions are added to the bound scheduler with
  confidence 1.0 and flushed: the copied text was routed that way last time.
"""

from __future__ import annotations

import torch

from specter.predictors.base import Predictor


class NgramPredictor(Predictor):
    drafts_tokens = True
    name = "ngram"
    needs_draft = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        super().__init__()
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._first_layer: int | None = None  # the layer that opens every forward pass
        self.reset()

    def bind(self, scheduler, layers) -> None:
        super().bind(scheduler, layers)
        self._first_layer = min(layers) if layers else None

    def reset(self) -> None:
        self._routes: dict[int, list[list[int]]] = {}  # layer -> position -> expert ids
        self._length = 0  # positions recorded by completed-or-running target passes
        self._pass_start = 0

    @property
    def length(self) -> int:
        """Positions recorded: the KV cache's length once the engine has rolled back."""
        return self._length

    def routing(self, layer: int) -> list[list[int]]:
        """The target's top-k experts recorded at ``layer``, one list per position."""
        return self._routes.get(layer, [])

    def rollback(self, length: int) -> None:
        self._length = min(self._length, length)
        for routes in self._routes.values():
            del routes[length:]

    def observe(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, mode: str) -> None:
        if mode != "target":
            return
        if self._first_layer is None:
            self._first_layer = layer
        if layer == self._first_layer:
            self._pass_start = self._length
            self._length += top_k_index.shape[0]
        routes = self._routes.setdefault(layer, [])
        del routes[self._pass_start:]
        if len(routes) < self._pass_start:  # a layer that missed earlier passes: keep positions aligned
            routes.extend([] for _ in range(self._pass_start - len(routes)))
        routes.extend(top_k_index.tolist())

    def match(self, context_ids: list[int]) -> int | None:
        """End position j of the most recent earlier occurrence of the longest suffix n-gram."""
        length = len(context_ids)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            suffix = context_ids[length - n:]
            last = suffix[-1]
            for j in range(length - 2, n - 2, -1):  # occurrence ends at j < length - 1
                if context_ids[j] == last and context_ids[j - n + 1 : j + 1] == suffix:
                    return j
        return None

    def propose(self, context_ids: list[int], k: int) -> list[int]:
        j = self.match(context_ids) if k > 0 else None
        if j is None:
            return []
        proposed = list(context_ids[j + 1 : j + 1 + k])
        self._predict(range(j, j + 1 + len(proposed)))
        return proposed

    def _predict(self, positions: range) -> None:
        if self.scheduler is None:
            return
        for layer in sorted(self._routes):
            routes = self._routes[layer]
            experts = sorted({e for p in positions if p < len(routes) for e in routes[p]})
            if experts:
                self.scheduler.add(layer, experts, [1.0] * len(experts))
        self.scheduler.flush()
