"""Replays a model's own greedy routing through an expert cache of a given size: how many experts
a decoded token must copy under each eviction rule, when rounds of T tokens are verified at once.

Run: python scripts/cache_replay.py [RECIPE] [--set key=value ...] [--slots 16,32] [--widths 1,2,3,5,9]
     python scripts/cache_replay.py [RECIPE] --verified [--set key=value ...]
     (no RECIPE: recipes/specter.yaml with bench-proxy's run settings, model=bundled:tiny-moe-x16,
     max_prompts=4, max_new_tokens=32, under any --set; a RECIPE runs as written, --set on top; one
     thread)
The recipe's ``resident`` engine generates its prompts (``max_prompts``, ``max_new_tokens``)
greedily while a hook records every MoE layer's chosen experts. Then, per prompt, the decoded
tokens are cut into rounds of T; a round asks for each layer's experts in layer order (the
distinct experts its T tokens chose there, all needed at once), from one pool of ``slots`` shared
by every layer, as Specter's cache is. The pool starts with the prefill's most recently used
experts. A missing expert is one copy; the figure is copies per decoded token under:
- ``lru``: evict the least recently used expert (``ondemand``'s rule at T = 1);
- ``round``: the round's own requests known (a perfect draft): evict the expert needed furthest
  ahead in the round, least recently used among those the round does not need;
- ``min``: the whole future known (Belady's MIN): the floor for any rule with this pool.
On a link where every copy is on the critical path, copies per token times the copy time bounds
tokens/s from above; these are the bounds the bench-proxy notes in docs/ compare with.

With ``--verified`` the recipe's own engine runs instead (a speculative one, e.g. ``--set
engine=specter``) and the rules replay the rounds it verified (each round's distinct experts per
layer, rejected drafts included, from the cache it started the prompt with): the engine's copies
per decoded token beside what lru / round / min would have copied for the same requests.
"""

from __future__ import annotations

import argparse
import bisect
from collections import OrderedDict

import torch

from specter.api import load
from specter.errors import SpecterError
from specter.model.layout import moe_layers

Key = tuple[int, int]  # (MoE layer position, expert)
Requests = list[set[Key]]  # one set per (round, layer), in the order they are needed
BENCH_PROXY_RUN = ["model=bundled:tiny-moe-x16", "max_prompts=4", "max_new_tokens=32"]


def record_routing(engine) -> list[list[list[torch.Tensor]]]:
    """Per prompt, per forward pass (prefill first), each MoE layer's top-k index [T, k]."""
    layers = moe_layers(engine.model)
    passes: list[list[torch.Tensor]] = []

    def hook(position: int):
        def record(module, args, kwargs):
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            if position == 0:
                passes.append([])
            passes[-1].append(index.detach().clone())
        return record

    handles = [info.experts.register_forward_pre_hook(hook(i), with_kwargs=True) for i, info in enumerate(layers)]
    per_prompt = []
    try:
        for prompt in engine.recipe.resolved_prompts():
            passes.clear()
            engine.generate([prompt])
            per_prompt.append(list(passes))
    finally:
        for handle in handles:
            handle.remove()
    return per_prompt


def rounds(decode: list[list[torch.Tensor]], width: int) -> Requests:
    """The decode passes (one token each) cut into rounds of ``width`` tokens: per round and
    layer, the set of experts its tokens chose."""
    requests = []
    for start in range(0, len(decode), width):
        chunk = decode[start : start + width]
        for layer in range(len(chunk[0])):
            requests.append({(layer, int(e)) for step in chunk for e in step[layer].reshape(-1).tolist()})
    return requests


def warm(prefill: list[torch.Tensor], slots: int) -> list[Key]:
    """The prefill's last ``slots`` distinct experts, least recently used first."""
    order: OrderedDict[Key, None] = OrderedDict()
    for layer, index in enumerate(prefill):
        for expert in index.reshape(-1).tolist():
            order.pop((layer, int(expert)), None)
            order[(layer, int(expert))] = None
    return list(order)[len(order) - slots:] if slots < len(order) else list(order)


