"""Engines end to end on a tiny random Mixtral: every engine writes the whole ``specter.report/1``
schema, figures that do not apply are null, counters cover one ``generate`` call, budgets are
checked before anything runs."""

from __future__ import annotations

import json

import pytest
import torch

import specter
from specter.build import build_engine
from specter.decode.engine import ResidentEngine
from specter.errors import BudgetError, SpecterError
from specter.config import load_recipe
from specter.report.schema import REPORT_KEYS, SCHEMA

torch.set_num_threads(1)

ENGINES = ("resident", "ondemand", "router-lookahead", "specter")
PROMPTS = [[1, 17, 93, 4, 250, 31, 8, 66, 140, 7], [1, 200, 5, 77, 12]]
MAX_NEW = 8
N_LAYERS, N_EXPERTS, TOP_K = 2, 16, 2


def recipe(path: str, engine: str, **extra) -> dict:
    data = {"model": path, "engine": engine, "max_new_tokens": MAX_NEW, "threads": 1,
            "offload": {"link": {"kind": "local"}, "expert_budget": 0.25},
            "speculation": {"governor": {"k": 3}}}
    data.update(extra)
    return data


@pytest.fixture(scope="module")
def reports(zoo_mixtral) -> dict[str, dict]:
    out = {}
    for name in ENGINES:
        engine = specter.load(recipe(zoo_mixtral, name))
        out[name] = engine.generate(PROMPTS).report
        engine.close()
    return out


@pytest.mark.parametrize("name", ENGINES)
def test_every_report_key_is_present_and_json_serialisable(name, reports):
    report = reports[name]
    assert set(REPORT_KEYS) <= set(report)
    assert report["schema"] == SCHEMA and report["engine"] == name
    assert json.loads(json.dumps(report)) == report
    model = report["model"]
    assert (model["arch"], model["n_moe_layers"], model["n_experts"], model["top_k"]) == (
        "mixtral", N_LAYERS, N_EXPERTS, TOP_K)
    assert model["expert_bytes"] > 0
    assert (report["device"], report["dtype"], report["threads"]) == ("cpu", "float32", 1)
    assert report["prompts"] == len(PROMPTS)
    assert report["prompt_tokens"] == sum(len(p) for p in PROMPTS)
    assert report["new_tokens"] == MAX_NEW * len(PROMPTS)
    assert [o["token_ids"] for o in report["outputs"]] and all(len(o["token_ids"]) == MAX_NEW for o in report["outputs"])
    assert [o["prompt_tokens"] for o in report["outputs"]] == [len(p) for p in PROMPTS]
    assert report["ttft_s"] > 0 and report["wall_s"] > 0 and report["decode_tokens_per_s"] > 0
    assert {"torch", "transformers", "specter"} <= set(report["versions"])
    assert report["lossless"] is None  # only run_recipe checks it
    device_bytes = report["device_bytes"]
    assert set(device_bytes) == {"draft", "cache", "dense", "total"}
    assert device_bytes["total"] == device_bytes["dense"] + device_bytes["cache"] + (device_bytes["draft"] or 0)


def test_all_engines_emit_the_same_greedy_tokens(reports):
    tokens = {name: [o["token_ids"] for o in report["outputs"]] for name, report in reports.items()}
    assert all(t == tokens["resident"] for t in tokens.values()), tokens


def test_resident_report_has_no_offload_figures(reports):
    report = reports["resident"]
    for key in ("link", "hit_rate", "prefetch_precision", "bytes_transferred", "transfer_wait_s", "io_wait_share",
                "copies_per_token", "acceptance_rate", "mean_accepted_per_step", "k"):
        assert report[key] is None, key
    assert report["expert_budget"]["fraction"] == 1.0
    assert report["device_bytes"]["draft"] is None
    all_experts = report["model"]["expert_bytes"] * N_LAYERS * N_EXPERTS
    assert report["device_bytes"]["cache"] == report["expert_budget"]["bytes"] == all_experts


