"""Reference computations the test suite checks Specter's kernels against (tests only).

``grouped_rows(x [P, K], w [S, N, K], ends [S]) -> float64 [P, N]``: rows ``ends[s-1] .. ends[s]``
of ``x`` times ``w[s]`` transposed, in float64 (the contract of ``native_rows.grouped_rows`` and
``blocked_rows.blocked_rows``, with the weights in today's layout).
"""

from __future__ import annotations

import torch


def grouped_rows(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    out, start = [], 0
    for group, end in enumerate(ends.tolist()):
        out.append(x[start:end].double() @ w[group].double().T)
        start = end
    return torch.cat(out)
