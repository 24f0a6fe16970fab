"""How the roofline governor reads a round's time against its prediction (``RoundWatch``): a lone
round far off is held back and dropped, two in a row are a change; and what a new link resets."""

from __future__ import annotations

import pytest

from specter.decode.roofline import RooflineGovernor
from specter.decode.roofline_watch import CHANGE, HOLD, LOOK, NOISE, RoundWatch, prediction_by_k

from roofline_machines import Machine, WaitingMachine, drive, fixed_rate, settled


def steady_watch() -> RoundWatch:
    """A watch whose typical miss is about 5%."""
    watch = RoundWatch(0.25)
    for measured in (1.05, 0.95, 1.05, 0.95):
        assert watch.judge(measured, 1.0, transition=False, known=True) == NOISE
    return watch


def test_a_lone_round_far_off_is_held_and_dropped_when_the_next_runs_as_predicted():
    watch = steady_watch()
    typical = watch.spread.value
    assert watch.judge(3.0, 1.0, transition=False, known=True) == HOLD
    watch.hold("samples")
    assert watch.spread.value == typical  # nothing learnt from it yet
    assert watch.judge(1.02, 1.0, transition=False, known=True) == NOISE
    assert watch.held is None and (watch.holds, watch.dropped) == (1, 1)


def test_two_rounds_far_off_the_same_way_are_a_change():
    watch = steady_watch()
    assert watch.judge(3.0, 1.0, transition=False, known=True) == HOLD
    watch.hold("samples")
    assert watch.judge(2.8, 1.0, transition=False, known=True) == CHANGE
    assert watch.take_held() == "samples" and watch.held is None


def test_far_off_the_other_way_does_not_confirm_the_held_round():
    watch = steady_watch()
    assert watch.judge(3.0, 1.0, transition=False, known=True) == HOLD
    watch.hold("slow")
    assert watch.judge(0.3, 1.0, transition=False, known=True) == HOLD  # held in its place
    assert watch.dropped == 1


def test_a_transition_is_noise_and_an_extrapolation_far_off_only_a_reason_to_look():
    watch = steady_watch()
    assert watch.judge(3.0, 1.0, transition=True, known=True) == NOISE
    watch = steady_watch()
    assert watch.judge(3.0, 1.0, transition=False, known=False) == LOOK


class HiccupMachine(Machine):
    """``Machine`` where every ``every``-th round takes ``factor`` times as long, every part of it
    (on this VM now and then a round ran 3x its prediction, its draft steps 5x, the rounds
    around it as predicted)."""

    def __init__(self, *args, every: int = 25, factor: float = 3.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.every, self.factor, self.count = every, factor, 0

    def round(self, k: int) -> tuple[int, dict]:
        accepted, timings = super().round(k)
        self.count += 1
        if self.count % self.every == 0:
            for name in ("draft_s", "verify_s", "host_s", "round_s"):
                timings[name] *= self.factor
        return accepted, timings


def test_a_lone_slow_round_is_not_a_change_of_conditions():
    machine = HiccupMachine(0.9, 1e-3)
    governor, log = RooflineGovernor(k=4), []
    drive(governor, machine, 210, log)
    assert governor._changed_at == -1  # nothing recalibrated: the machine's conditions never changed
    assert governor.watch.holds >= 3 and governor.watch.dropped == governor.watch.holds
    assert not [h for h in governor.history if h["k"] == 0 and not h["probe"]]  # speculation never switched off
    best = max(fixed_rate(HiccupMachine(0.9, 1e-3), k, 2000) for k in range(9))  # k = 1..8 within 3%
    assert sum(t for t, _ in log[40:]) / sum(s for _, s in log[40:]) >= 0.9 * best


def test_after_a_new_link_where_waits_are_reported_only_the_waits_and_the_plain_round_restart():
    # the verification's compute and the draft step stay (the machine's); the waits restart and
    # the plain round is measured again: two plain rounds instead of the seven-round calibration
    def machine(wait: float) -> WaitingMachine:  # k = 1-2 is best with 8 ms waits a token, k = 8 with 0.5
        return WaitingMachine(0.95, 0.0, per_expert=0.5e-3, draft=0.5e-3, wait_per_token=wait)

    slow = machine(8e-3)
    governor = RooflineGovernor(k=4)
    drive(governor, slow, 150)
    fast = machine(0.5e-3)  # the engine moved to a 16x faster link and says so
    fast.rng, fast.waits = slow.rng, slow.waits
    governor.link_changed()
    log: list = []
    chosen = drive(governor, fast, 60, log)
    assert chosen[:2] == [0, 0] and chosen[2] >= 6  # no k = 1 and 2 rounds to calibrate the compute again
    for k in range(1, governor.k_max + 1):
        true_round = fast.mean_verify_s(k + 1) + fast.host + (k + 1) * fast.draft
        assert abs(governor.round_s(k) - true_round) < 0.3 * true_round, k
    best = max(fixed_rate(machine(0.5e-3), k, 2000) for k in range(9))
    assert settled(chosen) >= 6 and sum(t for t, _ in log[2:]) / sum(s for _, s in log[2:]) >= 0.9 * best


def test_prediction_by_k_takes_medians_and_totals_of_chosen_rounds_only():
    def entry(k, predicted, measured, **flags):
        return {"k": k, "predicted_round_s": predicted, "measured_round_s": measured,
                "probe": False, "cut": False, "trial": False, **flags}

    history = [entry(4, 0.10, 0.08), entry(4, 0.10, 0.12), entry(4, 0.20, 0.10),
               entry(4, 0.5, 0.01, probe=True), entry(2, 0.05, 0.5, cut=True), entry(2, 0.05, 0.5, trial=True),
               entry(6, None, 0.2)]
    got = prediction_by_k(history)
    assert got.keys() == {"4"} and got["4"]["rounds"] == 3 and got["4"]["error"] == 0.0
    assert (got["4"]["predicted_s"], got["4"]["measured_s"]) == (0.10, 0.10)
    assert got["4"]["total_error"] == pytest.approx(0.10 / 0.30)  # sums 0.40 predicted against 0.30


def test_a_skewed_round_time_parts_the_medians_but_not_the_totals():
    rounds = [(0.03, 0.01)] * 3 + [(0.03, 0.09)]  # most rounds wait nothing, one waits long: mean 0.03
    history = [{"k": 7, "predicted_round_s": p, "measured_round_s": m, "probe": False, "cut": False,
                "trial": False} for p, m in rounds]
    got = prediction_by_k(history)["7"]
    assert got["error"] == pytest.approx(2.0) and got["total_error"] == pytest.approx(0.0, abs=1e-12)
