"""What the compiled decoder reads from a transformers MoE model, and whether it can.

Contract: ``unsupported_reason(model)`` says why a model's layers are not of the shape
``specter.compile.decoder_math`` writes and what in them is missing there (None when they are:
llama-style attention with optional biases, q/k RMSNorm per head or over the whole projection,
optional q/k/v clipping, RoPE whose frequencies are fixed at load (default, linear, llama3, YaRN;
longrope where the decoder's positions stay within its short factors) and sliding window, RMSNorms
or LayerNorms with biases, then gated [out, in] routed experts without bias behind a softmax top-k
router or PhiMoE's sparsemixer, optionally beside a SiLU-gated shared expert scaled by a sigmoid
gate: Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE and PhiMoE without dense layers; DeepSeek-V2/V3 with
latent attention, grouped routers, unscaled shared experts and dense first layers, through
``specter.compile.deepseek_math``; GPT-OSS with attention sinks, a window per layer, a biased
top-k-then-softmax router and [in, out] experts with biases). ``arch_of(model) -> Arch`` reads the constants the math is
traced with (hashable: part of a layout's key), ``layer_weights_of(layer) -> LayerWeights`` a
decoder layer's tensors; ``layer_tensors(w)`` / ``named_layer_tensors(w)`` list every tensor of
them, their parts' included.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor, nn

from specter.compile import deepseek_math
from specter.compile.deepseek_math import Groups, Latent, LatentWeights
from specter.kernels import native_rows

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "phimoe", *deepseek_math.DEEPSEEK_MODEL_TYPES,
                         "gpt_oss")
# RoPE variants whose frequencies and attention scaling transformers computes once, at load
# (``dynamic`` and ``longrope`` recompute them from the sequence length in every forward)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DEFAULT_MAX_LEN = 2048  # the compiled decoder's longest sequence unless given (at most the model's positions)
NOT_TENSORS = ("window",)  # LayerWeights fields that are constants of the traced math


@dataclasses.dataclass(frozen=True)
class Arch:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    scaling: float
    rope_scaling: float
    sliding_window: int | None
    top_k: int
    renormalize: bool  # top-k weights divided by their sum
    float_scores: bool  # Mixtral keeps router weights in float32; Qwen3-MoE casts to the logits' dtype
    row_kernel: bool = False  # the native row kernels serve the dense projections and norms (``linear``)
    layer_norm: bool = False  # LayerNorms with biases instead of RMSNorms (PhiMoE)
    sparsemixer_eps: float | None = None  # PhiMoE's router: two experts, each from a masked softmax
    whole_qk_norm: bool = False  # q/k RMSNorm over the whole projection before the heads split (OLMoE)
    clip_qkv: float | None = None  # q, k and v clamped to +-clip_qkv after the norms (OLMoE's option)
    latent: Latent | None = None  # multi-head latent attention (DeepSeek): n_kv_heads == n_heads
    groups: Groups | None = None  # a grouped router (DeepSeek)
    softmax_after_topk: bool = False  # top-k of the (biased) logits, then a softmax over those k (GPT-OSS)
    per_layer_windows: bool = False  # each layer's own ``LayerWeights.window`` (GPT-OSS), not ``sliding_window``

    @property
    def value_dim(self) -> int:
        return self.latent.v_dim if self.latent is not None else self.head_dim


@dataclasses.dataclass
class GatedMLP:
    """``down(silu(gate(x)) * up(x))``, every weight [out, in]: a dense layer's MLP, or a shared
    expert beside the routed ones, scaled by ``sigmoid(x @ scale.T)`` where it has ``scale``
    (Qwen2-MoE) and unscaled where not (DeepSeek)."""
    gate: Tensor
    up: Tensor
    down: Tensor
    scale: Tensor | None = None  # [1, H]


@dataclasses.dataclass
class LayerWeights:
    input_norm: Tensor
    post_norm: Tensor
    q: Tensor | None  # None with latent attention
    k: Tensor | None
    v: Tensor | None
    o: Tensor
    q_bias: Tensor | None
    k_bias: Tensor | None
    v_bias: Tensor | None
    o_bias: Tensor | None
    q_norm: Tensor | None
    k_norm: Tensor | None
    router: Tensor | None  # [E, H]; None in a dense layer
    shared: GatedMLP | None = None
    input_norm_bias: Tensor | None = None  # LayerNorm models
    post_norm_bias: Tensor | None = None
    latent: LatentWeights | None = None
    score_correction: Tensor | None = None  # [E] float32: DeepSeek-V3's, for the choice only
    dense: GatedMLP | None = None  # a dense layer's MLP (DeepSeek's first layers)
    router_bias: Tensor | None = None  # [E] (GPT-OSS)
    sinks: Tensor | None = None  # [nH] attention sink logits (GPT-OSS)
    window: int | None = None  # this layer's sliding window (with ``Arch.per_layer_windows``)


def unsupported_reason(model: nn.Module) -> str | None:
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return (f"model type {config.model_type!r}: its layers were never written here "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    longest = min(getattr(config, "max_position_embeddings", DEFAULT_MAX_LEN), DEFAULT_MAX_LEN)
    if rope_type == "longrope" and longest <= longrope_switch(model):
        rope_type = "default"  # its short factors, fixed at load, serve every sequence up to there
    if rope_type not in STATIC_ROPE_TYPES:
        return (f"rope type {rope_type!r}: its frequencies change with the sequence length, the compiled math "
                f"reads them once (supported: {', '.join(STATIC_ROPE_TYPES)})")
    deepseek = config.model_type in deepseek_math.DEEPSEEK_MODEL_TYPES
    if deepseek and (reason := deepseek_math.unsupported_reason(model)) is not None:
        return reason
    if not any(getattr(layer.mlp, "experts", None) is not None for layer in model.model.layers):
        return "no decoder layer has routed experts"
    gpt_oss = config.model_type == "gpt_oss"  # its own expert layout: [in, out] with biases, read per pair
    for index, layer in enumerate(model.model.layers):
        mlp = getattr(layer, "mlp", None)
        experts = getattr(mlp, "experts", None)
        if experts is None:
            if deepseek and _gated_mlp_of(mlp) is not None:
                continue  # a dense layer
            return f"decoder layer {index} has no routed experts (dense layers only as DeepSeek's)"
        if _router_of(mlp) is None:
            return f"decoder layer {index}: no router found beside its experts"
        if not experts.has_gate or (experts.is_transposed, experts.has_bias) != (gpt_oss, gpt_oss):
            return (f"decoder layer {index}: only gated [out, in] experts without bias (GPT-OSS: [in, out] with "
                    "biases) are supported")
        if getattr(experts, "has_post_expert_norm", False):
            return f"decoder layer {index}: post-expert norm is not supported"
        shared = getattr(mlp, "shared_expert", None)
        if shared is not None and (getattr(config, "hidden_act", None) != "silu"
                                   or not hasattr(mlp, "shared_expert_gate")):
            return f"decoder layer {index}: a shared expert other than a SiLU-gated one behind a sigmoid gate"
    if getattr(config, "use_sliding_window", False) and config.model_type == "qwen2_moe":
        return "sliding attention in some layers only (use_sliding_window)"
    return None


def arch_of(model: nn.Module) -> Arch:
    config = model.config
    attention = model.model.layers[0].self_attn
    router = _router_of(next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")))
    latent = deepseek_math.latent_of(model)
    groups = deepseek_math.groups_of(model)
    gpt_oss = config.model_type == "gpt_oss"
    return Arch(
        n_heads=config.num_attention_heads,
        n_kv_heads=config.num_attention_heads if latent is not None else config.num_key_value_heads,
        head_dim=latent.nope_dim + latent.rope_dim if latent is not None else attention.head_dim,
        eps=config.rms_norm_eps,
        scaling=attention.scaling,
        rope_scaling=float(model.model.rotary_emb.attention_scaling),
        # Qwen2-MoE writes 0 for none; GPT-OSS's windows are per layer
        sliding_window=None if gpt_oss else getattr(config, "sliding_window", None) or None,
        top_k=router.top_k,
        renormalize=groups is None and not gpt_oss and bool(getattr(router, "norm_topk_prob", True)),
        float_scores=config.model_type == "mixtral" or groups is not None,
        row_kernel=_row_kernel_serves(model),
        layer_norm=isinstance(model.model.norm, nn.LayerNorm),
        sparsemixer_eps=config.router_jitter_noise if config.model_type == "phimoe" else None,
        whole_qk_norm=config.model_type == "olmoe",
        clip_qkv=getattr(config, "clip_qkv", None),
        latent=latent,
        groups=groups,
        softmax_after_topk=gpt_oss,
        per_layer_windows=gpt_oss,
    )


def _row_kernel_serves(model: nn.Module) -> bool:
    """Whether the native row kernels serve every dense projection and norm weight of the model
    (``native_rows.serves``): the compiled graphs' ``linear`` and the lean draft step read this."""
    weights = [layer_weights_of(layer) for layer in model.model.layers]
    dense = [t for w in weights for name, t in named_layer_tensors(w)
             if t is not None and "bias" not in name and name not in ("sinks", "score_correction")]
    return native_rows.serves(model.model.embed_tokens.weight, model.lm_head.weight, model.model.norm.weight, *dense)


