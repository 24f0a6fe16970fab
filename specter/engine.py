"""Engines: one object per (model, strategy) that turns prompts into tokens and a report.

Contract: ``build_engine(recipe)`` loads the recipe's model the way its engine needs it and
returns an ``Engine``; ``engine.generate(prompts)`` (texts or token-id lists) returns a
``GenerationResult`` with texts, token ids and the ``specter.report/1`` report. Engines:

- ``resident``: every weight on the device; the model's own experts implementation (the speed limit).
- ``ondemand``: dense weights on the device, experts in a host store, an LRU (or any policy)
  device cache of experts loaded on a miss, no prefetch (mixtral-offloading's strategy).
- ``hf-offload``: the external baseline, transformers + accelerate offloading (CUDA: experts that
  do not fit the budget stay in host memory; CPU: they go to accelerate's disk offload); built by
  ``specter.hf_offload``.

All engines share the decoding loop, metrics and report code so comparisons are fair.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from specter.cache import CacheStats
from specter.errors import BudgetError, SpecterError
from specter.experts import ExpertRuntime, install
from specter.generate import forward_logits, new_kv_cache, synchronize
from specter.loader import DTYPES, load_model, load_tokenizer, resolve_model_path
from specter.metrics import GenerationMetrics
from specter.sampling import SamplingParams, sample

ProgressCallback = Callable[[int, int, int], None]  # (prompt index, prompts, tokens so far)
TokensCallback = Callable[[int, list[int]], None]  # (prompt index, new token ids so far)
StepCallback = Callable[[list[int]], None]  # decode_prompt's hook: the new token ids so far


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecterError(f"device: {spec} requested but this torch build sees no CUDA device; use device: cpu or auto")
    return device


@dataclass
class GenerationResult:
    texts: list[str]
    token_ids: list[list[int]]
    prompt_ids: list[list[int]]
    report: dict = field(default_factory=dict)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Engine:
    """Base: owns the model and tokenizer; subclasses say how one prompt is decoded."""

    name = "base"

    def __init__(self, recipe, model, tokenizer, device: torch.device, model_path) -> None:
        self.recipe = recipe
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.model_path = model_path
        self.sampling = SamplingParams(
            temperature=recipe.sampling.temperature, top_p=recipe.sampling.top_p, top_k=recipe.sampling.top_k
        )
        self.eos_token_id = getattr(model.generation_config, "eos_token_id", None)
        if isinstance(self.eos_token_id, list):
            self.eos_token_id = self.eos_token_id[0] if self.eos_token_id else None

    # --- the model call: eager, or the compiled step functions (specter.compiled) -------------
    compiled = None  # a specter.compiled.CompiledDecoder when the recipe says compile: true

    def forward_logits(self, input_ids: torch.Tensor, kv) -> torch.Tensor:
        """The model over new token ids [1, T], appending to ``kv``: fp32 logits [T, V]."""
        if self.compiled is not None:
            return self.compiled.forward_logits(input_ids, kv)
        return forward_logits(self.model, input_ids, kv)

    def new_kv_cache(self):
        return self.compiled.new_kv_cache() if self.compiled is not None else new_kv_cache(self.model)

    # --- what subclasses provide -------------------------------------------------------------
    def prefill(self, prompt_ids: list[int], kv, generator, metrics: GenerationMetrics) -> int:
        """Run the target over the prompt; returns the first new token."""
        started = time.perf_counter()
        logits = self.forward_logits(torch.tensor([prompt_ids], device=self.device), kv)
        token = int(sample(logits[-1], self.sampling, generator))
        synchronize(self.device)
        metrics.observe_prefill(len(prompt_ids), time.perf_counter() - started)
        return token

    def decode_prompt(
        self, prompt_ids: list[int], max_new_tokens: int, generator, metrics, on_step: StepCallback | None
    ) -> list[int]:
        """Plain decoding: one target step per new token, until max_new_tokens or EOS. ``on_step``
        sees the new tokens after the prefill and after every step; an exception it raises stops
        decoding and propagates."""
        kv = self.new_kv_cache()
        token = self.prefill(prompt_ids, kv, generator, metrics)
        new_tokens = [token]
        if on_step is not None:
            on_step(new_tokens)
        while len(new_tokens) < max_new_tokens and token != self.eos_token_id:
            started = time.perf_counter()
            self.begin_round()
            logits = self.forward_logits(torch.tensor([[token]], device=self.device), kv)
            self.end_round()
            token = int(sample(logits[-1], self.sampling, generator))
            synchronize(self.device)
            metrics.observe_decode_step(1, time.perf_counter() - started)
            new_tokens.append(token)
            if on_step is not None:
                on_step(new_tokens)
        return new_tokens

    def engine_report(self) -> dict:
        """Engine-specific report fields (cache, link, budget); the base fills the rest."""
        return {}

    def begin_round(self) -> None:
        """Called before every target step (a plain decode step or a speculation round)."""

    def end_round(self) -> None:
        """Called after the target step's forward pass."""

    def reset_counters(self) -> None:
        """Forget cache/link counters (not contents) so a report covers one ``generate`` call."""

    # --- shared ------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise SpecterError(f"model: {self.model_path} ships no tokenizer; pass token ids instead of text")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            return ids or [self.tokenizer.bos_token_id or 0]
        return [int(t) for t in prompt]

    @property
    def context_length(self) -> int | None:
        """The most positions the model takes (``max_position_embeddings``), None if it says none."""
        limit = getattr(self.model.config, "max_position_embeddings", None)
        return int(limit) if isinstance(limit, int) and limit > 0 else None

    def check_context(self, prompt_ids: Sequence[int], max_new_tokens: int, label: str = "prompt") -> None:
        """Refuse, before any work, a prompt whose length plus ``max_new_tokens`` exceeds the
        model's context length (the speculative round's k draft positions are cut to fit)."""
        limit = self.context_length
        if not prompt_ids:
            raise SpecterError(f"{label}: empty after tokenisation")
        if limit is not None and len(prompt_ids) + max_new_tokens > limit:
            raise SpecterError(
                f"{label}: {len(prompt_ids)} tokens + max_new_tokens {max_new_tokens} = "
                f"{len(prompt_ids) + max_new_tokens} positions exceed the model's context length {limit}; "
                f"shorten the prompt or lower max_new_tokens"
            )

    def decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def generate(
        self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int | None = None,
        progress: ProgressCallback | None = None, *, sampling: SamplingParams | None = None,
        seed: int | None = None, on_tokens: TokensCallback | None = None,
    ) -> GenerationResult:
        """Generate for each prompt in turn. ``max_new_tokens``, ``sampling`` and ``seed`` override
        the recipe's for this call; ``on_tokens(prompt index, new ids so far)`` is called after the
        prefill and after every decoding step (streaming), and an exception it raises stops the
        call (cancellation) and propagates."""
        from specter.report import build_report

        max_new = self.recipe.max_new_tokens if max_new_tokens is None else check_max_new_tokens(max_new_tokens)
        generator = torch.Generator(device="cpu").manual_seed(self.recipe.seed if seed is None else int(seed))
        recipe_sampling, self.sampling = self.sampling, sampling or self.sampling
        metrics = GenerationMetrics()
        self.reset_counters()
        compile_before = self.compiled.snapshot() if self.compiled is not None else None
        encoded = [self.encode(prompt) for prompt in prompts]
        for index, prompt_ids in enumerate(encoded):
            self.check_context(prompt_ids, max_new, f"prompt {index + 1}")
        all_prompt_ids, all_new = [], []
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                for index, prompt_ids in enumerate(encoded):
                    on_step = self._step_hook(index, len(prompts), progress, on_tokens)
                    new_ids = self.decode_prompt(prompt_ids, max_new, generator, metrics, on_step)
                    all_prompt_ids.append(prompt_ids)
                    all_new.append(new_ids)
        finally:
            self.sampling = recipe_sampling
        metrics.wall_s = time.perf_counter() - started
        texts = [self.decode_text(ids) for ids in all_new]
        result = GenerationResult(texts=texts, token_ids=all_new, prompt_ids=all_prompt_ids)
        result.report = build_report(self, metrics, result)
        result.report["compile"] = self.compiled.report(compile_before) if self.compiled is not None else None
        return result

    @staticmethod
    def _step_hook(
        index: int, total: int, progress: ProgressCallback | None, on_tokens: TokensCallback | None
    ) -> StepCallback | None:
        if progress is None and on_tokens is None:
            return None

        def on_step(new_tokens: list[int]) -> None:
            if progress is not None:
                progress(index, total, len(new_tokens))
            if on_tokens is not None:
                on_tokens(index, new_tokens)

        return on_step

    def close(self) -> None:
        pass


