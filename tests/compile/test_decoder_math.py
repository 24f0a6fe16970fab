"""The compiled decoder's dense projections: 2 to ``FUSED_MAX_TOKENS`` rows go through the native
row kernel where ``Arch.row_kernel`` says it serves (each row as it would be alone, equal to
``F.linear`` to float32 rounding); one row keeps the fused multiply-and-sum, longer inputs BLAS."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from specter import native
from specter.compile import decoder_math
from specter.compile.decoder_math import FUSED_MAX_TOKENS, linear
from specter.compile.model_weights import arch_of
from specter.kernels import native_rows
from specter.testing.marks import needs_native


@pytest.fixture
def row_kernel_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = native_rows.grouped_rows

    def counted(x, w, ends):
        calls.append(x.shape[0])
        return real(x, w, ends)

    monkeypatch.setattr(decoder_math.native_rows, "grouped_rows", counted)
    return calls


@needs_native
@pytest.mark.parametrize("rows", [2, 5, FUSED_MAX_TOKENS])
def test_a_few_rows_take_the_row_kernel_each_as_if_alone(rows: int, row_kernel_calls: list[int]) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, weight, bias = torch.randn(rows, 64, generator=gen), torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    y = linear(x, weight, bias, row_kernel=True)
    assert row_kernel_calls == [rows]
    torch.testing.assert_close(y, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    alone = torch.cat([native_rows.grouped_rows(x[i : i + 1], weight[None], torch.tensor([1])) for i in range(rows)])
    assert torch.equal(y, alone + bias)


@needs_native
def test_one_row_longer_inputs_and_no_row_kernel_keep_their_own_paths(row_kernel_calls: list[int]) -> None:
    weight = torch.randn(32, 64)
    for x, row_kernel in ((torch.randn(1, 64), True), (torch.randn(FUSED_MAX_TOKENS + 1, 64), True),
                          (torch.randn(4, 64), False)):
        torch.testing.assert_close(linear(x, weight, row_kernel=row_kernel), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert row_kernel_calls == []


@needs_native
def test_arch_says_the_row_kernel_serves_a_float32_cpu_model_unless_the_native_kernels_are_off(tiny_mixtral) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_mixtral, dtype=torch.float32)
    assert arch_of(model).row_kernel
    with native.disabled():
        assert not arch_of(model).row_kernel
    assert not arch_of(model.to(torch.bfloat16)).row_kernel


@needs_native
def test_a_compiled_graph_calls_it_with_a_dynamic_number_of_rows() -> None:
    weight = torch.randn(24, 32)
    step = torch.compile(lambda x: linear(x, weight, row_kernel=True), fullgraph=True, dynamic=True)
    for rows in (2, 3, 7):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(step(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eps", [0.01, 0.5])
def test_the_sparsemixer_routes_as_phimoes_own(eps: float) -> None:
    from transformers.models.phimoe.modeling_phimoe import sparsemixer as phimoes

    scores = torch.randn(64, 16, generator=torch.Generator().manual_seed(7))
    weights, index = decoder_math.sparsemixer(scores, eps)
    expected_weights, expected_index = phimoes(scores, jitter_eps=eps, training=False, top_k=2)
    assert torch.equal(index, expected_index)
    assert torch.equal(weights, expected_weights)
