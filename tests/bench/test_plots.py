import json
import subprocess
import sys

import pytest

from specter.bench import plots
from specter.bench.__main__ import plot
from specter.bench.plots import plot_all

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NAMES = ("tokens", "ratio-heatmap", "hit-rate", "io-wait", "acceptance-k", "roofline")


def _check_png(path):
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 300, (path, pixels.shape)
    assert pixels.std() > 0, path


def test_import_is_cheap():
    code = "import sys, specter.bench.plots, specter.bench.tables; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_plot_all_writes_every_figure(bench, tmp_path):
    paths = plot_all(bench, tmp_path / "figs", stem="run")
    assert [p.name for p in paths] == [f"run-{name}.png" for name in NAMES]
    for path in paths:
        _check_png(path)


def test_default_stem_comes_from_title(bench, tmp_path):
    bench["title"] = "bench proxy/v2"
    paths = plot_all(bench, tmp_path)
    assert paths[0].name == "bench-proxy-v2-tokens.png"


def test_titles_state_model_threads_and_emulation(bench):
    title = plots._title(bench, "decode tokens/s")
    assert "mixtral" in title and "1 thread" in title and "(emulated link)" in title
    bench["links"]["fast"]["emulated"] = False
    assert "(emulated link: slow)" in plots._title(bench, "x")
    bench["links"]["slow"]["emulated"] = False
    assert "emulated" not in plots._title(bench, "x")


def test_best_specter_row_per_cell(bench):
    best = plots._best_specter(bench["rows"])
    assert len(best) == 2 * 2 * 2
    assert {row["label"] for row in best.values()} == {"specter k=4"}


def test_plot_writes_next_to_out_dir(bench, tmp_path, capsys):
    source = tmp_path / "in" / "bench-1.json"
    source.parent.mkdir()
    source.write_text(json.dumps(bench))
    out = tmp_path / "out"
    assert plot([str(source), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / f"bench-1-{name}.png") for name in NAMES]
    for path in out.iterdir():
        _check_png(path)


def test_plot_defaults_to_json_folder_and_accepts_plot_prefix(bench, tmp_path, capsys):
    source = tmp_path / "b.json"
    source.write_text(json.dumps(bench))
    assert plot(["plot", str(source)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == sorted(f"b-{name}.png" for name in NAMES)


def test_plot_rejects_bad_input(tmp_path, capsys):
    assert plot([str(tmp_path / "missing.json")]) == 2
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"schema": "specter.bench/1"}))
    assert plot([str(wrong)]) == 2
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"schema": "specter.bench/2", "rows": []}))
    assert plot([str(empty)]) == 1
    assert "not a specter.bench/2 document" in capsys.readouterr().err


def test_sparse_bench_does_not_crash(sparse_bench, tmp_path):
    paths = plot_all(sparse_bench, tmp_path)
    names = [p.name.removeprefix("bench-proxy-").removesuffix(".png") for p in paths]
    assert names == ["tokens", "ratio-heatmap", "hit-rate", "acceptance-k"]
    for path in paths:
        _check_png(path)


@pytest.mark.parametrize("variant", ["nulls", "no-histogram", "one-link", "one-budget", "eager-only",
                                     "no-specter", "no-links"])
def test_missing_optional_figures(bench, tmp_path, variant):
    rows = bench["rows"]
    if variant == "nulls":
        for row in rows[::2]:
            for key in ("hit_rate", "io_wait_share", "acceptance_rate", "k_mean", "k", "ratios", "decode_tokens_per_s"):
                row[key] = None
    elif variant == "no-histogram":
        for row in rows:
            row.pop("k_histogram", None)
    elif variant == "one-link":
        bench["links"].pop("slow")
        bench["rows"] = [r for r in rows if r["link"] != "slow"]
    elif variant == "one-budget":
        bench["budgets"] = [0.25]
        bench["rows"] = [r for r in rows if r["budget"] in (None, 0.25)]
    elif variant == "eager-only":
        bench["rows"] = [r for r in rows if not r["compile"]]
    elif variant == "no-specter":
        bench["rows"] = [r for r in rows if r["engine"] != "specter"]
    elif variant == "no-links":
        bench["links"] = {}
        bench["rows"] = [r for r in rows if r["link"] is None]
    paths = plot_all(bench, tmp_path)
    assert paths
    for path in paths:
        _check_png(path)
    names = {p.name for p in paths}
    if variant == "no-specter":
        assert "bench-proxy-acceptance-k.png" not in names and "bench-proxy-ratio-heatmap.png" not in names
        assert "bench-proxy-roofline.png" not in names
    else:
        assert "bench-proxy-tokens.png" in names


def test_roofline_panels_cap_at_eight_eager_first(bench):
    extra = [dict(r, budget=b) for b in (0.5, 0.75) for r in bench["rows"] if r["label"] == "specter roofline"]
    bench["rows"] += extra
    fig = plots._roofline_figure(bench)
    try:
        titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
        assert len(fig.axes) == 16 and len(titles) == 8
        assert sum("eager" in t for t in titles) == 6 and all("specter roofline (roofline)" in t for t in titles)
        assert "budget 25%, link slow, eager" in titles[0]
        starred = [line for line in fig.axes[0].get_lines() if line.get_label() == "most chosen k=3"]
        assert len(starred) == 1 and list(starred[0].get_xdata()) == [3]
    finally:
        plots._pyplot().close(fig)


def test_roofline_absent_without_tables(bench, tmp_path):
    for row in bench["rows"]:
        if row.get("governor_summary"):
            row["governor_summary"] = {"name": "fixed"}
    names = [p.name for p in plot_all(bench, tmp_path)]
    assert "bench-proxy-roofline.png" not in names and len(names) == len(NAMES) - 1


def test_roofline_tolerates_missing_fields(bench, tmp_path):
    summaries = [r["governor_summary"] for r in bench["rows"] if r["label"] == "specter roofline"]
    summaries[0].pop("trace")
    summaries[1]["trace"] = [None, 2, None]
    summaries[2]["table"][3]["predicted_tokens_per_s"] = None
    summaries[2]["table"][4].pop("k")
    bench["rows"][0]["governor_summary"] = None
    paths = plot_all(bench, tmp_path, stem="x")
    assert tmp_path / "x-roofline.png" in paths
    _check_png(tmp_path / "x-roofline.png")
