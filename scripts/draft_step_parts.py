"""Splits a decode step of a recipe's model into its parts: the INT4 draft's experts, the target's
full-precision experts (Specter's grouped kernel), and a whole one-token forward of the resident
model, whose difference from the target's experts is the part draft and target steps share.

Run: python scripts/draft_step_parts.py [RECIPE] [--set key=value ...]
     (no RECIPE: recipes/specter.yaml with model=bundled:tiny-moe-x16, under any --set; a RECIPE
     runs as written, --set on top; one thread)
Each figure is the median of 7 x 20 calls, one token, random top-k routing per layer. CPU only
(the resident copy is loaded on the CPU). Then the draft step's floor as a fraction of a target
step with these kernels: the INT4 matmuls alone (bf16 in and out, no other op) plus the part of a
step draft and target share (attention, norms, router, LM head); last, an engine's whole draft
step (every expert cached, nothing copied) through the model's forward and, where the model
allows, through the lean step the eager engines use (``specter.compile.lean_draft``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
from transformers import DynamicCache

from specter.api import load
from specter.decode.kv import crop_to
from specter.errors import SpecterError
from specter.experts.runtime import use_grouped_kernel
from specter.kernels.grouped_experts import grouped_experts
from specter.model.layout import moe_layers
from specter.model.loader import load_model


def threads_label() -> str:
    """The torch threads the engine runs on (the recipe's ``threads``, which building the engine sets)."""
    threads = torch.get_num_threads()
    return f"{threads} thread{'s' if threads > 1 else ''}"


def median_ms(call) -> float:
    samples = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(20):
            call()
        samples.append((time.perf_counter() - start) / 20 * 1e3)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", nargs="?", help="a run recipe (default: recipes/specter.yaml with "
                        "model=bundled:tiny-moe-x16)")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    recipe, overrides = (args.recipe, args.overrides) if args.recipe else (
        "recipes/specter.yaml", ["model=bundled:tiny-moe-x16", *args.overrides])
    try:  # every expert cached: a draft step below copies nothing
        engine = load(recipe, [*overrides, "engine=specter", "offload.link.kind=local", "offload.expert_budget=1.0"])
    except SpecterError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
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

    first = next(iter(engine.draft.values()))
    x_kernel = x.to(torch.bfloat16)  # the int4pack kernels' input dtype: the matmuls with no glue
    a_kernel = torch.randn(1, first.down[0].shape[1], dtype=torch.bfloat16)

    def draft_matmuls() -> None:
        for draft in engine.draft.values():
            for expert in routing()[0][0].tolist():
                draft.up[expert].linear(x_kernel)
                draft.down[expert].linear(a_kernel)

    def forward() -> None:
        model(input_ids=torch.tensor([[5]]), cache=DynamicCache(), use_cache=True)

    kv = engine.new_kv_cache()
    prompt = torch.tensor([[1, 5, 9, 200, 31, 17, 8, 99]])

    def engine_draft_step(lean: bool) -> Callable[[], None]:
        def step() -> None:
            with engine.runtime.drafting():
                if lean:
                    engine.lean_draft.step(42, kv)
                else:
                    engine.forward_logits(torch.tensor([[42]]), kv)
            crop_to(kv, prompt.shape[1])
        return step

    with torch.inference_mode():
        engine.forward_logits(prompt, kv)
        draft, target, whole = median_ms(draft_experts), median_ms(target_experts), median_ms(forward)
        matmuls = median_ms(draft_matmuls)
        through_model = median_ms(engine_draft_step(lean=False))
        lean = median_ms(engine_draft_step(lean=True)) if engine.lean_draft is not None else None
    shared = whole - target
    print(f"{engine.recipe.model}, {len(layers)} MoE layers, {threads_label()}; medians of 7 x 20 calls, one token")
    print(f"draft INT4 experts, all layers   {draft:6.2f} ms")
    print(f"target experts, all layers       {target:6.2f} ms")
    print(f"whole one-token forward          {whole:6.2f} ms  (shared part {shared:.2f} ms)")
    print(f"  of which the INT4 matmuls alone {matmuls:6.2f} ms")
    print(f"draft / target: experts alone {draft / target:.2f}, with the shared part {(draft + shared) / whole:.2f}")
    print(f"floor with these kernels (INT4 matmuls + shared part, nothing else): {(matmuls + shared) / whole:.2f}")
    print(f"an engine's draft step through the model's forward {through_model:6.2f} ms ({through_model / whole:.2f} of the forward)")
    if lean is not None:
        print(f"an engine's lean draft step                        {lean:6.2f} ms ({lean / whole:.2f} of the forward)")
    engine.close()


if __name__ == "__main__":
    main()
