"""``specter.bench.markdown_format``: how each number of a bench document is written into its
markdown tables (``-`` for a null, ratios as ``1.80x``, shares with one
decimal), the null-safe arithmetic the tables use, pipe-table escaping and a row's cell name."""

from __future__ import annotations

import pytest

from specter.bench import markdown_format as fmt


@pytest.mark.parametrize("value, digits, shown", [
    (None, 2, "-"), (3.14159, 2, "3.14"), (2, 0, "2"), (0.0, 3, "0.000"), (1234.5, 1, "1234.5"), (-0.25, 2, "-0.25"),
])
def test_num_rounds_to_the_digits_asked_and_shows_a_null_as_a_dash(value: float | None, digits: int,
                                                                    shown: str) -> None:
    assert fmt.num(value, digits) == shown


@pytest.mark.parametrize("value, shown", [(None, "-"), (1.8, "1.80x"), (0.0, "0.00x"), (12.345, "12.35x"),
                                          (1, "1.00x")])
def test_ratio_has_two_decimals_and_an_x(value: float | None, shown: str) -> None:
    assert fmt.ratio(value) == shown


@pytest.mark.parametrize("value, shown", [(None, "-"), (0.25, "25.0%"), (0.1234, "12.3%"), (1.0, "100.0%"),
                                          (0.0, "0.0%")])
def test_share_is_a_percentage_with_one_decimal(value: float | None, shown: str) -> None:
    assert fmt.share(value) == shown


def test_escape_makes_any_value_one_pipe_table_cell() -> None:
    assert fmt.escape("a|b\nc") == "a\\|b c"
    assert fmt.escape("||") == "\\|\\|"
    assert fmt.escape(3) == "3"
    assert fmt.escape("plain") == "plain"


def test_mul_and_div_carry_a_null_through_and_div_by_zero_is_null() -> None:
    assert fmt.mul(None, 1e3) is None
    assert fmt.mul(0.002, 1e3) == 2.0
    assert fmt.mul(0.0, 1e3) == 0.0
    assert fmt.div(1.0, 4.0) == 0.25
    assert fmt.div(0.0, 4.0) == 0.0
    assert fmt.div(None, 4.0) is None
    assert fmt.div(1.0, None) is None
    assert fmt.div(1.0, 0) is None
    assert fmt.div(1.0, 0.0) is None


def test_row_escapes_every_cell() -> None:
    assert fmt.row(["specter | x", 1.5, "two\nlines"]) == "| specter \\| x | 1.5 | two lines |"
    assert fmt.row(iter(("a", "b"))) == "| a | b |"


def test_rows_table_is_a_header_a_rule_and_one_line_per_row() -> None:
    lines = fmt.rows_table(("row", "cell", "tok/s"), [("resident", "- / -", "30.00"), ("a|b", "25% / slow", "-")])
    assert lines == ["| row | cell | tok/s |", "|---|---|---|", "| resident | - / - | 30.00 |",
                     "| a\\|b | 25% / slow | - |"]


def test_rows_table_takes_any_iterables_and_no_rows_gives_the_header_alone() -> None:
    columns = (name for name in ("a", "b"))
    assert fmt.rows_table(columns, iter([])) == ["| a | b |", "|---|---|"]
    assert fmt.rows_table(["only"], ([x] for x in (1, 2))) == ["| only |", "|---|", "| 1 |", "| 2 |"]


@pytest.mark.parametrize("row, shown", [
    ({"budget": 0.25, "link": "slow", "compile": True}, "25% / slow / compiled"),
    ({"budget": 0.5, "link": "fast", "compile": False}, "50% / fast / eager"),
    ({"budget": 0.125, "link": "pcie"}, "12.5% / pcie / eager"),
    ({"budget": None, "link": None, "compile": True}, "- / - / compiled"),
    ({}, "- / - / eager"),
    ({"budget": 0.0, "link": ""}, "0% / - / eager"),
])
def test_where_names_the_cell_and_the_mode(row: dict, shown: str) -> None:
    assert fmt.where(row) == shown


def test_where_without_the_mode_is_budget_and_link_only() -> None:
    assert fmt.where({"budget": 0.25, "link": "slow", "compile": True}, mode=False) == "25% / slow"
    assert fmt.where({}, mode=False) == "- / -"


def test_rows_table_escapes_its_column_names_as_its_cells() -> None:
    assert fmt.rows_table(["a|b", "c"], [["x|y", 1]]) == ["| a\\|b | c |", "|---|---|", "| x\\|y | 1 |"]
