"""INT4 experts vs transformers' own experts modules on tiny random MoE models."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)
from transformers.integrations.moe import ExpertsInterface

from specter.kernels.int4_experts import Int4Experts, quantize_model_experts

HIDDEN, INTER, EXPERTS, TOP_K = 128, 64, 8, 2
COMMON = dict(
    hidden_size=HIDDEN, num_hidden_layers=2, num_experts_per_tok=TOP_K,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
)


def tiny(arch: str, **overrides) -> nn.Module:
    torch.manual_seed(0)
    overrides = {**COMMON, **overrides}
    if arch == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=INTER, num_local_experts=EXPERTS, **overrides))
    elif arch == "gpt-oss":
        config = GptOssConfig(intermediate_size=INTER, num_local_experts=EXPERTS, head_dim=32, **overrides)
        model = GptOssForCausalLM(config)
        for name, p in model.named_parameters():
            if name.endswith("_bias"):  # initialised to zero: make the biases count
                nn.init.normal_(p, std=0.02)
    elif arch == "qwen2-moe":
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
            intermediate_size=INTER, moe_intermediate_size=INTER, shared_expert_intermediate_size=INTER,
            num_experts=EXPERTS, **overrides,
        ))
    else:
        raise ValueError(arch)
    return model.eval()


def experts_of(model: nn.Module, layer: int = 0) -> nn.Module:
    return model.model.layers[layer].mlp.experts


def routing(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=gen)
    index = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])  # [T, k]
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=gen), dim=-1)  # [T, k]
    return hidden, index, weights


def make_representable(module: nn.Module, group_size: int) -> None:
    """Sets every stacked expert matrix to bf16 scale * q, q in [-8, 7], a 7 or -8 in each group."""
    gen = torch.Generator().manual_seed(1)
    for name in ("gate_up_proj", "up_proj", "down_proj"):
        param = getattr(module, name, None)
        if not isinstance(param, torch.Tensor) or param.dim() != 3:
            continue
        w = param.data.transpose(1, 2) if module.is_transposed else param.data  # [E, N, K] view
        e, n, k = w.shape
        q = torch.randint(-8, 8, (e, n, k // group_size, group_size), generator=gen)
        q[..., 0] = torch.where(torch.rand(e, n, k // group_size, generator=gen) < 0.5, 7, -8)
        scales = (torch.rand(e, n, k // group_size, 1, generator=gen) * 0.01 + 0.002).bfloat16().float()
        w.copy_((q * scales).reshape(e, n, k))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


ARCHS = ["mixtral", "gpt-oss", "qwen2-moe"]


@pytest.mark.parametrize("arch", ARCHS)
def test_close_to_the_full_precision_experts(arch: str) -> None:
    module = experts_of(tiny(arch))
    int4 = Int4Experts.from_module(module, group_size=32)
    assert int4.backend == "cpu-int4pack"
    hidden, index, weights = routing(12)
    with torch.no_grad():
        expected = module(hidden, index, weights)
        got = int4(hidden, index, weights)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    # two quantized matmuls around a gated activation, random weights at group 32: about 0.12-0.18
    assert rel(got, expected) < 0.25


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("group_size", [32, 64])
def test_exactly_representable_weights_match_full_precision(arch: str, group_size: int) -> None:
    module = experts_of(tiny(arch))
    with torch.no_grad():
        make_representable(module, group_size)
        hidden, index, weights = routing(12)
        expected = module(hidden, index, weights)
        int4 = Int4Experts.from_module(module, group_size)
        kernel = int4(hidden, index, weights)
        reference = Int4Experts.from_module(module, group_size, backend="reference")(hidden, index, weights)
    # the int4pack kernel rounds activations to bf16, the native one to int8 per 64 values (the
    # INT4 weights themselves are ~10x further from random full-precision experts: see above)
    assert rel(kernel, expected) < (2e-2 if int4.backend == "cpu-native" else 1e-2)
    assert rel(reference, expected) < 1e-5  # float32 end to end: the same math exactly


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_grouped_static_masked_and_gather_paths_agree(arch: str, tokens: int) -> None:
    int4 = Int4Experts.from_module(experts_of(tiny(arch)), group_size=64)
    hidden, index, weights = routing(tokens, seed=tokens)
    with torch.no_grad():
        grouped = int4.forward_grouped(hidden, index, weights)
        one_token = (int4.forward_one_token,) if tokens == 1 else ()  # the per-expert single-token form
        for path in (int4.forward_static, int4.forward_masked, int4.forward_gather, *one_token):
            torch.testing.assert_close(path(hidden, index, weights), grouped, rtol=1e-4, atol=1e-6)


def test_repeated_expert_and_bfloat16_hidden() -> None:
    int4 = Int4Experts.from_module(experts_of(tiny("mixtral")), group_size=64)
    hidden = torch.randn(4, HIDDEN, dtype=torch.bfloat16)
    index = torch.tensor([[3, 3], [0, 7], [7, 0], [5, 1]])  # a token sending both slots to one expert
    weights = torch.full((4, 2), 0.5)
    with torch.no_grad():
        out = int4(hidden, index, weights)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(int4.forward_static(hidden, index, weights), out, rtol=1e-2, atol=1e-3)
        single = int4.forward_grouped(hidden[:1], torch.tensor([[3]]), torch.ones(1, 1))
    torch.testing.assert_close(out[:1], single, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("arch", ARCHS)
def test_keeps_no_copies_and_counts_its_bytes(arch: str) -> None:
    module = experts_of(tiny(arch))
    int4 = Int4Experts.from_module(module, group_size=64)
    assert int4.module is module and int4.num_experts == EXPERTS
    if module.has_bias:
        assert int4.up_bias.data_ptr() == module.gate_up_proj_bias.data_ptr()
        assert int4.down_bias.data_ptr() == module.down_proj_bias.data_ptr()
    # the per-expert weights are views into one stacked tensor
    assert int4.up[1].packed.data_ptr() == int4.up_packed[1].data_ptr()
    full = sum(p.nbytes for p in module.parameters(recurse=False))
    int4_weights = int4.up_packed.nbytes + int4.up_scales.nbytes + int4.down_packed.nbytes + int4.down_scales.nbytes
    biases = full - module.down_proj.nbytes - module.gate_up_proj.nbytes
    assert int4.nbytes == int4_weights + biases
    assert int4_weights < (full - biases) / 6


def test_quantize_model_experts_keys_by_decoder_layer() -> None:
    model = tiny("qwen2-moe", num_hidden_layers=3, mlp_only_layers=[1])
    found = quantize_model_experts(model, group_size=64)
    assert list(found) == [0, 2]
    assert found[2].module is experts_of(model, 2)
    assert list(quantize_model_experts(tiny("gpt-oss"), 32)) == [0, 1]


def test_drives_a_whole_model_through_the_experts_interface() -> None:
    model = tiny("mixtral")
    with torch.no_grad():
        for layer in model.model.layers:
            make_representable(layer.mlp.experts, 64)
        ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(0))
        expected = model(ids).logits
        table = {id(m.module): m for m in quantize_model_experts(model, 64).values()}
        calls: list[int] = []

        def int4_forward(self, hidden, top_k_index, top_k_weights):
            calls.append(id(self))
            return table[id(self)](hidden, top_k_index, top_k_weights)

        ExpertsInterface.register("specter-int4-test", int4_forward)
        model.set_experts_implementation("specter-int4-test")
        try:
            got = model(ids).logits
        finally:
            model.set_experts_implementation("grouped_mm")
    assert sorted(calls) == sorted(table)  # one call per MoE layer
    assert rel(got, expected) < 1e-2


@pytest.mark.parametrize("arch", ["mixtral", "gpt-oss"])
def test_decode_path_traces_fullgraph(arch: str) -> None:
    int4 = Int4Experts.from_module(experts_of(tiny(arch)), group_size=64)
    torch._dynamo.reset()
    compiled = torch.compile(int4.forward, fullgraph=True, backend="aot_eager", dynamic=False)
    with torch.no_grad():
        for tokens in (1, 8):  # gather (T*k <= E), then masked
            hidden, index, weights = routing(tokens, seed=tokens)
            expected = int4.forward_grouped(hidden, index, weights)
            torch.testing.assert_close(compiled(hidden, index, weights), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_decode_path_compiles_with_inductor() -> None:
    int4 = Int4Experts.from_module(experts_of(tiny("gpt-oss")), group_size=64)
    torch._dynamo.reset()
    compiled = torch.compile(int4.forward, fullgraph=True, dynamic=False)
    with torch.no_grad():
        hidden, index, weights = routing(1)
        expected = int4.forward_grouped(hidden, index, weights)
        torch.testing.assert_close(compiled(hidden, index, weights), expected, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("arch, fused", [("mixtral", True), ("qwen2-moe", True), ("gpt-oss", False)])
def test_one_token_takes_the_fused_native_sum_where_the_gate_is_plain_silu(arch: str, fused: bool, monkeypatch) -> None:
    from specter import native
    from specter.kernels import int4_native

    if not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    int4 = Int4Experts.from_module(experts_of(tiny(arch)), group_size=64)
    assert int4.backend == "cpu-native" and int4.fused_token is fused  # GPT-OSS: clamped, interleaved gate and biases
    calls = []
    real = int4_native.glu_token
    monkeypatch.setattr(int4_native, "glu_token", lambda *args: calls.append(1) or real(*args))
    hidden, index, weights = routing(1, seed=5)
    with torch.no_grad():
        out = int4.forward(hidden, index, weights)
        torch.testing.assert_close(out, int4.forward_gather(hidden, index, weights), rtol=1e-5, atol=1e-6)
    assert len(calls) == (1 if fused else 0)


@pytest.mark.parametrize("arch", ["mixtral", "phimoe", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss"])
def test_every_layout_takes_the_fused_sum_exactly_where_its_gate_is_plain_silu(arch: str) -> None:
    from specter import native
    from specter.testing.zoo import random_model

    if not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    int4 = next(iter(quantize_model_experts(random_model(arch, hidden=128, intermediate=128), 64).values()))
    assert int4.fused_token is (arch != "gpt_oss")
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(1, 128, generator=gen)
    index = torch.randperm(int4.num_experts, generator=gen)[:2][None]
    weights = torch.softmax(torch.randn(1, 2, generator=gen), dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(int4.forward(hidden, index, weights), int4.forward_gather(hidden, index, weights),
                                   rtol=1e-5, atol=1e-6)


def test_up_and_down_take_one_backend_both_can_hold() -> None:
    """Qwen2-MoE-A2.7B's and DeepSeek-V2-Lite's shapes scaled down (an intermediate size that is a
    multiple of 64 but not of the group size): the up projection alone would take a packed kernel
    and the down one the reference layout, and every path that reads both through the up's
    backend crashed; both now take the best backend that holds each, and every path computes."""
    from specter.model.layout import moe_layers
    from specter.testing.zoo import random_model

    model = random_model("qwen2_moe", seed=0, hidden=256, intermediate=320)
    experts = Int4Experts.from_module(moe_layers(model)[0].experts, 256)
    assert experts.up[0].backend == experts.down[0].backend == "reference" and not experts.fused_token
    hidden, index, weights = torch.randn(3, 256), torch.tensor([[0, 1], [2, 1], [3, 0]]), torch.rand(3, 2)
    expected = experts.forward_one_token(hidden[:1], index[:1], weights[:1])
    torch.testing.assert_close(experts.forward(hidden[:1], index[:1], weights[:1]), expected)
    torch.testing.assert_close(experts.forward_gather(hidden[:1], index[:1], weights[:1]), expected)
    torch.testing.assert_close(experts.forward(hidden, index, weights)[:1], expected)

