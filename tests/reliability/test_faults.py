"""Injected faults in the data path: every case ends with exit 2 and one line naming the plugin,
or decodes on losslessly (the tokens of ``resident``), never hangs."""

from __future__ import annotations

import time

import pytest

import specter
from specter.errors import SpecterError

PROMPTS = [[1, 17, 93, 4, 250, 31, 8, 66, 140, 7]]
MAX_NEW = 12


def recipe(checkpoint, engine="specter", link=None, **sections) -> dict:
    offload = {"expert_budget": 0.25, "link": link or {"kind": "local"}, "transfer_timeout_s": 0.5}
    offload.update(sections.pop("offload", {}))
    data = {"model": str(checkpoint), "engine": engine, "max_new_tokens": MAX_NEW, "threads": 1,
            "offload": offload, "speculation": {"governor": {"k": 3}}, "prompts": ["unused"]}
    data.update(sections)
    return data


@pytest.fixture(scope="module")
def reference(tiny_mixtral) -> list[list[int]]:
    engine = specter.load(recipe(tiny_mixtral, "resident"))
    tokens = engine.generate(PROMPTS).token_ids
    engine.close()
    return tokens


def generate(data) -> tuple[list[list[int]], dict, object]:
    engine = specter.load(data)
    try:
        result = engine.generate(PROMPTS)
    finally:
        engine.close()
    return result.token_ids, result.report, engine


@pytest.mark.parametrize("kind", ["test-stall", "test-stall-blind"])
@pytest.mark.parametrize("engine", ["ondemand", "specter"])
def test_a_stalled_link_ends_the_run_within_its_deadline(tiny_mixtral, kind, engine):
    started = time.perf_counter()
    with pytest.raises(SpecterError, match=rf"offload.transfer_timeout_s: the copy of expert \(\d+, \d+\) over link "
                                           rf"'{kind}' did not complete within 0.5 s; the link is stalled"):
        generate(recipe(tiny_mixtral, engine, link={"kind": kind}))
    assert time.perf_counter() - started < 10


def test_a_link_whose_submit_raises_is_one_line_naming_it(tiny_mixtral, tmp_path, cli):
    path = tmp_path / "r.yaml"
    import yaml

    path.write_text(yaml.safe_dump(recipe(tiny_mixtral, "ondemand", link={"kind": "test-submit-fails"})))
    code, _, err = cli(str(path), "--quiet")
    assert code == 2 and len(err) == 1
    assert err[0].startswith("error: offload.link.kind: link 'test-submit-fails' failed to start the copy of expert")
    assert "OSError: device unplugged" in err[0]


@pytest.mark.parametrize("engine", ["ondemand", "specter"])
def test_failed_copies_are_reloaded_once_and_decoding_stays_lossless(tiny_mixtral, reference, engine):
    with pytest.warns(RuntimeWarning, match="link 'test-flaky' failed copying expert .*DMA error; reloaded it"):
        tokens, report, _ = generate(recipe(tiny_mixtral, engine, link={"kind": "test-flaky"}))
    assert tokens == reference
    assert report["cache"]["decode"]["reloads"] + report["cache"]["prefill"]["reloads"] > 0


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_corrupting_link_is_caught_by_verify_copies_also_when_sampling(tiny_mixtral, temperature):
    sampling = {"temperature": temperature, "top_p": 0.95}
    clean, _, _ = generate(recipe(tiny_mixtral, "ondemand", sampling=sampling))
    with pytest.warns(RuntimeWarning, match="arrived wrong over link 'test-corrupt' \\(checksum mismatch\\)"):
        tokens, report, _ = generate(recipe(tiny_mixtral, "ondemand", link={"kind": "test-corrupt"},
                                            sampling=sampling, offload={"verify_copies": True}))
    assert tokens == clean
    assert report["cache"]["decode"]["reloads"] > 0


def test_without_verify_copies_a_corrupting_link_changes_the_tokens(tiny_mixtral, reference, monkeypatch):
    monkeypatch.setenv("SPECTER_VERIFY_COPIES", "0")
    tokens, _, _ = generate(recipe(tiny_mixtral, "ondemand", link={"kind": "test-corrupt"}))
    assert tokens != reference  # what verify_copies exists to catch


@pytest.mark.parametrize("predictor", ["test-explode", "test-out-of-range"])
def test_a_failing_predictor_is_switched_off_with_one_warning_and_decoding_stays_lossless(
        tiny_mixtral, reference, predictor):
    with pytest.warns(RuntimeWarning, match=f"predictor '{predictor}' raised .*prediction is off") as caught:
        tokens, report, _ = generate(recipe(tiny_mixtral, "specter",
                                            speculation={"predictor": {"name": predictor}, "governor": {"k": 3}}))
    assert len([w for w in caught if "prediction is off" in str(w.message)]) == 1
    assert tokens == reference
    assert report["prediction"]["disabled"].startswith(f"predictor '{predictor}' raised")


@pytest.mark.parametrize("section, expected", [
    ({"offload": {"cache_policy": {"name": "test-explode"}, "expert_budget": {"experts": 2}}},
     "error: offload.cache_policy.name: cache_policy plugin 'test-explode' raised KeyError in choose_victim(): "),
    ({"speculation": {"governor": {"name": "test-explode", "k": 2}}},
     "error: speculation.governor.name: governor plugin 'test-explode' raised ZeroDivisionError in observe(): "
     "governor bug"),
])
def test_a_plugin_that_raises_while_decoding_is_one_line_naming_it(tiny_mixtral, tmp_path, cli, section, expected):
    import yaml

    data = recipe(tiny_mixtral, "specter")
    for name, value in section.items():
        data[name] = {**data.get(name, {}), **value}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    code, _, err = cli(str(path), "--quiet")
    assert code == 2 and len(err) == 1 and err[0].startswith(expected)
    code, _, err = cli(str(path), "--quiet", "--debug")
    assert code == 2 and any("Traceback" in line for line in err)
