from specter.bench.tables import COLUMNS, GOVERNOR_COLUMNS, PHASE_COLUMNS, markdown


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


EXTRA = ("Where the time goes (specter rows)", "Governor", "Compiled against eager")


def test_one_table_row_per_json_row(bench):
    text = markdown(bench)
    sections = {name: lines for name, lines in _sections(text).items() if name not in EXTRA}
    rows = [row for lines in sections.values() for row in _data_rows(lines)]
    assert len(rows) == len(bench["rows"])
    assert all(len(row) == len(COLUMNS) for row in rows)
    assert text.count("| engine |") == len(sections) == 2 * 2 + 1
    assert list(_sections(text))[-3:] == list(EXTRA)


def test_header_states_workload_and_emulated_links(bench):
    text = markdown(bench)
    assert text.startswith("## bench-proxy\n")
    for needle in ("mixtral", "x86_64 test", "**Threads**: 1", "4 prompts x 48 new tokens", "2 repeats",
                   "`python -m specter.bench recipes/bench-proxy.yaml`", "12.0 MiB per expert",
                   "wall 812.3 s, peak memory 6.0 GiB"):
        assert needle in text
    link_lines = [line for line in text.splitlines() if line.startswith("- link ")]
    assert len(link_lines) == 2
    assert all("EMULATED" in line for line in link_lines)
    assert "0.5 GB/s" in link_lines[0] and "5 GB/s" in link_lines[1]


def test_header_counts_the_slow_memory_the_run_swapped_only_where_it_settled_any(bench):
    assert "slow memory" not in markdown(bench)
    bench["page_placement"] = {"regions": 40, "pieces": 1200, "slow": 31, "swapped": 29, "quarantined_bytes": 0}
    assert "peak memory 6.0 GiB, slow memory: 31 of 1200 8 MiB pieces found, 29 swapped." in markdown(bench)


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
    assert list(sections) == ["budget 50% of experts, link `slow` (EMULATED)", "budget-independent", EXTRA[0]]
    assert len(_phase_rows(text)) == 2
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


def _phase_rows(text: str) -> list[list[str]]:
    lines = [line for line in _sections(text)["Where the time goes (specter rows)"] if line.startswith("| ")]
    assert lines[0] == "| " + " | ".join(PHASE_COLUMNS) + " |"
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[1:]]


def _phase_row(rows: list[list[str]], label: str, budget: str, link: str, mode: str = "eager") -> list[str]:
    matches = [row for row in rows if row[:4] == [label, budget, link, mode]]
    assert len(matches) == 1, (label, budget, link, mode, rows)
    return matches[0]


def test_where_the_time_goes(bench):
    rows = _phase_rows(markdown(bench))
    assert len(rows) == sum(r["engine"] == "specter" for r in bench["rows"])
    assert all(len(row) == len(PHASE_COLUMNS) for row in rows)
    row = _phase_row(rows, "specter k=4", "25%", "slow")
    resident = next(r for r in bench["rows"] if r["label"] == "resident" and not r["compile"])
    assert resident["decode_step_s"] == 1 / 30.0  # the target step: no transfer in it
    single_ms = resident["decode_step_s"] / (2 * 4) * 1e3  # top-2 x 4 MoE layers
    assert row[4:6] == ["50", "5.00"]
    assert row[6] == f"{0.005 / resident['decode_step_s']:.3f}" == "0.150"
    assert row[7:12] == ["50.00", "4.80", "4.50", "2.000", "1.500"]  # verify ms/expert read, of it kernels
    assert row[12] == f"{single_ms:.3f}" == "4.167"
    assert row[13] == "0.48x"
    assert row[14:] == ["25.0%", "62.5%", "10.0%", "conservative (auto)"]
    assert _phase_row(rows, "specter k=4", "25%", "fast")[17] == "aggressive (auto)"
    assert _phase_row(rows, "specter k=4", "50%", "fast")[17] == "lazy"
    compiled = _phase_row(rows, "specter roofline", "25%", "fast", "compiled")
    assert compiled[13] == f"{2.0 / (1e3 / 36.0 / 8):.2f}x" == "0.58x"


def test_where_the_time_goes_takes_residents_steps_in_the_rows_own_cell(bench):
    row = next(r for r in bench["rows"] if r["label"] == "specter k=4" and r["budget"] == 0.25
               and r["link"] == "slow" and not r["compile"])
    row["single_step_s"] = 0.04  # resident's median step in this cell, not its row's over the bench
    cells = _phase_row(_phase_rows(markdown(bench)), "specter k=4", "25%", "slow")
    assert cells[6] == f"{0.005 / 0.04:.3f}" == "0.125"
    assert cells[12] == f"{0.04 / 8 * 1e3:.3f}" == "5.000" and cells[13] == "0.40x"
    assert _phase_row(_phase_rows(markdown(bench)), "specter k=4", "25%", "fast")[12] == "4.167"  # others as before


