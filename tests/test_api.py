"""The public surfaces: ``specter.offload`` on a model the user loaded, ``specter.run_recipe`` with its
losslessness check, ``first_mismatch``, and the command line ``python -m specter.run``.

Zoo checkpoints ship no tokenizer, so the ones used with text prompts here get a byte-level
tokenizer of exactly their 256-token vocabulary, built offline. The quickstart test runs the
bundled ``tiny-moe`` (specter/data/tiny-moe, in the repository).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import specter
from specter.api import first_mismatch, run_recipe
from specter.errors import BudgetError, SpecterError, UnknownPluginError
from specter.model.layout import is_experts_module, moe_layers
from specter.testing.zoo import random_model, save_byte_tokenizer, save_random_checkpoint

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
PROMPT_IDS = torch.tensor([[1, 17, 93, 4, 250, 31, 8, 66, 140, 7]])
MAX_NEW = 10
TEXT_PROMPTS = ["def f(x):\n", "import os\n"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = save_random_checkpoint("mixtral", tmp_path_factory.mktemp("zoo") / "mixtral", seed=0)
    return str(save_byte_tokenizer(path))


def greedy(model) -> list[int]:
    out = model.generate(PROMPT_IDS, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
    return out[0, PROMPT_IDS.shape[1]:].tolist()


def expert_tensors(model) -> dict[tuple[int, str], torch.Tensor]:
    return {(m.layer, n): getattr(m.experts, n).detach().clone() for m in moe_layers(model) for n in m.param_names}


def expert_parameters(model) -> list[torch.Tensor]:
    """The own parameters of every routed-experts module (found without moe_layers, which needs them full)."""
    return [p for module in model.modules() if is_experts_module(module) for p in module.parameters(recurse=False)]


# ----------------------------------------------------------------------------- offload


def test_offload_keeps_the_users_generate_and_counts_hits_and_misses():
    model = random_model("mixtral", seed=0)
    before = greedy(model)
    originals = expert_tensors(model)
    implementation = model.config._experts_implementation
    handle = specter.offload(model, expert_budget=0.25, link="local")
    assert expert_parameters(model) and all(p.shape[0] == 0 for p in expert_parameters(model))
    assert greedy(model) == before
    stats = handle.stats
    assert stats.hits > 0 and stats.misses > 0
    assert stats.hits + stats.misses == stats.acquired_keys
    all_expert_bytes = sum(t.numel() * t.element_size() for t in originals.values())
    assert handle.cache.bytes <= 0.25 * all_expert_bytes
    assert handle.cache.capacity == int(0.25 * len(handle.store.layers) * handle.store.n_experts)

    handle.remove()
    # remove() restores the model's own experts implementation and detaches Specter's runtime ...
    assert model.config._experts_implementation == implementation
    assert not any(hasattr(module, "_specter_runtime") for module in model.modules())
    # ... and puts the experts back: the model is whole again and generates as before
    for (layer, name), tensor in originals.items():
        assert torch.equal(handle.store.stacked(layer)[name], tensor)
    assert all(p.shape[0] > 0 for p in expert_parameters(model))
    assert greedy(model) == before


def test_offload_with_an_emulated_link_and_another_policy():
    model = random_model("qwen2_moe", seed=1)
    before = greedy(model)
    handle = specter.offload(model, expert_budget={"per_layer": 4}, link={"kind": "emulated", "gbps": 5.0},
                             cache_policy="lfu")
    try:
        assert greedy(model) == before
        assert handle.link.emulated and handle.cache.policy.name == "lfu"
        assert handle.cache.capacity == 4 * len(handle.store.layers)
        assert handle.stats.transfer_wait_s > 0
    finally:
        handle.remove()


@pytest.mark.parametrize("kwargs, error, match", [
    ({"expert_budget": {"experts": 1}}, BudgetError, "offload.expert_budget"),
    ({"expert_budget": 0.01}, BudgetError, "offload.expert_budget"),
    ({"cache_policy": "nope"}, UnknownPluginError, "nope"),
    ({"link": "nope"}, UnknownPluginError, "nope"),
    ({"link": {"kind": "disk"}}, SpecterError, r"^link: 'disk' reads experts from a checkpoint on disk.*offload\(\) "
                                               r"copies from host memory: use auto, local, emulated or cuda$"),
])
def test_a_refused_offload_leaves_the_model_untouched(kwargs, error, match):
    model = random_model("mixtral", seed=0)
    before = greedy(model)
    originals = expert_tensors(model)
    with pytest.raises(error, match=match) as info:
        specter.offload(model, **{"expert_budget": 0.25, "link": "local", **kwargs})
    if error is BudgetError:
        assert "needs 2 experts" in str(info.value)
    assert all(torch.equal(t, originals[key]) for key, t in expert_tensors(model).items())
    assert greedy(model) == before


@pytest.mark.parametrize("model, kwargs, match", [
    ("model", {}, r"^model: expected a loaded transformers MoE model \(a torch.nn.Module"),
    (None, {"link": 5}, r"^link: expected a link name .* or a dict .*got int 5"),
    (None, {"link": None}, r"^link: expected a link name"),
])
def test_offload_refuses_a_wrong_argument_naming_it(model, kwargs, match):
    target = random_model("mixtral", seed=0) if model is None else model
    originals = expert_tensors(target) if model is None else None
    with pytest.raises(SpecterError, match=match):
        specter.offload(target, **{"expert_budget": 0.25, **kwargs})
    if originals is not None:
        assert all(torch.equal(t, originals[key]) for key, t in expert_tensors(target).items())


def test_offloading_an_offloaded_model_is_refused_and_points_at_remove():
    model = random_model("mixtral", seed=0)
    before = greedy(model)
    handle = specter.offload(model, expert_budget=0.25, link="local")
    with pytest.raises(SpecterError, match=r"^model: its experts are already offloaded by specter.*remove\(\)"):
        specter.offload(model, expert_budget=0.5, link="local")
    assert greedy(model) == before and handle.stats.acquired_keys > 0  # the first offload still serves
    handle.remove()
    again = specter.offload(model, expert_budget=0.5, link="local")  # after remove() it may be offloaded again
    assert greedy(model) == before
    again.remove()


def test_an_engines_model_cannot_be_offloaded_again(checkpoint):
    with specter.load(recipe(checkpoint, "ondemand")) as engine:
        with pytest.raises(SpecterError, match="already offloaded"):
            specter.offload(engine.model, link="local")


def test_remove_is_idempotent_and_a_stale_handle_leaves_a_newer_offload_alone():
    model = random_model("mixtral", seed=0)
    before = greedy(model)
    first = specter.offload(model, expert_budget=0.25, link="local")
    first.remove()
    first.remove()  # a second call does nothing
    assert first.removed and all(p.shape[0] > 0 for p in expert_parameters(model))
    assert greedy(model) == before
    second = specter.offload(model, expert_budget=0.25, link="local")
    first.remove()  # the stale handle must not undo the newer offload
    assert any(hasattr(module, "_specter_runtime") for module in model.modules())
    assert all(p.shape[0] == 0 for p in expert_parameters(model))
    assert greedy(model) == before and second.stats.acquired_keys > 0
    second.remove()
    assert greedy(model) == before


# ----------------------------------------------------------------------------- run_recipe


def recipe(path: str, engine: str, **extra) -> dict:
    data = {"model": path, "engine": engine, "prompts": TEXT_PROMPTS, "max_new_tokens": 8, "threads": 1,
            "offload": {"link": {"kind": "local"}, "expert_budget": 0.25}}
    data.update(extra)
    return data


def test_run_recipe_checks_losslessness_of_greedy_offloaded_runs(checkpoint):
    result = run_recipe(recipe(checkpoint, "ondemand"))
    report = result.report
    assert report["lossless"] is True and report["lossless_first_mismatch"] is None
    assert report["resident_decode_tokens_per_s"] > 0
    assert [len(ids) for ids in result.token_ids] == [8, 8]
    assert result.texts == [o["text"] for o in report["outputs"]] and all(result.texts)


def test_run_recipe_lossless_is_none_when_not_checked(checkpoint):
    assert run_recipe(recipe(checkpoint, "resident")).report["lossless"] is None
    sampled = run_recipe(recipe(checkpoint, "ondemand", sampling={"temperature": 0.8, "top_p": 0.9}))
    assert sampled.report["lossless"] is None
    assert run_recipe(recipe(checkpoint, "ondemand", check_lossless=False)).report["lossless"] is None


def test_run_recipe_reports_a_mismatch(checkpoint, monkeypatch):
    """Losslessness is computed from the tokens: a resident reference that differs flips it."""
    import specter.api as api

    real_build = api.build_engine

    def build(recipe_):
        engine = real_build(recipe_)
        if recipe_.engine == "resident":
            real_generate = engine.generate

            def generate(prompts, *args, **kwargs):
                result = real_generate(prompts, *args, **kwargs)
                result.token_ids[1][3] = (result.token_ids[1][3] + 1) % 256
                return result

            engine.generate = generate
        return engine

    monkeypatch.setattr(api, "build_engine", build)
    report = run_recipe(recipe(checkpoint, "ondemand")).report
    assert report["lossless"] is False
    mismatch = report["lossless_first_mismatch"]
    assert (mismatch["prompt"], mismatch["position"]) == (1, 3)
    assert mismatch["tokens"][0] != mismatch["tokens"][1]


def test_first_mismatch():
    assert first_mismatch([[1, 2, 3], [4]], [[1, 2, 3], [4]]) is None
    assert first_mismatch([], []) is None
    assert first_mismatch([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == {"prompt": 1, "position": 1, "tokens": [5, 6]}
    assert first_mismatch([[1, 9], [7]], [[1, 2], [8]]) == {"prompt": 0, "position": 1, "tokens": [9, 2]}
    assert first_mismatch([[1, 2], [3]], [[1, 2, 5], [4]]) == {"prompt": 0, "position": 2, "tokens": None}
    assert first_mismatch([[1, 2, 5]], [[1, 2]]) == {"prompt": 0, "position": 2, "tokens": None}


def test_load_applies_overrides(checkpoint):
    engine = specter.load(recipe(checkpoint, "resident"), ["engine=ondemand", "offload.expert_budget={experts: 4}"])
    try:
        assert engine.name == "ondemand" and engine.cache.capacity == 4
    finally:
        engine.close()


def test_load_takes_none_or_one_string_as_overrides_and_refuses_a_dict(checkpoint):
    for overrides in (None, (), "engine=resident"):
        with specter.load(recipe(checkpoint, "resident"), overrides=overrides) as engine:
            assert engine.name == "resident"
    assert specter.api.as_recipe(recipe(checkpoint, "ondemand"), None).engine == "ondemand"
    with pytest.raises(SpecterError, match=r"^overrides: expected a list of 'dotted.key=value' strings.*"
                                           r"\['engine=ondemand'\]"):
        specter.load(recipe(checkpoint, "resident"), overrides={"engine": "ondemand"})


# ----------------------------------------------------------------------------- command line


def cli(*args: str, cwd: Path = REPO) -> subprocess.Popen:
    env = dict(os.environ, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1", PYTHONIOENCODING="utf-8")
    return subprocess.Popen([sys.executable, "-m", "specter.run", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, encoding="utf-8", errors="replace")


BAD_OVERRIDES = {
    "typo": (["--set", "max_new_tokenz=8"], "max_new_tokenz"),
    "negative budget": (["--set", "offload.expert_budget=-0.5"], "offload.expert_budget"),
    "unknown plugin": (["--set", "engine=ondemand", "--set", "offload.cache_policy.name=nope"],
                       "offload.cache_policy.name"),
    "missing model": (["--set", "model=/nonexistent/dir"], "model"),
}


def assert_refused(returncode: int, stdout: str, stderr: str, key: str) -> None:
    assert returncode == 2, stderr
    assert "Traceback" not in stderr and "Traceback" not in stdout
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {key}"), stderr


def test_cli_process_refuses_a_bad_recipe_with_one_line_and_exit_code_2():
    args, key = BAD_OVERRIDES["typo"]
    process = cli("recipes/quickstart.yaml", *args)
    stdout, stderr = process.communicate(timeout=300)
    assert_refused(process.returncode, stdout, stderr, key)
    assert "did you mean max_new_tokens" in stderr


@pytest.mark.parametrize("case", list(BAD_OVERRIDES))
def test_cli_main_refuses_bad_recipes(case, capsys, monkeypatch):
    """The same entry point in this process (a new Python process per case costs seconds)."""
    from specter.run import main

    monkeypatch.chdir(REPO)
    args, key = BAD_OVERRIDES[case]
    returncode = main(["recipes/quickstart.yaml", *args])
    captured = capsys.readouterr()
    assert_refused(returncode, captured.out, captured.err, key)


def test_cli_runs_a_recipe_end_to_end(checkpoint, tmp_path):
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe(checkpoint, "specter", prompts=TEXT_PROMPTS[:1], max_new_tokens=6,
                                                 speculation={"governor": {"k": 3}})))
    report_path = tmp_path / "out" / "report.json"
    process = cli(str(recipe_path), "--report", str(report_path), "--quiet", cwd=tmp_path)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr
    report = json.loads(report_path.read_text())
    assert report["schema"] == "specter.report/1" and report["engine"] == "specter"
    assert report["model"]["arch"] == "mixtral"
    assert report["new_tokens"] == 6 and report["decode_tokens_per_s"] > 0
    assert report["lossless"] is True
    assert "=== prompt 1 ===" in stdout and "=== summary ===" in stdout
    assert report["outputs"][0]["text"] in stdout
    assert f"report written to {report_path}" in stdout


def test_cli_quickstart_with_the_bundled_model(tmp_path):
    report_path = tmp_path / "r.json"
    process = cli("recipes/quickstart.yaml", "--set", "max_new_tokens=8", "--set", "max_prompts=1",
                  "--report", str(report_path))
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr
    report = json.loads(report_path.read_text())
    for key in ("schema", "engine", "model", "new_tokens", "decode_tokens_per_s", "outputs"):
        assert key in report, key
    assert report["engine"] == "resident" and report["new_tokens"] == 8 and len(report["outputs"]) == 1
    assert report["decode_tokens_per_s"] > 0
    text = report["outputs"][0]["text"]
    assert text and text in stdout


def test_run_recipe_lets_the_engine_go_before_the_reference_loads(checkpoint, monkeypatch):
    """The offloaded engine (weights, cache slots, draft) is collected before the whole model loads
    for the lossless check, so the two never share the device's memory."""
    import weakref

    import specter.api as api

    real_build, built = api.build_engine, []

    def build(recipe_):
        if recipe_.engine == "resident":
            assert built and built[0]() is None, "the offloaded engine is still alive"
        engine = real_build(recipe_)
        built.append(weakref.ref(engine))
        return engine

    monkeypatch.setattr(api, "build_engine", build)
    assert run_recipe(recipe(checkpoint, "ondemand")).report["lossless"] is True
    assert len(built) == 2


