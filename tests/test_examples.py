"""The example third-party plugin package (examples/specter-example-plugins) as a stranger would
use it, without pip-installing it into the environment.

In process, the package's source directory goes on ``sys.path`` and ``importlib.metadata``
answers with the entry points its own pyproject.toml declares, so the registry loads it exactly as
it would an installed distribution. The ``specter`` engine then runs greedy with the example cache
policy, link, predictor and governor and must produce the ``resident`` engine's tokens, each
plugin showing through its counters that it ran; so must the example engine. In a subprocess,
``python -m specter.run --list-plugins`` sees the example through a ``.dist-info`` directory on
``PYTHONPATH`` next to two broken distributions (one re-registering the built-in governor
``fixed``, one registering an invalid name): it exits 0, lists the example's plugins and names the
two disabled ones under "skipped:".
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch

import specter
from specter.errors import SpecterError
from specter.plugins import registry, reset_plugins

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "specter-example-plugins"
SRC = EXAMPLE / "src"
PLUGINS = {"cache_policy": "example-fifo", "link": "example-counting", "predictor": "example-previous",
           "governor": "example-greedy-k", "engine": "example-warm"}
PROMPTS = [[1, 17, 93, 4, 250, 31, 8, 66, 140, 7, 201, 55, 3, 9, 120, 44], [1, 200, 5, 77, 12]]
MAX_NEW = 16


def example_project() -> dict:
    return tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]


class DistEntryPoint:
    """A real ``importlib.metadata.EntryPoint`` with the ``dist`` an installed one would carry."""

    def __init__(self, name: str, value: str, dist_name: str) -> None:
        self._entry_point = importlib.metadata.EntryPoint(name=name, value=value, group="specter")
        self.name, self.value, self.group = name, value, "specter"
        self.dist = types.SimpleNamespace(name=dist_name)

    def load(self):
        return self._entry_point.load()


@pytest.fixture
def example_plugins(monkeypatch):
    """The example package registered through its entry points, as if installed."""
    project = example_project()
    entry_points = [DistEntryPoint(name, value, project["name"])
                    for name, value in project["entry-points"]["specter"].items()]
    real_entry_points = importlib.metadata.entry_points

    def fake_entry_points(**kwargs):
        if kwargs.get("group") == "specter":
            return list(entry_points)
        return real_entry_points(**kwargs)

    monkeypatch.delenv("SPECTER_PLUGINS", raising=False)
    monkeypatch.syspath_prepend(str(SRC))
    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    reset_plugins()
    yield entry_points
    reset_plugins()  # the next registry() sees the real entry points again


def test_example_plugins_register_through_their_entry_point(example_plugins):
    source = f"specter-example-plugins (entry point {example_plugins[0].name})"
    for kind, name in PLUGINS.items():
        assert name in registry().names(kind)
        assert registry().source(kind, name) == source
    assert registry().skipped == []


def test_example_plugin_options_are_checked(example_plugins):
    policy = registry().create("cache_policy", "example-fifo", {"skip_hinted": True}, key="offload.cache_policy")
    assert policy.skip_hinted is True
    with pytest.raises(SpecterError, match="unknown option 'skip_hinteed'.*accepted options: skip_hinted"):
        registry().create("cache_policy", "example-fifo", {"skip_hinteed": True}, key="offload.cache_policy")
    with pytest.raises(SpecterError, match="rejected its options: threshold must be"):
        registry().create("governor", "example-greedy-k", {"threshold": 2}, k=4, n_experts=16, top_k=2)
    with pytest.raises(SpecterError, match="set by the engine"):
        registry().create("governor", "example-greedy-k", {"k": 2}, k=4, n_experts=16, top_k=2)


def recipe(path: Path, engine: str) -> dict:
    return {
        "model": str(path), "engine": engine, "device": "cpu", "dtype": "float32", "threads": 1,
        "max_new_tokens": MAX_NEW,
        "offload": {"expert_budget": 0.25,
                    "link": {"kind": "example-counting", "options": {"verify": True}},
                    "cache_policy": {"name": "example-fifo", "options": {"skip_hinted": True}}},
        "speculation": {"predictor": {"name": "example-previous", "options": {"confidence": 0.6}},
                        "governor": {"name": "example-greedy-k", "k": 2,
                                     "options": {"threshold": 0.5, "k_max": 4}}},
    }


def test_every_example_plugin_runs_and_is_lossless(example_plugins, tiny_mixtral):
    from specter_example_plugins import CountingLink, FifoPolicy, GreedyKGovernor, PreviousTokenPredictor

    with specter.load(recipe(tiny_mixtral, "resident")) as resident:
        expected = resident.generate(PROMPTS).token_ids
    with specter.load(recipe(tiny_mixtral, "specter")) as engine:
        result = engine.generate(PROMPTS)
    report = result.report
    assert result.token_ids == expected

    policy, link, predictor, governor = engine.cache.policy, engine.link, engine.predictor, engine.governor
    assert isinstance(policy, FifoPolicy) and policy.skip_hinted
    assert policy.inserted > 0 and policy.victims_chosen > 0 and policy.evicted > 0

    assert isinstance(link, CountingLink) and link.verify and link.device == torch.device("cpu")
    assert link.transfers > 0 and link.bytes_moved == report["bytes_transferred"] and link.closed
    assert report["link"]["kind"] == "example-counting" and report["link"]["transfers"] == link.transfers

    assert isinstance(predictor, PreviousTokenPredictor) and predictor.confidence == 0.6
    assert predictor.top_k == 2  # the context keyword the engine offered
    assert predictor.resets == len(PROMPTS) and predictor.observed > 0 and predictor.predicted > 0
    assert report["prediction"]["predictor"] == "example-previous"

    assert isinstance(governor, GreedyKGovernor) and governor.k_max == 4
    assert governor.rounds == len(governor.trace) > 0 and max(governor.trace) <= 4
    assert report["governor"]["name"] == "example-greedy-k"
    assert report["governor"]["rounds"] == governor.rounds

    from specter_example_plugins.warm_engine import WarmEngine

    warm = specter.load(recipe(tiny_mixtral, "example-warm"))
    try:
        assert warm.generate(PROMPTS).token_ids == expected
    finally:
        warm.close()
    assert isinstance(warm, WarmEngine) and isinstance(warm.cache.policy, FifoPolicy)
    assert len(warm.preloaded) == warm.cache.n_slots - warm.cache.n_slots % len(warm.layers) > 0


CLASH_PLUGIN = '''
from specter.hookspecs import hookimpl


class Policy:
    pass


@hookimpl
def register_cache_policies(register):
    register("clash-policy", Policy)   # fine on its own, disabled with the rest of the plugin


@hookimpl
def register_governors(register):
    register("fixed", Policy)          # the built-in governor's name: a clash
'''

BAD_NAME_PLUGIN = '''
from specter.hookspecs import hookimpl


@hookimpl
def register_links(register):
    register("Bad Link", object)       # not lowercase: an invalid name
'''


def write_dist(site: Path, dist: str, entry_points: dict[str, str]) -> None:
    """The two files importlib.metadata needs to see an installed distribution on ``sys.path``."""
    info = site / f"{dist.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[specter]\n{lines}")


def test_list_plugins_survives_a_clashing_plugin(tmp_path):
    project = example_project()
    site = tmp_path / "site"
    site.mkdir()
    write_dist(site, project["name"], project["entry-points"]["specter"])
    write_dist(site, "specter-clash", {"clash": "specter_clash_plugin"})
    (site / "specter_clash_plugin.py").write_text(CLASH_PLUGIN)
    write_dist(site, "specter-bad-name", {"bad_name": "specter_bad_name_plugin"})
    (site / "specter_bad_name_plugin.py").write_text(BAD_NAME_PLUGIN)
    env = {key: value for key, value in os.environ.items() if key != "SPECTER_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(SRC), env.get("PYTHONPATH")]))

    done = subprocess.run([sys.executable, "-m", "specter.run", "--list-plugins"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    listing, _, skipped = done.stdout.partition("\nskipped:\n")
    for name in PLUGINS.values():  # names are padded to the longest of their kind
        assert re.search(rf"^  {name} +specter-example-plugins \(entry point example_plugins\)$", listing, re.M)
    assert "clash-policy" not in listing and "Bad Link" not in listing
    assert "builtin (specter.decode.governors)" in listing  # fixed stays the built-in
    skipped_lines = skipped.splitlines()  # other installed plugins may add lines of their own
    assert not any("specter-example-plugins" in line for line in skipped_lines)
    clash = next(line for line in skipped_lines if "specter-clash" in line)
    assert "disabled plugin" in clash and "governor 'fixed' is registered twice" in clash
    bad = next(line for line in skipped_lines if "specter-bad-name" in line)
    assert "disabled plugin" in bad and "'Bad Link'" in bad
