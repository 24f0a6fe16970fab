"""The roofline governor's verification cost model: one fit through noisy widths, and what a
change of conditions does to it."""

from __future__ import annotations

import pytest

from specter.decode.roofline_cost import OWN_WAIT_ROUNDS, STALE_HALF_LIFE, PlainRound, VerifyCost, WaitPerToken
from specter.decode.roofline_fit import distinct_experts


def u(t: int) -> float:
    return distinct_experts(t, 16, 2)


def steady(t: int) -> float:
    return 0.01 + 0.002 * u(t) + 0.001 * t


def test_the_cost_follows_experts_tokens_and_streaming_through_noisy_widths():
    model = VerifyCost(16, 2, k_max=8, cache_slots_per_layer=6.0)
    dear = lambda t: steady(t) + 0.004 * max(0.0, u(t) - 6.0)  # noqa: E731  experts past six a layer stream
    for i, width in enumerate([3, 6, 2, 9, 4, 7, 3, 5, 8, 2, 6, 9, 4]):
        model.add(width, dear(width) * (1.05 if i % 2 else 0.95), i)
    curve = model.curve(now=13, changed_at=-1)
    assert curve[2:] == pytest.approx([dear(t) for t in range(2, 10)], rel=0.05)
    assert curve == sorted(curve)


def test_past_the_widest_width_measured_the_cost_scales_by_distinct_experts():
    # narrow widths whose cost happens to follow the tokens: extrapolated, width 17 would be priced
    # 0.17 s; scaled from width 4 by the experts it reads, 0.04 * u(17) / u(4) (0.087 s)
    model = VerifyCost(16, 2, k_max=16, cache_slots_per_layer=None)
    for i, width in enumerate([2, 3, 4] * 4):
        model.add(width, 0.01 * width, i)
    curve = model.curve(now=12, changed_at=-1)
    assert curve[2:5] == pytest.approx([0.02, 0.03, 0.04])
    assert curve[17] == pytest.approx(0.04 * u(17) / u(4))
    assert curve == sorted(curve)
    model.add(17, 0.17, 12)  # once measured, the wide width counts as measured
    assert model.curve(now=13, changed_at=-1)[17] > 0.15


def test_after_a_change_the_rounds_since_scale_the_curve_until_they_span_three_widths():
    model = VerifyCost(16, 2, k_max=8, cache_slots_per_layer=None)
    for i, width in enumerate([2, 3, 5, 7, 9, 2, 3, 5, 7, 9]):
        model.add(width, steady(width), i)
    model.add(5, 3 * steady(5), 10)  # conditions changed at round 10: three times dearer
    model.add(3, 3 * steady(3), 11)
    curve = model.curve(now=11, changed_at=10)
    assert curve[9] == pytest.approx(3 * steady(9), rel=0.05)  # the shape kept, the level moved
    model.add(9, 3 * steady(9), 12)
    assert model.curve(now=12, changed_at=10)[7] == pytest.approx(3 * steady(7), rel=1e-6)  # fitted alone


@pytest.mark.parametrize("transition_weight, near_steady", [(0.25, True), (1.0, False)])
def test_a_transition_counts_less_than_a_steady_round(transition_weight, near_steady):
    # each width's first round after another width takes twice its steady time (the cache holds
    # the other width's experts); counted at a quarter, the curve stays within 20% of the steady cost
    model = VerifyCost(16, 2, k_max=8, cache_slots_per_layer=None)
    for i, width in enumerate([3, 5, 7, 9]):
        model.add(width, 2 * steady(width), 2 * i, weight=transition_weight)
        model.add(width, steady(width), 2 * i + 1)
    curve = model.curve(now=8, changed_at=-1)
    within = all(abs(curve[t] / steady(t) - 1) < 0.2 for t in (3, 5, 7, 9))
    assert within == near_steady


def test_waits_pool_per_verified_token_over_widths_and_restart_after_a_change():
    waits = WaitPerToken()
    assert waits.value(now=0, changed_at=-1) is None
    for i, width in enumerate([2, 9, 5, 3]):
        waits.add(width, 0.01 * width, i)
    assert waits.value(now=4, changed_at=-1) == pytest.approx(0.01)
    scattered = WaitPerToken()  # one round lucky, the next one unlucky: the pool averages them
    for i, width in enumerate([2, 9, 5, 3, 7, 4]):
        scattered.add(width, 0.01 * width * (0.4 if i % 2 else 1.6), i)
    assert 0.008 < scattered.value(now=6, changed_at=-1) < 0.012
    for i in range(OWN_WAIT_ROUNDS):  # conditions changed at round 10: three times the wait
        assert waits.value(now=10 + i, changed_at=10) < 0.03  # too few rounds since: the old ones still count
        waits.add(4, 0.03 * 4, 10 + i)
    assert waits.value(now=10 + OWN_WAIT_ROUNDS, changed_at=10) == pytest.approx(0.03)


