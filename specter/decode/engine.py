"""Engines: one object per (model, strategy) that turns prompts into tokens and a report.

Contract: ``build_engine(recipe)`` loads the recipe's model the way its engine needs it and
returns an ``Engine``; ``engine.generate(prompts)`` (a list of texts or token-id lists) returns a
``GenerationResult`` with texts, token ids and the ``specter.report/1`` report, one entry per prompt
(none for an empty list); its arguments are checked once, before any decoding
(``specter.decode.prompt_check``): a misuse raises ``SpecterError`` naming the argument.
``close()`` (or leaving ``with engine:``) stops its link's copy thread (a second call does no
harm); afterwards ``generate`` / ``generate_by_prompt`` raise ``SpecterError`` ("... engine is
closed"), whichever class's ``close()`` ran (a subclass's own is wrapped to mark it). Engines:

- ``resident``: every weight on the device (the speed limit); on a CPU its experts run through the
  same grouped kernel as the offloaded engines' slots (``specter.kernels.grouped_experts``) where
  the layout allows, else the model's own experts implementation.
- ``ondemand``: dense weights on the device, experts in a host store, an LRU (or any policy)
  device cache of experts loaded on a miss, no prefetch (mixtral-offloading's strategy).
- ``hf-offload``: the external baseline, transformers + accelerate offloading (CUDA: experts that
  do not fit the budget stay in host memory; CPU: they go to accelerate's disk offload); built by
  ``specter.decode.hf_offload``.

All engines share the decoding loop, metrics and report code so comparisons are fair. The prompt
side (tokenising, the context length, the end-of-sequence ids) is ``specter.decode.prompt_io``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Sequence

import torch

from specter.memory.stats import CacheStats
from specter.errors import SpecterError
from specter.experts.runtime import ExpertRuntime, install, use_grouped_kernel
from specter.model.expert_layout import is_blocked
from specter.decode.kv import forward_logits, new_kv_cache, synchronize
from specter.decode.prompt_check import check_generate_args
from specter.decode.prompt_io import PromptIO, eos_ids
from specter.report.metrics import GenerationMetrics
from specter.decode.sampling import SamplingParams, sample

ProgressCallback = Callable[[int, int, int], None]  # (prompt index, prompts, tokens so far)
TokensCallback = Callable[[int, list[int]], None]  # (prompt index, new token ids so far)
StepCallback = Callable[[list[int]], None]  # decode_prompt's hook: the new token ids so far


class StopDecoding(Exception):
    """Raised by an ``on_tokens`` callback to end the current prompt where it is (a stop
    sequence matched): its tokens so far are kept and the call goes on, report included."""


@dataclass
class GenerationResult:
    texts: list[str]
    token_ids: list[list[int]]
    prompt_ids: list[list[int]]
    report: dict = field(default_factory=dict)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Engine(PromptIO):
    """Base: owns the model and tokenizer; subclasses say how one prompt is decoded."""

    name = "base"
    compilable = False  # whether specter.compile can run its steps (its model math is the model's own)
    closed = False  # set by close() (any class's): generate then refuses

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "close" in cls.__dict__:  # a subclass's own close() marks the engine closed too
            cls.close = _marking_closed(cls.__dict__["close"])

    def __init__(self, recipe, model, tokenizer, device: torch.device, model_path) -> None:
        self.recipe = recipe
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.model_path = model_path
        self.sampling = SamplingParams(
            temperature=recipe.sampling.temperature, top_p=recipe.sampling.top_p, top_k=recipe.sampling.top_k
        )
        self.eos_token_ids = eos_ids(model.generation_config)

    # --- the model call: eager, or the compiled step functions (specter.compile.decoder) -------------
    compiled = None  # a specter.compile.decoder.CompiledDecoder when the recipe says compile: true

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
        """The one decoding loop of every engine: prefill, then rounds (``decode_round``) until
        max_new_tokens or an end-of-sequence token (any of ``eos_token_ids``). ``on_step`` sees the
        new tokens after the prefill and after every round; ``StopDecoding`` from it ends this
        prompt with the tokens so far, any other exception stops decoding and propagates."""
        kv = self.new_kv_cache()
        self.start_prompt()
        token = self.prefill(prompt_ids, kv, generator, metrics)
        new_tokens = [token]
        if on_step is not None and self._stopped_by(on_step, new_tokens):
            return new_tokens
        eos = self.eos_token_ids
        while len(new_tokens) < max_new_tokens and token not in eos:
            started = time.perf_counter()
            emitted = self.decode_round(token, kv, generator, metrics, max_new_tokens - len(new_tokens),
                                        prompt_ids + new_tokens)
            end = next((i for i, t in enumerate(emitted) if t in eos), None)
            if end is not None:
                emitted = emitted[: end + 1]
            emitted = emitted[: max_new_tokens - len(new_tokens)]
            synchronize(self.device)
            metrics.observe_decode_step(len(emitted), time.perf_counter() - started)
            new_tokens.extend(emitted)
            token = new_tokens[-1]
            if on_step is not None and self._stopped_by(on_step, new_tokens):
                break
        return new_tokens

    @staticmethod
    def _stopped_by(on_step: StepCallback, new_tokens: list[int]) -> bool:
        try:
            on_step(new_tokens)
        except StopDecoding:
            return True
        return False

    def start_prompt(self) -> None:
        """A new prompt begins (predictors that track positions start over)."""

    def decode_round(self, token: int, kv, generator, metrics, remaining: int, context: list[int]) -> list[int]:
        """One round after ``token`` (the last committed token; ``context`` is every token so
        far): the tokens it emits, at least one. Plain decoding: one target step."""
        self.begin_round()
        logits = self.forward_logits(torch.tensor([[token]], device=self.device), kv)
        self.end_round()
        return [int(sample(logits[-1], self.sampling, generator))]

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
    def generate(
        self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int | None = None,
        progress: ProgressCallback | None = None, *, sampling: SamplingParams | None = None,
        seed: int | None = None, on_tokens: TokensCallback | None = None,
    ) -> GenerationResult:
        """Generate for each prompt in turn. ``max_new_tokens``, ``sampling`` and ``seed`` override
        the recipe's for this call; ``on_tokens(prompt index, new ids so far)`` is called after the
        prefill and after every decoding step (streaming): ``StopDecoding`` from it ends that
        prompt there (its tokens so far are its result), any other exception stops the call
        (cancellation) and propagates."""
        steps = self.generate_by_prompt(prompts, max_new_tokens, progress, sampling=sampling, seed=seed,
                                        on_tokens=on_tokens)
        while True:
            try:
                next(steps)
            except StopIteration as finished:
                return finished.value

    def generate_by_prompt(
        self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int | None = None,
        progress: ProgressCallback | None = None, *, sampling: SamplingParams | None = None,
        seed: int | None = None, on_tokens: TokensCallback | None = None,
    ) -> Generator[int, None, GenerationResult]:
        """``generate`` one prompt at a time: a generator that yields a prompt's index once it is
        decoded, for every prompt but the last; after the last prompt it yields nothing more and
        returns the ``GenerationResult`` (``StopIteration.value``), whose report covers every
        prompt. So n prompts give n - 1 yields (none for one prompt or an empty list). The caller
        may run other work between prompts (the bench interleaves engines prompt by prompt);
        ``wall_s`` counts only the time spent inside this call. The arguments are checked (and text
        prompts tokenised) when it is called, before the generator is returned; a closed engine
        is refused then and before each prompt."""
        self._refuse_if_closed()
        encoded, max_new, sampling, seed = check_generate_args(self, prompts, max_new_tokens, progress,
                                                               sampling, seed, on_tokens)
        return self._decode_by_prompt(encoded, max_new, progress, sampling, seed, on_tokens)

    def _decode_by_prompt(self, encoded: list[list[int]], max_new: int, progress, sampling, seed: int,
                          on_tokens) -> Generator[int, None, GenerationResult]:
        from specter.report.schema import build_report

        generator = torch.Generator(device=self.device).manual_seed(seed)
        metrics = GenerationMetrics()
        self.reset_counters()
        compile_before = self.compiled.snapshot() if self.compiled is not None else None
        all_new = []
        for index, prompt_ids in enumerate(encoded):
            self._refuse_if_closed()  # closed between two prompts
            started = time.perf_counter()
            recipe_sampling, self.sampling = self.sampling, sampling or self.sampling
            try:
                with torch.inference_mode():
                    on_step = self._step_hook(index, len(encoded), progress, on_tokens)
                    all_new.append(self.decode_prompt(prompt_ids, max_new, generator, metrics, on_step))
            finally:
                self.sampling = recipe_sampling
                metrics.wall_s += time.perf_counter() - started
            if index + 1 < len(encoded):
                yield index
        texts = [self.decode_text(ids) for ids in all_new]
        result = GenerationResult(texts=texts, token_ids=all_new, prompt_ids=encoded)
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

    def _refuse_if_closed(self) -> None:
        if self.closed:
            raise SpecterError(f"generate: this {self.name} engine is closed (close() was called, or its with "
                               f"block ended); load a new engine to generate again")

    def close(self) -> None:
        """Subclasses release what they hold here (a link's copy thread, an offload folder); a
        second call does no harm. The engine cannot generate afterwards."""
        self.closed = True

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _marking_closed(close: Callable) -> Callable:
    """``close`` that also marks the engine closed, even when it raises."""
    @functools.wraps(close)
    def marked(self, *args, **kwargs):
        try:
            return close(self, *args, **kwargs)
        finally:
            self.closed = True

    return marked


class ResidentEngine(Engine):
    compilable = True

    name = "resident"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.expert_kernel = "specter-grouped" if use_grouped_kernel(self.model) else "transformers"

    def engine_report(self) -> dict:
        from specter.model.layout import moe_layers

        layers = moe_layers(self.model)
        expert_tensors = [getattr(m.experts, n) for m in layers for n in m.param_names]
        expert_bytes = tensor_bytes(expert_tensors)
        dense = tensor_bytes(self.model.parameters()) + tensor_bytes(self.model.buffers()) - expert_bytes
        n_experts = sum(m.num_experts for m in layers)
        return {
            "expert_budget": {"experts": n_experts, "bytes": expert_bytes, "fraction": 1.0},
            "expert_kernel": self.expert_kernel,
            "expert_layout": "blocked" if any(is_blocked(m.experts) for m in layers) else "standard",
            "device_bytes": {"draft": None, "cache": expert_bytes, "dense": dense, "total": dense + expert_bytes},
        }


class OffloadedEngine(Engine):
    """Dense weights on the device, experts in a host store, a budgeted device cache of experts."""

    name = "ondemand"
    compilable = True

    def __init__(self, recipe, model, tokenizer, device, model_path, layers, store, cache, link) -> None:
        super().__init__(recipe, model, tokenizer, device, model_path)
        self.layers, self.store, self.cache, self.link = layers, store, cache, link
        self.runtime = ExpertRuntime(layers, cache)
        self.prefill_stats = CacheStats()
        install(model, self.runtime)

    def reset_counters(self) -> None:
        self.cache.reset_stats()
        self.prefill_stats = CacheStats()
        self.link.reset_counters()

    def prefill(self, prompt_ids, kv, generator, metrics) -> int:
        before = dataclasses.replace(self.cache.stats)
        token = super().prefill(prompt_ids, kv, generator, metrics)
        self.prefill_stats = self.prefill_stats + (self.cache.stats - before)
        return token

    def decode_stats(self) -> CacheStats:
        """Cache counters of the decode steps only (prefill streams experts through the slots and
        would make hit rates depend on prompt length)."""
        return self.cache.stats - self.prefill_stats

    def engine_report(self) -> dict:
        stats = self.decode_stats()
        dense = tensor_bytes(self.model.parameters()) + tensor_bytes(self.model.buffers())
        return {
            "expert_budget": {
                "experts": self.cache.capacity,
                "bytes": self.cache.bytes,
                "fraction": self.cache.fraction_held,
            },
            "device_bytes": {"draft": None, "cache": self.cache.bytes, "dense": dense, "total": dense + self.cache.bytes},
            "expert_layout": "blocked" if self.cache.store.blocked else "standard",
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
