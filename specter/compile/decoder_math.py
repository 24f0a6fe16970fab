"""The model math of the compiled decoder: plain functions over a decoder layer's weights, written
so that dynamo traces them whole (no data-dependent Python) and inductor fuses them.

Contract: the functions read ``Arch`` and ``LayerWeights`` (``specter.compile.model_weights``,
which says which layouts they cover); ``attention_and_route`` runs one decoder layer up to its
experts (DeepSeek's latent attention in ``latent_queries_keys_values``, its interleaved RoPE and
grouped routers from ``specter.compile.deepseek_math``),
``after_experts`` adds their output (and the shared expert's) to the residual, ``dense_layer`` is a
dense layer's MLP. Shapes are given as ``# [T, H]`` comments (T tokens of this step).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from specter.compile.deepseek_math import grouped_select, rotate_pairs
from specter.compile.model_weights import Arch, GatedMLP, LayerWeights
from specter.kernels import native_rows

FUSED_MAX_TOKENS = 17  # widest fused step (16 drafts + 1; wider rounds run layered); the row kernel's widest input


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


def rope_dtype(arch: Arch, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the RoPE tables for a model of ``dtype``: its own, or float32 where the model
    rotates in float32 (DeepSeek-V2)."""
    return torch.float32 if arch.latent is not None and arch.latent.float_rope else dtype


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, n, d]
    return x * cos + rotated * sin


def route(arch: Arch, w: LayerWeights, x: Tensor) -> tuple[Tensor, Tensor]:
    """(top_k_weights [T, k], top_k_index [T, k]) of a layer's expert input ``x [T, H]``."""
    if arch.groups is not None:  # DeepSeek's routers score in float32
        logits = linear(x.float(), w.router.float(), row_kernel=arch.row_kernel)
        return grouped_select(arch.groups, arch.top_k, logits, w.score_correction)
    return select_experts(arch, linear(x, w.router, w.router_bias, row_kernel=arch.row_kernel))


def select_experts(arch: Arch, logits: Tensor) -> tuple[Tensor, Tensor]:
    """Router logits [T, E] -> (top_k_weights [T, k], top_k_index [T, k]), as the model's router."""
    if arch.sparsemixer_eps is not None:
        return sparsemixer(logits, arch.sparsemixer_eps)
    if arch.softmax_after_topk:
        top, top_k_index = torch.topk(logits, arch.top_k, dim=-1)  # [T, k]
        return torch.softmax(top, dim=-1), top_k_index
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


