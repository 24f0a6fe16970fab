"""The compiled decoder's traced step functions, and their compilation.

Contract: ``DecoderGraphs`` is mixed into ``specter.compile.decoder.CompiledDecoder``, whose
constructor sets what the functions read: ``arch`` (``model_weights.Arch``), ``dtype``, ``embed``,
``inv_freq``, ``final_norm`` / ``final_norm_bias``, ``lm_head`` / ``lm_head_bias``, ``layers``
(``model_weights.LayerWeights``), ``cuda_graphs``, ``target_experts`` and, once a draft is set,
``_draft_experts`` (both ``(layer, x, top_k_index, top_k_weights) -> (y, missing or None)``).
- ``_compile_graphs(key, cpp_wrapper)``: sets the compiled functions, each on its own copy of the
  code for the layout ``key`` (``specter.compile.layout_code``): ``_target_step`` /
  ``_draft_step`` (a whole step, fused: ``(tokens, positions, kv_index, keys, values) ->
  StepOutput``, CUDA graphs where ``cuda_graphs``), and the layered path's pieces
  ``_embed_piece`` (``(tokens, positions) -> (h, cos, sin)``), ``_layer_piece``
  (``decoder_math.attention_and_route``), ``_after_piece`` (``decoder_math.after_experts``, for
  a layer with a shared expert), ``_dense_piece`` (``decoder_math.dense_layer``, a dense layer's
  MLP) and ``_head_piece`` (``h -> float32 logits [T, V]``).
- The functions are the model's forward over its weights (``decoder_math``), written so that
  dynamo traces each whole (``fullgraph=True``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from specter.compile.decoder_math import (
    after_experts, attention_and_route, dense_layer, linear, norm, rope_dtype, rope_tables,
)
from specter.compile.layout_code import per_layout
from specter.compile.parts import StepOutput


class DecoderGraphs:
    def _compile_graphs(self, key: tuple, cpp_wrapper: bool) -> None:
        # guards already pin every input's size and stride: the per-call re-checks cost ~5% of a decode step;
        # a bfloat16 / float16 model's intermediates rounded where eager rounds them (inductor keeps them
        # in float32 otherwise): tiny DeepSeek-V2 / V3 in bfloat16 then gave eager `resident`'s tokens compiled
        options = {"size_asserts": False, "alignment_asserts": False,
                   "emulate_precision_casts": self.dtype != torch.float32}
        # cpp_wrapper (measured on CPU, bundled model): draft step 15% and decode step 12% faster,
        # about 10 s more compile per fused graph; off by default to keep warm-up short
        fused_options = options | {"triton.cudagraphs": self.cuda_graphs, "cpp_wrapper": cpp_wrapper}
        fused = dict(fullgraph=True, dynamic=False, options=fused_options)
        self._target_step = torch.compile(per_layout(self._target_graph, key), **fused)
        self._draft_step = torch.compile(per_layout(self._draft_graph, key), **fused)
        pieces = dict(fullgraph=True, dynamic=False, options=options)  # the host runs between pieces
        self._embed_piece = torch.compile(per_layout(self._embed_graph, key), **pieces)
        self._layer_piece = torch.compile(per_layout(attention_and_route, key), **pieces)
        self._after_piece = torch.compile(per_layout(after_experts, key), **pieces)  # a layer with a shared expert
        self._dense_piece = torch.compile(per_layout(dense_layer, key), **pieces)  # a dense layer's MLP
        self._head_piece = torch.compile(per_layout(self._head_graph, key), **pieces)

    def _embed_graph(self, tokens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        h = F.embedding(tokens, self.embed)  # [T, H]
        cos, sin = rope_tables(self.inv_freq, positions, self.arch.rope_scaling, rope_dtype(self.arch, h.dtype))
        return h, cos, sin

    def _head_graph(self, h: Tensor) -> Tensor:
        normed = norm(self.arch, h, self.final_norm, self.final_norm_bias)
        return linear(normed, self.lm_head, self.lm_head_bias, self.arch.row_kernel).float()  # [T, V]

    def _fused(self, experts, tokens: Tensor, positions: Tensor, kv_index: Tensor,
               keys: list[Tensor], values: list[Tensor]) -> StepOutput:
        h, cos, sin = self._embed_graph(tokens, positions)
        indices, weights, inputs, missing = [], [], [], []
        for layer, w in enumerate(self.layers):
            h, x, top_k_weights, top_k_index = attention_and_route(
                self.arch, w, keys[layer], values[layer], h, cos, sin, positions, kv_index)
            if w.dense is not None:
                h = dense_layer(self.arch, w, h, x)
                continue
            y, miss = experts(layer, x, top_k_index, top_k_weights)
            h = after_experts(self.arch, w, h, x, y)
            indices.append(top_k_index)
            weights.append(top_k_weights)
            inputs.append(x)
            if miss is not None:
                missing.append(miss)
        return StepOutput(
            logits=self._head_graph(h),
            top_k_index=torch.stack(indices),
            top_k_weights=torch.stack(weights),
            expert_inputs=torch.stack(inputs),
            missing=torch.stack(missing).any() if missing else None,
        )

    def _target_graph(self, tokens, positions, kv_index, keys, values) -> StepOutput:
        return self._fused(self.target_experts, tokens, positions, kv_index, keys, values)

    def _draft_graph(self, tokens, positions, kv_index, keys, values) -> StepOutput:
        return self._fused(self._draft_experts, tokens, positions, kv_index, keys, values)
