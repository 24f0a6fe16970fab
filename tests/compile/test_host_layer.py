"""The fused cache step's per-layer host call: the op hands the host clones and checks its answer;
in an engine, each layer's experts are acquired live (misses load inside the fused step, no
rerun, no wait for every transfer in flight), each layer seen once by the observers."""

from __future__ import annotations

import pytest
import torch

import specter
from specter.compile import host_layer
from specter.testing.zoo import save_random_checkpoint

torch.set_num_threads(1)

PROMPTS = [[1, 17, 93, 4, 250, 31, 8, 66, 140, 7], [1, 200, 5, 77, 12]]


class Host:
    def __init__(self, answer: torch.Tensor) -> None:
        self.answer = answer
        self.seen: list = []

    def callback(self, row, x, top_k_index, top_k_weights):
        self.seen.append((row, x, top_k_index, top_k_weights))
        return self.answer


def test_the_op_calls_the_host_with_clones_and_returns_its_table_row():
    host = Host(torch.arange(6))
    handle = torch.tensor(host_layer.register(host.callback))
    x, index, weights = torch.randn(2, 4), torch.tensor([[0, 3], [5, 3]]), torch.rand(2, 2)
    try:
        row = host_layer.layer_slots(x, index, weights, 1, handle, 6)
    finally:
        host_layer.unregister(int(handle))
    assert torch.equal(row, torch.arange(6))
    (seen_row, seen_x, seen_index, seen_weights), = host.seen
    assert seen_row == 1 and torch.equal(seen_x, x) and torch.equal(seen_index, index)
    assert seen_x.data_ptr() != x.data_ptr()  # a clone the host may keep


def test_a_wrong_answer_or_a_missing_host_is_a_clear_error():
    host = Host(torch.arange(5))
    handle = torch.tensor(host_layer.register(host.callback))
    x, index, weights = torch.randn(1, 4), torch.tensor([[0, 1]]), torch.rand(1, 2)
    with pytest.raises(RuntimeError, match=r"expected \(6,\) int64"):
        host_layer.layer_slots(x, index, weights, 0, handle, 6)
    host_layer.unregister(int(handle))
    with pytest.raises(RuntimeError, match="no host registered"):
        host_layer.layer_slots(x, index, weights, 0, handle, 6)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("host_layer") / "mixtral"
    return str(save_random_checkpoint("mixtral", path, seed=0, hidden=64, intermediate=64, layers=2))


def test_fused_cache_steps_load_misses_live_and_never_drain(checkpoint, monkeypatch):
    synchronous = {"kind": "local", "options": {"copy_thread": False}}
    recipe = {"model": checkpoint, "engine": "ondemand", "max_new_tokens": 12, "threads": 1, "compile": True,
              "offload": {"link": synchronous, "expert_budget": 0.25}}
    expected = specter.load({**recipe, "engine": "resident", "compile": False}).generate(PROMPTS).token_ids
    engine = specter.load(recipe)
    decoder = engine.compiled
    assert decoder.host_layers
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
