"""Speculative engines: ``specter`` (INT4 self-draft + lookahead prefetch) and ``router-lookahead``.

Contract of one ``specter`` round (batch 1, one shared ``DynamicCache``):
1. The governor picks k (k = 0: a plain decoding round, one target step with router-lookahead
   prefetch, as the ``router-lookahead`` engine does; without prefetch, as ``ondemand``, on a
   link that does not overlap compute). The draft — the same model with its routed experts
   switched to the resident INT4 copies; attention, norms, routers, embeddings and KV cache are
   the target's own; a lean one-token step over the same weights where the model allows
   (``specter.compile.lean_draft``, given by the composition root; compiled engines take it on a
   CPU, elsewhere their draft graph) — runs k steps from the last
   emitted token, appending temporary KV entries (the lean step on a transformers cache holds
   them beside it instead, ``step(ahead=)``). Its routing at every (position, layer) fills
   the scheduler's lookahead buffer and prefetches start at once.
   With ``lookahead_last`` one more draft step runs over the k-th drafted token for its routing
   only, so every one of the k+1 verified positions has a prediction; engines skip it on a
   link that does not overlap compute (``Link.overlaps_compute``, e.g. ``local`` without its
   copy thread), where a prefetch costs the same copy as a demand load and the step would be
   pure cost.
2. The scheduler flushes every remaining predicted expert; the KV cache is cropped back to the
   round's start.
3. The target runs once over the k+1 tokens (last emitted token + k drafts), experts from the
   device cache (misses load on demand), tokens routed to the same expert computed together.
4. Greedy: the longest prefix matching the target's argmax plus the target's next token.
   Sampling: exact rejection sampling against the draft's probabilities, so the output follows
   the target's distribution. The KV cache is cropped to the accepted length.
The ``router-lookahead`` engine decodes one token per target step and prefetches layer L+1's
experts from layer L's hidden state (no draft).
Both engines close the scheduler's round when an exception cuts a round short (a failing link or
plugin, an interrupt) before it propagates: no key stays protected and no prediction stays open,
so the next call's prefill does not stream the cut round's predictions (``decode_round``).
"""

from __future__ import annotations

import contextlib
import time
import warnings

import torch

from specter.decode.acceptance import greedy_verify, rejection_verify
from specter.decode.engine import OffloadedEngine
from specter.experts.runtime import SlotView
from specter.decode.kv import crop_to, synchronize
from specter.decode.governor import check_next_k
from specter.plugins import call_plugin
from specter.kernels.int4_experts import Int4Experts
from specter.memory.huge_pages import rehome
from specter.decode.sampling import logits_to_probs
from specter.memory.scheduler import PrefetchScheduler


def build_draft(layers, store, device: torch.device, group_size: int,
                huge_pages: bool = False) -> dict[int, Int4Experts]:
    """INT4 copies of every MoE layer's routed experts, resident on ``device``, quantized one layer
    at a time from the host store in the standard layout (``store.standard``: only one layer's
    full-precision experts visit the device);
    ``huge_pages``: their packed weights on 2 MiB pages (CPU tensors only; ``huge_pages.rehome``)."""
    draft = {}
    for info in layers:
        weights = {name: tensor.to(device) for name, tensor in store.standard(info.layer).items()}
        proxy = SlotView(info.experts, weights)
        draft[info.layer] = Int4Experts.from_module(proxy, group_size=group_size)
        if huge_pages:
            draft[info.layer].move_storage(rehome)
        for name in weights:
            if not name.endswith("_bias"):
                object.__setattr__(proxy, name, None)
        del weights
    return draft


