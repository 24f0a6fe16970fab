"""Verification of k drafted tokens against one target pass over k+1 positions.

The draft proposed ``draft_tokens`` ``[k]``; the target scored the last committed token and the k
drafted ones, so row ``i`` of its output is the target's next-token distribution after the prefix
plus ``draft_tokens[:i]`` (``k + 1`` rows). A step emits:

- accepted tokens: the longest prefix of the draft the rule below lets through;
- then exactly one token from the target: the recovered token, chosen at the first rejected
  position, or the bonus token, chosen at position ``k`` when every draft token was accepted.

So a step emits ``accepted + 1`` tokens, between 1 and ``k + 1``, and the output is the
target's own: ``greedy_verify`` gives exactly the target's greedy tokens, ``rejection_verify``
gives tokens distributed exactly as sampling from the target (see its docstring).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["VerifyResult", "greedy_verify", "rejection_verify"]


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """What one verification step emits.

    accepted: how many draft tokens were accepted (0..k).
    tokens: the emitted tokens, ``draft_tokens[:accepted]`` then the recovered or bonus token.
    bonus: True when all k draft tokens were accepted and the last token is the bonus token.
    """

    accepted: int
    tokens: list[int]
    bonus: bool


def _accepted_prefix(accept: torch.Tensor) -> int:
    """Length of the leading run of True in a bool ``[k]`` (one host sync)."""
    return int(accept.to(torch.int32).cumprod(0).sum().item()) if accept.numel() else 0


def _check_shapes(draft_tokens: torch.Tensor, rows: torch.Tensor, name: str) -> int:
    if draft_tokens.dim() != 1:
        raise ValueError(f"draft_tokens: expected [k], got shape {tuple(draft_tokens.shape)}")
    k = draft_tokens.shape[0]
    if rows.dim() != 2 or rows.shape[0] != k + 1:
        raise ValueError(f"{name}: expected [k+1={k + 1}, V], got shape {tuple(rows.shape)}")
    return k


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """Accept draft tokens while they equal the target's argmax; then emit the target's argmax.

    ``target_logits`` ``[k+1, V]`` may equally be probabilities; only the argmax matters.
    """
    k = _check_shapes(draft_tokens, target_logits, "target_logits")
    target_argmax = target_logits.argmax(dim=-1)  # [k+1]
    match = draft_tokens.to(target_argmax.device) == target_argmax[:k]  # [k]
    accepted = _accepted_prefix(match)
    emitted = target_argmax[: accepted + 1].tolist()
    return VerifyResult(accepted=accepted, tokens=emitted, bonus=accepted == k)


def rejection_verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    ``draft_tokens[i]`` must have been drawn from ``draft_probs[i]`` ``[k, V]`` (a one-hot row,
    i.e. a greedy draft, is allowed); ``target_probs`` ``[k+1, V]`` are the target's processed
    probabilities (``specter.decode.sampling.logits_to_probs``). With ``q = draft_probs[i]``,
    ``p = target_probs[i]`` and ``x = draft_tokens[i]``:

    - x is accepted with probability ``min(1, p(x) / q(x))``;
    - at the first rejection, the recovered token is drawn from ``norm(max(0, p - q))``;
    - if all k are accepted, the bonus token is drawn from ``target_probs[k]``.

    Why the emitted token at position i is distributed exactly as p: it equals y either because
    the draft proposed y and it was accepted, probability ``q(y) min(1, p(y)/q(y)) = min(p(y),
    q(y))``, or because the proposal was rejected, probability ``1 - sum_x min(p(x), q(x)) =
    sum_x max(0, p(x) - q(x))``, and the residual then chose y, probability ``max(0, p(y) - q(y))``
    over that same sum. Adding the two: ``min(p, q) + max(0, p - q) = p``. Accepted tokens are
    exactly what the target would have produced at position i given the same prefix, so row
    ``i + 1`` is the right conditional for the next position; by induction the emitted sequence
    is distributed as sampling from the target one token at a time. The residual can only be all
    zero through rounding (p and q both sum to 1, so p(x) < q(x) forces p > q elsewhere); then p
    itself is used.

    Randomness: ``k`` uniforms, then one multinomial draw, all from ``generator``.
    """
    k = _check_shapes(draft_tokens, target_probs, "target_probs")
    if draft_probs.shape != (k, target_probs.shape[1]):
        raise ValueError(
            f"draft_probs: expected [k={k}, V={target_probs.shape[1]}], got {tuple(draft_probs.shape)}"
        )
    device = target_probs.device
    draft_tokens = draft_tokens.to(device)

    rows = torch.arange(k, device=device)
    p = target_probs[rows, draft_tokens].float()  # [k]
    q = draft_probs[rows, draft_tokens].float()  # [k]
    u = torch.rand(k, generator=generator, device=device)  # [k] in [0, 1)
    # u < p/q without dividing: p >= q accepts (even with q == 0), p == 0 never accepts.
    accept = (u * q < p) | ((p >= q) & (p > 0))  # [k]
    accepted = _accepted_prefix(accept)

    if accepted == k:
        weights = target_probs[k].float()  # [V]
    else:
        target_row = target_probs[accepted].float()  # [V]
        residual = (target_row - draft_probs[accepted].float()).clamp_(min=0.0)  # [V]
        weights = torch.where(residual.sum() > 0, residual, target_row)
    last = int(torch.multinomial(weights, 1, generator=generator).item())

    emitted = draft_tokens[:accepted].tolist() + [last]
    return VerifyResult(accepted=accepted, tokens=emitted, bonus=accepted == k)