def latent_queries_keys_values(
    arch: Arch, w: LayerWeights, x: Tensor, cos: Tensor, sin: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """DeepSeek's multi-head latent attention inputs from a layer's normed input ``x [T, H]``: q, k
    [T, nH, nope + rope] and v [T, nH, v_dim] (queries through the low-rank pair or one projection;
    the compressed key/value latent normed and expanded per head; the one rotated key part
    broadcast to every head). Keys and values are kept expanded in the decoder's K/V buffers (what
    transformers expands from its latent cache at every step), so attention is plain SDPA."""
    latent, weights, num_tokens = arch.latent, w.latent, x.shape[0]
    if weights.q is not None:
        q = linear(x, weights.q, None, arch.row_kernel)
    else:
        low_rank = rms_norm(linear(x, weights.q_a, weights.q_a_bias, arch.row_kernel), weights.q_a_norm, latent.eps)
        q = linear(low_rank, weights.q_b, None, arch.row_kernel)
    q = q.view(num_tokens, arch.n_heads, latent.nope_dim + latent.rope_dim)
    q_nope, q_rope = q.split((latent.nope_dim, latent.rope_dim), dim=-1)
    compressed = linear(x, weights.kv_a, weights.kv_a_bias, arch.row_kernel)  # [T, kv_rank + rope]
    kv_latent, k_rope = compressed.split((latent.kv_rank, latent.rope_dim), dim=-1)
    kv = linear(rms_norm(kv_latent, weights.kv_a_norm, latent.eps), weights.kv_b, None, arch.row_kernel)
    kv = kv.view(num_tokens, arch.n_heads, latent.nope_dim + latent.v_dim)
    k_nope, v = kv.split((latent.nope_dim, latent.v_dim), dim=-1)
    turn = rotate_pairs if latent.interleaved else rotate
    if latent.float_rope:  # V2: float32 complex numbers
        q_rope, k_rope = q_rope.float(), k_rope.float()
    q_rope = turn(q_rope, cos, sin).to(q.dtype)
    k_rope = turn(k_rope[:, None, :], cos, sin).to(q.dtype)  # [T, 1, rope]
    q = torch.cat((q_nope, q_rope), dim=-1)
    k = torch.cat((k_nope, k_rope.expand(num_tokens, arch.n_heads, latent.rope_dim)), dim=-1)
    return q, k, v.contiguous()


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
    top_k_weights [T, k], top_k_index [T, k]; both None in a dense layer); writes the layer's K/V
    at ``positions``."""
    num_tokens = h.shape[0]
    normed = norm(arch, h, w.input_norm, w.input_norm_bias)
    if arch.latent is not None:
        q, k, v = latent_queries_keys_values(arch, w, normed, cos, sin)
    else:
        q, k, v = queries_keys_values(arch, w, normed, cos, sin)
    keys[:, :, positions] = k.transpose(0, 1)[None]  # [1, nKV, T, d] into [1, nKV, L, d], in place
    values[:, :, positions] = v.transpose(0, 1)[None]
    span = kv_index.shape[0]
    mask = kv_index[None, :] <= positions[:, None]  # [T, S]
    window = w.window if arch.per_layer_windows else arch.sliding_window
    if window is not None:
        mask = mask & (positions[:, None] - kv_index[None, :] < window)
    attended = attend(arch, q.transpose(0, 1)[None], keys[:, :, :span], values[:, :, :span], mask, w.sinks)
    h = h + linear(attended[0].transpose(0, 1).reshape(num_tokens, -1), w.o, w.o_bias, arch.row_kernel)  # [T, H]
    x = norm(arch, h, w.post_norm, w.post_norm_bias)  # [T, H]
    if w.router is None:
        return h, x, None, None
    top_k_weights, top_k_index = route(arch, w, x)
    return h, x, top_k_weights, top_k_index


def attend(arch: Arch, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, sinks: Tensor | None) -> Tensor:
    """Attention of ``q [1, nH, T, d]`` over ``keys``/``values [1, nKV, S, d]`` where ``mask [T, S]``
    -> [1, nH, T, d_v]. With ``sinks [nH]`` (GPT-OSS) each head's softmax also weighs its sink
    logit, whose share of the attention goes nowhere (written out: SDPA has no sinks)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[None, None], scale=arch.scaling,
                                              enable_gqa=arch.n_heads != arch.n_kv_heads)
    groups = arch.n_heads // arch.n_kv_heads
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = (q @ keys.transpose(-1, -2)) * arch.scaling  # [1, nH, T, S]
    scores = scores.masked_fill(~mask[None, None], float("-inf"))
    sink = sinks.view(1, -1, 1, 1).expand(1, -1, q.shape[2], 1).to(scores.dtype)
    logits = torch.cat((scores, sink), dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return probs.to(values.dtype) @ values


def after_experts(arch: Arch, w: LayerWeights, h: Tensor, x: Tensor, routed: Tensor,
                  project: Callable[[Tensor, Tensor], Tensor] | None = None) -> Tensor:
    """The residual ``h [T, H]`` after a layer's experts: ``h + routed``, or with a shared expert
    ``h + (routed + shared(x))``, the shared expert scaled by ``sigmoid(x @ scale.T)`` where it has
    a scale (the models' order). ``project(x, weight)`` computes ``x @ weight.T`` (default: ``linear``)."""
    if w.shared is None:
        return h + routed
    project = project or _projection(arch)
    shared = gated_mlp(w.shared, x, project)  # [T, H]
    if w.shared.scale is not None:
        shared = torch.sigmoid(project(x, w.shared.scale)) * shared
    return h + (routed + shared)


def dense_layer(arch: Arch, w: LayerWeights, h: Tensor, x: Tensor) -> Tensor:
    """The residual ``h [T, H]`` after a dense layer's MLP on its normed input ``x``."""
    return h + gated_mlp(w.dense, x, _projection(arch))


def _projection(arch: Arch) -> Callable[[Tensor, Tensor], Tensor]:
    """``(x, weight) -> x @ weight.T`` through ``linear`` as the model's projections go."""
    return lambda rows, weight: linear(rows, weight, None, arch.row_kernel)


def gated_mlp(mlp: GatedMLP, x: Tensor, project: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    return project(F.silu(project(x, mlp.gate)) * project(x, mlp.up), mlp.down)
