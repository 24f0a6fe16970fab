"""specter.decode.acceptance: greedy verification and exact speculative (rejection) sampling.

The statistical tests check the defining property of speculative sampling: whatever the draft
proposes, each emitted token is distributed as the target's distribution at its position. They
also run two wrong samplers through the same harness to show that the test would catch them.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specter.decode.acceptance import VerifyResult, greedy_verify, rejection_verify

torch.set_num_threads(1)

Verify = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator], VerifyResult]


def one_hot(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long), vocab).float()


# ---------------------------------------------------------------------------------------------
# greedy_verify


def greedy_logits(argmaxes: list[int], vocab: int = 6) -> torch.Tensor:
    """Logits ``[len, V]`` whose row i has its argmax at argmaxes[i], plus some noise."""
    noise = torch.rand(len(argmaxes), vocab, generator=torch.Generator().manual_seed(0))
    return noise + 2.0 * one_hot(argmaxes, vocab)


def test_greedy_all_accepted_emits_bonus() -> None:
    result = greedy_verify(torch.tensor([3, 1, 4]), greedy_logits([3, 1, 4, 2]))
    assert result == VerifyResult(accepted=3, tokens=[3, 1, 4, 2], bonus=True)


def test_greedy_mismatch_at_first_position_emits_only_recovered() -> None:
    result = greedy_verify(torch.tensor([0, 1, 4]), greedy_logits([3, 1, 4, 2]))
    assert result == VerifyResult(accepted=0, tokens=[3], bonus=False)


def test_greedy_mismatch_in_the_middle_stops_there() -> None:
    # Position 2 would match again, but acceptance is a prefix.
    result = greedy_verify(torch.tensor([3, 0, 4]), greedy_logits([3, 1, 4, 2]))
    assert result == VerifyResult(accepted=1, tokens=[3, 1], bonus=False)


def test_greedy_k0_emits_the_bonus_token() -> None:
    result = greedy_verify(torch.empty(0, dtype=torch.long), greedy_logits([5]))
    assert result == VerifyResult(accepted=0, tokens=[5], bonus=True)


def test_verify_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="target_logits"):
        greedy_verify(torch.tensor([1, 2]), torch.zeros(2, 6))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_verify(torch.tensor([1, 2]), torch.zeros(2, 5), torch.full((3, 6), 1 / 6))


# ---------------------------------------------------------------------------------------------
# rejection_verify: exact cases and properties


def random_probs(gen: torch.Generator, rows: int, vocab: int, sparse: bool) -> torch.Tensor:
    """Random distributions ``[rows, V]``; with ``sparse`` some entries are exactly zero."""
    probs = torch.rand(rows, vocab, generator=gen) ** 3
    if sparse:
        probs = probs * (torch.rand(rows, vocab, generator=gen) < 0.5)
        probs[torch.arange(rows), torch.randint(vocab, (rows,), generator=gen)] += 0.1
    return probs / probs.sum(-1, keepdim=True)


def draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs`` ``[k, V]`` -> ``[k]``."""
    if probs.shape[0] == 0:
        return torch.empty(0, dtype=torch.long)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def test_rejection_k0_samples_the_bonus_from_the_target() -> None:
    target = one_hot([4], 6)
    result = rejection_verify(torch.empty(0, dtype=torch.long), torch.empty(0, 6), target)
    assert result == VerifyResult(accepted=0, tokens=[4], bonus=True)


