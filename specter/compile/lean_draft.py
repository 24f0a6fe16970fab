"""The draft's one-token step written over the model's weights, for eager speculative rounds.

Contract: ``use_lean_draft(engine)`` gives a ``specter`` engine a lean step where its model allows
(the composition root calls it, before compiling): an eager engine drafts with it; so does a
compiled one on a CPU (native kernels serving; ``specter.compile.attach``), with no compiled draft
graph; returns whether it did. ``LeanDraftStep.build(model, runtime)`` returns a step for models
whose decoder ``specter.compile.decoder_math`` writes with RMSNorms (Mixtral, Qwen3-MoE, OLMoE,
Qwen2-MoE without dense layers; not PhiMoE's LayerNorms, DeepSeek's latent attention nor GPT-OSS's
sinks) and no sliding window, every decoder layer served by ``runtime``; otherwise None, and
``unsupported_reason(model, runtime)`` says why.
``step(token, kv)`` runs one token id through every layer, appends its K/V to ``kv`` at the
positions the model's own forward would (a transformers cache, or the compiled decoder's
``StaticKV``, written in place, its length advanced), computes the routed experts through
``runtime.forward`` (in draft mode: the INT4 experts) or inside the layer's one native call
(``fused_layers``, below), the observers seeing each layer's (layer, expert input, top_k_index,
top_k_weights, mode) as from the model's forward, and returns fp32 logits [V] (``logits=False``:
None, without the LM head or the last layer's experts, whose routing the observers still see, for
the routing-only step). ``step(token, kv, ahead=i)`` (the engines' rounds: i = 0, 1, ...) leaves a
transformers cache as it was and holds the round's K/V beside it, where the native layer half serves
(below); a cache's ``update`` copies the whole cache a layer a step (widened model, 50% on
``local``, k = 8, eight runs each way toggled in one process: draft step 2.71 against 2.80 ms, 119.6
against 118.4 tok/s; the copy grows with the context).

Why: a draft step through transformers' modules spends most of its non-expert time dispatching
modules, building masks and position ids for one token; this step does only the tensor math. On the
widened model (one thread, ``python scripts/draft_step_parts.py``, two runs) an engine's draft step
took 13.1-13.9 ms through the model's forward and 10.6-11.6 ms here, same logits. Only the draft
runs it: its tokens are proposals the target verifies, so a rounding difference could cost
acceptance but never change an emitted token; verification always runs the model's own forward. On a
CPU in float32, for models without attention biases, clipping or shared experts whose q/k norms (if
any) are per head (``native_layers``), a layer's attention half is two native calls around the K/V
append (``native_rows.draft_qkv``: the input norm, q, k and v, per-head norms, rotation;
``native_rows.draft_attend_route``: one query attending the cache, o, the residual, the
post-attention norm, the router and its top-k), where it was some 25 PyTorch ops: widened model, one
thread, an eager engine toggled per run in one process, eight runs each (``/tmp`` script,
2026-12-05), 50% on ``local``, k = 8: draft step 2.79 against 3.11 ms, 116.8 against 112.5 tok/s;
25% on ``local``, k = 4: 2.76 against 3.12 ms, 100.2 against 96.4 tok/s; every run faster. Where the
step's K/V go to the compiled decoder's static cache or beside a transformers cache (``ahead``) and
the layer's INT4 draft experts are the native kernel's one-token form (``fused_token``), the whole
layer is one native call (``native_rows.draft_layer``: those two calls, the K/V write, the experts
and the residual; the same bits; the observers hear the layer right after it; ``fused_layers``):
widened model, 50% on ``local``, k = 4, one thread, the same engines toggled per run in one process,
four runs each way (``/tmp`` script, 2026-12-05): compiled draft step 2.42 against 2.67 ms, 103.3
against 101.7 tok/s (0.964x against 0.949x compiled ``resident``); eager 2.48 against 2.66 ms, 98.1
against 97.3 tok/s. Otherwise each norm goes with the projections that read its output into one
native call (``native_rows.normed_rows``: the input norm with q, k and v, the post-attention norm
with the router, the final norm with the LM head; the target's own weights, [out, in]), o through
the native row kernel (``native_rows.grouped_rows``), and q and k rotate in three ops (``_rope``).
Against the previous step (each norm and projection its own op, o and the projections on the row
kernel, ``rotate``'s slices and cat), the same engine, one thread, rounds of five steps alternating
in one process with 256 MiB swept before each: 3.44 against 3.98 ms a step (medians of 100 rounds
each; ``/tmp`` script, 2026-12-03). The router's narrow weight rides in its norm's call; alone, a
weight under ``NATIVE_MIN_ROWS`` rows stays on ``F.linear`` (faster there: stop 27's measurement of
the router by itself)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specter.compile.parts import StaticKV
from specter.compile.decoder_math import after_experts, rms_norm, rope_tables, select_experts, split_heads
from specter.compile.model_weights import arch_of, layer_weights_of, unsupported_reason as decoder_unsupported
from specter.kernels import native_rows

NATIVE_MIN_ROWS = 64  # ``project``: narrower weights are faster through F.linear


def unsupported_reason(model: nn.Module, runtime) -> str | None:
    """Why ``LeanDraftStep`` cannot run this model's draft (None: it can)."""
    reason = decoder_unsupported(model)
    if reason is not None:
        return reason
    arch = arch_of(model)
    if arch.sliding_window is not None:
        return "a sliding attention window"
    if arch.layer_norm:
        return "LayerNorms (the lean step norms by RMS)"
    if arch.per_layer_windows or arch.softmax_after_topk:
        return "attention sinks, per-layer windows and a top-k-then-softmax router (GPT-OSS)"
    if arch.latent is not None or arch.groups is not None:
        return "latent attention and grouped routers (the lean step attends and routes as llama-style models do)"
    missing = [i for i in range(len(model.model.layers)) if i not in runtime.layers]
    if missing:
        return f"decoder layers {missing} are not served by the expert runtime"
    return None


