"""The speculative engines on tiny random checkpoints: greedy ``specter`` and ``router-lookahead``
produce exactly the ``resident`` engine's tokens, stop exactly at ``max_new_tokens`` or EOS, fill
the report's speculation fields, and sample reproducibly.

Architectures: Mixtral (plain), Qwen2-MoE (shared experts beside the routed ones) and GPT-OSS
(sliding-window attention layers whose KV cache is cropped after every round; the first prompt
is longer than the 32-token window so the crop happens inside a full window).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import specter
from specter.decode.speculative import build_draft

torch.set_num_threads(1)

ARCHS = ("mixtral", "qwen2_moe", "gpt_oss")
VOCAB = 256
MAX_NEW = 16
PROMPTS = [
    [1, 17, 93, 4, 250, 31, 8, 66, 140, 7, 201, 55, 3, 9, 120, 44, 61, 180, 23, 99,
     5, 77, 12, 230, 160, 41, 88, 19, 147, 203, 36, 71, 11, 190, 64, 128, 15, 222, 90, 50],
    [1, 200, 5, 77, 12],
]


def recipe(path: str, engine: str, budget: float = 0.25, k: int = 3, max_new: int = MAX_NEW, **extra) -> dict:
    data = {"model": path, "engine": engine, "max_new_tokens": max_new, "threads": 1, "dtype": "float32",
            "offload": {"link": {"kind": "local"}, "expert_budget": budget},
            "speculation": {"governor": {"name": "fixed", "k": k}}}
    data.update(extra)
    return data


def generate(path: str, engine: str, prompts=PROMPTS, **kw):
    runner = specter.load(recipe(path, engine, **kw))
    try:
        return runner.generate(prompts)
    finally:
        runner.close()


@pytest.fixture(scope="module")
def resident(zoo_checkpoints) -> dict[str, list[list[int]]]:
    return {arch: generate(zoo_checkpoints[arch], "resident").token_ids for arch in ARCHS}


@pytest.mark.parametrize("budget", (0.25, 0.5))
@pytest.mark.parametrize("k", (1, 3, 6))
@pytest.mark.parametrize("arch", ARCHS)
def test_specter_greedy_equals_resident(arch, k, budget, zoo_checkpoints, resident):
    result = generate(zoo_checkpoints[arch], "specter", k=k, budget=budget)
    assert result.token_ids == resident[arch], f"{arch}, k={k}, budget={budget}"
    assert all(len(ids) == MAX_NEW for ids in result.token_ids)  # the zoo models never emit EOS (2) here


@pytest.mark.parametrize("mode", ("conservative", "lazy"))
@pytest.mark.parametrize("engine", ("specter", "router-lookahead"))
@pytest.mark.parametrize("arch", ARCHS)
def test_conservative_and_lazy_prefetch_keep_the_tokens(arch, engine, mode, zoo_checkpoints, resident):
    runner = specter.load(recipe(zoo_checkpoints[arch], engine, budget=0.25, k=4,
                                 offload={"link": {"kind": "local"}, "expert_budget": 0.25,
                                          "prefetch": mode, "cache_policy": {"name": "lookahead"}}))
    with runner:
        assert (runner.scheduler.conservative, runner.scheduler.lazy) == (mode == "conservative", mode == "lazy")
        result = runner.generate(PROMPTS)
        assert result.token_ids == resident[arch]
        assert result.report["prediction"]["prefetch_mode"] == mode
        assert result.report["prediction"]["conservative_now"] is (mode == "conservative")
        assert result.report["prediction"]["lazy_now"] is (mode == "lazy")
        if engine == "specter" and mode == "lazy":
            assert result.report["prediction"]["issued_while_drafting"] == 0


def test_auto_prefetch_turns_conservative_on_a_link_that_keeps_rounds_waiting(zoo_checkpoints, resident):
    """The default ``offload.prefetch: auto`` on an emulated link whose every copy costs 3 ms: the
    rounds wait on copies most of their time, so the scheduler is conservative by the end."""
    link = {"kind": "emulated", "gbps": 1.0, "latency_us": 3000}
    runner = specter.load(recipe(zoo_checkpoints["mixtral"], "specter", k=4,
                                 offload={"link": link, "expert_budget": 0.25}))
    try:
        result = runner.generate(PROMPTS)
    finally:
        runner.close()
    assert result.token_ids == resident["mixtral"]
    prediction = result.report["prediction"]
    assert prediction["prefetch_mode"] == "auto"
    assert prediction["transfer_wait_share"] > 0.25 and prediction["conservative_now"] is True


@pytest.mark.parametrize("arch", ARCHS)
def test_router_lookahead_equals_resident(arch, zoo_checkpoints, resident):
    result = generate(zoo_checkpoints[arch], "router-lookahead", budget=0.25)
    assert result.token_ids == resident[arch]
    prediction = result.report["prediction"]
    assert prediction["predictor"] == "router-lookahead"
    assert 0.0 <= prediction["recall"] <= 1.0
    assert result.report["acceptance_rate"] is None and result.report["k"] is None  # no speculation


@pytest.mark.parametrize("max_new", (1, 2, 3, 5, 8))
def test_max_new_tokens_is_exact_even_when_k_exceeds_what_is_left(max_new, zoo_checkpoints, resident):
    result = generate(zoo_checkpoints["mixtral"], "specter", k=6, max_new=max_new)
    assert [len(ids) for ids in result.token_ids] == [max_new] * len(PROMPTS)
    assert result.token_ids == [ids[:max_new] for ids in resident["mixtral"]]
    assert result.report["new_tokens"] == max_new * len(PROMPTS)
    histogram = (result.report["k"] or {}).get("histogram", {})
    # a round never drafts more than can still be emitted: k + 1 <= max_new - (tokens so far >= 1)
    assert all(int(k) <= max_new - 2 for k in histogram)


def with_eos(src: str, dst: Path, eos: int | list[int]) -> str:
    shutil.copytree(src, dst)
    config_path = dst / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = eos
    config_path.write_text(json.dumps(config))
    return str(dst)


@pytest.mark.parametrize("arch, listed", [("mixtral", False), ("gpt_oss", False), ("mixtral", True)])
def test_eos_stops_generation(arch, listed, zoo_checkpoints, resident, tmp_path):
    """Any end-of-sequence id ends a prompt, also the second of a list (Qwen2/3-MoE and GPT-OSS
    ship several), as in transformers' generate."""
    reference = resident[arch][0]
    # a token the model emits in the middle of prompt 0's output, for the first time there
    position = max(p for p in range(2, MAX_NEW - 2) if reference[p] not in reference[:p])
    eos = reference[position]
    unused = next(t for t in range(3, 256) if all(t not in ids for ids in resident[arch]))
    path = with_eos(zoo_checkpoints[arch], tmp_path / "eos", [unused, eos] if listed else eos)

    def truncated(ids: list[int]) -> list[int]:
        return ids[: ids.index(eos) + 1] if eos in ids else ids

    expected = [truncated(ids) for ids in resident[arch]]
    assert len(expected[0]) == position + 1 < MAX_NEW
    assert generate(path, "resident").token_ids == expected
    for k in (3, 6):
        result = generate(path, "specter", k=k)
        assert result.token_ids == expected, f"k={k}"
        assert result.report["new_tokens"] == sum(len(ids) for ids in expected)


