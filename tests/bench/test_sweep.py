"""A whole bench on a tiny random Mixtral: every engine in every cell, rows with ratios taken in
the same cell, lossless against eager resident, files written by the CLI."""

from __future__ import annotations

import json
import re
import sys
from types import SimpleNamespace

import pytest

from specter.bench.__main__ import main
from specter.bench.spec import SAME_MEMORY, load_bench
from specter.bench.sweep import Sweep, run_bench, take_turns

LINKS = {"slow": {"kind": "emulated", "gbps": 0.05, "latency_us": 10}, "fast": {"kind": "local"}}


def bench_recipe(model) -> dict:
    return {"title": "tiny", "run": {"model": str(model), "threads": 1, "prompts": ["def f(x):", "import os\n"],
                                     "max_new_tokens": 6, "offload": {"cache_policy": {"name": "lru"}}},
            "sweep": {"engines": ["resident", "ondemand", SAME_MEMORY, "router-lookahead", "specter", "hf-offload"],
                      "budgets": [0.25], "links": LINKS, "k": [2, 3], "compile": [False], "repeats": 2,
                      "warmup_tokens": 2, "twins": ["specter k=2"]}}


@pytest.fixture(scope="module")
def document(tiny_mixtral) -> dict:
    return run_bench(load_bench(bench_recipe(tiny_mixtral)), progress=False)


def rows_by(document, label, link):
    return [r for r in document["rows"] if r["label"] == label and r["link"] == link]


def test_every_engine_has_a_row_per_cell_and_all_are_lossless(document):
    labels = {"ondemand", SAME_MEMORY, "router-lookahead", "specter k=2", "specter k=3", "specter k=2 (twin)"}
    for link in LINKS:
        for label in labels:
            (row,) = rows_by(document, label, link)
            assert row["budget"] == 0.25 and row["compile"] is False
            assert len(row["decode_tokens_per_s"]["runs"]) == 2
            low, mid, high = (row["decode_tokens_per_s"][k] for k in ("min", "median", "max"))
            assert 0 < low <= mid <= high
            assert row["lossless"] is True
    (resident,) = rows_by(document, "resident", None)
    assert resident["budget"] is None and len(resident["decode_tokens_per_s"]["runs"]) == 2 * len(LINKS)
    (hf,) = rows_by(document, "hf-offload", None)
    assert hf["budget"] == 0.25 and hf["lossless"] is True and "disk" in hf["note"]


def test_ratios_are_taken_against_baselines_of_the_same_cell(document):
    for link in LINKS:
        (specter,) = rows_by(document, "specter k=2", link)
        (ondemand,) = rows_by(document, "ondemand", link)
        ratio = specter["decode_tokens_per_s"]["median"] / ondemand["decode_tokens_per_s"]["median"]
        assert specter["ratios"]["ondemand"] == pytest.approx(ratio)
        assert set(specter["ratios"]) == {"ondemand", SAME_MEMORY, "router-lookahead", "resident", "hf-offload"}
        assert "ondemand" not in ondemand["ratios"]


def test_specter_rows_carry_k_and_acceptance_and_same_memory_is_bigger(document):
    (k3,) = rows_by(document, "specter k=3", "fast")
    assert k3["k"] == 3 and k3["governor"] == "fixed" and 0 <= k3["acceptance_rate"] <= 1
    (same,) = rows_by(document, SAME_MEMORY, "fast")
    (ondemand,) = rows_by(document, "ondemand", "fast")
    assert same["device_bytes_total"] > ondemand["device_bytes_total"]
    assert same["device_bytes_total"] == pytest.approx(k3["device_bytes_total"], rel=0.05)


def test_a_twin_is_a_second_engine_built_as_its_row(document):
    for link in LINKS:
        (original,) = rows_by(document, "specter k=2", link)
        (twin,) = rows_by(document, "specter k=2 (twin)", link)
        assert twin["twin_of"] == "specter k=2" and original["twin_of"] is None
        assert (twin["k"], twin["governor"], twin["device_bytes_total"]) == (2, "fixed", original["device_bytes_total"])
        assert twin["decode_tokens_per_s"]["runs"] != original["decode_tokens_per_s"]["runs"]  # timed on its own
    assert document["bench_recipe"]["sweep"]["twins"] == ["specter k=2"]


