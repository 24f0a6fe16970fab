"""The lossless matrix: offloaded engines produce exactly the resident engine's greedy tokens.

For a tiny random-weight model of every supported architecture (16 experts per MoE layer) and
budgets of 10%, 25% and 50% of all experts, ``ondemand`` must match ``resident`` token for token,
and ``resident`` must match plain ``transformers`` ``generate`` (fp32). Prompts are longer than
the 10% cache so prefill has to stream experts through the slots.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import specter
from specter.testing.zoo import ARCHITECTURES, save_random_checkpoint

BUDGETS = (0.1, 0.25, 0.5)
MAX_NEW = 12
PROMPTS = [[1, 17, 93, 4, 250, 31, 8, 66, 140, 7, 201, 55, 3, 9, 120, 44], [1, 200, 5, 77, 12]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("zoo")
    return {arch: str(save_random_checkpoint(arch, root / arch, seed=0)) for arch in ARCHITECTURES}


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
def test_ondemand_matches_resident_and_transformers(arch, checkpoints):
    path = checkpoints[arch]
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
