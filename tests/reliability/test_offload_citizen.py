"""``specter.offload(model)`` as a good citizen of transformers: autograd reaches the inputs,
a user's ``torch.compile`` does not trace the cache, ``save_pretrained`` saves the real experts,
switching the experts implementation is refused until ``remove()``."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import specter
from specter.errors import SpecterError
from specter.testing.zoo import random_model

IDS = torch.tensor([[1, 17, 93, 4, 250, 31, 8, 66, 140, 7]])


def input_gradient(model) -> torch.Tensor:
    embeds = model.get_input_embeddings()(IDS).detach().requires_grad_(True)
    model(inputs_embeds=embeds).logits.square().mean().backward()
    return embeds.grad


@pytest.mark.parametrize("budget", [1.0, 0.25])
def test_gradients_reach_the_inputs_through_offloaded_experts(budget):
    expected = input_gradient(random_model("mixtral", seed=0))
    model = random_model("mixtral", seed=0)
    handle = specter.offload(model, expert_budget=budget, link="local")
    got = input_gradient(model)
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-4)
    handle.remove()


def test_a_users_torch_compile_does_not_trace_the_cache_or_recompile_as_it_changes():
    torch._dynamo.reset()
    reference = random_model("mixtral", seed=0)
    model = random_model("mixtral", seed=0)
    handle = specter.offload(model, expert_budget=0.25, link="local")
    compiled = torch.compile(model, backend="eager")
    before = dict(torch._dynamo.utils.counters["stats"])
    for seed in range(6):  # different routings: the cache's contents change between calls
        ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            assert torch.allclose(compiled(ids).logits, reference(ids).logits, atol=1e-5)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before.get("unique_graphs", 0)
    assert handle.stats.evictions > 0
    assert graphs <= 8  # a fixed set of graphs between the experts' graph breaks, not one per cache state
    assert "recompile_limit" not in str(torch._dynamo.utils.counters.get("recompiles", {}))
    handle.remove()


def test_save_pretrained_writes_the_real_expert_weights(tmp_path):
    original = random_model("mixtral", seed=0)
    with torch.no_grad():
        expected = original(IDS).logits
    handle = specter.offload(original, expert_budget=0.25, link="local")
    original.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    with torch.no_grad():
        assert torch.allclose(reloaded(IDS).logits, expected, atol=1e-5)
        assert torch.allclose(original(IDS).logits, expected, atol=1e-5)  # still offloaded and right
    handle.remove()


def test_switching_the_experts_implementation_while_offloaded_is_refused():
    model = random_model("mixtral", seed=0)
    handle = specter.offload(model, expert_budget=0.5, link="local")
    with pytest.raises(SpecterError, match="call the offload handle's remove\\(\\) before set_experts_implementation"):
        model.set_experts_implementation("eager")
    handle.remove()
    model.set_experts_implementation("eager")  # allowed again
    with torch.no_grad():
        model(IDS)
