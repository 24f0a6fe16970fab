"""The path chooser: per-step choice by measured step time, and per-round choice judged by a cost
the caller measures over the round (the speculative engine's draft steps); the experts kernel a
graph traces for a blocked source."""

from __future__ import annotations

import time

import pytest
import torch

from specter import native
from specter.compile.parts import PathChooser, _pairs_kernel
from specter.kernels.slot_experts import gather_experts


def test_steps_take_the_path_with_the_lower_measured_time_after_trying_both():
    chooser = PathChooser()
    seconds = {"fused": 0.010, "layered": 0.013}
    for _ in range(2 * PathChooser.TRIALS):
        path = chooser.choose(0)
        chooser.observe(0, path, seconds[path])
    assert chooser.counts[(0, "fused")] == chooser.counts[(0, "layered")] == PathChooser.TRIALS
    assert chooser.choose(0) == "fused"


def test_a_round_holds_one_path_and_is_judged_by_the_callers_cost():
    # fused draft steps are faster, but the transfers their late predictions leave behind make
    # the rounds dearer: judged per round, layered wins
    chooser = PathChooser()
    round_cost = {"fused": 0.009 + 0.006, "layered": 0.013 + 0.0}
    chosen = []
    for _ in range(2 * PathChooser.TRIALS + 3):
        chooser.begin_round(0)
        path = chooser.held(0)
        for _ in range(3):  # the round's draft steps see the held path
            assert chooser.held(0) == path
        chooser.end_round(0, round_cost[path])
        chosen.append(path)
        assert chooser.held(0) is None
    assert sorted(chosen[: 2 * PathChooser.TRIALS]) == ["fused"] * PathChooser.TRIALS + ["layered"] * PathChooser.TRIALS
    assert chosen[2 * PathChooser.TRIALS:] == ["layered"] * 3
    assert chooser.counts[(0, "fused")] == PathChooser.TRIALS  # one observation per round, not per step


def test_ending_a_round_that_was_never_begun_observes_nothing():
    chooser = PathChooser()
    chooser.end_round(0, 1.0)
    assert chooser.counts == {} and chooser.held(0) is None


def test_trials_count_the_choices_of_the_path_measured_slower_so_far():
    chooser = PathChooser()
    seconds = {"fused": 0.030, "layered": 0.015}
    trial_flags = []
    for _ in range(2 * PathChooser.TRIALS + PathChooser.RECHECK):
        before = chooser.trials
        path = chooser.choose(5)
        chooser.observe(5, path, seconds[path])
        trial_flags.append((path, chooser.trials != before))
    assert trial_flags[0] == ("layered", False)  # the layered path first: nothing known yet
    assert trial_flags[1] == ("fused", True)  # not measured while the layered path is
    assert all(flag == (path == "fused") for path, flag in trial_flags)  # fused is the slower one here
    assert [path for path, _ in trial_flags].count("fused") == PathChooser.TRIALS + 1  # trials, one recheck


def test_one_slow_early_step_does_not_hide_the_faster_path():
    # fused is faster, but its first step was slow (beside a burst of copies): a moving average
    # kept layered until the next recheck; the median of the recent steps does not
    chooser = PathChooser()
    fused_times = iter([0.030] + [0.005] * 100)
    chosen = []
    for _ in range(2 * PathChooser.TRIALS + 5):
        path = chooser.choose(5)
        chooser.observe(5, path, next(fused_times) if path == "fused" else 0.010)
        chosen.append(path)
    assert chosen[2 * PathChooser.TRIALS:] == ["fused"] * 5


def test_run_judges_a_path_by_its_time_less_the_transfer_wait_it_added():
    # the fused path waits 30 ms for a copy (both paths would: the copy is the step's, not the
    # path's) and computes nothing; the layered path computes for 20 ms: fused is the faster path
    chooser = PathChooser()
    waited = [0.0]

    def fused():
        time.sleep(0.03)
        waited[0] += 0.03
        return "fused"

    def layered():
        time.sleep(0.02)
        return "layered"

    ran = [chooser.run(5, fused, layered, lambda: waited[0]) for _ in range(2 * PathChooser.TRIALS + 2)]
    assert ran[-2:] == ["fused", "fused"]
    assert chooser.seconds[(5, "fused")] < 0.01 < chooser.seconds[(5, "layered")]
    # without the wait it says, the chooser takes the path that computed less wall time
    plain = PathChooser()
    ran = [plain.run(5, fused, layered) for _ in range(2 * PathChooser.TRIALS + 2)]
    assert ran[-2:] == ["layered", "layered"]


def test_the_fused_path_replaces_the_layered_one_only_when_faster_by_the_margin():
    for fused_seconds, expected in ((0.0099, "layered"), (0.0090, "fused")):  # 1% and 10% faster than 0.010
        chooser = PathChooser()
        for _ in range(2 * PathChooser.TRIALS):
            path = chooser.choose(5)
            chooser.observe(5, path, fused_seconds if path == "fused" else 0.010)
        trials = chooser.trials
        assert chooser.choose(5) == expected
        assert chooser.trials == trials  # the path the evidence favours is no trial


def test_rechecks_of_a_path_that_keeps_losing_come_ever_more_rarely():
    chooser = PathChooser()
    seconds = {"fused": 0.030, "layered": 0.015}
    steps = 2 * PathChooser.TRIALS + 240
    fused_at = []
    for step in range(1, steps + 1):
        path = chooser.choose(5)
        chooser.observe(5, path, seconds[path])
        if path == "fused" and step > 2 * PathChooser.TRIALS:
            fused_at.append(step)
    recheck = PathChooser.RECHECK
    assert fused_at == [recheck, 3 * recheck, 7 * recheck, 15 * recheck]  # 16, then 32, 64, 128 steps later


def test_a_recheck_that_finds_the_other_path_faster_switches_and_rechecks_as_often_as_at_first():
    chooser = PathChooser()
    seconds = {"fused": 0.030, "layered": 0.015}
    chosen = []
    for step in range(1, 80):
        if step == 2 * PathChooser.TRIALS + 1:
            seconds = {"fused": 0.005, "layered": 0.015}  # the fused path became the faster one
        path = chooser.choose(5)
        chooser.observe(5, path, seconds[path])
        chosen.append(path)
    first = chosen.index("fused", 2 * PathChooser.TRIALS)
    assert first == PathChooser.RECHECK - 1  # the first recheck, at step 16
    # the median of the fused path's last WINDOW steps moves once enough fast ones come in; from
    # then on fused holds, with rechecks of the layered path again after RECHECK steps
    assert chosen[-5:] == ["fused"] * 5


def test_a_blocked_source_the_native_kernel_cannot_serve_is_refused_not_gathered_per_pair():
    gate_up, down = torch.zeros(4, 32, 16), torch.zeros(4, 16, 16)
    probe = gate_up.new_zeros(1, 16)
    with native.disabled():
        assert _pairs_kernel(probe, gate_up, down, blocked=False) is gather_experts
        with pytest.raises(RuntimeError, match="blocked experts need Specter's native kernels"):
            _pairs_kernel(probe, gate_up, down, blocked=True)
