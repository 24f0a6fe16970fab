"""Governors: the fixed governor and its registration."""

from __future__ import annotations

import pytest

from specter.decode.governor import MAX_K, Governor, check_observation
from specter.decode.governors import FixedGovernor
from specter.hookspecs import hookimpl
from specter.plugins import register_plugin, registry


pytestmark = pytest.mark.usefixtures("clean_plugins")


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
    with pytest.raises(ValueError, match=f"k must be an integer in 1..{MAX_K}"):
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


class RecordingGovernor(Governor):
    """A third-party governor: returns a scripted k per round and records what it observes."""

    name = "recording"

    def __init__(self, script=(2, 0, 3), k: int = 4) -> None:
        self.script, self.calls, self.observed = list(script), 0, []

    def next_k(self):
        k = self.script[self.calls % len(self.script)]
        self.calls += 1
        return k

    def observe(self, drafted: int, accepted: int, **timings: float) -> None:
        self.observed.append((drafted, accepted, timings))


class GovernorPlugins:
    def __init__(self, governor) -> None:
        self.governor = governor

    @hookimpl
    def register_governors(self, register) -> None:
        register("recording", lambda k: self.governor)


def run_specter(checkpoint, governor_name="recording", tokens=12):
    import specter

    engine = specter.load({"model": str(checkpoint), "engine": "specter", "max_new_tokens": tokens, "threads": 1,
                           "offload": {"link": {"kind": "local"}, "expert_budget": 0.5},
                           "speculation": {"governor": {"name": governor_name}}})
    return engine, engine.generate([[1, 17, 93, 4, 250, 31]])


def test_third_party_governor_gets_the_round_timings_and_k_zero_decodes_plainly(tiny_mixtral):
    governor = RecordingGovernor()
    register_plugin(GovernorPlugins(governor))
    engine, result = run_specter(tiny_mixtral)
    assert governor.observed and all(0 <= a <= d for d, a, _ in governor.observed)
    drafted, _, timings = governor.observed[0]
    assert drafted == 2
    for name in ("draft_s", "draft_issue_s", "flush_s", "verify_s", "verify_io_wait_s", "host_s", "round_s",
                 "draft_steps", "experts_read"):
        assert name in timings and timings[name] >= 0, name
    assert timings["round_s"] >= timings["draft_s"] + timings["verify_s"]
    plain = [t for d, _, t in governor.observed if d == 0]
    assert plain and all(t["draft_steps"] == 0 for t in plain)
    assert result.report["k"]["histogram"].get("0")
    assert result.report["governor"] == {"name": "recording"}
    requested = [governor.script[i % len(governor.script)] for i in range(len(governor.observed))]
    assert [t["cut_short"] for _, _, t in governor.observed] == [d < k for (d, _, _), k in zip(governor.observed, requested)]


def test_a_round_the_generations_end_shortens_is_observed_as_cut_short(tiny_mixtral):
    governor = RecordingGovernor(script=(8,))
    register_plugin(GovernorPlugins(governor))
    run_specter(tiny_mixtral, tokens=4)
    drafted, _, timings = governor.observed[0]
    assert drafted < 8 and timings["cut_short"] is True


@pytest.mark.parametrize("bad", [-1, MAX_K + 1, 2.5, None])
def test_a_governor_returning_a_bad_k_stops_the_run_naming_it(tiny_mixtral, bad):
    from specter.errors import SpecterError

    register_plugin(GovernorPlugins(RecordingGovernor(script=(bad,))))
    with pytest.raises(SpecterError, match=r"governor 'recording' returned k="):
        run_specter(tiny_mixtral)


def test_roofline_governor_is_lossless_and_reports_its_table(tiny_mixtral):
    import specter

    engine, result = run_specter(tiny_mixtral, "roofline", tokens=24)
    resident = specter.load({"model": str(tiny_mixtral), "engine": "resident", "max_new_tokens": 24, "threads": 1})
    assert result.token_ids == resident.generate([[1, 17, 93, 4, 250, 31]]).token_ids
    summary = result.report["governor"]
    assert summary["name"] == "roofline" and len(summary["table"]) == summary["k_max"] + 1
    assert len(summary["trace"]) == result.report["phases"]["rounds"]
