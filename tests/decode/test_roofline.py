"""The roofline governor: its model, its choices, and how it follows changing conditions.

The governor is driven by a synthetic machine whose round time and acceptance are known, so the
best k is known too: round(k) = host + (k+1) * draft + verify(k+1), verify(T) = per_expert *
distinct(T) + io(T), and each draft position is accepted with probability p (seeded, so runs
are reproducible).
"""

from __future__ import annotations

import random

import pytest

from specter.errors import SpecterError
from specter.decode.governor import MAX_K, check_next_k
from specter.plugins import registry
from specter.decode.roofline import RooflineGovernor
from specter.decode.roofline_fit import distinct_experts

from roofline_machines import Machine, ScatteredComputeMachine, drive, drive_prompts, fixed_rate, settled


def test_expected_accepted_follows_per_position_acceptance():
    governor = RooflineGovernor(k=2, prior_acceptance=0.5)
    assert governor.expected_accepted(0) == 0
    assert governor.expected_accepted(3) == pytest.approx(0.5 + 0.25 + 0.125)


@pytest.mark.parametrize("p, io", [(0.95, 4e-3), (0.9, 1e-3), (0.3, 1e-4), (0.95, 0.0), (0.0, 1e-3)])
def test_reaches_the_throughput_of_the_best_fixed_k(p, io):
    machine = Machine(p, io)
    log: list = []
    drive(RooflineGovernor(k=4), machine, 300, log)
    rate = sum(t for t, _ in log[50:]) / sum(s for _, s in log[50:])
    best = max(fixed_rate(Machine(p, io), k) for k in range(9))
    assert rate >= 0.95 * best, (rate, best)


def test_speculation_switches_off_when_it_stops_paying_and_back_on():
    machine = Machine(0.95, 1e-4, draft=2e-4)
    governor = RooflineGovernor(k=4, probe_every=8)
    high = settled(drive(governor, machine, 80))
    assert high >= 3
    machine.p = 0.0  # a prompt on which the draft is always wrong
    low = settled(drive(governor, machine, 80))
    assert low == 0 and governor.best_k() == 0
    machine.p = 0.95
    assert settled(drive(governor, machine, 120)) >= 3


def test_speculation_comes_back_within_120_rounds_for_almost_every_draw():
    # the same story over 10 seeds; before the acceptance estimate shrunk to the pooled one and
    # the follow-up of fully kept probes while off, half of the seeds were still at k = 0
    back = 0
    for seed in range(10):
        machine = Machine(0.95, 1e-4, draft=2e-4)
        machine.rng = random.Random(seed)
        governor = RooflineGovernor(k=4, probe_every=8)
        drive(governor, machine, 80)
        machine.p = 0.0
        drive(governor, machine, 80)
        machine.p = 0.95
        back += settled(drive(governor, machine, 120)) >= 3
    assert back >= 9


def test_k_grows_when_the_link_slows_down():
    machine = Machine(0.8, 0.0, per_expert=2e-3, draft=1e-3)
    governor = RooflineGovernor(k=2)
    fast = settled(drive(governor, machine, 100))
    machine.io = 2e-2
    slow = settled(drive(governor, machine, 100))
    assert slow > fast


def test_after_a_long_steady_run_a_faster_link_is_noticed_and_k_comes_back():
    machine = Machine(0.8, 2e-2, per_expert=2e-3, draft=1e-3)
    governor = RooflineGovernor(k=2)
    slow = settled(drive(governor, machine, 300))  # probes have backed off to their longest interval
    machine.io = 0.0
    after = drive(governor, machine, 100)
    best_k = Machine(0.8, 0.0, per_expert=2e-3, draft=1e-3).best_k()
    assert best_k < slow
    assert settled(after) == best_k


def test_predicted_round_time_matches_the_measured_one():
    machine = Machine(0.9, 1e-3)
    governor = RooflineGovernor(k=4)
    drive(governor, machine, 100)
    summary = governor.summary()
    assert summary["prediction_error"] < 0.05 and summary["prediction_total_error"] < 0.05
    main = summary["prediction"][str(summary["prediction_k"])]  # the errors are of the width of most rounds
    assert summary["prediction_rounds"] == main["rounds"] == max(row["rounds"] for row in summary["prediction"].values())
    assert summary["prediction_error"] == main["error"]
    assert len(summary["table"]) == governor.k_max + 1 and len(summary["trace"]) == 100


