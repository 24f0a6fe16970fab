"""``python -m specter.bench``'s command line: every budget form end to end, mistakes refused in
one line with exit code 2 before any engine is built, Ctrl-C, the help text."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specter.bench.__main__ import main, parse_args

RUN = {"model": "bundled:tiny-moe", "device": "cpu", "threads": 1, "prompts": ["def f(x):"], "max_new_tokens": 2}
SWEEP = {"engines": ["resident", "ondemand"], "budgets": [0.5], "links": {"l": {"kind": "local"}}, "k": [4],
         "compile": [False], "repeats": 1, "warmup_tokens": 1}


def recipe_file(tmp_path, title="tiny", **sweep):
    path = tmp_path / "bench.yaml"
    path.write_text(json.dumps({"title": title, "run": RUN, "sweep": {**SWEEP, **sweep}}))  # JSON is YAML
    return str(path)


@pytest.fixture
def no_engines(monkeypatch):
    """Fail the test if the bench gets as far as running (building engines)."""
    def run_bench(*args, **kwargs):
        raise AssertionError("the bench ran; the mistake should have been refused before")

    monkeypatch.setattr("specter.bench.sweep.run_bench", run_bench)


def refused(capsys, argv, expected: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: " + expected), err


def test_every_budget_form_runs_to_json_markdown_and_plots(tmp_path, capsys):
    out = tmp_path / "out"
    assert main([recipe_file(tmp_path), "--budgets", "{per_layer: 8},2MiB,{experts: 40},1e-1", "--out", str(out)]) == 0
    document = json.loads((out / "tiny.json").read_text())
    assert document["budgets"] == [{"per_layer": 8}, "2MiB", {"experts": 40}, 0.1]
    assert [r["budget"] for r in document["rows"] if r["label"] == "ondemand"] == document["budgets"]
    table = (out / "tiny.md").read_text()
    for heading in ("8 per layer", "2 MiB", "40 experts", "10% of experts"):
        assert f"### budget {heading}, link `l`" in table
    assert len(list(out.glob("tiny-*.png"))) >= 3
    err = capsys.readouterr().err
    assert "building ondemand (eager budget 8 per layer) ..." in err
    assert "[budget 2 MiB, l link, eager] warming up 2 engines (1 token each) ..." in err
    assert main(["plot", str(out / "tiny.json"), "--out", str(tmp_path / "again")]) == 0
    assert len(list((tmp_path / "again").glob("tiny-*.png"))) >= 3


def test_budgets_given_twice_are_refused(tmp_path, capsys, no_engines):
    refused(capsys, [recipe_file(tmp_path), "--budgets", "0.5,0.5"],
            "--budgets (sweep.budgets[1]): 0.5 repeats sweep.budgets[0]")
    refused(capsys, [recipe_file(tmp_path), "--budgets", "2MiB,'2097152'"], "--budgets (sweep.budgets[1]): '2097152' repeats")
    refused(capsys, [recipe_file(tmp_path, engines=["specter"]), "--k", "4,4"], "--k (sweep.k[1]): 4 repeats sweep.k[0]")


def test_an_out_path_that_is_a_file_is_refused(tmp_path, capsys, no_engines):
    taken = tmp_path / "taken"
    taken.write_text("")
    refused(capsys, [recipe_file(tmp_path), "--out", str(taken)], f"--out: cannot write to {taken}: it is a file")
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"schema": "specter.bench/2", "rows": []}))
    refused(capsys, ["plot", str(bench), "--out", str(taken)], f"--out: cannot write to {taken}: it is a file")


@pytest.mark.parametrize("title", ["my/run", "..", "", "a\\b", "x" * 101, None, ["a"]])
def test_a_title_that_cannot_name_a_file_is_refused(tmp_path, capsys, no_engines, title):
    refused(capsys, [recipe_file(tmp_path, title=title)], "title: ")


def test_ctrl_c_prints_interrupted_and_exits_130(tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def exit_code(argv: list[str]) -> int:
        try:
            return main(argv)
        except KeyboardInterrupt:  # would end this test session too
            pytest.fail("Ctrl-C escaped main as a KeyboardInterrupt")

    monkeypatch.setattr("specter.bench.sweep.run_bench", interrupted)
    assert exit_code([recipe_file(tmp_path), "--out", str(tmp_path / "out")]) == 130
    monkeypatch.setattr("specter.bench.plots.plot_all", interrupted)
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"schema": "specter.bench/2", "rows": []}))
    assert exit_code(["plot", str(bench)]) == 130
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("interrupted: nothing written") and lines[1] == "interrupted"


@pytest.mark.parametrize("override, instead", [
    ("engine=specter", "--engines"), ("compile=true", "--compile"), ("check_lossless=true", "lossless"),
    ("offload.expert_budget=0.25", "--budgets"), ("offload.link.kind=emulated", "--links"),
    ("offload.link={kind: local}", "--links"), ("speculation.governor.name=roofline", "--governors"),
    ("speculation.governor.k=2", "--k"),
])
def test_a_set_of_a_key_the_sweep_replaces_is_refused(tmp_path, capsys, no_engines, override, instead):
    key = override.split("=")[0]
    assert main([recipe_file(tmp_path, engines=["ondemand", "specter"]), "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --set {key}: the bench sets it in every cell") and instead in err
    assert err.count("\n") == 1


def test_a_set_that_some_cell_takes_is_kept(tmp_path):
    from specter.bench.spec import load_bench

    path = recipe_file(tmp_path, engines=["ondemand", "specter"], governors=["roofline"])
    spec = load_bench(path, ["offload.link.gbps=3", "speculation.governor.k=2", "max_new_tokens=3"])
    assert spec.recipe.offload.link.gbps == 3 and spec.recipe.speculation.governor.k == 2  # no link sets gbps
    plain = load_bench("recipes/specter.yaml", ["offload.expert_budget=0.25", "compile=true"])  # one cell: its own
    assert plain.budgets == (0.25,) and plain.compile == (True,)
    with pytest.raises(Exception, match="^--set offload.expert_budget: .* --budgets"):
        load_bench("recipes/specter.yaml", ["offload.expert_budget=0.25"], {"budgets": [0.5]})


def test_narrowing_engines_drops_the_twins_of_rows_left_out(capsys, no_engines, tmp_path):
    from specter.bench.spec import load_bench

    assert load_bench("recipes/bench-bundled.yaml", [], {"engines": ["resident", "ondemand"]}).twins == ()
    assert load_bench("recipes/bench-bundled.yaml", [], {"k": [2]}).twins == ("specter roofline",)
    refused(capsys, ["recipes/bench-bundled.yaml", "--engines", "resident,ondemand", "--twins", "specter k=4"],
            "--twins (sweep.twins[0]): 'specter k=4' is not a row of this sweep")


def test_help_explains_the_command_and_plot():
    text = subprocess.run([sys.executable, "-m", "specter.bench", "--help"], capture_output=True, text=True,
                          check=True).stdout
    assert "python -m specter.bench plot BENCH.json [--out DIR]" in text and "redraws the PNG plots" in text
    assert "benched as one cell." in text
    repeats = text[text.index("--repeats REPEATS"):text.index("--twins")]
    assert "timed runs" in repeats


def test_option_mistakes_name_what_was_expected(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["r.yaml", "--k", "four"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --k: expected comma-separated integers" in err and "<lambda>" not in err
    assert parse_args(["r.yaml", "--budgets", "1e-1,.5,2MiB,'3'"]).budgets == [0.1, 0.5, "2MiB", "3"]


def test_links_are_read_as_recipe_yaml_so_a_name_given_twice_is_refused(capsys):
    both = '{"local": {"kind": "local"}, "local": {"kind": "emulated", "gbps": 1}}'
    with pytest.raises(SystemExit) as exit_:
        parse_args(["r.yaml", "--links", both])  # json.loads kept the second silently
    assert exit_.value.code == 2
    assert "'local' is given twice in one mapping" in capsys.readouterr().err
    flow = parse_args(["r.yaml", "--links", "{slow: {kind: emulated, gbps: 4e0}}"]).links
    assert flow == {"slow": {"kind": "emulated", "gbps": 4.0}}


def test_a_bench_recipe_reads_budgets_with_an_exponent_as_fractions(tmp_path):
    from specter.bench.spec import load_bench

    recipe = tmp_path / "exp.yaml"
    recipe.write_text("run: {}\nsweep:\n  engines: [resident, ondemand]\n  budgets: [25e-2, 5e-1]\n")
    assert load_bench(recipe).budgets == (0.25, 0.5)


def test_run_section_keys_the_sweep_replaces_are_warned_about(tmp_path, capsys, no_engines):
    recipe = tmp_path / "dead.yaml"
    recipe.write_text("run:\n  engine: specter\n  compile: true\n  offload: {expert_budget: 0.3}\n"
                      "  speculation: {governor: {name: roofline, k: 2}}\n"
                      "sweep:\n  engines: [resident, specter]\n  k: [4]\n  budgets: [0.5]\n")
    from specter.bench.spec import load_bench

    unused = dict(load_bench(recipe).unused)
    # engine is always the sweep's; budgets and k are given; compile is not, so run.compile is used
    assert set(unused) == {"run.engine", "run.offload.expert_budget", "run.speculation.governor.k",
                           "run.speculation.governor.name"}
    assert "--budgets" in unused["run.offload.expert_budget"]
    assert load_bench(recipe).compile == (True,)
    with pytest.raises(AssertionError, match="the bench ran"):  # a warning, not a refusal
        main([str(recipe), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "warning: run.engine has no effect: the bench sets it in every cell; choose engines with --engines" in err


def test_a_set_of_a_sweep_key_the_recipe_leaves_out_is_taken(tmp_path):
    from specter.bench.spec import load_bench

    recipe = tmp_path / "open.yaml"
    recipe.write_text("run: {}\nsweep:\n  engines: [resident, ondemand]\n")
    spec = load_bench(recipe, ["compile=true", "offload.expert_budget=0.3"])
    assert spec.compile == (True,) and spec.budgets == (0.3,)