def test_where_the_time_goes_falls_back_to_the_cells_ondemand(bench):
    bench["rows"] = [r for r in bench["rows"] if r["label"] != "resident"]
    row = _phase_row(_phase_rows(markdown(bench)), "specter k=4", "25%", "slow")
    assert row[6] == f"{0.005 * 12.5:.3f}" and row[12] == f"{1 / 12.5 / 8 * 1e3:.3f}"
    bench["rows"] = [r for r in bench["rows"] if r["label"] != "ondemand"]
    row = _phase_row(_phase_rows(markdown(bench)), "specter k=4", "25%", "slow")
    assert row[6] == "-" and row[12:14] == ["-", "-"]


def test_governor_section(bench):
    older = [r for r in bench["rows"] if r["label"] == "specter roofline"][-1]
    older["governor_summary"] = dict(older["governor_summary"])
    older["governor_summary"].pop("prediction_total_error")  # a report from before the total error
    lines = _sections(markdown(bench))["Governor"]
    assert lines[1] == "| " + " | ".join(GOVERNOR_COLUMNS) + " |"
    rows = [[c.strip() for c in line.strip("|").split(" | ")] for line in lines
            if line.startswith("| specter")]
    assert rows[0] == ["specter roofline (roofline)", "25% / slow / eager", "0:1 1:1 2:2 3:6 4:2", "9.0% (2.0% total)",
                       "5", "2"]
    assert rows[-1][3] == "9.0%"
    assert len(rows) == 4 and {row[1] for row in rows} == {f"25% / {link} / {mode}" for link in ("slow", "fast")
                                                           for mode in ("eager", "compiled")}
    captions = [line for line in lines if line.startswith("Roofline table of")]
    assert captions[0] == "Roofline table of specter roofline (25% / slow / eager):" and len(captions) == 4
    # what the tables are (the state at the run's end), said once before them
    said = [i for i, line in enumerate(lines) if line.startswith("Each roofline table is the governor's prediction")]
    assert len(said) == 1 and said[0] < lines.index(captions[0])
    first = lines[lines.index(captions[0]):]
    k3 = next(line for line in first if line.startswith("| 3 |"))
    accepted = 4 * (1 - 0.8**3)
    assert k3 == f"| 3 | {accepted:.2f} | 86.00 | {(1 + accepted) / 0.086:.2f} |"
    assert sum(line.startswith("| ") and line[2].isdigit() for line in first[:14]) == 9


def test_noise_floor_section_pairs_each_twin_with_its_row(bench):
    assert "Noise floor: identical engines (A/A)" not in markdown(bench)
    rows = bench["rows"]
    original = next(r for r in rows if r["label"] == "specter k=4" and r["link"] == "slow" and not r["compile"])
    twin = {**original, "label": "specter k=4 (twin)", "twin_of": "specter k=4",
            "decode_tokens_per_s": {"median": original["decode_tokens_per_s"]["median"] * 0.9, "min": 1.0, "max": 99.0,
                                    "runs": [x * r for x, r in zip(original["decode_tokens_per_s"]["runs"], (0.8, 1.0))]}}
    rows.append(twin)
    lines = _sections(markdown(bench))["Noise floor: identical engines (A/A)"]
    median = original["decode_tokens_per_s"]["median"]
    assert f"| specter k=4 | {original['budget'] * 100:g}% / slow / eager | {median:.2f} | {median * 0.9:.2f} | 0.90x " \
           "| 0.80-1.00x | - / - |" in lines  # a document without memory read rates (before stop 57)
    original["memory_read_gibps"], twin["memory_read_gibps"] = 13.04, 11.0
    assert "| 0.80-1.00x | 13.0 / 11.0 |" in "\n".join(_sections(markdown(bench))["Noise floor: identical engines (A/A)"])
    assert lines[-1].startswith("Two identical engines landed up to 10.0% apart")


def test_compiled_against_eager_pairs_rows_of_one_label_and_cell(bench):
    rows = bench["rows"]
    lines = _sections(markdown(bench))["Compiled against eager"]
    pairs = [r for r in rows if r["compile"] and any(
        not o["compile"] and o["label"] == r["label"] and (o["budget"], o["link"]) == (r["budget"], r["link"]) for o in rows)]
    table = [line for line in lines if line.startswith("| ") and not line.startswith("| row |")]
    assert len(table) == len(pairs) > 0
    assert "| resident | - / - | 30.00 | 36.00 | 1.200x | 1.200-1.200x |" in table
    assert sum("| 1.100x | 1.100-1.100x |" in line for line in table) == len(table) - 3  # resident, two rooflines
    assert lines[-1] == f"Compiled at or above eager in {len(pairs)} of {len(pairs)} rows."

    slower = next(r for r in rows if r["label"] == "specter k=4" and r["link"] == "slow" and r["compile"])
    eager = next(r for r in rows if r["label"] == "specter k=4" and r["link"] == "slow" and not r["compile"]
                 and r["budget"] == slower["budget"])
    median = eager["decode_tokens_per_s"]["median"]
    slower["decode_tokens_per_s"] = {"median": median * 0.97, "runs": [x * 0.97 for x in eager["decode_tokens_per_s"]["runs"]]}
    twin = {**eager, "label": "specter k=4 (twin)", "twin_of": "specter k=4",
            "decode_tokens_per_s": {"median": median * 0.95, "runs": eager["decode_tokens_per_s"]["runs"]}}
    rows.append(twin)
    lines = [line for line in _sections(markdown(bench))["Compiled against eager"] if line]
    assert f"| {median:.2f} | {median * 0.97:.2f} | 0.970x | 0.970-0.970x |" in "\n".join(lines)
    assert lines[-1] == (f"Compiled at or above eager in {len(pairs) - 1} of {len(pairs)} rows; of those below, "
                         "1 within the A/A noise floor (5.0%).")