def check_max_new_tokens(value) -> int:
    """The API's check of a per-call ``max_new_tokens``: an integer >= 1 (as the recipe requires)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecterError(f"max_new_tokens: must be an integer >= 1, got {value!r}")
    return value


class ResidentEngine(Engine):
    name = "resident"

    def engine_report(self) -> dict:
        from specter.layout import moe_layers

        layers = moe_layers(self.model)
        expert_tensors = [getattr(m.experts, n) for m in layers for n in m.param_names]
        expert_bytes = tensor_bytes(expert_tensors)
        dense = tensor_bytes(self.model.parameters()) + tensor_bytes(self.model.buffers()) - expert_bytes
        n_experts = sum(m.num_experts for m in layers)
        return {
            "expert_budget": {"experts": n_experts, "bytes": expert_bytes, "fraction": 1.0},
            "device_bytes": {"draft": None, "cache": expert_bytes, "dense": dense, "total": dense + expert_bytes},
        }


def subtract_stats(a: CacheStats, b: CacheStats) -> CacheStats:
    return CacheStats(**{f.name: getattr(a, f.name) - getattr(b, f.name) for f in dataclasses.fields(CacheStats)})


def add_stats(a: CacheStats, b: CacheStats) -> CacheStats:
    return CacheStats(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(CacheStats)})


class OffloadedEngine(Engine):
    """Dense weights on the device, experts in a host store, a budgeted device cache of experts."""

    name = "ondemand"

    def __init__(self, recipe, model, tokenizer, device, model_path, layers, store, cache, link) -> None:
        super().__init__(recipe, model, tokenizer, device, model_path)
        self.layers, self.store, self.cache, self.link = layers, store, cache, link
        self.runtime = ExpertRuntime(layers, cache)
        self.prefill_stats = CacheStats()
        install(model, self.runtime)

    def reset_counters(self) -> None:
        self.cache.stats = CacheStats()
        self.prefill_stats = CacheStats()

    def prefill(self, prompt_ids, kv, generator, metrics) -> int:
        before = dataclasses.replace(self.cache.stats)
        token = super().prefill(prompt_ids, kv, generator, metrics)
        self.prefill_stats = add_stats(self.prefill_stats, subtract_stats(self.cache.stats, before))
        return token

    def decode_stats(self) -> CacheStats:
        """Cache counters of the decode steps only (prefill streams experts through the slots and
        would make hit rates depend on prompt length)."""
        return subtract_stats(self.cache.stats, self.prefill_stats)

    def engine_report(self) -> dict:
        stats = self.decode_stats()
        dense = tensor_bytes(self.model.parameters()) + tensor_bytes(self.model.buffers())
        total_experts = len(self.store.layers) * self.store.n_experts
        return {
            "expert_budget": {
                "experts": self.cache.capacity,
                "bytes": self.cache.bytes,
                "fraction": self.cache.capacity / total_experts,
            },
            "device_bytes": {"draft": None, "cache": self.cache.bytes, "dense": dense, "total": dense + self.cache.bytes},
            "hit_rate": stats.hit_rate(),
            "bytes_transferred": stats.bytes_transferred + self.prefill_stats.bytes_transferred,
            "decode_bytes_transferred": stats.bytes_transferred,
            "transfer_wait_s": stats.transfer_wait_s,
            "cache": {"policy": self.recipe.offload.cache_policy.name, "decode": stats.as_dict(),
                      "prefill": self.prefill_stats.as_dict()},
        }

    def use_link(self, link) -> None:
        """Move expert bytes over ``link`` from now on (transfers in flight finish on the old one,
        which is then closed); the cache keeps its contents."""
        self.cache.drain()
        old, self.link, self.cache.link = self.link, link, link
        old.close()

    def close(self) -> None:
        self.link.close()


def make_link(recipe, device: torch.device):
    from specter.plugins import registry

    spec = recipe.offload.link
    kind = spec.kind
    if kind == "auto":
        kind = "cuda" if device.type == "cuda" else "emulated"
    if kind == "cuda" and device.type != "cuda":
        raise SpecterError(f"offload.link.kind: 'cuda' needs a CUDA device, but the device is {device}; use emulated or local")
    options = {"gbps": spec.gbps, "latency_us": spec.latency_us} if kind == "emulated" else {}
    return registry().create("link", kind, options, key="offload.link.kind")


def budget_slots(budget, n_layers: int, n_experts: int, expert_bytes: int, top_k: int) -> int:
    """Experts the ``offload.expert_budget`` buys (at most all of them); ``BudgetError`` when that
    is fewer than one decode step needs of a layer at once."""
    total = n_layers * n_experts
    slots = min(total, budget.resolve(n_layers, n_experts, expert_bytes))
    if slots < top_k:
        raise BudgetError(
            f"offload.expert_budget: {budget.describe()} gives {slots} expert slot(s) "
            f"({expert_bytes:,} bytes each), but one decode step needs {top_k} experts of a layer at once; "
            f"use at least {top_k} experts ({top_k / total:.1%} of {total}, {top_k * expert_bytes:,} bytes)"
        )
    return slots


def slots_for_budget(recipe, store, top_k: int) -> int:
    return budget_slots(recipe.offload.expert_budget, len(store.layers), store.n_experts, store.expert_bytes, top_k)


def build_engine(recipe) -> Engine:
    engine = _build_engine(recipe)
    if recipe.compile:  # compiles and warms up here, so that decode timings exclude it
        from specter.compiled import compile_engine

        compile_engine(engine)
    return engine


def _build_engine(recipe) -> Engine:
    from specter.cache import ExpertCache
    from specter.plugins import registry

    torch.set_num_threads(recipe.threads)
    torch.manual_seed(recipe.seed)
    device = resolve_device(recipe.device)
    dtype = DTYPES[recipe.dtype]
    path = resolve_model_path(str(recipe.model_path()))
    tokenizer = load_tokenizer(path, recipe.trust_remote_code)
    engine_name = recipe.engine
    common = dict(dtype=dtype, device=device, allow_pickle=recipe.allow_pickle, trust_remote_code=recipe.trust_remote_code)
    if engine_name == "resident":
        model, _, _ = load_model(path, **common)
        return ResidentEngine(recipe, model, tokenizer, device, path)
    if engine_name == "hf-offload":
        from specter.hf_offload import build_hf_offload

        return build_hf_offload(recipe, path, tokenizer, device, dtype)
    if engine_name in ("ondemand", "router-lookahead", "specter"):
        model, layers, store = load_model(path, keep_experts_on_host=True, **common)
        n_slots = slots_for_budget(recipe, store, max(m.top_k for m in layers))
        link = make_link(recipe, device)
        policy = registry().create("cache_policy", recipe.offload.cache_policy.name,
                                   recipe.offload.cache_policy.options, key="offload.cache_policy.name")
        cache = ExpertCache(store, n_slots, device, link, policy)
        parts = (recipe, model, tokenizer, device, path, layers, store, cache, link)
        if engine_name == "ondemand":
            return OffloadedEngine(*parts)
        from specter import speculative

        if engine_name == "router-lookahead":
            predictor = registry().create("predictor", "router-lookahead", {}, key="engine")
            return speculative.RouterLookaheadEngine(*parts, predictor=predictor)
        spec = recipe.speculation
        predictor = registry().create("predictor", spec.predictor.name, spec.predictor.options,
                                      key="speculation.predictor.name")
        governor = registry().create("governor", spec.governor.name, spec.governor.options,
                                     key="speculation.governor.name", k=spec.governor.k,
                                     n_experts=store.n_experts, top_k=max(m.top_k for m in layers))
        draft = speculative.build_draft(layers, store, device, spec.draft.group_size)
        return speculative.SpecterEngine(*parts, predictor=predictor, governor=governor, draft=draft)
    raise SpecterError(f"engine: {engine_name!r} is not available; available: resident, ondemand, router-lookahead, "
                       "specter, hf-offload")
