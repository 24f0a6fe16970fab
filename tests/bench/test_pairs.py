"""``specter.bench.pairs``: which rows are paired (a twin with the row of its ``twin_of`` label in
the same cell and mode; a compiled row with the eager row of its label and cell, twins left out),
the paired-run ratios and the noise floor, and the exact lines of the "Compiled against eager" and
"Noise floor" sections on small hand-made documents (the full bench is in test_tables.py)."""

from __future__ import annotations

import pytest

from specter.bench.pairs import _median_ratio, _paired_runs, _twin_gaps, _twin_pairs, compile_section, twin_section

COMPILE_HEADER = ["| row | cell | eager tok/s | compiled tok/s | compiled / eager | paired runs |",
                  "|---|---|---|---|---|---|"]
TWIN_HEADER = ["| row | cell | original tok/s | twin tok/s | twin / original | paired runs "
               "| memory read GiB/s (original / twin) |", "|---|---|---|---|---|---|---|"]


def row(label: str | None, median: float | None = 10.0, runs: tuple[float, ...] = (), *, budget: float | None = 0.25,
        link: str | None = "slow", compiled: bool | None = False, **extra: object) -> dict:
    """One bench row: its label, cell, mode and decode tokens/s (median and runs by repeat)."""
    data = {"label": label, "engine": (label or "specter").split(" ")[0], "budget": budget, "link": link,
            "compile": compiled, "decode_tokens_per_s": {"median": median, "runs": list(runs)}}
    data.update(extra)
    return data


def twin(of: str, median: float | None, runs: tuple[float, ...] = (), **where: object) -> dict:
    return row(f"{of} (twin)", median, runs, twin_of=of, **where)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- pairing


def test_a_twin_pairs_with_its_original_in_the_same_cell_and_mode_only() -> None:
    eager = row("a")
    compiled = row("a", compiled=True)
    other_link = row("a", link="fast")
    twin_eager, twin_compiled = twin("a", 9.0), twin("a", 9.0, compiled=True)
    twin_none = twin("a", 9.0, compiled=None)  # no compile flag: eager
    orphan = twin("a", 9.0, budget=0.5)  # no "a" at 50%
    rows = [eager, compiled, other_link, twin_eager, twin_compiled, twin_none, orphan, row("b")]
    pairs = [(rows.index(t), rows.index(o)) for t, o in _twin_pairs(rows)]
    assert pairs == [(3, 0), (4, 1), (5, 0)]


def test_a_twin_of_an_empty_label_pairs_with_nothing() -> None:
    assert list(_twin_pairs([row(""), row("x", twin_of="")])) == []


def test_paired_runs_pair_by_repeat_skipping_a_zero_base_and_stopping_at_the_shorter() -> None:
    base = row("a", runs=(10.0, 0.0, 5.0, 7.0))
    other = row("b", runs=(9.0, 12.0, 5.0))
    assert _paired_runs(other, base) == [pytest.approx(0.9), 1.0]
    assert _paired_runs(row("b", runs=()), base) == []
    assert _paired_runs({}, base) == [] and _paired_runs(other, {"decode_tokens_per_s": None}) == []


def test_median_ratio_is_null_without_both_medians_or_with_a_zero_base() -> None:
    assert _median_ratio(row("b", 12.0), row("a", 10.0)) == pytest.approx(1.2)
    assert _median_ratio(row("b", None), row("a", 10.0)) is None
    assert _median_ratio(row("b", 12.0), row("a", None)) is None
    assert _median_ratio(row("b", 12.0), row("a", 0.0)) is None
    assert _median_ratio({}, row("a", 10.0)) is None


def test_noise_floor_is_each_labels_largest_gap_over_its_twins() -> None:
    rows = [row("a", 10.0), twin("a", 9.7), twin("a", 10.4), twin("a", None),
            row("b", 20.0, link="fast"), twin("b", 19.0, link="fast"), row("c", None), twin("c", 5.0)]
    gaps = _twin_gaps(rows)
    assert list(gaps) == ["a", "b"]
    assert gaps["a"] == pytest.approx(0.04) and gaps["b"] == pytest.approx(0.05)
    assert _twin_gaps([row("a"), row("b")]) == {}


# ----------------------------------------------------------------------------- "Compiled against eager"


def test_compile_section_writes_both_medians_the_ratio_and_the_paired_run_range() -> None:
    bench = {"rows": [row("ondemand", 10.0, (10.0, 10.0)), row("ondemand", 12.0, (11.0, 13.0), compiled=True)]}
    assert compile_section(bench) == COMPILE_HEADER + [
        "| ondemand | 25% / slow | 10.00 | 12.00 | 1.200x | 1.100-1.300x |", "",
        "Compiled at or above eager in 1 of 1 rows."]


