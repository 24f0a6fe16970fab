"""The lossless matrix: offloaded engines produce exactly the resident engine's greedy tokens.

For a tiny random-weight model of every supported architecture (16 experts per MoE layer) and
budgets of 10%, 25% and 50% of all experts, ``ondemand`` must match ``resident`` token for token,
and ``resident`` must match plain ``transformers`` ``generate`` (fp32). Prompts are longer than
the 10% cache so prefill has to stream experts through the slots. The blocked expert layout keeps
every engine lossless too.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import specter
from specter.model import expert_layout
from specter.testing.marks import needs_native
from specter.testing.zoo import ARCHITECTURES, save_random_checkpoint

BUDGETS = (0.1, 0.25, 0.5)
MAX_NEW = 12
PROMPTS = [[1, 17, 93, 4, 250, 31, 8, 66, 140, 7, 201, 55, 3, 9, 120, 44], [1, 200, 5, 77, 12]]


def recipe(path: str, engine: str, budget: float | None = None) -> dict:
    data = {"model": path, "engine": engine, "max_new_tokens": MAX_NEW, "threads": 1,
            "offload": {"link": {"kind": "local"}}}
    if budget is not None:
        data["offload"]["expert_budget"] = budget
    return data


def transformers_greedy(path: str) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outputs = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, min_new_tokens=MAX_NEW)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_ondemand_matches_resident_and_transformers(arch, zoo_checkpoints):
    path = zoo_checkpoints[arch]
    resident = specter.load(recipe(path, "resident")).generate(PROMPTS).token_ids
    reference = transformers_greedy(path)
    # generate() may stop at EOS; Specter stops there too: compare the common prefix lengths exactly
    assert [r[: len(t)] for r, t in zip(resident, reference)] == reference
    for budget in BUDGETS:
        engine = specter.load(recipe(path, "ondemand", budget))
        result = engine.generate(PROMPTS)
        report = result.report
        assert result.token_ids == resident, f"{arch} at budget {budget}"
        assert report["expert_budget"]["fraction"] <= budget + 1e-9
        assert report["device_bytes"]["cache"] <= budget * report["model"]["expert_bytes"] * 32 + 1
        assert 0.0 <= report["hit_rate"] <= 1.0
        assert report["cache"]["prefill"]["misses"] > 0
        engine.close()


@needs_native
def test_blocked_experts_keep_every_engine_lossless(tmp_path, monkeypatch):
    """With the size floor lowered, a tiny Mixtral's experts are kept blocked by every engine
    (``resident``'s own modules, the shared host store and so the cache slots, the disk tier's
    reads, straight into slots or into the host tier): each engine's greedy tokens equal
    ``resident``'s, which equal the standard layout's."""
    path = str(save_random_checkpoint("mixtral", tmp_path / "mixtral", seed=1, hidden=64, intermediate=64, layers=2))
    standard = specter.load(recipe(path, "resident")).generate(PROMPTS)
    assert standard.report["expert_layout"] == "standard"  # the floor: tiny experts stay standard
    monkeypatch.setattr(expert_layout, "BLOCKED_MIN_BYTES", 0)
    resident = specter.load(recipe(path, "resident")).generate(PROMPTS)
    assert resident.report["expert_layout"] == "blocked"
    assert resident.token_ids == standard.token_ids
    speculative = {"speculation": {"governor": {"name": "fixed", "k": 4}}}
    disk = {"offload": {"experts_on": "disk", "link": {"kind": "disk"}, "expert_budget": 0.25}}
    tiers = {"offload": {"experts_on": "disk", "host_budget": 0.5, "link": {"kind": "emulated", "gbps": 5},
                         "expert_budget": 0.25}}
    for engine, extra in [("ondemand", {}), ("specter", speculative), ("specter", disk | speculative),
                          ("specter", tiers | speculative)]:
        data = recipe(path, engine, 0.25)
        data["offload"] |= extra.get("offload", {})
        data["speculation"] = extra.get("speculation", {})
        loaded = specter.load(data)
        result = loaded.generate(PROMPTS)
        assert result.report["expert_layout"] == "blocked", (engine, extra)
        assert result.token_ids == resident.token_ids, (engine, extra)
        loaded.close()


SPECTER_ROOFLINE = {"name": "roofline", "k": 4}
MANY_ENGINES = [  # (engine, compiled, governor) against eager resident
    ("specter", False, SPECTER_ROOFLINE), ("ondemand", False, None), ("resident", True, None),
    ("specter", True, SPECTER_ROOFLINE), ("specter", True, {"name": "fixed", "k": 6}), ("ondemand", True, None),
]


def many_prompts(count: int = 12, seed: int = 11) -> list[list[int]]:
    """Seeded random prompts of 5 to 60 tokens: a random model's near-uniform logits put greedy
    choices close to ties, so a step that sums in another order shows up as a different token."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 60, (count,), generator=generator).tolist()
    return [[1] + torch.randint(2, 250, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_engine_eager_and_compiled_keeps_resident_tokens_on_many_prompts(arch, tmp_path):
    """Twelve random prompts x 40 tokens, 25% of the experts on ``local``: ``specter`` (roofline
    and fixed k), ``ondemand`` and compiled ``resident`` give eager ``resident``'s greedy tokens,
    eager and compiled, on every layout (about 10-20 s a layout once compiled graphs are cached)."""
    path = str(save_random_checkpoint(arch, tmp_path / arch, seed=3))
    prompts = many_prompts()

    def run(engine: str, compile: bool, governor: dict | None) -> list[list[int]]:
        data = recipe(path, engine, None if engine == "resident" else 0.25) | {"max_new_tokens": 40, "compile": compile}
        if governor is not None:
            data["speculation"] = {"governor": governor}
        loaded = specter.load(data)
        try:
            return loaded.generate(prompts).token_ids
        finally:
            loaded.close()

    reference = run("resident", False, None)
    assert sum(map(len, reference)) >= 12 * 40 // 2  # an early EOS ends a prompt (for every engine alike)
    for engine, compile, governor in MANY_ENGINES:
        tokens = run(engine, compile, governor)
        mismatched = [i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b]
        assert not mismatched, (arch, engine, "compiled" if compile else "eager", governor, mismatched)
