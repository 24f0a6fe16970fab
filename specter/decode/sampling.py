"""Turning target logits into the distribution Specter samples from, and sampling it.

``logits_to_probs`` defines "the target's distribution": temperature, then top-k, then top-p
(nucleus), each step renormalising what it keeps. Speculative sampling (``specter.decode.acceptance``)
must reproduce exactly this distribution, so the engine computes both the draft's and the
target's probabilities through this one function.

Greedy decoding (``temperature == 0``) is the limit of the above: the distribution is a point
mass on the argmax (the lowest index among ties, as ``torch.argmax``). With that convention exact
rejection sampling over greedy probabilities reduces to greedy verification.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "logits_to_probs", "sample"]

_NUCLEUS_CANDIDATES = 1024


@dataclass(frozen=True)
class SamplingParams:
    """How a token is chosen from logits.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_p: keep the smallest set of most likely tokens whose probability sums to at least top_p
        (the most likely token is always kept); 1.0 disables it.
    top_k: keep the top_k most likely tokens; 0 disables it.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: must be an integer >= 0, got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed fp32 probabilities ``[..., V]`` for ``logits`` ``[..., V]``.

    Order: temperature, top-k, top-p; the result sums to 1 over the last dimension and is zero
    outside the kept set. Greedy params give a one-hot on the argmax. Exact ties at a top-k or
    top-p cut are broken as ``torch.topk`` breaks them.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)

    # shifted by the row's max first (softmax, top-k and top-p do not change): a tiny temperature
    # divides differences, and no logit overflows to inf (which made every probability NaN)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    top_k = min(params.top_k, vocab)
    if top_k == 0 and params.top_p >= 1.0:
        return torch.softmax(logits, dim=-1)

    # Work on candidates in descending order, then scatter back. Without top-k, the nucleus is
    # searched among the top _NUCLEUS_CANDIDATES tokens, widened until it holds top_p of the mass
    # in every row: a full sort of a 150k vocabulary costs ~20x a top-k of 1024 on CPU.
    if top_k > 0:
        vals, idx = torch.topk(logits, top_k, dim=-1)  # [..., K]
        kept = torch.softmax(vals, dim=-1)  # [..., K], renormalised over the top-k
    else:
        log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)  # [..., 1]
        width = min(_NUCLEUS_CANDIDATES, vocab)
        while True:
            vals, idx = torch.topk(logits, width, dim=-1)  # [..., W]
            kept = torch.exp(vals - log_norm)  # [..., W], probabilities under the full softmax
            if width == vocab or bool((kept.sum(dim=-1) >= params.top_p).all()):
                break
            width = min(4 * width, vocab)

    if params.top_p < 1.0:
        # A token survives when the mass strictly before it is still short of top_p; the first
        # token always survives because the mass before it is 0.
        mass_before = torch.cumsum(kept, dim=-1) - kept
        kept = kept.masked_fill(mass_before >= params.top_p, 0.0)
        kept = kept / kept.sum(dim=-1, keepdim=True)

    return torch.zeros_like(logits).scatter_(-1, idx, kept)


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row: ``logits`` ``[V]`` gives a 0-dim LongTensor, ``[T, V]`` gives ``[T]``.

    Greedy params take the argmax (no randomness consumed); otherwise one draw of
    ``torch.multinomial`` from ``logits_to_probs`` with ``generator``.
    """
    if logits.dim() not in (1, 2):
        raise ValueError(f"logits: expected [V] or [T, V], got shape {tuple(logits.shape)}")
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = logits_to_probs(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
