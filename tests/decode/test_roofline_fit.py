"""The roofline governor's estimators: distinct experts, the non-negative line, isotonic
regression and the moving average."""

from __future__ import annotations

import pytest

from specter.decode.roofline_fit import Ema, distinct_experts, fit_line, monotone


def test_distinct_experts_is_top_k_for_one_token_and_approaches_all_experts():
    assert distinct_experts(1, 16, 2) == pytest.approx(2.0)
    assert distinct_experts(2, 16, 2) == pytest.approx(16 * (1 - (14 / 16) ** 2))
    assert distinct_experts(200, 16, 2) == pytest.approx(16.0, rel=1e-9)


def test_fit_line_recovers_a_line_and_keeps_both_coefficients_non_negative():
    a, b = fit_line([(x, 3.0 + 2.0 * x, 1.0) for x in (1.0, 2.0, 4.0)])
    assert (a, b) == (pytest.approx(3.0), pytest.approx(2.0))
    assert fit_line([(1.0, 5.0, 1.0), (2.0, 3.0, 1.0)]) == (pytest.approx(4.0), 0.0)  # falling: flat at the mean
    a, b = fit_line([(1.0, 1.0, 1.0), (3.0, 5.0, 1.0)])  # the free fit's intercept is negative
    assert a == 0.0 and b == pytest.approx((1.0 + 15.0) / 10.0)


def test_monotone_pools_adjacent_violators_by_weight():
    assert monotone([(1.0, 1.0), (3.0, 1.0), (2.0, 3.0), (4.0, 1.0)]) == [1.0, 2.25, 2.25, 4.0]
    assert monotone([(2.0, 1.0), (1.0, 1.0)]) == [1.5, 1.5]


def test_ema_starts_at_its_first_sample_and_takes_a_larger_weight_when_given_one():
    average = Ema(0.25)
    average.update(4.0)
    average.update(8.0)
    assert average.value == pytest.approx(5.0)
    average.update(0.0, 0.5)
    assert average.value == pytest.approx(2.5)
    average.update(10.0, 0.1)  # never below its own weight
    assert average.value == pytest.approx(2.5 * 0.75 + 10.0 * 0.25)
