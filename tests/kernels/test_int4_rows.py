"""``specter::int4_rows``: each row through its own expert's INT4 weight, eagerly and inside a
``fullgraph=True`` compiled graph (one opaque op, no graph break), equal to the per-row kernel."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

import pytest

from specter.kernels.int4 import int4_matmul, quantize_int4
from specter.kernels.int4_rows import IN_PLACE_BACKENDS, int4_rows

torch.set_num_threads(1)
EXPERTS, N, K, GROUP = 5, 96, 128, 64


def stacked_weights(backend: str):
    gen = torch.Generator().manual_seed(0)
    weights = [quantize_int4(torch.randn(N, K, generator=gen), GROUP, backend) for _ in range(EXPERTS)]
    return torch.stack([w.packed for w in weights]), torch.stack([w.scales for w in weights])


def per_row(x, packed, scales, ids, backend):
    return torch.cat([int4_matmul(x[s : s + 1], packed[e], scales[e], backend, (N, K), GROUP)
                      for s, e in enumerate(ids.tolist())])


@pytest.mark.parametrize("backend", IN_PLACE_BACKENDS)
def test_each_row_uses_its_own_experts_weights(backend: str) -> None:
    packed, scales = stacked_weights(backend)
    x = torch.randn(4, K)
    ids = torch.tensor([3, 0, 3, 4])  # a repeated expert too
    out = int4_rows(x, packed, scales, ids, GROUP, N, backend)
    assert out.shape == (4, N) and out.dtype == x.dtype
    torch.testing.assert_close(out, per_row(x, packed, scales, ids, backend), rtol=0, atol=0)
    assert not torch.equal(out[0], int4_rows(x[:1], packed, scales, torch.tensor([0]), GROUP, N, backend)[0])


def test_rejects_a_backend_whose_weights_it_cannot_read() -> None:
    packed, scales = stacked_weights("cpu-int4pack")
    with pytest.raises(ValueError, match="reads cpu-native or cpu-int4pack"):
        int4_rows(torch.randn(1, K), packed, scales, torch.tensor([0]), GROUP, N, "reference")


@pytest.mark.parametrize("backend", IN_PLACE_BACKENDS)
def test_one_opaque_op_inside_a_fullgraph_compiled_graph(backend: str) -> None:
    packed, scales = stacked_weights(backend)

    def step(x, ids):
        return torch.relu(int4_rows(x * 2.0, packed, scales, ids, GROUP, N, backend)).sum(dim=0)

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    breaks = sum(counters["graph_break"].values())
    x = torch.randn(2, K)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x, torch.tensor([1, 2])), step(x, torch.tensor([1, 2])))
        graphs = counters["stats"]["unique_graphs"]
        torch.testing.assert_close(compiled(x, torch.tensor([4, 0])), step(x, torch.tensor([4, 0])))
    assert counters["stats"]["unique_graphs"] == graphs  # other experts: the same graph
    assert sum(counters["graph_break"].values()) == breaks


def test_the_native_row_loop_equals_the_kernel_row_by_row() -> None:
    from specter.kernels import int4_native

    if not int4_native.available():
        pytest.skip(f"native kernels: {int4_native.unavailable_reason()}")
    packed, scales = stacked_weights("cpu-native")
    x = torch.randn(5, K)
    ids = torch.tensor([4, 0, 4, 2, 1])
    out = int4_native.rows(x, packed, scales, ids, GROUP)
    torch.testing.assert_close(out, per_row(x, packed, scales, ids, "cpu-native"), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="expert id out of range"):
        int4_native.rows(x[:1], packed, scales, torch.tensor([EXPERTS]), GROUP)
    compiled = torch.compile(lambda v, i: int4_native.rows(v * 2.0, packed, scales, i, GROUP), fullgraph=True)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x, ids), int4_native.rows(x * 2.0, packed, scales, ids, GROUP))