def test_latency_cap_limits_k():
    machine = Machine(0.95, 4e-3)
    free = settled(drive(RooflineGovernor(k=4), machine, 100))
    capped_governor = RooflineGovernor(k=4, max_latency_ms=1.0)  # impossible: take the fastest per token
    drive(capped_governor, machine, 100)
    latency = {row["k"]: 1 / row["predicted_tokens_per_s"] for row in capped_governor.table()
               if row["k"] <= capped_governor.frontier()}
    assert free >= 1 and capped_governor.best_k() == min(latency, key=latency.get) != 0


def test_registered_and_built_with_the_engine_context():
    governor = registry().create("governor", "roofline", {"k_max": 6}, key="speculation.governor", k=3,
                                 n_experts=8, top_k=2)
    assert isinstance(governor, RooflineGovernor) and governor.k_max == 6 and governor.n_experts == 8
    with pytest.raises(SpecterError, match="speculation.governor"):
        registry().create("governor", "roofline", {"k_max": 99}, key="speculation.governor", k=3)


@pytest.mark.parametrize("k", [-1, 33, 2.0, None, True])
def test_the_engine_refuses_a_bad_k_naming_the_governor(k):
    with pytest.raises(SpecterError, match="governor 'roofline' returned k="):
        check_next_k(k, RooflineGovernor())


def test_verify_cost_is_monotone_in_width_so_one_lucky_width_cannot_make_it_jagged():
    governor = RooflineGovernor(k=4, n_experts=16, top_k=2)
    for width, seconds in [(3, 0.06), (5, 0.10), (6, 0.07), (8, 0.12), (9, 0.40)]:  # width 6 lucky
        for _ in range(20):
            governor.observe(drafted=width - 1, accepted=0, draft_s=0.01 * width, draft_steps=width, verify_s=seconds)
    predicted = [governor.verify_s(t) for t in range(2, 10)]
    assert predicted == sorted(predicted)  # monotone in width
    assert governor.verify_s(6) > 0.07


def test_widths_between_measured_ones_follow_a_cost_that_grows_with_tokens():
    # a verification whose cost is per token (compute), not per expert read: between widths 6 and
    # 13, interpolating in distinct experts alone would put width 9 at 0.049 s, not 0.045 s
    governor = RooflineGovernor(k=4, k_max=16, n_experts=16, top_k=2)
    for width in (3, 4, 6, 13):
        for _ in range(20):
            governor.observe(drafted=width - 1, accepted=0, draft_s=1e-3 * width, draft_steps=width,
                             verify_s=5e-3 * width)
    for width in (7, 9, 11):
        assert governor.verify_s(width) == pytest.approx(5e-3 * width, rel=1e-6)
    # past the widest measured (13) the cost is scaled by distinct experts from there, not extrapolated
    assert governor.verify_s(15) == pytest.approx(5e-3 * 13 * distinct_experts(15, 16, 2) / distinct_experts(13, 16, 2))


class StreamingMachine(Machine):
    """Verification beyond five tokens no longer fits the cache and pays a streaming cost, so
    the verify cost jumps instead of following the line through distinct experts."""

    def round(self, k: int) -> tuple[int, dict]:
        accepted, timings = super().round(k)
        if k + 1 > 5:
            timings["verify_s"] += 0.02 * (k - 4)
            timings["round_s"] += 0.02 * (k - 4)
        return accepted, timings


def test_far_probes_find_a_better_k_that_neighbour_probes_would_not_reach():
    machine = StreamingMachine(0.95, 0.0, per_expert=1e-3, draft=1e-3)
    # told the cache's size (as the engine tells it): five tokens' distinct experts a layer
    governor = RooflineGovernor(k=8, cache_slots_per_layer=distinct_experts(5, 16, 2))
    for width in (7, 8, 9):  # a history that only knows the wide rounds, as after a long run at k = 8
        for _ in range(20):
            accepted, timings = machine.round(width - 1)
            governor.observe(drafted=width - 1, accepted=accepted, **timings)
    governor._calibration.clear()
    log: list = []
    chosen = drive(governor, machine, 200, log)
    assert set(chosen[:60]) - {0, 1, 8}, "never measured a width far from its choices"
    best = machine.best_k()
    assert best <= 4 and settled(chosen) <= 5
    rate = sum(t for t, _ in log[100:]) / sum(s for _, s in log[100:])
    assert rate >= 0.95 * fixed_rate(StreamingMachine(0.95, 0.0, per_expert=1e-3, draft=1e-3), best)


