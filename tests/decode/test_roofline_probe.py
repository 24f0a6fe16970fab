"""The roofline governor's exploration as pure functions: its calibration schedule and the k a probe
tries (neighbours in turn, every third probe the width measured least recently near the best rate)."""

from __future__ import annotations

from specter.decode.roofline_cost import STALE_HALF_LIFE
from specter.decode.roofline_probe import ProbeSchedule, calibration_rounds, probe_k

RATES = [100.0, 120.0, 150.0, 160.0, 158.0, 140.0, 90.0, 70.0, 60.0]  # predicted tokens/s for k = 0..8


def test_the_calibration_visits_k0_the_plain_round_twice_and_the_first_widths_once():
    assert calibration_rounds(4, 8) == [4, 0, 0, 1, 2]
    assert calibration_rounds(0, 8) == [0, 0, 1, 2]  # k0 = 0: then one more plain round
    assert calibration_rounds(2, 8) == [2, 0, 0, 1]
    assert calibration_rounds(4, 1) == [4, 0, 0, 1]
    assert calibration_rounds(4, 32, widest=True)[-2:] == [2, 32]
    assert calibration_rounds(32, 32, widest=True) == [32, 0, 0, 1, 2]  # k0 already the widest


def test_neighbour_probes_step_up_then_down_within_the_frontier():
    assert probe_k(3, 1, [], frontier=8, k_max=8, measured_at={}, rounds=50) == 4
    assert probe_k(3, 2, [], frontier=8, k_max=8, measured_at={}, rounds=50) == 2
    assert probe_k(5, 1, [], frontier=5, k_max=8, measured_at={}, rounds=50) == 5  # the frontier holds it
    assert probe_k(1, 2, [], frontier=8, k_max=8, measured_at={}, rounds=50) == 0
    assert probe_k(0, 1, [], frontier=8, k_max=8, measured_at={}, rounds=50) == 2  # speculation off: k = 2
    assert probe_k(0, 2, [], frontier=8, k_max=8, measured_at={}, rounds=50) == 2
    assert probe_k(0, 1, [], frontier=8, k_max=1, measured_at={}, rounds=50) == 1


def test_a_far_probe_takes_the_width_measured_least_recently_near_the_best_rate():
    rounds = 50
    measured = {w: rounds - 1 for w in range(1, 10)}  # every width measured last round ...
    measured[6] = 10  # ... but k = 5's (rate 140 >= 0.8 x 160) long ago
    measured[8] = 5  # k = 7's longer ago still, yet its rate (70) is far below the best
    assert probe_k(3, 0, RATES, frontier=8, k_max=8, measured_at=measured, rounds=rounds) == 5
    del measured[5]  # k = 4 never measured: first, before any measured long ago
    assert probe_k(3, 0, RATES, frontier=8, k_max=8, measured_at=measured, rounds=rounds) == 4
    # beyond the frontier nothing is tried: of k <= 3 only k = 2 (150) is near the best
    assert probe_k(3, 0, RATES, frontier=3, k_max=8, measured_at={w: rounds for w in range(1, 10)},
                   rounds=rounds) == 2
    assert probe_k(3, 0, RATES, frontier=8, k_max=8, measured_at={w: rounds for w in range(1, 10)},
                   rounds=rounds) == 2  # all measured alike: the nearest, the lower of two
    assert probe_k(2, 0, [50.0, 50.0, 200.0], frontier=2, k_max=8, measured_at={}, rounds=rounds) == 2  # none near
    # unknown rates are all eligible, and the plain round never measured is stale: it goes first
    assert probe_k(3, 0, [None] * 9, frontier=3, k_max=8, measured_at={}, rounds=rounds) == 0


def test_a_stale_plain_round_is_refreshed_first_and_speculation_off_widens_the_range():
    rounds = 100
    measured = {w: rounds - 1 for w in range(2, 10)}
    flat = [150.0, 152.0, 155.0, 160.0, 158.0, 150.0, 140.0, 130.0, 120.0]
    measured[1] = rounds - STALE_HALF_LIFE - 1
    assert probe_k(3, 0, flat, frontier=8, k_max=8, measured_at=measured, rounds=rounds) == 0
    assert probe_k(3, 0, RATES, frontier=8, k_max=8, measured_at=measured, rounds=rounds) != 0  # 100: not near 160
    measured[1] = rounds - 1
    off = [160.0, 100.0, 90.0, 80.0, 60.0, 50.0, 40.0, 30.0, 20.0]  # k = 0 best; 0.6 x 160 = 96 admits k = 1
    measured[2] = 0
    assert probe_k(0, 0, off, frontier=8, k_max=8, measured_at=measured, rounds=rounds) == 1
    assert probe_k(3, 0, off, frontier=8, k_max=8, measured_at=measured, rounds=rounds) == 0  # 0.8 x 160: only k = 0


def test_probes_back_off_while_the_choice_stays_and_less_while_speculation_is_off():
    def gaps(best: int, rounds: int = 300) -> list[int]:
        schedule, due = ProbeSchedule(8), []
        for now in range(rounds):
            if schedule.due(now, best):
                due.append(now)
        return [b - a for a, b in zip(due, due[1:])]

    assert gaps(best=6)[:5] == [8, 16, 32, 64, 64]  # doubling, at most 8 x every
    assert gaps(best=0)[:4] == [8, 16, 32, 32]  # speculation off: at most 4 x every
    schedule = ProbeSchedule(8)
    # a new choice at round 20: the probe already due at 32 stays, and the next comes 8 after it (not 32)
    assert [now for now in range(45) if schedule.due(now, 6 if now < 20 else 7)] == [8, 16, 32, 40]
    schedule.soon(45)
    assert schedule.next == 47 and schedule.interval == 8
    schedule.soon(50, later=False)
    assert schedule.next == 47


def test_speculation_switched_off_is_probed_within_every_rounds_however_long_the_last_interval():
    """After a long steady choice the next probe can be 8 x ``every`` away; a switch to k = 0 pulls
    it in, so a draft that got good again waits at most ``every`` rounds for its first probe."""
    schedule = ProbeSchedule(8)
    due = [now for now in range(200) if schedule.due(now, 6)]
    assert due[-1] - due[-2] == 64 and schedule.next > 250
    off_at = 205
    first_off_probe = next(now for now in range(off_at, 400) if schedule.due(now, 0))
    assert first_off_probe <= off_at + 8
