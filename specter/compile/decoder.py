"""Compile-native decoding: the model's step functions as plain functions compiled once.

Contract:
- ``unsupported_reason(model) -> str | None`` (``specter.compile.model_weights``, what the graphs'
  model math, ``specter.compile.decoder_math``, reads; its contract lists the layer shapes it
  covers: Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, PhiMoE, DeepSeek-V2/V3 and GPT-OSS): why a model
  cannot be compiled here (None: it can).
- ``CompiledDecoder(model, experts="resident" | "cache", runtime=None, layered=False)``: the
  model's forward written against its weights (not through transformers' modules), experts from
  the layers' own stacked tensors (``resident``) or from an ``ExpertRuntime``'s device cache and,
  in draft mode, its INT4 experts (``cache``). ``forward_logits(input_ids [1, T], kv) -> fp32
  logits [T, V]`` and ``new_kv_cache()`` stand in for ``specter.decode.kv.forward_logits`` and
  ``new_kv_cache``; the ``StaticKV`` answers ``get_seq_length()`` and ``crop(-n)`` like a
  DynamicCache, so the engines' loops run unchanged.
- Paths, chosen on the host before each step:
  * fused (one graph, no host inside, ``fullgraph=True``): decode (T = 1), verification
    (2 <= T <= ``fused_max_tokens``, T a dynamic dimension) and the draft step (T = 1). Experts:
    the layer's own weights, or cache slots found by reading ``slot_table`` on the device (on a
    CPU in float32, through the native grouped kernel: each chosen expert read once for all its
    tokens; else per (token, slot) pair), or the INT4 draft experts. On a CPU the graph calls the
    host at each MoE layer (``specter.compile.host_layer``): observers see the layer, the cache
    acquires its experts (waiting only for their transfers, loading misses) and releases the
    previous layer's, and the graph reads the slot table row the host returns (for experts of at
    least ``host_layer.COMPUTES_MIN_BYTES`` the host computes them, in waves as their copies
    arrive, and the graph adds its output). Elsewhere (CUDA graphs) every transfer in flight is
    waited for first (``cache.drain``), the graph reads READY slots only and returns whether a
    needed expert was absent; then the result is discarded and the step reruns layered.
  * layered (the host between compiled pieces, once per MoE layer): a compiled attention+router
    piece per layer, then the host's experts (``ExpertRuntime.forward``: observers,
    ``cache.acquire`` loading misses, the slot math, ``release``; the layer's own experts module
    when resident), then a compiled final norm + LM head. Prefill (T > ``fused_max_tokens``, or
    any cache prefill) and cache misses take it; ``layered=True`` sends every target step there
    (for predictors that must act between layers, e.g. router lookahead) unless the fused graph
    calls the host at each layer (CPU), where they act inside it. Where that host computes the
    experts a cache target step that fits runs fused (the same waves as layered, fewer graph
    calls: design notes, stop 53). For the other cache target steps, and for draft steps without
    a ``lean_step`` (the fused draft graph against compiled attention + the eager grouped INT4
    experts), a ``PathChooser`` measures both paths and takes the faster one;
    draft steps between ``begin_draft_round()`` and ``end_draft_round(cost)`` keep one path the
    caller judges. Where ``lean_step`` is set (the eager lean draft step, on a CPU with the native
    kernels: ``attach.compile_engine``) it runs every draft step and no draft graph is compiled:
    the fused draft graph never beat it there (design notes, stop 48).
- After a fused step without host calls (draft and cache target steps under CUDA graphs) the host
  replays per layer what the eager path does inside it: observers get (layer, expert input,
  top_k_index, top_k_weights, mode); a cache target step's ``cache.acquire`` + ``release`` keep
  the cache's counters. On a CPU the draft graph tells the host each layer's routing as it runs.
- Shapes: K/V buffers [1, n_kv, max_len + 1, head_dim] per layer are allocated once and shared by
  every ``StaticKV``; a sequence holds at most ``max_len`` positions (``forward_logits`` refuses
  more). Attention reads the first ``span`` positions, ``span`` the length rounded up to
  ``span_step`` (at most ``max_len``) and a dynamic dimension (``span_step=None``, the default on
  CUDA: always ``max_len``, as CUDA graphs want). The spare position keeps every span shorter than
  the buffers: a span as long as them made dynamo specialise it (ConstraintViolationError once a
  sequence's span reached ``max_len``). Cache contents, k and sequence growth do not recompile.
- ``warm_up(max_verify_tokens, draft)`` compiles every graph on scratch inputs (touching no
  observer, cache or counter); ``stats``: its seconds, steps per path, fused-step misses, graphs
  compiled after warm-up (``late_graphs``, from dynamo's counters).
- The traced step functions and their compilation: ``specter.compile.graphs`` (mixed in).
- ``specter.compile.attach.compile_engine(engine)`` gives an engine its warmed-up decoder. On
  CUDA the fused graphs use CUDA graphs (inductor's ``triton.cudagraphs``; an H200, stop 38).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable

import torch
from torch import Tensor, nn
from torch._dynamo.utils import counters

from specter.compile.host_layer import LayerHost
from specter.compile.decoder_math import FUSED_MAX_TOKENS
from specter.compile.model_weights import (
    DEFAULT_MAX_LEN, arch_of, layer_tensors, layer_weights_of, longrope_switch, unsupported_reason,
)
from specter.compile.graphs import DecoderGraphs
from specter.compile.layout_code import layout_key
from specter.errors import SpecterError
from specter.compile.parts import (
    CompiledDraftExperts, CompileStats, OwnExperts, PathChooser, SlotExperts, StaticKV, StepOutput, _mark_static,
)

DRAFT_KEY = 0  # the PathChooser's key for draft steps (target steps are keyed by their width >= 1)
HostExperts = Callable[[int, Tensor, Tensor, Tensor], Tensor]  # (layer, x [T,H], index [T,k], weights [T,k])


class CompiledDecoder(DecoderGraphs):
    def __init__(
        self,
        model: nn.Module,
        experts: str = "resident",
        runtime=None,
        layered: bool = False,
        max_len: int | None = None,
        span_step: int | None = None,
        fused_max_tokens: int = FUSED_MAX_TOKENS,
        cuda_graphs: bool | None = None,
        cpp_wrapper: bool = False,
    ) -> None:
        if (reason := unsupported_reason(model)) is not None:
            raise SpecterError(f"compile: true cannot compile this model: {reason}; set compile: false")
        if experts not in ("resident", "cache") or (experts == "cache" and runtime is None):
            raise ValueError(f"experts must be 'resident', or 'cache' with the engine's ExpertRuntime; got {experts!r}")
        decoder = model.model
        self.model = model
        self.arch = arch_of(model)
        self.source = experts
        self.runtime = runtime
        self.cache = runtime.cache if experts == "cache" else None
        self.fused_max_tokens = fused_max_tokens
        self.stats = CompileStats()
        self.device, self.dtype = decoder.embed_tokens.weight.device, decoder.embed_tokens.weight.dtype
        self.embed = decoder.embed_tokens.weight  # [V, H]
        self.final_norm, self.final_norm_bias = decoder.norm.weight, getattr(decoder.norm, "bias", None)
        self.lm_head, self.lm_head_bias = model.lm_head.weight, model.lm_head.bias  # [V, H], [V] or None
        self.inv_freq = decoder.rotary_emb.inv_freq
        self.layers = [layer_weights_of(layer) for layer in decoder.layers]
        # the MoE layers' experts by decoder layer (DeepSeek's first layers are dense)
        self.expert_modules = {index: layer.mlp.experts for index, layer in enumerate(decoder.layers)
                               if hasattr(layer.mlp, "experts")}
        self.moe_layers = list(self.expert_modules)  # their decoder indices, in order
        first_experts = next(iter(self.expert_modules.values()))
        positions_limit = getattr(model.config, "max_position_embeddings", DEFAULT_MAX_LEN)
        self.max_len = max_len or min(positions_limit, DEFAULT_MAX_LEN)
        if decoder.rotary_emb.rope_type == "longrope" and self.max_len > longrope_switch(model):
            raise SpecterError(f"compile: longrope switches its frequencies past {longrope_switch(model)} tokens")
        self.span_step = span_step if span_step is not None or self.device.type == "cuda" else 64
        # one spare position: every span (<= max_len) stays shorter than the buffers (see Shapes)
        shape = (1, self.arch.n_kv_heads, self.max_len + 1)
        self._keys = [torch.zeros(*shape, self.arch.head_dim, dtype=self.dtype, device=self.device)
                      for _ in self.layers]
        self._values = [torch.zeros(*shape, self.arch.value_dim, dtype=self.dtype, device=self.device)
                        for _ in self.layers]
        self._kv_index = torch.arange(self.max_len, device=self.device)

        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        # a fused cache step calls the host at each layer (a CUDA graph cannot): specter.compile.host_layer
        self.host_layers = experts == "cache" and self.device.type == "cpu" and not self.cuda_graphs
        self.layered = layered and not self.host_layers  # host calls: observers act between layers in the graph
        self.layer_host = LayerHost(runtime, self.expert_modules) if self.host_layers else None
        if experts == "resident":
            self.target_experts = OwnExperts(self.expert_modules)
            self.host_experts: HostExperts = self._host_resident_experts
        else:
            self.target_experts = SlotExperts(self.cache, first_experts, host=self.layer_host)
            self.host_experts = self._host_cache_experts
        self._draft_experts: CompiledDraftExperts | None = None
        self.lean_step = None  # the eager lean draft step (attach.compile_engine): then it runs every draft step
        self.chooser = PathChooser()  # fused or layered, per width, for cache target steps

        dense = [self.embed, self.final_norm, self.final_norm_bias, self.lm_head, self.lm_head_bias, self.inv_freq]
        dense += [t for w in self.layers for t in layer_tensors(w)]
        if self.device.type == "cuda":  # CUDA graphs copy every input without a static address
            weights = list(dense)
            if self.cache is None:
                weights += [t for m in self.expert_modules.values() for t in m.parameters()]  # GPT-OSS's biases too
            else:
                weights += [self.cache.slot_table, *self.cache.slots.values()]
            _mark_static(weights + self._keys + self._values + [self._kv_index])
        slots = [self.cache.slot_table, *self.cache.slots.values()] if self.cache is not None else []
        # a cache of another size is another layout: graphs (and recompile limits) of its own, so any
        # number of budgets compiles in one process
        key = layout_key(self.arch, self.dtype, self.device, [*dense, *first_experts.parameters(), *slots], experts,
                         (self.cuda_graphs, cpp_wrapper))  # compiled under other options: graphs of their own
        self._compile_graphs(key, cpp_wrapper)  # graphs and recompile limits per layout

    # ----- public --------------------------------------------------------------------------------

    def new_kv_cache(self) -> StaticKV:
        return StaticKV(self._keys, self._values)

    def snapshot(self) -> CompileStats:
        return dataclasses.replace(self.stats)

    def report(self, since: CompileStats | None = None) -> dict:
        """Step counters since ``since`` (a ``snapshot``; all when None), warm-up seconds, settings."""
        counts = self.stats.as_dict()
        if since is not None:
            counts = {name: value if name == "warmup_s" else value - getattr(since, name)
                      for name, value in counts.items()}
        return {"enabled": True, "experts": self.source, "layered": self.layered, "max_len": self.max_len,
                "span_step": self.span_step, "cuda_graphs": self.cuda_graphs, "paths": self.chooser.as_dict(),
                **counts}

    def set_draft(self, draft: dict[int, object]) -> None:
        """The INT4 draft experts by decoder layer (the speculative engine's)."""
        self._draft_experts = CompiledDraftExperts({layer: draft[layer] for layer in self.expert_modules},
                                                   host=self.layer_host)
        if self.device.type == "cuda":
            _mark_static(t for d in self._draft_experts.draft.values()
                         for t in (d.up_packed, d.up_scales, d.down_packed, d.down_scales))

    def begin_draft_round(self) -> None:
        """Hold one draft path until ``end_draft_round(seconds_per_step)`` judges it."""
        self.chooser.begin_round(DRAFT_KEY)

    def end_draft_round(self, seconds_per_step: float) -> None:
        self.chooser.end_round(DRAFT_KEY, seconds_per_step)

    def forward_logits(self, input_ids: Tensor, kv: StaticKV) -> Tensor:
        """Run over ``input_ids`` [1, T] appending to ``kv``; fp32 logits [T, V]."""
        tokens = input_ids.reshape(-1)  # [T]
        num_tokens = tokens.shape[0]
        start = kv.length
        if start + num_tokens > self.max_len:
            raise SpecterError(
                f"compile: the sequence reaches {start + num_tokens} tokens but the static KV cache holds "
                f"{self.max_len} (the model's max_position_embeddings, at most {DEFAULT_MAX_LEN})"
            )
        graphs = counters["stats"]["unique_graphs"]
        if self.runtime is not None and self.runtime.mode == "draft":
            if num_tokens != 1:
                raise SpecterError("compile: the draft runs one token per step")
            logits = self._run_draft(tokens, start, kv)
        else:
            positions = torch.arange(start, start + num_tokens, device=self.device)  # [T]
            args = (tokens, positions, self._span(start + num_tokens), kv)
            layered = self.layered or num_tokens > self.fused_max_tokens or (start == 0 and self.source == "cache")
            logits = self._run_layered(*args) if layered else self._run_target(*args)  # a cache's prefill streams
        self.stats.late_graphs += counters["stats"]["unique_graphs"] - graphs
        kv.length = start + num_tokens
        return logits

    def warm_up(self, max_verify_tokens: int = 1, draft: bool = False) -> float:
        """Compile, on scratch inputs, the graphs of decode, verification of up to
        ``max_verify_tokens`` tokens, prefill, cache misses and (``draft``) the draft step.
        Returns the seconds taken (accumulated in ``stats.warmup_s``)."""
        started = time.perf_counter()
        kv = StaticKV(self._keys, self._values)
        fused_sizes = (1, 2, 3) if max_verify_tokens > 1 or self.source == "resident" else (1,)
        if self.layered:
            fused_sizes = ()
        layered_sizes = (2, 3, self.fused_max_tokens + 1) + ((1,) if self.source == "cache" else ())
        with torch.inference_mode():
            for num_tokens in fused_sizes:
                self._call_fused(self._target_step, *self._scratch(num_tokens), kv)
            for num_tokens in layered_sizes:
                self._layered_logits(*self._scratch(num_tokens), kv, host=self._zero_experts)
            if draft:
                for start in (0, self.span_step or 0):
                    self._call_fused(self._draft_step, *self._scratch(1, start), kv)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.warmup_s += time.perf_counter() - started
        return self.stats.warmup_s

    # ----- step paths ----------------------------------------------------------------------------

    def _span(self, end: int) -> Tensor:
        if self.span_step is None:
            return self._kv_index
        span = min(self.max_len, -(-end // self.span_step) * self.span_step)
        kv_index = self._kv_index[:span]  # [S]
        torch._dynamo.mark_dynamic(kv_index, 0)
        return kv_index

    def _scratch(self, num_tokens: int, start: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        tokens = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + num_tokens, device=self.device)
        return tokens, positions, self._span(start + num_tokens)

    def _call_fused(self, step: Callable, tokens: Tensor, positions: Tensor, kv_index: Tensor,
                    kv: StaticKV) -> StepOutput:
        if tokens.shape[0] > 1:
            torch._dynamo.mark_dynamic(tokens, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        return step(tokens, positions, kv_index, kv.keys, kv.values)

    def _run_draft(self, tokens: Tensor, start: int, kv: StaticKV) -> Tensor:
        if self._draft_experts is None:
            raise SpecterError("compile: draft mode without draft experts (CompiledDecoder.set_draft)")
        self.stats.draft_steps += 1
        if self.lean_step is not None:
            return self.lean_step.step(int(tokens[0]), kv)[None]

        def graph_inputs() -> tuple[Tensor, Tensor, Tensor]:
            return tokens, torch.arange(start, start + 1, device=self.device), self._span(start + 1)

        def fused() -> Tensor:
            if self.layer_host is None:
                out = self._call_fused(self._draft_step, *graph_inputs(), kv)
                out.replay(self.runtime, self.cache, "draft", self.moe_layers)
            else:  # the graph tells the host each layer's routing as it runs
                with self.layer_host.live():
                    out = self._call_fused(self._draft_step, *graph_inputs(), kv)
            return out.logits

        def layered() -> Tensor:  # compiled attention with the INT4 experts eagerly
            return self._layered_logits(*graph_inputs(), kv, host=self.host_experts)

        held = self.chooser.held(DRAFT_KEY)  # a round's path, judged by the engine (begin_draft_round)
        if held is not None:
            return layered() if held == "layered" else fused()
        return self._run_chosen(DRAFT_KEY, fused, layered)

    def _run_chosen(self, key: int, fused: Callable[[], Tensor], layered: Callable[[], Tensor]) -> Tensor:
        """The chooser's path for ``key``. A target step comes here only where the host does not
        compute the experts, and a path's wait is then its own: a fused step frees a layer's slots
        only at the next layer, so a streaming round's later experts copy later (design notes, stop
        47); under CUDA graphs it drains first. Where the host computes them (both paths in waves)
        the waits, the waves' hidden one (``ExpertRuntime.overlap_s``) included, are left out of a
        step's time; only draft steps without a lean step still come here then, and they wait for
        no copies."""
        hidden = (lambda: self.runtime.overlap_s) if self.runtime is not None else (lambda: 0.0)
        alike = self.layer_host is not None and self.layer_host.computes
        waited = (lambda: self.cache.stats.transfer_wait_s + hidden()) if alike else (lambda: 0.0)
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else (lambda: None)
        return self.chooser.run(key, fused, layered, waited, sync)

    def _run_target(self, tokens: Tensor, positions: Tensor, kv_index: Tensor, kv: StaticKV) -> Tensor:
        if self.cache is None:
            return self._run_fused_target(tokens, positions, kv_index, kv)
        args = (tokens, positions, kv_index, kv)
        if self.layer_host is not None and not self.layer_host.fits(tokens.shape[0]):
            return self._run_layered(*args)  # a layer might need more experts than the cache holds
        if self.layer_host is not None and self.layer_host.computes:
            return self._run_fused_target(*args)  # the same waves as layered, fewer graph calls
        return self._run_chosen(tokens.shape[0], lambda: self._run_fused_target(*args),
                                lambda: self._run_layered(*args))

    def _run_fused_target(self, tokens: Tensor, positions: Tensor, kv_index: Tensor, kv: StaticKV) -> Tensor:
        if self.cache is not None and not self.host_layers:
            self.cache.drain()
        with self.layer_host.live() if self.layer_host is not None else contextlib.nullcontext():
            out = self._call_fused(self._target_step, tokens, positions, kv_index, kv)
        if out.missing is not None and bool(out.missing):
            self.stats.fused_misses += 1
            return self._run_layered(tokens, positions, kv_index, kv)
        self.stats.fused_steps += 1
        if not self.host_layers:  # with host layers the observers and the cache saw each layer live
            out.replay(self.runtime, self.cache, "target", self.moe_layers)
        return out.logits

    def _run_layered(self, tokens: Tensor, positions: Tensor, kv_index: Tensor, kv: StaticKV) -> Tensor:
        self.stats.layered_steps += 1
        return self._layered_logits(tokens, positions, kv_index, kv, host=self.host_experts)

    def _layered_logits(self, tokens: Tensor, positions: Tensor, kv_index: Tensor, kv: StaticKV,
                        host: HostExperts) -> Tensor:
        dynamic = tokens.shape[0] > 1
        mark = torch._dynamo.mark_dynamic if dynamic else (lambda tensor, dim: None)
        mark(tokens, 0)
        mark(positions, 0)
        h, cos, sin = self._embed_piece(tokens, positions)
        for layer, w in enumerate(self.layers):
            for tensor in (h, cos, sin):
                mark(tensor, 0)
            h, x, top_k_weights, top_k_index = self._layer_piece(
                self.arch, w, kv.keys[layer], kv.values[layer], h, cos, sin, positions, kv_index)
            if w.dense is not None:  # a dense layer's MLP, dynamic in T as the layer's graph
                for tensor in (h, x):
                    mark(tensor, 0)
                h = self._dense_piece(self.arch, w, h, x)
                continue
            y = host(layer, x, top_k_index, top_k_weights)
            if w.shared is None:
                h = h + y
            else:  # the shared expert's graph, dynamic in T as the layer's
                for tensor in (h, x, y):
                    mark(tensor, 0)
                h = self._after_piece(self.arch, w, h, x, y)
        mark(h, 0)
        return self._head_piece(h)

    # ----- host experts of the layered path --------------------------------------------------------

    def _host_resident_experts(self, layer: int, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return self.expert_modules[layer](x, top_k_index, top_k_weights)

    def _host_cache_experts(self, layer: int, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return self.runtime.forward(layer, self.expert_modules[layer], x, top_k_index, top_k_weights)

    @staticmethod
    def _zero_experts(layer: int, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return torch.zeros_like(x)