def test_a_near_tie_keeps_the_current_choice_instead_of_flapping():
    from specter.decode.roofline import HOLD_MARGIN

    governor = RooflineGovernor(k=2)
    governor.probes.last_best = 2
    rates = {2: 100.0, 3: 100.0 * (1 + HOLD_MARGIN / 2), 4: 90.0}
    governor.table = lambda: [{"k": k, "predicted_tokens_per_s": rates.get(k, 50.0)} for k in range(9)]
    assert governor.best_k() == 2  # k = 3 is faster, but within the hold margin
    rates[3] = 100.0 * (1 + 2 * HOLD_MARGIN)
    assert governor.best_k() == 3  # clearly faster: the choice moves


def test_round_time_counts_the_draft_steps_the_engine_reports():
    governor = RooflineGovernor(k=4)
    for _ in range(5):
        governor.observe(drafted=4, accepted=4, draft_s=0.05, draft_steps=5, verify_s=0.1, host_s=0.0)
    with_routing_step = governor.round_s(4)
    assert with_routing_step == pytest.approx(5 * 0.01 + 0.1)
    for _ in range(30):  # the engine now drafts without the routing-only step (a synchronous link)
        governor.observe(drafted=4, accepted=4, draft_s=0.04, draft_steps=4, verify_s=0.1, host_s=0.0)
    assert governor.round_s(4) == pytest.approx(4 * 0.01 + 0.1, rel=1e-3)


def test_a_round_cut_short_at_the_end_of_a_prompt_is_neither_a_probe_nor_a_surprise():
    governor = RooflineGovernor(k=4)
    machine = Machine(0.9, 1e-3)
    drive(governor, machine, 40)
    while governor.next_k() == 0:
        accepted, timings = machine.round(0)
        governor.observe(drafted=0, accepted=accepted, **timings)
    probes_before, next_probe = governor.summary()["probes"], governor.probes.next
    accepted, timings = machine.round(0)  # the engine had one token left: nothing drafted, a short round
    governor.observe(drafted=0, accepted=accepted, **timings)
    summary = governor.summary()
    assert summary["cut_rounds"] == 1 and summary["probes"] == probes_before
    assert governor.probes.next == next_probe  # a short round's time is no reason to look around


def test_estimates_made_on_a_slower_link_do_not_keep_wide_rounds_from_being_chosen_on_a_faster_one():
    machine = Machine(0.95, 2e-2, draft=5e-4)
    governor = RooflineGovernor(k=4, k_max=8)  # with 32 both links' best k is 32: nothing to tell apart
    assert settled(drive(governor, machine, 150)) == 8
    machine.io = 1e-3  # ten times less I/O per expert: every width's old average is far too high
    log: list = []
    after = drive(governor, machine, 80, log)
    fast = Machine(0.95, 1e-3, draft=5e-4)
    best = fast.best_k()
    assert best >= 6 and settled(after) >= 6
    rate = sum(t for t, _ in log[20:]) / sum(s for _, s in log[20:])
    assert rate >= 0.94 * fixed_rate(fast, best)


def test_after_the_engine_reports_a_new_link_every_width_follows_the_new_costs():
    machine = Machine(0.9, 2e-2, draft=5e-4)
    governor = RooflineGovernor(k=4)
    drive(governor, machine, 150)
    machine.io = 5e-4  # the engine moved to a 40x faster link and says so
    governor.link_changed()
    chosen = drive(governor, machine, 40)
    assert chosen[:5] == [4, 0, 0, 1, 2]  # calibrates again
    for k in range(governor.k_max + 1):
        true_round = machine.round(k)[1]["round_s"]
        assert abs(governor.round_s(k) - true_round) < 0.3 * true_round, k


