"""What ``python -m specter.bench`` leaves on disk and says, from a new user's audit: option
mistakes in one line naming the option, ``--warmup-tokens``, ``--out``, an interrupted bench,
earlier runs' plots, plot file names, ``plot`` of a malformed document, the lossless note."""

from __future__ import annotations

import copy
import json
import os

import pytest

from specter.bench.__main__ import main
from specter.bench.tables import markdown

RUN = {"model": "bundled:tiny-moe", "device": "cpu", "threads": 1, "prompts": ["def f(x):"], "max_new_tokens": 2}
SWEEP = {"engines": ["resident", "ondemand"], "budgets": [0.5], "links": {"l": {"kind": "local"}}, "k": [4],
         "compile": [False], "repeats": 1, "warmup_tokens": 1}


def recipe_file(tmp_path, title: str = "tiny", **sweep) -> str:
    path = tmp_path / "bench.yaml"
    path.write_text(json.dumps({"title": title, "run": RUN, "sweep": {**SWEEP, **sweep}}))
    return str(path)


@pytest.fixture
def measured(monkeypatch, bench):
    """The bench 'runs' in no time: ``run_bench`` returns the synthetic document (conftest's
    ``bench``), titled as the spec; the specs it was given are kept."""
    specs: list = []

    def run_bench(spec, command=""):
        specs.append(spec)
        return {**copy.deepcopy(bench), "title": spec.title, "command": command}

    monkeypatch.setattr("specter.bench.sweep.run_bench", run_bench)
    return specs


def one_line_error(capsys, argv: list[str]) -> str:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    return err


@pytest.mark.parametrize("argv, expected", [
    (["r.yaml", "--k", "four"], "error: argument --k: expected comma-separated integers"),
    (["r.yaml", "--repeats", "x"], "error: argument --repeats: expected an integer, got 'x'"),
    (["r.yaml", "--compile", "both"], "error: argument --compile: expected eager,compiled"),
    (["r.yaml", "--bogus"], "error: unrecognized arguments: --bogus"),
    ([], "error: the following arguments are required: RECIPE"),
    (["plot"], "error: the following arguments are required: bench"),
    (["r.yaml", "--out", ""], "error: argument --out: expected a folder, got an empty path"),
    (["plot", "b.json", "--out", " "], "error: argument --out: expected a folder, got an empty path"),
])
def test_a_mistaken_option_is_one_line(capsys, argv, expected):
    assert one_line_error(capsys, argv).startswith(expected)


@pytest.mark.parametrize("option, expected", [
    (["--repeats", "0"], "error: --repeats (sweep.repeats): expected an integer >= 1, got 0"),
    (["--engines", "resident,nope"], "error: --engines (sweep.engines[1]): unknown engine 'nope'"),
    (["--links", "{a: {kind: warp}}"], "error: --links (sweep.links.a): offload.link.kind: unknown link 'warp'"),
    (["--warmup-tokens", "-1"], "error: --warmup-tokens (sweep.warmup_tokens): expected an integer >= 1"),
    (["--set", "warmup_tokens=8"], "error: --set warmup_tokens: a sweep key, not a run-recipe key: use --warmup-tokens"),
    (["--set", "sweep.repeats=3"], "error: --set sweep.repeats: a sweep key, not a run-recipe key: use --repeats"),
])
def test_a_mistaken_sweep_option_names_the_option(tmp_path, capsys, measured, option, expected):
    assert one_line_error(capsys, [recipe_file(tmp_path), *option]).startswith(expected)
    assert not measured


