"""The experts' layout: when it is blocked, rewriting a module and a disk read blocked, and every
kernel entry point reading blocked weights with ``blocked_rows``' bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, MixtralForCausalLM

from specter.kernels import native_rows
from specter.memory.blocked_layout import block, block_rows_into, unblock
from specter.model import expert_layout
from specter.model.expert_layout import block_module, chooses_blocked, is_blocked
from specter.kernels.grouped_experts import PairsByExpert, PairsBySlot, grouped_experts, native_grouped_experts
from specter.testing.marks import needs_native

HIDDEN, INTER, EXPERTS = 32, 48, 6


def experts_module(hidden: int = HIDDEN, inter: int = INTER) -> torch.nn.Module:
    config = MixtralConfig(vocab_size=32, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=EXPERTS,
                           num_experts_per_tok=2)
    return MixtralForCausalLM(config).eval().model.layers[0].mlp.experts


def gate(t: torch.Tensor) -> torch.Tensor:
    return F.silu(t[..., :INTER]) * t[..., INTER:]


@pytest.fixture
def no_size_floor(monkeypatch):
    monkeypatch.setattr(expert_layout, "BLOCKED_MIN_BYTES", 0)


@needs_native
def test_blocked_where_a_cpu_computes_large_float32_experts_of_sixteen_wide_dimensions(monkeypatch) -> None:
    module, cpu = experts_module(), torch.device("cpu")
    expert_bytes = (2 * INTER * HIDDEN + HIDDEN * INTER) * 4
    monkeypatch.setattr(expert_layout, "BLOCKED_MIN_BYTES", expert_bytes)
    assert chooses_blocked(module, torch.float32, cpu)
    assert not chooses_blocked(module, torch.bfloat16, cpu)
    assert not chooses_blocked(module, torch.float32, torch.device("meta"))
    assert not chooses_blocked(experts_module(inter=40), torch.float32, cpu)  # I = 40: not whole blocks
    monkeypatch.setattr(expert_layout, "BLOCKED_MIN_BYTES", expert_bytes + 1)
    assert not chooses_blocked(module, torch.float32, cpu)  # smaller than the floor


@needs_native
def test_the_switch_turns_the_blocked_layout_off_process_wide(no_size_floor) -> None:
    module, was = experts_module(), expert_layout.enabled()
    try:
        assert expert_layout.enabled(False) is False
        assert not chooses_blocked(module, torch.float32, torch.device("cpu"))
        assert expert_layout.enabled(True) is True
        assert chooses_blocked(module, torch.float32, torch.device("cpu"))
    finally:
        expert_layout.enabled(was)


def test_the_environment_sets_the_switch_and_a_wrong_value_warns(monkeypatch) -> None:
    monkeypatch.setenv("SPECTER_EXPERT_LAYOUT", "standard")
    assert expert_layout.switch_from_environment() is False
    monkeypatch.setenv("SPECTER_EXPERT_LAYOUT", "auto")
    assert expert_layout.switch_from_environment() is True
    monkeypatch.delenv("SPECTER_EXPERT_LAYOUT")
    assert expert_layout.switch_from_environment() is True
    monkeypatch.setenv("SPECTER_EXPERT_LAYOUT", "standrad")
    with pytest.warns(UserWarning, match="standrad"):
        assert expert_layout.switch_from_environment() is True


def test_block_module_rewrites_both_weights_in_their_own_storage_and_marks_the_module() -> None:
    module = experts_module()
    gate_up, down = module.gate_up_proj.detach().clone(), module.down_proj.detach().clone()
    storage = module.gate_up_proj.data_ptr()
    assert not is_blocked(module)
    block_module(module)
    assert is_blocked(module) and module.gate_up_proj.data_ptr() == storage
    assert torch.equal(module.gate_up_proj.detach(), block(gate_up))
    assert torch.equal(unblock(module.down_proj.detach()), down)


def test_block_rows_into_writes_a_row_span_of_the_blocked_weight() -> None:
    weight = torch.randn(64, 24)
    blocked = torch.zeros(64 * 24)
    block_rows_into(blocked[: 32 * 24], weight[:32])  # the gate half, then the up half, as disk pieces arrive
    block_rows_into(blocked[32 * 24 :], weight[32:])
    assert torch.equal(blocked.view(64, 24), block(weight))
    with pytest.raises(ValueError, match="multiple of 16"):
        block_rows_into(torch.zeros(8 * 24), weight[:8])


@needs_native
@pytest.mark.parametrize("tokens, top_k", [(1, 2), (5, 2), (9, 3)])
def test_every_entry_point_reads_blocked_weights_with_the_blocked_kernels_bits(tokens, top_k) -> None:
    gen = torch.Generator().manual_seed(tokens * 3 + top_k)
    gate_up, down = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen), torch.randn(EXPERTS, HIDDEN, INTER, generator=gen)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    gate_up_b, down_b = block(gate_up), block(down)
    # what blocked_rows computes, pair by pair, summed over j in order
    pairs = torch.zeros(tokens * top_k, HIDDEN)
    for p, expert in enumerate(ids.reshape(-1).tolist()):
        one = torch.tensor([1])
        hidden = gate(native_rows.grouped_rows(x[p // top_k : p // top_k + 1], gate_up_b[expert : expert + 1], one, True))
        pairs[p] = native_rows.grouped_rows(hidden, down_b[expert : expert + 1], one, True)[0] * weights.reshape(-1)[p]
    expected = pairs.view(tokens, top_k, HIDDEN).sum(dim=1)

    assert torch.equal(native_grouped_experts(x, ids, weights, gate_up_b, down_b, gate, blocked=True), expected)
    assert torch.equal(grouped_experts(x, ids, weights, gate_up_b, down_b, gate, blocked=True), expected)
    by_expert = PairsByExpert(x, ids, weights, blocked=True)
    experts = sorted(set(ids.reshape(-1).tolist()))
    by_expert.compute(experts[:1], experts[:1], gate_up_b, down_b)  # two waves
    by_expert.compute(experts[1:], experts[1:], gate_up_b, down_b)
    assert torch.equal(by_expert.result(), expected)
    by_slot = PairsBySlot(x, ids, weights, EXPERTS, blocked=True)
    by_slot.compute(experts[:1], gate_up_b, down_b, gate)
    by_slot.compute(experts[1:], gate_up_b, down_b, gate)
    assert torch.equal(by_slot.result(), expected)
    standard = native_grouped_experts(x, ids, weights, gate_up, down, gate)
    torch.testing.assert_close(expected, standard, rtol=1e-4, atol=1e-4)  # another summation order, same sums


def test_autograd_computes_blocked_experts_from_standard_copies() -> None:
    gen = torch.Generator().manual_seed(3)
    gate_up, down = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen), torch.randn(EXPERTS, HIDDEN, INTER, generator=gen)
    x = torch.randn(4, HIDDEN, generator=gen, requires_grad=True)
    ids, weights = torch.tensor([[0, 3], [3, 5], [1, 0], [2, 4]]), torch.rand(4, 2, generator=gen)
    blocked = grouped_experts(x, ids, weights, block(gate_up), block(down), gate, blocked=True)
    standard = grouped_experts(x, ids, weights, gate_up, down, gate)
    assert torch.equal(blocked, standard)  # the same _grouped_mm form on the same values
    blocked.sum().backward()
    assert x.grad is not None and bool(x.grad.abs().sum() > 0)
