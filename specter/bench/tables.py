"""Markdown rendering of a ``specter.bench/2`` JSON document.

Contract: ``markdown(bench)`` returns GitHub-flavoured markdown, with no I/O: a header paragraph
(title, model, machine, threads, prompts x new tokens, repeats, wall time and peak memory, the
slow 8 MiB pieces of memory found and swapped where any buffer was settled, command), one line
per link (an emulated link is marked EMULATED), then one table per (budget, link) cell, budgets
in the order of ``bench["budgets"]`` and links in the order of ``bench["links"]`` (a budget, here
and in every table, as ``specter.bench.budgets.label`` writes it: ``25%``, ``8 per layer``,
``40 experts``, ``2 MiB``; a fraction's heading says ``25% of experts``), and a last
table for the budget-independent rows (those whose budget or link is null: resident, hf-offload).
Each JSON row is exactly one table row, in JSON order within its table. Any metric may be null or
absent and renders as ``-``; ratios render as ``1.80x``, rates with 3 decimals. A row's ``note`` is
listed under its table. Where no row has a lossless verdict, a line after the tables says why (no
eager ``resident`` row to compare tokens with, or sampling that is not greedy).

Then, when there is something to show: "Where the time goes (specter rows)", one table row per
specter row with ``phases`` (draft step against the row's ``single_step_s``, resident's median
target step of the same compile mode in the same cell, a step with no transfer in it; without it
resident's row's ``decode_step_s``, else the cell's ondemand step; verification's compute per expert
read against that step per expert read, i.e. ``decode_step_s / (top_k * n_moe_layers)``, and
the part of it in the expert kernels where measured (a CPU's host-computed experts); each
phase's share of the round; the prefetch mode its last run ended in, ``(auto)`` when
``offload.prefetch: auto`` chose it),
and "Governor", one row per row whose ``governor_summary`` names a governor other than ``fixed``,
followed by the roofline table of the first such row of each (budget, link, compile) cell;
"Compiled against eager" (``specter.bench.pairs``, as the next), one row per compiled row with
an eager row of the same label and cell:
both medians, compiled / eager (medians, and the range over runs paired by repeat), then a line
counting the rows at or above 1.00x and, of those below, the ones within the A/A noise floor (a
row's own twins' largest gap where it has twins, else the smallest such floor of the run);
and "Noise floor: identical engines (A/A)", one row per row with ``twin_of`` (``sweep.twins``):
the two medians, their ratio, the range of the paired runs' ratios and both engines' memory read
rates (``memory_read_gibps``: where their memory landed), and the largest gap.
"""

from __future__ import annotations

from collections.abc import Iterable

from specter.bench import budgets as budget_of
from specter.bench import markdown_format as fmt
from specter.bench.pairs import compile_section, twin_section

SAME_MEMORY = "ondemand@same-memory"

COLUMNS = (
    "engine", "compile", "decode tok/s median (min-max)", "vs ondemand", "vs same-memory", "vs resident",
    "hit rate", "copies/token", "I/O wait share", "acceptance", "mean k", "device MiB", "lossless",
)


def _tokens(stats: dict | None) -> str:
    stats = stats or {}
    median, lo, hi = stats.get("median"), stats.get("min"), stats.get("max")
    if median is None:
        return "-"
    if lo is None or hi is None:
        return f"{median:.2f}"
    return f"{median:.2f} ({lo:.2f}-{hi:.2f})"


def _lossless(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "**NO**")


def _mean_k(row: dict) -> str:
    k = row.get("k_mean")
    return fmt.num(k if k is not None else row.get("k"), 2)


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


def _label(row: dict, independent: bool) -> str:
    label = row.get("label") or row.get("engine") or "?"
    if not independent:
        return label
    where = [f"budget {budget_of.label(row['budget'])}"] if row.get("budget") is not None else []
    where += [f"link {row['link']}"] if row.get("link") is not None else []
    return f"{label} ({', '.join(where)})" if where else label