def test_a_mistake_in_the_recipe_names_its_key(tmp_path, capsys, measured):
    from specter.bench.__main__ import naming_option
    from specter.bench.spec import SWEEP_OPTIONS

    assert one_line_error(capsys, [recipe_file(tmp_path, repeats=0)]).startswith("error: sweep.repeats: expected")
    assert naming_option("sweep.k: needs one", ["budgets"]) == "sweep.k: needs one"
    assert naming_option("sweep.k[1]: 4 repeats", ["k"]) == "--k (sweep.k[1]): 4 repeats"
    assert naming_option("sweep.warmup_tokens: at least 1", ["warmup_tokens"]) == (
        f"{SWEEP_OPTIONS['warmup_tokens']} (sweep.warmup_tokens): at least 1")
    assert SWEEP_OPTIONS["warmup_tokens"] == "--warmup-tokens"


def test_warmup_tokens_replaces_the_recipes(tmp_path, measured):
    assert main([recipe_file(tmp_path, warmup_tokens=48), "--warmup-tokens", "3", "--out", str(tmp_path / "o"),
                 "--no-plots"]) == 0
    assert measured[0].warmup_tokens == 3


def test_a_bench_result_given_as_the_recipe_points_at_plot(tmp_path, capsys, measured, bench):
    result = tmp_path / "r.json"
    result.write_text(json.dumps(bench))
    err = one_line_error(capsys, [str(result)])
    assert "is a bench's result (specter.bench/2), not a recipe" in err and f"plot {result}" in err


def test_k_without_the_specter_engine_is_a_warning(tmp_path, capsys, measured):
    assert main([recipe_file(tmp_path), "--k", "2,4", "--out", str(tmp_path / "o"), "--no-plots"]) == 0
    assert "warning: --k has no effect: it makes specter rows" in capsys.readouterr().err


