"""Tiny random models of every supported MoE architecture: build, generate, layout, experts calls,
save/load round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, MixtralConfig
from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

from specter.testing import zoo

torch.set_num_threads(1)

PROMPT = torch.randint(3, 256, (1, 12), generator=torch.Generator().manual_seed(7))
NEW_TOKENS = 8
_CALLS: list[tuple[torch.nn.Module, torch.Size, torch.Tensor, torch.Tensor]] = []


def _probe_experts(self, hidden_states, top_k_index, top_k_weights):
    _CALLS.append((self, hidden_states.shape, top_k_index.clone(), top_k_weights.clone()))
    return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


ExpertsInterface.register("specter-zoo-probe", _probe_experts)


def _greedy(model: torch.nn.Module, ids: torch.Tensor = PROMPT) -> torch.Tensor:
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    return out[:, ids.shape[1] :]


def _expected_param_shapes(arch: str, hidden: int = 64, inter: int = 64) -> dict[str, tuple[int, ...]]:
    if arch == "gpt_oss":
        return {
            "gate_up_proj": (hidden, 2 * inter),
            "gate_up_proj_bias": (2 * inter,),
            "down_proj": (inter, hidden),
            "down_proj_bias": (hidden,),
        }
    return {"gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}


@pytest.fixture(scope="module", params=zoo.ARCHITECTURES)
def built(request) -> tuple[str, torch.nn.Module, torch.Tensor]:
    model = zoo.random_model(request.param)
    return request.param, model, _greedy(model)


def test_builds_and_generates(built):
    arch, model, tokens = built
    assert not model.training
    assert model.dtype == torch.float32
    assert model.config.tie_word_embeddings is False
    assert tokens.shape == (1, NEW_TOKENS)
    assert int(tokens.min()) >= 0 and int(tokens.max()) < model.config.vocab_size
    assert torch.equal(_greedy(model), tokens), "greedy decoding is not repeatable"


def test_layout_finds_every_moe_layer(built):
    arch, model, _ = built
    layout = zoo.moe_layout(model)
    dense = 1 if arch.startswith("deepseek") else 0
    assert [info.layer for info in layout] == [dense, dense + 1]
    assert len(model.model.layers) == dense + 2
    for info in layout:
        experts = model.get_submodule(info.experts_module_name)
        router = model.get_submodule(info.router_module_name)
        assert info.experts_module_name == f"model.layers.{info.layer}.mlp.experts"
        assert (info.num_experts, info.top_k) == (16, 2)
        assert router.weight.shape == (16, 64)
        assert info.param_shapes == _expected_param_shapes(arch)
        assert set(info.param_names) == set(info.param_shapes)
        for name in info.param_names:
            assert getattr(experts, name).shape == (16, *info.param_shapes[name])
        assert info.has_gate is True
        assert (info.is_transposed, info.has_bias, info.is_concatenated) == (
            (True, True, False) if arch == "gpt_oss" else (False, False, True)
        )
    shared = {
        "qwen2_moe": ("shared_expert", "shared_expert_gate"),
        "deepseek_v2": ("shared_experts",),
        "deepseek_v3": ("shared_experts",),
    }.get(arch, ())
    for info in layout:
        assert info.shared_expert_module_names == tuple(f"{info.block_module_name}.{s}" for s in shared)


def test_experts_called_with_routing_and_tokens_unchanged(built):
    arch, model, tokens = built
    layout = zoo.moe_layout(model)
    experts_modules = {id(model.get_submodule(info.experts_module_name)): info for info in layout}
    _CALLS.clear()
    model.set_experts_implementation("specter-zoo-probe")
    try:
        probed = _greedy(model)
    finally:
        model.set_experts_implementation("grouped_mm")
    assert torch.equal(probed, tokens)
    # one prefill plus one step per further token, each through every MoE layer
    assert len(_CALLS) == len(layout) * NEW_TOKENS
    for i, (module, shape, index, weights) in enumerate(_CALLS):
        info = experts_modules[id(module)]
        assert info is layout[i % len(layout)]
        t = PROMPT.shape[1] if i < len(layout) else 1
        assert shape == (t, 64)
        assert index.shape == weights.shape == (t, 2)
        assert index.dtype == torch.int64 and weights.dtype == torch.float32
        assert int(index.min()) >= 0 and int(index.max()) < 16
        assert (index[:, 0] != index[:, 1]).all()


def test_other_experts_implementations_agree(built):
    arch, model, tokens = built
    for impl in ("eager", "batched_mm"):
        model.set_experts_implementation(impl)
        try:
            assert torch.equal(_greedy(model), tokens), impl
        finally:
            model.set_experts_implementation("grouped_mm")


def test_routing_is_spread_over_experts(built):
    arch, model, _ = built
    ids = torch.randint(3, 256, (1, 64), generator=torch.Generator().manual_seed(11))
    _CALLS.clear()
    model.set_experts_implementation("specter-zoo-probe")
    try:
        with torch.no_grad():
            model(ids)
    finally:
        model.set_experts_implementation("grouped_mm")
    assert len(_CALLS) == len(zoo.moe_layout(model))
    for _, _, index, _ in _CALLS:
        assert index.unique().numel() >= 8


@pytest.mark.parametrize("arch", zoo.ARCHITECTURES)
def test_checkpoint_round_trip(arch, tmp_path: Path):
    model = zoo.random_model(arch, seed=3)
    path = zoo.save_random_checkpoint(arch, tmp_path / arch, seed=3)
    assert {"config.json", "generation_config.json", "model.safetensors"} <= {p.name for p in path.iterdir()}
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 2
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert type(loaded) is type(model) and loaded.dtype == torch.float32
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert torch.equal(_greedy(loaded), _greedy(model))


def test_seed_decides_weights():
    a, b, c = (zoo.random_model("mixtral", seed=s) for s in (0, 0, 1))
    key = "model.layers.0.mlp.experts.gate_up_proj"
    assert torch.equal(a.state_dict()[key], b.state_dict()[key])
    assert not torch.equal(a.state_dict()[key], c.state_dict()[key])


def test_deepseek_correction_bias_is_live():
    model = zoo.random_model("deepseek_v3")
    for info in zoo.moe_layout(model):
        assert model.get_submodule(info.router_module_name).e_score_correction_bias.abs().sum() > 0


def test_tiny_config_options():
    config = zoo.tiny_config("qwen3_moe", n_experts=8, top_k=4, hidden=128, intermediate=128, layers=3)
    assert (config.num_experts, config.num_experts_per_tok, config.num_hidden_layers) == (8, 4, 3)
    assert zoo.tiny_config("deepseek_v3", layers=4).num_hidden_layers == 5
    assert zoo.tiny_config("mixtral", rms_norm_eps=1e-3).rms_norm_eps == 1e-3
    with pytest.raises(ValueError, match="unknown architecture"):
        zoo.tiny_config("llama")
    with pytest.raises(ValueError, match="sparsemixer"):
        zoo.tiny_config("phimoe", top_k=3)


def test_mixtral_shaped_builds_on_meta_without_memory():
    config = zoo.mixtral_shaped(layers=2)
    assert isinstance(config, MixtralConfig)
    model = zoo.random_model(config, device="meta")
    params = list(model.parameters())
    assert {p.device.type for p in params} == {"meta"}
    assert {p.dtype for p in params} == {torch.bfloat16}
    layout = zoo.moe_layout(model)
    assert [info.layer for info in layout] == [0, 1]
    assert layout[0].param_shapes == {"gate_up_proj": (2 * 14336, 4096), "down_proj": (4096, 14336)}
    assert layout[0].num_experts == 8


def test_gpt_oss_sliding_cache_rolls_back_only_when_recording():
    # Speculative verification crops the shared KV cache; GPT-OSS's sliding layers (window 32 here)
    # drop old states unless past recording is on, after which crop(-n) is exact.
    model = zoo.random_model("gpt_oss")
    prompt = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    drafted, step = torch.tensor([[5, 6, 7]]), torch.tensor([[9]])
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prompt, cache=cache)
        model(drafted, cache=cache)
        with pytest.raises(RuntimeError, match="activate_past_recording"):
            cache.crop(-2)
        cache = DynamicCache(config=model.config)
        cache.activate_past_recording()
        model(prompt, cache=cache)
        model(drafted, cache=cache)
        cache.crop(-2)
        cached = model(step, cache=cache).logits[0, -1]
        full = model(torch.cat([prompt, drafted[:, :1], step], dim=1)).logits[0, -1]
    assert cached.argmax() == full.argmax()
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-5)
