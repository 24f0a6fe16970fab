"""``gather_biased_experts`` (GPT-OSS's [in, out] experts with biases, per pair, as a compiled graph
reads them) against the model's own experts module."""

from __future__ import annotations

import torch

from specter.kernels.slot_experts import gather_biased_experts
from specter.testing.zoo import random_model, tiny_config


def test_biased_experts_per_pair_equal_gpt_oss_own_module() -> None:
    experts = random_model(tiny_config("gpt_oss"), seed=2).model.layers[0].mlp.experts
    with torch.no_grad():  # biases of every expert apart, so a wrong pick shows
        experts.gate_up_proj_bias.copy_(torch.randn_like(experts.gate_up_proj_bias))
        experts.down_proj_bias.copy_(torch.randn_like(experts.down_proj_bias))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, experts.hidden_size, generator=gen) * 12  # large enough to reach the clamps (+-7)
    ids = torch.randint(0, experts.num_experts, (5, 2), generator=gen)
    weights = torch.rand(5, 2, generator=gen)
    with torch.inference_mode():
        assert torch.einsum("th,ehi->tei", x, experts.gate_up_proj).abs().max() > experts.limit
        expected = experts(x, ids, weights)
        got = gather_biased_experts(x, ids, weights, experts.gate_up_proj, experts.down_proj, experts._apply_gate,
                                    experts.gate_up_proj_bias, experts.down_proj_bias)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
