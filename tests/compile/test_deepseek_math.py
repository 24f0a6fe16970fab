"""DeepSeek-V2/V3's compiled math against the models' own modules: the grouped routers choose the
same experts with the same weights, and a whole forward written with ``decoder_math`` (latent
attention with its expanded K/V, interleaved or plain RoPE, low-rank or full queries, dense first
layers, unscaled shared experts) gives transformers' logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specter.compile import decoder_math
from specter.compile.deepseek_math import Groups, grouped_select
from specter.compile.decoder_math import rope_tables
from specter.compile.model_weights import arch_of, layer_weights_of, unsupported_reason
from specter.testing.zoo import random_model, tiny_config


def _sorted(weights: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = index.argsort(dim=-1)
    return weights.gather(1, order), index.gather(1, order)


@pytest.mark.parametrize("arch, overrides", [
    ("deepseek_v2", {"topk_method": "greedy"}),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "routed_scaling_factor": 16.0}),
    ("deepseek_v3", {"norm_topk_prob": True}),
    ("deepseek_v3", {"norm_topk_prob": False, "routed_scaling_factor": 1.0}),
])
def test_the_grouped_routers_choose_as_the_models_own(arch: str, overrides: dict) -> None:
    model = random_model(tiny_config(arch, n_experts=16, **overrides), seed=3)
    gate = model.model.layers[-1].mlp.gate
    if arch == "deepseek_v3":  # a correction bias that changes the choice, not the weights
        gate.e_score_correction_bias.copy_(torch.randn(16, generator=torch.Generator().manual_seed(1)) * 0.2)
    x = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    _, expected_weights, expected_index = gate(x)
    groups = arch_of(model).groups
    weights, index = grouped_select(groups, gate.top_k, F.linear(x, gate.weight), getattr(gate, "e_score_correction_bias", None))
    expected_weights, expected_index = _sorted(expected_weights, expected_index)
    weights, index = _sorted(weights, index)
    assert torch.equal(index, expected_index)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)
    assert groups.topk_group == (0 if overrides.get("topk_method") == "greedy" else model.config.topk_group)


def test_group_limits_keep_the_choice_inside_the_best_groups() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0, 4.5, 0.0, 0.0, 0.0]])  # groups of two: {0,1} {2,3} {4,5} {6,7}
    groups = Groups(sigmoid=False, n_group=4, topk_group=1, renormalize=False, scaling=1.0)
    _, index = grouped_select(groups, 2, logits, None)
    assert sorted(index[0].tolist()) == [0, 1]  # expert 4 outscores 1 but lies in another group
    _, index = grouped_select(Groups(False, 4, 0, False, 1.0), 2, logits, None)
    assert sorted(index[0].tolist()) == [0, 4]


def forward_with_decoder_math(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] of ``tokens [T]`` through ``decoder_math`` (no cache before them), experts eagerly."""
    arch, decoder = arch_of(model), model.model
    positions = torch.arange(tokens.shape[0])
    h = decoder.embed_tokens(tokens)
    cos, sin = rope_tables(decoder.rotary_emb.inv_freq, positions, arch.rope_scaling, h.dtype)
    for layer in decoder.layers:
        w = layer_weights_of(layer)
        keys = torch.zeros(1, arch.n_kv_heads, tokens.shape[0], arch.head_dim)
        values = torch.zeros(1, arch.n_kv_heads, tokens.shape[0], arch.value_dim)
        h, x, top_k_weights, top_k_index = decoder_math.attention_and_route(
            arch, w, keys, values, h, cos, sin, positions, positions)
        if w.dense is not None:
            h = decoder_math.dense_layer(arch, w, h, x)
        else:
            h = decoder_math.after_experts(arch, w, h, x, layer.mlp.experts(x, top_k_index, top_k_weights))
    return model.lm_head(decoder.norm(h))


@pytest.mark.parametrize("arch, overrides", [
    ("deepseek_v2", {}),
    ("deepseek_v2", {"q_lora_rank": None, "attention_bias": True, "topk_method": "greedy"}),
    ("deepseek_v3", {}),
    ("deepseek_v3", {"rope_interleave": False, "first_k_dense_replace": 0}),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                         "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0}}),
])
def test_a_forward_through_the_compiled_math_gives_the_models_logits(arch: str, overrides: dict) -> None:
    model = random_model(tiny_config(arch, **overrides), seed=5)
    assert unsupported_reason(model) is None
    tokens = torch.tensor([1, 17, 93, 4, 250, 31, 8, 66, 140, 7, 201, 55])
    with torch.inference_mode():
        expected = model(tokens[None]).logits[0]
        logits = forward_with_decoder_math(model, tokens)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_unsupported_deepseek_options_say_what() -> None:
    reason = unsupported_reason(random_model(tiny_config("deepseek_v2", hidden_act="gelu")))
    assert "activation 'gelu'" in reason
