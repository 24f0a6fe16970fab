"""The model math of the compiled decoder: plain functions over a decoder layer's weights, written
so that dynamo traces them whole (no data-dependent Python) and inductor fuses them.

Contract: ``unsupported_reason(model)`` says why a model's layers are not of the supported shape and
what in them is missing here (None when they are: llama-style attention with optional biases, q/k
RMSNorm per head or over the whole projection, optional q/k/v clipping, RoPE whose frequencies are
fixed at load (default, linear, llama3, YaRN; longrope where the decoder's positions stay within its
short factors) and sliding window, RMSNorms or LayerNorms with biases, then gated [out, in] routed
experts without bias behind a softmax top-k router or PhiMoE's sparsemixer, optionally beside a
SiLU-gated shared expert scaled by a sigmoid gate; Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE and PhiMoE
without dense layers). ``arch_of(model)`` and ``layer_weights_of(layer)`` read the constants and
tensors the functions need; ``attention_and_route`` runs one decoder layer up to its experts,
``after_experts`` adds their output (and the shared expert's) to the residual. Shapes are given as
``# [T, H]`` comments (T tokens of this step).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specter.kernels import native_rows

FUSED_MAX_TOKENS = 17  # widest fused step (16 drafts + 1; wider rounds run layered); the row kernel's widest input

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "phimoe")
# RoPE variants whose frequencies and attention scaling transformers computes once, at load
# (``dynamic`` and ``longrope`` recompute them from the sequence length in every forward)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DEFAULT_MAX_LEN = 2048  # the compiled decoder's longest sequence unless given (at most the model's positions)
# what the compiled decoder's math lacks for each layout Specter runs eagerly
MISSING_FOR_MODEL_TYPE = {
    "deepseek_v2": "its attention is multi-head latent attention (compressed, partly rotated keys and values) "
                   "and its router picks within expert groups; the compiled math has llama-style attention and a "
                   "plain softmax top-k router",
    "deepseek_v3": "its attention is multi-head latent attention (compressed, partly rotated keys and values) "
                   "and its router is a biased sigmoid over expert groups; the compiled math has llama-style "
                   "attention and a plain softmax top-k router",
    "gpt_oss": "its attention has sinks and its experts have biases, interleaved gate/up columns and a clamped "
               "activation; the compiled math has plain attention and gated experts without bias",
}


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


@dataclasses.dataclass
class SharedExpert:
    """A shared expert beside the routed ones (Qwen2-MoE): ``sigmoid(x @ scale.T) * down(silu(gate(x))
    * up(x))``, every weight [out, in]."""
    gate: Tensor
    up: Tensor
    down: Tensor
    scale: Tensor  # [1, H]


@dataclasses.dataclass
class LayerWeights:
    input_norm: Tensor
    post_norm: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    o: Tensor
    q_bias: Tensor | None
    k_bias: Tensor | None
    v_bias: Tensor | None
    o_bias: Tensor | None
    q_norm: Tensor | None
    k_norm: Tensor | None
    router: Tensor  # [E, H]
    shared: SharedExpert | None = None
    input_norm_bias: Tensor | None = None  # LayerNorm models
    post_norm_bias: Tensor | None = None


def unsupported_reason(model: nn.Module) -> str | None:
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        missing = MISSING_FOR_MODEL_TYPE.get(config.model_type, "its layers were never written here")
        return f"model type {config.model_type!r}: {missing} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    longest = min(getattr(config, "max_position_embeddings", DEFAULT_MAX_LEN), DEFAULT_MAX_LEN)
    if rope_type == "longrope" and longest <= longrope_switch(model):
        rope_type = "default"  # its short factors, fixed at load, serve every sequence up to there
    if rope_type not in STATIC_ROPE_TYPES:
        return (f"rope type {rope_type!r}: its frequencies change with the sequence length, the compiled math "
                f"reads them once (supported: {', '.join(STATIC_ROPE_TYPES)})")
    for index, layer in enumerate(model.model.layers):
        mlp = getattr(layer, "mlp", None)
        experts = getattr(mlp, "experts", None)
        if experts is None or _router_of(mlp) is None:
            return f"decoder layer {index} has no routed experts (dense layers are not supported)"
        if not experts.has_gate or experts.is_transposed or experts.has_bias:
            return f"decoder layer {index}: only gated [out, in] experts without bias are supported"
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
    router = _router_of(model.model.layers[0].mlp)
    return Arch(
        n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads,
        head_dim=attention.head_dim,
        eps=config.rms_norm_eps,
        scaling=attention.scaling,
        rope_scaling=float(model.model.rotary_emb.attention_scaling),
        sliding_window=getattr(config, "sliding_window", None) or None,  # Qwen2-MoE writes 0 for none
        top_k=router.top_k,
        renormalize=bool(getattr(router, "norm_topk_prob", True)),
        float_scores=config.model_type == "mixtral",
        row_kernel=_row_kernel_serves(model),
        layer_norm=isinstance(model.model.norm, nn.LayerNorm),
        sparsemixer_eps=config.router_jitter_noise if config.model_type == "phimoe" else None,
        whole_qk_norm=config.model_type == "olmoe",
        clip_qkv=getattr(config, "clip_qkv", None),
    )


def _row_kernel_serves(model: nn.Module) -> bool:
    """Whether the native row kernels serve every dense projection and norm weight of the model
    (``native_rows.serves``): the compiled graphs' ``linear`` and the lean draft step read this."""
    weights = [layer_weights_of(layer) for layer in model.model.layers]
    dense = [t for w in weights for t in (w.q, w.k, w.v, w.o, w.router, w.input_norm, w.post_norm)]
    return native_rows.serves(model.model.embed_tokens.weight, model.lm_head.weight, model.model.norm.weight, *dense)


