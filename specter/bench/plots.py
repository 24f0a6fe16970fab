"""PNG figures of a ``specter.bench/2`` JSON document (``python -m specter.bench plot BENCH.json``).

Contract: ``plot_all(bench, out_dir, stem=None)`` writes into ``out_dir`` (created if missing)
each figure below that has something to draw, as ``<stem>-<name>.png`` (``stem`` defaults to the
bench title), and returns the written paths in this order:

- ``tokens``: decode tokens/s (median, min-max error bars) against budget, one line per engine
  label, one panel per link; a row without a budget (resident) is a horizontal line, a row
  without a link (resident, hf-offload) is drawn in every panel; eager solid, compiled dashed.
  A budget sits at the share of all experts it gives the model (``specter.bench.budgets.share``)
  where every budget of the document has one, else at its place in the document's order; its
  tick is labelled as the tables label it (``25%``, ``8 per layer``, ``2 MiB``), a budget not
  written as a fraction with its share beside it.
- ``ratio-heatmap``: the best specter row (by median tokens/s) of each (budget, link) cell,
  its ratio to each baseline present (ondemand, ondemand@same-memory, router-lookahead,
  resident) over budget (in the order of ``tokens``) x link; one panel per baseline, one row of
  panels per compile mode, diverging colours centred at 1.0, each cell annotated.
- ``hit-rate`` and ``io-wait``: hit rate and I/O wait share, laid out as ``tokens``.
- ``acceptance-k``: acceptance rate and mean k of the specter rows grouped by cell, and the
  k histogram (share of steps, summed over cells per label) when any row has one.
- ``roofline``: for rows whose ``governor_summary`` has a ``table`` (at most 8, eager rows first),
  one column of panels each: predicted tokens/s against k (the most chosen k of the trace
  starred) over the k chosen per round (the trace, as a step plot).

A figure of one of these names that an earlier draw left in ``out_dir`` and that has nothing to
draw now is removed, so the folder's plots are all of ``bench`` (``FIGURES``: the names in order).

Titles name the model and the thread count, and say "(emulated link)" when links are emulated.
Null or absent metrics are skipped. matplotlib is imported on first use, with the Agg backend.
The ``plot`` subcommand that calls ``plot_all`` on a JSON file is ``specter.bench.__main__.plot``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path

from specter.bench import budgets as budget_of

SCHEMA = "specter.bench/2"
BASELINES = ("ondemand", "ondemand@same-memory", "router-lookahead", "resident")
FIGURES = ("tokens", "ratio-heatmap", "hit-rate", "io-wait", "acceptance-k", "roofline")
DPI = 110

Value = Callable[[dict], "float | None"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _median(row: dict) -> float | None:
    return (row.get("decode_tokens_per_s") or {}).get("median")


def _mean_k(row: dict) -> float | None:
    return row["k_mean"] if row.get("k_mean") is not None else row.get("k")


def _label(row: dict) -> str:
    return row.get("label") or row.get("engine") or "?"


def _rows(bench: dict) -> list[dict]:
    return list(bench.get("rows") or [])


def _budget_axis(bench: dict) -> tuple[dict[Hashable, tuple[float, str]], bool]:
    """Each budget of the document (by ``budgets.key``) -> (x, tick label), and whether x is its
    share of all experts (``budgets.share``, where every budget has one) rather than its place in
    the document's order. A tick of a budget not written as a fraction also names its share."""
    written: list = []
    for value in [*(bench.get("budgets") or []), *(r.get("budget") for r in _rows(bench))]:
        if value is not None and value not in written:
            written.append(value)
    shares = [budget_of.share(value, bench.get("model")) for value in written]
    by_share = all(share is not None for share in shares)
    axis = {}
    for place, (value, share) in enumerate(zip(written, shares)):
        text = budget_of.label(value)
        if by_share and not isinstance(value, (int, float)):
            text += f"\n({share * 100:.3g}%)"
        axis[budget_of.key(value)] = (share if by_share else float(place), text)
    return axis, by_share


def _links(bench: dict) -> list[str]:
    order = list(bench.get("links") or {})
    seen = dict.fromkeys(r.get("link") for r in _rows(bench))
    return order + [link for link in seen if link is not None and link not in order]


def _colors(bench: dict) -> dict[str, tuple]:
    import matplotlib

    labels = list(dict.fromkeys(_label(r) for r in _rows(bench)))
    cmap = matplotlib.colormaps["tab10" if len(labels) <= 10 else "tab20"]
    return {label: cmap(i % cmap.N) for i, label in enumerate(labels)}