def test_compile_section_is_empty_without_a_compiled_row_that_has_an_eager_partner() -> None:
    assert compile_section({}) == [] and compile_section({"rows": None}) == []
    assert compile_section({"rows": [row("a"), row("b", compiled=True)]}) == []
    assert compile_section({"rows": [row("a", link="fast"), row("a", compiled=True)]}) == []
    assert compile_section({"rows": [row("a", budget=0.5), row("a", compiled=True)]}) == []


def test_compile_section_leaves_twins_out_of_both_sides() -> None:
    rows = [twin("a", 9.0), row("a", 10.0, (10.0,)), row("a", 11.0, (11.0,), compiled=True),
            twin("a", 9.9, compiled=True)]  # as partners they would give 11 / 9 and a second row
    lines = compile_section({"rows": rows})
    assert lines[2:] == ["| a | 25% / slow | 10.00 | 11.00 | 1.100x | 1.100-1.100x |", "",
                         "Compiled at or above eager in 1 of 1 rows; of those below, 0 within the A/A noise floor "
                         "(10.0%)."]


def test_compile_section_falls_back_to_the_engine_name_and_writes_dashes_for_missing_figures() -> None:
    rows = [row(None, 10.0, engine="resident", budget=None, link=None),
            row(None, None, engine="resident", budget=None, link=None, compiled=True),
            row("b", 8.0), row("b", 6.0, compiled=True)]
    assert compile_section({"rows": rows}) == COMPILE_HEADER + [
        "| resident | - / - | 10.00 | - | - | - |",
        "| b | 25% / slow | 8.00 | 6.00 | 0.750x | - |", "",
        "Compiled at or above eager in 0 of 1 rows."]


def test_rows_below_eager_are_judged_against_their_own_floor_else_the_smallest() -> None:
    rows = [row("a", 10.0), twin("a", 9.0),  # a's floor: 10%
            row("b", 10.0, link="fast"), twin("b", 10.4, link="fast"),  # b's floor: 4%
            row("c", 10.0),
            row("a", 9.2, compiled=True),  # 8% below, inside a's 10%
            row("b", 9.5, link="fast", compiled=True),  # 5% below, outside b's 4%
            row("c", 9.7, compiled=True),  # 3% below, no twins: inside the smallest floor, 4%
            row("c", 10.1, link="fast"), row("c", 10.2, link="fast", compiled=True)]  # at or above
    lines = compile_section({"rows": rows})
    assert lines[-1] == ("Compiled at or above eager in 1 of 4 rows; of those below, 2 within the A/A noise floor "
                         "(a 10.0%, b 4.0%; other rows the smallest).")


# ----------------------------------------------------------------------------- "Noise floor"


def test_twin_section_writes_one_row_per_twin_and_the_largest_gap() -> None:
    rows = [row("specter k=4", 20.0, (19.0, 21.0), memory_read_gibps=13.04),
            twin("specter k=4", 18.0, (15.2, 21.0), memory_read_gibps=11.0)]
    assert twin_section({"rows": rows}) == TWIN_HEADER + [
        "| specter k=4 | 25% / slow / eager | 20.00 | 18.00 | 0.90x | 0.80-1.00x | 13.0 / 11.0 |", "",
        "Two identical engines landed up to 10.0% apart (medians) in this run: ratios closer than that are within "
        "its noise."]


def test_twin_section_names_each_labels_floor_when_there_are_several() -> None:
    rows = [row("a", 10.0), twin("a", 9.8), row("b", 10.0, compiled=True), twin("b", 10.6, compiled=True)]
    lines = twin_section({"rows": rows})
    assert lines[2:4] == ["| a | 25% / slow / eager | 10.00 | 9.80 | 0.98x | - | - / - |",
                          "| b | 25% / slow / compiled | 10.00 | 10.60 | 1.06x | - | - / - |"]
    assert lines[-1] == ("Two identical engines landed up to 6.0% apart (medians) in this run "
                         "(by row: a 2.0%, b 6.0%): ratios closer than that are within its noise.")


def test_twin_section_without_a_median_has_no_gap_line() -> None:
    rows = [row("a", None), twin("a", 9.0)]
    assert twin_section({"rows": rows}) == TWIN_HEADER + ["| a | 25% / slow / eager | - | 9.00 | - | - | - / - |"]


def test_twin_section_is_empty_without_a_paired_twin() -> None:
    assert twin_section({}) == []
    assert twin_section({"rows": [row("a"), twin("a", 9.0, link="fast"), twin("missing", 9.0)]}) == []


def test_compile_section_counts_no_rows_when_no_pair_has_both_medians() -> None:
    rows = [row("b", 8.0), row("b", None, compiled=True)]
    assert compile_section({"rows": rows}) == COMPILE_HEADER + ["| b | 25% / slow | 8.00 | - | - | - |"]