def layer_weights_of(layer: nn.Module) -> LayerWeights:
    attention = layer.self_attn
    q_norm = getattr(attention, "q_norm", None)
    k_norm = getattr(attention, "k_norm", None)
    return LayerWeights(
        input_norm=layer.input_layernorm.weight,
        post_norm=layer.post_attention_layernorm.weight,
        q=attention.q_proj.weight, k=attention.k_proj.weight,
        v=attention.v_proj.weight, o=attention.o_proj.weight,
        q_bias=attention.q_proj.bias, k_bias=attention.k_proj.bias,
        v_bias=attention.v_proj.bias, o_bias=attention.o_proj.bias,
        q_norm=q_norm.weight if q_norm is not None else None,
        k_norm=k_norm.weight if k_norm is not None else None,
        router=_router_of(layer.mlp).weight,
        shared=_shared_expert_of(layer.mlp),
        input_norm_bias=getattr(layer.input_layernorm, "bias", None),
        post_norm_bias=getattr(layer.post_attention_layernorm, "bias", None),
    )


def longrope_switch(model: nn.Module) -> int:
    """Past how many tokens a ``longrope`` model's frequencies switch to their long factors (0: not said)."""
    parameters = getattr(model.config, "rope_parameters", None) or {}
    return int(parameters.get("original_max_position_embeddings") or 0)


def _router_of(mlp: nn.Module) -> nn.Module | None:
    return getattr(mlp, "gate", None) or getattr(mlp, "router", None)  # PhiMoE names it router


def layer_tensors(w: LayerWeights) -> list[Tensor | None]:
    """Every tensor field of ``w`` (None where the layer has none), the shared expert's included."""
    tensors = [getattr(w, f.name) for f in dataclasses.fields(w) if f.name != "shared"]
    shared = [getattr(w.shared, f.name) for f in dataclasses.fields(SharedExpert)] if w.shared is not None else []
    return tensors + shared


def _shared_expert_of(mlp: nn.Module) -> SharedExpert | None:
    shared = getattr(mlp, "shared_expert", None)
    if shared is None:
        return None
    return SharedExpert(gate=shared.gate_proj.weight, up=shared.up_proj.weight, down=shared.down_proj.weight,
                        scale=mlp.shared_expert_gate.weight)


# ----- the model's math: plain functions, traced by dynamo ---------------------------------------

