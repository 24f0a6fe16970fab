"""Where a speculative round's time goes, part by part: a bench cell's ``specter`` engine at a fixed
k, its decode rounds timed with wall-clock counters around the draft's and the verification's
parts (only while a round runs: prefills are left out).

Run: python scripts/round_parts.py [BENCH_RECIPE] [--budget 0.5] [--link local] [--k 4]
     [--compiled] [--repeats 3]
     (default: recipes/bench-proxy.yaml, the widened model; one thread)
Each generation runs the recipe's prompts; the table gives each part in ms a round (the median
over ``--repeats`` generations) and its calls a round. Draft parts: whole layers in one native call
(``native_rows.draft_layer``: attention half and INT4 experts, where the lean step takes it), else
the INT4 experts (the runtime's draft experts) and the attention half (``native_rows.draft_qkv`` /
``draft_attend_route``), the observers told of a draft layer (the draft predictor's hand-over, the
scheduler's prefetches); the rest of a draft step is its LM head, norms and Python. Verification
parts: the experts from the cache (``ExpertRuntime._forward_from_slots``: acquire, one pass or
waves, release), of them the kernels' share (one pass, for gates other than a silu GLU, whose
layers are waves even when every expert is ready: ``_grouped_experts_forward``; waves:
``PairsByExpert.compute``, ``PairsBySlot.compute`` for other gates), and the observers told of a target layer; the rest of verification is
attention, norms, the LM head, the graph or model around them and Python. A counter adds about
0.5 us to a call (timeit on a hot loop; more between kernels that flush the caches). Timings vary
between spells on this VM: compare parts within one run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import statistics
import time
from typing import Iterator

import torch

from specter.bench.spec import fixed_k_overrides, load_bench
from specter.build import build_engine
from specter.compile import lean_draft
from specter.decode.speculative import SpecterEngine
from specter.errors import SpecterError
from specter.experts import runtime as runtime_module
from specter.kernels import grouped_experts, native_rows

ORDER = ["round", "draft step", "draft: whole layers", "draft: INT4 experts", "draft: attention half", "draft: observers",
         "verify: experts from the cache", "verify:   kernels, one pass", "verify:   kernels, waves",
         "verify: observers"]
_INHERITED = object()  # a patched name the owner did not define itself


class Parts:
    """Seconds and calls per part, counted only while ``in_round``."""

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.in_round = False

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] += seconds
        self.calls[part] += 1

    def timed(self, call, part: str):
        @functools.wraps(call)
        def timed(*args, **kwargs):
            if not self.in_round:
                return call(*args, **kwargs)
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.add(part, time.perf_counter() - started)
        return timed


@contextlib.contextmanager
def instrumented(engine) -> Iterator[Parts]:
    """Counters around the parts of ``engine``'s rounds (see the module docstring), removed on
    exit. Eager-only functions only, so no compiled graph traces a counter."""
    parts = Parts()
    runtime = engine.runtime
    targets = [(SpecterEngine, "decode_round", "round"), (lean_draft.LeanDraftStep, "step", "draft step"),
               (native_rows, "draft_layer", "draft: whole layers"),
               (native_rows, "draft_qkv", "draft: attention half"),
               (native_rows, "draft_attend_route", "draft: attention half"),
               (type(runtime), "_forward_from_slots", "verify: experts from the cache"),
               (runtime_module, "_grouped_experts_forward", "verify:   kernels, one pass"),
               (grouped_experts.PairsByExpert, "compute", "verify:   kernels, waves"),
               (grouped_experts.PairsBySlot, "compute", "verify:   kernels, waves")]
    targets += [(draft_type, "forward", "draft: INT4 experts") for draft_type in {type(d) for d in runtime.draft.values()}]
    originals = [(owner, name, vars(owner).get(name, _INHERITED))
                 for owner, name in [(owner, name) for owner, name, _ in targets] + [(type(runtime), "notify")]]
    try:
        for owner, name, part in targets:
            setattr(owner, name, parts.timed(getattr(owner, name), part))
        round_ = SpecterEngine.decode_round

        @functools.wraps(round_)
        def flagged_round(self, *args, **kwargs):
            parts.in_round = True
            try:
                return round_(self, *args, **kwargs)
            finally:
                parts.in_round = False
        SpecterEngine.decode_round = flagged_round
        notify = type(runtime).notify

        @functools.wraps(notify)
        def timed_notify(self, layer, hidden, top_k_index, top_k_weights, mode=None):
            started = time.perf_counter()
            try:
                return notify(self, layer, hidden, top_k_index, top_k_weights, mode)
            finally:
                if parts.in_round:
                    draft = (mode or self.mode) == "draft"
                    parts.add("draft: observers" if draft else "verify: observers", time.perf_counter() - started)
        type(runtime).notify = timed_notify
        yield parts
    finally:
        for owner, name, original in reversed(originals):
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def measure(engine, prompts: list, repeats: int) -> dict:
    """``repeats`` generations of ``prompts``, instrumented: {"parts": {part: (median ms a round,
    calls a round)}, "tokens_per_s": median, "draft_ms" / "verify_ms": the reports' phases a round
    (medians), "verify_tokens": tokens verified a round}."""
    per_round: dict[str, list[float]] = collections.defaultdict(list)
    calls: dict[str, float] = {}
    rates, draft_ms, verify_ms, report = [], [], [], None
    with instrumented(engine) as parts:
        for _ in range(repeats):
            parts.seconds.clear()
            parts.calls.clear()
            report = engine.generate(prompts).report
            rounds = report["phases"]["rounds"]
            rates.append(report["decode_tokens_per_s"])
            draft_ms.append(report["phases"]["draft_s"] / rounds * 1e3)
            verify_ms.append(report["phases"]["verify_s_per_round"] * 1e3)
            for part, seconds in parts.seconds.items():
                per_round[part].append(seconds / rounds * 1e3)
                calls[part] = parts.calls[part] / rounds
    ordered = sorted(per_round, key=lambda p: ORDER.index(p) if p in ORDER else len(ORDER))
    return {"parts": {part: (statistics.median(per_round[part]), calls[part]) for part in ordered},
            "tokens_per_s": statistics.median(rates), "draft_ms": statistics.median(draft_ms),
            "verify_ms": statistics.median(verify_ms), "verify_tokens": report["phases"]["verify_tokens_per_round"]}


def threads_label() -> str:
    """The torch threads the engine runs on (the recipe's ``threads``, which building the engine sets)."""
    threads = torch.get_num_threads()
    return f"{threads} thread{'s' if threads > 1 else ''}"


def link_label(name: str, link: dict) -> str:
    """The link as the table's heading names it: the recipe's name, then the kind the engine
    reported, emulated links marked so with their rate (a CPU's "device" copies paced in software)."""
    if link.get("emulated"):
        return f"link {name} (emulated, {link['gbps']:g} GB/s + {link.get('latency_us', 0):g} us)"
    kind = link.get("kind", "?")
    return f"link {name}" if kind == name else f"link {name} ({kind})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", nargs="?", default="recipes/bench-proxy.yaml")
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--link", default="local", help="one of the bench recipe's sweep.links (default: local)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    try:
        spec = load_bench(args.recipe)
        if args.link not in spec.links:
            parser.error(f"--link {args.link!r} is not one of {args.recipe}'s links: {', '.join(spec.links)}")
        torch.set_num_threads(1)
        engine = build_engine(spec.cell_recipe("specter", args.budget, args.link, args.compiled,
                                               fixed_k_overrides(args.k)))
    except SpecterError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    try:
        prompts = spec.recipe.resolved_prompts()
        warm_up = engine.generate(prompts[:1], max_new_tokens=48)  # warm-up (and compilation)
        result = measure(engine, prompts, args.repeats)
    finally:
        engine.close()
    mode = "compiled" if args.compiled else "eager"
    print(f"{args.recipe}: specter k={args.k}, {args.budget:.0%} budget, {link_label(args.link, warm_up.report['link'])}, "
          f"{mode}, {threads_label()}; decode {result['tokens_per_s']:.1f} tok/s (median of {args.repeats}), "
          f"{result['verify_tokens']:.2f} tokens verified a round")
    print(f"  the reports' phases (medians): draft {result['draft_ms']:.2f} ms a round, verify {result['verify_ms']:.2f}")
    print(f"  {'part':34s} {'ms a round':>10s} {'calls a round':>14s}")
    for part, (ms, calls) in result["parts"].items():
        print(f"  {part:34s} {ms:10.2f} {calls:14.1f}")


if __name__ == "__main__":
    main()
