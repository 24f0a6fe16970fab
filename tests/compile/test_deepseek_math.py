"""DeepSeek-V2/V3's grouped routers choose the same experts with the same weights as the models'
own (their whole forward through the compiled math: ``test_model_weights``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specter.compile.deepseek_math import Groups, grouped_select
from specter.compile.model_weights import arch_of, unsupported_reason
from specter.testing.zoo import random_model, tiny_config


def _sorted(weights: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = index.argsort(dim=-1)
    return weights.gather(1, order), index.gather(1, order)


@pytest.mark.parametrize("arch, overrides", [
    ("deepseek_v2", {"topk_method": "greedy"}),
    ("deepseek_v2", {"topk_method": "group_limited_greedy", "routed_scaling_factor": 16.0}),
    ("deepseek_v3", {"norm_topk_prob": True}),
    ("deepseek_v3", {"norm_topk_prob": False, "routed_scaling_factor": 1.0}),
])
def test_the_grouped_routers_choose_as_the_models_own(arch: str, overrides: dict) -> None:
    model = random_model(tiny_config(arch, n_experts=16, **overrides), seed=3)
    gate = model.model.layers[-1].mlp.gate
    if arch == "deepseek_v3":  # a correction bias that changes the choice, not the weights
        gate.e_score_correction_bias.copy_(torch.randn(16, generator=torch.Generator().manual_seed(1)) * 0.2)
    x = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    _, expected_weights, expected_index = gate(x)
    groups = arch_of(model).groups
    bias = getattr(gate, "e_score_correction_bias", None)
    weights, index = grouped_select(groups, gate.top_k, F.linear(x, gate.weight), bias)
    expected_weights, expected_index = _sorted(expected_weights, expected_index)
    weights, index = _sorted(weights, index)
    assert torch.equal(index, expected_index)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)
    assert groups.topk_group == (0 if overrides.get("topk_method") == "greedy" else model.config.topk_group)


def test_group_limits_keep_the_choice_inside_the_best_groups() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0, 4.5, 0.0, 0.0, 0.0]])  # groups of two: {0,1} {2,3} {4,5} {6,7}
    groups = Groups(sigmoid=False, n_group=4, topk_group=1, renormalize=False, scaling=1.0)
    _, index = grouped_select(groups, 2, logits, None)
    assert sorted(index[0].tolist()) == [0, 1]  # expert 4 outscores 1 but lies in another group
    _, index = grouped_select(Groups(False, 4, 0, False, 1.0), 2, logits, None)
    assert sorted(index[0].tolist()) == [0, 4]


def test_unsupported_deepseek_options_say_what() -> None:
    reason = unsupported_reason(random_model(tiny_config("deepseek_v2", hidden_act="gelu")))
    assert "activation 'gelu'" in reason