def test_report_fields_of_a_specter_run(zoo_checkpoints):
    k = 3
    report = generate(zoo_checkpoints["qwen2_moe"], "specter", k=k, budget=0.25).report
    assert report["engine"] == "specter"
    assert 0.0 <= report["acceptance_rate"] <= 1.0
    assert 1.0 <= report["mean_accepted_per_step"] <= k + 1
    histogram = {int(key): n for key, n in report["k"]["histogram"].items()}
    assert histogram and all(0 <= key <= k and n > 0 for key, n in histogram.items())  # 0: the last token alone
    rounds, drafted = sum(histogram.values()), sum(key * n for key, n in histogram.items())
    assert report["k"]["mean"] == pytest.approx(drafted / rounds)
    accepted = report["acceptance_rate"] * drafted
    assert report["mean_accepted_per_step"] == pytest.approx((accepted + rounds) / rounds)
    assert 0.0 <= report["hit_rate"] <= 1.0
    assert report["prefetch_precision"] is not None and 0.0 <= report["prefetch_precision"] <= 1.0
    device_bytes = report["device_bytes"]
    assert device_bytes["draft"] > 0 and device_bytes["cache"] > 0 and device_bytes["dense"] > 0
    assert device_bytes["total"] == device_bytes["dense"] + device_bytes["cache"] + device_bytes["draft"]
    all_expert_bytes = report["model"]["expert_bytes"] * report["model"]["n_moe_layers"] * report["model"]["n_experts"]
    assert device_bytes["cache"] <= 0.25 * all_expert_bytes
    assert device_bytes["draft"] < all_expert_bytes / 2  # INT4 (plus scales) is well under half of fp32
    assert report["new_tokens"] == sum(len(o["token_ids"]) for o in report["outputs"]) == MAX_NEW * len(PROMPTS)
    assert report["draft"]["bits"] == 4
    phases = report["phases"]  # on a CPU the verification's expert kernels are timed, inside its compute time
    assert 0.0 < phases["verify_kernel_s"] < phases["verify_s"] - phases["verify_io_wait_s"]
    assert phases["verify_kernel_s_per_expert"] == pytest.approx(phases["verify_kernel_s"] / phases["experts_read"])