def test_rejection_never_accepts_a_token_the_target_excludes() -> None:
    target = torch.tensor([[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    draft = torch.tensor([[0.9, 0.05, 0.05]])
    for seed in range(50):
        result = rejection_verify(torch.tensor([0]), draft, target, torch.Generator().manual_seed(seed))
        assert result.accepted == 0 and result.tokens[0] in (1, 2)


def test_rejection_is_reproducible_with_a_seeded_generator() -> None:
    gen = torch.Generator().manual_seed(3)
    target, draft = random_probs(gen, 5, 8, False), random_probs(gen, 4, 8, False)
    tokens = draw(draft, gen)
    runs = [rejection_verify(tokens, draft, target, torch.Generator().manual_seed(11)) for _ in range(2)]
    assert runs[0] == runs[1]


cases = st.tuples(
    st.integers(0, 2**31 - 1),  # seed
    st.integers(0, 8),  # k
    st.integers(1, 12),  # V
    st.booleans(),  # sparse
)


@settings(max_examples=150, deadline=None)
@given(cases)
def test_rejection_emits_a_well_formed_result(case: tuple[int, int, int, bool]) -> None:
    seed, k, vocab, sparse = case
    gen = torch.Generator().manual_seed(seed)
    target, draft = random_probs(gen, k + 1, vocab, sparse), random_probs(gen, k, vocab, sparse)
    tokens = draw(draft, gen)
    result = rejection_verify(tokens, draft, target, gen)

    assert 0 <= result.accepted <= k
    assert len(result.tokens) == result.accepted + 1
    assert result.tokens[: result.accepted] == tokens[: result.accepted].tolist()
    assert result.bonus == (result.accepted == k)
    assert all(0 <= t < vocab for t in result.tokens)
    # Every emitted token is possible under the target at its position.
    assert all(target[i, t] > 0 for i, t in enumerate(result.tokens))


@settings(max_examples=100, deadline=None)
@given(cases)
def test_rejection_accepts_everything_when_draft_equals_target(case: tuple[int, int, int, bool]) -> None:
    seed, k, vocab, sparse = case
    gen = torch.Generator().manual_seed(seed)
    target = random_probs(gen, k + 1, vocab, sparse)
    tokens = draw(target[:k], gen)
    result = rejection_verify(tokens, target[:k].clone(), target, gen)
    assert result.accepted == k and result.bonus
    assert result.tokens[:k] == tokens.tolist()


@settings(max_examples=100, deadline=None)
@given(cases)
def test_rejection_on_greedy_distributions_equals_greedy_verify(case: tuple[int, int, int, bool]) -> None:
    # Greedy target and greedy draft are one-hot distributions; exact sampling must then give
    # exactly greedy verification.
    seed, k, vocab, _ = case
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, vocab, generator=gen)
    # Draft tokens agree with the target's argmax most of the time, as a good draft would.
    tokens = torch.where(
        torch.rand(k, generator=gen) < 0.7, logits[:k].argmax(-1), torch.randint(vocab, (k,), generator=gen)
    )
    target = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    result = rejection_verify(tokens, one_hot(tokens.tolist(), vocab).reshape(k, vocab), target, gen)
    assert result == greedy_verify(tokens, logits)


# ---------------------------------------------------------------------------------------------
# rejection_verify: the emitted tokens follow the target's distribution

N_TRIALS = 20_000
P_MIN = 1e-3

# Each case: target rows [k+1, V] and a deliberately wrong draft [k, V] for k = 3 (k = 1 uses the
# first rows). The rows of later positions are different distributions, so that a sampler mixing
# up positions would also be caught.
TARGET_TAIL = torch.tensor([[0.05, 0.1, 0.2, 0.3, 0.25, 0.1], [1 / 6] * 6, [0.3, 0.3, 0.1, 0.1, 0.1, 0.1]])
DRAFT_TAIL = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.03, 0.02], [0.1, 0.1, 0.1, 0.1, 0.1, 0.5]])
CASES = {
    # The draft puts most of its mass where the target has little.
    "draft-favours-rare": (
        torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03]),
        torch.tensor([0.02, 0.03, 0.05, 0.1, 0.3, 0.5]),
    ),
    # The draft never proposes the target's favourite, and likes a token the target excludes.
    "draft-misses-favourite": (
        torch.tensor([0.45, 0.2, 0.15, 0.1, 0.1, 0.0]),
        torch.tensor([0.0, 0.1, 0.2, 0.2, 0.2, 0.3]),
    ),
}