def test_waits_by_width_fall_with_the_width_as_measured_and_never_rise():
    waits = WaitPerToken()
    assert waits.by_width(5, now=0, changed_at=-1) is None
    waits.add(5, 0.1, 0)
    assert waits.by_width(17, now=1, changed_at=-1) == pytest.approx(0.02)  # one width: its rate, everywhere
    for i, (width, per_token) in enumerate([(2, 0.021), (17, 0.015), (2, 0.019), (17, 0.015), (9, 0.018)], start=1):
        waits.add(width, per_token * width, i)
    rates = [waits.by_width(t, now=6, changed_at=-1) for t in (2, 9, 13, 17, 200)]
    assert rates[0] == pytest.approx(0.020, abs=0.001) and rates[1] == pytest.approx(0.018, abs=0.0005)
    assert rates[2] == pytest.approx((rates[1] + rates[3]) / 2)  # linear between measured widths
    assert rates[3] == pytest.approx(0.015) and rates[4] == rates[3]  # flat beyond them
    # given a width's distinct experts, past the widest measured width a round waits as much per
    # distinct expert as the widest one did (and within the measured widths nothing changes)
    distinct = {9: 7.0, 17: 10.0, 33: 13.0}.__getitem__
    assert waits.by_width(33, now=6, changed_at=-1, distinct=distinct) == pytest.approx(0.015 * 17 / 33 * 13 / 10)
    assert waits.by_width(9, now=6, changed_at=-1, distinct=distinct) == rates[1]
    rising = WaitPerToken()  # narrow rounds hid their copies, wide ones waited: no width is cheaper a token
    for i, (width, per_token) in enumerate([(2, 0.001), (17, 0.003), (2, 0.001), (17, 0.003)]):
        rising.add(width, per_token * width, i)
    pooled = rising.value(now=4, changed_at=-1)
    assert all(rising.by_width(t, now=4, changed_at=-1) == pytest.approx(pooled) for t in (2, 9, 17))


def test_shrunk_waits_follow_the_distinct_experts_they_are_asked_with():
    # the shrunk curve per distinct expert is kept between calls: asked with another ``distinct``
    # at the same samples, it is computed for that one, not handed back from the first
    waits = WaitPerToken()
    for i, (width, per_token) in enumerate([(2, 0.02), (9, 0.01), (2, 0.02)]):
        waits.add(width, per_token * width, i)
    few, many = {2: 2.0, 9: 4.0}.__getitem__, {2: 2.0, 9: 9.0}.__getitem__
    first = waits.by_width(9, now=3, changed_at=-1, shrunk=True, distinct=few)
    second = waits.by_width(9, now=3, changed_at=-1, shrunk=True, distinct=many)
    fresh = WaitPerToken()
    for sample in waits.samples:
        fresh.add(*sample)
    assert second == fresh.by_width(9, now=3, changed_at=-1, shrunk=True, distinct=many) != first


def test_the_plain_round_is_a_running_mean_since_a_restart_then_a_moving_average():
    plain = PlainRound(0.25)
    for now, seconds in enumerate((10.0, 20.0, 30.0)):
        plain.add(seconds, now)
    assert plain.value == pytest.approx(20.0)  # each sample counts alike since the start
    plain.add(40.0, 3)
    assert plain.value == pytest.approx(25.0)  # from the fourth on, the moving average's own step (0.25)
    plain.restart()
    plain.add(100.0, 4)
    assert plain.value == pytest.approx(100.0)  # after a restart the old average is of other conditions
    plain.add(90.0, 5)
    assert plain.value == pytest.approx(95.0)
    plain.add(90.0, 6)
    assert plain.value == pytest.approx(280.0 / 3)
    plain.add(60.0, 6 + 4 * STALE_HALF_LIFE)  # after a long gap the old average yields 15/16 of the way
    assert plain.value == pytest.approx(280.0 / 3 - 15 / 16 * (280.0 / 3 - 60.0))
    before = plain.value
    plain.add(3 * before, 7 + 4 * STALE_HALF_LIFE)  # 3x off the average: moved at least half way
    assert plain.value >= 2 * before
