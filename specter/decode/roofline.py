"""The ``roofline`` governor: picks k each round from an amortization roofline calibrated online.
Its verification cost model is ``specter.decode.roofline_cost``; its estimators (distinct
experts, the non-negative fit, isotonic regression, the moving average) ``roofline_fit``; its
exploration (the calibration rounds, a probe's k) ``roofline_probe``.

Contract (MoE-SpeQ's Speculative Governor, measured rather than assumed):
- Tokens per round with k drafts: ``1 + E[accepted(k)]``, ``E[accepted(k)] = sum_{i<=k} prod_{j<=i}
  p_j`` with ``p_j`` the acceptance at draft position j (``AcceptanceEstimate``: a round that
  kept a of k drafts observes 1 at positions 1..a and 0 at position a+1; each position's
  estimate is shrunk towards the acceptance pooled over all positions).
- Round time: ``T(k) = host + steps(k) * t_draft + V(k + 1)``. ``t_draft`` is the moving average of
  one draft step (``steps(k) = k + 1`` while the engine runs a routing-only step, ``k`` once its
  ``draft_steps`` say it does not, 0 for k = 0); ``V(T)`` is the flush + verification time of
  a width-T pass, transfer waits included, so the link, the cache and streaming are in it as
  they are on this machine. A drafted width's transfer waits (the engine's ``verify_io_wait_s``)
  are ``T`` times the rate at T of the drafted rounds at the same place in their prompt
  (``PromptWaits``: the first rounds after a prefill stream the decode's experts in; each width's
  rate shrunk towards the place's pooled wait per distinct expert times its distinct experts (one
  round's wait scatters far more than the rest), then made non-increasing in T, as a wide
  round's tokens share the experts they wait for; past the widest width measured there, its wait
  per distinct expert), or where every round streams (``always_streams``) the widths' own rates
  at T over all places (``by_width``; past the widest measured width, its wait per distinct
  expert) but a round ``cut_short`` by the generation's end (its low wait pooled the wider widths'
  rates down: 9-10% too cheap at 25% on 2 GB/s); the rest follows ``VerifyCost``
  (``specter.decode.roofline_cost``, both): one non-negative fit, through the recent drafted
  rounds, of the experts read, the tokens and (for an engine that reports no waits) the experts
  streamed past the cache's slots (a round's time depends on the width before it, so one
  width's average reads wrong; a transition, the first round at a new k, which finds the cache
  holding what the previous k needed, counts ``TRANSITION_WEIGHT`` of a steady round: on the
  2 GB/s link at 50% a k = 2 round right after k = 1 ones took 97-113 ms, the next one 45-100);
  rounds since conditions last changed count alone once they span three widths (until then
  they scale the fit through the rounds before); the curve is non-decreasing in T, and past the
  widest width measured no dearer than that width's cost scaled by distinct experts. A plain
  round (T = 1) keeps its own average (``PlainRound``), but is priced no cheaper than its own
  average less its transfer waits plus the waits a drafted round has at this place
  (``PromptWaits.per_distinct``; every place pooled where every round streams) per distinct expert
  read, times a plain round's distinct experts: a plain round prefetches nothing ahead, so it waits
  at least that. Why: the main job's plain round, measured where the cache already held the
  decode's experts (5.0 ms), priced a prompt's first round, whose drafted widths waited while the
  decode's experts streamed in (k = 8 at 97.6 ms), at 200 tok/s: the governor switched speculation
  off there, its plain rounds then taking 19.6 and 23.5 ms. The first round is not measured. With
  no drafted round yet, widths scale from T = 1 by distinct experts; with no measurement at all,
  ``V(T) = distinct(T) / distinct(1)`` target steps, a target step being ``t_draft /
  draft_ratio``.
- ``next_k()`` returns the k in ``[0, k_max]`` (``k_max`` unless given: ``MAX_K``, since stop 57;
  the frontier below reaches wide k only where they are measured to pay) with the highest predicted
  tokens/s (``(1 + E[accepted(k)]) / T(k)``) among those meeting ``max_latency_ms`` per token (if
  set; if none does, the lowest latency a token) and within ``frontier()``: at most twice the
  wider of the widest k measured and ``k0`` (the start, whose first round is never measured), or
  ``FRONTIER_STEP`` beyond it where that is further, so wider ones are reached step by step, each
  measured before the next is extrapolated (a fit through widths that fit the cache cannot see the
  cost that jumps once a round's experts stop fitting; doubling, not two at a time, since stop
  57), except where even a
  round of ``FRONTIER_STEP`` drafts streams (more distinct experts per layer than
  ``cache_slots_per_layer``, the engine's cache slots over its MoE layers): every round streams,
  there is no such cliff ahead, and any k up to ``k_max`` may be chosen. The current choice is kept
  while no other k is predicted more than ``HOLD_MARGIN`` faster (``SWITCH_MARGIN`` where one of
  them is 0): on a flat roofline, noise must not make it flap, and each change of k costs a round
  that pays for the other width's cache contents.
  k = 0 is plain decoding for that round. Now and then it tries another k (k + 1 and k - 1, k = 2
  when speculation is off, and every third time the k whose width was measured least recently
  among those predicted within ``FAR_PROBE_RANGE`` of the best rate, k = 0 first when its own
  average is older than ``STALE_HALF_LIFE`` rounds), so that it notices when conditions change:
  after ``probe_every`` rounds, then twice as long each time while its choice stays the same (at
  most 8 x ``probe_every``; 4 x while speculation is off: ``roofline_probe.ProbeSchedule``), back
  to ``probe_every`` when the choice changes, and two rounds after a probe whose first draft token
  was accepted (or rejected) against the odds, a probe that kept every draft while speculation is
  off (it also makes the acceptance estimate restart from its value, so the next observations
  move it fast and a draft that got good again is seen within a few probes), or a chosen round
  that ``RoundWatch`` (``specter.decode.roofline_watch``)
  finds off its prediction beyond the usual miss. Two rounds in a row far off the same way (a
  lone one is held back, unlearnt, and dropped if the next runs as predicted; not a drafted
  round whose place in its prompt has no waits of its own yet: ``_judge``) mark a change of
  conditions (see ``V(T)``), and both neighbours of the k are tried next. The first rounds
  visit k0, then 0 twice, then 1 and 2 (and k_max where every round streams) once each to
  calibrate (``roofline_probe.calibration_rounds``; after ``link_changed()`` see there). A plain
  round right after a drafted one finds the draft's prefetches in the cache and would make k = 0
  look cheap: once the plain round has an average measured since the last change such a round is
  not measured, and k = 0 is visited (calibrated or probed) for two rounds in a row.
- ``observe(drafted, accepted, **timings)`` takes the engine's phase timings (``draft_s``,
  ``flush_s``, ``verify_s`` and the transfer waits within it ``verify_io_wait_s``, ``host_s``,
  ``draft_steps``); unknown names are ignored (an engine that reports no waits has them fitted
  with the rest). A round whose ``path_trial`` is set (a compiled engine tried a path it had
  measured slower) counts for acceptance only: its times are the trial's, and a width first seen
  through a trial (a fused verification draining every transfer, 2x the layered one at width 5)
  would otherwise be judged by it and not chosen again (compiled, 50% on ``local``: 20 plain rounds).
- ``table()`` gives, for every k, the expected accepted tokens, predicted round time and tokens/s;
  ``predicted_round_s`` is the prediction for the k last returned (None while nothing can price it yet).
Switching speculation off (k = 0 chosen, not probed) or back on is logged once per switch
(logger ``specter.governor``).
"""