def test_ondemand_report(reports):
    report = reports["ondemand"]
    from specter.memory.links import _spare_core

    assert report["link"] == {"kind": "local", "gbps": None, "latency_us": None, "emulated": False,
                              "copy_thread": _spare_core()}
    budget = report["expert_budget"]
    assert budget["experts"] == int(0.25 * N_LAYERS * N_EXPERTS) and budget["fraction"] == pytest.approx(0.25)
    assert report["device_bytes"]["cache"] == budget["bytes"] == budget["experts"] * report["model"]["expert_bytes"]
    assert report["device_bytes"]["draft"] is None
    assert 0.0 <= report["hit_rate"] <= 1.0
    decode = report["cache"]["decode"]
    assert decode["hits"] + decode["misses"] == decode["acquired_keys"] > 0
    assert report["hit_rate"] == pytest.approx(decode["hits"] / decode["acquired_keys"])
    assert report["cache"]["prefill"]["misses"] > 0
    assert report["bytes_transferred"] >= decode["bytes_transferred"] > 0
    assert report["copies_per_token"] > 0
    for key in ("acceptance_rate", "mean_accepted_per_step", "k", "prefetch_precision"):
        assert report[key] is None, key


def test_offloaded_engines_dense_bytes_agree_and_exclude_experts(reports):
    resident, ondemand, spec = reports["resident"], reports["ondemand"], reports["specter"]
    assert ondemand["device_bytes"]["dense"] == spec["device_bytes"]["dense"] == resident["device_bytes"]["dense"]
    assert spec["device_bytes"]["cache"] == ondemand["device_bytes"]["cache"]
    assert spec["device_bytes"]["total"] > ondemand["device_bytes"]["total"]  # plus the resident INT4 draft


def test_counters_cover_one_generate_call(zoo_mixtral):
    engine = specter.load(recipe(zoo_mixtral, "ondemand"))
    first = engine.generate(PROMPTS).report
    second = engine.generate(PROMPTS).report
    engine.close()
    assert first["new_tokens"] == second["new_tokens"] == MAX_NEW * len(PROMPTS)
    assert second["cache"]["decode"]["acquired_keys"] == first["cache"]["decode"]["acquired_keys"]
    assert first["outputs"] == second["outputs"]


def test_emulated_link_is_labelled_and_waits_are_measured(zoo_mixtral):
    # 2 ms a transfer: a wait of 0 needs the copy done before the engine waits for it, which with
    # 50 us happened once in a CI run (every load of a short generation finished first)
    engine = specter.load(recipe(zoo_mixtral, "ondemand",
                                 offload={"link": {"kind": "emulated", "gbps": 0.5, "latency_us": 2000},
                                          "expert_budget": 0.25}))
    report = engine.generate(PROMPTS[:1]).report
    engine.close()
    assert report["link"] == {"kind": "emulated", "gbps": 0.5, "latency_us": 2000.0, "emulated": True}
    assert report["transfer_wait_s"] > 0
    assert 0.0 < report["io_wait_share"] <= 1.0


@pytest.mark.parametrize("engine", ("ondemand", "specter"))
def test_budget_below_top_k_raises_budget_error_naming_the_key(engine, zoo_mixtral):
    with pytest.raises(BudgetError, match="offload.expert_budget") as info:
        build_engine(load_recipe(recipe(zoo_mixtral, engine, offload={"expert_budget": {"experts": TOP_K - 1}})))
    assert f"needs {TOP_K} experts" in str(info.value)


def test_text_prompts_need_a_tokenizer(zoo_mixtral):
    engine = specter.load(recipe(zoo_mixtral, "resident"))
    assert isinstance(engine, ResidentEngine) and engine.tokenizer is None
    with pytest.raises(SpecterError, match="no tokenizer"):
        engine.generate(["def f(x):"])


def test_cuda_device_without_cuda_is_refused(zoo_mixtral):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SpecterError, match="device"):
        specter.load(recipe(zoo_mixtral, "resident", device="cuda"))


@pytest.mark.parametrize("name", ("resident", "specter"))
def test_on_tokens_streams_every_step_and_an_exception_cancels(name, zoo_mixtral):
    engine = specter.load(recipe(zoo_mixtral, name))
    seen: list[list[int]] = []
    result = engine.generate(PROMPTS[:1], on_tokens=lambda index, ids: seen.append(list(ids)))
    assert seen[0] == result.token_ids[0][:1] and seen[-1] == result.token_ids[0]
    assert all(a == b[: len(a)] and len(a) < len(b) for a, b in zip(seen, seen[1:]))

    class Stop(Exception):
        pass

    def stop_after_two(index, ids):
        if len(ids) >= 2:
            raise Stop

    with pytest.raises(Stop):
        engine.generate(PROMPTS[:1], on_tokens=stop_after_two)
    assert engine.generate(PROMPTS[:1]).token_ids == result.token_ids  # usable after a cancel
    engine.close()


