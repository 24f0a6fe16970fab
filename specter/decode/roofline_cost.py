"""The roofline governor's verification cost model (``specter.decode.roofline``): what a width-T
pass of drafted tokens costs on this machine, learned from the rounds it has seen.

Contract: ``VerifyCost.add(width, seconds, round, weight=1)`` records a drafted round's flush +
verify seconds (``weight``: how much it counts, e.g. less for a transition, a round right after
one at another width); ``waits_apart()`` says the seconds leave the round's transfer waits out
(``WaitPerToken`` has them), and the streaming term below is dropped;
``curve(now, changed_at)`` gives the predicted seconds by width (index T, 2..k_max + 1; None
before any round). The cost is one fit through the last ``MAX_SAMPLES`` rounds: ``a + b *
distinct(T) + c * T + d * max(0, distinct(T) - cache_slots_per_layer)``, coefficients ``>= 0``
(``fit_nonnegative``; ``distinct_experts``: T tokens of top-k routing over E experts): the
experts read, the tokens computed, the experts a layer reads beyond the cache's slots (they
stream). A round weighs its ``weight`` times ``0.5 ** (age / STALE_HALF_LIFE)``. Rounds from
``changed_at`` on (conditions changed) are fitted alone once they span ``OWN_FIT_WIDTHS`` widths;
before that, the fit through the rounds before them is scaled to them (a line through one or
two widths would put every other width on it, however far). Each measured width adds its mean
residual shrunk by ``RESIDUAL_PRIOR`` rounds (a cost the terms cannot follow shows once a width
has run a while), and the curve is non-decreasing in T (``cost_curve``); past the widest width
measured it is no dearer than that width's cost scaled by distinct experts (``_optimistic_beyond``:
up to the widths that stream past the cache's slots, where the fit has that term). Why four
rounds, not one: with one, a width probed once kept half of its round's luck, a bump in the curve
that the non-decreasing fit spread over the wider widths (a bench-governor table showed k = 6 predicted 9%
below k = 5 and 6% below k = 8 at 50% on 20 GB/s); six paired cell runs (50% of the widened
model, both links, the one-round prior's governor beside): 1.002x fixed k = 8 on 20 GB/s against
0.982x, and 0.956x against 0.953x on 2 GB/s.

Why one fit and not an average per width: a round's time depends on the width before it
(widened model, 50% of the experts, emulated 2 GB/s: k = 4 verified in 86 ms right after a
narrower round, 45-59 ms after another k = 4), so a width probed once from another reads wrong;
one fit through every width averages those errors over all of them (design notes, stop 29).
Terms for the experts a round reads beyond (or short of) the previous round's width were tried
and dropped: in a bench run the governor then held k = 15 at 50% on 2 GB/s (0.82x the best fixed
k), likely because the widths past the cache are measured mostly right after narrower rounds,
so that term can take the cost of streaming.

``WaitPerToken``: the transfer waits of drafted rounds per verified token, pooled over every
width (``add(width, seconds, round)``; ``value(now, changed_at)``: the age-weighted sum of the
waits over that of the widths, from the rounds since ``changed_at`` alone once there are
``OWN_WAIT_ROUNDS`` of them; None before any round). Why apart from the fit through the widths:
on a link-bound machine a round waits for the experts its tokens bring in, at a rate per token
that hardly depends on the k that ran (widened model, emulated 2 GB/s, fixed k each alone: 9.5-11
ms a verified token for k = 1..16 at 50%; 20.9-21.8 for k = 1..8 at 25%, 15.7 at k = 16), while
one round's wait scatters (sd 17-31 ms against 3-8 ms for the rest of its verification), and a
width probed once reads the cache the previous k left. Every drafted round measures the one
rate; the fit through the widths, with its residuals by width, sees only the compute, which does
not scatter, and without the streaming term (with it, the compute of the calibration's k = 1 and
2 rounds at 25% on 2 GB/s went onto that term, wide rounds looked dear, and the governor took
k = 1 for 3-4 rounds, then 5-6: 0.93 and 0.96x the best fixed k in two runs; without it, 0.98 and
0.98x, holding k = 6, though in two later runs it held k = 1 for most rounds: 0.89 and 0.84x).
Fitting the waits by distinct experts and streamed experts as well was tried: wider rounds then
looked cheaper at 50% on 2 GB/s, and the governor climbed to k = 12-14 (fixed k = 12 and 16
there: 0.9x k = 6 or 8).
``by_width(width, now, changed_at, shrunk=False)``: the rate at one width, from the measured widths'
own rates (``shrunk``: each first shrunk by ``WIDTH_PRIOR_ROUNDS`` rounds towards the pooled rate,
per distinct expert where ``distinct`` is given, since stop 58)
made non-increasing in the width (weighted isotonic regression, a width weighing its rounds' age
weights times the width), linear between measured widths and flat beyond them, or given
``distinct`` (a width's distinct experts per layer) past the widest measured width the same wait
per distinct expert as there: a round that streams waits for the experts its tokens read, which
grow far slower than its tokens (widened model, 25% on 2 GB/s, fixed k = 4, 8, 16, 32 in one bench:
verification 18.2, 19.9, 21.2, 20.2 ms a distinct expert of a layer, against 24.6, 21.5, 16.4, 10.4
ms a verified token). Flat per token, with the calibration's k = 32 rounds cut by 32-token
generations (so left out), k = 32 was priced at 2.5x its round and the governor held k = 7 (35.7
tok/s against fixed k = 32's 51.7, in one process); per distinct expert it held k = 32 (52.0). The governor
takes it unshrunk where every round streams (its ``always_streams``): there a wide round's tokens share
the experts they stream, so its wait per token is no higher (25% on 2 GB/s, fixed k each, stop 36: 20.4,
20.9, 21.6, 20.8 ms a verified token for k = 1, 2, 4, 8, then 17.3 at 12 and 15.2 at 16, where
fixed k = 16 ran 1.23-1.29x k = 4); the pooled rate, carried by the narrow rounds the governor had
measured, made k = 16 look slower than k = 4, and it held k = 1 or 4 (0.79-0.84x the best fixed
k in two cell runs). Elsewhere ``PromptWaits`` takes it shrunk within a place's pool (there).
Where narrow rounds hide their copies behind the draft and wide ones wait (a fast link), the
rates rise with the width, the regression pools them, and the rate is the pooled one. A line
through the widths' rates was tried first: a probe a width or two from the held k set its
slope, extrapolated far (276 ms a token at width 2 from rounds at 15-17), and after the link got
10x faster a positive slope made narrow rounds look free (a synthetic three-phase run, twelve
draws: 0.875x the best fixed k in the fast phase against 1.013x with the regression).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from specter.decode.roofline_fit import Ema, cost_curve, distinct_experts, interpolate, monotone
from specter.decode.roofline_watch import changed

MAX_SAMPLES = 96  # the drafted rounds the verify cost is fitted through (the most recent)
OWN_FIT_WIDTHS = 3  # after a change of conditions, the rounds since are fitted alone from this many widths on
OWN_WAIT_ROUNDS = 3  # ... and their transfer waits are pooled alone from this many rounds on
PROMPT_POOLS = 5  # rounds 0-3 after a prefill pool their waits apart, round 4 on together
OWN_PLACE_ROUNDS = 2  # a place's own pool answers from this many rounds on
WIDTH_PRIOR_ROUNDS = 4.0  # rounds at the pooled rate a width's own wait rate is shrunk with
RESIDUAL_PRIOR = 4.0  # rounds: a width's mean residual from the fit counts as n / (n + this) of itself
STALE_HALF_LIFE = 24  # rounds: a round's verify time loses half its weight in the fit per this many


def _age_weight(now: int, round_index: int) -> float:
    """How much a round ``now - round_index`` rounds old counts: half per ``STALE_HALF_LIFE``."""
    return 0.5 ** ((now - round_index) / STALE_HALF_LIFE)


def _state(samples: deque, now: int, changed_at: int) -> tuple:
    """What a model's cached answer depends on: the round, the last change, and its samples
    (a bounded deque: its length and last entry tell whether one was added)."""
    return now, changed_at, len(samples), samples[-1] if samples else None


class PlainRound:
    """The flush + verify seconds of a plain round (T = 1): a running mean of the samples since
    ``restart()`` (conditions or the link changed: the old average is of other conditions), then
    a moving average whose step grows with the rounds since the last sample (an old average
    yields to a fresh sample) and is at least 0.5 for a sample ``changed`` from it (a rarely
    measured plain round must not lag far behind)."""

    def __init__(self, ema: float) -> None:
        self.average = Ema(ema)
        self.samples = 0  # since the last restart
        self.last_round: int | None = None

    @property
    def value(self) -> float | None:
        return self.average.value

    def restart(self) -> None:
        self.samples = 0

    def add(self, seconds: float, now: int) -> None:
        step = 0.0 if self.last_round is None else 1 - _age_weight(now, self.last_round)
        if self.average.value and changed(seconds, self.average.value):
            step = max(step, 0.5)
        self.samples += 1
        self.average.update(seconds, max(step, 1 / self.samples))
        self.last_round = now


class WaitPerToken:
    def __init__(self) -> None:
        self.samples: deque[tuple[int, float, int]] = deque(maxlen=MAX_SAMPLES)  # (width, seconds, round)
        self._key: tuple | None = None
        self._value: float | None = None
        self._by_width: dict[int, float] = {}  # measured width -> its non-increasing rate (``by_width``)
        self._shrunk: dict[int, float] = {}  # ... shrunk towards the pooled rate first
        self._sums: dict[int, tuple[float, float]] = {}  # width -> age-weighted (waits, tokens)
        # ... towards the pooled rate per distinct expert, with the ``distinct`` it was computed for
        self._shrunk_by_distinct: tuple[Callable[[int], float], dict[int, float]] | None = None
        self.prior_by_distinct = True  # False: a place's widths shrink towards the pooled rate per token (A/B)

    def add(self, width: int, seconds: float, round_index: int) -> None:
        self.samples.append((width, max(0.0, seconds), round_index))

    def value(self, now: int, changed_at: int) -> float | None:
        """Seconds of transfer wait per verified token (see the module's contract)."""
        self._update(now, changed_at)
        return self._value

    def by_width(self, width: int, now: int, changed_at: int, shrunk: bool = False,
                 distinct: Callable[[int], float] | None = None) -> float | None:
        """Seconds of transfer wait per verified token at ``width``: the measured widths' own
        rates made non-increasing in the width (isotonic regression, each width weighted by its
        rounds' age weights times the width), linear between them, flat beyond them or, given
        ``distinct`` (a width's distinct experts per layer), past the widest measured width its
        round's wait per distinct expert. ``shrunk``: each width's rate first shrunk towards the
        pooled rate as if ``WIDTH_PRIOR_ROUNDS`` more rounds of that width had waited at it (one
        round's wait scatters too much to set a width's rate alone); given ``distinct`` too (and
        ``prior_by_distinct``, the default; False: towards the pooled rate per token), towards the
        pooled wait per distinct expert times the width's distinct experts: a wide round's tokens
        share the experts they stream. Why: the main job's (bundled model, 50% on 0.15 GB/s) first
        rounds of a prompt, mostly narrow, waited 6.8 ms a verified token and its one k = 32 round
        there 4.8; shrunk per token, k = 32 was priced at 6.5 ms a token and the governor held k =
        5-13 there. One process, two copies each, three generations: 150.2 / 150.0 tok/s per token,
        182.6 / 180.6 per distinct expert, fixed k = 32 185.2; the widened model at 50% on 2 GB/s
        68.0 / 62.4 against 71.0 / 71.6 (fixed k = 32 70.9), at 50% `local` compiled 137.3 / 130.1
        against 137.8 / 137.2; the bundled model at 50% on 0.1 GB/s 85.5 / 84.9 against 91.0 / 91.2,
        at 50% on 1 GB/s compiled 453.8 / 430.8 against 433.6 / 443.6 (stop 58)."""
        self._update(now, changed_at)
        curve = self._shrunk if shrunk else self._by_width
        if shrunk and distinct is not None and self.prior_by_distinct and curve:
            curve = self._distinct_shrunk(distinct)
        if not curve:
            return self._value
        widest = next(reversed(curve))
        if distinct is not None and width > widest:
            return curve[widest] * widest / width * distinct(width) / distinct(widest)
        return interpolate(curve, width)

    def counted(self, changed_at: int) -> list[tuple[int, float, int]]:
        """The samples the rates pool: those since ``changed_at`` once there are
        ``OWN_WAIT_ROUNDS`` of them, else all."""
        since = [sample for sample in self.samples if sample[2] >= changed_at]
        return since if len(since) >= OWN_WAIT_ROUNDS else list(self.samples)

    def _update(self, now: int, changed_at: int) -> None:
        key = _state(self.samples, now, changed_at)
        if key == self._key:
            return
        samples = self.counted(changed_at)
        tokens: dict[int, float] = {}  # by width: age-weighted verified tokens and their waits
        waited: dict[int, float] = {}
        for t, v, r in samples:
            w = _age_weight(now, r)
            tokens[t], waited[t] = tokens.get(t, 0.0) + w * t, waited.get(t, 0.0) + w * v
        total = sum(tokens.values())
        self._key, self._value = key, sum(waited.values()) / total if total else None
        widths = sorted(t for t in tokens if tokens[t] > 0)
        self._by_width = _falling({t: (waited[t], tokens[t]) for t in widths})
        self._sums = {t: (waited[t], tokens[t]) for t in widths}
        pooled = self._value or 0.0
        self._shrunk = self._shrunk_towards(lambda t: t * pooled)
        self._shrunk_by_distinct = None

    def _shrunk_towards(self, prior_wait: Callable[[int], float]) -> dict[int, float]:
        """The measured widths' rates, each as if ``WIDTH_PRIOR_ROUNDS`` more rounds of that width
        had waited ``prior_wait(width)``, made non-increasing in the width."""
        prior = WIDTH_PRIOR_ROUNDS
        return _falling({t: (waited + prior * prior_wait(t), tokens + prior * t)
                         for t, (waited, tokens) in self._sums.items()})

    def _distinct_shrunk(self, distinct: Callable[[int], float]) -> dict[int, float]:
        """``by_width``'s shrunk rates with the prior scaled by distinct experts: the pooled wait per
        distinct expert times the width's distinct experts (a wide round's tokens share what they
        stream)."""
        if self._shrunk_by_distinct is None or self._shrunk_by_distinct[0] is not distinct:
            experts = sum(tokens / t * distinct(t) for t, (_, tokens) in self._sums.items())
            per_expert = sum(waited for waited, _ in self._sums.values()) / experts if experts else 0.0
            self._shrunk_by_distinct = distinct, self._shrunk_towards(lambda t: per_expert * distinct(t))
        return self._shrunk_by_distinct[1]


def _falling(by_width: dict[int, tuple[float, float]]) -> dict[int, float]:
    """Width -> rate from width -> (seconds, tokens), made non-increasing in the width: the
    isotonic regression of the negated rates, each width weighted by its tokens."""
    falling = monotone([-seconds / tokens for seconds, tokens in by_width.values()], [t for _, t in by_width.values()])
    return {t: -rate for t, rate in zip(by_width, falling)}


class PromptWaits:
    """``WaitPerToken`` kept apart by a round's place in its prompt: the first ``PROMPT_POOLS - 1``
    rounds after a prefill each pool their own waits (the prefill left the cache holding its own
    experts, so they stream the decode's in), later rounds one pool; ``value`` answers from the
    place's pool once it holds ``OWN_PLACE_ROUNDS`` rounds (each pool as ``WaitPerToken`` pools),
    else from all rounds pooled; given a ``width``, the pool's ``by_width(shrunk=True)`` rate (and
    given ``distinct``, past the pool's widest width its wait per distinct expert: the main job,
    bundled model at 50% on 0.15 GB/s, roofline with ``k_max`` 32 in one process with fixed k,
    four generations each: 145.8 tok/s against 131.7 flat per token; fixed k = 16 138.9, k = 32
    163.9; the widened model at 50% on 2 GB/s 61.6 against 51.1, fixed k = 32 60.8).
    Why by width where rounds fit the cache too: at 50% of the widened model on 2 GB/s the wait
    per verified token falls from 10.3 ms at k = 1 to 7.4 at k = 8 (bench-governor stop 40, fixed
    k each), and the pooled rate, carried by the calibration's narrow rounds, priced k = 8 ~10% too
    dear: the governor held k = 5-6 where k = 8 ran 4-13% faster. Why shrunk: a width probed once
    would otherwise set the rate of every width past it (the test of scattered waits: 52% off)."""

    def __init__(self) -> None:
        self.all = WaitPerToken()
        self.by_place = [WaitPerToken() for _ in range(PROMPT_POOLS)]

    @property
    def samples(self) -> deque:
        return self.all.samples

    def add(self, width: int, seconds: float, round_index: int, place: int) -> None:
        self.all.add(width, seconds, round_index)
        self._place(place).add(width, seconds, round_index)

    def value(self, now: int, changed_at: int, place: int, width: int | None = None,
              distinct: Callable[[int], float] | None = None) -> float | None:
        pool = self._pool(place)
        if width is None:
            return pool.value(now, changed_at)
        return pool.by_width(width, now, changed_at, shrunk=True, distinct=distinct)

    def _pool(self, place: int) -> WaitPerToken:
        """The place's own pool once it holds ``OWN_PLACE_ROUNDS`` rounds, else every round's."""
        return self._place(place) if self._own(place) else self.all

    def _place(self, place: int) -> WaitPerToken:
        return self.by_place[min(place, PROMPT_POOLS - 1)]

    def _own(self, place: int) -> bool:
        return len(self._place(place).samples) >= OWN_PLACE_ROUNDS

    def priced_apart(self, place: int) -> bool:
        """Whether a round at ``place`` is priced from waits of its own place: its pool holds
        ``OWN_PLACE_ROUNDS`` rounds, or no waits were reported at all (nothing differs by place)."""
        return not self.all.samples or self._own(place)

    def by_width(self, width: int, now: int, changed_at: int,
                 distinct: Callable[[int], float] | None = None) -> float | None:
        return self.all.by_width(width, now, changed_at, distinct=distinct)

    def per_distinct(self, now: int, changed_at: int, place: int | None,
                     distinct: Callable[[int], float]) -> float | None:
        """Seconds of transfer wait per distinct expert a round reads (``distinct(width)``) at
        ``place`` (None: every place), from the pool ``value`` answers from: the rounds since
        ``changed_at`` (all of them while fewer than ``OWN_WAIT_ROUNDS``), each weighted by its
        age; None with none."""
        samples = (self.all if place is None else self._pool(place)).counted(changed_at)
        experts = sum(_age_weight(now, r) * distinct(t) for t, _, r in samples)
        return sum(_age_weight(now, r) * v for _, v, r in samples) / experts if experts else None


class VerifyCost:
    def __init__(self, n_experts: int, top_k: int, k_max: int, cache_slots_per_layer: float | None) -> None:
        self.n_experts, self.top_k, self.k_max = n_experts, top_k, k_max
        self.cache_slots_per_layer = cache_slots_per_layer
        # (width, seconds, round, weight)
        self.samples: deque[tuple[int, float, int, float]] = deque(maxlen=MAX_SAMPLES)
        self._terms = [self.terms(t) for t in range(k_max + 2)]  # by width: fixed for this cache and model
        self._key: tuple | None = None
        self._curve: list[float] | None = None

    def add(self, width: int, seconds: float, round_index: int, weight: float = 1.0) -> None:
        self.samples.append((width, seconds, round_index, weight))

    def waits_apart(self) -> None:
        """The samples leave their transfer waits out (``WaitPerToken`` has them): experts streamed
        past the cache cost waits, not compute, so the fit drops that term."""
        if self.cache_slots_per_layer is not None:
            self.cache_slots_per_layer, self._key = None, None
            self._terms = [self.terms(t) for t in range(self.k_max + 2)]

    def terms(self, width: int) -> list[float]:
        """The terms a width-T round's verify cost is a non-negative sum of."""
        experts = distinct_experts(width, self.n_experts, self.top_k)
        terms = [1.0, experts, float(width)]
        if self.cache_slots_per_layer is not None:
            terms.append(max(0.0, experts - self.cache_slots_per_layer))
        return terms

    def curve(self, now: int, changed_at: int) -> list[float] | None:
        """Predicted verify seconds by width at round ``now``, conditions having last
        changed at round ``changed_at`` (see the module's contract)."""
        key = _state(self.samples, now, changed_at)
        if key != self._key:
            since = [sample for sample in self.samples if sample[2] >= changed_at]
            if len({t for t, *_ in since}) >= OWN_FIT_WIDTHS:
                curve = self._through(since, now)
            else:
                before = [sample for sample in self.samples if sample[2] < changed_at]
                curve = self._through(before or self.samples, now)
                predicted = sum(w * curve[t] for t, _, _, w in since) if curve and since else 0.0
                if predicted > 0:
                    scale = sum(w * v for _, v, _, w in since) / predicted
                    curve = [c * scale for c in curve]
            self._key, self._curve = key, self._optimistic_beyond(curve)
        return self._curve

    def _optimistic_beyond(self, curve: list[float] | None) -> list[float] | None:
        """Past the widest width measured, no dearer than that width's cost scaled by the distinct
        experts read (what a memory-bound verification costs), up to the widths whose experts
        stream past the cache's slots where the fit has that term (that cliff is real, and the
        frontier reaches it step by step). Why: the fit's per-token term, set by narrow widths,
        where tokens and experts grow almost alike, can price wide rounds far too dear; a width
        priced too dear is never chosen, so never measured, so never corrected, while one priced
        too cheap is chosen once, measured, and the fit learns it (bp82's compiled twin at 50% on
        ``local`` held k = 7 for 14 of 19 rounds, its fit pricing k = 32 at 188 ms, 1.6x)."""
        widest = max((t for t, *_ in self.samples), default=0)
        if curve is None or widest < 2:
            return curve
        per_expert = curve[widest] / distinct_experts(widest, self.n_experts, self.top_k)
        optimistic = list(curve)
        for t in range(widest + 1, len(curve)):
            experts = distinct_experts(t, self.n_experts, self.top_k)
            if self.cache_slots_per_layer is not None and experts > self.cache_slots_per_layer:
                break
            optimistic[t] = min(curve[t], per_expert * experts)
        return optimistic

    def _through(self, samples, now: int) -> list[float] | None:
        weighted = [(t, v, w * _age_weight(now, r)) for t, v, r, w in samples]
        return cost_curve(weighted, self._terms, RESIDUAL_PRIOR)
