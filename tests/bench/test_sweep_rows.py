"""A sweep's rows from engines without a model (``fake_engines``): each budget's notes are its
own, and a run that timed no decode step leaves its figures null instead of failing the bench."""

from __future__ import annotations

from specter.bench.spec import SAME_MEMORY, load_bench

from fake_engines import fake_sweep


def spec(engines: list[str], budgets: list[float]):
    return load_bench({"title": "t", "run": {"prompts": ["a", "b"], "max_new_tokens": 4},
                       "sweep": {"engines": engines, "budgets": budgets, "links": {"l": {"kind": "local"}},
                                 "k": [4], "compile": [False], "repeats": 2, "warmup_tokens": 1}})


def test_each_budget_rows_carry_their_own_notes(monkeypatch):
    # the same-memory cache and the hf-offload bytes differ by budget; the last budget's note was
    # printed under every budget's table
    sweep = fake_sweep(spec(["ondemand", "specter", SAME_MEMORY, "hf-offload"], [0.25, 0.5]),
                       rate=lambda engine: 10.0, cache_bytes=lambda budget: int((budget or 0) * 100_000), monkeypatch=monkeypatch)
    sweep.run()
    notes = {(row["label"], row["budget"]): row["note"] for row in sweep.rows() if row["note"]}
    assert "(26,000 B)" in notes[(SAME_MEMORY, 0.25)] and "(51,000 B)" in notes[(SAME_MEMORY, 0.5)]
    assert "25,000 B" in notes[("hf-offload", 0.25)] and "50,000 B" in notes[("hf-offload", 0.5)]


def test_a_run_that_timed_no_decode_leaves_its_row_null_and_its_baselines_unratioed(monkeypatch):
    calls = []

    def rate(engine):  # ondemand's first run timed nothing (every prompt stopped at its first token)
        calls.append(engine.name)
        return None if engine.name == "ondemand" and calls.count("ondemand") == 1 else 10.0

    sweep = fake_sweep(spec(["ondemand", "specter"], [0.25]), rate, lambda budget: 1000, monkeypatch)
    sweep.run()
    rows = {row["label"]: row for row in sweep.rows()}
    assert rows["ondemand"]["decode_tokens_per_s"] == {"median": 10.0, "min": 10.0, "max": 10.0, "runs": [None, 10.0]}
    assert rows["specter k=4"]["ratios"]["ondemand"] == 1.0
    sweep = fake_sweep(spec(["ondemand", "specter"], [0.25]), lambda engine: None if engine.name == "ondemand" else 5.0,
                       lambda budget: 1000, monkeypatch)
    sweep.run()
    rows = {row["label"]: row for row in sweep.rows()}
    assert rows["ondemand"]["decode_tokens_per_s"]["median"] is None
    assert "ondemand" not in rows["specter k=4"]["ratios"]