def table_row(row: dict, independent: bool = False) -> str:
    ratios = row.get("ratios") or {}
    cells = (
        _label(row, independent),
        "compiled" if row.get("compile") else "eager",
        _tokens(row.get("decode_tokens_per_s")),
        fmt.ratio(ratios.get("ondemand")),
        fmt.ratio(ratios.get(SAME_MEMORY)),
        fmt.ratio(ratios.get("resident")),
        fmt.num(row.get("hit_rate"), 3),
        fmt.num(row.get("copies_per_token"), 2),
        fmt.num(row.get("io_wait_share"), 3),
        fmt.num(row.get("acceptance_rate"), 3),
        _mean_k(row),
        _mib(row.get("device_bytes_total")),
        _lossless(row.get("lossless")),
    )
    return fmt.row(cells)


def table(rows: Iterable[dict], independent: bool = False) -> list[str]:
    rows = list(rows)
    lines = fmt.rows_table(COLUMNS, ()) + [table_row(row, independent) for row in rows]
    notes = list(dict.fromkeys((row.get("label") or row.get("engine") or "?", row["note"]) for row in rows if row.get("note")))
    if notes:
        lines += [""] + [f"- {fmt.escape(label)}: {fmt.escape(note)}" for label, note in notes]
    return lines


def link_line(name: str, link: dict | None) -> str:
    link = link or {}
    parts = [str(link.get("kind") or "?")]
    if link.get("gbps") is not None:
        parts.append(f"{link['gbps']:g} GB/s")
    if link.get("latency_us") is not None:
        parts.append(f"{link['latency_us']:g} us latency")
    text = f"- link `{name}`: {', '.join(parts)}"
    return text + (" - **EMULATED** (paced in software, not measured hardware)" if link.get("emulated") else "")


def _placement_text(placement: dict | None) -> str:
    """``, slow memory: S of P 8 MiB pieces swapped`` where the run settled any buffer's pages."""
    if not isinstance(placement, dict) or not placement.get("pieces"):
        return ""
    return (f", slow memory: {placement.get('slow', 0)} of {placement['pieces']} 8 MiB pieces found, "
            f"{placement.get('swapped', 0)} swapped")


def header(bench: dict) -> list[str]:
    model, machine = bench.get("model") or {}, bench.get("machine") or {}
    expert_bytes = model.get("expert_bytes")
    model_text = (f"{model.get('arch', '?')} (`{model.get('path', '?')}`): {model.get('n_moe_layers', '?')} MoE layers"
                  f" x {model.get('n_experts', '?')} experts, top-{model.get('top_k', '?')}, "
                  f"{_mib(expert_bytes)} MiB per expert")
    machine_text = ", ".join(
        f"{key} {machine[key]}" for key in ("cpu", "cores", "platform", "python", "torch", "transformers", "device")
        if machine.get(key) is not None)
    wall = bench.get("wall_s")
    workload = (f"{bench.get('prompts', '?')} prompts x {bench.get('max_new_tokens', '?')} new tokens, "
                f"{bench.get('repeats', '?')} repeats (median over repeats)"
                + (f", wall {wall:.1f} s" if wall is not None else "")
                + (f", peak memory {bench['peak_rss_bytes'] / 2**30:.1f} GiB" if bench.get("peak_rss_bytes") else "")
                + _placement_text(bench.get("page_placement")))
    lines = [
        f"## {bench.get('title') or 'bench'}",
        "",
        f"**Model**: {model_text}. **Machine**: {machine_text or '-'}. **Threads**: {bench.get('threads', '-')}. "
        f"**Workload**: {workload}.",
    ]
    if bench.get("command"):
        lines += ["", f"Command: `{bench['command']}`"]
    links = bench.get("links") or {}
    if links:
        lines += [""] + [link_line(name, link) for name, link in links.items()]
    return lines


def _order(declared: Iterable, seen: Iterable) -> list:
    """``declared``, then the values of ``seen`` not in it, each once (values may be unhashable)."""
    order: list = []
    for value in [*declared, *seen]:
        if value not in order:
            order.append(value)
    return order


PHASE_COLUMNS = (
    "label", "budget", "link", "compile", "rounds", "draft step ms", "draft / target step", "verify ms/round",
    "verify tok/round", "distinct experts/layer", "verify ms/expert read", "of it kernels",
    "single-step ms/expert read",
    "verify / single-step", "draft share", "verify share", "host share", "prefetch at the end",
)
GOVERNOR_COLUMNS = ("label", "cell", "k histogram", "prediction error", "probes", "rounds cut at prompt end")


