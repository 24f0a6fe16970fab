"""What the link's copies cost a verification's expert kernels when both share a CPU's memory.

Run: python scripts/verify_beside_copies.py [BENCH_RECIPE] [--budget 0.25] [--k 4] [--compiled]
     [--repeats 3]
     (default: recipes/bench-proxy.yaml, the widened model; one thread, ~3 min)

Builds a bench cell's ``specter`` engine (fixed k, the ``local`` link: unpaced copies) twice: its
copies on the link's copy thread, running on the other core while verification computes (as the
bench runs it), and with ``copy_thread: false`` (every copy on the compute thread, before the
kernels that read it), plus ``resident`` of the same compile mode. The engines take turns,
``--repeats`` generations of the recipe's prompts each. Printed (medians, with the range): decode
tokens/s; the reports' verification compute time per distinct expert read (``phases``; without a
copy thread it includes the copies) and the part of it in the expert kernels
(``verify_kernel_s_per_expert``), against ``resident``'s step per expert read (its step over
top_k x MoE layers, as the bench's phase table). The kernels read the same experts for the same
tokens in both engines; their ratio is what the copies beside them cost. Why: on a CPU device the
"host" and "device" memory are one DRAM, so an emulated link's copies take memory bandwidth from
the kernels; a GPU's copy engines write into memory many times faster than the link feeds them.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from specter.bench.spec import fixed_k_overrides, load_bench
from specter.build import build_engine
from specter.errors import SpecterError

ENGINES = ("resident", "copies beside", "copies before")


def median_range(values: list[float], scale: float = 1.0) -> str:
    return f"{statistics.median(values) * scale:.3f} [{min(values) * scale:.3f}-{max(values) * scale:.3f}]"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", nargs="?", default="recipes/bench-proxy.yaml")
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    torch.set_num_threads(1)
    fixed = fixed_k_overrides(args.k)
    engines = {}
    try:
        spec = load_bench(args.recipe)
        engines["resident"] = build_engine(spec.cell_recipe("resident", None, None, args.compiled))
        for name, thread in (("copies beside", True), ("copies before", False)):
            engines[name] = build_engine(spec.cell_recipe("specter", args.budget, None, args.compiled, fixed + [
                "offload.link.kind=local", f"offload.link.options={{copy_thread: {'true' if thread else 'false'}}}"]))
    except SpecterError as error:
        for engine in engines.values():
            engine.close()
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    prompts = spec.recipe.resolved_prompts()
    try:
        for engine in engines.values():
            engine.generate(prompts[:1], max_new_tokens=48)  # warm-up (and compilation)
        figures: dict[str, dict[str, list[float]]] = {name: {"tok/s": [], "compute": [], "kernels": []} for name in ENGINES}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                report = engine.generate(prompts).report
                figures[name]["tok/s"].append(report["decode_tokens_per_s"])
                if name == "resident":
                    reads = report["model"]["top_k"] * report["model"]["n_moe_layers"]
                    figures[name]["compute"].append(report["decode_step_s"] / reads)
                    continue
                phases = report["phases"]
                if phases["verify_kernel_s_per_expert"] is None:
                    raise SystemExit("the verification's kernels were not timed here (a compiled graph computed "
                                     "the experts itself, or the device is not a CPU)")
                figures[name]["compute"].append(phases["verify_compute_s_per_expert"])
                figures[name]["kernels"].append(phases["verify_kernel_s_per_expert"])
    finally:
        for engine in engines.values():
            engine.close()
    mode = "compiled" if args.compiled else "eager"
    threads = f"{torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''}"
    print(f"{args.recipe}: specter k={args.k}, {args.budget:.0%} budget, link local, {mode}, {threads}, "
          f"{args.repeats} generations of {len(prompts)} prompts each (medians [range])")
    print(f"  {'engine':16s} {'tok/s':>24s} {'compute ms/expert read':>24s} {'kernels ms/expert read':>24s}")
    for name in ENGINES:
        row = figures[name]
        kernels = median_range(row["kernels"], 1e3) if row["kernels"] else "-"
        print(f"  {name:16s} {median_range(row['tok/s']):>24s} {median_range(row['compute'], 1e3):>24s} {kernels:>24s}")
    beside, before = (statistics.median(figures[name]["kernels"]) for name in ENGINES[1:])
    single = statistics.median(figures["resident"]["compute"])
    print(f"  kernels beside the copy thread / before it: {beside / before:.2f}x; against resident's step per "
          f"expert read: {beside / single:.2f}x / {before / single:.2f}x")


if __name__ == "__main__":
    main()
