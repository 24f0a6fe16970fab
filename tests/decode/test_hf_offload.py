"""The ``hf-offload`` baseline on a CPU: transformers + accelerate disk offload.

On a CPU the engine keeps the dense weights and the experts modules of the first layers that fit
the budget in memory and puts the other layers' experts modules on accelerate's ``disk`` tier
(a temporary offload folder). transformers 5 stores a layer's experts as one module with stacked
parameters, so the offload granularity is one layer's experts: with 4 MoE layers and a 25% budget
exactly one layer's experts stay in memory and three go to disk. Greedy tokens must equal the
resident engine's, and the folder must exist only while the engine is open.
"""

from __future__ import annotations

import os

import pytest
import torch

import specter
from specter.errors import BudgetError, SpecterError
from specter.testing.zoo import save_byte_tokenizer, save_random_checkpoint

torch.set_num_threads(1)

N_LAYERS, N_EXPERTS = 4, 16
MAX_NEW = 12
PROMPTS = ["def fibonacci(n):\n", [1, 200, 5, 77, 12, 9, 31]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("zoo") / "mixtral"
    save_random_checkpoint("mixtral", path, layers=N_LAYERS, n_experts=N_EXPERTS, seed=0)
    save_byte_tokenizer(path)
    return str(path)


def recipe(path: str, engine: str, budget=0.25, **offload) -> dict:
    return {"model": path, "engine": engine, "device": "cpu", "max_new_tokens": MAX_NEW, "threads": 1,
            "offload": {"expert_budget": budget, **offload}}


def on_tmpfs(path: str) -> bool:
    """Whether ``path`` lives in memory (tmpfs keeps no separate page cache to drop)."""
    real, best, fs_type = os.path.realpath(path), "", ""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            mount_point, kind = line.split()[1:3]
            if (real == mount_point or real.startswith(mount_point.rstrip("/") + "/")) and len(mount_point) > len(best):
                best, fs_type = mount_point, kind
    return fs_type in ("tmpfs", "ramfs")


@pytest.fixture(scope="module")
def resident(checkpoint) -> dict:
    engine = specter.load(recipe(checkpoint, "resident"))
    result = engine.generate(PROMPTS)
    engine.close()
    return {"token_ids": result.token_ids, "report": result.report}


def layer_expert_bytes(resident_report) -> int:
    return resident_report["expert_budget"]["bytes"] // N_LAYERS


def test_disk_offload_matches_resident_and_keeps_to_the_budget(checkpoint, resident):
    engine = specter.load(recipe(checkpoint, "hf-offload", 0.25))
    try:
        result = engine.generate(PROMPTS)
        report = result.report
        assert result.token_ids == resident["token_ids"]
        assert all(len(ids) == MAX_NEW for ids in result.token_ids)  # random weights rarely hit EOS; keep it honest
        offload = report["offload"]
        assert offload["backend"] == "accelerate" and offload["tier"] == "disk"
        budget = report["expert_budget"]
        assert budget == {"experts": N_LAYERS * N_EXPERTS // 4, "bytes": layer_expert_bytes(resident["report"]),
                          "fraction": 0.25}
        # one layer's experts stay in memory, three layers' experts are on disk: the offload really happened
        all_experts = resident["report"]["expert_budget"]["bytes"]
        assert offload["offloaded_bytes"] > 0
        assert offload["modules_offloaded"] == N_LAYERS - 1
        assert offload["offloaded_bytes"] == all_experts - layer_expert_bytes(resident["report"])
        device = report["device_bytes"]
        assert device["cache"] == layer_expert_bytes(resident["report"])
        assert device["cache"] + offload["offloaded_bytes"] == all_experts
        assert device["dense"] == resident["report"]["device_bytes"]["dense"]
        assert device["total"] == device["dense"] + device["cache"] <= device["dense"] + budget["bytes"]
        # the offloaded experts are not materialised in memory (meta until accelerate's hook loads them)
        offloaded_params = [p for name, p in engine.model.named_parameters() if p.device.type == "meta"]
        assert sum(p.numel() * p.element_size() for p in offloaded_params) == offload["offloaded_bytes"]
        experts = [engine.model.get_submodule(f"model.layers.{i}.mlp.experts") for i in range(N_LAYERS)]
        assert [e.gate_up_proj.device.type for e in experts] == ["cpu"] + ["meta"] * (N_LAYERS - 1)
        assert list(engine.model.hf_device_map.values()).count("disk") == N_LAYERS - 1
        folder = offload["folder"]
        assert os.path.basename(folder).startswith("specter-hf-offload-")
        assert os.path.isdir(folder) and os.listdir(folder)
    finally:
        engine.close()
    assert not os.path.exists(folder)
    engine.close()  # idempotent


def test_page_cache_mode_follows_the_disk_tier_recipe(checkpoint, resident):
    """With the experts on disk and direct_io (a disk-tier recipe), accelerate's offloaded files are
    dropped from the page cache after each read, so every forward reads them from storage again;
    otherwise the page cache serves them. Either way the wait and the bytes are reported."""
    forwards = sum(MAX_NEW for _ in PROMPTS)  # one prefill and MAX_NEW - 1 decode steps per prompt
    reports = {}
    for drop in (True, False):
        engine = specter.load(recipe(checkpoint, "hf-offload", 0.25, experts_on="disk" if drop else "host",
                                     link={"kind": "disk" if drop else "auto"}))
        try:
            folder = engine.offload_folder
            result = engine.generate(PROMPTS)
        finally:
            engine.close()
        assert result.token_ids == resident["token_ids"]
        reports[drop] = result.report
    dropped, cached = reports[True], reports[False]
    assert dropped["offload"]["page_cache"] == dropped["link"]["io"] == "memory-mapped, pages dropped after each read"
    assert cached["offload"]["page_cache"] == cached["link"]["io"] == "memory-mapped, page cache allowed"
    for report in (dropped, cached):
        assert report["link"]["kind"] == "accelerate-disk-offload"
        assert 0 < report["transfer_wait_s"] <= report["link"]["busy_s"]  # decode only <= the whole run
        assert 0 < report["io_wait_share"] <= 1
    if os.path.exists("/proc/self/io") and not on_tmpfs(folder):
        # every forward reads at least its top-2 experts of each offloaded layer from storage again
        top2_per_forward = dropped["offload"]["offloaded_bytes"] * 2 // N_EXPERTS
        assert dropped["link"]["bytes_read"] >= 0.9 * top2_per_forward * forwards
        assert dropped["link"]["read_gbps"] > 0
        assert cached["link"]["bytes_read"] < 0.1 * dropped["link"]["bytes_read"]


def test_full_budget_offloads_nothing(checkpoint, resident):
    engine = specter.load(recipe(checkpoint, "hf-offload", 1.0))
    result = engine.generate(PROMPTS)
    engine.close()
    assert result.token_ids == resident["token_ids"]
    offload = result.report["offload"]
    assert offload == {"backend": "accelerate", "tier": "disk", "offloaded_bytes": 0, "modules_offloaded": 0,
                       "folder": None, "page_cache": None}
    assert result.report["device_bytes"] == resident["report"]["device_bytes"]


def test_budget_below_one_step_is_refused(checkpoint):
    with pytest.raises(BudgetError, match=r"^offload\.expert_budget: .*needs 2 experts") as info:
        specter.load(recipe(checkpoint, "hf-offload", {"experts": 1}))
    assert "\n" not in str(info.value)


def test_accelerate_refusal_is_one_line_and_removes_the_folder(checkpoint, monkeypatch):
    from transformers import AutoModelForCausalLM

    seen = {}

    def refuse(path, **kwargs):
        seen["folder"] = kwargs.get("offload_folder")
        assert os.path.isdir(seen["folder"])
        raise ValueError("The current `device_map` had weights offloaded to the disk.\nPlease provide ...")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    with pytest.raises(SpecterError, match=r"^offload\.expert_budget: hf-offload: accelerate refused") as info:
        specter.load(recipe(checkpoint, "hf-offload", 0.25))
    assert "\n" not in str(info.value)
    assert not os.path.exists(seen["folder"])


def test_loading_shows_no_weight_loading_bar_unless_verbose(checkpoint, capfd, monkeypatch):
    from transformers.utils import logging as transformers_logging

    monkeypatch.delenv("SPECTER_VERBOSE", raising=False)
    transformers_logging.enable_progress_bar()  # as on a terminal: the bar is on until a load hides it
    capfd.readouterr()
    engine = specter.load(recipe(checkpoint, "hf-offload", 0.25))
    engine.close()
    assert "Loading weights" not in capfd.readouterr().err  # the CLI is quiet about third-party chatter
    assert transformers_logging.is_progress_bar_enabled()  # restored afterwards


def test_an_offload_folder_removed_while_the_engine_lives_is_one_line_naming_it(checkpoint):
    """A temp-directory cleaner (or a user) removing accelerate's offload folder mid-run: the next
    forward cannot read the offloaded experts; that is a SpecterError naming the folder, not a
    FileNotFoundError traceback from inside accelerate."""
    import shutil

    engine = specter.load(recipe(checkpoint, "hf-offload", 0.25))
    try:
        folder = engine.offload_folder
        shutil.rmtree(folder)
        with pytest.raises(SpecterError, match=r"^engine: hf-offload: accelerate could not read its offloaded "
                                               rf"weights \(offload folder {folder}\): FileNotFoundError") as info:
            engine.generate(PROMPTS)
        assert "\n" not in str(info.value)
    finally:
        engine.close()
