"""``scripts/round_parts.py``: its counters see a speculative engine's rounds part by part, only
inside rounds, and leave every patched function as it was."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from specter.bench.spec import load_bench
from specter.build import build_engine
from specter.compile import lean_draft
from specter.decode.speculative import SpecterEngine

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("round_parts", ROOT / "scripts" / "round_parts.py")
round_parts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(round_parts)


def test_the_parts_of_a_round_add_up_inside_it_and_the_patches_come_off() -> None:
    torch.set_num_threads(1)
    bench = load_bench(str(ROOT / "recipes" / "bench-bundled.yaml"))
    engine = build_engine(bench.cell_recipe("specter", 0.25, "fast", False, [
        "speculation.governor.name=fixed", "speculation.governor.k=2", "speculation.governor.options={}"]))
    before = (SpecterEngine.decode_round, lean_draft.LeanDraftStep.step, type(engine.runtime).notify,
              vars(type(engine.runtime))["_forward_from_slots"])
    prompt = bench.recipe.resolved_prompts()[:1]
    engine.generate(prompt, max_new_tokens=4)
    with round_parts.instrumented(engine) as parts:
        engine.generate(prompt, max_new_tokens=4)
        parts.seconds.clear()
        parts.calls.clear()
        report = engine.generate(prompt, max_new_tokens=12).report  # a prefill (not counted), then rounds
        seconds, calls = dict(parts.seconds), dict(parts.calls)
    rounds = report["phases"]["rounds"]
    assert rounds > 0 and calls["round"] == rounds
    layers = len(engine.runtime.layers)
    assert calls["verify: experts from the cache"] == layers * rounds  # one verification a round, no prefill
    total = seconds["round"]
    assert 0 < seconds["draft step"] < total
    experts = seconds.get("draft: whole layers", 0) + seconds.get("draft: INT4 experts", 0)
    assert 0 < experts < seconds["draft step"]
    assert 0 < seconds["verify: experts from the cache"] < total - seconds["draft step"]
    assert seconds["verify: observers"] > 0 and seconds["draft: observers"] > 0
    kernels = seconds.get("verify:   kernels, one pass", 0) + seconds.get("verify:   kernels, waves", 0)
    assert 0 < kernels < seconds["verify: experts from the cache"]
    after = (SpecterEngine.decode_round, lean_draft.LeanDraftStep.step, type(engine.runtime).notify,
             vars(type(engine.runtime))["_forward_from_slots"])
    assert after == before
    engine.close()


def test_an_emulated_link_is_labelled_emulated_with_its_rate() -> None:
    emulated = {"kind": "emulated", "gbps": 0.1, "latency_us": 20.0, "emulated": True}
    assert round_parts.link_label("slow", emulated) == "link slow (emulated, 0.1 GB/s + 20 us)"
    assert round_parts.link_label("local", {"kind": "local"}) == "link local"
    assert round_parts.link_label("gpu", {"kind": "cuda"}) == "link gpu (cuda)"
