"""Splits a decode step of a recipe's model into its parts: the INT4 draft's experts, the target's
full-precision experts (Specter's grouped kernel), and a whole one-token forward of the resident
model, whose difference from the target's experts is the part draft and target steps share.

Run: python scripts/draft_step_parts.py [RECIPE] [--set key=value ...]
     (default: recipes/specter.yaml with model=bundled:tiny-moe-x16; one thread)
Each figure is the median of 7 x 20 calls, one token, random top-k routing per layer. CPU only
(the resident copy is loaded on the CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from specter.api import load
from specter.experts.runtime import use_grouped_kernel
from specter.kernels.grouped_experts import grouped_experts
from specter.model.layout import moe_layers
from specter.model.loader import load_model


def median_ms(call) -> float:
    samples = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(20):
            call()
        samples.append((time.perf_counter() - start) / 20 * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="recipes/specter.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    overrides = args.overrides if args.overrides is not None else ["model=bundled:tiny-moe-x16"]
    engine = load(args.recipe, [*overrides, "engine=specter", "offload.link.kind=local"])
    model, _, _ = load_model(engine.model_path, dtype=engine.model.dtype, device=torch.device("cpu"))
    use_grouped_kernel(model)
    layers = moe_layers(model)
    n_experts, top_k, hidden = layers[0].num_experts, layers[0].top_k, model.config.hidden_size
    x = torch.randn(1, hidden, dtype=model.dtype)

    def routing() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randperm(n_experts)[:top_k][None], torch.rand(1, top_k)

    def draft_experts() -> None:
        for draft in engine.draft.values():
            draft.forward_one_token(x, *routing())

    def target_experts() -> None:
        for m in layers:
            grouped_experts(x, *routing(), m.experts.gate_up_proj, m.experts.down_proj, m.experts._apply_gate)

    def forward() -> None:
        model(torch.tensor([[5]]), past_key_values=DynamicCache())

    with torch.no_grad():
        draft, target, whole = median_ms(draft_experts), median_ms(target_experts), median_ms(forward)
    shared = whole - target
    print(f"draft INT4 experts, all layers   {draft:6.2f} ms")
    print(f"target experts, all layers       {target:6.2f} ms")
    print(f"whole one-token forward          {whole:6.2f} ms  (shared part {shared:.2f} ms)")
    print(f"draft / target: experts alone {draft / target:.2f}, with the shared part {(draft + shared) / whole:.2f}")
    engine.close()


if __name__ == "__main__":
    main()
