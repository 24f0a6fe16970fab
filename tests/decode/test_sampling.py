"""specter.decode.sampling: the processed target distribution (temperature, top-k, top-p) and sampling."""

from __future__ import annotations

import math

import pytest
import torch

from specter.decode.sampling import SamplingParams, logits_to_probs, sample

torch.set_num_threads(1)

# Probabilities chosen so that no top-p threshold used below sits on a cumulative sum.
BASE = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted order: 1, 3, 2, 0
LOGITS = BASE.log()


def kept(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


def test_default_params_are_greedy() -> None:
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.7).greedy


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"top_k": 2.0}]
)
def test_invalid_params_name_the_field(kwargs: dict) -> None:
    (field,) = kwargs
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_plain_temperature_one_is_softmax() -> None:
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=1.0))
    torch.testing.assert_close(probs, BASE)
    assert probs.dtype == torch.float32


def test_temperature_scales_logits() -> None:
    logits = torch.tensor([1.0, 2.0, 4.0])
    for t in (0.5, 2.0):
        probs = logits_to_probs(logits, SamplingParams(temperature=t))
        torch.testing.assert_close(probs, torch.softmax(logits / t, dim=-1))
    hot = logits_to_probs(logits, SamplingParams(temperature=4.0))
    cold = logits_to_probs(logits, SamplingParams(temperature=0.25))
    assert hot.max() < cold.max()  # higher temperature flattens
    # At temperature 2 the log-odds of tokens 2 and 0 are (4 - 1) / 2.
    warm = logits_to_probs(logits, SamplingParams(temperature=2.0))
    assert math.isclose((warm[2] / warm[0]).log().item(), 1.5, rel_tol=1e-5)


def test_greedy_probs_are_one_hot_on_argmax() -> None:
    probs = logits_to_probs(LOGITS, SamplingParams())
    torch.testing.assert_close(probs, torch.tensor([0.0, 1.0, 0.0, 0.0]))


@pytest.mark.parametrize(
    "top_k, expected", [(1, {1}), (2, {1, 3}), (3, {1, 3, 2}), (4, {0, 1, 2, 3}), (99, {0, 1, 2, 3})]
)
def test_top_k_keeps_the_k_most_likely(top_k: int, expected: set[int]) -> None:
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_k=top_k))
    assert kept(probs) == expected
    idx = sorted(expected)
    torch.testing.assert_close(probs[idx], BASE[idx] / BASE[idx].sum())


@pytest.mark.parametrize(
    "top_p, expected",
    [(0.01, {1}), (0.45, {1}), (0.55, {1, 3}), (0.75, {1, 3}), (0.85, {1, 3, 2}), (0.97, {0, 1, 2, 3})],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p: float, expected: set[int]) -> None:
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
    assert kept(probs) == expected
    idx = sorted(expected)
    torch.testing.assert_close(probs[idx], BASE[idx] / BASE[idx].sum())


def test_top_p_applies_after_top_k_renormalisation() -> None:
    # After top-k=3 the kept mass is 0.95: token 1 has 0.526, tokens {1, 3} 0.842 >= 0.82. Without
    # renormalisation {1, 3} would only reach 0.80 and token 2 would also be kept.
    probs = logits_to_probs(LOGITS, SamplingParams(temperature=1.0, top_k=3, top_p=0.82))
    assert kept(probs) == {1, 3}
    torch.testing.assert_close(probs[[1, 3]], torch.tensor([0.625, 0.375]))


def test_batched_rows_are_processed_independently() -> None:
    logits = torch.stack([LOGITS, LOGITS.flip(0), torch.zeros(4)]).reshape(3, 1, 4)  # [3, 1, V]
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.82)
    probs = logits_to_probs(logits, params)
    assert probs.shape == (3, 1, 4)
    for row in range(3):
        torch.testing.assert_close(probs[row, 0], logits_to_probs(logits[row, 0], params))
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 1))


def test_greedy_sample_is_argmax() -> None:
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, SamplingParams()), logits.argmax(-1))
    one = sample(logits[2], SamplingParams())
    assert one.dim() == 0 and one.item() == logits[2].argmax().item()


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, top_p=0.9)
    draws = [sample(logits, params, torch.Generator().manual_seed(s)) for s in (7, 7, 8)]
    assert draws[0].shape == (64,) and draws[0].dtype == torch.long
    assert torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], draws[2])


def test_sample_never_leaves_the_kept_set() -> None:
    logits = LOGITS.expand(4000, 4)
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.82)
    draws = sample(logits, params, torch.Generator().manual_seed(2))
    assert set(draws.tolist()) == {1, 3}


def reference_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus by a full sort, for comparison."""
    probs = torch.softmax(logits, dim=-1)
    vals, idx = torch.sort(probs, dim=-1, descending=True)
    vals = vals.masked_fill(torch.cumsum(vals, dim=-1) - vals >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, idx, vals / vals.sum(-1, keepdim=True))


@pytest.mark.parametrize("scale", [0.1, 3.0], ids=["flat-needs-widening", "peaked"])
def test_top_p_on_a_large_vocabulary_matches_a_full_sort(scale: float) -> None:
    logits = scale * torch.randn(3, 20_000, generator=torch.Generator().manual_seed(4))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.9))
    expected = reference_top_p(logits, 0.9)
    assert torch.equal(probs > 0, expected > 0)
    torch.testing.assert_close(probs, expected)
    if scale < 1:  # the nucleus really is wider than the first candidate set
        assert ((probs > 0).sum(-1) > 1024).all()


@pytest.mark.parametrize("temperature", [1e-30, 1e-39, 1e-45])
def test_a_tiny_temperature_is_the_argmax_not_nan(temperature: float) -> None:
    """A temperature above 0 but small enough that logits / temperature overflows float32 keeps
    a valid distribution: the mass on the argmax."""
    logits = torch.tensor([[2.0, 1.0, -3.0], [0.5, 0.5, 0.4]])
    for params in (SamplingParams(temperature=temperature), SamplingParams(temperature=temperature, top_p=0.9),
                   SamplingParams(temperature=temperature, top_k=2)):
        probs = logits_to_probs(logits, params)
        assert torch.isfinite(probs).all()
        assert torch.equal(probs[0], torch.tensor([1.0, 0.0, 0.0]))
        assert probs[1, 2] == 0 and probs[1].sum() == pytest.approx(1.0)
