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
sweep builds a second, identical engine (``<label> (twin)``) that takes its turns in the same cells
and repeats (after the cell's other offloaded engines): how far apart two copies of one engine land
in a cell is the run's noise floor. With neither ``k`` nor ``governors`` given, the specter rows
are the run recipe's governor's (its k where it is ``fixed``), as for a plain run recipe.
``warmup_tokens`` is at least 1; the run recipe's ``max_new_tokens`` at least 2 (the first token
comes from the prefill, so one alone leaves no decode to time).

``budgets`` takes every form of ``offload.expert_budget`` (a fraction, ``{per_layer: N}``,
``{experts: N}``, a byte size like ``2MiB``), kept as written; two naming one budget (``2MiB``,
``"2097152"``) are refused, as are a ``k`` or a governor given twice (each would run a cell or row
twice, merged). ``title`` names the output files (``<title>.json``): 1-100 characters, no ``/``,
``\\`` or control character, not only dots.

A file without ``run``/``sweep`` is a plain run recipe: it is benched as one cell (its own budget,
link, k and compile setting) with the default engines. ``overrides`` (``key=value``) apply to the
run recipe; ``sweep_overrides`` (a mapping) replace sweep keys. When they replace ``engines``,
``k`` or ``governors`` but not ``twins``, the recipe's twins of rows no longer in the sweep are
dropped. Every mistake raises ``RecipeError`` naming the key (``sweep.budgets[1]: ...``,
``run.max_new_tokens: ...``; a YAML syntax error as ``recipe: FILE:LINE:COL: ...``; a bench's
result JSON given as the recipe as ``recipe: ...``, pointing at ``plot``; an override of a sweep
key, ``sweep.repeats=3`` or ``repeats=3``, naming its option, ``SWEEP_OPTIONS``), before any engine
is built: plugin names (a governor, a link kind) are checked against the registry, and an override
of a key the sweep sets in every cell (``dropped``: ``engine``, ``compile``, ``check_lossless``,
``offload.expert_budget``, ``offload.link`` and the keys of it a sweep link sets,
``speculation.governor``'s name, and its k and options where every specter row has a fixed k) is
refused, naming the sweep option to use; "every cell" counts the sweep keys the recipe (or
``sweep_overrides``) gives, since one left out takes the run recipe's value. The same keys written
in a bench recipe's ``run`` section are kept in ``BenchSpec.unused`` as (``run.<key>``, the option
to use) for the CLI to warn about, where the recipe's own sweep makes them dead too (not where only
``sweep_overrides`` do: narrowing a recipe from the command line is no mistake in it).
``fixed_k_overrides(k)``: the run recipe overrides of a ``specter`` row that always drafts k (the
sweep's ``specter k=<k>`` rows; scripts that build one cell's engine take them too);
``budget_override(budget)``, ``link_overrides(link)``, ``governor_override(name)``: the run recipe
overrides of a cell's budget and link and of a ``specter <governor>`` row.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from collections.abc import Set
from pathlib import Path
from typing import Any, Mapping, Sequence

from specter.config import Recipe, load_recipe
from specter.config.loading import _read_yaml
from specter.config.recipe import MAX_K
from specter.config.schema import check_bounded
from specter.config.unused import leaves, under
from specter.errors import RecipeError, SpecterError, bounded_repr

SAME_MEMORY = "ondemand@same-memory"
BENCH_ENGINES = ("resident", "ondemand", "router-lookahead", "specter", "hf-offload", SAME_MEMORY)  # what a sweep knows how to run
DEFAULT_ENGINES = ("resident", "ondemand", SAME_MEMORY, "specter")
SWEEP_KEYS = ("engines", "budgets", "links", "k", "governors", "compile", "repeats", "warmup_tokens", "twins")
SWEEP_OPTIONS = {key: "--" + key.replace("_", "-") for key in SWEEP_KEYS}  # the CLI option that replaces each
TWIN_SUFFIX = " (twin)"
TITLE = re.compile(r"[^/\\\x00-\x1f\x7f]{1,100}")


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
    unused: tuple[tuple[str, str], ...] = ()  # (run.<key>, what to use): run-section keys every cell replaces

    def specter_variants(self) -> list[tuple[str, list[str], int | None, str]]:
        """(label, recipe overrides, k, governor) of every specter row."""
        variants = [(f"specter k={k}", fixed_k_overrides(k), k, "fixed") for k in self.k]
        variants += [(f"specter {g}", [governor_override(g)], None, g) for g in self.governors]
        return variants

    def row_labels(self) -> list[str]:
        """The labels of the rows an offloaded group of a cell has (twins excluded)."""
        labels = [label for label, *_ in self.specter_variants()] if "specter" in self.engines else []
        return labels + [e for e in ("ondemand", "router-lookahead", SAME_MEMORY) if e in self.engines]

    def cell_recipe(self, engine: str, budget: Any, link: str | None, compile: bool, extra: Sequence[str] = ()) -> Recipe:
        overrides = [f"engine={engine}", f"compile={str(compile).lower()}", "check_lossless=false", *extra]
        if budget is not None:
            overrides.append(budget_override(budget))
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


