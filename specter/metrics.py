"""Counters one generation run accumulates, with ``observe_*`` methods (vLLM spec-decode style).

Contract: engines call ``observe_prefill`` once per prompt, ``observe_decode_step`` for every
target step (plain decode or verification) with the tokens it emitted, and ``observe_draft`` for
every speculation round. Derived figures (tokens/s, acceptance) are computed on demand, never stored.
"""

from __future__ import annotations

import dataclasses
from collections import Counter


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

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else None

    @property
    def ttft_s(self) -> float | None:
        return self.ttft_s_total / self.prompts if self.prompts else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_per_step(self) -> float | None:
        """Tokens emitted per verification (accepted drafts + the recovered/bonus token)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else None

    @property
    def mean_k(self) -> float | None:
        return self.drafted / self.rounds if self.rounds else None
