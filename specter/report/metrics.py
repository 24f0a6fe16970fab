"""Counters one generation run accumulates, with ``observe_*`` methods (vLLM spec-decode style).

Contract: engines call ``observe_prefill`` once per prompt, ``observe_decode_step`` for every
target step (plain decode or verification) with the tokens it emitted, and ``observe_draft`` for
every speculation round. Derived figures (tokens/s, acceptance) are computed on demand, never stored.
``phase_summary(totals, moe_layers)`` derives a run's phase figures from its round sums (the
report's ``phases``); ``pool_phases(phase_reports, moe_layers)`` derives them over several runs
(a bench row's repeats).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence


@dataclasses.dataclass
class GenerationMetrics:
    prompts: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    ttft_s_total: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0  # tokens emitted by decode steps (after each prompt's first token)
    target_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    k_histogram: Counter = dataclasses.field(default_factory=Counter)
    wall_s: float = 0.0
    phases: Counter = dataclasses.field(default_factory=Counter)  # seconds and counts per round phase

    def observe_prefill(self, prompt_tokens: int, seconds_to_first_token: float) -> None:
        self.prompts += 1
        self.prompt_tokens += prompt_tokens
        self.new_tokens += 1
        self.ttft_s_total += seconds_to_first_token

    def observe_decode_step(self, emitted: int, seconds: float) -> None:
        self.target_steps += 1
        self.new_tokens += emitted
        self.decode_tokens += emitted
        self.decode_s += seconds

    def observe_draft(self, k: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += k
        self.accepted += accepted
        self.k_histogram[k] += 1

    def observe_round(self, *, draft_s: float, flush_s: float, verify_s: float, host_s: float, total_s: float,
                      draft_steps: int, verify_tokens: int, experts_read: int, verify_io_wait_s: float,
                      draft_issue_s: float = 0.0, verify_kernel_s: float | None = None) -> None:
        """Phase timings of one speculation round: drafting (``draft_issue_s`` of it spent issuing
        prefetches: a synchronous link copies there), flushing prefetches, the verification forward
        (its transfer wait included: ``verify_io_wait_s``; its expert kernels' time, where measured,
        ``verify_kernel_s``), and the rest (host work)."""
        self.phases.update(rounds=1, draft_s=draft_s, flush_s=flush_s, verify_s=verify_s, host_s=host_s,
                           round_s=total_s, draft_steps=draft_steps, verify_tokens=verify_tokens,
                           experts_read=experts_read, verify_io_wait_s=verify_io_wait_s, draft_issue_s=draft_issue_s)
        if verify_kernel_s is not None:
            self.phases.update(kernel_rounds=1, verify_kernel_s=verify_kernel_s)

    def phase_report(self, moe_layers: int) -> dict | None:
        """``phase_summary`` of this run's rounds."""
        return phase_summary(self.phases, moe_layers)

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else None

    @property
    def ttft_s(self) -> float | None:
        return self.ttft_s_total / self.prompts if self.prompts else None

    @property
    def acceptance_rate(self) -> float | None:
        """Drafted tokens the target accepted, of all drafted: the draft's agreement (those
        accepted past an EOS that ends the generation count, though never emitted)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_per_step(self) -> float | None:
        """Tokens emitted per verification (accepted drafts + the recovered/bonus token, cut where
        an EOS ends the generation): every decode step of a speculative engine is one round."""
        return self.decode_tokens / self.rounds if self.rounds else None

    @property
    def mean_k(self) -> float | None:
        return self.drafted / self.rounds if self.rounds else None


PHASE_TOTALS = ("rounds", "draft_s", "draft_issue_s", "flush_s", "verify_s", "host_s", "draft_steps", "verify_tokens",
                "experts_read", "verify_io_wait_s")


def phase_summary(totals: Mapping[str, float], moe_layers: int | None) -> dict | None:
    """Totals and per-round means of the phases, the draft step's mean time (prefetch issuing
    excluded), the verification's compute time per distinct (layer, expert) it read (its transfer
    wait excluded) and, where every round measured it (``kernel_rounds == rounds``), the part of it
    in the expert kernels (``verify_kernel_s_per_expert``, else None); None when no round was
    observed. ``totals``: the sums ``GenerationMetrics.observe_round`` keeps."""
    p = totals
    if not p.get("rounds"):
        return None
    rounds = p["rounds"]
    out = {name: p.get(name, 0) for name in PHASE_TOTALS}
    draft_compute = p["draft_s"] - p.get("draft_issue_s", 0)
    out["draft_step_s"] = draft_compute / p["draft_steps"] if p.get("draft_steps") else None
    out["verify_s_per_round"] = p["verify_s"] / rounds
    out["verify_tokens_per_round"] = p["verify_tokens"] / rounds
    out["distinct_experts_per_layer"] = p["experts_read"] / rounds / moe_layers if moe_layers else None
    compute = p["verify_s"] - p.get("verify_io_wait_s", 0)
    out["verify_compute_s_per_expert"] = compute / p["experts_read"] if p.get("experts_read") else None
    kernels = p.get("verify_kernel_s") if p.get("kernel_rounds") == rounds else None
    out["verify_kernel_s"] = kernels
    out["verify_kernel_s_per_expert"] = kernels / p["experts_read"] if kernels is not None and p.get("experts_read") else None
    return out


def pool_phases(reports: Sequence[Mapping | None], moe_layers: int | None) -> dict | None:
    """One ``phase_summary`` over several runs' phase reports (``phase_summary`` outputs, e.g. a
    bench row's repeats): their totals summed, the kernels' share only where every run measured
    it; None when no run has rounds."""
    runs = [r for r in reports if r and r.get("rounds")]
    if not runs:
        return None
    totals: dict[str, float] = {name: sum(r.get(name) or 0 for r in runs) for name in PHASE_TOTALS}
    if all(r.get("verify_kernel_s") is not None for r in runs):
        totals["verify_kernel_s"] = sum(r["verify_kernel_s"] for r in runs)
        totals["kernel_rounds"] = totals["rounds"]
    return phase_summary(totals, moe_layers)
