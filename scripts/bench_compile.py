"""Eager vs compiled engines, side by side in one process: ``python scripts/bench_compile.py RECIPE``.

Builds each requested engine twice from the same recipe (``compile=false`` and ``compile=true``;
the compiled one warms up while it is built), runs one short generation on each, then runs them
in alternating order ``--repeats`` times. Prints per engine the median decode tokens/s of both,
their ratio, the compiled engine's warm-up seconds, steps per path and graphs compiled after
warm-up, and whether its greedy tokens equal the eager ``resident`` engine's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_compile.py", description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--engines", default="resident,specter")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--report", type=Path)
    args = parser.parse_args(argv)

    from specter.engine import build_engine
    from specter.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    prompts = recipe.resolved_prompts()
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    engines = {}
    for name in dict.fromkeys(["resident", *names]):
        for compiled in (False, True):
            print(f"building {name} compile={compiled} ...", file=sys.stderr, flush=True)
            engine = build_engine(load_recipe(args.recipe, [*args.overrides, f"engine={name}", f"compile={compiled}"]))
            engine.generate(prompts[:1], max_new_tokens=8)
            engines[(name, compiled)] = engine
    runs = {key: [] for key in engines}
    for repeat in range(args.repeats):
        order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
        for key in order:
            result = engines[key].generate(prompts)
            runs[key].append(result)
            print(f"[repeat {repeat + 1}] {key[0]} compile={key[1]}: "
                  f"{result.report['decode_tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    reference = runs[("resident", False)][-1].token_ids
    table = {}
    for name in names:
        eager = statistics.median(r.report["decode_tokens_per_s"] for r in runs[(name, False)])
        compiled = statistics.median(r.report["decode_tokens_per_s"] for r in runs[(name, True)])
        last = runs[(name, True)][-1]
        table[name] = {
            "eager_tokens_per_s": eager, "compiled_tokens_per_s": compiled, "speedup": compiled / eager,
            "lossless": last.token_ids == reference if recipe.sampling.temperature == 0 else None,
            "acceptance_rate": (runs[(name, False)][-1].report["acceptance_rate"], last.report["acceptance_rate"]),
            "compile": last.report["compile"],
        }
    print(f"\neager vs compiled, {recipe.threads} thread(s), {len(prompts)} prompts x {recipe.max_new_tokens} tokens")
    print(f"{'engine':<18}{'eager tok/s':>12}{'compiled':>10}{'speedup':>9}{'warm-up s':>11}"
          f"{'late graphs':>13}{'lossless':>10}")
    for name, row in table.items():
        print(f"{name:<18}{row['eager_tokens_per_s']:>12.1f}{row['compiled_tokens_per_s']:>10.1f}{row['speedup']:>9.2f}"
              f"{row['compile']['warmup_s']:>11.1f}{row['compile']['late_graphs']:>13}{str(row['lossless']):>10}")
    if args.report:
        args.report.write_text(json.dumps({"threads": recipe.threads, "engines": table}, indent=2) + "\n")
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
