"""Round phases: one run's summary from its sums, and several runs' pooled."""

from __future__ import annotations

import pytest

from specter.report.metrics import GenerationMetrics, phase_summary, pool_phases


def run(rounds: list[tuple[float, float, int, float | None]]) -> GenerationMetrics:
    """A run of rounds (draft_s, verify_s, experts_read, verify_kernel_s): two draft steps each."""
    metrics = GenerationMetrics()
    for draft_s, verify_s, experts, kernels in rounds:
        metrics.observe_round(draft_s=draft_s, flush_s=0.001, verify_s=verify_s, host_s=0.002, total_s=0.1,
                              draft_steps=2, verify_tokens=3, experts_read=experts, verify_io_wait_s=0.0,
                              verify_kernel_s=kernels)
    return metrics


def test_the_report_is_the_summary_of_its_sums():
    metrics = run([(0.02, 0.05, 10, 0.04), (0.04, 0.07, 14, 0.05)])
    report = metrics.phase_report(moe_layers=2)
    assert report == phase_summary(metrics.phases, 2)
    assert report["draft_step_s"] == pytest.approx(0.06 / 4)
    assert report["verify_compute_s_per_expert"] == pytest.approx(0.12 / 24)
    assert report["verify_kernel_s_per_expert"] == pytest.approx(0.09 / 24)
    assert report["distinct_experts_per_layer"] == pytest.approx(24 / 2 / 2)


def test_pooled_runs_weigh_each_round_not_each_run():
    short = run([(0.02, 0.05, 10, 0.04)]).phase_report(2)
    long = run([(0.04, 0.07, 14, 0.05)] * 3).phase_report(2)
    pooled = pool_phases([short, long], 2)
    assert pooled["rounds"] == 4
    assert pooled["verify_compute_s_per_expert"] == pytest.approx((0.05 + 3 * 0.07) / (10 + 3 * 14))
    assert pooled["verify_kernel_s_per_expert"] == pytest.approx((0.04 + 3 * 0.05) / (10 + 3 * 14))
    assert pooled["draft_step_s"] == pytest.approx((0.02 + 3 * 0.04) / 8)
    one_run = phase_summary(run([(0.02, 0.05, 10, 0.04)] + [(0.04, 0.07, 14, 0.05)] * 3).phases, 2)
    assert pooled == pytest.approx(one_run)  # the four rounds as one run (sums in another order)


def test_kernels_pool_only_where_every_run_measured_them():
    measured = run([(0.02, 0.05, 10, 0.04)]).phase_report(2)
    unmeasured = run([(0.02, 0.05, 10, None)]).phase_report(2)
    pooled = pool_phases([measured, unmeasured], 2)
    assert pooled["verify_kernel_s"] is None and pooled["verify_kernel_s_per_expert"] is None
    assert pooled["verify_compute_s_per_expert"] == pytest.approx(0.1 / 20)


def test_runs_without_rounds_pool_to_nothing():
    assert pool_phases([None, GenerationMetrics().phase_report(2)], 2) is None
    assert pool_phases([], 2) is None


def test_tokens_per_verification_are_the_tokens_emitted_not_the_drafts_accepted():
    metrics = GenerationMetrics()
    metrics.observe_draft(4, 4)  # the target accepted all four drafts ...
    metrics.observe_decode_step(2, 0.01)  # ... but an EOS in the second ended the generation
    metrics.observe_draft(4, 1)
    metrics.observe_decode_step(2, 0.01)
    assert metrics.acceptance_rate == pytest.approx(5 / 8)  # the draft's agreement counts all four
    assert metrics.mean_accepted_per_step == pytest.approx(2.0)  # it was 3.5: 5 accepted + 2 rounds
