"""The roofline governor's estimators: distinct experts, the non-negative cost fit, piecewise
interpolation, isotonic regression and the moving average."""

from __future__ import annotations

import random

import pytest

from specter.decode.roofline_fit import Ema, cost_curve, distinct_experts, fit_nonnegative, interpolate, monotone


def test_distinct_experts_is_top_k_for_one_token_and_approaches_all_experts():
    assert distinct_experts(1, 16, 2) == pytest.approx(2.0)
    assert distinct_experts(2, 16, 2) == pytest.approx(16 * (1 - (14 / 16) ** 2))
    assert distinct_experts(200, 16, 2) == pytest.approx(16.0, rel=1e-9)


def cost_rows(widths, cost, weight=1.0):
    """(1, distinct experts, tokens) rows of a verification cost over ``widths``."""
    return [((1.0, distinct_experts(t, 16, 2), float(t)), cost(t), weight) for t in widths]


def u(t):
    return distinct_experts(t, 16, 2)


def test_fit_recovers_experts_and_tokens_terms():
    assert fit_nonnegative(cost_rows((2, 3, 5, 9), lambda t: 1.0 + 2.0 * u(t) + 0.5 * t)) == (
        pytest.approx(1.0), pytest.approx(2.0), pytest.approx(0.5))
    a, b, c = fit_nonnegative(cost_rows((2, 3, 5, 9), lambda t: 3.0 * t))
    assert (a, b) == (pytest.approx(0.0, abs=1e-9), 0.0) and c == pytest.approx(3.0)


def test_fit_keeps_the_line_in_distinct_experts_where_few_widths_cannot_tell():
    assert fit_nonnegative(cost_rows((2, 5), lambda t: 1.0 + 2.0 * u(t))) == (
        pytest.approx(1.0), pytest.approx(2.0), 0.0)
    assert fit_nonnegative(cost_rows((2, 5), lambda t: 6.0 + t))[2] == 0.0  # a line in tokens too
    a, b, c = fit_nonnegative(cost_rows((5,), lambda t: 4.0))
    assert (a, c) == (0.0, 0.0) and b == pytest.approx(4.0 / u(5))  # one width: through the origin


def test_fit_of_falling_costs_is_flat_at_their_weighted_mean():
    rows = [((1.0, 2.0, 2.0), 5.0, 1.0), ((1.0, 3.0, 3.0), 3.0, 3.0)]
    assert fit_nonnegative(rows) == (pytest.approx(3.5), 0.0, 0.0)


def test_fit_coefficients_are_never_negative_and_fit_no_worse_than_a_constant():
    rng = random.Random(0)
    for _ in range(200):
        rows = [((1.0, u(t), float(t), max(0.0, u(t) - 6.0)), rng.uniform(0.0, 10.0), rng.uniform(0.1, 3.0))
                for t in rng.sample(range(2, 17), rng.randint(1, 6))]
        fit = fit_nonnegative(rows)
        assert min(fit) >= 0.0
        error = sum(w * (y - sum(c * x for c, x in zip(fit, xs))) ** 2 for xs, y, w in rows)
        mean = sum(w * y for _, y, w in rows) / sum(w for *_, w in rows)
        assert error <= sum(w * (y - mean) ** 2 for _, y, w in rows) + 1e-9


def test_cost_curve_follows_the_fit_and_a_width_measured_often_where_the_terms_cannot():
    terms = [[1.0, u(t), float(t)] for t in range(10)]
    line = lambda t: 1.0 + 0.5 * t  # noqa: E731
    samples = [(t, line(t), 1.0) for t in (2, 3, 5, 9)]
    assert cost_curve(samples, terms, prior=4.0)[2:] == pytest.approx([line(t) for t in range(2, 10)])
    jumped = samples + [(7, line(7) + 2.0, 1.0)] * 36  # width 7 costs 2 more than any line through the rest
    curve = cost_curve(jumped, terms, prior=4.0)
    assert curve[7] == pytest.approx(line(7) + 2.0, abs=0.25) and curve == sorted(curve)
    assert cost_curve([], terms, prior=4.0) is None


def test_interpolate_is_piecewise_linear_and_flat_beyond_its_points():
    points = {2: 1.0, 4: 3.0, 8: 1.0}
    assert [interpolate(points, x) for x in (1, 2, 3, 4, 6, 8, 12)] == [1.0, 1.0, 2.0, 3.0, 2.0, 1.0, 1.0]


def test_monotone_pools_adjacent_violators():
    assert monotone([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert monotone([2.0, 1.0]) == [1.5, 1.5]
    assert monotone([2.0, 1.0], [3.0, 1.0]) == [1.75, 1.75]  # a pool is its points' weighted mean
    assert monotone([1.0, 3.0, 2.0], [1.0, 1.0, 3.0]) == [1.0, 2.25, 2.25]


def test_ema_starts_at_its_first_sample_and_takes_a_larger_weight_when_given_one():
    average = Ema(0.25)
    average.update(4.0)
    average.update(8.0)
    assert average.value == pytest.approx(5.0)
    average.update(0.0, 0.5)
    assert average.value == pytest.approx(2.5)
    average.update(10.0, 0.1)  # never below its own weight
    assert average.value == pytest.approx(2.5 * 0.75 + 10.0 * 0.25)
