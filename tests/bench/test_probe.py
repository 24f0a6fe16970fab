"""The quality probe: teacher-forced draft/target and router-lookahead agreement, and its CLI flag."""

from __future__ import annotations

import json

import pytest

import specter
from specter.errors import SpecterError
from specter.bench.probe import format_probe, probe, probe_texts, read_texts
from specter.config import load_recipe
from specter.run import main
from specter.testing.zoo import save_byte_tokenizer, save_random_checkpoint

TEXTS = [[1, 17, 93, 4, 250, 31, 8, 66, 140, 7, 201, 55, 3, 9, 120, 44] * 2, [1, 200, 5, 77, 12]]


def recipe(path: str, budget: float = 0.5, **extra) -> dict:
    return {"model": path, "engine": "specter", "threads": 1,
            "offload": {"link": {"kind": "local"}, "expert_budget": budget}, **extra}


class TargetExperts:
    """A stand-in draft that computes a layer's experts exactly as the target does."""

    def __init__(self, runtime, layer: int) -> None:
        self.runtime, self.layer = runtime, layer

    def forward(self, hidden, top_k_index, top_k_weights):
        module = self.runtime.layers[self.layer].experts
        return self.runtime._forward_from_slots(self.layer, module, hidden, top_k_index, top_k_weights)


def test_probe_reports_rates_for_every_moe_layer(zoo_mixtral):
    engine = specter.load(recipe(zoo_mixtral))
    observers = list(engine.runtime.observers)
    result = probe(engine, TEXTS, max_tokens_per_text=20)
    assert engine.runtime.observers == observers and engine.runtime.mode == "target"
    assert result["texts"] == 2 and result["positions"] == 20 + 5
    assert [entry["layer"] for entry in result["layers"]] == sorted(engine.runtime.layers)
    first, *rest = result["layers"]
    # the first MoE layer's input is the same in both passes, so its routing is too
    assert first["draft_exact"] == 1.0 and first["draft_recall"] == 1.0
    assert first["lookahead_exact"] is None and first["lookahead_recall"] is None
    for entry in rest:
        for name in ("draft_exact", "draft_recall", "lookahead_exact", "lookahead_recall"):
            assert 0.0 <= entry[name] <= 1.0
        assert entry["draft_exact"] <= entry["draft_recall"]
    for value in (result["draft_exact"], result["lookahead_recall"], result["next_token_agreement"],
                  result["sampled_acceptance"]["temperature_1"]):
        assert 0.0 <= value <= 1.0
    assert result["sampled_acceptance"]["recipe"] is None  # greedy recipe
    assert result["next_token_agreement"] > 0.5  # INT4, group 64, on a random model: close to the target
    json.dumps(result)
    table = format_probe(result)
    assert "lookahead recall" in table and "next-token agreement" in table
    engine.close()


@pytest.mark.parametrize("budget", [0.5, 0.1])  # 0.1: the target streams experts through 3 slots
def test_a_draft_that_is_the_target_agrees_exactly(zoo_mixtral, budget):
    engine = specter.load(recipe(zoo_mixtral, budget))
    engine.runtime.draft = {layer: TargetExperts(engine.runtime, layer) for layer in engine.runtime.layers}
    result = probe(engine, TEXTS)
    assert result["draft_exact"] == 1.0 and result["draft_recall"] == 1.0
    assert all(entry["draft_exact"] == 1.0 for entry in result["layers"])
    assert result["next_token_agreement"] == 1.0
    assert result["sampled_acceptance"]["temperature_1"] == pytest.approx(1.0, abs=1e-5)
    engine.close()


def test_sampling_recipe_reports_acceptance_under_its_own_temperature(zoo_mixtral):
    engine = specter.load(recipe(zoo_mixtral, sampling={"temperature": 0.7, "top_k": 20}))
    result = probe(engine, TEXTS[:1])
    assert 0.0 <= result["sampled_acceptance"]["recipe"] <= 1.0
    assert result["sampling"] == {"temperature": 0.7, "top_p": 1.0, "top_k": 20}
    engine.close()


def test_probe_needs_the_specter_engine(zoo_mixtral):
    engine = specter.load(recipe(zoo_mixtral) | {"engine": "ondemand"})
    with pytest.raises(SpecterError, match="engine: specter"):
        probe(engine, TEXTS)
    engine.close()
    with pytest.raises(SpecterError, match="engine: ondemand"):
        probe_texts(load_recipe(recipe(zoo_mixtral) | {"engine": "ondemand"}))


def test_read_texts(tmp_path):
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"text": "one"}\n\n{"prompt": "two"}\n')
    assert read_texts(jsonl) == ["one", "two"]
    plain = tmp_path / "t.txt"
    plain.write_text("a whole file\nis one text\n")
    assert read_texts(plain) == ["a whole file\nis one text\n"]
    (tmp_path / "bad.jsonl").write_text('{"other": 1}\n')
    with pytest.raises(SpecterError, match="bad.jsonl:1"):
        read_texts(tmp_path / "bad.jsonl")


def test_cli_probe_prints_the_table_and_reports_it(tmp_path, capsys):
    path = str(save_random_checkpoint("mixtral", tmp_path / "model", seed=1))
    save_byte_tokenizer(path)
    recipe_file = tmp_path / "r.json"  # JSON is YAML
    recipe_file.write_text(json.dumps(recipe(path, prompts=["abcabc"], max_new_tokens=4, check_lossless=False)))
    text_file = tmp_path / "probe.txt"
    text_file.write_text("the quick brown fox jumps over the lazy dog")
    report = tmp_path / "report.json"
    assert main([str(recipe_file), "--probe", str(text_file), "--report", str(report), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "=== probe ===" in out and "draft exact" in out
    probed = json.loads(report.read_text())["probe"]
    assert probed["texts"] == 1 and probed["positions"] == len("the quick brown fox jumps over the lazy dog")

    resident = tmp_path / "resident.json"
    resident.write_text(json.dumps(recipe(path) | {"engine": "resident"}))
    assert main([str(resident), "--probe", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--probe needs engine: specter" in err
