"""The fused cache step's per-layer host call: the ops hand the host clones and check its answer;
in an engine, each layer's experts are acquired live (misses load inside the fused step, no
rerun, no wait for every transfer in flight), each layer seen once by the observers; a host that
computes large experts computes a layer's early ones while its later ones still copy."""

from __future__ import annotations

import pytest
import torch

import specter
from specter.compile import host_layer
from specter.compile.parts import StepOutput

torch.set_num_threads(1)

PROMPTS = [[1, 17, 93, 4, 250, 31, 8, 66, 140, 7], [1, 200, 5, 77, 12]]


class Host:
    def __init__(self, answer: torch.Tensor) -> None:
        self.answer = answer
        self.seen: list = []

    def callback(self, row, x, top_k_index, top_k_weights):
        self.seen.append((row, x, top_k_index, top_k_weights))
        return self.answer


def call(op: str, host: Host, x, index, weights, row: int):
    handle = torch.tensor(host_layer.register(host.callback))
    try:
        if op == "layer_slots":
            return host_layer.layer_slots(x, index, weights, row, handle, 6)
        return getattr(host_layer, op)(x, index, weights, row, handle)
    finally:
        host_layer.unregister(int(handle))


def test_the_draft_routing_op_tells_the_host_and_returns_a_copy_of_its_input():
    x, index, weights = torch.randn(1, 4), torch.tensor([[2, 0]]), torch.rand(1, 2)
    host = Host(None)
    out = call("layer_routed", host, x, index, weights, 3)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    (seen_row, seen_x, seen_index, _), = host.seen
    assert seen_row == 3 and torch.equal(seen_x, x) and torch.equal(seen_index, index)


@pytest.mark.parametrize("op", ["layer_slots", "layer_experts"])
def test_the_op_calls_the_host_with_clones_and_returns_its_answer(op):
    x, index, weights = torch.randn(2, 4), torch.tensor([[0, 3], [5, 3]]), torch.rand(2, 2)
    answer = torch.arange(6) if op == "layer_slots" else torch.randn(2, 4)
    host = Host(answer)
    assert torch.equal(call(op, host, x, index, weights, 1), answer)
    (seen_row, seen_x, seen_index, seen_weights), = host.seen
    assert seen_row == 1 and torch.equal(seen_x, x) and torch.equal(seen_index, index)
    assert seen_x.data_ptr() != x.data_ptr()  # a clone the host may keep


@pytest.mark.parametrize("op, wrong, expected", [("layer_slots", torch.arange(5), r"expected \(6,\) int64"),
                                                 ("layer_experts", torch.zeros(1, 5), r"expected \(1, 4\) torch.float32")])
def test_a_wrong_answer_or_a_missing_host_is_a_clear_error(op, wrong, expected):
    x, index, weights = torch.randn(1, 4), torch.tensor([[0, 1]]), torch.rand(1, 2)
    with pytest.raises(RuntimeError, match=expected):
        call(op, Host(wrong), x, index, weights, 0)
    handle = torch.tensor(host_layer.register(Host(wrong).callback))  # its callback's owner is gone
    with pytest.raises(RuntimeError, match="no host registered"):
        getattr(host_layer, op)(x, index, weights, 0, handle, *([6] if op == "layer_slots" else []))


def specter_recipe(zoo_mixtral: str, budget: float, k: int, tokens: int) -> dict:
    return {"model": zoo_mixtral, "engine": "specter", "max_new_tokens": tokens, "threads": 1, "compile": True,
            "offload": {"link": {"kind": "local"}, "expert_budget": budget},
            "speculation": {"governor": {"name": "fixed", "k": k}}}


def resident_tokens(recipe: dict) -> list:
    """The eager resident engine's greedy tokens for PROMPTS under ``recipe``."""
    return specter.load({**recipe, "engine": "resident", "compile": False}).generate(PROMPTS).token_ids


@pytest.mark.parametrize("computes", [False, True])
def test_fused_cache_steps_load_misses_live_and_never_drain(zoo_mixtral, monkeypatch, computes):
    monkeypatch.setattr(host_layer, "COMPUTES_MIN_BYTES", 0 if computes else 1 << 40)
    synchronous = {"kind": "local", "options": {"copy_thread": False}}
    recipe = {"model": zoo_mixtral, "engine": "ondemand", "max_new_tokens": 12, "threads": 1, "compile": True,
              "offload": {"link": synchronous, "expert_budget": 0.25}}
    expected = resident_tokens(recipe)
    engine = specter.load(recipe)
    decoder = engine.compiled
    assert decoder.host_layers and decoder.layer_host.computes == computes
    monkeypatch.setattr(engine.cache, "drain", lambda: pytest.fail("a fused step waited for every transfer"))
    seen: list = []
    engine.runtime.observers.append(lambda layer, hidden, index, weights, mode: seen.append((layer, mode)))
    before = decoder.snapshot()
    report = engine.generate(PROMPTS).report
    engine.close()
    assert [o["token_ids"] for o in report["outputs"]] == expected
    steps = decoder.stats.fused_steps - before.fused_steps
    layered = decoder.stats.layered_steps - before.layered_steps
    assert steps >= 3  # the chooser tries the fused path at least TRIALS times
    assert decoder.stats.fused_misses == before.fused_misses  # misses load inside the step
    assert report["cache"]["decode"]["misses"] > 0
    assert [layer for layer, _ in seen] == [0, 1] * (steps + layered)  # each layer once per step, in order


