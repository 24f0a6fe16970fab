from specter.bench.tables import COLUMNS, markdown


def _sections(text: str) -> dict[str, list[str]]:
    sections, current = {}, None
    for line in text.splitlines():
        if line.startswith("### "):
            current = line[4:]
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    return sections


def _data_rows(lines: list[str]) -> list[list[str]]:
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| engine |")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in rows]


def _find(rows: list[list[str]], label: str, mode: str = "eager") -> list[str]:
    matches = [row for row in rows if row[0] == label and row[1] == mode]
    assert len(matches) == 1, (label, mode, rows)
    return matches[0]


def test_one_table_row_per_json_row(bench):
    text = markdown(bench)
    rows = [row for lines in _sections(text).values() for row in _data_rows(lines)]
    assert len(rows) == len(bench["rows"])
    assert all(len(row) == len(COLUMNS) for row in rows)
    assert text.count("| engine |") == len(_sections(text)) == 2 * 2 + 1


def test_header_states_workload_and_emulated_links(bench):
    text = markdown(bench)
    assert text.startswith("## bench-proxy\n")
    for needle in ("mixtral", "x86_64 test", "**Threads**: 1", "4 prompts x 48 new tokens", "2 repeats",
                   "`python -m specter.bench recipes/bench-proxy.yaml`", "12.0 MiB per expert"):
        assert needle in text
    link_lines = [line for line in text.splitlines() if line.startswith("- link ")]
    assert len(link_lines) == 2
    assert all("EMULATED" in line for line in link_lines)
    assert "0.5 GB/s" in link_lines[0] and "5 GB/s" in link_lines[1]


def test_real_link_is_not_called_emulated(bench):
    bench["links"]["fast"] = {"kind": "cuda", "gbps": None, "latency_us": None, "emulated": False}
    lines = markdown(bench).splitlines()
    fast = [line for line in lines if line.startswith("- link `fast`")]
    assert fast == ["- link `fast`: cuda"]
    assert any(line.startswith("### ") and "`fast`" in line and "EMULATED" not in line for line in lines)


def test_cell_values_are_formatted(bench):
    sections = _sections(markdown(bench))
    cell = _data_rows(sections["budget 25% of experts, link `slow` (EMULATED)"])
    row = _find(cell, "specter k=4")
    json_row = next(r for r in bench["rows"] if r["label"] == "specter k=4" and r["budget"] == 0.25
                    and r["link"] == "slow" and not r["compile"])
    tokens = json_row["decode_tokens_per_s"]
    assert row[2] == f"{tokens['median']:.2f} ({tokens['min']:.2f}-{tokens['max']:.2f})"
    assert row[2].startswith("22.50 (")
    assert row[3:6] == ["1.80x", "1.29x", "0.75x"]
    assert row[6:] == ["0.925", "1.25", "0.200", "0.875", "4.00", "3.0", "yes"]
    ondemand = _find(cell, "ondemand")
    assert ondemand[3] == "-" and ondemand[9] == "-" and ondemand[10] == "-"
    compiled = _find(cell, "specter k=4", "compiled")
    assert compiled[5] == f"{json_row['decode_tokens_per_s']['median'] * 1.1 / 36.0:.2f}x"


def test_budget_independent_rows_and_notes(bench):
    lines = _sections(markdown(bench))["budget-independent"]
    rows = _data_rows(lines)
    assert [row[0] for row in rows] == ["resident", "resident", "hf-offload (budget 25%)"]
    assert [row[1] for row in rows] == ["eager", "compiled", "eager"]
    assert rows[0][2].startswith("30.00 (")
    assert rows[2][6] == "-"
    assert "- hf-offload: hf-offload: experts spilled to disk (offload folder)" in lines


def test_nulls_render_as_dash_and_sparse_bench_renders(sparse_bench):
    text = markdown(sparse_bench)
    sections = _sections(text)
    assert list(sections) == ["budget 50% of experts, link `slow` (EMULATED)", "budget-independent"]
    rows = _data_rows(sections["budget 50% of experts, link `slow` (EMULATED)"])
    assert len(rows) == 5
    missing = _find(rows, "specter k=4")
    assert missing[2] == "-" and missing[3] == "-" and missing[12] == "-"
    assert all(row[8] == "-" and row[11] == "-" for row in rows)


def test_minimal_bench_does_not_crash():
    text = markdown({"schema": "specter.bench/2", "rows": [
        {"engine": "specter", "label": "specter | x", "budget": 0.125, "link": "pcie", "compile": True}]})
    assert "specter \\| x" in text
    assert "### budget 12.5% of experts, link `pcie`" in text
    assert markdown({}).startswith("## bench\n")
