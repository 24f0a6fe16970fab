"""The estimators the ``roofline`` governor (``specter.decode.roofline``) is built from.

Contract: ``distinct_experts(tokens, n_experts, top_k)``, the expected distinct experts of one
layer that ``tokens`` tokens routed top-k uniformly read (what a memory-bound verification's cost
follows); ``fit_nonnegative(rows)``, weighted least squares with non-negative coefficients (a
verification's cost as fixed + per distinct expert read + per token + per expert streamed);
``cost_curve``, that fit through a governor's samples with each width's shrunk residual, made
non-decreasing (``interpolate``: piecewise linear; ``monotone``: isotonic regression); ``Ema``, a
moving average whose ``update`` may be given a larger weight for one sample. Pure Python, no
state beyond ``Ema``'s value.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations


def distinct_experts(tokens: int, n_experts: int, top_k: int) -> float:
    """Expected distinct experts of one layer read by ``tokens`` tokens routed top-k uniformly."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


PREFERRED_TERMS = 2  # among equally good fits, one using only the first two terms (the line) is kept


def fit_nonnegative(rows: list[tuple[Sequence[float], float, float]]) -> tuple[float, ...]:
    """Weighted least squares ``y = sum_i c_i x_i`` over (features x, y, weight) rows with every
    ``c_i >= 0``. Subsets of the terms are fitted (their normal equations) in order, subsets of
    the first ``PREFERRED_TERMS`` terms first, then by size, later terms first; the first whose
    fit is non-negative and optimal (no left-out term would lower the error: the Karush-Kuhn-
    Tucker conditions) is the answer, so among equally good fits (few distinct rows fit several
    subsets exactly) the line is kept, and one row gives the line through the origin in the
    second term. Terms a subset leaves out are 0; no rows, or none determined, gives all zeros."""
    n = len(rows[0][0]) if rows else 0
    normal = [[sum(w * x[i] * x[j] for x, _, w in rows) for j in range(n)] for i in range(n)]
    right = [sum(w * x[i] * y for x, y, w in rows) for i in range(n)]
    tolerance = 1e-9 * max((abs(r) for r in right), default=1.0)
    subsets = [s for size in range(1, n + 1) for s in combinations(range(n), size)]
    subsets.sort(key=lambda s: (max(s) >= PREFERRED_TERMS, len(s), -sum(s)))
    for terms in subsets:
        solved = _solve([[normal[i][j] for j in terms] for i in terms], [right[i] for i in terms])
        if solved is None or min(solved) < 0:
            continue
        coefficients = [0.0] * n
        for c, i in zip(solved, terms):
            coefficients[i] = c
        gradient = [sum(normal[j][i] * coefficients[i] for i in terms) - right[j] for j in range(n)]
        if all(gradient[j] >= -tolerance for j in range(n) if j not in terms):
            return tuple(coefficients)
    return (0.0,) * n


def _solve(matrix: list[list[float]], right: list[float]) -> list[float] | None:
    """``matrix @ x = right`` by Gaussian elimination, or None where ``x`` is not determined."""
    n = len(right)
    rows = [list(row) + [value] for row, value in zip(matrix, right)]
    size = max(abs(rows[i][i]) for i in range(n)) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) <= 1e-10 * size:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(n):
            if r != col:
                factor = rows[r][col] / rows[col][col]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col])]
    return [rows[i][n] / rows[i][i] for i in range(n)]


def cost_curve(samples: list[tuple[int, float, float]], terms: list[list[float]], prior: float) -> list[float] | None:
    """Seconds by width T (index T; entries 0 and 1 are 0: drafted widths start at 2) through
    (width, seconds, weight) samples: the coefficients of ``terms[T]`` fitted
    (``fit_nonnegative``); each measured width adds its mean residual shrunk by ``prior``
    samples (``interpolate``d between measured widths, the nearest one's beyond), so a cost the
    terms cannot follow shows once a width is measured often; the curve is then made
    non-decreasing (``monotone``). None without samples."""
    sums: dict[int, list[float]] = {}  # width -> [weight, weighted seconds]: samples of one width share their terms
    for t, v, w in samples:
        total = sums.setdefault(t, [0.0, 0.0])
        total[0], total[1] = total[0] + w, total[1] + w * v
    if not sums:
        return None
    fit = fit_nonnegative([(terms[t], v / w, w) for t, (w, v) in sums.items()])
    cost = [sum(c * x for c, x in zip(fit, row)) for row in terms]
    residual = {t: (v - w * cost[t]) / (w + prior) for t, (w, v) in sorted(sums.items())}
    return [0.0, 0.0] + monotone([max(0.0, cost[t] + interpolate(residual, t)) for t in range(2, len(terms))])


def interpolate(points: dict[int, float], x: int) -> float:
    """The value at ``x`` of the piecewise-linear curve through ``points`` (sorted by key), the
    nearest point's value beyond them."""
    keys = list(points)
    if x <= keys[0]:
        return points[keys[0]]
    if x >= keys[-1]:
        return points[keys[-1]]
    hi = next(k for k in keys if k >= x)
    lo = keys[keys.index(hi) - 1]
    return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)


def monotone(points: list[float], weights: list[float] | None = None) -> list[float]:
    """The non-decreasing sequence closest to ``points`` in least squares, each point weighted by
    ``weights`` (default 1) (isotonic regression, pooling adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for value, weight in zip(points, weights or [1.0] * len(points)):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1, n1), (m2, w2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
    return [mean for mean, _, count in blocks for _ in range(int(count))]


class Ema:
    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.value: float | None = None

    def update(self, sample: float, weight: float | None = None) -> None:
        weight = self.weight if weight is None else max(weight, self.weight)
        self.value = sample if self.value is None else (1 - weight) * self.value + weight * sample
