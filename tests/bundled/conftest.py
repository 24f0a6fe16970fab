"""Shared by the bundled-model tests: the evaluation prompts, recipe dicts and the resident
engine's greedy tokens (fp32) on them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest

import specter

EVAL_PROMPTS = Path(__file__).resolve().parents[2] / "recipes/prompts/eval.jsonl"
MAX_NEW = 32


def _recipe(engine: str, budget: float | None = None, **extra) -> dict:
    data = {"model": "bundled:tiny-moe", "engine": engine, "max_new_tokens": MAX_NEW, "threads": 1,
            "dtype": "float32", "offload": {"link": {"kind": "local"}}, **extra}
    if budget is not None:
        data["offload"]["expert_budget"] = budget
    return data


@pytest.fixture(scope="session")
def eval_prompts() -> list[str]:
    lines = EVAL_PROMPTS.read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]


@pytest.fixture(scope="session")
def bundled_recipe() -> Callable[..., dict]:
    """``bundled_recipe(engine, budget=None, **keys)``: a recipe dict for the bundled model, fp32,
    greedy, ``MAX_NEW`` tokens, unpaced link."""
    return _recipe


@pytest.fixture(scope="session")
def resident_tokens(eval_prompts) -> list[list[int]]:
    return specter.load(_recipe("resident")).generate(eval_prompts).token_ids
