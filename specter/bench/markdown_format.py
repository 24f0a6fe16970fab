"""How a bench document's numbers are written into its markdown tables: ``-`` for a null, ratios
as ``1.80x``, budgets as ``specter.bench.budgets.label`` writes them
(``25%``, ``8 per layer``, ``40 experts``, ``2 MiB``), cells escaped for a pipe table, a row's cell
named ``budget / link / mode``. Used by ``specter.bench.tables`` and ``specter.bench.pairs``."""

from __future__ import annotations

from collections.abc import Iterable

from specter.bench import budgets


def num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def escape(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def mul(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def div(num: float | None, den: float | None) -> float | None:
    return None if num is None or not den else num / den


def share(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def row(cells: Iterable[object]) -> str:
    """One pipe-table line, every cell escaped."""
    return "| " + " | ".join(escape(c) for c in cells) + " |"


def rows_table(columns: Iterable[str], rows: Iterable[Iterable[object]]) -> list[str]:
    columns = list(columns)
    return [row(columns), "|" + "|".join("---" for _ in columns) + "|"] + [row(r) for r in rows]


def where(row: dict, mode: bool = True) -> str:
    """The row's cell, ``budget / link``, and (``mode``) ``/ compiled`` or ``/ eager``."""
    cell = f"{budgets.label(row.get('budget'))} / {row.get('link') or '-'}"
    return f"{cell} / {'compiled' if row.get('compile') else 'eager'}" if mode else cell
