"""The bench markdown's sections that compare rows in pairs: "Compiled against eager" (each
compiled row against the eager row of its label and cell) and "Noise floor: identical engines
(A/A)" (each twin against the row it copies, with both engines' memory read rates), and the
noise floor itself (each twinned label's largest gap), by which the first judges the rows below
1.00x. Contract details: ``specter.bench.tables``' docstring."""

from __future__ import annotations

from collections.abc import Iterable

from specter.bench import markdown_format as fmt


def _twin_pairs(rows: list[dict]) -> Iterable[tuple[dict, dict]]:
    """(twin, original) for each row with ``twin_of`` whose original is in the same cell and mode."""
    for twin in rows:
        label = twin.get("twin_of")
        where = (twin.get("budget"), twin.get("link"), bool(twin.get("compile")))
        original = next((r for r in rows if label and r.get("label") == label
                         and (r.get("budget"), r.get("link"), bool(r.get("compile"))) == where), None)
        if original is not None:
            yield twin, original


def _paired_runs(row: dict, base: dict) -> list[float]:
    """``row``'s runs over ``base``'s, paired by repeat."""
    a, b = base.get("decode_tokens_per_s") or {}, row.get("decode_tokens_per_s") or {}
    return [y / x for x, y in zip(a.get("runs") or [], b.get("runs") or []) if x]


def _median_ratio(row: dict, base: dict) -> float | None:
    return fmt.div((row.get("decode_tokens_per_s") or {}).get("median"),
                   (base.get("decode_tokens_per_s") or {}).get("median"))


def _twin_gaps(rows: list[dict]) -> dict[str, float]:
    """Each twinned label's largest |twin / original - 1| over its twins (medians): its noise floor."""
    gaps: dict[str, float] = {}
    for twin, original in _twin_pairs(rows):
        if (ratio := _median_ratio(twin, original)) is not None:
            gaps[twin["twin_of"]] = max(gaps.get(twin["twin_of"], 0.0), abs(ratio - 1))
    return gaps


def _by_label(gaps: dict[str, float]) -> str:
    return ", ".join(f"{label} {gap * 100:.1f}%" for label, gap in gaps.items())


def compile_section(bench: dict) -> list[str]:
    """One row per compiled row with an eager row of the same label, budget and link: both medians,
    compiled / eager (medians and the range over runs paired by repeat), then how many rows are
    at or above 1.00x and how many of the others lie within the A/A noise floor."""
    rows = [r for r in bench.get("rows") or [] if not r.get("twin_of")]
    out, ratios = [], []
    for row in rows:
        if not row.get("compile"):
            continue
        label = row.get("label") or row.get("engine")
        eager = next((r for r in rows if not r.get("compile") and (r.get("label") or r.get("engine")) == label
                      and (r.get("budget"), r.get("link")) == (row.get("budget"), row.get("link"))), None)
        if eager is None:
            continue
        a, b = eager.get("decode_tokens_per_s") or {}, row.get("decode_tokens_per_s") or {}
        ratio = _median_ratio(row, eager)
        paired = _paired_runs(row, eager)
        if ratio is not None:
            ratios.append((label, ratio))
        out.append((label or "?", fmt.where(row, mode=False), fmt.num(a.get("median"), 2),
                    fmt.num(b.get("median"), 2), "-" if ratio is None else f"{ratio:.3f}x",
                    f"{min(paired):.3f}-{max(paired):.3f}x" if paired else "-"))
    if not out:
        return []
    lines = fmt.rows_table(("row", "cell", "eager tok/s", "compiled tok/s", "compiled / eager", "paired runs"), out)
    below = [(label, r) for label, r in ratios if r < 1.0]
    gaps = _twin_gaps(bench.get("rows") or [])
    within = ""
    if gaps:  # a row against its own twins' floor where it has twins, else the tightest one measured
        inside = sum(1 for label, r in below if 1 - r <= gaps.get(label, min(gaps.values())))
        floors = f"{max(gaps.values()) * 100:.1f}%" if len(gaps) == 1 else f"{_by_label(gaps)}; other rows the smallest"
        within = f"; of those below, {inside} within the A/A noise floor ({floors})"
    if not ratios:  # no pair with both medians: nothing to count
        return lines
    return lines + ["", f"Compiled at or above eager in {len(ratios) - len(below)} of {len(ratios)} rows{within}."]


def twin_section(bench: dict) -> list[str]:
    """One row per twin: its cell, the row it copies, both medians, twin / original (medians and
    the range over paired runs), then the largest gap as a line: the run's noise floor."""
    out = []
    for twin, original in _twin_pairs(bench.get("rows") or []):
        a, b = original.get("decode_tokens_per_s") or {}, twin.get("decode_tokens_per_s") or {}
        paired = _paired_runs(twin, original)
        out.append((twin["twin_of"], fmt.where(twin), fmt.num(a.get("median"), 2), fmt.num(b.get("median"), 2),
                    fmt.ratio(_median_ratio(twin, original)),
                    f"{min(paired):.2f}-{max(paired):.2f}x" if paired else "-",
                    f"{fmt.num(original.get('memory_read_gibps'), 1)} / {fmt.num(twin.get('memory_read_gibps'), 1)}"))
    if not out:
        return []
    lines = fmt.rows_table(("row", "cell", "original tok/s", "twin tok/s", "twin / original", "paired runs",
                         "memory read GiB/s (original / twin)"), out)
    gaps = _twin_gaps(bench.get("rows") or [])
    if gaps:
        by_row = "" if len(gaps) == 1 else f" (by row: {_by_label(gaps)})"
        lines += ["", f"Two identical engines landed up to {max(gaps.values()) * 100:.1f}% apart (medians) in this "
                      f"run{by_row}: ratios closer than that are within its noise."]
    return lines