def _title(bench: dict, what: str) -> str:
    model, threads = bench.get("model") or {}, bench.get("threads")
    links = bench.get("links") or {}
    emulated = [name for name, link in links.items() if (link or {}).get("emulated")]
    note = "" if not emulated else (" (emulated link)" if len(emulated) == len(links)
                                    else f" (emulated link: {', '.join(emulated)})")
    return (f"{bench.get('title') or 'bench'}: {what}\n{model.get('arch') or '?'} "
            f"({model.get('n_moe_layers', '?')} MoE layers x {model.get('n_experts', '?')} experts, "
            f"top-{model.get('top_k', '?')}), {threads if threads is not None else '?'} "
            f"thread{'' if threads == 1 else 's'}{note}")


def _series_figure(bench: dict, what: str, value: Value, errorbars: bool = False, log_y: bool = False):
    rows = [r for r in _rows(bench) if value(r) is not None]
    if not rows:
        return None
    plt = _pyplot()
    colors, (axis, by_share) = _colors(bench), _budget_axis(bench)
    ticks: dict[float, list[str]] = {}
    for x, text in sorted(axis[budget_of.key(r["budget"])] for r in rows if r.get("budget") is not None):
        if text not in ticks.setdefault(x, []):
            ticks[x].append(text)
    links = _links(bench) or [None]
    fig, axes = plt.subplots(1, len(links), figsize=(5.2 * len(links) + 3.5, 4.8), sharey=True,
                             squeeze=False, layout="constrained")
    for ax, link in zip(axes[0], links):
        groups: dict[tuple[str, bool], list[dict]] = {}
        for row in rows:
            if link is None or row.get("link") in (None, link):
                groups.setdefault((_label(row), bool(row.get("compile"))), []).append(row)
        for (label, compiled), group in groups.items():
            style = {"color": colors[label], "linestyle": "--" if compiled else "-",
                     "label": label + (" (compiled)" if compiled else "")}
            for row in (r for r in group if r.get("budget") is None):
                ax.axhline(value(row), linewidth=1.5, **style)
                style["label"] = None
            curve = sorted((r for r in group if r.get("budget") is not None),
                           key=lambda r: axis[budget_of.key(r["budget"])][0])
            xs, ys = [axis[budget_of.key(r["budget"])][0] for r in curve], [value(r) for r in curve]
            if curve and errorbars:
                stats = [r.get("decode_tokens_per_s") or {} for r in curve]
                low = [max(y - (s.get("min") if s.get("min") is not None else y), 0.0) for y, s in zip(ys, stats)]
                high = [max((s.get("max") if s.get("max") is not None else y) - y, 0.0) for y, s in zip(ys, stats)]
                ax.errorbar(xs, ys, yerr=[low, high], marker="o", capsize=3, **style)
            elif curve:
                ax.plot(xs, ys, marker="o", **style)
        if ticks:
            ax.set_xticks(list(ticks), [" = ".join(texts) for texts in ticks.values()])
        ax.set_xlabel("expert budget (share of all experts)" if by_share else "expert budget")
        ax.set_title("all rows" if link is None else f"link {link}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(what)
    if log_y:
        values = [value(r) for r in rows if value(r) > 0]
        if values and max(values) / min(values) > 30:
            axes[0][0].set_yscale("log")
    entries: dict[str, object] = {}
    for ax in axes[0]:
        for handle, text in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(text, handle)
    fig.legend(list(entries.values()), list(entries), fontsize=8, loc="outside right upper")
    fig.suptitle(_title(bench, what), fontsize=11)
    return fig


def _best_specter(rows: Iterable[dict]) -> dict[tuple[bool, Hashable, str], dict]:
    """(compiled, budget key, link) -> the specter row of that cell with the highest median."""
    best: dict[tuple[bool, Hashable, str], dict] = {}
    for row in rows:
        if row.get("engine") != "specter" or row.get("budget") is None or row.get("link") is None:
            continue
        if _median(row) is None:
            continue
        key = (bool(row.get("compile")), budget_of.key(row["budget"]), row["link"])
        if key not in best or _median(row) > _median(best[key]):
            best[key] = row
    return best


def _ratio_figure(bench: dict):
    best = _best_specter(_rows(bench))
    baselines = [b for b in BASELINES if any((r.get("ratios") or {}).get(b) is not None for r in best.values())]
    if not baselines:
        return None
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    plt = _pyplot()
    modes = sorted({mode for mode, _, _ in best})
    axis, _ = _budget_axis(bench)
    budgets = sorted({budget for _, budget, _ in best}, key=lambda budget: axis[budget][0])
    links = [link for link in _links(bench) if any(link == key[2] for key in best)]
    values = [r["ratios"][b] for r in best.values() for b in baselines if (r.get("ratios") or {}).get(b) is not None]
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(min(values), 0.95), vmax=max(max(values), 1.05))
    fig, axes = plt.subplots(len(modes), len(baselines), squeeze=False, layout="constrained",
                             figsize=(1.6 + len(baselines) * max(3.0, 1.3 * len(budgets)),
                                      1.4 + len(modes) * (1.3 + 0.75 * len(links))))
    image = None
    for i, mode in enumerate(modes):
        for j, baseline in enumerate(baselines):
            ax = axes[i][j]
            grid = np.full((len(links), len(budgets)), np.nan)
            for y, link in enumerate(links):
                for x, budget in enumerate(budgets):
                    row = best.get((mode, budget, link))
                    ratio = None if row is None else (row.get("ratios") or {}).get(baseline)
                    text = "-"
                    if ratio is not None:
                        grid[y, x] = ratio
                        text = f"{ratio:.2f}x\n{_label(row).removeprefix('specter ')}"
                    dark = ratio is not None and abs(norm(ratio) - 0.5) > 0.3
                    ax.text(x, y, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")
            image = ax.imshow(np.ma.masked_invalid(grid), cmap="RdYlGn", norm=norm, aspect="auto", origin="lower")
            ax.set_xticks(range(len(budgets)), [axis[b][1] for b in budgets])
            ax.set_yticks(range(len(links)), links)
            ax.set_title(f"specter vs {baseline}, {'compiled' if mode else 'eager'}", fontsize=9)
            ax.set_xlabel("expert budget", fontsize=8)
    fig.colorbar(image, ax=axes.ravel().tolist(), label="tokens/s ratio (>1: specter faster)", shrink=0.9)
    fig.suptitle(_title(bench, "best specter row vs baselines"), fontsize=11)
    return fig


def _acceptance_figure(bench: dict):
    rows = [r for r in _rows(bench) if r.get("engine") == "specter"
            and (r.get("acceptance_rate") is not None or _mean_k(r) is not None)]
    if not rows:
        return None
    from matplotlib.patches import Patch

    plt = _pyplot()
    colors, links, (axis, _) = _colors(bench), _links(bench), _budget_axis(bench)
    both_modes = len({bool(r.get("compile")) for r in rows}) > 1
    cell_of = {id(r): (bool(r.get("compile")), budget_of.key(r.get("budget")), r.get("link")) for r in rows}
    cells = sorted(dict.fromkeys(cell_of.values()), key=lambda c: (
        c[0], -1.0 if c[1] is None else axis[c[1]][0], links.index(c[2]) if c[2] in links else -1))
    labels = list(dict.fromkeys(_label(r) for r in rows))
    index = {(*cell_of[id(r)], _label(r)): r for r in rows}
    histograms: dict[str, Counter] = {}
    for row in rows:
        if row.get("k_histogram"):
            histograms.setdefault(_label(row), Counter()).update({int(k): n for k, n in row["k_histogram"].items()})
    panels = 3 if histograms else 2
    bar_width = max(4.5, 0.3 * len(cells) * len(labels) + 1.5)
    fig, axes = plt.subplots(1, panels, figsize=(2 * bar_width + (5.0 if histograms else 0.0) + 1.5, 4.8),
                             squeeze=False, layout="constrained")
    width = 0.8 / len(labels)
    ticks = [f"{'-' if budget is None else axis[budget][1]}\n{link or '-'}"
             + (("\ncompiled" if compiled else "\neager") if both_modes else "") for compiled, budget, link in cells]
    for ax, value, name in ((axes[0][0], lambda r: r.get("acceptance_rate"), "acceptance rate"),
                            (axes[0][1], _mean_k, "mean k")):
        for i, label in enumerate(labels):
            bars = [(j - 0.4 + width * (i + 0.5), value(index[(*cell, label)])) for j, cell in enumerate(cells)
                    if (*cell, label) in index and value(index[(*cell, label)]) is not None]
            if bars:
                ax.bar([x for x, _ in bars], [y for _, y in bars], width, color=colors[label], label=label)
        ax.set_xticks(range(len(cells)), ticks, fontsize=8)
        ax.set_ylabel(name)
        ax.set_title(f"{name} per cell (budget, link)", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylim(0, 1.05)
    if histograms:
        ax = axes[0][2]
        ks = sorted({k for counts in histograms.values() for k in counts})
        width = 0.8 / len(histograms)
        for i, (label, counts) in enumerate(histograms.items()):
            total = sum(counts.values()) or 1
            ax.bar([j - 0.4 + width * (i + 0.5) for j in range(len(ks))], [counts[k] / total for k in ks], width,
                   color=colors[label], label=label)
        ax.set_xticks(range(len(ks)), [str(k) for k in ks])
        ax.set_xlabel("k (draft length)")
        ax.set_ylabel("share of speculative steps")
        ax.set_title("k histogram (all cells)", fontsize=10)
    fig.legend(handles=[Patch(color=colors[label], label=label) for label in labels], fontsize=8,
               loc="outside right upper")
    fig.suptitle(_title(bench, "specter acceptance and draft length"), fontsize=11)
    return fig


def _roofline_figure(bench: dict):
    rows = [r for r in _rows(bench) if (r.get("governor_summary") or {}).get("table")]
    rows = sorted(rows, key=lambda r: bool(r.get("compile")))[:8]
    if not rows:
        return None
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    colors = _colors(bench)
    fig, axes = plt.subplots(2, len(rows), figsize=(1.5 + 3.6 * len(rows), 7.2), squeeze=False, layout="constrained")
    for top, bottom, row in zip(axes[0], axes[1], rows):
        summary, color = row["governor_summary"], colors[_label(row)]
        table = sorted((e for e in summary["table"] if isinstance(e, dict) and e.get("k") is not None
                        and e.get("predicted_tokens_per_s") is not None), key=lambda e: e["k"])
        ks, rates = [e["k"] for e in table], [e["predicted_tokens_per_s"] for e in table]
        top.plot(ks, rates, marker="o", color=color)
        trace = [k for k in summary.get("trace") or [] if k is not None]
        if trace:
            mode = Counter(trace).most_common(1)[0][0]
            top.plot([k for k in ks if k == mode], [y for k, y in zip(ks, rates) if k == mode], linestyle="none",
                     marker="*", markersize=16, color="crimson", label=f"most chosen k={mode}")
            top.legend(fontsize=8)
            bottom.step(range(len(trace)), trace, where="post", color=color)
        else:
            bottom.text(0.5, 0.5, "no trace", ha="center", va="center", transform=bottom.transAxes)
        budget = budget_of.label(row.get("budget"))
        top.set_title(f"{_label(row)} ({summary.get('name') or '?'})\nbudget {budget}, link {row.get('link') or '-'}, "
                      f"{'compiled' if row.get('compile') else 'eager'}", fontsize=9)
        top.set_xlabel("k (draft length)")
        bottom.set_xlabel("round")
        bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("predicted tokens/s")
    axes[1][0].set_ylabel("k chosen")
    fig.suptitle(_title(bench, "governor roofline and k per round"), fontsize=11)
    return fig


def _stem(bench: dict) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(bench.get("title") or "bench")).strip("-") or "bench"


def plot_all(bench: dict, out_dir: Path, stem: str | None = None) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = stem or _stem(bench)
    draws = {
        "tokens": lambda: _series_figure(bench, "decode tokens/s", _median, errorbars=True, log_y=True),
        "ratio-heatmap": lambda: _ratio_figure(bench),
        "hit-rate": lambda: _series_figure(bench, "expert cache hit rate", lambda r: r.get("hit_rate")),
        "io-wait": lambda: _series_figure(bench, "I/O wait share of decode time", lambda r: r.get("io_wait_share")),
        "acceptance-k": lambda: _acceptance_figure(bench),
        "roofline": lambda: _roofline_figure(bench),
    }
    written = []
    for name in FIGURES:
        draw = draws[name]
        fig = draw()
        path = out_dir / f"{stem}-{name}.png"
        if fig is None:
            path.unlink(missing_ok=True)  # an earlier draw's: it is not of this document
            continue
        try:
            fig.savefig(path, dpi=DPI)
        finally:
            _pyplot().close(fig)
        written.append(path)
    return written