def governor_override(name: str) -> str:
    return f"speculation.governor.name={json.dumps(name)}"


def budget_override(budget: Any) -> str:
    return f"offload.expert_budget={json.dumps(budget, default=str)}"


def link_overrides(link: Mapping) -> list[str]:
    return [f"offload.link.{key}={json.dumps(value, default=str)}" for key, value in link.items()]


def _error(key: str, text: str) -> RecipeError:
    return RecipeError(f"{key}: {text}")


def _within(key: str, error: SpecterError) -> RecipeError:
    """``error`` (``subkey: ...`` or ``recipe: ...``) as a mistake under ``key`` of the bench recipe."""
    text = str(error)
    return RecipeError(key + text[len("recipe"):] if text.startswith("recipe:") else f"{key}.{text}")


def _list(raw: Mapping, key: str, default: Sequence) -> list:
    value = raw.get(key, list(default))
    if not isinstance(value, (list, tuple)) or not value:
        raise _error(f"sweep.{key}", f"expected a non-empty list, got {value!r:.60}")
    return list(value)


def _once(key: str, written: Sequence, meant: Sequence) -> None:
    """Refuse two values of ``sweep.<key>`` that mean one (``meant``): it would run twice, merged."""
    for i, meaning in enumerate(meant):
        first = list(meant).index(meaning)
        if first < i:
            raise _error(f"sweep.{key}[{i}]", f"{bounded_repr(written[i])} repeats sweep.{key}[{first}] "
                                               f"({bounded_repr(written[first])}); give each once")