def phase_table(bench: dict) -> list[str]:
    rows = bench.get("rows") or []
    model = bench.get("model") or {}
    top_k, layers = model.get("top_k"), model.get("n_moe_layers")
    reads = top_k * layers if isinstance(top_k, (int, float)) and isinstance(layers, (int, float)) else None

    def step(label: str, row: dict, same_cell: bool) -> float | None:
        cell = (row.get("budget"), row.get("link"))
        return next((o["decode_step_s"] for o in rows if (o.get("label") or o.get("engine")) == label
                     and bool(o.get("compile")) == bool(row.get("compile")) and o.get("decode_step_s") is not None
                     and (not same_cell or (o.get("budget"), o.get("link")) == cell)), None)

    out = []
    for row in rows:
        phases = row.get("phases")
        if row.get("engine") != "specter" or not isinstance(phases, dict) or not phases:
            continue
        target = row.get("single_step_s")  # resident's steps in this cell: no transfer in them
        target = target if target is not None else step("resident", row, False)
        target = target if target is not None else step("ondemand", row, True)
        per_expert = fmt.div(target, reads)
        verify_expert = phases.get("verify_compute_s_per_expert")
        total = sum(phases.get(key) or 0.0 for key in ("draft_s", "flush_s", "verify_s", "host_s"))
        out.append((
            row.get("label") or row.get("engine") or "?",
            budget_of.label(row.get("budget")), row.get("link") or "-",
            "compiled" if row.get("compile") else "eager",
            "-" if phases.get("rounds") is None else phases["rounds"],
            fmt.num(fmt.mul(phases.get("draft_step_s"), 1e3), 2),
            fmt.num(fmt.div(phases.get("draft_step_s"), target), 3),
            fmt.num(fmt.mul(phases.get("verify_s_per_round"), 1e3), 2),
            fmt.num(phases.get("verify_tokens_per_round"), 2),
            fmt.num(phases.get("distinct_experts_per_layer"), 2), fmt.num(fmt.mul(verify_expert, 1e3), 3),
            fmt.num(fmt.mul(phases.get("verify_kernel_s_per_expert"), 1e3), 3),
            fmt.num(fmt.mul(per_expert, 1e3), 3), fmt.ratio(fmt.div(verify_expert, per_expert)),
            *(fmt.share(fmt.div(phases.get(key), total)) for key in ("draft_s", "verify_s", "host_s")),
            _prefetch_cell(row.get("prefetch")),
        ))
    return fmt.rows_table(PHASE_COLUMNS, out) if out else []


def _prefetch_cell(prefetch: dict | None) -> str:
    """``conservative`` / ``lazy`` / ``aggressive`` as the row's last run ended, ``(auto)`` when it chose."""
    if not isinstance(prefetch, dict) or prefetch.get("conservative") is None:
        return "-"
    state = "conservative" if prefetch["conservative"] else "lazy" if prefetch.get("lazy") else "aggressive"
    return f"{state} (auto)" if prefetch.get("mode") == "auto" else state