def test_a_row_with_twins_of_its_own_is_judged_against_its_own_floor(bench):
    rows = bench["rows"]

    def row(label: str, link: str, compiled: bool) -> dict:
        return next(r for r in rows if r["label"] == label and r["link"] == link and r["compile"] == compiled)

    def scale(target: dict, base: dict, factor: float) -> None:
        runs = base["decode_tokens_per_s"]["runs"]
        target["decode_tokens_per_s"] = {"median": base["decode_tokens_per_s"]["median"] * factor,
                                         "runs": [x * factor for x in runs]}

    for label, gap in (("specter k=4", 0.02), ("specter roofline", 0.08)):
        eager = row(label, "slow", False)
        twin = {**eager, "label": f"{label} (twin)", "twin_of": label}
        scale(twin, eager, 1 - gap)
        rows.append(twin)
    scale(row("specter roofline", "slow", True), row("specter roofline", "slow", False), 0.95)  # inside its 8%
    scale(row("specter k=4", "slow", True), row("specter k=4", "slow", False), 0.95)  # outside its 2%
    scale(row("ondemand", "slow", True), row("ondemand", "slow", False), 0.97)  # no twins: the smallest floor, 2%
    lines = [line for line in _sections(markdown(bench))["Compiled against eager"] if line]
    assert lines[-1].endswith("; of those below, 1 within the A/A noise floor (specter k=4 2.0%, specter roofline "
                              "8.0%; other rows the smallest).")
    twins = _sections(markdown(bench))["Noise floor: identical engines (A/A)"]
    assert twins[-1].startswith("Two identical engines landed up to 8.0% apart (medians) in this run (by row: "
                                "specter k=4 2.0%, specter roofline 8.0%)")


def test_extra_sections_skipped_when_empty(sparse_bench):
    for row in sparse_bench["rows"]:
        row.pop("phases", None)
    assert not set(EXTRA) & set(_sections(markdown(sparse_bench)))


def test_extra_sections_tolerate_missing_fields(bench):
    rows = bench["rows"]
    bench.pop("model")
    specter = [r for r in rows if r["engine"] == "specter"]
    specter[0]["phases"] = None
    specter[1]["phases"] = {"rounds": 3}
    specter[2]["phases"] = {"draft_step_s": 0.01, "draft_s": 0.0}
    specter[1]["prefetch"] = {"mode": "auto"}  # an older report: no state at the end
    roofline = [r for r in rows if r["label"] == "specter roofline"]
    roofline[0]["governor_summary"] = {"name": "roofline"}
    roofline[1]["governor_summary"]["table"] = [{"k": 0}, {}, "junk"]
    roofline[1].pop("k_histogram")
    roofline[1]["governor_summary"].pop("prediction_error")
    roofline[0]["governor_summary"]["probes"] = 1  # no cut_rounds: an older report
    for row in rows:
        row.pop("decode_step_s", None)
    text = markdown(bench)
    phase_rows = _phase_rows(text)
    assert len(phase_rows) == len(specter) - 1
    assert phase_rows[0][4:] == ["3"] + ["-"] * 13
    assert all(row[6] == "-" and row[12] == "-" for row in phase_rows)
    governor = _sections(text)["Governor"]
    assert "| specter roofline (roofline) | 25% / fast / eager | - | - | 5 | 2 |" in governor
    assert any(line.startswith("| specter roofline (roofline) | 25% / slow / eager |") and line.endswith("| 1 | - |")
               for line in governor)
    assert "Roofline table of specter roofline (25% / fast / eager):" in governor
    assert "| 0 | - | - | - |" in governor and "| - | - | - | - |" in governor


def test_disk_reads_section_shows_the_bandwidth_the_disk_delivered(bench):
    assert "Disk reads" not in markdown(bench)
    row = bench["rows"][0]
    row["link_stats"] = {"kind": "disk", "io": "O_DIRECT", "bytes_read": 2_500_000_000, "busy_s": 5.0,
                         "read_gbps": 0.5, "emulated": False}
    text = markdown(bench)
    section = text[text.index("### Disk reads"):]
    assert "| O_DIRECT | 0.500 | 2.50 |" in section