def test_a_host_that_computes_a_layer_computes_its_first_experts_while_its_others_still_copy(zoo_mixtral, monkeypatch):
    monkeypatch.setattr(host_layer, "COMPUTES_MIN_BYTES", 0)
    slow = {"kind": "emulated", "gbps": 0.02, "latency_us": 200}  # a tiny expert's copy takes ~2 ms
    recipe = {"model": zoo_mixtral, "engine": "ondemand", "max_new_tokens": 8, "threads": 1, "compile": True,
              "offload": {"link": slow, "expert_budget": 0.5}}
    expected = resident_tokens(recipe)
    engine = specter.load(recipe)
    decoder, runtime = engine.compiled, engine.runtime
    assert decoder.layer_host.computes  # so every decode step runs fused
    fused_target, overlap_in_fused = decoder._run_fused_target, []

    def run_fused_target(*args):
        before = runtime.overlap_s
        logits = fused_target(*args)
        overlap_in_fused.append(runtime.overlap_s - before)
        return logits
    monkeypatch.setattr(decoder, "_run_fused_target", run_fused_target)
    report = engine.generate(PROMPTS).report
    engine.close()
    assert [o["token_ids"] for o in report["outputs"]] == expected
    assert len(overlap_in_fused) >= 10 and decoder.stats.fused_misses == 0
    assert sum(overlap_in_fused) > 0  # some layer computed an early wave beside a copy still in flight


def test_the_host_computes_the_experts_that_hold_at_least_the_threshold(zoo_mixtral, monkeypatch):
    recipe = {"model": zoo_mixtral, "engine": "ondemand", "max_new_tokens": 4, "threads": 1, "compile": True,
              "offload": {"link": {"kind": "local"}, "expert_budget": 0.5}}
    engine = specter.load(recipe)
    expert_bytes = sum(slots[0].nbytes for slots in engine.cache.slots.values())
    assert expert_bytes < host_layer.COMPUTES_MIN_BYTES and not engine.compiled.layer_host.computes
    for threshold, computes in ((expert_bytes, True), (expert_bytes + 1, False)):
        monkeypatch.setattr(host_layer, "COMPUTES_MIN_BYTES", threshold)
        assert host_layer.LayerHost(engine.runtime, []).computes is computes
    engine.close()


def test_a_computing_host_verifies_rounds_wider_than_the_cache_in_the_fused_step(zoo_mixtral, monkeypatch):
    monkeypatch.setattr(host_layer, "COMPUTES_MIN_BYTES", 0)
    recipe = specter_recipe(zoo_mixtral, 0.15, k=6, tokens=12)
    expected = resident_tokens(recipe)
    engine = specter.load(recipe)
    decoder = engine.compiled
    runtime, in_fused, needed = engine.runtime, [False], []
    fused_target, from_slots = decoder._run_fused_target, runtime._forward_from_slots

    def run_fused_target(*args):
        in_fused[0] = True
        try:
            return fused_target(*args)
        finally:
            in_fused[0] = False

    def forward_from_slots(layer, module, hidden, top_k_index, top_k_weights):
        if in_fused[0]:
            needed.append(top_k_index.unique().numel())
        return from_slots(layer, module, hidden, top_k_index, top_k_weights)
    monkeypatch.setattr(decoder, "_run_fused_target", run_fused_target)
    monkeypatch.setattr(runtime, "_forward_from_slots", forward_from_slots)
    report = engine.generate(PROMPTS).report
    capacity = engine.cache.capacity
    engine.close()
    assert [o["token_ids"] for o in report["outputs"]] == expected
    assert max(needed) > capacity  # a fused verification's layer needed more experts than the cache holds
    assert decoder.stats.fused_misses == 0


