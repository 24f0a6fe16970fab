"""The bench recipe: a run recipe shared by every cell, and the sweep over it.

Contract: ``load_bench(source, overrides, sweep_overrides) -> BenchSpec`` reads a YAML file (or a
mapping) of the form::

    title: bench-proxy
    run: {...}        # a run recipe (``python -m specter.run`` keys), shared by every cell
    sweep:
      engines: [resident, ondemand, ondemand@same-memory, router-lookahead, specter, hf-offload]
      budgets: [0.25, 0.5]                       # offload.expert_budget values
      links: {slow: {kind: emulated, gbps: 0.8, latency_us: 20}, fast: {...}}
      k: [4]                                     # fixed-k specter rows, one per value
      governors: []                              # other governors (one specter row each)
      compile: [false, true]
      repeats: 2
      warmup_tokens: 8
      twins: []                                  # rows run twice, as identical engines (A/A)

``twins`` names rows (``specter k=4``, ``specter roofline``, ``ondemand``, ...) of which the
sweep builds a second, identical engine (``<label> (twin)``) that takes its turns beside the
first: how far apart two copies of one engine land in a cell is the run's noise floor.

A file without ``run``/``sweep`` is a plain run recipe: it is benched as one cell (its own
budget, link, k and compile setting) with the default engines. ``overrides`` (``key=value``)
apply to the run recipe; ``sweep_overrides`` (a mapping) replace sweep keys. Every mistake raises
``RecipeError`` naming the key (``sweep.budgets[1]: ...``). ``fixed_k_overrides(k)``: the run
recipe overrides of a ``specter`` row that always drafts k (the sweep's ``specter k=<k>`` rows;
scripts that build one cell's engine take them too).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from specter.errors import RecipeError
from specter.config.recipe import MAX_K
from specter.config import Recipe, load_recipe
from specter.config.schema import check_bounded

SAME_MEMORY = "ondemand@same-memory"
BENCH_ENGINES = ("resident", "ondemand", "router-lookahead", "specter", "hf-offload", SAME_MEMORY)  # what a sweep knows how to run
DEFAULT_ENGINES = ("resident", "ondemand", SAME_MEMORY, "specter")
SWEEP_KEYS = ("engines", "budgets", "links", "k", "governors", "compile", "repeats", "warmup_tokens", "twins")
TWIN_SUFFIX = " (twin)"


@dataclasses.dataclass(frozen=True)
class BenchSpec:
    title: str
    recipe: Recipe  # the shared run recipe (its budget/link/compile are replaced per cell)
    engines: tuple[str, ...]
    budgets: tuple[Any, ...]  # offload.expert_budget values as written
    links: dict[str, dict]  # name -> offload.link mapping
    k: tuple[int, ...]
    governors: tuple[str, ...]
    compile: tuple[bool, ...]
    repeats: int
    warmup_tokens: int
    twins: tuple[str, ...] = ()  # labels of offloaded rows run twice (A/A)

    def specter_variants(self) -> list[tuple[str, list[str], int | None, str]]:
        """(label, recipe overrides, k, governor) of every specter row."""
        variants = [(f"specter k={k}", fixed_k_overrides(k), k, "fixed") for k in self.k]
        variants += [(f"specter {g}", [f"speculation.governor.name={g}"], None, g) for g in self.governors]
        return variants

    def row_labels(self) -> list[str]:
        """The labels of the rows an offloaded group of a cell has (twins excluded)."""
        labels = [label for label, *_ in self.specter_variants()] if "specter" in self.engines else []
        return labels + [e for e in ("ondemand", "router-lookahead", SAME_MEMORY) if e in self.engines]

    def cell_recipe(self, engine: str, budget: Any, link: str | None, compile: bool, extra: Sequence[str] = ()) -> Recipe:
        overrides = [f"engine={engine}", f"compile={str(compile).lower()}", "check_lossless=false", *extra]
        if budget is not None:
            overrides.append(f"offload.expert_budget={budget}")
        if link is not None:
            overrides += link_overrides(self.links[link])
        return load_recipe(self.recipe, overrides)

    def as_dict(self) -> dict:
        return {"title": self.title, "run": self.recipe.to_dict(), "sweep": {
            "engines": list(self.engines), "budgets": list(self.budgets), "links": self.links, "k": list(self.k),
            "governors": list(self.governors), "compile": list(self.compile), "repeats": self.repeats,
            "warmup_tokens": self.warmup_tokens, "twins": list(self.twins)}}


def fixed_k_overrides(k: int) -> list[str]:
    # a fixed row takes none of the recipe's governor options (they are the other governors')
    return ["speculation.governor.name=fixed", f"speculation.governor.k={k}", "speculation.governor.options={}"]


def link_overrides(link: Mapping) -> list[str]:
    return [f"offload.link.{key}={value}" for key, value in link.items()]


def _error(key: str, text: str) -> RecipeError:
    return RecipeError(f"{key}: {text}")


def _list(raw: Mapping, key: str, default: Sequence) -> list:
    value = raw.get(key, list(default))
    if not isinstance(value, (list, tuple)) or not value:
        raise _error(f"sweep.{key}", f"expected a non-empty list, got {value!r:.60}")
    return list(value)


def load_bench(source: str | Path | Mapping, overrides: Sequence[str] = (), sweep_overrides: Mapping | None = None) -> BenchSpec:
    if isinstance(source, Mapping):
        raw, source_dir, title = copy.deepcopy(dict(source)), None, "bench"
    else:
        path = Path(source)
        try:
            raw = yaml.safe_load(path.read_text()) or {}
            check_bounded(raw, "bench recipe")
        except OSError as error:
            raise _error("recipe", f"cannot read {path}: {error.strerror}") from None
        except yaml.YAMLError as error:
            raise _error("recipe", f"{path} is not valid YAML: {str(error).splitlines()[0]}") from None
        source_dir, title = path.resolve().parent, path.stem
    if not isinstance(raw, Mapping):
        raise _error("recipe", "the top level must be a mapping")
    if "sweep" in raw or "run" in raw:
        unknown = set(raw) - {"title", "run", "sweep"}
        if unknown:
            raise _error(sorted(unknown)[0], "unknown key; allowed keys of a bench recipe: title, run, sweep")
        run_raw, sweep_raw = raw.get("run") or {}, dict(raw.get("sweep") or {})
        title = str(raw.get("title", title))
        single_cell = False
    else:
        run_raw, sweep_raw, single_cell = raw, {}, True
    if not isinstance(run_raw, Mapping):
        raise _error("run", "expected a mapping of run-recipe keys")
    base = load_recipe(run_raw, overrides, source_dir=source_dir)
    if single_cell:
        sweep_raw = {"budgets": [base.offload.expert_budget.to_recipe_value()],
                     "links": {base.offload.link.kind: base.offload.link.to_dict()},
                     "k": [base.speculation.governor.k], "compile": [base.compile]}
        if base.speculation.governor.name != "fixed":
            sweep_raw.update(k=[], governors=[base.speculation.governor.name])
    sweep_raw.update(sweep_overrides or {})
    unknown = set(sweep_raw) - set(SWEEP_KEYS)
    if unknown:
        raise _error(f"sweep.{sorted(unknown)[0]}", f"unknown key; allowed keys: {', '.join(SWEEP_KEYS)}")
    engines = _list(sweep_raw, "engines", DEFAULT_ENGINES)
    for i, name in enumerate(engines):
        if name not in BENCH_ENGINES:
            raise _error(f"sweep.engines[{i}]", f"unknown engine {name!r}; allowed: {', '.join(BENCH_ENGINES)}")
    if SAME_MEMORY in engines and "specter" not in engines:
        raise _error("sweep.engines", f"{SAME_MEMORY} is sized from the specter engine's cache and draft: add specter")
    budgets = _list(sweep_raw, "budgets", [base.offload.expert_budget.to_recipe_value()])
    for i, budget in enumerate(budgets):
        try:
            load_recipe(base, [f"offload.expert_budget={budget}"])
        except RecipeError as error:
            raise _error(f"sweep.budgets[{i}]", str(error)) from None
    links = sweep_raw.get("links", {base.offload.link.kind: base.offload.link.to_dict()})
    if not isinstance(links, Mapping) or not links:
        raise _error("sweep.links", "expected a mapping of link names to offload.link settings")
    for name, link in links.items():
        if not isinstance(link, Mapping):
            raise _error(f"sweep.links.{name}", "expected a mapping like {kind: emulated, gbps: 1, latency_us: 20}")
        try:
            load_recipe(base, link_overrides(link))
        except RecipeError as error:
            raise _error(f"sweep.links.{name}", str(error)) from None
    ks = sweep_raw.get("k", [base.speculation.governor.k])
    if not isinstance(ks, (list, tuple)) or any(isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K for k in ks):
        raise _error("sweep.k", f"expected a list of integers in 1..{MAX_K}, got {ks!r:.60}")
    governors = sweep_raw.get("governors", [])
    if not isinstance(governors, (list, tuple)) or not all(isinstance(g, str) for g in governors):
        raise _error("sweep.governors", "expected a list of governor names")
    if "specter" in engines and not ks and not governors:
        raise _error("sweep.k", "the specter engine needs at least one k or governor")
    compile_modes = _list(sweep_raw, "compile", [base.compile])
    if not all(isinstance(c, bool) for c in compile_modes):
        raise _error("sweep.compile", f"expected a list of booleans, got {compile_modes!r:.60}")
    repeats, warmup = sweep_raw.get("repeats", 2), sweep_raw.get("warmup_tokens", 8)
    for key, value, low in (("repeats", repeats, 1), ("warmup_tokens", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise _error(f"sweep.{key}", f"expected an integer >= {low}, got {value!r:.60}")
    spec = BenchSpec(title=title, recipe=base, engines=tuple(engines), budgets=tuple(budgets),
                     links={str(n): dict(v) for n, v in links.items()}, k=tuple(ks), governors=tuple(governors),
                     compile=tuple(dict.fromkeys(compile_modes)), repeats=repeats, warmup_tokens=warmup)
    twins = sweep_raw.get("twins", [])
    if not isinstance(twins, (list, tuple)) or not all(isinstance(t, str) for t in twins):
        raise _error("sweep.twins", "expected a list of row labels, like [specter k=4]")
    for i, label in enumerate(twins):
        if label not in spec.row_labels():
            allowed = ", ".join(spec.row_labels()) or "none (no offloaded engine)"
            raise _error(f"sweep.twins[{i}]", f"{label!r} is not a row of this sweep; its offloaded rows: {allowed}")
    return dataclasses.replace(spec, twins=tuple(dict.fromkeys(twins)))
