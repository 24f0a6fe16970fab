"""The bundled ``tiny-moe``: ships within the size limit, loads with plain transformers, matches
Specter's engines token for token, and its model card records a healthy router.

These tests use the shipped weights and the repository's evaluation prompts (fp32, greedy).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import specter
from specter.bundled import bundled_path

MODEL_DIR = bundled_path("tiny-moe")
MAX_NEW = 32


def test_checkpoint_is_small_safetensors_with_a_model_card():
    weights = list(MODEL_DIR.glob("*.safetensors"))
    assert weights and sum(w.stat().st_size for w in weights) <= 32 * 10**6
    assert not list(MODEL_DIR.glob("*.bin"))
    summary = json.loads((MODEL_DIR / "training_summary.json").read_text())
    assert summary["min_routed_share"] >= 0.01, "an expert gets under 1% of routed tokens on held-out text"
    assert 0 < summary["heldout_loss"] < 8.3  # below the uniform-distribution loss ln(4096) = 8.32
    card = (MODEL_DIR / "MODEL_CARD.md").read_text()
    assert f"{summary['heldout_loss']:.3f}" in card


def test_plain_transformers_loads_it_and_agrees_with_the_resident_engine(resident_tokens, eval_prompts):
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    assert model.config.model_type == "mixtral" and model.config.num_local_experts == 16
    for prompt, expected in list(zip(eval_prompts, resident_tokens))[:4]:
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)
        assert out[0, ids.shape[1]:].tolist() == expected[: out.shape[1] - ids.shape[1]]


@pytest.mark.parametrize("budget", [0.1, 0.25, 0.5])
def test_ondemand_is_lossless_on_the_evaluation_prompts(budget, resident_tokens, eval_prompts, bundled_recipe):
    assert specter.load(bundled_recipe("ondemand", budget)).generate(eval_prompts).token_ids == resident_tokens


@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_specter_is_lossless_on_the_evaluation_prompts(budget, resident_tokens, eval_prompts, bundled_recipe):
    engine = specter.load(bundled_recipe("specter", budget, speculation={"governor": {"name": "fixed", "k": 4}}))
    result = engine.generate(eval_prompts)
    assert result.token_ids == resident_tokens
    assert result.report["acceptance_rate"] > 0.5
