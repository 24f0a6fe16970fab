"""Runs a bench recipe: every engine of every cell, interleaved, repeated; one JSON document out.

Contract: ``run_bench(spec, command="") -> dict`` (schema ``specter.bench/2``, documented in
docs/benchmarks.md and read by ``specter.bench.tables`` and ``specter.bench.plots``).

- A cell is (budget, link, compile mode). Offloaded engines are built once per (compile mode,
  budget) and moved from link to link (``OffloadedEngine.use_link``); ``resident`` is built once
  per compile mode and runs in every cell; ``hf-offload`` runs eagerly once per budget (it has
  no link and no compiled mode). The cells of one (budget, link) run together: every engine of
  every compile mode there first generates ``warmup_tokens`` tokens on the first prompt
  (untimed), then all of them run all prompts ``repeats`` times, alternating their order each
  repeat; within a repeat they take turns prompt by prompt (``Engine.generate_by_prompt``), so
  every engine's rate, eager or compiled, spans the same minutes of the machine, and so do the
  ratios within a cell and between a compiled row and its eager row.
- A row is one (engine label, budget, link, compile mode): decode tokens/s (median, min, max and
  every run), the figures of its last run, its round phases pooled over every run (``phases``,
  ``specter.report.metrics.pool_phases``), its target step's median over its runs
  (``decode_step_s``), in a cell the median target step of ``resident`` (same compile mode) over
  the runs it made in that cell (``single_step_s``: a step with no transfer in it, measured in the
  same minutes), whether its greedy tokens equal the eager
  ``resident`` engine's, its median's ratio to each baseline's median in the same cell, and how
  fast one thread read its cache slots (or its large weights) after the cell's runs
  (``memory_read_gibps``, ``specter.bench.memory_rate``). Its ``budget`` (and the document's
  ``budgets``) is written as in ``sweep.budgets``: a fraction, ``{per_layer: N}``,
  ``{experts: N}`` or a byte size string (``specter.bench.budgets`` labels them); null for a row
  built once for every cell (``resident``).
- Progress on stderr: a line per engine built, one per (budget, link) before its engines warm up
  (``[budget 25%, slow link, eager and compiled] warming up 12 engines (48 tokens each) ...``),
  one per engine warmed up (``[budget 25%, slow link, compiled] warmed up specter k=4 in 3.2 s``),
  one per timed run.
- The document's ``page_placement``: what settling the engines' large buffers did over the run
  (``specter.memory.page_placement.stats``: pieces probed, slow, swapped, bytes held apart).
- Labels: ``specter k=K`` (fixed k), ``specter <governor>``; ``ondemand`` has the cache of the
  ``specter`` engine (same cache size); ``ondemand@same-memory`` has that cache plus the bytes of
  ``specter``'s INT4 draft (same total device memory); ``<label> (twin)``: a second engine built
  exactly as the row it names (``sweep.twins``; the row's ``twin_of``), an A/A control.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import sys
import time
from typing import Any, Iterator

import torch

from specter.bench import budgets as budget_of
from specter.bench.memory_rate import engine_read_rate
from specter.bench.spec import SAME_MEMORY, TWIN_SUFFIX, BenchSpec
from specter.memory import page_placement
from specter.report.metrics import pool_phases

SCHEMA = "specter.bench/2"
BASELINES = ("ondemand", SAME_MEMORY, "router-lookahead", "resident", "hf-offload")


def machine() -> dict:
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    device = "cuda: " + torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "device": device}


class Progress:
    """A tqdm bar over all timed runs on a terminal; plain lines on stderr otherwise."""

    def __init__(self, total: int, title: str, enabled: bool | None = None) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc=title, unit="run", disable=None if enabled is None else not enabled,
                        file=sys.stderr)

    def log(self, message: str) -> None:
        if self.bar.disable:
            print(message, file=sys.stderr, flush=True)
        else:
            self.bar.write(message, file=sys.stderr)

    def step(self) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class Sweep:
    def __init__(self, spec: BenchSpec, progress: bool | None = None) -> None:
        self.spec = spec
        self.prompts = spec.recipe.resolved_prompts()
        self.written = {budget_of.key(b): b for b in spec.budgets}  # budgets.key -> the budget as written
        self.runs: dict[tuple, list[dict]] = {}  # (label, budget key, link, compile) -> reports
        self.tokens: dict[tuple, list[list[int]]] = {}
        self.cells: dict[tuple, dict[str, list[float]]] = {}  # (budget key, link, compile) -> label -> tok/s runs
        self.meta: dict[tuple, dict] = {}  # (label, budget key; None for resident) -> {engine, k, governor, note}
        self.read_rates: dict[tuple, float | None] = {}  # (label, budget key, link, compile) -> GiB/s (memory_rate)
        self.cell_steps: dict[tuple, list[float]] = {}  # (budget key, link, compile) -> resident's decode_step_s runs
        self.reference: list[list[int]] | None = None
        self.progress = Progress(self._count_runs(), spec.title, progress)

    def _count_runs(self) -> int:
        spec = self.spec
        per_cell = len(spec.row_labels()) + len(spec.twins) + ("resident" in spec.engines)
        total = per_cell * len(spec.budgets) * len(spec.links) * len(spec.compile)
        total += ("hf-offload" in spec.engines) * len(spec.budgets)
        return total * spec.repeats

    # ----- building ---------------------------------------------------------------------------

    def _build(self, label: str, engine: str, budget, link: str | None, compile: bool, extra=()):
        from specter.build import build_engine

        mode = "compiled" if compile else "eager"
        where = "" if budget is None else f" budget {budget_of.label(budget)}"
        self.progress.log(f"building {label} ({mode}{where}) ...")
        started = time.perf_counter()
        built = build_engine(self.spec.cell_recipe(engine, budget, link, compile, extra))
        built.bench_label = label
        self.progress.log(f"built {label} in {time.perf_counter() - started:.1f} s")
        return built

    def _offloaded_group(self, budget, link: str, compile: bool) -> dict[str, Any]:
        spec, group = self.spec, {}
        plans: dict[str, tuple[str, Any, list[str], dict]] = {}  # label -> (engine, budget, overrides, meta)

        def build(label: str, as_label: str | None = None):
            engine, engine_budget, extra, _ = plans[label]
            return self._build(as_label or label, engine, engine_budget, link, compile, extra)

        if "specter" in spec.engines:
            for label, extra, k, governor in spec.specter_variants():
                plans[label] = ("specter", budget, extra, {"engine": "specter", "k": k, "governor": governor})
        for name in ("ondemand", "router-lookahead"):
            if name in spec.engines:
                plans[name] = (name, budget, [], {"engine": name})
        for label in plans:
            group[label] = build(label)
        if SAME_MEMORY in spec.engines:
            first = next(e for e in group.values() if e.name == "specter")
            same_bytes = first.cache.bytes + first.draft_bytes
            note = f"cache = specter's cache + INT4 draft ({same_bytes:,} B)"
            plans[SAME_MEMORY] = ("ondemand", None, [f"offload.expert_budget={same_bytes}B"],
                                  {"engine": "ondemand", "note": note})
            group[SAME_MEMORY] = build(SAME_MEMORY)
        bkey = budget_of.key(budget)
        for label, (*_, meta) in plans.items():
            self.meta[(label, bkey)] = meta  # a budget's own: the same-memory engine's note names its bytes
            if label in spec.twins:  # an identical second engine: the cell's noise floor
                twin = label + TWIN_SUFFIX
                group[twin] = build(label, twin)
                self.meta[(twin, bkey)] = {**meta, "twin_of": label}
        return group

    # ----- running ----------------------------------------------------------------------------

    def _run_cell(self, engines: dict[tuple[str, bool], Any], budget, link: str | None,
                  scopes: dict[tuple[str, bool], tuple]) -> None:
        """Every engine of the (budget, link) cells of every compile mode, keyed by (label,
        compiled), warmed up (after a progress line saying so), then taking turns prompt by prompt
        for ``repeats`` repeats."""
        bkey, tokens = budget_of.key(budget), self.spec.warmup_tokens
        modes = " and ".join(dict.fromkeys("compiled" if compile else "eager" for _, compile in engines))
        self.progress.log(f"[{_cell_name(budget, link, modes)}] warming up {len(engines)} engine"
                          f"{'' if len(engines) == 1 else 's'} ({tokens} token{'' if tokens == 1 else 's'} each) ...")
        for (label, compile), engine in engines.items():
            started = time.perf_counter()
            engine.generate(self.prompts[:1], max_new_tokens=tokens)
            mode = "compiled" if compile else "eager"
            self.progress.log(f"[{_cell_name(budget, link, mode)}] warmed up {label} in "
                              f"{time.perf_counter() - started:.1f} s")
        for repeat in range(self.spec.repeats):
            order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
            for (label, compile), result in take_turns(engines, order, self.prompts):
                rate = result.report["decode_tokens_per_s"]
                key = scopes.get((label, compile), (label, bkey, link, compile))
                self.runs.setdefault(key, []).append(result.report)
                self.tokens[key] = result.token_ids
                self.cells.setdefault((bkey, link, compile), {}).setdefault(label, []).append(rate)
                if label == "resident" and not compile and self.reference is None:
                    self.reference = result.token_ids
                if label == "resident" and result.report.get("decode_step_s") is not None:
                    self.cell_steps.setdefault((bkey, link, compile), []).append(result.report["decode_step_s"])
                self.progress.step()
                mode = "compiled" if compile else "eager"
                shown = "- (no decode step timed)" if rate is None else f"{rate:.2f} tok/s"
                self.progress.log(f"[{_cell_name(budget, link, mode)} #{repeat + 1}] {label}: {shown}")
        for (label, compile), engine in engines.items():  # after the timed runs: where each one's memory landed
            key = scopes.get((label, compile), (label, bkey, link, compile))
            if key not in self.read_rates:  # an engine scoped over cells (resident) is read once
                self.read_rates[key] = engine_read_rate(engine)

    def run(self) -> None:
        """Both compile modes' engines of a (budget, link) take turns in one cell run, so a compiled
        row and its eager row span the same minutes (offloaded engines share one host store, so
        both groups fit in memory)."""
        spec = self.spec
        links = list(spec.links)
        residents = {}
        if "resident" in spec.engines:
            residents = {compile: self._build("resident", "resident", None, None, compile) for compile in spec.compile}
            self.meta[("resident", None)] = {"engine": "resident"}
        for budget in spec.budgets:
            groups = {compile: self._offloaded_group(budget, links[0], compile) for compile in spec.compile}
            hf = None
            if "hf-offload" in spec.engines:
                hf = self._build("hf-offload", "hf-offload", budget, None, False)
                self.meta[("hf-offload", budget_of.key(budget))] = {"engine": "hf-offload", "note": _hf_note(hf)}
            for index, link in enumerate(links):
                cell, scopes = {}, {}
                for compile, group in groups.items():
                    for label, engine in group.items():
                        if index:
                            engine.use_link(_make_link(spec, engine, link))
                        cell[(label, compile)] = engine
                    if compile in residents:
                        cell[("resident", compile)] = residents[compile]
                        scopes[("resident", compile)] = ("resident", None, None, compile)
                if hf is not None and index == 0:
                    cell[("hf-offload", False)] = hf
                    scopes[("hf-offload", False)] = ("hf-offload", budget_of.key(budget), None, False)
                self._run_cell(cell, budget, link, scopes)
            for engine in [e for group in groups.values() for e in group.values()] + ([hf] if hf is not None else []):
                engine.close()
            del groups, hf, cell  # every reference, before the next budget's engines load
            gc.collect()
        for resident in residents.values():
            resident.close()
        del residents
        gc.collect()
        self.progress.close()

    # ----- the document -----------------------------------------------------------------------

    def rows(self) -> list[dict]:
        hf_medians = {key[1]: _median([r["decode_tokens_per_s"] for r in reports])
                      for key, reports in self.runs.items() if key[0] == "hf-offload"}
        out = []
        for key, reports in self.runs.items():
            label, bkey, link, compile = key
            rates = [r["decode_tokens_per_s"] for r in reports]
            timed = [rate for rate in rates if rate is not None]  # None: a run with no decode step to time
            last = reports[-1]
            median = statistics.median(timed) if timed else None
            ratios = {}
            if link is not None and median is not None:
                cell = {name: _median(v) for name, v in self.cells[(bkey, link, compile)].items()}
                if bkey in hf_medians:
                    cell.setdefault("hf-offload", hf_medians[bkey])
                ratios = {base: median / cell[base] for base in BASELINES
                          if base != label and cell.get(base)}
            meta = self.meta.get((label, bkey), {"engine": label})
            greedy = self.spec.recipe.sampling.temperature == 0
            steps = [r["decode_step_s"] for r in reports if r.get("decode_step_s") is not None]
            single = self.cell_steps.get((bkey, link, compile)) if link is not None else None
            out.append({
                "engine": meta["engine"], "label": label, "k": meta.get("k"), "governor": meta.get("governor"),
                "budget": self.written.get(bkey), "link": link, "compile": compile,
                "decode_tokens_per_s": {"median": median, "min": min(timed, default=None),
                                        "max": max(timed, default=None), "runs": rates},
                "hit_rate": last.get("hit_rate"), "io_wait_share": last.get("io_wait_share"),
                "copies_per_token": last.get("copies_per_token"), "acceptance_rate": last.get("acceptance_rate"),
                "mean_accepted_per_step": last.get("mean_accepted_per_step"),
                "k_mean": (last.get("k") or {}).get("mean"), "k_histogram": (last.get("k") or {}).get("histogram"),
                "ttft_s": last.get("ttft_s"), "transfer_wait_s": last.get("transfer_wait_s"),
                "device_bytes_total": (last.get("device_bytes") or {}).get("total"),
                "lossless": (self.tokens[key] == self.reference) if greedy and self.reference is not None else None,
                "note": meta.get("note"), "ratios": ratios, "twin_of": meta.get("twin_of"),
                "compile_stats": last.get("compile"), "offload": last.get("offload"),
                "phases": pool_phases([r.get("phases") for r in reports], (last.get("model") or {}).get("n_moe_layers")),
                "decode_step_s": statistics.median(steps) if steps else None,
                "single_step_s": statistics.median(single) if single else None,
                "governor_summary": last.get("governor") if meta["engine"] == "specter" else None,
                "link_stats": last.get("link"), "prefetch": _prefetch_state(last.get("prediction")),
                "memory_read_gibps": self.read_rates.get(key),
            })
        return out

    def document(self, command: str, wall_s: float) -> dict:
        any_report = next(iter(self.runs.values()))[-1]
        links = {}
        for name, link in self.spec.links.items():
            kind = link.get("kind", self.spec.recipe.offload.link.kind)
            if kind == "auto":
                kind = "cuda" if torch.cuda.is_available() else "emulated"
            links[name] = {**link, "kind": kind, "emulated": kind == "emulated"}
        return {
            "schema": SCHEMA, "title": self.spec.title, "command": command, "model": any_report["model"],
            "machine": machine(), "threads": self.spec.recipe.threads, "dtype": self.spec.recipe.dtype,
            "prompts": len(self.prompts), "max_new_tokens": self.spec.recipe.max_new_tokens,
            "repeats": self.spec.repeats, "wall_s": wall_s, "peak_rss_bytes": _peak_rss_bytes(),
            "page_placement": page_placement.stats(), "links": links,
            "budgets": list(self.spec.budgets),
            "bench_recipe": self.spec.as_dict(), "rows": self.rows(),
        }


def _peak_rss_bytes() -> int | None:
    """This process's peak resident memory so far (Linux and macOS), None where unknown."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def take_turns(engines: dict[str, Any], order: list[str], prompts: list) -> Iterator[tuple[str, Any]]:
    """Every engine generates every prompt, one prompt at a time in turn (the first engine of
    ``order`` decodes prompt 1, then the next engine prompt 1, ..., then the first prompt 2), so a
    slow spell of the machine falls on every engine alike; yields (label, GenerationResult) as
    each engine finishes its last prompt."""
    running = {label: engines[label].generate_by_prompt(prompts) for label in order}
    while running:
        for label in list(running):
            try:
                next(running[label])
            except StopIteration as finished:
                del running[label]
                yield label, finished.value


