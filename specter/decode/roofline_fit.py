"""The estimators the ``roofline`` governor (``specter.decode.roofline``) is built from.

Contract: ``distinct_experts(tokens, n_experts, top_k)``, the expected distinct experts of one
layer that ``tokens`` tokens routed top-k uniformly read (what a memory-bound verification's cost
follows); ``fit_line(points)``, weighted least squares ``y = a + b x`` with ``a, b >= 0``;
``monotone(points)``, weighted isotonic regression (non-decreasing); ``Ema``, a moving average
whose ``update`` may be given a larger weight for one sample. Pure Python, no state beyond
``Ema``'s value.
"""

from __future__ import annotations


def distinct_experts(tokens: int, n_experts: int, top_k: int) -> float:
    """Expected distinct experts of one layer read by ``tokens`` tokens routed top-k uniformly."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def fit_line(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Weighted least squares ``y = a + b x`` over (x, y, weight) points with ``a, b >= 0``; with
    one distinct x, or when the free fit breaks the signs, the line through the origin."""
    total = sum(w for _, _, w in points)
    mean_x = sum(w * x for x, _, w in points) / total
    mean_y = sum(w * y for _, y, w in points) / total
    spread = sum(w * (x - mean_x) ** 2 for x, _, w in points)
    if spread > 1e-12 * max(mean_x, 1.0) ** 2:
        slope = sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points) / spread
        intercept = mean_y - slope * mean_x
        if slope >= 0 and intercept >= 0:
            return intercept, slope
        if slope < 0:
            return mean_y, 0.0
    through_origin = sum(w * x * y for x, y, w in points) / sum(w * x * x for x, _, w in points)
    return 0.0, through_origin


def monotone(points: list[tuple[float, float]]) -> list[float]:
    """Weighted isotonic regression (pool adjacent violators): the non-decreasing sequence
    closest to the (value, weight) points in weighted least squares, one value per point."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for value, weight in points:
        blocks.append([value, max(weight, 1e-9), 1])
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