def layer_weights_of(layer: nn.Module) -> LayerWeights:
    attention = layer.self_attn
    latent = hasattr(attention, "kv_a_proj_with_mqa")
    q_norm = getattr(attention, "q_norm", None)
    k_norm = getattr(attention, "k_norm", None)
    router = _router_of(layer.mlp) if hasattr(layer.mlp, "experts") else None
    return LayerWeights(
        input_norm=layer.input_layernorm.weight,
        post_norm=layer.post_attention_layernorm.weight,
        q=None if latent else attention.q_proj.weight, k=None if latent else attention.k_proj.weight,
        v=None if latent else attention.v_proj.weight, o=attention.o_proj.weight,
        q_bias=None if latent else attention.q_proj.bias, k_bias=None if latent else attention.k_proj.bias,
        v_bias=None if latent else attention.v_proj.bias, o_bias=attention.o_proj.bias,
        q_norm=q_norm.weight if q_norm is not None else None,
        k_norm=k_norm.weight if k_norm is not None else None,
        router=router.weight if router is not None else None,
        shared=_shared_expert_of(layer.mlp),
        input_norm_bias=getattr(layer.input_layernorm, "bias", None),
        post_norm_bias=getattr(layer.post_attention_layernorm, "bias", None),
        latent=deepseek_math.latent_weights_of(attention) if latent else None,
        score_correction=getattr(router, "e_score_correction_bias", None),
        dense=_gated_mlp_of(layer.mlp) if router is None else None,
        router_bias=getattr(router, "bias", None),
        sinks=getattr(attention, "sinks", None),
        window=getattr(attention, "sliding_window", None),
    )