class WarmAfterDraft(Machine):
    """A plain round right after a drafted one finds that round's prefetches in the cache and
    costs ``warm_share`` of a plain round's verify time; plain rounds after plain ones pay it all."""

    def __init__(self, *args, warm_share: float = 0.5, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.warm_share, self.last_k = warm_share, 0

    def round(self, k: int) -> tuple[int, dict]:
        accepted, timings = super().round(k)
        if k == 0 and self.last_k:
            timings["verify_s"] *= self.warm_share
            timings["round_s"] = sum(timings[n] for n in ("draft_s", "verify_s", "host_s"))
        self.last_k = k
        return accepted, timings


def test_a_plain_round_after_a_drafted_one_does_not_make_plain_decoding_look_cheap():
    # plain decoding would be best if every plain round cost what the first after a draft costs
    # (k = 0 at 1.6x the rate of k = 2 with the warm cost), but it is the slowest choice here.
    # Over eight draws: k = 1..8 lie within 5% of each other, so one draw's probes and acceptance
    # luck move its rate 0.89-1.15x the best fixed k, and its last plain estimate 0.63-1.0x the
    # steady cost (the committed calibration before stop 59 as well: sixteen draws each)
    steady_plain = Machine(0.9, 4e-3, draft=1e-3).round(0)[1]["round_s"]
    plain, rates = [], []
    for seed in range(8):
        machine = WarmAfterDraft(0.9, 4e-3, draft=1e-3, warm_share=0.25)
        machine.rng = random.Random(seed)
        governor = RooflineGovernor(k=2, probe_every=6)
        log: list = []
        chosen = drive(governor, machine, 200, log)
        assert chosen.count(0) < 0.15 * len(chosen), seed
        plain.append(governor.round_s(0))
        rates.append(sum(t for t, _ in log[50:]) / sum(s for _, s in log[50:]))
    assert sorted(plain)[4] == pytest.approx(steady_plain, rel=0.1)  # a median: single draws 0.63-1.0x
    best = max(fixed_rate(Machine(0.9, 4e-3, draft=1e-3), k) for k in range(1, 9))
    assert sum(rates) / len(rates) >= 0.95 * best


class JitteryMachine(Machine):
    """``Machine`` whose verification time is alternately 1.5x and 0.6x its mean (a slow link's spread)."""

    def round(self, k: int) -> tuple[int, dict]:
        accepted, timings = super().round(k)
        self.turn = not getattr(self, "turn", False)
        extra = timings["verify_s"] * (0.5 if self.turn else -0.4)
        timings["verify_s"] += extra
        timings["round_s"] += extra
        return accepted, timings


@pytest.mark.parametrize("machine, looks_around",
                         [(Machine(0.9, 1e-3), True), (JitteryMachine(0.9, 1e-3), False)])
def test_a_round_off_its_prediction_by_the_usual_spread_is_noise_not_a_reason_to_probe(machine, looks_around):
    governor = RooflineGovernor(k=4)
    drive(governor, machine, 80)
    while governor.history[-1]["probe"] or governor._calibration:
        drive(governor, machine, 1)
    k = governor.next_k()
    while governor.history[-1]["probe"]:  # a scheduled probe: judge the next chosen round
        governor.observe(drafted=k, accepted=k, **machine.round(k)[1])
        k = governor.next_k()
    accepted, timings = Machine.round(machine, k)
    slower = 0.6 * governor.predicted_round_s  # 60% above the prediction
    timings["verify_s"] += slower
    timings["round_s"] += slower
    governor.observe(drafted=k, accepted=accepted, **timings)
    assert (governor.probes.next <= governor.rounds + 2) == looks_around


class SwitchingMachine(Machine):
    """The first round at a new k pays for the cache contents the old k left: its verification
    takes ``penalty`` times as long (the widened model at 50% on 2 GB/s: up to 2x)."""

    def __init__(self, *args, penalty: float = 2.5, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.penalty, self.previous_k = penalty, None

    def round(self, k: int) -> tuple[int, dict]:
        accepted, timings = super().round(k)
        if self.previous_k is not None and k != self.previous_k:
            extra = timings["verify_s"] * (self.penalty - 1)
            timings["verify_s"] += extra
            timings["round_s"] += extra
        self.previous_k = k
        return accepted, timings


def test_the_first_round_at_a_new_k_is_a_transition_not_a_change_of_conditions():
    governor = RooflineGovernor(k=4, k_max=8)
    drive(governor, SwitchingMachine(0.9, 2e-3), 150)
    assert governor._changed_at == -1  # never recalibrated: the machine's conditions never changed


def test_a_round_timed_on_a_compiled_path_trial_teaches_acceptance_but_not_costs():
    governor = RooflineGovernor(k=4)
    machine = Machine(0.9, 1e-3)
    drive(governor, machine, 40)
    k = governor.next_k()
    accepted, timings = machine.round(k)
    costs, plain, measured = list(governor.cost.samples), governor.plain.value, dict(governor.verify_round)
    draft_step = governor.draft_step.value
    seen = list(governor.acceptance.seen)
    slow = {**timings, "verify_s": 3 * timings["verify_s"], "draft_s": 3 * timings["draft_s"],
            "round_s": 3 * timings["round_s"]}
    governor.observe(drafted=k, accepted=accepted, path_trial=True, **slow)
    assert list(governor.cost.samples) == costs and governor.plain.value == plain and governor.verify_round == measured
    assert governor.draft_step.value == draft_step
    assert governor.history[-1]["trial"] and k > 0 and governor.acceptance.seen != seen


class CliffMachine(Machine):
    """Transfers grow steeply past ``fits`` experts over the four layers (a cliff)."""

    def __init__(self, *args, fits: float = 44.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fits = fits

    def round(self, k: int) -> tuple[int, dict]:
        accepted, timings = super().round(k)
        extra = max(0.0, distinct_experts(k + 1, 16, 2) * 4 - self.fits) * 0.02
        timings["verify_s"] += extra
        timings["round_s"] += extra
        return accepted, timings


def test_k_goes_past_the_measured_widths_step_by_step_and_stops_at_the_cliff():
    from specter.decode.roofline import FRONTIER_STEP

    machine = CliffMachine(0.97, 4e-3, per_expert=1e-3, draft=1e-3)
    governor = RooflineGovernor(k=4, k_max=16, cache_slots_per_layer=machine.fits / 4)
    widest, log, chosen = 4, [], []
    for _ in range(200):
        k = governor.next_k()
        assert k <= max(widest + FRONTIER_STEP, 2 * widest)  # never a width far beyond the measured ones
        accepted, timings = machine.round(k)
        governor.observe(drafted=k, accepted=accepted, **timings)
        widest = max(widest, k)
        log.append((1 + accepted, timings["round_s"]))
        chosen.append(k)
    best = machine.best_k(16)
    # from k = 4 and the line through narrow widths, 16 would look best: past the cliff it is measured
    # once at most (a probe), never held
    assert best == 7 and settled(chosen) == 7 and sum(k > 8 for k in chosen) <= 1
    rate = sum(t for t, _ in log[50:]) / sum(s for _, s in log[50:])
    assert rate >= 0.95 * fixed_rate(CliffMachine(0.97, 4e-3, per_expert=1e-3, draft=1e-3), best)


def test_with_k_max_16_the_governor_climbs_to_wide_rounds_where_they_pay():
    machine = Machine(0.97, 2e-2, draft=5e-4)
    assert machine.best_k(16) >= 14
    chosen = drive(RooflineGovernor(k=4, k_max=16), machine, 60)
    assert settled(chosen) >= 12


def test_once_the_measured_rounds_stream_through_the_cache_wider_ones_need_no_steps():
    # four slots per layer: the calibration's k = 4 and k = 2 rounds already stream, so the line
    # through the measured widths holds beyond them and the governor goes straight to a wide k
    machine = Machine(0.97, 2e-2, draft=5e-4)
    governor = RooflineGovernor(k=4, k_max=16, cache_slots_per_layer=4)
    chosen = drive(governor, machine, 12)
    assert chosen[:5] == [4, 0, 0, 1, 2] and governor.frontier() == 16 and chosen[5] >= 14
    stepwise = drive(RooflineGovernor(k=4, k_max=16), Machine(0.97, 2e-2, draft=5e-4), 12)
    assert stepwise[5] == 8  # without the cache's size: twice the widest measured


def test_unless_given_k_max_is_the_widest_k_the_engines_allow():
    # the frontier reaches wide k only where they are measured to pay; a default of 8 where rounds
    # fit the cache left up to 23% on the table, 7.7% on the main job (stop 57)
    assert RooflineGovernor(cache_slots_per_layer=4.0).k_max == MAX_K
    assert RooflineGovernor(cache_slots_per_layer=8.0).k_max == MAX_K
    assert RooflineGovernor().k_max == MAX_K  # the cache's size unknown
    assert RooflineGovernor(k_max=12, cache_slots_per_layer=4.0).k_max == 12
    assert RooflineGovernor(k=20, cache_slots_per_layer=4.0).k0 == 20
    with pytest.raises(ValueError, match="k_max"):
        RooflineGovernor(k=20, k_max=8, cache_slots_per_layer=8.0)
    with pytest.raises(ValueError, match="k_max"):
        RooflineGovernor(k_max=0)


def test_a_plain_round_without_an_average_of_its_own_is_priced_from_the_narrowest_drafted_width():
    """The calibration's plain rounds may both be compiled-path trials (not measured): k = 0 is then
    priced as width 2 scaled by distinct experts, not as free (the fit's curve starts at width 2)."""
    machine = Machine(0.6, 0.0)
    governor = RooflineGovernor(k=4, k_max=8)
    for _ in range(8):
        k = governor.next_k()
        accepted, timings = machine.round(k)
        governor.observe(drafted=k, accepted=accepted, path_trial=k == 0, **timings)
    assert governor.plain.value is None
    true_plain = machine.round(0)[1]["verify_s"]
    assert governor.verify_s(1) == pytest.approx(true_plain, rel=0.25)
    rates = [row["predicted_tokens_per_s"] for row in governor.table()]
    assert rates[0] < 2 * max(rates[1:])


def test_a_change_of_conditions_next_to_k_1_measures_the_plain_round_cold_too():
    """A change found at k = 1 calibrates its neighbours again; the plain one twice, as a plain
    probe is: the first, right after a drafted round, finds the draft's prefetches cached (warm),
    and alone it would be the plain round's whole average."""
    governor = RooflineGovernor(k=1, k_max=8, probe_every=12)
    previous = 0
    for round_ in range(1, 104):
        scale = 3.0 if round_ >= 100 else 1.0
        k = governor.next_k()
        experts = distinct_experts(k + 1, 16, 2) * 4
        verify = experts * 0.5e-3 * scale * (0.25 if k == 0 and previous else 1.0)  # warm after a drafted round
        steps = k + 1 if k else 0
        timings = {"draft_s": steps * 1e-3 * scale, "flush_s": 0.0, "verify_s": verify, "host_s": 10e-3 * scale,
                   "draft_steps": steps}
        timings["round_s"] = timings["draft_s"] + verify + timings["host_s"]
        governor.observe(drafted=k, accepted=min(k, 1), **timings)
        if round_ == 101:
            assert governor._changed_at == 100 and governor._calibration[:2] == [0, 0]
        previous = k
    cold, warm = 4 * 0.5e-3 * 3 * 2, 4 * 0.5e-3 * 3 * 2 * 0.25  # a plain round's experts: 2 a layer x 4
    assert governor.plain.samples == 2 and governor.plain.value > (warm + cold) / 2 * 0.9


def test_scattered_rounds_rarely_trap_the_governor_at_a_narrow_k():
    # A compiled verification on a busy CPU: rounds scatter by 22%, so a fit through the first narrow
    # widths can put their cost on the tokens and price a wide round at 2-3x its cost. Such a width
    # was never chosen, so never measured, and the governor held k = 2-7 (bp82's compiled twin at 50%
    # on ``local``: k = 7 for 14 of 19 rounds, 0.79x ``resident``). Priced past the widest width
    # measured by distinct experts, a wide width is tried and measured. Extrapolating the fit, 9 of
    # these 100 seeds ran below 0.8x the best fixed k, median 0.945x.
    def timed_rate(governor, machine) -> float:
        log: list = []
        drive_prompts(governor, machine, 8, 32, log)
        return sum(tokens for tokens, _ in log) / sum(seconds for _, seconds in log)

    best = max(sum(timed_rate(k, ScatteredComputeMachine(seed)) for seed in range(20)) / 20 for k in (8, 16, 32))
    ratios = []
    for seed in range(100):
        governor, machine = RooflineGovernor(k=4, k_max=32, n_experts=16, top_k=2), ScatteredComputeMachine(seed)
        drive_prompts(governor, machine, 4, 48)  # the bench's warm-up
        ratios.append(timed_rate(governor, machine) / best)
    ratios.sort()
    assert ratios[50] >= 0.96
    assert sum(r < 0.8 for r in ratios) <= 5