def test_every_row_on_a_cpu_carries_its_engines_memory_read_rate(document):
    for row in document["rows"]:
        if row["engine"] == "hf-offload":
            continue  # accelerate's disk offload: its weights are not ours to read
        assert row["memory_read_gibps"] > 0, row["label"]


def test_phases_pool_every_run_against_residents_steps_in_the_same_cell(document):
    for link in LINKS:
        for row in rows_by(document, "specter k=2", link):
            phases = row["phases"]
            # two repeats of two prompts, five tokens after each prompt's first, at most three a round
            # (k = 2): at least two rounds and five verified tokens a prompt, twice one run's
            assert phases["rounds"] >= 2 * 2 * 2 and phases["verify_tokens"] >= 2 * 2 * 5
            assert row["single_step_s"] > 0 and row["decode_step_s"] > 0
        (resident,) = [r for r in document["rows"] if r["label"] == "resident"]
        assert resident["single_step_s"] is None  # no cell of its own: its decode_step_s spans them all
    singles = {row["single_step_s"] for row in document["rows"] if row["link"] == "slow" and row["budget"] == 0.25}
    assert len(singles) == 1  # one figure per cell, whatever the row


def test_links_are_labelled_and_the_document_is_json(document):
    assert document["schema"] == "specter.bench/2"
    assert document["links"]["slow"]["emulated"] is True and document["links"]["fast"]["emulated"] is False
    assert document["threads"] == 1 and document["machine"]["cores"] >= 1
    assert document["peak_rss_bytes"] > 100 * 2**20  # this process's peak, a model and its engines in it
    assert document["page_placement"]["pieces"] >= 0 and "swapped" in document["page_placement"]
    json.dumps(document)


def test_cli_writes_json_markdown_and_plots(tiny_mixtral, tmp_path):
    recipe = tmp_path / "tiny.yaml"
    data = bench_recipe(tiny_mixtral)
    data["sweep"].update(engines=["resident", "ondemand", "specter"], k=[2], repeats=1)
    recipe.write_text(json.dumps(data))
    out = tmp_path / "out"
    assert main([str(recipe), "--out", str(out), "--links", json.dumps({"fast": {"kind": "local"}})]) == 0
    written = json.loads((out / "tiny.json").read_text())
    assert list(written["links"]) == ["fast"]
    assert "| specter k=2 |" in (out / "tiny.md").read_text()
    assert len(list(out.glob("tiny-*.png"))) >= 4