def case_rows(name: str, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    target0, draft0 = CASES[name]
    target = torch.cat([target0[None], TARGET_TAIL])[: k + 1]  # [k+1, V]
    draft = torch.cat([draft0[None], DRAFT_TAIL])[:k]  # [k, V]
    return target, draft


def emitted_counts(
    verify: Verify, target: torch.Tensor, draft: torch.Tensor, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts ``[V]`` of the first emitted token over N_TRIALS steps, and of the second emitted
    token over the steps that accepted the first draft token."""
    k, vocab = draft.shape
    gen_draft, gen_verify = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    proposals = torch.multinomial(draft, N_TRIALS, replacement=True, generator=gen_draft).T  # [N, k]
    first, second = torch.zeros(vocab, dtype=torch.long), torch.zeros(vocab, dtype=torch.long)
    for tokens in proposals:
        emitted = verify(tokens, draft, target, gen_verify).tokens
        first[emitted[0]] += 1
        if len(emitted) > 1:
            second[emitted[1]] += 1
    return first, second


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson goodness of fit of ``counts`` to ``probs`` over the target's support -> (chi2, p).

    Tokens outside the support must never appear; any that do make p = 0.
    """
    support = probs > 0
    if counts[~support].sum() > 0:
        return float("inf"), 0.0
    n = counts.sum().double()
    expected = n * probs[support].double()
    chi2 = ((counts[support].double() - expected) ** 2 / expected).sum()
    dof = torch.tensor(support.sum().item() - 1, dtype=torch.float64)
    return chi2.item(), torch.special.gammaincc(dof / 2, chi2 / 2).item()


def test_chi_square_helper_matches_known_values() -> None:
    # 60/40 against 50/50 gives chi2 = 4 with 1 degree of freedom: p = erfc(sqrt(2)) = 0.0455.
    chi2, p = chi_square(torch.tensor([60, 40]), torch.tensor([0.5, 0.5]))
    assert chi2 == pytest.approx(4.0) and p == pytest.approx(0.0455, abs=1e-4)
    assert chi_square(torch.tensor([50, 50, 0]), torch.tensor([0.5, 0.5, 0.0])) == (0.0, 1.0)
    assert chi_square(torch.tensor([50, 49, 1]), torch.tensor([0.5, 0.5, 0.0]))[1] == 0.0


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("name", sorted(CASES))
def test_emitted_tokens_follow_the_target(name: str, k: int) -> None:
    target, draft = case_rows(name, k)
    first, second = emitted_counts(rejection_verify, target, draft, seed=1000 + 10 * k + len(name))
    chi2, p = chi_square(first, target[0])
    print(f"\n{name} k={k} first: chi2={chi2:.2f} p={p:.3f} n={first.sum().item()}")
    assert p > P_MIN, (first.tolist(), chi2)
    # Given the first draft token was accepted, the next emitted token follows row 1.
    chi2, p = chi_square(second, target[1])
    print(f"{name} k={k} second: chi2={chi2:.2f} p={p:.3f} n={second.sum().item()}")
    assert second.sum() > 0.25 * N_TRIALS
    assert p > P_MIN, (second.tolist(), chi2)


def emit_the_draft(
    tokens: torch.Tensor, draft: torch.Tensor, target: torch.Tensor, gen: torch.Generator
) -> VerifyResult:
    """Wrong: accepts every draft token, as if the draft were the target."""
    k = tokens.shape[0]
    bonus = int(torch.multinomial(target[k], 1, generator=gen))
    return VerifyResult(accepted=k, tokens=tokens.tolist() + [bonus], bonus=True)


def recover_from_the_target(
    tokens: torch.Tensor, draft: torch.Tensor, target: torch.Tensor, gen: torch.Generator
) -> VerifyResult:
    """Wrong: the right acceptance test, but the recovered token is drawn from the target itself
    rather than from the residual max(0, p - q), which over-weights what the draft proposes."""
    k = tokens.shape[0]
    for i, x in enumerate(tokens.tolist()):
        if torch.rand((), generator=gen) * draft[i, x] >= target[i, x]:
            recovered = int(torch.multinomial(target[i], 1, generator=gen))
            return VerifyResult(accepted=i, tokens=tokens[:i].tolist() + [recovered], bonus=False)
    bonus = int(torch.multinomial(target[k], 1, generator=gen))
    return VerifyResult(accepted=k, tokens=tokens.tolist() + [bonus], bonus=True)


@pytest.mark.parametrize("wrong", [emit_the_draft, recover_from_the_target], ids=lambda f: f.__name__)
def test_the_statistical_test_catches_wrong_samplers(wrong: Verify) -> None:
    target, draft = case_rows("draft-favours-rare", 1)
    first, _ = emitted_counts(wrong, target, draft, seed=2000)
    chi2, p = chi_square(first, target[0])
    print(f"\nnegative control {wrong.__name__}: chi2={chi2:.2f} p={p:.3g}")
    assert p < P_MIN
