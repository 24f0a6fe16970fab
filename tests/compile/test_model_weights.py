"""What the compiled math reads from a model, checked by running it: a whole forward written with
``decoder_math`` over ``layer_weights_of`` (no compilation; the experts through the model's own
modules) gives transformers' logits, bit for bit in float32 and bfloat16, for every layout that
compiles (two cases within rounding, named in ``NOT_BIT_EXACT``), and the options it does not cover
are refused saying what is missing."""

from __future__ import annotations

import pytest
import torch

from specter.compile import decoder_math
from specter.compile.decoder_math import rope_dtype, rope_tables
from specter.compile.model_weights import arch_of, layer_weights_of, named_layer_tensors, unsupported_reason
from specter.testing.zoo import random_model, tiny_config

TOKENS = torch.tensor([1, 17, 93, 4, 250, 31, 8, 66, 140, 7, 201, 55, 3, 9, 120, 44, 19, 23, 77, 5])
YARN_MSCALE = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 64,
               "mscale": 1.0, "mscale_all_dim": 1.0}


def forward_with_decoder_math(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] of ``tokens [T]`` through ``decoder_math`` (no cache before them)."""
    arch, decoder = arch_of(model), model.model
    positions = torch.arange(tokens.shape[0])
    h = decoder.embed_tokens(tokens)
    cos, sin = rope_tables(decoder.rotary_emb.inv_freq, positions, arch.rope_scaling, rope_dtype(arch, h.dtype))
    for layer in decoder.layers:
        w = layer_weights_of(layer)
        keys = torch.zeros(1, arch.n_kv_heads, tokens.shape[0], arch.head_dim, dtype=h.dtype)
        values = torch.zeros(1, arch.n_kv_heads, tokens.shape[0], arch.value_dim, dtype=h.dtype)
        h, x, top_k_weights, top_k_index = decoder_math.attention_and_route(
            arch, w, keys, values, h, cos, sin, positions, positions)
        if w.dense is not None:
            h = decoder_math.dense_layer(arch, w, h, x)
        else:
            h = decoder_math.after_experts(arch, w, h, x, layer.mlp.experts(x, top_k_index, top_k_weights))
    normed = decoder_math.norm(arch, h, decoder.norm.weight, getattr(decoder.norm, "bias", None))
    return model.lm_head(normed)


# where the math and transformers' forward round differently (the logits then agree to rounding)
NOT_BIT_EXACT = {
    ("deepseek_v2", torch.float32): "V2 rotates as complex numbers, whose product the CPU kernel fuses",
    ("phimoe", torch.bfloat16): "its attention rounds differently in bfloat16 (float32: exact)",
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch, overrides", [
    ("mixtral", {}), ("qwen3_moe", {}), ("olmoe", {}), ("qwen2_moe", {}), ("phimoe", {}),
    ("deepseek_v2", {}),
    ("deepseek_v2", {"q_lora_rank": None, "attention_bias": True, "topk_method": "greedy"}),
    ("deepseek_v3", {}),
    ("deepseek_v3", {"rope_interleave": False, "first_k_dense_replace": 0}),
    ("deepseek_v3", {"rope_parameters": YARN_MSCALE}),
    ("gpt_oss", {"sliding_window": 6}),  # the window bites in every other layer
])
def test_a_forward_through_the_compiled_math_gives_the_models_logits(arch: str, overrides: dict, dtype) -> None:
    model = random_model(tiny_config(arch, **overrides), seed=5).to(dtype)
    assert unsupported_reason(model) is None
    with torch.inference_mode():
        expected = model(TOKENS[None]).logits[0]
        logits = forward_with_decoder_math(model, TOKENS)
    if (arch, dtype) in NOT_BIT_EXACT:
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(logits, expected, rtol=0, atol=tolerance)
    else:
        assert torch.equal(logits, expected)


def test_gpt_oss_layers_keep_their_own_windows_and_sinks() -> None:
    model = random_model(tiny_config("gpt_oss", sliding_window=6), seed=5)
    arch = arch_of(model)
    weights = [layer_weights_of(layer) for layer in model.model.layers]
    assert arch.per_layer_windows and arch.sliding_window is None and arch.softmax_after_topk
    assert [w.window for w in weights] == [6, None] and all(w.sinks is not None for w in weights)
    assert "window" not in dict(named_layer_tensors(weights[0]))  # a constant of the math, not a tensor


@pytest.mark.parametrize("config, missing", [
    (lambda: tiny_config("qwen2_moe", use_sliding_window=True), "use_sliding_window"),
    (lambda: tiny_config("deepseek_v2", hidden_act="gelu"), "activation 'gelu'"),
])
def test_options_the_math_does_not_cover_are_refused_saying_what(config, missing: str) -> None:
    assert missing in unsupported_reason(random_model(config()))
