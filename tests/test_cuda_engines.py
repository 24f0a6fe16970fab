"""Every engine on a CUDA device, eager and compiled: greedy tokens equal the eager resident engine's.

GPU-only (``pytest -m gpu``; skipped where torch sees no CUDA device). The model is the shared
4-layer, 16-expert random Mixtral; offloaded engines keep a quarter of the experts in a device
cache fed by the ``cuda`` link (pinned host memory, copies on a side stream), so the asynchronous
paths that CPU runs only emulate are exercised on real hardware.
"""

from __future__ import annotations

import pytest

import specter
from specter.testing.zoo import ARCHITECTURES

PROMPTS = [[1, 17, 93, 4, 250, 31, 8, 66, 140, 7, 201, 55, 3, 9, 120, 44], [1, 200, 5, 77, 12]]
MAX_NEW = 12
ENGINES = [("ondemand", None), ("router-lookahead", None), ("specter", {"name": "fixed", "k": 3}),
           ("specter", {"name": "roofline", "k": 4, "options": {"k_max": 8}})]


def cuda_recipe(path, engine: str, compile: bool, governor: dict | None = None) -> dict:
    data = {"model": str(path), "engine": engine, "device": "cuda", "max_new_tokens": MAX_NEW, "threads": 1,
            "compile": compile}
    if engine != "resident":
        data["offload"] = {"link": {"kind": "cuda"}, "expert_budget": 0.25}
    if governor is not None:
        data["speculation"] = {"governor": governor}
    return data


@pytest.fixture(scope="module")
def cuda_resident(tiny_mixtral) -> list[list[int]]:
    return specter.load(cuda_recipe(tiny_mixtral, "resident", compile=False)).generate(PROMPTS).token_ids


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("engine,governor", ENGINES, ids=["ondemand", "router-lookahead", "specter-k3", "roofline"])
def test_offloaded_engines_on_cuda_equal_resident(tiny_mixtral, cuda_resident, engine, governor, compile):
    with specter.load(cuda_recipe(tiny_mixtral, engine, compile, governor)) as loaded:
        result = loaded.generate(PROMPTS)
    report = result.report
    assert result.token_ids == cuda_resident
    assert report["link"]["kind"] == "cuda" and report["bytes_transferred"] > 0
    assert (report["compile"] is not None and report["compile"]["enabled"]) == compile
    if engine == "specter":
        assert sum(report["k"]["histogram"].values()) > 0


@pytest.mark.gpu
def test_compiled_resident_on_cuda_equals_eager(tiny_mixtral, cuda_resident):
    result = specter.load(cuda_recipe(tiny_mixtral, "resident", compile=True)).generate(PROMPTS)
    assert result.token_ids == cuda_resident
    assert result.report["compile"]["enabled"] and result.report["device"].startswith("cuda")


LAYOUTS = [arch for arch in ARCHITECTURES if arch != "mixtral"]  # Mixtral: the tests above


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("arch", LAYOUTS)
def test_every_layout_compiled_on_cuda_equals_eager(arch, zoo_checkpoints):
    """Each layout's compiled graphs on CUDA (CUDA graphs; latent attention, sinks, per-layer windows,
    grouped routers, biased experts): compiled ``resident`` and compiled ``specter`` (fixed k, the
    ``cuda`` link) give eager ``resident``'s greedy tokens. Slow as well as GPU-only (a compile per
    engine and layout): ``pytest -m "gpu and slow" tests/test_cuda_engines.py``."""
    path = zoo_checkpoints[arch]
    eager = specter.load(cuda_recipe(path, "resident", compile=False)).generate(PROMPTS).token_ids
    for engine, governor in (("resident", None), ("specter", {"name": "fixed", "k": 3})):
        with specter.load(cuda_recipe(path, engine, True, governor)) as loaded:
            result = loaded.generate(PROMPTS)
        assert result.token_ids == eager, (arch, engine)
        compiled = result.report["compile"]
        assert compiled["enabled"] and compiled["late_graphs"] == 0, (arch, engine, compiled)