def governor_section(bench: dict) -> list[str]:
    rows = [r for r in bench.get("rows") or [] if isinstance(r.get("governor_summary"), dict)
            and r["governor_summary"].get("name") not in (None, "fixed")]
    if not rows:
        return []
    out, tables = [], {}
    for row in rows:
        summary = row["governor_summary"]
        histogram = row.get("k_histogram") or {}
        error, total = summary.get("prediction_error"), summary.get("prediction_total_error")
        out.append((f"{row.get('label') or row.get('engine') or '?'} ({summary['name']})", fmt.where(row),
                    " ".join(f"{k}:{n}" for k, n in sorted(histogram.items(), key=lambda kv: int(kv[0]))) or "-",
                    "-" if error is None else f"{error:.1%}" + ("" if total is None else f" ({total:.1%} total)"),
                    "-" if summary.get("probes") is None else summary["probes"],
                    "-" if summary.get("cut_rounds") is None else summary["cut_rounds"]))
        key = (budget_of.key(row.get("budget")), row.get("link"), bool(row.get("compile")))
        if summary.get("table") and key not in tables:
            tables[key] = row
    lines = fmt.rows_table(GOVERNOR_COLUMNS, out)
    if tables:
        lines += ["", "Each roofline table is the governor's prediction, when the run ended, for a round at the place in "
                      "its prompt where the last one stopped: usually past a prompt's first rounds, whose transfer waits "
                      "are longer (the prefill left its own experts in the cache), so it may promise more tokens/s than "
                      "the run made."]
    for row in tables.values():
        entries = [e for e in row["governor_summary"]["table"] if isinstance(e, dict)]
        lines += ["", f"Roofline table of {row.get('label') or row.get('engine') or '?'} ({fmt.where(row)}):", ""]
        lines += fmt.rows_table(("k", "expected accepted", "predicted round ms", "predicted tok/s"), (
            ("-" if e.get("k") is None else e["k"], fmt.num(e.get("expected_accepted"), 2),
             fmt.num(fmt.mul(e.get("predicted_round_s"), 1e3), 2), fmt.num(e.get("predicted_tokens_per_s"), 2))
            for e in entries))
    return lines


def disk_section(bench: dict) -> list[str]:
    """Rows whose link read from disk: the bandwidth the disk delivered while reads were in flight,
    bytes read per decoded token, the read mode and the I/O wait share."""
    rows = [r for r in bench.get("rows") or [] if isinstance(r.get("link_stats"), dict)
            and r["link_stats"].get("bytes_read") is not None]
    if not rows:
        return []
    return fmt.rows_table(("engine", "where", "read mode", "disk GB/s (while reading)", "GB read", "I/O wait share"), (
        (row.get("label") or row.get("engine") or "?", fmt.where(row), row["link_stats"].get("io") or "-",
         fmt.num(row["link_stats"].get("read_gbps"), 3), fmt.num(fmt.mul(row["link_stats"].get("bytes_read"), 1e-9), 2),
         fmt.share(row.get("io_wait_share")))
        for row in rows))


def lossless_note(bench: dict) -> list[str]:
    """Why the lossless column is ``-`` in every row (nothing where some row has a verdict)."""
    rows = bench.get("rows") or []
    if not rows or any(row.get("lossless") is not None for row in rows):
        return []
    run = (bench.get("bench_recipe") or {}).get("run") or {}
    if ((run.get("sampling") or {}).get("temperature") or 0) > 0:
        why = "sampling is not greedy (`sampling.temperature` > 0), so no tokens are compared"
    else:
        why = ("no eager `resident` row ran to compare tokens with (add `resident` to `--engines` and `eager` to "
               "`--compile`)")
    return ["", f"Lossless `-`: {why}."]


def markdown(bench: dict) -> str:
    rows = bench.get("rows") or []
    cell_rows = [r for r in rows if r.get("budget") is not None and r.get("link") is not None]
    independent = [r for r in rows if r.get("budget") is None or r.get("link") is None]
    budgets = _order(bench.get("budgets") or [], (r["budget"] for r in cell_rows))
    links = _order(bench.get("links") or {}, (r["link"] for r in cell_rows))
    lines = header(bench)
    for budget in budgets:
        for link in links:
            cell = [r for r in cell_rows if r["budget"] == budget and r["link"] == link]
            if cell:
                emulated = ((bench.get("links") or {}).get(link) or {}).get("emulated")
                of_experts = " of experts" if isinstance(budget, (int, float)) else ""
                lines += ["", f"### budget {budget_of.label(budget)}{of_experts}, link `{link}`"
                          + (" (EMULATED)" if emulated else ""), ""] + table(cell)
    if independent:
        lines += ["", "### budget-independent", ""] + table(independent, independent=True)
    lines += lossless_note(bench)
    for title, section in (("Where the time goes (specter rows)", phase_table(bench)),
                           ("Disk reads (last repeat, prefill included)", disk_section(bench)),
                           ("Governor", governor_section(bench)),
                           ("Compiled against eager", compile_section(bench)),
                           ("Noise floor: identical engines (A/A)", twin_section(bench))):
        if section:
            lines += ["", f"### {title}", ""] + section
    return "\n".join(lines) + "\n"