def _title(value: object) -> str:
    text = str(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else None
    if text is None or not TITLE.fullmatch(text) or not text.strip(" ."):
        raise _error("title", f"{bounded_repr(value)} cannot name the output files (<title>.json, <title>.md); "
                              "allowed: 1-100 characters, no / or \\ or control character, not only dots")
    return text


def _read(path: Path) -> Any:
    raw = _read_yaml(path)
    check_bounded(raw, "bench recipe")
    return raw


def _budgets(sweep: Mapping, base: Recipe) -> list:
    budgets = _list(sweep, "budgets", [base.offload.expert_budget.to_recipe_value()])
    meant = []
    for i, budget in enumerate(budgets):
        try:
            meant.append(load_recipe(base, [budget_override(budget)]).offload.expert_budget)
        except SpecterError as error:
            raise _error(f"sweep.budgets[{i}]", str(error)) from None
    _once("budgets", budgets, meant)
    return budgets


def _links(sweep: Mapping, base: Recipe) -> dict[str, dict]:
    links = sweep.get("links", {base.offload.link.kind: base.offload.link.to_dict()})
    if not isinstance(links, Mapping) or not links:
        raise _error("sweep.links", "expected a mapping of link names to offload.link settings")
    for name, link in links.items():
        if not isinstance(link, Mapping):
            raise _error(f"sweep.links.{name}", "expected a mapping like {kind: emulated, gbps: 1, latency_us: 20}")
        try:
            load_recipe(base, link_overrides(link))
        except SpecterError as error:
            raise _error(f"sweep.links.{name}", str(error)) from None
    return {str(name): dict(link) for name, link in links.items()}


def _specter_rows(sweep: Mapping, base: Recipe, engines: Sequence[str]) -> tuple[list[int], list[str]]:
    """The fixed k values and governors of the specter rows; with neither given, the run recipe's
    governor: its k where it is ``fixed``, else a row of that governor."""
    if "k" not in sweep and "governors" not in sweep and base.speculation.governor.name != "fixed":
        sweep = {**sweep, "k": [], "governors": [base.speculation.governor.name]}
    ks = sweep.get("k", [base.speculation.governor.k])
    if not isinstance(ks, (list, tuple)) or any(isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K for k in ks):
        raise _error("sweep.k", f"expected a list of integers in 1..{MAX_K}, got {ks!r:.60}")
    _once("k", ks, ks)
    governors = sweep.get("governors", [])
    if not isinstance(governors, (list, tuple)) or not all(isinstance(g, str) for g in governors):
        raise _error("sweep.governors", "expected a list of governor names")
    _once("governors", governors, governors)
    for i, governor in enumerate(governors):
        try:  # a plugin of the registry, as the row will name it
            load_recipe(base, [governor_override(governor)])
        except SpecterError as error:
            raise _error(f"sweep.governors[{i}]", str(error)) from None
    if "specter" in engines and not ks and not governors:
        raise _error("sweep.k", "the specter engine needs at least one k or governor")
    return list(ks), list(governors)


def dropped(key: str, replaced: Set[str], links: Mapping, fixed_only: bool) -> str | None:
    """What to use instead of a ``--set`` of run-recipe ``key`` that every cell would replace (so
    drop), None where some cell takes it. ``replaced``: the sweep keys that do not come from the run
    recipe (all in a bench recipe; those given on the command line for a plain run recipe);
    ``fixed_only``: every specter row drafts a fixed k (its own governor k and options)."""
    if key == "engine":
        return "choose engines with --engines (sweep.engines)"
    if key == "check_lossless":
        return "every row's tokens are compared with eager resident's instead (its lossless column)"
    if key == "compile" and "compile" in replaced:
        return "use --compile (sweep.compile)"
    if under(key, ["offload.expert_budget"]) and "budgets" in replaced:
        return "use --budgets (sweep.budgets)"
    if under(key, ["offload.link"]) and "links" in replaced:
        sub = key.split(".")[2:3]
        if not sub or any(sub[0] in link for link in links.values()):  # else no link sets it: every cell takes it
            return "use --links (sweep.links)"
    if key in ("speculation.governor", "speculation.governor.name") and "governors" in replaced:
        return "use --governors (sweep.governors) or --k (sweep.k)"
    if under(key, ["speculation.governor"]) and fixed_only and {"k", "governors"} & replaced:
        return "every specter row of this sweep drafts a fixed k: use --k (sweep.k), or add a row with --governors"
    return None


def load_bench(source: str | Path | Mapping, overrides: Sequence[str] = (), sweep_overrides: Mapping | None = None) -> BenchSpec:
    sweep_overrides = dict(sweep_overrides or {})
    if isinstance(source, Mapping):
        raw, source_dir, title = copy.deepcopy(dict(source)), None, "bench"
    else:
        path = Path(source)
        raw, source_dir, title = _read(path) or {}, path.resolve().parent, path.stem
    if not isinstance(raw, Mapping):
        raise _error("recipe", "the top level must be a mapping")
    if isinstance(raw.get("schema"), str) and raw["schema"].startswith("specter.bench/"):
        raise _error("recipe", f"{source} is a bench's result ({raw['schema']}), not a recipe; to redraw its plots: "
                               f"python -m specter.bench plot {source}")
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        sweep_key = key[len("sweep."):] if key.startswith("sweep.") else key
        if sweep_key.split(".")[0] in SWEEP_OPTIONS and (key != sweep_key or sweep_key != "compile"):
            option = SWEEP_OPTIONS[sweep_key.split(".")[0]]
            raise _error(f"--set {key}", f"a sweep key, not a run-recipe key: use {option} (sweep.{sweep_key})")
    single_cell = "sweep" not in raw and "run" not in raw
    if single_cell:
        run_raw, sweep_raw = raw, {}
    else:
        unknown = set(raw) - {"title", "run", "sweep"}
        if unknown:
            raise _error(sorted(unknown)[0], "unknown key; allowed keys of a bench recipe: title, run, sweep")
        run_raw, sweep_raw, title = raw.get("run") or {}, raw.get("sweep") or {}, _title(raw.get("title", title))
        if not isinstance(sweep_raw, Mapping):
            raise _error("sweep", f"expected a mapping of sweep keys ({', '.join(SWEEP_KEYS)})")
    if not isinstance(run_raw, Mapping):
        raise _error("run", "expected a mapping of run-recipe keys")
    try:
        base = load_recipe(run_raw, overrides, source_dir=source_dir)
    except SpecterError as error:
        raise (error if single_cell else _within("run", error)) from None
    if base.max_new_tokens < 2:  # the first token comes from the prefill: no decode to time
        raise _error("max_new_tokens" if single_cell else "run.max_new_tokens",
                     f"a bench times decoding, which needs at least 2 new tokens a prompt, got {base.max_new_tokens}")
    if single_cell:
        sweep_raw = {"budgets": [base.offload.expert_budget.to_recipe_value()],
                     "links": {base.offload.link.kind: base.offload.link.to_dict()},
                     "k": [base.speculation.governor.k], "compile": [base.compile]}
        if base.speculation.governor.name != "fixed":
            sweep_raw.update(k=[], governors=[base.speculation.governor.name])
    own_sweep, sweep_raw = sweep_raw, {**sweep_raw, **sweep_overrides}
    unknown = set(sweep_raw) - set(SWEEP_KEYS)
    if unknown:
        raise _error(f"sweep.{sorted(unknown)[0]}", f"unknown key; allowed keys: {', '.join(SWEEP_KEYS)}")
    engines = _list(sweep_raw, "engines", DEFAULT_ENGINES)
    for i, name in enumerate(engines):
        if name not in BENCH_ENGINES:
            raise _error(f"sweep.engines[{i}]", f"unknown engine {name!r}; allowed: {', '.join(BENCH_ENGINES)}")
    if SAME_MEMORY in engines and "specter" not in engines:
        raise _error("sweep.engines", f"{SAME_MEMORY} is sized from the specter engine's cache and draft: add specter")
    budgets, links = _budgets(sweep_raw, base), _links(sweep_raw, base)
    ks, governors = _specter_rows(sweep_raw, base, engines)
    compile_modes = _list(sweep_raw, "compile", [base.compile])
    if not all(isinstance(c, bool) for c in compile_modes):
        raise _error("sweep.compile", f"expected a list of booleans, got {compile_modes!r:.60}")
    repeats, warmup = sweep_raw.get("repeats", 2), sweep_raw.get("warmup_tokens", 8)
    for key, value, low in (("repeats", repeats, 1), ("warmup_tokens", warmup, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise _error(f"sweep.{key}", f"expected an integer >= {low}, got {value!r:.60}")
    replaced = set(sweep_overrides) if single_cell else set(sweep_raw) & set(SWEEP_KEYS)
    fixed_only = "specter" in engines and not governors
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        instead = dropped(key, replaced, links, fixed_only)
        if instead is not None:
            raise _error(f"--set {key}", f"the bench sets it in every cell, so this value would be dropped; {instead}")
    written = [] if single_cell else sorted(set(leaves(run_raw)))
    own_links = own_sweep.get("links") if isinstance(own_sweep.get("links"), Mapping) else links
    own_fixed = "specter" in own_sweep.get("engines", DEFAULT_ENGINES) and not own_sweep.get("governors")
    unused = tuple((f"run.{key}", instead) for key in written  # dead as the recipe is written, not only by the options
                   if (instead := dropped(key, replaced, links, fixed_only)) is not None
                   and dropped(key, set(own_sweep) & set(SWEEP_KEYS), own_links, own_fixed) is not None)
    spec = BenchSpec(title=title, recipe=base, engines=tuple(engines), budgets=tuple(budgets), links=links,
                     k=tuple(ks), governors=tuple(governors), compile=tuple(dict.fromkeys(compile_modes)),
                     repeats=repeats, warmup_tokens=warmup, unused=unused)
    twins = sweep_raw.get("twins", [])
    if not isinstance(twins, (list, tuple)) or not all(isinstance(t, str) for t in twins):
        raise _error("sweep.twins", "expected a list of row labels, like [specter k=4]")
    if "twins" not in sweep_overrides and {"engines", "k", "governors"} & set(sweep_overrides):
        twins = [label for label in twins if label in spec.row_labels()]  # rows the command line left out
    for i, label in enumerate(twins):
        if label not in spec.row_labels():
            allowed = ", ".join(spec.row_labels()) or "none (no offloaded engine)"
            raise _error(f"sweep.twins[{i}]", f"{label!r} is not a row of this sweep; its offloaded rows: {allowed}")
    return dataclasses.replace(spec, twins=tuple(dict.fromkeys(twins)))
