"""Engines without a model for driving ``specter.bench.sweep.Sweep``: each run reports the rate
``rate(engine)`` gives, every prompt in its turn, so a sweep's bookkeeping (rows, notes, ratios)
can be checked in milliseconds. ``fake_sweep(spec, rate, cache_bytes)`` is a Sweep that builds them."""

from __future__ import annotations

import types
from typing import Callable

from specter.bench import sweep as sweep_module
from specter.bench.sweep import Sweep


class FakeResult:
    def __init__(self, report: dict, token_ids: list[list[int]]) -> None:
        self.report, self.token_ids = report, token_ids


class FakeEngine:
    draft_bytes = 1000

    def __init__(self, name: str, budget, rate: Callable, cache_bytes: int) -> None:
        self.name, self.budget, self.rate = name, budget, rate
        self.cache = types.SimpleNamespace(bytes=cache_bytes, slots=None)
        self.model = None

    def use_link(self, link) -> None:
        pass

    def generate(self, prompts, max_new_tokens=None) -> None:
        pass

    def engine_report(self) -> dict:
        return {"offload": {"tier": "disk", "modules_offloaded": 1, "offloaded_bytes": self.cache.bytes}}

    def generate_by_prompt(self, prompts):
        for _ in prompts[:-1]:
            yield
        rate = self.rate(self)
        return FakeResult({"decode_tokens_per_s": rate, "decode_step_s": 1 / rate if rate else None}, [[1, 2]])

    def close(self) -> None:
        pass


def fake_sweep(spec, rate: Callable, cache_bytes: Callable, monkeypatch) -> Sweep:
    sweep = Sweep(spec, progress=False)

    def build(self, label, engine, budget, link, compile, extra=()):
        return FakeEngine(engine, budget, rate, cache_bytes(budget))

    sweep._build = types.MethodType(build, sweep)
    monkeypatch.setattr(sweep_module, "_make_link", lambda spec, engine, link: link)
    return sweep
