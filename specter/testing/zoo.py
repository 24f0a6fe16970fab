"""Tiny random-weight models of real MoE architectures, and where their experts live.

Contract:
- ``tiny_config(arch, ...)`` returns a valid config of that architecture's own transformers class:
  ``n_experts`` routed experts in each of ``layers`` MoE decoder layers (DeepSeek architectures add
  ``first_k_dense_replace`` dense layers in front, 1 by default), fp32, untied embeddings (as all
  these architectures ship), token ids bos=1, eos=2, pad=0, and the attention implementation
  ``sdpa`` (``eager`` for GPT-OSS, which has no sdpa path).
- ``random_model(arch_or_config, seed=0, device=None, ...)`` builds the model directly on
  ``device`` (no CPU copy first), in eval mode, seeded. Router weights are re-drawn with std
  ``1/sqrt(hidden)`` (router logits of std ~1) so that different tokens pick different experts.
  The same seed gives the same weights on the same device type.
- ``save_random_checkpoint`` writes ``save_pretrained`` output (safetensors, config.json,
  generation_config.json); ``AutoModelForCausalLM.from_pretrained`` reloads it exactly.
- ``moe_layout(model)`` finds the routed-experts modules generically: a module carrying the
  ``has_gate``/``is_transposed``/``has_bias`` flags of transformers' ``use_experts_implementation``
  decorator whose direct parameters are stacked ``[num_experts, ...]``; its router is the sibling
  with a ``weight`` of shape ``[num_experts, hidden]``; every other sibling holding parameters is a
  shared expert (or its gate). The only naming assumption: decoder layers sit in a ModuleList
  called ``layers`` (true for all architectures here).
- ``mixtral_shaped(...)`` returns a MixtralConfig of real-model size for benchmarks; pass it to
  ``random_model`` with a ``device``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    GptOssConfig,
    MixtralConfig,
    OlmoeConfig,
    PhimoeConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from specter.model.layout import moe_layers

ARCHITECTURES: tuple[str, ...] = (
    "mixtral",
    "phimoe",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
)

_HEADS = 4
_KV_HEADS = 2


@dataclass(frozen=True)
class MoELayerInfo:
    """Where one decoder layer's routed experts live and how their tensors are laid out."""

    layer: int  # decoder-layer index (dense layers are skipped, so indices may start above 0)
    block_module_name: str  # the MoE block holding router, experts and shared experts
    experts_module_name: str
    router_module_name: str
    num_experts: int
    top_k: int
    param_names: tuple[str, ...]  # stacked [num_experts, ...] parameters of the experts module
    param_shapes: dict[str, tuple[int, ...]]  # per expert, i.e. without the leading expert dim
    is_transposed: bool  # True: weights are [in, out] (x @ W); False: [out, in] (F.linear)
    has_bias: bool
    has_gate: bool  # True: gate_up_proj (gate and up fused); False: up_proj only
    is_concatenated: bool  # True: gate_up = [gate; up]; False: interleaved gate0, up0, gate1, ...
    shared_expert_module_names: tuple[str, ...]