def _cell_name(budget, link: str, mode: str) -> str:
    return f"budget {budget_of.label(budget)}, {link} link, {mode}"


def _hf_note(engine) -> str:
    offload = engine.engine_report().get("offload") or {}
    return (f"transformers + accelerate: experts modules beyond the budget offloaded to {offload.get('tier', '?')} "
            f"({offload.get('modules_offloaded', '?')} modules, {offload.get('offloaded_bytes') or 0:,} B), "
            "whole layers at a time" + (f"; {offload['page_cache']}" if offload.get("page_cache") else "")
            + "; eager only")


def _make_link(spec: BenchSpec, engine, link: str):
    from specter.build import make_link

    return make_link(spec.cell_recipe(engine.name, None, link, False), engine.device, getattr(engine, "store", None))


def run_bench(spec: BenchSpec, command: str = "", progress: bool | None = None) -> dict:
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # one bar for the bench, not one per model load
    torch.set_num_threads(spec.recipe.threads)
    started = time.perf_counter()
    sweep = Sweep(spec, progress)
    try:
        sweep.run()
    finally:  # an interrupted run leaves no bar drawn over the shell's prompt
        sweep.progress.close()
    return sweep.document(command, time.perf_counter() - started)


def _prefetch_state(prediction: dict | None) -> dict | None:
    """A prefetching row's ``offload.prefetch`` mode and where its last run ended (mode auto)."""
    if not isinstance(prediction, dict) or prediction.get("prefetch_mode") is None:
        return None
    return {"mode": prediction["prefetch_mode"], "conservative": prediction.get("conservative_now"),
            "lazy": prediction.get("lazy_now"), "transfer_wait_share": prediction.get("transfer_wait_share")}


def _median(rates: list[float | None]) -> float | None:
    """The median of the runs that timed a decode (None where none did)."""
    timed = [rate for rate in rates if rate is not None]
    return statistics.median(timed) if timed else None
