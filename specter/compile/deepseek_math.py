"""DeepSeek-V2/V3's parts of the compiled decoder's math: what its multi-head latent attention and
grouped routers read from a model, interleaved RoPE and the grouped routers' choice (plain
functions traced by dynamo, as ``specter.compile.decoder_math``'s are, which writes the latent
attention itself over these: ``latent_queries_keys_values``).

Contract:
- ``Latent`` (frozen, part of ``model_weights.Arch``): the attention's dimensions; ``latent_of(model)``
  reads them (None for llama-style attention). ``LatentWeights`` holds one layer's projections,
  ``latent_weights_of(attention)`` reads them.
- ``rotate_pairs(x, cos, sin)``: interleaved RoPE (DeepSeek-V2's complex pairs, V3's
  ``rope_interleave``) rotates each pair and lays the rotated halves out de-interleaved, for
  queries and keys alike (their dot product is the model's); V2 rotates in float32
  (``Latent.float_rope``: the decoder's RoPE tables are then float32, ``decoder_math.rope_dtype``),
  as its complex numbers do.
- ``Groups`` (frozen, part of ``Arch``): a grouped router's constants; ``groups_of(model)``.
  ``grouped_select(groups, top_k, logits [T, E] float32, bias) -> (weights [T, k] float32, index
  [T, k])``: V2's softmax (``greedy`` or ``group_limited_greedy``) and V3's biased sigmoid over the
  best groups, both times ``routed_scaling_factor``, as the models' routers compute them.
- ``unsupported_reason(model)``: what of a DeepSeek model the math does not cover (None: all).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


@dataclasses.dataclass(frozen=True)
class Latent:
    nope_dim: int  # per head, the key/query part without position
    rope_dim: int  # the rotated part, one key for every head
    v_dim: int
    kv_rank: int
    eps: float  # the latent norms' own (transformers builds them with its default, not rms_norm_eps)
    interleaved: bool  # RoPE on consecutive pairs
    float_rope: bool  # rotated in float32 (V2's complex numbers), the tables float32 too


@dataclasses.dataclass(frozen=True)
class Groups:
    sigmoid: bool  # V3: sigmoid scores with a correction bias for the choice; V2: softmax
    n_group: int
    topk_group: int  # 0: no group limit (V2's ``greedy``)
    renormalize: bool
    scaling: float  # routed_scaling_factor


@dataclasses.dataclass
class LatentWeights:
    q: Tensor | None  # [nH * (nope + rope), H] where the model has no low-rank queries
    q_a: Tensor | None  # [q_rank, H]
    q_a_bias: Tensor | None
    q_a_norm: Tensor | None  # [q_rank]
    q_b: Tensor | None  # [nH * (nope + rope), q_rank]
    kv_a: Tensor  # [kv_rank + rope, H]
    kv_a_bias: Tensor | None
    kv_a_norm: Tensor  # [kv_rank]
    kv_b: Tensor  # [nH * (nope + v), kv_rank]


def latent_of(model: nn.Module) -> Latent | None:
    if model.config.model_type not in DEEPSEEK_MODEL_TYPES:
        return None
    config, attention = model.config, model.model.layers[0].self_attn
    return Latent(
        nope_dim=config.qk_nope_head_dim, rope_dim=config.qk_rope_head_dim, v_dim=config.v_head_dim,
        kv_rank=config.kv_lora_rank, eps=attention.kv_a_layernorm.variance_epsilon,
        interleaved=config.model_type == "deepseek_v2" or bool(getattr(config, "rope_interleave", False)),
        float_rope=config.model_type == "deepseek_v2",
    )


def latent_weights_of(attention: nn.Module) -> LatentWeights:
    low_rank = attention.q_a_proj is not None
    return LatentWeights(
        q=None if low_rank else attention.q_proj.weight,
        q_a=attention.q_a_proj.weight if low_rank else None,
        q_a_bias=attention.q_a_proj.bias if low_rank else None,
        q_a_norm=attention.q_a_layernorm.weight if low_rank else None,
        q_b=attention.q_b_proj.weight if low_rank else None,
        kv_a=attention.kv_a_proj_with_mqa.weight, kv_a_bias=attention.kv_a_proj_with_mqa.bias,
        kv_a_norm=attention.kv_a_layernorm.weight, kv_b=attention.kv_b_proj.weight,
    )


def groups_of(model: nn.Module) -> Groups | None:
    config = model.config
    if config.model_type not in DEEPSEEK_MODEL_TYPES:
        return None
    v3 = config.model_type == "deepseek_v3"
    limited = v3 or config.topk_method == "group_limited_greedy"
    return Groups(sigmoid=v3, n_group=config.n_group if limited else 1, topk_group=config.topk_group if limited else 0,
                  renormalize=v3 and bool(config.norm_topk_prob), scaling=float(config.routed_scaling_factor))


def unsupported_reason(model: nn.Module) -> str | None:
    config = model.config
    if config.model_type == "deepseek_v2" and config.topk_method not in ("greedy", "group_limited_greedy"):
        return f"router topk_method {config.topk_method!r} (supported: greedy, group_limited_greedy)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} in the dense and shared MLPs (supported: silu)"
    if model.model.rotary_emb.inv_freq.shape[0] * 2 != config.qk_rope_head_dim:
        return "rotary frequencies that do not span qk_rope_head_dim"
    return None


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on consecutive pairs ``(x0, x1), (x2, x3), ...`` of ``x [T, n, d]`` (``cos``/``sin``
    [T, 1, d] as ``decoder_math.rope_tables``: each angle twice), rotated halves de-interleaved."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * c - odd * s, odd * c + even * s), dim=-1)


def grouped_select(groups: Groups, top_k: int, logits: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """Router logits ``[T, E]`` (float32) -> (top_k_weights [T, k] float32, top_k_index [T, k])."""
    num_tokens, n_experts = logits.shape
    scores = logits.sigmoid() if groups.sigmoid else logits.softmax(dim=-1)
    choice = scores + bias if bias is not None else scores
    if groups.topk_group:
        grouped = choice.view(num_tokens, groups.n_group, n_experts // groups.n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if groups.sigmoid else grouped.max(dim=-1).values
        best = torch.topk(group_scores, k=groups.topk_group, dim=-1)[1]  # [T, topk_group]
        kept = torch.zeros_like(group_scores).scatter(1, best, 1.0).bool()  # [T, n_group]
        kept = kept[:, :, None].expand(-1, -1, n_experts // groups.n_group).reshape(num_tokens, n_experts)
        choice = choice.masked_fill(~kept, float("-inf") if groups.sigmoid else 0.0)
    index = torch.topk(choice, k=top_k, dim=-1)[1]  # [T, k]
    weights = scores.gather(1, index)
    if groups.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * groups.scaling, index