@pytest.mark.parametrize("link, routing_step", [({"kind": "local", "options": {"copy_thread": False}}, False),
                                                ({"kind": "local", "options": {"copy_thread": True}}, True),
                                                ({"kind": "emulated", "gbps": 50.0, "latency_us": 1}, True)])
def test_the_routing_only_draft_step_runs_only_where_a_copy_can_hide_behind_it(link, routing_step, zoo_checkpoints,
                                                                                resident):
    result = generate(zoo_checkpoints["mixtral"], "specter", k=3, offload={"link": link, "expert_budget": 0.25})
    assert result.token_ids == resident["mixtral"]
    report = result.report
    histogram = {int(key): n for key, n in report["k"]["histogram"].items()}
    drafted = sum(key * n for key, n in histogram.items())
    drafting_rounds = sum(n for key, n in histogram.items() if key)
    assert report["phases"]["draft_steps"] == drafted + (drafting_rounds if routing_step else 0)
    assert report["draft"]["lookahead_last"] is routing_step


def test_no_routing_only_step_where_the_cache_holds_every_expert(zoo_checkpoints, resident):
    link = {"kind": "local", "options": {"copy_thread": True}}
    result = generate(zoo_checkpoints["mixtral"], "specter", k=3, offload={"link": link, "expert_budget": 1.0})
    assert result.token_ids == resident["mixtral"]
    report = result.report
    drafted = sum(int(key) * n for key, n in report["k"]["histogram"].items())
    assert drafted > 0 and report["phases"]["draft_steps"] == drafted
    assert report["draft"]["lookahead_last"] is False


def test_moving_to_another_link_tells_the_governor_and_stays_lossless(zoo_checkpoints, resident):
    from specter.memory.links import LocalLink

    engine = specter.load(recipe(zoo_checkpoints["mixtral"], "specter", speculation={"governor": {"name": "roofline"}}))
    try:
        slots_per_layer = engine.cache.capacity / len(engine.runtime.layers)
        assert engine.governor.cache_slots_per_layer == pytest.approx(slots_per_layer)  # the engine's context
        engine.generate(PROMPTS[:1])
        rounds = engine.governor.rounds
        engine.use_link(LocalLink())
        governor = engine.governor
        # the engine reports its transfer waits apart: they restart, the plain round is measured again
        assert governor.plain.samples == 0 and governor._calibration[:2] == [0, 0]
        assert not governor.wait.samples and governor._changed_at < rounds
        assert engine.generate(PROMPTS).token_ids == resident["mixtral"]
    finally:
        engine.close()


def test_build_draft_covers_every_moe_layer_and_stays_resident(zoo_checkpoints):
    from specter.model.loader import load_model

    model, layers, store = load_model(Path(zoo_checkpoints["mixtral"]), dtype=torch.float32, device=torch.device("cpu"),
                                      keep_experts_on_host=True)
    draft = build_draft(layers, store, torch.device("cpu"), group_size=64)
    assert sorted(draft) == [m.layer for m in layers]
    hidden = torch.randn(3, model.config.hidden_size)
    index = torch.tensor([[0, 1], [2, 3], [1, 2]])
    weights = torch.full((3, 2), 0.5)
    for info in layers:
        out = draft[info.layer].forward(hidden, index, weights)
        assert out.shape == hidden.shape and torch.isfinite(out).all()
        assert draft[info.layer].nbytes > 0