def test_run_recipe_skips_the_check_where_the_whole_model_does_not_fit(checkpoint, monkeypatch):
    """A reference that runs out of device memory (CUDA's OutOfMemoryError) leaves the run's own
    result: lossless None, the reason in ``lossless_skipped`` and in a warning."""
    import specter.api as api

    real_build = api.build_engine

    def build(recipe_):
        if recipe_.engine == "resident":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_build(recipe_)

    monkeypatch.setattr(api, "build_engine", build)
    said: list[str] = []
    result = run_recipe(recipe(checkpoint, "ondemand"), progress=said.append)
    report = result.report
    assert report["lossless"] is None and [len(ids) for ids in result.token_ids] == [8, 8]
    assert report["lossless_skipped"].startswith("the resident reference did not fit on cpu: CUDA out of memory")
    assert any(line.startswith("warning: lossless check skipped: the resident reference did not fit") for line in said)


def test_offload_chooses_the_store_layout_for_the_device_that_computes(monkeypatch):
    """The store's layout (blocked or not) is chosen for the cache's device, where the experts are
    computed, not for wherever the experts sat (a model with its experts left on the CPU and the
    rest on a GPU must not get the CPU's blocked layout in its GPU slots)."""
    import specter.model.loader as loader

    real_split, seen = loader.split_experts, []

    def split(model, pin, device=None):
        seen.append(device)
        return real_split(model, pin, device=device)

    monkeypatch.setattr(loader, "split_experts", split)
    model = random_model("mixtral", seed=0)
    handle = specter.offload(model, expert_budget=0.5, link="local")
    assert seen == [handle.cache.device]
    handle.remove()
