"""``ExpertRuntime``'s waves: a layer whose experts are still copying is computed as they arrive,
with the bits of one pass, and its early experts' slots go to the next predictions at once."""

from __future__ import annotations

import torch

import specter

torch.set_num_threads(1)
PROMPTS = [[1, 17, 93, 4, 250, 31, 8, 66, 140, 7, 201, 55], [1, 200, 5, 77, 12]]
SLOW = {"kind": "emulated", "gbps": 0.02, "latency_us": 200}  # a tiny expert's copy takes ~5 ms


def load(path: str, engine: str, link: dict, budget: float = 0.25):
    return specter.load({"model": path, "engine": engine, "max_new_tokens": 10, "threads": 1, "dtype": "float32",
                         "offload": {"link": link, "expert_budget": budget},
                         "speculation": {"governor": {"name": "fixed", "k": 4}}})


def count_releases(engine) -> list:
    calls = []
    forward = engine.runtime.on_release

    def on_release(layer, experts):
        calls.append((layer, list(experts)))
        if forward is not None:
            forward(layer, experts)
    engine.runtime.on_release = on_release
    return calls


def first_layer_inputs(engine, gen: torch.Generator, tokens: int) -> tuple:
    """(layer, experts module, hidden [T, H], top_k_index [T, 2], top_k_weights [T, 2]) for the
    engine's first MoE layer, drawn from ``gen``."""
    layer = min(engine.runtime.layers)
    module = engine.runtime.layers[layer].experts
    n_experts = engine.runtime.layers[layer].num_experts
    hidden = torch.randn(tokens, module.gate_up_proj.shape[-1], generator=gen)
    index = torch.stack([torch.randperm(n_experts, generator=gen)[:2] for _ in range(tokens)])
    return layer, module, hidden, index, torch.rand(tokens, 2, generator=gen)


def test_a_layer_computed_in_waves_has_the_bits_of_one_pass(zoo_mixtral):
    gen = torch.Generator().manual_seed(0)
    outputs = {}
    for waves in (True, False):
        with load(zoo_mixtral, "ondemand", SLOW, budget=0.5) as engine:
            engine.runtime.waves = waves
            releases = count_releases(engine)
            gen.manual_seed(0)
            layer, module, hidden, index, weights = first_layer_inputs(engine, gen, 6)
            for expert in index.unique().tolist()[::2]:  # half of them already copying, the rest on demand
                engine.cache.prefetch(layer, expert)
            with torch.inference_mode():
                outputs[waves] = engine.runtime.forward(layer, module, hidden, index, weights)
            assert engine.cache.pinned_keys() == set()
            if waves:  # every copy was still in flight: more than one wave, the early ones beside copies
                assert releases and engine.runtime.overlap_s > 0
            else:
                assert not releases and engine.runtime.overlap_s == 0
    assert torch.equal(outputs[True], outputs[False])


def test_waves_on_a_slow_link_decode_as_resident_and_hand_freed_slots_to_the_scheduler(zoo_mixtral):
    with load(zoo_mixtral, "resident", {"kind": "local"}) as reference:
        expected = reference.generate(PROMPTS).token_ids
    with load(zoo_mixtral, "specter", SLOW) as engine:
        releases = count_releases(engine)
        assert engine.generate(PROMPTS).token_ids == expected
        assert releases and engine.scheduler.stats.streamed > 0


def test_a_layer_whose_experts_are_all_ready_is_one_native_wave_with_the_bits_of_one_pass(zoo_mixtral, monkeypatch):
    from specter.kernels import grouped_experts

    gen = torch.Generator().manual_seed(1)
    outputs, waves_computed = {}, []
    compute = grouped_experts.PairsByExpert.compute

    def counted(self, experts, slots, gate_up, down):
        waves_computed.append(list(experts))
        return compute(self, experts, slots, gate_up, down)
    monkeypatch.setattr(grouped_experts.PairsByExpert, "compute", counted)
    for waves in (True, False):
        with load(zoo_mixtral, "ondemand", {"kind": "local"}, budget=0.5) as engine:
            engine.runtime.waves = waves
            gen.manual_seed(1)
            layer, module, hidden, index, weights = first_layer_inputs(engine, gen, 5)
            needed = index.unique().tolist()
            engine.cache.preload([(layer, e) for e in needed])  # READY before the layer starts
            waves_computed.clear()
            with torch.inference_mode():
                outputs[waves] = engine.runtime.forward(layer, module, hidden, index, weights)
            assert engine.cache.pinned_keys() == set()
            # waves: the whole layer in one PairsByExpert call; without waves, the one-pass kernel
            assert waves_computed == ([needed] if waves else [])
    assert torch.equal(outputs[True], outputs[False])


def test_blocked_experts_are_refused_off_the_cpu_rather_than_read_as_the_standard_layout():
    """Off the CPU the slot math is transformers' own, which would read blocked bits (a CPU
    layout) as [out, in] weights: a clear error instead of wrong numbers."""
    import pytest

    from specter.errors import SpecterError
    from specter.experts.runtime import _grouped_experts_forward
    from specter.model.expert_layout import mark

    class Blocked:
        pass

    view = Blocked()
    mark(view, True)
    hidden = torch.empty(3, 64, device="meta")
    with pytest.raises(SpecterError, match="experts stored blocked .* cannot be computed on meta"):
        _grouped_experts_forward(view, hidden, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))