SAMPLING = {"temperature": 0.8, "top_p": 0.9}


@pytest.mark.parametrize("engine", ("specter", "resident"))
def test_sampling_is_reproducible_and_in_vocab(engine, zoo_checkpoints):
    path = zoo_checkpoints["mixtral"]
    first = generate(path, engine, k=3, sampling=SAMPLING, seed=7)
    again = generate(path, engine, k=3, sampling=SAMPLING, seed=7)
    other = generate(path, engine, k=3, sampling=SAMPLING, seed=8)
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids
    for ids in first.token_ids:
        assert 1 <= len(ids) <= MAX_NEW and all(0 <= t < VOCAB for t in ids)
        assert len(ids) == MAX_NEW or ids[-1] == 2  # stops early only at EOS
    if engine == "specter":
        assert 0.0 <= first.report["acceptance_rate"] <= 1.0
        assert first.report["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 0}


@pytest.mark.parametrize("engine_name, method", [("specter", "flush"), ("router-lookahead", "advance")])
def test_an_exception_inside_a_round_leaves_no_round_open(engine_name, method, zoo_checkpoints, resident):
    """A round cut short by an exception (here the scheduler's third ``flush`` / ``advance``
    call, inside a round) is closed before the exception propagates: nothing stays protected,
    and the next call's prefill prefetches nothing (a round left open had its layers stream the
    cut round's predictions in) and its tokens are the resident engine's."""
    engine = specter.load(recipe(zoo_checkpoints["mixtral"], engine_name))
    try:
        original, calls = getattr(engine.scheduler, method), []

        def failing(*args):
            calls.append(args)
            if len(calls) == 3:
                raise KeyboardInterrupt("cut inside a round")
            return original(*args)

        setattr(engine.scheduler, method, failing)
        with pytest.raises(KeyboardInterrupt):
            engine.generate(PROMPTS)
        delattr(engine.scheduler, method)  # the scheduler's own method again
        assert not engine.cache.protected_keys()
        result = engine.generate(PROMPTS)
        assert result.token_ids == resident["mixtral"]
        assert result.report["cache"]["prefill"]["prefetch_issued"] == 0
    finally:
        engine.close()


def test_an_eos_inside_a_round_ends_the_tokens_and_the_tokens_per_round_there(zoo_checkpoints, resident):
    """The target accepts drafts past an EOS that ends the generation; they are never emitted,
    and the report's tokens per verification counts the tokens emitted (it counted them)."""
    tokens = resident["mixtral"][1]
    stop = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])  # first occurrence
    engine = specter.load(recipe(zoo_checkpoints["mixtral"], "specter", k=6))
    try:
        engine.eos_token_id = tokens[stop]
        report = engine.generate([PROMPTS[1]]).report
    finally:
        engine.close()
    assert report["outputs"][0]["token_ids"] == tokens[: stop + 1]
    rounds = sum(report["k"]["histogram"].values())
    assert report["mean_accepted_per_step"] == pytest.approx(stop / rounds)  # prefill's token is not a round's


def test_cut_short_means_the_generation_ends_not_a_predictor_proposing_fewer(zoo_checkpoints):
    """The governor's ``cut_short`` is set only where the engine drafted fewer than next_k() said
    because the generation ends after the round; an n-gram predictor proposing fewer (or none) is
    not a cut round (the roofline leaves cut rounds' waits out of its estimates)."""
    engine = specter.load(dict(recipe(zoo_checkpoints["mixtral"], "specter", k=5, max_new=20),
                               speculation={"governor": {"name": "fixed", "k": 5}, "predictor": {"name": "ngram"}}))
    seen, remaining = [], {}
    play_round, observe = engine.play_round, engine.governor.observe

    def round_(token, kv, generator, metrics, left, context):
        remaining["now"] = left
        return play_round(token, kv, generator, metrics, left, context)

    def observed(drafted, accepted, **timings):
        seen.append((drafted, remaining["now"], timings["cut_short"]))
        return observe(drafted, accepted, **timings)

    engine.play_round, engine.governor.observe = round_, observed
    engine.generate([[1] + list(range(3, 120)) + [10, 20]])
    engine.close()
    assert any(drafted < 5 <= left - 1 for drafted, left, _ in seen)  # the predictor proposed fewer somewhere
    assert all(cut == (left - 1 < 5) for _, left, cut in seen)