from __future__ import annotations

import logging
import math

from specter.decode.acceptance_estimate import AcceptanceEstimate
from specter.decode.governor import MAX_K, Governor
from specter.decode.roofline_cost import STALE_HALF_LIFE, PlainRound, PromptWaits, VerifyCost
from specter.decode.roofline_fit import Ema, distinct_experts
from specter.decode.roofline_probe import ProbeSchedule, calibration_rounds, probe_k
from specter.decode.roofline_watch import CHANGE, HOLD, LOOK, NOISE, RoundWatch, prediction_by_k

log = logging.getLogger("specter.governor")
SURPRISE = 0.5  # a probe whose first draft token defies p_1 by more than this is followed up at once
HOLD_MARGIN = 0.03  # another k must be predicted this much faster (relative) to replace the current choice
SWITCH_MARGIN = 0.03  # ... where one of the two is k = 0 (speculation switched on or off)
FRONTIER_STEP = 2  # k may go at most this far beyond the widest k measured, or to twice it
TRANSITION_WEIGHT = 0.25  # how much the verify cost counts a round right after one at another k


class RooflineGovernor(Governor):
    name = "roofline"

    def __init__(self, k: int = 4, k_max: int | None = None, n_experts: int = 16, top_k: int = 2, ema: float = 0.25,
                 probe_every: int = 12, max_latency_ms: float | None = None, prior_acceptance: float = 0.8,
                 draft_ratio: float = 0.5, cache_slots_per_layer: float | None = None) -> None:
        self.n_experts, self.top_k = n_experts, top_k
        self._distinct = lambda tokens: distinct_experts(tokens, n_experts, top_k)  # a width's experts per layer
        self.cache_slots_per_layer = cache_slots_per_layer  # None: unknown, the frontier always applies
        k_max = MAX_K if k_max is None else k_max
        if not 1 <= k_max <= MAX_K or not 0 <= k <= k_max:
            raise ValueError(f"roofline governor: need 0 <= k <= k_max <= {MAX_K}, got k={k}, k_max={k_max}")
        self.k_max, self.k0 = k_max, k
        self.weight, self.max_latency_ms, self.draft_ratio = ema, max_latency_ms, draft_ratio
        self.acceptance = AcceptanceEstimate(k_max, prior_acceptance)
        self.draft_step = Ema(ema)
        self.extra_steps = 1  # draft steps per round beyond k (the engine's routing-only step)
        self.host = Ema(ema)
        self.watch = RoundWatch(ema)  # a round's time against its prediction: noise, surprise, change
        self.plain = PlainRound(ema)  # flush + verify seconds of a plain round (T = 1)
        self.plain_compute = PlainRound(ema)  # ... less its transfer waits
        self.verify_round: dict[int, int] = {}  # the round each width was last measured
        self._steady_round: dict[int, int] = {}  # ... in a round at the same k as the round before
        self.cost = VerifyCost(n_experts, top_k, k_max, cache_slots_per_layer)  # drafted widths' verify seconds
        self.wait = PromptWaits()  # ... and their transfer waits, per verified token, by place in the prompt
        self.prompt_round = 0  # rounds since the prompt's prefill (``start_prompt``)
        self._changed_at = -1  # the round whose time showed that conditions changed
        self._previous_drafted = 0  # tokens the last observed round drafted
        self.rounds = 0
        self.last_k: int | None = None
        self.predicted_round_s: float | None = None
        self.history: list[dict] = []  # per round: k, probe, predicted and measured seconds
        self._report_from = 0  # the first round of the current report (new_report)
        self._speculating: bool | None = None
        self._calibration = calibration_rounds(k, k_max, self.always_streams())
        self.probes = ProbeSchedule(probe_every)  # when to look around (``roofline_probe``)

    # ----- the model --------------------------------------------------------------------------

    def position_acceptance(self, j: int) -> float:
        """p_j, the estimated acceptance at draft position j (``AcceptanceEstimate``)."""
        return self.acceptance.p(j)

    def expected_accepted(self, k: int) -> float:
        return self.acceptance.expected_accepted(k)

    def verify_s(self, width: int) -> float | None:
        """Predicted flush + verify seconds of a width-T pass. A plain round (T = 1, nothing
        drafted, so no transfer hidden behind a draft) is its own moving average; drafted widths
        follow ``self.cost`` (``VerifyCost``; a plain round without its own average yet, its rounds
        trials, is T = 2 scaled by distinct experts). Before any drafted round, widths scale from
        T = 1 by distinct experts, and with no measurement at all from the draft step."""
        u = self._distinct(width) / self._distinct(1)
        if width == 1 and self.plain.value is not None:
            return max(self.plain.value, self._plain_floor())
        curve = self.cost.curve(self.rounds, self._changed_at)
        if curve is not None:
            now = (self.rounds, self._changed_at)
            wait = (self.wait.by_width(width, *now, distinct=self._distinct) if self.always_streams()
                    else self.wait.value(*now, self.prompt_round, width, distinct=self._distinct))
            if width == 1:
                return curve[2] * self._distinct(1) / self._distinct(2) + (wait or 0.0)
            return curve[min(width, len(curve) - 1)] + width * (wait or 0.0)
        if self.plain.value is not None:
            return self.plain.value * u
        return None if self.draft_step.value is None else self.draft_step.value / self.draft_ratio * u

    def _plain_floor(self) -> float:
        """The least a plain round can cost here (see the module's contract); 0 unmeasured."""
        if self.plain_compute.value is None:
            return 0.0
        place = None if self.always_streams() else self.prompt_round
        wait = self.wait.per_distinct(self.rounds, self._changed_at, place, self._distinct)
        return self.plain_compute.value + (wait or 0.0) * self._distinct(1)

    def round_s(self, k: int) -> float | None:
        verify = self.verify_s(k + 1)
        if verify is None:
            return None
        steps = k + self.extra_steps if k else 0
        return (self.host.value or 0.0) + steps * (self.draft_step.value or 0.0) + verify

    def table(self) -> list[dict]:
        rows = []
        for k, accepted in enumerate(self.acceptance.expected_accepted_upto(self.k_max)):
            seconds = self.round_s(k)
            rows.append({"k": k, "expected_accepted": accepted, "predicted_round_s": seconds,
                         "predicted_tokens_per_s": (1 + accepted) / seconds if seconds else None})
        return rows

    def always_streams(self) -> bool:
        """Whether every round streams: ``FRONTIER_STEP`` drafts read more experts than a layer's slots."""
        capacity = self.cache_slots_per_layer
        return capacity is not None and self._distinct(FRONTIER_STEP + 1) > capacity

    def frontier(self) -> int:
        """The widest k that may be chosen or probed now (see the module's contract); ``k_max``
        where ``always_streams`` (no cliff ahead)."""
        if self.always_streams():
            return self.k_max
        measured = [t for t in self.verify_round if t > 1]
        widest = max(max(measured, default=0) - 1, self.k0)
        return min(self.k_max, max(widest + FRONTIER_STEP, 2 * widest))

    def best_k(self) -> int | None:
        rows, frontier = self.table(), self.frontier()
        rates = [row["predicted_tokens_per_s"] for row in rows[: frontier + 1]]  # rows by k: 0, 1, ...
        if None in rates:
            return None
        cap = self.max_latency_ms
        meeting = [k for k, rate in enumerate(rates) if cap is None or 1e3 / rate <= cap]
        best = max(meeting or range(len(rates)), key=lambda k: rates[k])  # none meets the cap: the fastest
        best_rate = rates[best]
        held = self.probes.last_best
        if held is not None and held != best:  # held <= frontier: it never narrows
            rate = rows[held]["predicted_tokens_per_s"]
            latency_ok = self.max_latency_ms is None or 1e3 / rate <= self.max_latency_ms
            margin = HOLD_MARGIN if held and best else SWITCH_MARGIN  # turning speculation on or off: its own
            if latency_ok and rate * (1 + margin) >= best_rate:
                return held
        return best

    # ----- the governor contract --------------------------------------------------------------

    def next_k(self) -> int:
        probe = False
        if self._calibration:
            k, probe = self._calibration.pop(0), True
        else:
            best = self.best_k()
            k = self.k0 if best is None else best
            if self.probes.due(self.rounds, best):
                k = self._probe_k(k)
                probe = True
                if k == 0:
                    self._calibration.insert(0, 0)  # a plain round after a drafted one is not measured
            elif best is not None:
                self._announce(best)
        self.last_k = k
        self.predicted_round_s = self.round_s(k)
        self.history.append({"k": k, "probe": probe, "cut": False, "trial": False,
                             "predicted_round_s": self.predicted_round_s, "measured_round_s": None})
        return k

    def _probe_k(self, k: int) -> int:
        """The k to try instead of ``k`` (``roofline_probe.probe_k``: a neighbour, or every third
        probe the width measured least recently among those predicted near the best rate)."""
        turn = self.probes.count % 3
        rates = [row["predicted_tokens_per_s"] for row in self.table()] if turn == 0 else []
        return probe_k(k, turn, rates, self.frontier(), self.k_max, self.verify_round, self.rounds)

    def _announce(self, k: int) -> None:
        speculating = k > 0
        if self._speculating is not None and speculating != self._speculating:
            if speculating:
                log.warning("roofline governor: speculation pays again (k=%d)", k)
            else:
                log.warning("roofline governor: speculation does not pay here; decoding plainly (k=0), probing now and then")
        self._speculating = speculating

    def start_prompt(self) -> None:
        self.prompt_round = 0

    def observe(self, drafted: int, accepted: int, **timings: float) -> None:
        self.rounds += 1
        place, self.prompt_round = self.prompt_round, self.prompt_round + 1
        kept_all_while_off = False
        if self.history and self.history[-1]["probe"] and drafted and not self._calibration:
            kept_all_while_off = self._speculating is False and accepted == drafted
            if kept_all_while_off or abs(min(accepted, 1) - self.position_acceptance(1)) > SURPRISE:
                self.probes.soon(self.rounds)  # look again soon
        # a probe keeping every draft while speculation is off restarts the estimate; a lone surprise is left to its shift watch
        self.acceptance.observe(drafted, accepted, kept_all_while_off)
        after_draft, self._previous_drafted = self._previous_drafted, drafted
        warm_plain = drafted == 0 and after_draft and self.plain.samples > 0  # measured since the last restart
        transition = len(self.history) >= 2 and self.history[-2]["k"] != self.history[-1]["k"]
        first = self.rounds == 1  # right after the first prefill the cache holds the prompt's experts: not a width's cost
        sample = (self.rounds, drafted, timings, transition, not (warm_plain or first), place)
        verdict = self._judge(drafted, timings, transition, place)
        if verdict == HOLD:
            self.watch.hold(sample)  # learnt from only if the next round is as far off
            return
        if verdict == CHANGE:  # the machine or the link changed under the estimates
            held = self.watch.take_held()
            self._mark_change(held[0], {held[1] + 1, drafted + 1})
            self._learn(*held)
        self._learn(*sample)
        if verdict in (LOOK, CHANGE):  # the estimates are off: look around soon
            self.probes.soon(self.rounds, later=False)
        if verdict == CHANGE and not self._calibration:
            for neighbour in dict.fromkeys([max(0, drafted - 1), min(self.k_max, drafted + 1)]):
                if neighbour != drafted:  # a plain one twice: the first, right after a drafted round, is warm
                    self._calibration += [neighbour] * (2 if neighbour == 0 else 1)

    def _judge(self, drafted: int, timings: dict, transition: bool, place: int) -> str:
        """Records the round's measured time and, for a chosen round, ``RoundWatch``'s verdict on
        it (the prediction ``known`` where it stands on the width's own recent steady rounds and,
        for a drafted round, on its place's own waits: a prompt's first rounds, priced from every
        round's waits until their place has its own, would be held back and dropped as lone
        surprises, and their place would never get its own)."""
        if not self.history or "round_s" not in timings:
            return NOISE
        entry = self.history[-1]
        entry["measured_round_s"] = timings["round_s"]
        entry["trial"] = bool(timings.get("path_trial"))
        entry["cut"] = entry["k"] != drafted  # the engine shortened the round (end of generation)
        predicted = entry["predicted_round_s"]
        if not predicted or entry["probe"] or entry["trial"] or entry["cut"]:
            self.watch.drop_held()
            return NOISE
        last = self._steady_round.get(drafted + 1, -math.inf)
        known = last >= self._changed_at and self.rounds - last <= STALE_HALF_LIFE
        known = known and (not drafted or self.always_streams() or self.wait.priced_apart(place))
        return self.watch.judge(timings["round_s"], predicted, transition, known)

    def _learn(self, now: int, drafted: int, timings: dict, transition: bool, measured_verify: bool,
               place: int) -> None:
        """Moves the estimates by one round's timings (``now``: the round it was)."""
        trial = bool(timings.get("path_trial"))  # a compiled path's trial: not what this k costs
        steps = int(timings.get("draft_steps", 0) or 0)
        if steps and "draft_s" in timings and not trial:
            self.draft_step.update(timings["draft_s"] / steps)
            if drafted:
                self.extra_steps = max(0, steps - drafted)
        if "verify_s" in timings and measured_verify and not trial:
            width, sample = drafted + 1, timings["verify_s"] + timings.get("flush_s", 0.0)
            if width > 1:
                wait = 0.0
                if "verify_io_wait_s" in timings:  # the waits pooled apart; the fit sees the rest
                    self.cost.waits_apart()
                    wait = min(sample, max(0.0, timings["verify_io_wait_s"]))
                    # a round the generation's end cut short: see the module's contract
                    if not (timings.get("cut_short") and self.always_streams()):
                        self.wait.add(width, wait, now, place)
                self.cost.add(width, sample - wait, now, TRANSITION_WEIGHT if transition else 1.0)
            else:
                self.plain.add(sample, now)
                if "verify_io_wait_s" in timings:
                    self.plain_compute.add(max(0.0, sample - timings["verify_io_wait_s"]), now)
            self.verify_round[width] = now
            if not transition:
                self._steady_round[width] = now
        if "host_s" in timings:
            self.host.update(max(0.0, timings["host_s"]))

    def _mark_change(self, at: int, widths: set[int]) -> None:
        """Conditions changed at round ``at``: the first new sample of every width but ``widths``
        replaces most of its average."""
        self._changed_at = at
        self.plain.restart()
        self.plain_compute.restart()
        for width in self.verify_round:
            if width not in widths:
                self.verify_round[width] = min(self.verify_round[width], at - 4 * STALE_HALF_LIFE)

    def link_changed(self) -> None:
        """The engine moved to another link. Where it reports its transfer waits apart, only they
        and the plain round (nothing drafted to hide its loads behind) are the link's: the waits
        restart from the rounds after this one, the plain round is measured again (twice: the first,
        right after a drafted round, is warm) and, where every round streams, so is k_max (the waits
        by width); the verification's compute and the draft step are the machine's and stay. An
        engine that reports no waits has them in the fit: that is treated as a round showing a
        change (every width measured so far stands on the fit through those measured from now on,
        and is replaced by its next sample), and the first rounds calibrate again."""
        self.watch.drop_held()
        self.probes.restart(self.rounds)
        self.plain.restart()
        self.plain_compute.restart()
        if self.wait.samples:
            self.wait = PromptWaits()
            self._calibration = [0, 0, *([self.k_max] if self.always_streams() else [])]
        else:
            self._changed_at = self.rounds + 1
            self._calibration = calibration_rounds(self.k0, self.k_max, self.always_streams())

    def new_report(self) -> None:
        self._report_from = len(self.history)

    def summary(self) -> dict:
        """The report's governor entry: the roofline table, and over the rounds since ``new_report``
        the k chosen per round and how far the predicted round times were from the measured ones
        (``prediction_by_k``; the errors: at the k of most rounds, ``prediction_k``, over its rounds)."""
        history = self.history[self._report_from:]
        per_k = prediction_by_k(history)
        main_k = max(per_k, key=lambda k: per_k[k]["rounds"], default=None)
        main = per_k.get(main_k, {})
        return {"name": self.name, "k_max": self.k_max, "table": self.table(),
                "trace": [h["k"] for h in history], "probes": sum(h["probe"] for h in history),
                "cut_rounds": sum(h["cut"] for h in history), "prediction": per_k,
                "prediction_error": main.get("error"), "prediction_total_error": main.get("total_error"),
                "prediction_k": None if main_k is None else int(main_k), "prediction_rounds": main.get("rounds")}
