"""Side-by-side engine comparison in one process: ``python -m specter.bench RECIPE``.

Contract: builds every requested engine from the same recipe (each its own model copy, same
prompts, same thread count), warms each up on one short generation, then runs them in
alternating order ``--repeats`` times and reports, per engine, the median decode tokens/s and
the figures of its last run; ratios are taken against ``ondemand`` (and ``resident``).
Engine names: ``resident``, ``ondemand``, ``router-lookahead``, ``specter``, and
``ondemand@same-memory`` — ``ondemand`` with its cache enlarged by the bytes of the ``specter``
engine's resident INT4 draft, i.e. the same total device memory as ``specter``. Greedy outputs
of every engine are compared with ``resident``'s (``lossless``). Emulated-link figures are
labelled as such in the printed table and in the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SAME_MEMORY = "ondemand@same-memory"


def build(recipe, name: str, specter_engine):
    from specter.engine import build_engine
    from specter.recipe import load_recipe

    if name == SAME_MEMORY:
        if specter_engine is None:
            raise SystemExit("error: ondemand@same-memory needs the specter engine in the same bench")
        # the same recipe budget gives ondemand the cache specter has; add the draft's bytes to it
        budget = specter_engine.cache.bytes + specter_engine.draft_bytes
        engine = build_engine(load_recipe(recipe, ["engine=ondemand", f"offload.expert_budget={budget}B"]))
        engine.name = SAME_MEMORY
        return engine
    return build_engine(load_recipe(recipe, [f"engine={name}"]))


def summarize(report: dict) -> dict:
    keys = ("decode_tokens_per_s", "ttft_s", "hit_rate", "io_wait_share", "transfer_wait_s", "copies_per_token",
            "acceptance_rate", "mean_accepted_per_step", "prefetch_precision", "new_tokens")
    out = {k: report.get(k) for k in keys}
    out["device_bytes"] = report.get("device_bytes")
    out["expert_budget"] = report.get("expert_budget")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specter.bench", description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--engines", default="resident,ondemand,specter," + SAME_MEMORY)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--report", type=Path)
    args = parser.parse_args(argv)

    from specter.errors import SpecterError
    from specter.recipe import load_recipe

    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except SpecterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    prompts = recipe.resolved_prompts()
    engines = {}
    for name in sorted(names, key=lambda n: n == SAME_MEMORY):  # specter before same-memory
        print(f"building {name} ...", file=sys.stderr, flush=True)
        engines[name] = build(recipe, name, engines.get("specter"))
    for name, engine in engines.items():
        engine.generate(prompts[:1], max_new_tokens=8)  # warm-up
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for repeat in range(args.repeats):
        order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
        for name in order:
            started = time.perf_counter()
            result = engines[name].generate(prompts)
            runs[name].append({"report": result.report, "tokens": result.token_ids})
            print(f"[repeat {repeat + 1}] {name}: {result.report['decode_tokens_per_s']:.1f} tok/s "
                  f"({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)
    reference = runs.get("resident", [{}])[-1].get("tokens")
    greedy = recipe.sampling.temperature == 0
    table = {}
    for name, results in runs.items():
        entry = summarize(results[-1]["report"])
        entry["decode_tokens_per_s"] = statistics.median(r["report"]["decode_tokens_per_s"] for r in results)
        entry["decode_tokens_per_s_runs"] = [r["report"]["decode_tokens_per_s"] for r in results]
        entry["lossless"] = (results[-1]["tokens"] == reference) if (greedy and reference is not None) else None
        table[name] = entry
    ratios = {}
    for base in ("ondemand", SAME_MEMORY, "resident"):
        if base in table:
            ratios[f"vs_{base}"] = {n: e["decode_tokens_per_s"] / table[base]["decode_tokens_per_s"] for n, e in table.items()}
    any_engine = next(iter(engines.values()))
    link = getattr(any_engine, "link", None) or next((getattr(e, "link", None) for e in engines.values() if getattr(e, "link", None)), None)
    output = {
        "schema": "specter.bench/1",
        "recipe": recipe.to_dict(),
        "threads": recipe.threads,
        "link": None if link is None else {"kind": link.kind, "gbps": link.gbps, "latency_us": link.latency_us,
                                           "emulated": bool(link.emulated)},
        "prompts": len(prompts),
        "repeats": args.repeats,
        "engines": table,
        "ratios": ratios,
        "reports": {name: results[-1]["report"] for name, results in runs.items()},
    }
    label = " (EMULATED link)" if output["link"] and output["link"]["emulated"] else ""
    print(f"\nengines side by side, {recipe.threads} thread(s), {len(prompts)} prompts x {recipe.max_new_tokens} tokens{label}")
    header = f"{'engine':<22}{'tok/s':>8}{'vs ondemand':>13}{'hit':>7}{'io wait':>9}{'copies/tok':>11}{'accept':>8}{'dev MB':>8}{'lossless':>10}"
    print(header)
    for name, e in table.items():
        vs = ratios.get("vs_ondemand", {}).get(name)
        dev = (e["device_bytes"] or {}).get("total")
        fmt = lambda v, f: "-" if v is None else format(v, f)
        print(f"{name:<22}{e['decode_tokens_per_s']:>8.1f}{fmt(vs, '.2f'):>13}{fmt(e['hit_rate'], '.3f'):>7}"
              f"{fmt(e['io_wait_share'], '.2f'):>9}{fmt(e['copies_per_token'], '.2f'):>11}"
              f"{fmt(e['acceptance_rate'], '.3f'):>8}{fmt(dev and dev / 2**20, '.1f'):>8}{str(e['lossless']):>10}")
    if args.report:
        args.report.write_text(json.dumps(output, indent=2) + "\n")
        print(f"bench report written to {args.report}")
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