def test_cli_refuses_bad_input_with_exit_2(tiny_mixtral, tmp_path, capsys):
    assert main(["recipes/specter.yaml", "--budgets", "-3"]) == 2
    assert "sweep.budgets[0]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["recipes/specter.yaml", "--links", "{not json"])
    assert exit_.value.code == 2 and "argument --links: expected a mapping" in capsys.readouterr().err


class TurnTaker:
    """An engine stand-in whose ``generate_by_prompt`` records (name, prompt) as it decodes."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def generate_by_prompt(self, prompts):
        for index, prompt in enumerate(prompts):
            self.log.append((self.name, prompt))
            if index + 1 < len(prompts):
                yield index
        return f"{self.name} done"


def test_engines_take_turns_prompt_by_prompt():
    log: list = []
    engines = {name: TurnTaker(name, log) for name in ("a", "b", "c")}
    finished = list(take_turns(engines, ["c", "a", "b"], ["p1", "p2", "p3"]))
    assert log == [(n, p) for p in ("p1", "p2", "p3") for n in ("c", "a", "b")]
    assert finished == [("c", "c done"), ("a", "a done"), ("b", "b done")]


def test_fixed_rows_leave_the_recipe_governor_options_to_the_other_governors():
    from specter.plugins import registry

    spec = load_bench({"title": "t", "run": {"model": "bundled:tiny-moe", "speculation": {
        "governor": {"name": "roofline", "options": {"k_max": 12}}}}, "sweep": {"k": [2], "governors": ["roofline"]}})
    governors = {}
    for label, extra, _, _ in spec.specter_variants():
        chosen = spec.cell_recipe("specter", 0.5, next(iter(spec.links)), False, extra).speculation.governor
        governors[label] = registry().create("governor", chosen.name, chosen.options, k=chosen.k, n_experts=16, top_k=2)
    assert governors["specter k=2"].name == "fixed" and governors["specter k=2"].k == 2
    assert governors["specter roofline"].k_max == 12


class StandIn:
    """An engine stand-in for ``Sweep._build``: logs (label, compiled, prompt) as it decodes; a
    compiled one reports twice the rate."""

    def __init__(self, label: str, name: str, compiled: bool, log: list) -> None:
        self.label, self.name, self.compiled, self.log = label, name, compiled, log

    def generate(self, prompts, max_new_tokens=None):
        return None

    def generate_by_prompt(self, prompts):
        for index, prompt in enumerate(prompts):
            self.log.append((self.label, self.compiled, prompt))
            if index + 1 < len(prompts):
                yield index
        return SimpleNamespace(report={"decode_tokens_per_s": 2.0 if self.compiled else 1.0}, token_ids=[[1]])

    def close(self) -> None:
        pass


def test_eager_and_compiled_engines_of_a_cell_take_turns_prompt_by_prompt(monkeypatch):
    spec = load_bench({"title": "t", "run": {"model": "bundled:tiny-moe", "prompts": ["a", "b"]}, "sweep": {
        "engines": ["resident", "ondemand"], "budgets": [0.5], "links": {"fast": {"kind": "local"}},
        "compile": [False, True], "repeats": 1, "warmup_tokens": 1}})
    log: list = []
    sweep = Sweep(spec, progress=False)
    monkeypatch.setattr(sweep, "_build", lambda label, engine, budget, link, compile, extra=(): StandIn(
        label, engine, compile, log))
    sweep.run()
    first = log[:4]  # prompt "a" by every engine of both modes before any engine's prompt "b"
    assert {prompt for *_, prompt in first} == {"a"} and log[4:] and {prompt for *_, prompt in log[4:]} == {"b"}
    assert sorted((label, compiled) for label, compiled, _ in first) == [
        ("ondemand", False), ("ondemand", True), ("resident", False), ("resident", True)]
    assert sweep.cells[(0.5, "fast", False)] == {"ondemand": [1.0], "resident": [1.0]}
    assert sweep.cells[(0.5, "fast", True)] == {"ondemand": [2.0], "resident": [2.0]}
    assert set(sweep.runs) == {("ondemand", 0.5, "fast", False), ("ondemand", 0.5, "fast", True),
                               ("resident", None, None, False), ("resident", None, None, True)}


def test_a_cell_says_it_is_warming_up_before_its_engines_warm_up(monkeypatch, capsys):
    spec = load_bench({"title": "t", "run": {"model": "bundled:tiny-moe", "prompts": ["a"]}, "sweep": {
        "engines": ["resident", "ondemand"], "budgets": [0.25], "links": {"slow": {"kind": "local"}},
        "compile": [False, True], "repeats": 1, "warmup_tokens": 48}})
    sweep = Sweep(spec, progress=False)
    monkeypatch.setattr(sweep, "_build", lambda label, engine, budget, link, compile, extra=(): StandIn(
        label, engine, compile, []))
    monkeypatch.setattr(StandIn, "generate", lambda self, prompts, max_new_tokens=None: print(
        f"warm-up {max_new_tokens}", file=sys.stderr))
    sweep.run()
    lines = capsys.readouterr().err.splitlines()
    start = lines.index("[budget 25%, slow link, eager and compiled] warming up 4 engines (48 tokens each) ...")
    warm_ups = lines[start + 1:start + 9]  # each engine's warm-up, then a line saying it is done
    assert warm_ups[0::2] == ["warm-up 48"] * 4
    done = [re.sub(r"in \d+\.\d s$", "in X s", line) for line in warm_ups[1::2]]
    assert sorted(done) == sorted(f"[budget 25%, slow link, {mode}] warmed up {label} in X s"
                                  for label in ("ondemand", "resident") for mode in ("eager", "compiled"))
    assert lines[start + 9].startswith("[budget 25%, slow link, eager #1] ")