def test_stop_decoding_ends_the_prompt_with_its_tokens_and_a_full_report(zoo_mixtral):
    from specter.decode.engine import StopDecoding

    engine = specter.load(recipe(zoo_mixtral, "specter"))
    full = engine.generate(PROMPTS[:2])

    def stop_after_five(index, ids):
        if index == 0 and len(ids) >= 5:
            raise StopDecoding

    cut = engine.generate(PROMPTS[:2], on_tokens=stop_after_five)
    first = cut.token_ids[0]
    assert 5 <= len(first) < len(full.token_ids[0]) and first == full.token_ids[0][: len(first)]
    assert cut.token_ids[1] == full.token_ids[1]  # the next prompt decodes in full
    assert cut.report["hit_rate"] is not None and cut.report["acceptance_rate"] is not None
    assert cut.report["new_tokens"] == len(first) + len(cut.token_ids[1])
    engine.close()


def test_per_call_sampling_and_seed_override_the_recipe(zoo_mixtral):
    from specter.decode.sampling import SamplingParams

    engine = specter.load(recipe(zoo_mixtral, "resident"))
    greedy = engine.generate(PROMPTS[:1]).token_ids
    hot = SamplingParams(temperature=5.0)
    first = engine.generate(PROMPTS[:1], sampling=hot, seed=7).token_ids
    assert engine.generate(PROMPTS[:1], sampling=hot, seed=7).token_ids == first
    assert first != greedy
    assert engine.generate(PROMPTS[:1]).token_ids == greedy  # the recipe's sampling is back
    engine.close()


@pytest.mark.parametrize("bad", (0, -5, 2.5, True))
def test_max_new_tokens_is_checked_like_the_recipe(bad, zoo_mixtral):
    engine = specter.load(recipe(zoo_mixtral, "resident"))
    with pytest.raises(SpecterError, match="max_new_tokens"):
        engine.generate(PROMPTS[:1], max_new_tokens=bad)
    engine.close()


def test_prompt_plus_generation_beyond_the_context_length_is_refused_before_work(zoo_mixtral):
    engine = specter.load(recipe(zoo_mixtral, "ondemand"))
    limit = engine.context_length
    assert limit is not None
    with pytest.raises(SpecterError, match=f"context length {limit}"):
        engine.generate([[1] * (limit - MAX_NEW + 1)])
    assert engine.cache.stats.acquired_keys == 0  # refused before any step ran
    with pytest.raises(SpecterError, match="context length"):
        engine.generate(PROMPTS[:1], max_new_tokens=limit)
    assert len(engine.generate([[1] * (limit - MAX_NEW)]).token_ids[0]) == MAX_NEW
    engine.close()


def test_generate_by_prompt_yields_between_prompts_and_times_only_its_own_work(zoo_mixtral):
    import time

    engine = specter.load(recipe(zoo_mixtral, "specter"))
    whole = engine.generate(PROMPTS)
    steps = engine.generate_by_prompt(PROMPTS)
    assert next(steps) == 0  # the first prompt is decoded; the second is not begun
    pause = 1.0 + 5 * whole.report["wall_s"]
    time.sleep(pause)  # other work between prompts (another engine's turn in the bench)
    with pytest.raises(StopIteration) as finished:
        next(steps)
    result = finished.value.value
    assert result.token_ids == whole.token_ids
    assert result.report["new_tokens"] == whole.report["new_tokens"]
    assert result.report["hit_rate"] is not None
    assert result.report["wall_s"] < pause  # the pause between prompts is not counted
    assert not torch.is_inference_mode_enabled()  # nothing leaks into the caller between prompts
    engine.close()


def test_leaving_a_with_block_closes_the_engine_and_its_link(zoo_mixtral):
    link = {"kind": "emulated", "gbps": 1.0}
    with specter.load(recipe(zoo_mixtral, "ondemand", offload={"expert_budget": 0.5, "link": link})) as engine:
        assert engine.link.alive
        engine.generate([[1, 17, 93]], max_new_tokens=2)
    assert not engine.link.alive


@pytest.mark.parametrize("name", ("ondemand", "specter"))
def test_an_engine_dropped_without_close_stops_its_copy_thread(name, zoo_mixtral):
    import gc

    link = {"kind": "emulated", "gbps": 1.0}
    engine = specter.load(recipe(zoo_mixtral, name, offload={"expert_budget": 0.5, "link": link}))
    engine.generate([[1, 17, 93]], max_new_tokens=4)
    worker = engine.link._worker
    del engine
    gc.collect()
    worker.join(timeout=5.0)
    assert not worker.is_alive()