def tiny_config(
    arch: str,
    *,
    n_experts: int = 16,
    top_k: int = 2,
    hidden: int = 64,
    intermediate: int = 64,
    layers: int = 2,
    vocab: int = 256,
    **overrides: Any,
) -> PretrainedConfig:
    """A tiny valid config of ``arch``; ``layers`` counts MoE layers, ``overrides`` win over all."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")
    if hidden % _HEADS or (hidden // _HEADS) % 2:
        raise ValueError(f"hidden={hidden} must split into {_HEADS} heads of even size")
    if arch == "phimoe" and top_k != 2:
        raise ValueError("phimoe routes with sparsemixer, which always picks exactly 2 experts")
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_attention_heads=_HEADS,
        num_key_value_heads=_KV_HEADS,
        num_experts_per_tok=top_k,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype=torch.float32,
        attn_implementation="eager" if arch == "gpt_oss" else "sdpa",
    )
    specific: dict[str, Any]
    if arch == "mixtral":
        cls = MixtralConfig
        specific = dict(num_hidden_layers=layers, num_local_experts=n_experts, intermediate_size=intermediate)
    elif arch == "phimoe":
        # Phi-3.5-MoE ships LayerNorm, biased attention projections and a biased lm_head.
        cls = PhimoeConfig
        specific = dict(
            num_hidden_layers=layers,
            num_local_experts=n_experts,
            intermediate_size=intermediate,
            attention_bias=True,
            lm_head_bias=True,
        )
    elif arch == "qwen2_moe":
        cls = Qwen2MoeConfig
        specific = dict(
            num_hidden_layers=layers,
            num_experts=n_experts,
            moe_intermediate_size=intermediate,
            intermediate_size=2 * intermediate,
            shared_expert_intermediate_size=2 * intermediate,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=False,
        )
    elif arch == "qwen3_moe":
        cls = Qwen3MoeConfig
        specific = dict(
            num_hidden_layers=layers,
            num_experts=n_experts,
            moe_intermediate_size=intermediate,
            intermediate_size=2 * intermediate,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    elif arch == "olmoe":
        cls = OlmoeConfig
        specific = dict(
            num_hidden_layers=layers, num_experts=n_experts, intermediate_size=intermediate, norm_topk_prob=False
        )
    elif arch in ("deepseek_v2", "deepseek_v3"):
        dense = int(overrides.pop("first_k_dense_replace", 1))
        n_group = 4 if n_experts % 4 == 0 and n_experts // 4 >= 2 else 1
        specific = dict(
            num_hidden_layers=layers + dense,
            first_k_dense_replace=dense,
            n_routed_experts=n_experts,
            n_shared_experts=1,
            moe_intermediate_size=intermediate,
            intermediate_size=2 * intermediate,
            n_group=n_group,
            topk_group=max(1, n_group // 2),
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=16,
            num_key_value_heads=_HEADS,
        )
        if arch == "deepseek_v3":
            cls = DeepseekV3Config
            specific.update(norm_topk_prob=True, routed_scaling_factor=2.5)
        else:
            cls = DeepseekV2Config
            specific.update(topk_method="group_limited_greedy", norm_topk_prob=False, routed_scaling_factor=1.0)
    else:
        # Sliding window smaller than typical test prompts so that the sliding layers are exercised.
        cls = GptOssConfig
        specific = dict(
            num_hidden_layers=layers,
            num_local_experts=n_experts,
            intermediate_size=intermediate,
            head_dim=hidden // _HEADS,
            sliding_window=32,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        )
    return cls(**{**common, **specific, **overrides})


def mixtral_shaped(
    layers: int = 8,
    experts: int = 8,
    hidden: int = 4096,
    intermediate: int = 14336,
    dtype: torch.dtype = torch.bfloat16,
    **overrides: Any,
) -> MixtralConfig:
    """A Mixtral-8x7B-shaped config (32 heads, 8 KV heads, 32000 vocab) with ``layers`` layers."""
    fields: dict[str, Any] = dict(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=experts,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        dtype=dtype,
        attn_implementation="sdpa",
    )
    return MixtralConfig(**{**fields, **overrides})


def random_model(
    arch: str | PretrainedConfig,
    seed: int = 0,
    device: str | torch.device | None = None,
    **config_kwargs: Any,
) -> PreTrainedModel:
    """Build a random model of ``arch`` (a name from ARCHITECTURES, or a ready config) on ``device``."""
    if isinstance(arch, PretrainedConfig):
        if config_kwargs:
            raise ValueError("config_kwargs apply only when arch is a name; edit the config instead")
        config = arch
    else:
        config = tiny_config(arch, **config_kwargs)
    dtype = config.dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if not isinstance(dtype, torch.dtype):
        dtype = torch.float32
    torch.manual_seed(seed)
    with torch.device(device if device is not None else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _randomize_routing(model)
    return model.eval()


@torch.no_grad()
def _randomize_routing(model: PreTrainedModel) -> None:
    """Re-draw router weights (std 1/sqrt(hidden)) so routing depends on the token, and give the
    tensors that transformers initialises to zero but trained checkpoints carry (DeepSeek-V3's
    score-correction bias, GPT-OSS's expert biases) small random values so their paths are live."""
    std = model.config.initializer_range
    for info in moe_layout(model):
        router = model.get_submodule(info.router_module_name)
        router.weight.normal_(0.0, 1.0 / math.sqrt(router.weight.shape[-1]))
        correction = getattr(router, "e_score_correction_bias", None)
        if isinstance(correction, torch.Tensor):
            correction.normal_(0.0, 0.05)
        experts = model.get_submodule(info.experts_module_name)
        for name in info.param_names:
            if name.endswith("_bias"):
                getattr(experts, name).normal_(0.0, std)


def save_random_checkpoint(arch: str | PretrainedConfig, path: str | Path, seed: int = 0, **kw: Any) -> Path:
    """Save ``random_model(arch, seed, **kw)`` with ``save_pretrained`` (safetensors) into ``path``."""
    path = Path(path)
    model = random_model(arch, seed=seed, **kw)
    model.save_pretrained(path)
    return path


def moe_layout(model: torch.nn.Module) -> list[MoELayerInfo]:
    """Every decoder layer with routed experts, in layer order (found by ``specter.model.layout``), with
    the layout facts tests and docs care about; every parameter-holding sibling of the experts
    module other than the router is a shared expert (or its gate)."""
    modules = dict(model.named_modules())
    found: list[MoELayerInfo] = []
    for info in moe_layers(model):
        if info.router_name is None:
            raise ValueError(f"no router (a sibling with weight [{info.num_experts}, hidden]) next to {info.experts_name!r}")
        parent_name, _, own_name = info.experts_name.rpartition(".")
        router_child = info.router_name.rpartition(".")[2]
        shared = [
            f"{parent_name}.{child_name}" for child_name, child in modules[parent_name].named_children()
            if child_name not in (own_name, router_child) and any(True for _ in child.parameters())
        ]
        module = info.experts
        params = {name: getattr(module, name) for name in info.param_names}
        found.append(
            MoELayerInfo(
                layer=info.layer,
                block_module_name=parent_name,
                experts_module_name=info.experts_name,
                router_module_name=info.router_name,
                num_experts=info.num_experts,
                top_k=info.top_k,
                param_names=info.param_names,
                param_shapes={k: tuple(p.shape[1:]) for k, p in params.items()},
                is_transposed=bool(module.is_transposed),
                has_bias=bool(module.has_bias),
                has_gate=bool(module.has_gate),
                is_concatenated=bool(getattr(module, "is_concatenated", True)),
                shared_expert_module_names=tuple(shared),
            )
        )
    return found


def save_byte_tokenizer(path: str | Path) -> Path:
    """Save next to a random checkpoint a byte-level tokenizer whose 256 ids are the 256 bytes (no
    merges, no special tokens), so text prompts work with a model of vocabulary >= 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(path)
    return Path(path)
