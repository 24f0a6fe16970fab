"""Budgets of every ``offload.expert_budget`` form through a bench: their labels, keys and shares
(``specter.bench.budgets``), the sweep's rows, the markdown tables and the plots."""

from __future__ import annotations

import json

import pytest

from specter.bench import budgets
from specter.bench import markdown_format as fmt
from specter.bench.plots import plot_all
from specter.bench.spec import load_bench
from specter.bench.sweep import Sweep
from specter.bench.tables import markdown

MODEL = {"n_moe_layers": 4, "n_experts": 16, "expert_bytes": 786432}  # the bundled tiny-moe: 0.75 MiB experts
FORMS = [0.25, {"per_layer": 8}, {"experts": 40}, "2MiB"]


@pytest.mark.parametrize("value, shown", [
    (0.25, "25%"), (1, "100%"), ({"per_layer": 8}, "8 per layer"), ({"experts": 40}, "40 experts"),
    ("2MiB", "2 MiB"), ("2097152", "2 MiB"), ("1.5GB", "1.5 GB"), ("1000000", "1 MB"), ("1234567", "1,234,567 B"),
    ("512 KiB", "512 KiB"), (None, "-"), ("nonsense", "nonsense"),
])
def test_a_budget_is_labelled_in_its_own_terms(value, shown):
    assert budgets.label(value) == shown


@pytest.mark.parametrize("value, shown", [(None, "-"), (0.25, "25%"), (0.125, "12.5%"), (1, "100%"), (0.07, "7%"),
                                          (0.0, "0%"), (0.0625, "6.25%")])
def test_a_fraction_is_a_percentage_without_trailing_zeros(value, shown):
    assert budgets.label(value) == shown


def test_keys_are_hashable_and_equal_for_equal_budgets():
    keys = {budgets.key(value) for value in FORMS + [{"per_layer": 8}]}
    assert len(keys) == len(FORMS)
    assert budgets.key(0.5) == 0.5 and budgets.key(None) is None


def test_share_is_the_part_of_all_experts_the_model_gets():
    assert budgets.share(0.25, None) == 0.25
    assert budgets.share({"per_layer": 8}, MODEL) == 0.5
    assert budgets.share({"experts": 40}, MODEL) == 40 / 64
    assert budgets.share("2MiB", MODEL) == 2 / 64  # two whole 0.75 MiB experts
    assert budgets.share({"per_layer": 8}, {}) is None and budgets.share("bad", MODEL) is None


def test_where_names_a_cell_of_any_budget():
    assert fmt.where({"budget": {"per_layer": 8}, "link": "slow"}) == "8 per layer / slow / eager"
    assert fmt.where({"budget": "2MiB", "link": "l", "compile": True}, mode=False) == "2 MiB / l"


def test_a_sweep_of_every_budget_form_loads_and_keeps_them_as_written():
    spec = load_bench({"title": "t", "run": {"model": "bundled:tiny-moe"}, "sweep": {"budgets": FORMS}})
    assert spec.budgets == tuple(FORMS) and spec.as_dict()["sweep"]["budgets"] == FORMS
    recipe = spec.cell_recipe("ondemand", {"per_layer": 8}, next(iter(spec.links)), False)
    assert (recipe.offload.expert_budget.kind, recipe.offload.expert_budget.value) == ("per_layer", 8)
    assert spec.cell_recipe("ondemand", "2MiB", None, False).offload.expert_budget.value == 2 * 2**20


class StandIn:
    """An engine stand-in for ``Sweep._build`` that decodes one token per prompt at 1 tok/s."""

    def __init__(self, name: str) -> None:
        self.name = name

    def generate(self, prompts, max_new_tokens=None):
        return None

    def generate_by_prompt(self, prompts):
        for index in range(len(prompts) - 1):
            yield index
        return type("Result", (), {"report": {"decode_tokens_per_s": 1.0}, "token_ids": [[1]]})()

    def close(self) -> None:
        pass


def test_the_sweep_runs_cells_of_mapping_and_byte_budgets(monkeypatch):
    spec = load_bench({"title": "t", "run": {"model": "bundled:tiny-moe", "prompts": ["a"]}, "sweep": {
        "engines": ["resident", "ondemand"], "budgets": [{"per_layer": 8}, "2MiB"], "links": {"l": {"kind": "local"}},
        "compile": [False], "repeats": 1, "warmup_tokens": 1}})
    sweep = Sweep(spec, progress=False)
    monkeypatch.setattr(sweep, "_build", lambda label, engine, *args, **kw: StandIn(engine))
    sweep.run()
    rows = sweep.rows()
    assert [(r["label"], r["budget"]) for r in rows if r["label"] == "ondemand"] == [
        ("ondemand", {"per_layer": 8}), ("ondemand", "2MiB")]
    assert all(r["ratios"]["resident"] == 1.0 for r in rows if r["label"] == "ondemand")
    json.dumps(rows)


@pytest.fixture
def formed_bench(bench: dict) -> dict:
    """The synthetic document with its 25% cells at {per_layer: 8} and its 50% cells at 2 MiB."""
    forms = {0.25: {"per_layer": 8}, 0.5: "24MiB"}
    bench["budgets"] = [forms[b] for b in bench["budgets"]]
    for row in bench["rows"]:
        row["budget"] = forms.get(row["budget"], row["budget"])
    return bench


def test_markdown_names_cells_of_any_budget(formed_bench):
    text = markdown(formed_bench)
    assert "### budget 8 per layer, link `slow`" in text and "### budget 24 MiB, link `fast`" in text
    assert "| hf-offload (budget 8 per layer) |" in text
    assert "| specter k=4 | 24 MiB | slow | eager |" in text  # where the time goes


def test_plots_draw_cells_of_any_budget(formed_bench, tmp_path):
    paths = plot_all(formed_bench, tmp_path)
    assert [p.name.removeprefix("bench-proxy-") for p in paths] == [
        "tokens.png", "ratio-heatmap.png", "hit-rate.png", "io-wait.png", "acceptance-k.png", "roofline.png"]
    formed_bench["model"] = {}  # no sizes to place the budgets by: they keep the document's order
    assert len(plot_all(formed_bench, tmp_path / "unsized")) == 6