class PrefetchingEngine(OffloadedEngine):
    """An offloaded engine with a predictor feeding a prefetch scheduler."""

    def __init__(self, *args, predictor, max_in_flight: int = 2, prefetch_mode: str = "aggressive",
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scheduler = PrefetchScheduler(self.cache, max_in_flight=max_in_flight, mode=prefetch_mode)
        self.predictor = predictor
        self.predictor.bind(self.scheduler, self.runtime.layers)
        self.runtime.observers.append(self._advance)
        self.runtime.observers.append(self._observe_prediction)
        self.prediction_failure: str | None = None
        self._routing: list[tuple[int, torch.Tensor]] = []  # this round's target (layer, top_k_index)
        self._expert_stride = max(m.num_experts for m in self.runtime.layers.values())
        self.runtime.observers.append(self._record_use)
        self.runtime.on_release = self.scheduler.computed  # a layer's early wave frees slots for the window

    def _observe_prediction(self, layer, hidden, top_k_index, top_k_weights, mode) -> None:
        if self.prediction_failure is None:
            self.guarded(self.predictor.observe, layer, hidden, top_k_index, top_k_weights, mode)

    def guarded(self, call, *args, fallback=None):
        """Call the predictor; if it raises, switch prediction off for the rest of the run (one
        warning, the report says why) and return ``fallback``: decoding goes on, losslessly,
        with on-demand loads where prefetches would have been."""
        if self.prediction_failure is not None:
            return fallback
        try:
            return call(*args)
        except Exception as error:
            name = getattr(self.predictor, "name", type(self.predictor).__name__)
            self.prediction_failure = f"predictor {name!r} raised {type(error).__name__}: {error}"
            warnings.warn(f"{self.prediction_failure}; prediction is off for the rest of this run",
                          RuntimeWarning, stacklevel=2)
            self.scheduler.begin_round()  # drop whatever it had predicted
            self.cache.unprotect_all()
            return fallback

    def _advance(self, layer, hidden, top_k_index, top_k_weights, mode) -> None:
        if mode == "target":
            self.scheduler.advance(layer)

    def _record_use(self, layer, hidden, top_k_index, top_k_weights, mode) -> None:
        if mode == "target":
            self._routing.append((layer, top_k_index))

    def used_experts(self) -> set[tuple[int, int]]:
        """The (layer, expert) pairs the target read this round, from the routing recorded per
        layer on the device, with one device-to-host transfer for the whole round."""
        if not self._routing:
            return set()
        keys = torch.cat([layer * self._expert_stride + index.reshape(-1) for layer, index in self._routing])
        return {divmod(key, self._expert_stride) for key in keys.unique().tolist()}

    def begin_round(self, drafting: bool = False) -> None:
        """``drafting``: a draft runs before verification (the scheduler holds the last round's
        experts until its flush)."""
        self._routing = []
        self.scheduler.begin_round(hold_last_read=drafting)

    def end_round(self, used: set[tuple[int, int]] | None = None) -> None:
        self.scheduler.end_round(self.used_experts() if used is None else used)

    def decode_round(self, token: int, kv, generator, metrics, remaining: int, context: list[int]) -> list[int]:
        """``play_round``; should it raise, the scheduler's round is closed first
        (``close_cut_round``)."""
        try:
            return self.play_round(token, kv, generator, metrics, remaining, context)
        except BaseException:
            self.close_cut_round()
            raise

    def play_round(self, token: int, kv, generator, metrics, remaining: int, context: list[int]) -> list[int]:
        """One round: here the base engine's plain decoding step (its target step prefetching)."""
        return super().decode_round(token, kv, generator, metrics, remaining, context)

    def close_cut_round(self) -> None:
        """End the round an exception cut short, as ``end_round`` ends one (the experts it read so
        far as used), and lift every protection: left open, its predictions stayed protected and
        the next prompt's prefill, whose layers advance the scheduler, streamed them in."""
        if self.scheduler.in_round:
            with contextlib.suppress(Exception):  # the exception that cut the round is the one to see
                self.end_round()
        self.cache.unprotect_all()

    def reset_counters(self) -> None:
        super().reset_counters()
        self.scheduler.stats = type(self.scheduler.stats)()

    def engine_report(self) -> dict:
        report = super().engine_report()
        stats = self.scheduler.stats
        report["prefetch_precision"] = self.cache.stats.prefetch_precision()
        report["prediction"] = {
            "predictor": self.predictor.name,
            "recall": stats.recall(), "precision": stats.precision(),
            "cached_at_prediction": stats.cached_at_prediction,
            "issued_while_drafting": stats.issued_while_drafting, "issued_at_flush": stats.issued_at_flush,
            "streamed": stats.streamed, "not_admitted": stats.not_admitted,
            "disabled": self.prediction_failure,
            "prefetch_mode": self.scheduler.mode, "conservative_now": self.scheduler.conservative,
            "lazy_now": self.scheduler.lazy,
            "transfer_wait_share": self.scheduler.wait_share,
        }
        return report


class RouterLookaheadEngine(PrefetchingEngine):
    """Plain decoding; each step's MoE layer L prefetches layer L+1's predicted experts."""

    name = "router-lookahead"


class SpecterEngine(PrefetchingEngine):
    name = "specter"
    lean_draft = None  # a specter.compile.lean_draft.LeanDraftStep, set by the composition root where the model allows

    def __init__(self, *args, draft: dict[int, Int4Experts], governor, plain_predictor,
                 lookahead_last: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.runtime.draft = draft
        self.draft = draft
        self.governor = governor
        self.lookahead_last = lookahead_last and self.predictor.needs_draft
        # k = 0 rounds decode plainly; then layer L's router predicts layer L+1 (as router-lookahead)
        self._plain_round = False
        self.plain_predictor = plain_predictor  # router-lookahead, from the registry
        self.plain_predictor.bind(self.scheduler, self.runtime.layers)
        self.runtime.observers.append(self._plain_observe)

    def _plain_observe(self, layer, hidden, top_k_index, top_k_weights, mode) -> None:
        # on a link that cannot overlap compute a prefetch is the same copy as a demand load, and a
        # wrong one is a copy for nothing: a plain round there decodes as ondemand does
        if self._plain_round and self.link.overlaps_compute:
            self.plain_predictor.observe(layer, hidden, top_k_index, top_k_weights, mode)

    @property
    def draft_bytes(self) -> int:
        """Device bytes of the resident INT4 draft experts."""
        return sum(d.nbytes for d in self.draft.values())

    def engine_report(self) -> dict:
        report = super().engine_report()
        device_bytes = report["device_bytes"]
        device_bytes["draft"] = self.draft_bytes
        device_bytes["total"] += self.draft_bytes
        report["draft"] = {"bits": 4, "group_size": next(iter(self.draft.values())).group_size,
                           "backend": next(iter(self.draft.values())).backend, "lookahead_last": self.routing_step,
                           "step": self.draft_step_kind}
        report["governor"] = call_plugin("governor", self.governor, "summary")
        return report

    def reset_counters(self) -> None:
        super().reset_counters()
        call_plugin("governor", self.governor, "new_report")

    def use_link(self, link) -> None:
        super().use_link(link)
        call_plugin("governor", self.governor, "link_changed")  # Governor's default does nothing

    def _draft_steps(self, k: int) -> int:
        """Draft forward passes for k drafted tokens: k, plus the routing-only one (lookahead_last)."""
        return k + (1 if self.routing_step and k else 0)

    @property
    def routing_step(self) -> bool:
        """Whether rounds run the routing-only draft step: ``lookahead_last`` on a link whose
        copies overlap compute, eager or compiled. On a synchronous link a prefetch is the same
        copy as a demand load, so the step is pure cost (when the fused verification graph still
        needed every expert cached, compiled ``specter`` without the step was 1.07-1.18x its eager
        self at 25% on ``local`` against 0.99-1.04x with it: widened model, one thread, three
        interleaved repeats). On ``local`` with a copy thread, eager, 50%: 108.2 tok/s with the
        step and 108.2 without on commit 677bd33 (it cost 3.4 ms a round and saved 2.5 ms of
        verification; three interleaved repeats). Nor where the cache holds every expert of every
        MoE layer: nothing is ever copied, so the step buys nothing (widened model, budget 100% on
        `local`, compiled, six runs each toggled in one process: k = 4 189.9 tok/s without it
        against 180.0 with it, the roofline 226.7 against 219.8)."""
        return self.lookahead_last and self.link.overlaps_compute and self.cache.fraction_held < 1.0

    def _draft_tokens(self, token: int, k: int, kv, generator, context: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """k drafted tokens and, when sampling, their draft probabilities [k, V]. A predictor with a
        ``propose(context, k)`` method (e.g. ``ngram``) drafts instead of the INT4 model; its
        proposals are deterministic, so their draft distribution is one-hot."""
        if self.predictor.drafts_tokens:
            proposed = self.guarded(self.predictor.propose, context, k, fallback=[])
            vocab = self.model.config.vocab_size
            drafted = [int(t) for t in proposed if 0 <= int(t) < vocab][:k]
            if self.sampling.greedy or not drafted:
                return drafted, None
            return drafted, torch.nn.functional.one_hot(torch.tensor(drafted), vocab).float().to(self.device)
        drafted: list[int] = []
        probs: list[torch.Tensor] = []
        steps = self._draft_steps(k)
        with self.runtime.drafting():
            current = token
            for step in range(steps):
                if step == k:  # routing-only step over the last drafted token
                    self._draft_logits(current, kv, logits=False, ahead=step)
                    break
                logits = self._draft_logits(current, kv, ahead=step)
                if self.sampling.greedy:
                    current = int(logits.argmax())
                else:
                    q = logits_to_probs(logits, self.sampling)
                    current = int(torch.multinomial(q, 1, generator=generator))
                    probs.append(q)
                drafted.append(current)
        return drafted, (torch.stack(probs) if probs else None)

    def _draft_logits(self, token: int, kv, logits: bool = True, ahead: int = 0) -> torch.Tensor | None:
        """One draft step over ``token``, the round's ``ahead``-th: fp32 logits [V]. The lean step
        where the engine has one (``specter.compile.lean_draft``: eager engines where the model
        allows, compiled ones on a CPU as well; it may hold the round's K/V beside ``kv``), else a
        compiled engine's draft graph, else the model's own forward with the INT4 experts switched
        in (both append to ``kv``). ``logits=False``: the step is run for its routing only; the
        lean step then skips the LM head (and returns None)."""
        lean = self.lean_step
        if lean is not None:
            return lean.step(token, kv, logits=logits, ahead=ahead)
        return self.forward_logits(torch.tensor([[token]], device=self.device), kv)[-1]

    @property
    def lean_step(self):
        """The lean draft step this engine drafts with (eager: ``lean_draft``; compiled: its
        decoder's ``lean_step``), or None."""
        return self.lean_draft if self.compiled is None else getattr(self.compiled, "lean_step", None)

    @property
    def draft_step_kind(self) -> str:
        """How draft tokens come: ``predictor`` (it proposes them, e.g. ``ngram``), else how draft
        steps run: ``lean``, ``compiled`` (the draft graph against its layered path, judged per
        round) or ``model`` (see ``_draft_logits``)."""
        if self.predictor.drafts_tokens:
            return "predictor"
        if self.lean_step is not None:
            return "lean"
        return "compiled" if self.compiled is not None else "model"

    def start_prompt(self) -> None:
        self.guarded(self.predictor.reset)
        call_plugin("governor", self.governor, "start_prompt")  # Governor's default does nothing

    def close_cut_round(self) -> None:
        super().close_cut_round()
        self._plain_round = False

    def play_round(self, token: int, kv, generator, metrics, remaining: int, context: list[int]) -> list[int]:
        """One speculative round: draft k (the governor's choice, at most ``remaining - 1``),
        flush the prefetches, verify the k+1 tokens in one target pass, keep the accepted ones."""
        started = time.perf_counter()
        chosen = check_next_k(call_plugin("governor", self.governor, "next_k"), self.governor)
        k = min(chosen, remaining - 1)
        cut_short = k < chosen  # the generation ends after this round (a predictor proposing fewer is not)
        base_length = kv.get_seq_length()
        self._plain_round = k == 0
        self.begin_round(drafting=k > 0)
        issue_before = self.scheduler.issue_s
        judged = k > 0 and self.draft_step_kind == "compiled"
        trials_before = self.compiled.chooser.trials if self.compiled is not None else 0
        if judged:
            self.compiled.begin_draft_round()
        drafted, draft_probs = self._draft_tokens(token, k, kv, generator, context)
        draft_issue_s = self.scheduler.issue_s - issue_before
        k = len(drafted)
        crop_to(kv, base_length)
        synchronize(self.device)
        drafted_at = time.perf_counter()
        self.scheduler.flush()
        flushed_at = time.perf_counter()
        wait_before, kernel_before = self.cache.stats.transfer_wait_s, self.runtime.kernel_s
        in_graph_before = self.runtime.layers_computed_in_graph
        verify_ids = torch.tensor([[token] + drafted], device=self.device)  # [1, k+1]
        target_logits = self.forward_logits(verify_ids, kv)  # [k+1, V]
        synchronize(self.device)
        verified_at = time.perf_counter()
        used = self.used_experts()
        experts_read = len(used)
        self.end_round(used)
        if self.sampling.greedy:
            result = greedy_verify(torch.tensor(drafted, dtype=torch.long, device=target_logits.device), target_logits)
        else:
            target_probs = logits_to_probs(target_logits, self.sampling)
            draft_tokens = torch.tensor(drafted, dtype=torch.long, device=target_probs.device)
            if draft_probs is None:
                draft_probs = target_probs[:0]
            result = rejection_verify(draft_tokens, draft_probs.to(target_probs.device), target_probs, generator)
        crop_to(kv, base_length + 1 + result.accepted)
        self.guarded(self.predictor.rollback, kv.get_seq_length())
        synchronize(self.device)
        total = time.perf_counter() - started
        timings = dict(draft_s=drafted_at - started, flush_s=flushed_at - drafted_at,
                       verify_s=verified_at - flushed_at,
                       draft_steps=0 if self.predictor.drafts_tokens else self._draft_steps(k),
                       experts_read=experts_read, draft_issue_s=draft_issue_s,
                       verify_io_wait_s=self.cache.stats.transfer_wait_s - wait_before)
        # a layer computed inside a compiled graph hides its kernels' time: then none is reported
        kernels_measured = kernel_before is not None and self.runtime.layers_computed_in_graph == in_graph_before
        verify_kernel_s = self.runtime.kernel_s - kernel_before if kernels_measured else None
        timings["host_s"] = total - timings["draft_s"] - timings["flush_s"] - timings["verify_s"]
        if judged and timings["draft_steps"]:
            # a compiled draft path is judged by the round: copies its predictions started late
            # are waited for in verification
            self.compiled.end_draft_round((timings["draft_s"] + timings["verify_io_wait_s"]) / timings["draft_steps"])
        metrics.observe_round(total_s=total, verify_tokens=k + 1, verify_kernel_s=verify_kernel_s, **timings)
        metrics.observe_draft(k, result.accepted)
        # a compiled path tried against the odds this round: its times are the trial's, not the path's
        path_trial = self.compiled is not None and self.compiled.chooser.trials != trials_before
        call_plugin("governor", self.governor, "observe", drafted=k, accepted=result.accepted, round_s=total,
                    path_trial=path_trial, cut_short=cut_short, **timings)
        return result.tokens