def test_a_fused_draft_step_tells_the_observers_each_layer_while_it_runs(zoo_mixtral, monkeypatch):
    recipe = specter_recipe(zoo_mixtral, 0.5, k=3, tokens=10)
    expected = resident_tokens(recipe)
    engine = specter.load(recipe)
    decoder = engine.compiled
    monkeypatch.setattr(decoder, "lean_step", None)  # no lean step (as where the native kernels do not serve)
    monkeypatch.setattr(decoder.chooser, "held", lambda key: "fused")  # every draft step runs the fused graph
    replay = StepOutput.replay
    monkeypatch.setattr(StepOutput, "replay", lambda out, runtime, cache, mode: pytest.fail(
        "a draft step was replayed after it ran") if mode == "draft" else replay(out, runtime, cache, mode))
    seen: list = []
    engine.runtime.observers.append(
        lambda layer, hidden, index, weights, mode: seen.append((layer, decoder.layer_host._live)) if mode == "draft" else None)
    before = decoder.snapshot()
    report = engine.generate(PROMPTS).report
    engine.close()
    assert [o["token_ids"] for o in report["outputs"]] == expected
    steps = decoder.stats.draft_steps - before.draft_steps
    assert steps > 0 and seen == [(0, True), (1, True)] * steps  # every layer, in order, inside the step


@pytest.mark.parametrize("computes", [False, True])
def test_the_chooser_discounts_transfer_waits_only_where_both_paths_wait_alike(zoo_mixtral, monkeypatch, computes):
    monkeypatch.setattr(host_layer, "COMPUTES_MIN_BYTES", 0 if computes else 1 << 40)
    recipe = {"model": zoo_mixtral, "engine": "ondemand", "max_new_tokens": 2, "threads": 1, "compile": True,
              "offload": {"link": {"kind": "local"}, "expert_budget": 0.5}}
    engine = specter.load(recipe)
    decoder, passed = engine.compiled, {}
    monkeypatch.setattr(decoder.chooser, "run", lambda key, fused, layered, waited_s, sync: passed.update(w=waited_s))
    decoder._run_chosen(5, lambda: None, lambda: None)
    before = passed["w"]()
    engine.cache.stats.transfer_wait_s += 0.5
    after = passed["w"]()
    engine.close()
    assert after - before == pytest.approx(0.5 if computes else 0.0)


@pytest.mark.parametrize("computes", [False, True])
def test_a_computing_host_runs_every_verification_fused_and_others_let_the_chooser_pick(zoo_mixtral, monkeypatch,
                                                                                       computes):
    monkeypatch.setattr(host_layer, "COMPUTES_MIN_BYTES", 0 if computes else 1 << 40)
    recipe = specter_recipe(zoo_mixtral, 0.5, k=3, tokens=10)
    expected = resident_tokens(recipe)
    engine = specter.load(recipe)
    decoder, keys = engine.compiled, []
    run = decoder.chooser.run

    def recording_run(key, fused, layered, waited_s, sync):
        keys.append(key)
        return run(key, fused, layered, waited_s, sync)
    monkeypatch.setattr(decoder.chooser, "run", recording_run)
    before = decoder.snapshot()
    report = engine.generate(PROMPTS).report
    engine.close()
    assert [o["token_ids"] for o in report["outputs"]] == expected
    if computes:  # the same waves on both paths: no trials, every verification fused
        assert keys == [] and decoder.stats.fused_steps - before.fused_steps > 0
        assert decoder.stats.layered_steps - before.layered_steps == len(PROMPTS)  # the prefills only
    else:  # verifications of k + 1 = 4 tokens, chosen per width
        assert 4 in keys and all(key >= 1 for key in keys)


def test_a_fused_step_frees_the_previous_layers_slots_before_the_observers_hear_of_the_next():
    # the scheduler's advance (an observer) streams the round's next predictions into the slots
    # the layers behind have freed: told first, it found them still held
    log: list = []

    class Cache:
        capacity = 8
        slot_table = torch.zeros(2, 6, dtype=torch.long)
        table_rows = {0: 0, 1: 1}

        def acquire(self, row, experts):
            log.append(("acquire", row, experts))

        def release(self, row, experts):
            log.append(("release", row, experts))

    class Runtime:
        cache = Cache()
        layers = {0: type("Layer", (), {"top_k": 2})(), 1: type("Layer", (), {"top_k": 2})()}
        layers_computed_in_graph = 0

        def notify(self, row, x, top_k_index, top_k_weights):
            log.append(("notify", row))

    runtime = Runtime()
    host = host_layer.LayerHost(runtime, [None, None], computes=False)
    x, weights = torch.zeros(1, 4), torch.ones(1, 2)
    with host.live():
        host(0, x, torch.tensor([[0, 3]]), weights)
        host(1, x, torch.tensor([[5, 1]]), weights)
    assert log == [("notify", 0), ("acquire", 0, [0, 3]), ("release", 0, [0, 3]), ("notify", 1),
                   ("acquire", 1, [1, 5]), ("release", 1, [1, 5])]
    assert runtime.layers_computed_in_graph == 2  # the graph computed both layers: no kernel time for the host
