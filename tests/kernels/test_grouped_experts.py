"""The grouped experts kernel against a per-pair reference and transformers' own experts math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.integrations.moe import grouped_mm_experts_forward

from specter.experts.runtime import use_grouped_kernel
from specter.kernels.grouped_experts import (
    PairsByExpert, PairsBySlot, grouped_experts, is_silu_glu, native_grouped_experts, supports,
)

HIDDEN, INTER, SLOTS = 32, 24, 7


def gate(t: torch.Tensor) -> torch.Tensor:
    return F.silu(t[..., :INTER]) * t[..., INTER:]


def reference(x, ids, weights, gate_up, down):
    out = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = gate(gate_up[e].double() @ x[t].double())
            out[t] += float(weights[t, j]) * (down[e].double() @ h)
    return out


@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 9, 16])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_every_pair_runs_its_expert_once_scaled_and_summed(tokens: int, top_k: int) -> None:
    gen = torch.Generator().manual_seed(tokens * 10 + top_k)
    gate_up = torch.randn(SLOTS, 2 * INTER, HIDDEN, generator=gen)
    down = torch.randn(SLOTS, HIDDEN, INTER, generator=gen)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    # distinct experts per token; some experts shared by several tokens, some by one (padded)
    ids = torch.stack([torch.randperm(SLOTS, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    out = grouped_experts(x, ids, weights, gate_up, down, gate)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), reference(x, ids, weights, gate_up, down), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("native_kernel", [True, False])
@pytest.mark.parametrize("tokens, top_k", [(1, 2), (5, 2), (9, 3)])
def test_the_native_and_the_grouped_mm_forms_agree_with_the_reference(tokens, top_k, native_kernel, monkeypatch) -> None:
    from specter import native
    from specter.kernels import native_rows

    if native_kernel and not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    if not native_kernel:
        monkeypatch.setattr(native, "available", lambda: False)
    gen = torch.Generator().manual_seed(tokens + top_k)
    inter = 48  # K of the down projection a multiple of 16: the native kernel can serve both projections
    gate_up, down = torch.randn(SLOTS, 2 * inter, HIDDEN, generator=gen), torch.randn(SLOTS, HIDDEN, inter, generator=gen)
    assert native_rows.serves(torch.zeros(1, HIDDEN), gate_up, down) is native_kernel
    x = torch.randn(tokens, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(SLOTS, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    wide_gate = lambda t: F.silu(t[..., :inter]) * t[..., inter:]  # noqa: E731
    expected = torch.zeros(tokens, HIDDEN, dtype=torch.float64)
    for t in range(tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            expected[t] += float(weights[t, j]) * (down[e].double() @ wide_gate(gate_up[e].double() @ x[t].double()))
    out = grouped_experts(x, ids, weights, gate_up, down, wide_gate)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seed", range(6))
def test_pairs_computed_in_any_split_of_the_experts_have_the_bits_of_one_pass(seed: int) -> None:
    from specter import native

    if not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    gen = torch.Generator().manual_seed(seed)
    inter, tokens, top_k = 48, 1 + seed * 3, 1 + seed % 3
    gate_up, down = torch.randn(SLOTS, 2 * inter, HIDDEN, generator=gen), torch.randn(SLOTS, HIDDEN, inter, generator=gen)
    wide_gate = lambda t: F.silu(t[..., :inter]) * t[..., inter:]  # noqa: E731
    x = torch.randn(tokens, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(SLOTS, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    used = ids.unique()[torch.randperm(ids.unique().numel(), generator=gen)].tolist()
    cuts = sorted(torch.randperm(len(used) + 1, generator=gen)[:2].tolist())
    waves = [w for w in (used[: cuts[0]], used[cuts[0] : cuts[1]], used[cuts[1] :]) if w]
    pairs = PairsBySlot(x, ids, weights, SLOTS)
    for wave in waves:
        pairs.compute(wave, gate_up, down, wide_gate)
    one_pass = native_grouped_experts(x, ids, weights, gate_up, down, wide_gate)
    assert torch.equal(pairs.result(), one_pass)
    one_by_one = PairsBySlot(x, ids, weights, SLOTS)  # single-slot waves: the rows read in place
    for slot in used + [s for s in range(SLOTS) if s not in used]:  # unused slots: no rows
        one_by_one.compute([slot], gate_up, down, wide_gate)
    assert torch.equal(one_by_one.result(), one_pass)
    by_expert = PairsByExpert(x, ids, weights)  # the waves in one native call each (ids are the slots here)
    for wave in waves:
        by_expert.compute(wave, wave, gate_up, down)
    assert torch.equal(by_expert.result(), one_pass)
    by_expert_one_by_one = PairsByExpert(x, ids, weights)
    for slot in used:
        by_expert_one_by_one.compute([slot], [slot], gate_up, down)
    assert torch.equal(by_expert_one_by_one.result(), one_pass)
    relocated = PairsByExpert(x, ids, weights)  # an expert's weights in another slot: the same bits
    moved = {e: (e + 1) % SLOTS for e in used}
    for wave in waves:
        relocated.compute(wave, [moved[e] for e in wave], gate_up.roll(1, 0), down.roll(1, 0))
    assert torch.equal(relocated.result(), one_pass)
    partial = PairsBySlot(x, ids, weights, SLOTS)
    partial.compute(used[:1], gate_up, down, wide_gate)
    if len(used) > 1:  # pairs of slots never computed count as zero
        assert not torch.equal(partial.result(), one_pass)


def test_is_silu_glu_only_for_the_default_gate_with_a_silu() -> None:
    config = MixtralConfig(vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    experts = MixtralForCausalLM(config).model.layers[0].mlp.experts
    assert is_silu_glu(experts)
    experts.act_fn = torch.nn.GELU()
    assert not is_silu_glu(experts)
    experts.act_fn = torch.nn.SiLU()
    assert is_silu_glu(experts)

    class OwnGate(type(experts)):
        def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
            gate, up = gate_up_out.chunk(2, dim=-1)
            return gate * torch.sigmoid(gate) * up

    experts.__class__ = OwnGate
    assert not is_silu_glu(experts)


def test_all_tokens_on_one_expert_and_unused_slots() -> None:
    gen = torch.Generator().manual_seed(1)
    gate_up, down = torch.randn(SLOTS, 2 * INTER, HIDDEN, generator=gen), torch.randn(SLOTS, HIDDEN, INTER, generator=gen)
    x = torch.randn(4, HIDDEN, generator=gen)
    ids = torch.full((4, 1), 5)
    weights = torch.ones(4, 1)
    torch.testing.assert_close(grouped_experts(x, ids, weights, gate_up, down, gate).double(),
                               reference(x, ids, weights, gate_up, down), rtol=1e-4, atol=1e-4)


def test_bfloat16_matches_the_reference_to_bf16_rounding() -> None:
    gen = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(SLOTS, 2 * INTER, HIDDEN, generator=gen) * 0.1).bfloat16()
    down = (torch.randn(SLOTS, HIDDEN, INTER, generator=gen) * 0.1).bfloat16()
    x = torch.randn(3, HIDDEN, generator=gen).bfloat16()
    ids = torch.tensor([[0, 3], [3, 6], [1, 0]])
    weights = torch.rand(3, 2, generator=gen)
    out = grouped_experts(x, ids, weights, gate_up, down, gate)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference(x, ids, weights, gate_up, down), rtol=3e-2, atol=3e-2)


@pytest.fixture(scope="module")
def mixtral() -> MixtralForCausalLM:
    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2, num_local_experts=SLOTS,
                           num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    return MixtralForCausalLM(config).eval()


def test_matches_transformers_experts_on_a_real_module(mixtral) -> None:
    experts = mixtral.model.layers[0].mlp.experts
    assert supports(experts)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(SLOTS, generator=gen)[:2] for _ in range(6)])
    weights = torch.rand(6, 2, generator=gen)
    with torch.no_grad():
        ours = grouped_experts(x, ids, weights, experts.gate_up_proj, experts.down_proj, experts._apply_gate)
        theirs = grouped_mm_experts_forward(experts, x, ids, weights)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_layouts_outside_the_kernel_are_refused(mixtral) -> None:
    experts = mixtral.model.layers[0].mlp.experts
    for flag, value in (("has_bias", True), ("is_transposed", True), ("has_gate", False), ("has_post_expert_norm", True)):
        original = getattr(experts, flag, None)
        setattr(experts, flag, value)
        try:
            assert not supports(experts), flag
        finally:
            setattr(experts, flag, original)


def test_a_resident_model_on_cpu_runs_its_experts_through_the_kernel(mixtral) -> None:
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        before = mixtral(ids).logits
        assert use_grouped_kernel(mixtral)
        assert mixtral.config._experts_implementation == "specter-grouped"
        after = mixtral(ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