def replay(requests: Requests, slots: int, initial: list[Key], rule: str, layers: int) -> int:
    """Copies made serving ``requests`` from a pool of ``slots`` under ``rule`` (lru, round, min).
    A group's experts are needed at once: a group larger than the pool is a ``ValueError``."""
    widest = max(map(len, requests), default=0)
    if widest > slots:
        raise ValueError(f"a layer of a round needs {widest} experts at once, more than the {slots} slots")
    uses: dict[Key, list[int]] = {}
    for group, needed in enumerate(requests):
        for key in needed:
            uses.setdefault(key, []).append(group)
    cache: OrderedDict[Key, None] = OrderedDict((key, None) for key in initial)  # LRU first
    copies = 0
    for group, needed in enumerate(requests):
        round_end = (group // layers + 1) * layers  # the first group of the next round
        horizon = round_end if rule == "round" else len(requests)
        for key in sorted(needed):
            if key in cache:
                cache.move_to_end(key)
                continue
            copies += 1
            if len(cache) >= slots:
                candidates = [k for k in cache if k not in needed]

                def next_use(candidate: Key) -> int:  # the next group needing it, capped at the horizon
                    times = uses.get(candidate, [])
                    after = bisect.bisect_right(times, group)
                    return min(times[after], horizon) if after < len(times) else horizon

                if rule == "lru":
                    victim = candidates[0]
                else:  # the furthest next use; the least recently used among equals (max keeps the first)
                    victim = max(candidates, key=next_use)
                del cache[victim]
            cache[key] = None
    return copies


def record_verified_rounds(engine) -> tuple[list[tuple[Requests, list[Key]]], int, int]:
    """Runs the engine's prompts; per prompt its verified rounds as requests (layer order, the
    cache's layer numbering) and the cache's keys when the first round began; the engine's decode
    copies; the decoded tokens."""
    if getattr(engine, "scheduler", None) is None:
        raise SystemExit(f"--verified replays a speculative engine's rounds; {engine.recipe.engine} has none "
                         "(--set engine=specter)")
    scheduler, cache = engine.scheduler, engine.cache
    begin, end = scheduler.begin_round, scheduler.end_round
    requests: Requests = []
    initial: list[Key] = []

    def begin_round(**options) -> None:
        if not requests and not initial:
            initial.extend(cache.resident_keys())
        begin(**options)

    def end_round(used: set[Key]) -> None:
        requests.extend({key for key in used if key[0] == layer} for layer in sorted({key[0] for key in used}))
        end(used)

    scheduler.begin_round, scheduler.end_round = begin_round, end_round
    per_prompt, copies, tokens = [], 0, 0
    try:
        for prompt in engine.recipe.resolved_prompts():
            requests, initial = [], []
            result = engine.generate([prompt])
            decoded = len(result.token_ids[0]) - 1  # the first token comes from the prefill
            per_prompt.append((requests, initial))
            copies += round(result.report["copies_per_token"] * decoded)
            tokens += decoded
    finally:
        scheduler.begin_round, scheduler.end_round = begin, end
    return per_prompt, copies, tokens


def verified_main(engine) -> None:
    per_prompt, copies, tokens = record_verified_rounds(engine)
    layers = len(engine.cache.store.layers)
    totals = {"lru": 0, "round": 0, "min": 0}
    try:
        for requests, initial in per_prompt:
            for rule in totals:
                totals[rule] += replay(requests, engine.cache.capacity, initial, rule, layers)
        replayed = "  ".join(f"{rule} {count / tokens:.3f}" for rule, count in totals.items())
    except ValueError as error:  # the engine streamed a layer through its cache in waves
        replayed = f"- ({error})"
    print(f"{engine.recipe.model}, {engine.recipe.engine}: {len(per_prompt)} prompts, {tokens} decoded tokens, "
          f"{engine.cache.capacity} slots; copies per decoded token: engine {copies / tokens:.3f}; on its "
          "verified rounds " + replayed)


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of whole numbers of at least 1 (an argparse type)."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of whole numbers: {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"every value must be at least 1: {text!r}")
    return values


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", nargs="?", help="a run recipe (default: recipes/specter.yaml with bench-proxy's "
                        "run settings)")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--slots", type=positive_ints, default="16,32", help="pool sizes (comma-separated)")
    parser.add_argument("--widths", type=positive_ints, default="1,2,3,5,9",
                        help="tokens verified per round (comma-separated)")
    parser.add_argument("--verified", action="store_true", help="replay the rounds the recipe's engine verified")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    recipe, overrides = (args.recipe, args.overrides) if args.recipe else ("recipes/specter.yaml",
                                                                           [*BENCH_PROXY_RUN, *args.overrides])
    try:
        if args.verified:
            with load(recipe, [*overrides, "check_lossless=false"]) as engine:
                verified_main(engine)
            return
        with load(recipe, [*overrides, "engine=resident", "check_lossless=false"]) as engine:
            routing = record_routing(engine)
            experts_per_layer = moe_layers(engine.model)[0].num_experts
            model = engine.recipe.model
    except SpecterError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    layers = len(routing[0][0])
    experts = layers * experts_per_layer
    tokens = sum(len(passes) - 1 for passes in routing)
    print(f"{model}: {len(routing)} prompts, {tokens} decoded tokens, {layers} MoE layers, "
          f"{experts} experts; copies per decoded token (lru / round / min)")
    for slots in args.slots:
        for width in args.widths:
            totals = {"lru": 0, "round": 0, "min": 0}
            try:
                for passes in routing:
                    requests, initial = rounds(passes[1:], width), warm(passes[0], slots)
                    for rule in totals:
                        totals[rule] += replay(requests, slots, initial, rule, layers)
            except ValueError as error:
                print(f"slots {slots:3d} ({slots / experts:.0%})  T = {width:2d}:  - ({error})")
                continue
            print(f"slots {slots:3d} ({slots / experts:.0%})  T = {width:2d}:  "
                  + "  ".join(f"{rule} {count / tokens:.2f}" for rule, count in totals.items()))


if __name__ == "__main__":
    main()
