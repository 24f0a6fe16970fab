"""Governors: the fixed governor and its registration."""

from __future__ import annotations

import pytest

from specter.governors import MAX_K, FixedGovernor, Governor, check_observation
from specter.plugins import registry, reset_plugins


@pytest.fixture(autouse=True)
def fresh_plugins():
    reset_plugins()
    yield
    reset_plugins()


def test_fixed_governor_always_returns_k():
    governor = FixedGovernor(k=5)
    assert isinstance(governor, Governor)
    assert governor.next_k() == 5
    for drafted, accepted in [(5, 0), (5, 5), (5, 2)]:
        governor.observe(drafted, accepted, draft_s=0.01, verify_s=0.02, io_wait_s=0.0)
        assert governor.next_k() == 5
    assert FixedGovernor().next_k() == 4


@pytest.mark.parametrize("k", [0, -1, MAX_K + 1, True, 2.0, "4"])
def test_fixed_governor_rejects_bad_k(k):
    with pytest.raises(ValueError, match="k must be an integer in 1..16"):
        FixedGovernor(k)


@pytest.mark.parametrize("drafted, accepted", [(4, 5), (4, -1), (-1, 0), (4, 1.0)])
def test_observe_rejects_impossible_counts(drafted, accepted):
    with pytest.raises(ValueError, match="0 <= accepted <= drafted"):
        FixedGovernor(4).observe(drafted, accepted)
    with pytest.raises(ValueError):
        check_observation(drafted, accepted)


def test_fixed_governor_is_registered_and_created_with_k_from_the_engine():
    assert registry().get("governor", "fixed") is FixedGovernor
    governor = registry().create("governor", "fixed", {}, key="speculation.governor", k=MAX_K)
    assert governor.next_k() == MAX_K