def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, row_kernel: bool = False) -> Tensor:
    """``F.linear`` on ``x [T, K]``. On a CPU a single row is written as multiply-and-sum, which
    inductor turns into a GEMV loop fused with its neighbours: 1.8x faster than the BLAS call
    inside a compiled graph (one thread; the 256-wide projections and the 4096x256 LM head).
    2 <= T <= ``FUSED_MAX_TOKENS`` rows (verification, short prefills) go through Specter's
    native row kernel where it serves (``row_kernel``, decided outside the graph: ``Arch``; an
    extern op reading each weight row once for all rows):
    BLAS's small-M GEMM ran 2.6-3.3x slower (one thread, weights cycled from memory: [256, 256]
    at 5 rows 68 against 26 us, the [4096, 256] LM head 896 against 338 us; ``/tmp`` script,
    2026-12-03); the same multiply-and-sum form for T > 1 measured slower inside the full step
    (inductor fused it into large kernels). Longer inputs keep BLAS."""
    if x.device.type == "cpu" and x.shape[0] == 1:
        y = (x[:, None, :] * weight[None]).sum(-1)  # [1, N]
    elif row_kernel and x.shape[0] <= FUSED_MAX_TOKENS:
        ends = torch.full((1,), x.shape[0], dtype=torch.long, device=x.device)  # one group: every row
        y = native_rows.grouped_rows(x, weight.unsqueeze(0), ends)  # [T, N]
    else:
        return F.linear(x, weight, bias)
    return y if bias is None else y + bias


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def norm(arch: Arch, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The model's norm: RMSNorm, or LayerNorm with its bias (``arch.layer_norm``)."""
    if arch.layer_norm:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, arch.eps)
    return rms_norm(x, weight, arch.eps)


def rope_tables(inv_freq: Tensor, positions: Tensor, scaling: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    freqs = positions[:, None].float() * inv_freq[None, :].float()  # [T, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, d]
    cos = (emb.cos() * scaling).to(dtype)[:, None, :]  # [T, 1, d]
    sin = (emb.sin() * scaling).to(dtype)[:, None, :]  # [T, 1, d]
    return cos, sin


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, n, d]
    return x * cos + rotated * sin