def test_an_interrupted_bench_removes_the_folder_it_made_and_says_nothing_was_written(tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("specter.bench.sweep.run_bench", interrupted)
    made, kept = tmp_path / "made" / "here", tmp_path / "kept"
    kept.mkdir()
    (kept / "tiny.json").write_text("an earlier run's")
    assert main([recipe_file(tmp_path), "--out", str(made)]) == 130
    assert main([recipe_file(tmp_path), "--out", str(kept)]) == 130
    assert not (tmp_path / "made").exists() and (kept / "tiny.json").read_text() == "an earlier run's"
    assert capsys.readouterr().err.splitlines() == [
        "interrupted: nothing written (the bench writes tiny.json and .md once every cell has run)"] * 2


def test_an_interrupt_while_drawing_says_how_to_redraw(tmp_path, capsys, measured, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("specter.bench.plots.plot_all", interrupted)
    assert main([recipe_file(tmp_path), "--out", str(tmp_path / "o")]) == 130
    assert json.loads((tmp_path / "o" / "tiny.json").read_text())["title"] == "tiny"
    err = capsys.readouterr().err
    assert err.startswith("interrupted while drawing the plots") and f"plot {tmp_path / 'o' / 'tiny.json'}" in err


def test_an_interrupted_write_leaves_the_earlier_file_whole(tmp_path, monkeypatch):
    from specter.bench import output

    path = tmp_path / "t.json"
    path.write_text("earlier")

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        output.write_atomic(path, "later")
    assert path.read_text() == "earlier" and os.listdir(tmp_path) == ["t.json"]


def test_plots_are_named_after_the_json_so_plot_redraws_the_same_files(tmp_path, measured):
    out = tmp_path / "o"
    assert main([recipe_file(tmp_path, title="my bench"), "--out", str(out)]) == 0
    drawn = sorted(p.name for p in out.glob("*.png"))
    assert drawn and all(name.startswith("my bench-") for name in drawn)
    assert main(["plot", str(out / "my bench.json")]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == drawn


def test_an_earlier_runs_plots_are_replaced_or_warned_about(tmp_path, capsys, measured, bench):
    out = tmp_path / "o"
    out.mkdir()
    stale = out / "tiny-roofline.png"
    stale.write_bytes(b"an earlier run's roofline")
    assert main([recipe_file(tmp_path), "--out", str(out), "--no-plots"]) == 0
    assert stale.exists() and f"warning: {out} holds 1 plot(s) of an earlier run" in capsys.readouterr().err
    for row in bench["rows"]:
        row["governor_summary"] = None  # nothing for the roofline figure
    (out / "tiny.json").write_text(json.dumps(bench))
    assert main(["plot", str(out / "tiny.json")]) == 0
    assert not stale.exists() and (out / "tiny-tokens.png").exists()


@pytest.mark.parametrize("change, problem", [
    (lambda b: b["rows"].insert(1, 1), "rows[1]: expected a mapping, got int"),
    (lambda b: b["rows"][0].update(decode_tokens_per_s=5), "rows[0].decode_tokens_per_s: expected a mapping or null"),
    (lambda b: b["rows"][3].update(hit_rate="high"), "rows[3].hit_rate: expected a number or null, got str"),
    (lambda b: b["rows"][3]["decode_tokens_per_s"].update(median="9"), "rows[3].decode_tokens_per_s.median"),
    (lambda b: b.update(rows={"a": 1}), "rows: expected a list or null, got dict"),
    (lambda b: b.update(model=[]), "model: expected a mapping or null, got list"),
    (lambda b: b["links"].update(slow="fast"), "links.slow: expected a mapping or null, got str"),
    (lambda b: b["rows"][3]["ratios"].update(ondemand="2x"), "rows[3].ratios['ondemand']: expected a number"),
])
def test_plot_of_a_malformed_document_is_one_line(tmp_path, capsys, change, problem, bench):
    change(bench)
    path = tmp_path / "b.json"
    path.write_text(json.dumps(bench))
    err = one_line_error(capsys, ["plot", str(path)])
    assert err.startswith(f"error: {path} is not a valid specter.bench/2 document: {problem}")


def test_a_lossless_column_of_dashes_says_why(bench):
    assert "Lossless `-`" not in markdown(bench)
    bench["rows"] = [row for row in bench["rows"] if row["engine"] != "resident"]
    for row in bench["rows"]:
        row["lossless"] = None
    assert "Lossless `-`: no eager `resident` row ran to compare tokens with" in markdown(bench)
    bench["bench_recipe"] = {"run": {"sampling": {"temperature": 0.7}}}
    assert "Lossless `-`: sampling is not greedy" in markdown(bench)


def test_narrowing_a_recipe_from_the_command_line_warns_about_nothing_in_it(tmp_path, capsys, measured):
    # bench-bundled's run.speculation.governor.k starts its roofline rows; --governors '' drops them
    assert main(["recipes/bench-bundled.yaml", "--k", "4", "--governors", "", "--out", str(tmp_path / "o"),
                 "--no-plots"]) == 0
    assert "warning" not in capsys.readouterr().err
    recipe = tmp_path / "dead.yaml"
    recipe.write_text("run:\n  speculation: {governor: {k: 2}}\nsweep:\n  engines: [resident, specter]\n  k: [4]\n")
    assert main([str(recipe), "--governors", "", "--out", str(tmp_path / "o"), "--no-plots"]) == 0
    assert "warning: run.speculation.governor.k has no effect" in capsys.readouterr().err  # dead in the recipe itself


def test_a_bench_that_fails_removes_the_folder_it_made(tmp_path, capsys, monkeypatch):
    from specter.errors import SpecterError

    def fails(error):
        def run_bench(*args, **kwargs):
            raise error
        return run_bench

    monkeypatch.setattr("specter.bench.sweep.run_bench", fails(SpecterError("offload.expert_budget: too small")))
    assert main([recipe_file(tmp_path), "--out", str(tmp_path / "a" / "b")]) == 2
    assert capsys.readouterr().err == "error: offload.expert_budget: too small\n"
    monkeypatch.setattr("specter.bench.sweep.run_bench", fails(RuntimeError("a crash")))
    with pytest.raises(RuntimeError):
        main([recipe_file(tmp_path), "--out", str(tmp_path / "a" / "b")])
    assert not (tmp_path / "a").exists()