class LeanDraftStep:
    def __init__(self, model: nn.Module, runtime) -> None:
        decoder = model.model
        self.arch = arch_of(model)
        self.weights = [layer_weights_of(layer) for layer in decoder.layers]
        self.experts = [runtime.layers[i].experts for i in range(len(self.weights))]
        self.runtime = runtime
        self.embed = decoder.embed_tokens.weight  # [V, H]
        self.final_norm = decoder.norm.weight
        self.lm_head, self.lm_head_bias = model.lm_head.weight, model.lm_head.bias  # [V, H]
        self.inv_freq = decoder.rotary_emb.inv_freq
        self._cos = self._sin = self.embed.new_empty(0)  # rope tables [positions, 1, head_dim], grown on demand
        self.native_rows = self.arch.row_kernel  # the native row kernels serve every projection and norm
        # a layer's attention half in two native calls (no biases, q/k norms per head if any, no
        # clipping, no shared expert, which the native layer would leave out: other models keep
        # the op-by-op path)
        plain = not self.arch.whole_qk_norm and self.arch.clip_qkv is None and self.arch.sparsemixer_eps is None
        plain = plain and all(w.shared is None for w in self.weights)
        self.native_layers = self.native_rows and plain and all(
            w.q_bias is None and w.k_bias is None and w.v_bias is None and w.o_bias is None
            and native_rows.layer_serves(self.embed, self.arch.head_dim, w.input_norm, w.q, w.k, w.v, w.o, w.router)
            for w in self.weights)
        self.fused_layers = self.native_layers  # a layer's attention half and INT4 experts in one native call
        self._one_row = torch.ones(1, dtype=torch.long)  # the row groups' ends: one group of one row
        self._beside: list[tuple[Tensor, Tensor] | None] = [None] * len(self.weights)  # see ``step(ahead=)``

    def project(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """``F.linear(x, weight, bias)`` for one row ``x [1, K]``, through the native row kernel
        where it serves (see the module docstring)."""
        if not self.native_rows or weight.shape[0] < NATIVE_MIN_ROWS:
            return F.linear(x, weight, bias)
        y = native_rows.grouped_rows(x, weight.unsqueeze(0), self._one_row)
        return y if bias is None else y + bias

    def _project(self, x: Tensor, weight: Tensor) -> Tensor:
        return self.project(x, weight, None)

    @classmethod
    def build(cls, model: nn.Module, runtime) -> LeanDraftStep | None:
        return cls(model, runtime) if unsupported_reason(model, runtime) is None else None

    def _rope(self, position: int) -> tuple[Tensor, Tensor]:
        """cos and the signed sin at ``position`` [1, 1, d]: rotating x is ``x * cos +
        x.roll(d/2) * signed_sin`` (signed_sin = [-sin, sin] halves: ``rotate``'s
        ``cat(-x2, x1) * sin``, without the slices and the cat)."""
        if position >= self._cos.shape[0]:
            positions = torch.arange(max(2 * position, 256), device=self.inv_freq.device)
            self._cos, sin = rope_tables(self.inv_freq, positions, self.arch.rope_scaling, self.embed.dtype)
            half = sin.shape[-1] // 2
            self._sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return self._cos[position : position + 1], self._sin[position : position + 1]  # [1, 1, d]

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:
        if x.dtype == torch.float32:  # one op; the model's RMSNorm is the same math in float32
            return F.rms_norm(x, (x.shape[-1],), weight, self.arch.eps)
        return rms_norm(x, weight, self.arch.eps)

    def _norm_project(self, h: Tensor, norm_weight: Tensor, weights: list[Tensor],
                      biases: list[Tensor | None]) -> tuple[Tensor, list[Tensor]]:
        """The RMS-normed row ``h [1, H]`` and each weight on it (plus its bias): one native call
        (``native_rows.normed_rows``) where the kernel serves."""
        if self.native_rows:
            x, joined = native_rows.normed_rows(h, norm_weight, self.arch.eps, weights)
            outs = list(joined.split([w.shape[0] for w in weights], dim=-1)) if len(weights) > 1 else [joined]
        else:
            x = self._norm(h, norm_weight)
            outs = [F.linear(x, w) for w in weights]
        return x, [y if b is None else y + b for y, b in zip(outs, biases)]

    def _queries_keys_values(self, w, h: Tensor, cos: Tensor, signed_sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``decoder_math.queries_keys_values`` for one row, the input norm included: ``h [1, H]``
        -> q [1, nH, d], k and v [1, nKV, d], normed where the model norms them, q and k
        rotated."""
        arch = self.arch
        _, (q, k, v) = self._norm_project(h, w.input_norm, [w.q, w.k, w.v], [w.q_bias, w.k_bias, w.v_bias])
        q, k, v = split_heads(arch, w, q, k, v, self._norm)
        half = arch.head_dim // 2
        q = torch.addcmul(q * cos, q.roll(half, -1), signed_sin)
        k = torch.addcmul(k * cos, k.roll(half, -1), signed_sin)
        return q, k, v

    def _native_attention(self, layer: int, w, h: Tensor, cos: Tensor, signed_sin: Tensor, kv, position: int,
                          static: bool, ahead: int | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """A layer's attention half through ``native_rows.draft_qkv`` and ``draft_attend_route``,
        the K/V written between them (into ``kv``, or beside it at ``ahead``: see ``step``): (h
        after attention [1, H], expert input [1, H], top_k_weights [1, k], top_k_index [1, k])."""
        arch = self.arch
        q, k, v = native_rows.draft_qkv(h, w.input_norm, w.q, w.k, w.v, w.q_norm, w.k_norm, cos.view(-1),
                                        signed_sin.view(-1), arch.head_dim, arch.eps)  # [nH, d], [nKV, d] x 2
        if static or ahead is not None:
            (write_keys, write_values, index), (keys, values, length), more = self._kv_places(
                layer, kv, position, static, ahead)
            _write_at(write_keys, write_values, index, k, v)
        else:
            keys, values = kv.update(k[None, :, None], v[None, :, None], layer)  # [1, nKV, L, d]
            length, more = position + 1, None
        return native_rows.draft_attend_route(q, keys, values, length, h, w.o, w.post_norm, w.router, arch.eps,
                                              arch.scaling, arch.top_k, arch.renormalize, more=more)

    def _kv_places(self, layer: int, kv, position: int, static: bool,
                   ahead: int | None) -> tuple[tuple[Tensor, Tensor, int], tuple[Tensor, Tensor, int],
                                               tuple[Tensor, Tensor, int] | None]:
        """Where a step's K/V go and what it attends, on the compiled decoder's static cache
        (``static``) or beside a transformers cache (``ahead``): (write = (keys, values, position),
        cache = (keys, values, length), more = (keys, values, length) or None); the written
        position lies inside cache or more."""
        if static:
            keys, values = kv.keys[layer], kv.values[layer]
            return (keys, values, position), (keys, values, position + 1), None
        beside_keys, beside_values = self._beside_kv(layer, ahead + 1)
        cached = kv.layers[layer]
        return ((beside_keys, beside_values, ahead), (cached.keys, cached.values, position - ahead),
                (beside_keys, beside_values, ahead + 1))

    def _fused_int4(self, layer: int):
        """The runtime's INT4 draft experts of ``layer`` where ``native_rows.draft_layer`` can
        compute them (one token's SiLU-gated sum in one native call), else None."""
        experts = self.runtime.draft.get(layer) if self.runtime.mode == "draft" else None
        return experts if getattr(experts, "fused_token", False) else None

    def _native_layer(self, layer: int, w, int4, h: Tensor, cos: Tensor, signed_sin: Tensor, kv, position: int,
                      static: bool, ahead: int | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """A whole layer through ``native_rows.draft_layer`` (K/V written as ``_native_attention``
        writes them, the INT4 experts added to the residual): (h after the layer [1, H], expert
        input [1, H], top_k_weights [1, k], top_k_index [1, k])."""
        arch = self.arch
        write, cache, more = self._kv_places(layer, kv, position, static, ahead)
        return native_rows.draft_layer(
            h, w.input_norm, w.q, w.k, w.v, w.q_norm, w.k_norm, cos.view(-1), signed_sin.view(-1), arch.head_dim,
            arch.eps, write, cache, more, w.o, w.post_norm, w.router, arch.scaling, arch.top_k, arch.renormalize,
            *int4.glu_token_weights)

    def _op_attention(self, layer: int, w, h: Tensor, cos: Tensor, signed_sin: Tensor, kv, position: int,
                      static: bool, ahead: int | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """A layer's attention half op by op (models ``native_layers`` does not serve; ``ahead`` is
        then always None): what ``_native_attention`` returns, the K/V appended to ``kv``."""
        arch = self.arch
        q, k, v = self._queries_keys_values(w, h, cos, signed_sin)
        if static:  # the compiled decoder's buffers [1, nKV, max_len, d]: write in place
            keys, values = _write_at(kv.keys[layer], kv.values[layer], position, k, v)
            keys, values = keys.narrow(2, 0, position + 1), values.narrow(2, 0, position + 1)
        else:
            keys, values = kv.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], layer)  # [1, nKV, L, d]
        attended = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys, values, scale=arch.scaling,
            enable_gqa=arch.n_heads != arch.n_kv_heads,
        )  # [1, nH, 1, d]: one query attends every cached position
        h = h + self.project(attended.reshape(1, -1), w.o, w.o_bias)
        x, (router_logits,) = self._norm_project(h, w.post_norm, [w.router], [None])
        top_k_weights, top_k_index = select_experts(arch, router_logits)  # [1, k]
        return h, x, top_k_weights, top_k_index

    def _beside_kv(self, layer: int, positions: int) -> tuple[Tensor, Tensor]:
        """The layer's K/V buffers [1, nKV, >= positions, d] for a round's own positions, grown
        (keeping what they hold) when a round drafts further than before."""
        held = self._beside[layer]
        if held is None or held[0].shape[2] < positions:
            shape = (1, self.arch.n_kv_heads, max(2 * positions, 16), self.arch.head_dim)
            grown = (self.embed.new_empty(shape), self.embed.new_empty(shape))
            if held is not None:
                for new, old in zip(grown, held):
                    new[:, :, : old.shape[2]].copy_(old)
            held = self._beside[layer] = grown
        return held

    def step(self, token: int, kv, logits: bool = True, ahead: int | None = None) -> Tensor | None:
        """One token through the model, draft experts and all: fp32 logits [V]; appends to ``kv``.
        ``logits=False`` (a step run for its routing only) skips the final norm and LM head and
        the last layer's experts (the observers still hear its routing) and returns None.
        ``ahead`` (a round's step index, 0, 1, ... in turn; taken with a transformers cache and
        ``native_layers``): the token sits ``ahead`` positions past ``kv``'s end, the round's
        earlier steps' K/V are held beside ``kv`` and this step's joins them; ``kv`` is left as it
        was (appending copied the whole cache a layer a step)."""
        position = kv.get_seq_length()
        static = isinstance(kv, StaticKV)
        if static or not self.native_layers or position == 0:
            ahead = None
        if ahead is not None:
            position += ahead
        cos, sin = self._rope(position)
        h = self.embed[token][None]  # [1, H]
        last = len(self.weights) - 1
        attention = self._native_attention if self.native_layers else self._op_attention
        fused = self.fused_layers and (static or ahead is not None)
        for layer, w in enumerate(self.weights):
            int4 = self._fused_int4(layer) if fused and (logits or layer < last) else None
            if int4 is not None:  # the whole layer in one call; the observers hear it after
                h, x, top_k_weights, top_k_index = self._native_layer(layer, w, int4, h, cos, sin, kv, position,
                                                                      static, ahead)
                self.runtime.notify(layer, x, top_k_index, top_k_weights)
                continue
            h, x, top_k_weights, top_k_index = attention(layer, w, h, cos, sin, kv, position, static, ahead)  # [1, k]
            if layer == last and not logits:  # its experts' output feeds nothing a routing-only step returns
                self.runtime.notify(layer, x, top_k_index, top_k_weights)
            else:
                routed = self.runtime.forward(layer, self.experts[layer], x, top_k_index, top_k_weights)
                h = after_experts(self.arch, w, h, x, routed, self._project)
        if static:
            kv.length = position + 1
        if not logits:
            return None
        _, (logits_row,) = self._norm_project(h, self.final_norm, [self.lm_head], [self.lm_head_bias])
        return logits_row[0].float()


def _write_at(keys: Tensor, values: Tensor, position: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """One position's K and V ([nKV, d] or [1, nKV, d]) written into K/V buffers [1, nKV, L, d],
    in place (one view op each: indexing took four); returns the buffers."""
    keys.select(2, position).copy_(k)
    values.select(2, position).copy_(v)
    return keys, values


def use_lean_draft(engine) -> bool:
    """Give a drafting (``specter``) engine the lean step where its model allows
    (``engine.lean_draft``); whether it did. Called before compiling: ``compile_engine`` hands the
    step to the compiled decoder where the native kernels serve it (on a CPU), which then drafts
    with it instead of a compiled draft graph."""
    if not hasattr(engine, "lean_draft"):
        return False
    engine.lean_draft = LeanDraftStep.build(engine.model, engine.runtime)
    return engine.lean_draft is not None