def longrope_switch(model: nn.Module) -> int:
    """Past how many tokens a ``longrope`` model's frequencies switch to their long factors (0: not said)."""
    parameters = getattr(model.config, "rope_parameters", None) or {}
    return int(parameters.get("original_max_position_embeddings") or 0)


def _router_of(mlp: nn.Module) -> nn.Module | None:
    return getattr(mlp, "gate", None) or getattr(mlp, "router", None)  # PhiMoE names it router


def named_layer_tensors(w: LayerWeights) -> list[tuple[str, Tensor | None]]:
    """Every tensor field of ``w`` by name (None where the layer has none), its parts' included
    (``latent.kv_b``, ``shared.gate``, ...)."""
    named = []
    for field in dataclasses.fields(w):
        value = getattr(w, field.name)
        if dataclasses.is_dataclass(value):
            named += [(f"{field.name}.{part.name}", getattr(value, part.name)) for part in dataclasses.fields(value)]
        elif field.name not in NOT_TENSORS:
            named.append((field.name, value))
    return named


def layer_tensors(w: LayerWeights) -> list[Tensor | None]:
    """Every tensor field of ``w`` (None where the layer has none), its parts' included."""
    return [tensor for _, tensor in named_layer_tensors(w)]


def _gated_mlp_of(mlp: nn.Module) -> GatedMLP | None:
    if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")):
        return None
    return GatedMLP(gate=mlp.gate_proj.weight, up=mlp.up_proj.weight, down=mlp.down_proj.weight)


def _shared_expert_of(mlp: nn.Module) -> GatedMLP | None:
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None:  # Qwen2-MoE's, behind its sigmoid gate
        return dataclasses.replace(_gated_mlp_of(shared), scale=mlp.shared_expert_gate.weight)
    shared = getattr(mlp, "shared_experts", None)  # DeepSeek's, unscaled
    return _gated_mlp_of(shared) if shared is not None else None