def route(arch: Arch, router: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    return select_experts(arch, linear(x, router, row_kernel=arch.row_kernel))


def select_experts(arch: Arch, logits: Tensor) -> tuple[Tensor, Tensor]:
    """Router logits [T, E] -> (top_k_weights [T, k], top_k_index [T, k]), as the model's router."""
    if arch.sparsemixer_eps is not None:
        return sparsemixer(logits, arch.sparsemixer_eps)
    probs = torch.softmax(logits.float(), dim=-1)
    top_k_weights, top_k_index = torch.topk(probs, arch.top_k, dim=-1)  # [T, k]
    if arch.renormalize:
        top_k_weights = top_k_weights / top_k_weights.sum(dim=-1, keepdim=True)
    if not arch.float_scores:
        top_k_weights = top_k_weights.to(logits.dtype)
    return top_k_weights, top_k_index


def sparsemixer(scores: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """PhiMoE's router in inference: the top expert, then the best of the rest, each weighted by a
    softmax over the experts within a relative ``2 * eps`` of its score (the others masked)."""
    weights, picks, masked = [], [], scores
    for _ in range(2):
        threshold, pick = masked.max(dim=-1, keepdim=True)  # [T, 1]
        factor = scores.abs().clamp(min=threshold)
        gates = masked.masked_fill((threshold - scores) / factor > 2 * eps, float("-inf"))
        weights.append(torch.softmax(gates, dim=-1).gather(-1, pick))
        picks.append(pick)
        masked = torch.scatter(scores, -1, pick, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(picks, dim=-1)


def queries_keys_values(
    arch: Arch, w: LayerWeights, x: Tensor, cos: Tensor, sin: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """A layer's normed input ``x [T, H]`` -> q [T, nH, d], k and v [T, nKV, d], q and k normed
    (where the model has it: per head, or over the whole projection) and rotated."""
    q = linear(x, w.q, w.q_bias, arch.row_kernel)  # [T, nH * d]
    k = linear(x, w.k, w.k_bias, arch.row_kernel)
    v = linear(x, w.v, w.v_bias, arch.row_kernel)
    q, k, v = split_heads(arch, w, q, k, v)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def split_heads(arch: Arch, w: LayerWeights, q: Tensor, k: Tensor, v: Tensor,
                rms: Callable[[Tensor, Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The projections ``[T, n * d]`` -> q [T, nH, d], k and v [T, nKV, d], q and k normed as the
    model norms them (over the whole projection before the split, or per head after it) and q, k
    and v clipped where the model clips (after the norms, before the split: OLMoE's order).
    ``rms(x, weight)``: the RMS norm to use (default: ``rms_norm`` with the model's eps)."""
    if rms is None:
        rms = lambda x, weight: rms_norm(x, weight, arch.eps)  # noqa: E731
    num_tokens = q.shape[0]
    if w.q_norm is not None and arch.whole_qk_norm:
        q, k = rms(q, w.q_norm), rms(k, w.k_norm)
    if arch.clip_qkv is not None:
        q, k, v = (t.clamp(-arch.clip_qkv, arch.clip_qkv) for t in (q, k, v))
    q = q.view(num_tokens, arch.n_heads, arch.head_dim)
    k = k.view(num_tokens, arch.n_kv_heads, arch.head_dim)
    v = v.view(num_tokens, arch.n_kv_heads, arch.head_dim)
    if w.q_norm is not None and not arch.whole_qk_norm:
        q, k = rms(q, w.q_norm), rms(k, w.k_norm)
    return q, k, v


def attention_and_route(
    arch: Arch, w: LayerWeights, keys: Tensor, values: Tensor, h: Tensor, cos: Tensor, sin: Tensor,
    positions: Tensor, kv_index: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One decoder layer up to its experts: (h after attention [T, H], expert input [T, H],
    top_k_weights [T, k], top_k_index [T, k]); writes the layer's K/V at ``positions``."""
    num_tokens = h.shape[0]
    q, k, v = queries_keys_values(arch, w, norm(arch, h, w.input_norm, w.input_norm_bias), cos, sin)
    keys[:, :, positions] = k.transpose(0, 1)[None]  # [1, nKV, T, d] into [1, nKV, L, d], in place
    values[:, :, positions] = v.transpose(0, 1)[None]
    span = kv_index.shape[0]
    mask = kv_index[None, :] <= positions[:, None]  # [T, S]
    if arch.sliding_window is not None:
        mask = mask & (positions[:, None] - kv_index[None, :] < arch.sliding_window)
    attended = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[:, :, :span], values[:, :, :span], attn_mask=mask[None, None],
        scale=arch.scaling, enable_gqa=arch.n_heads != arch.n_kv_heads,
    )  # [1, nH, T, d]
    h = h + linear(attended[0].transpose(0, 1).reshape(num_tokens, -1), w.o, w.o_bias, arch.row_kernel)  # [T, H]
    x = norm(arch, h, w.post_norm, w.post_norm_bias)  # [T, H]
    top_k_weights, top_k_index = route(arch, w.router, x)
    return h, x, top_k_weights, top_k_index


def after_experts(arch: Arch, w: LayerWeights, h: Tensor, x: Tensor, routed: Tensor,
                  project: Callable[[Tensor, Tensor], Tensor] | None = None) -> Tensor:
    """The residual ``h [T, H]`` after a layer's experts: ``h + routed``, or with a shared expert
    ``h + (routed + sigmoid(x @ scale.T) * shared(x))`` (the model's order). ``project(x, weight)``
    computes ``x @ weight.T`` (default: ``linear``)."""
    if w.shared is None:
        return h + routed
    if project is None:
        project = lambda rows, weight: linear(rows, weight, None, arch.row_kernel)  # noqa: E731
    s = w.shared
    shared = project(F.silu(project(x, s.gate)) * project(x, s.up), s.down)  # [T, H]
    return h + (routed + torch.sigmoid(project(x, s.scale)) * shared)
