"""``specter::int4_rows``: each row through its own expert's INT4 weight, eagerly and inside a
``fullgraph=True`` compiled graph (one opaque op, no graph break), equal to the per-row kernel."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from specter.kernels.int4 import int4_matmul, quantize_int4
from specter.kernels.int4_rows import int4_rows

torch.set_num_threads(1)
EXPERTS, N, K, GROUP = 5, 96, 128, 64


def stacked_weights():
    gen = torch.Generator().manual_seed(0)
    weights = [quantize_int4(torch.randn(N, K, generator=gen), GROUP, "cpu-int4pack") for _ in range(EXPERTS)]
    return torch.stack([w.packed for w in weights]), torch.stack([w.scales for w in weights])


def per_row(x, packed, scales, ids):
    return torch.cat([int4_matmul(x[s : s + 1], packed[e], scales[e], "cpu-int4pack", (N, K), GROUP)
                      for s, e in enumerate(ids.tolist())])


def test_each_row_uses_its_own_experts_weights() -> None:
    packed, scales = stacked_weights()
    x = torch.randn(4, K)
    ids = torch.tensor([3, 0, 3, 4])  # a repeated expert too
    out = int4_rows(x, packed, scales, ids, GROUP, N)
    assert out.shape == (4, N) and out.dtype == x.dtype
    torch.testing.assert_close(out, per_row(x, packed, scales, ids), rtol=0, atol=0)
    assert not torch.equal(out[0], int4_rows(x[:1], packed, scales, torch.tensor([0]), GROUP, N)[0])


def test_one_opaque_op_inside_a_fullgraph_compiled_graph() -> None:
    packed, scales = stacked_weights()

    def step(x, ids):
        return torch.relu(int4_rows(x * 2.0, packed, scales, ids, GROUP, N)).sum(dim=0)

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    breaks = sum(counters["graph_break"].values())
    x = torch.randn(2, K)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x, torch.tensor([1, 2])), step(x, torch.tensor([1, 2])))
        graphs = counters["stats"]["unique_graphs"]
        torch.testing.assert_close(compiled(x, torch.tensor([4, 0])), step(x, torch.tensor([4, 0])))
    assert counters["stats"]["unique_graphs"] == graphs  # other experts: the same graph
    assert sum(counters["graph_break"].values()) == breaks
