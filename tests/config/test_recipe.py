"""The recipe schema: defaults, every validation rule, overrides and plugin names; budgets are in
test_budget.py, the fuzzer in test_recipe_fuzz.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from specter.bundled import BUNDLED_MODELS
from specter.errors import RecipeError, SpecterError, UnknownPluginError
from specter.hookspecs import hookimpl
from specter.plugins import register_plugin, registry
from specter.config import ExpertBudget, Recipe, describe, load_recipe, recipe_keys
from specter.config.recipe import DEFAULT_PROMPTS


def error_of(source, overrides=(), **kwargs) -> str:
    with pytest.raises(SpecterError) as caught:
        load_recipe(source, overrides, **kwargs)
    message = str(caught.value)
    assert len(message.splitlines()) == 1
    return message


# ----------------------------------------------------------------------------- defaults


def test_defaults_load_from_empty_mapping_and_empty_file(tmp_path):
    recipe = load_recipe({})
    assert recipe.model == "bundled:tiny-moe"
    assert recipe.engine == "resident"
    assert recipe.max_new_tokens == 64
    assert recipe.offload.expert_budget == ExpertBudget("fraction", 0.5)
    assert recipe.offload.link.gbps == 2.0 and recipe.offload.link.kind == "auto"
    assert recipe.speculation.governor.k == 4 and recipe.speculation.draft.group_size == 64
    assert recipe.check_lossless is True and recipe.allow_pickle is False
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_recipe(empty) == recipe
    assert Recipe() == recipe


def test_to_dict_round_trips_and_is_plain_data():
    recipe = load_recipe(
        {"engine": "ondemand", "prompts": ["a", "b"], "offload": {"expert_budget": "2GiB"}}
    )
    plain = recipe.to_dict()
    assert plain["offload"]["expert_budget"] == str(2 * 2**30)
    assert json.loads(json.dumps(plain)) == plain
    assert load_recipe(plain) == recipe


def test_design_sketch_recipe_file_loads(tmp_path):
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "def f():"}\n\n{"prompt": "x = 1"}\n')
    path = tmp_path / "recipe.yaml"
    path.write_text(
        """
model: bundled:tiny-moe
engine: specter
device: auto
dtype: float32
threads: 1
seed: 0
prompts_file: prompts.jsonl
max_new_tokens: 64
sampling: {temperature: 0.0, top_p: 1.0}
offload:
  expert_budget: 0.5
  link: {kind: emulated, gbps: 0.5, latency_us: 50}
  cache_policy: {name: lru}
speculation:
  draft: {group_size: 64}
  predictor: {name: draft}
  governor: {name: fixed, k: 4}
compile: false
"""
    )
    recipe = load_recipe(path, check_plugins=False)
    assert recipe.source_dir == tmp_path.resolve()
    assert recipe.offload.link.latency_us == 50.0 and isinstance(recipe.offload.link.latency_us, float)
    assert recipe.resolved_prompts() == ["def f():", "x = 1"]


# ----------------------------------------------------------------------------- schema rules


def test_typo_key_suggests_the_close_match():
    message = error_of({"max_new_token": 3})
    assert message.startswith("max_new_token: unknown key; did you mean max_new_tokens?")
    assert "allowed keys:" in message and "max_new_tokens" in message


def test_nested_typo_key_names_the_full_path():
    message = error_of({"offload": {"linkk": {"kind": "emulated"}}})
    assert message.startswith("offload.linkk: unknown key; did you mean offload.link?")


@pytest.mark.parametrize(
    "raw, key, fragment",
    [
        ({"threads": True}, "threads", "expected an integer, got bool True"),
        ({"max_new_tokens": "64"}, "max_new_tokens", "expected an integer, got str '64'"),
        ({"max_new_tokens": 64.0}, "max_new_tokens", "expected an integer"),
        ({"compile": "yes"}, "compile", "expected a boolean"),
        ({"compile": 1}, "compile", "expected a boolean"),
        ({"prompt": 7}, "prompt", "quote it"),
        ({"prompts": "abc"}, "prompts", "expected a list of strings"),
        ({"prompts": ["a", 1]}, "prompts", "expected a list of strings"),
        ({"sampling": {"temperature": "hot"}}, "sampling.temperature", "expected a number"),
        ({"sampling": {"temperature": math.inf}}, "sampling.temperature", "finite"),
        ({"sampling": 3}, "sampling", "expected a mapping"),
        ({"offload": {"cache_policy": {"options": [1]}}}, "offload.cache_policy.options", "expected a mapping"),
        ({"speculation": {"governor": {"k": True}}}, "speculation.governor.k", "got bool True"),
    ],
)
def test_wrong_types_name_the_key(raw, key, fragment):
    message = error_of(raw)
    assert message.startswith(f"{key}: ")
    assert fragment in message and "allowed:" in message


def test_yaml_yes_is_a_bool_not_an_int(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("threads: yes\ncompile: yes\n")
    assert error_of(path).startswith("threads: expected an integer, got bool True")
    path.write_text("compile: yes\n")
    assert load_recipe(path).compile is True


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"threads": 0}, "threads"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_prompts": 0}, "max_prompts"),
        ({"seed": -1}, "seed"),
        ({"sampling": {"temperature": -0.1}}, "sampling.temperature"),
        ({"sampling": {"top_p": 0}}, "sampling.top_p"),
        ({"sampling": {"top_p": 1.5}}, "sampling.top_p"),
        ({"sampling": {"top_k": -1}}, "sampling.top_k"),
        ({"offload": {"link": {"gbps": 0}}}, "offload.link.gbps"),
        ({"offload": {"link": {"latency_us": -1}}}, "offload.link.latency_us"),
        ({"speculation": {"draft": {"group_size": 48}}}, "speculation.draft.group_size"),
        ({"speculation": {"governor": {"k": 0}}}, "speculation.governor.k"),
        ({"speculation": {"governor": {"k": 33}}}, "speculation.governor.k"),
        ({"prompt": ""}, "prompt"),
        ({"prompts": []}, "prompts"),
    ],
)
def test_out_of_range_values_show_value_and_allowed_range(raw, key):
    message = error_of(raw)
    assert message.startswith(f"{key}: invalid value ")
    assert "allowed:" in message


@pytest.mark.parametrize(
    "raw, fragment",
    [
        ({"engine": "spectre"}, "engine: unknown engine 'spectre'; did you mean specter? known: hf-offload, ondemand"),
        ({"dtype": "fp16"}, "dtype: invalid value 'fp16'"),
        ({"device": "cuda:x"}, "device: invalid value 'cuda:x'; allowed: auto, cpu, cuda, cuda:N"),
        ({"device": "gpu"}, "device: invalid value 'gpu'"),
    ],
)
def test_choices(raw, fragment):
    assert error_of(raw).startswith(fragment)


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_valid_devices(device):
    assert load_recipe({"device": device}).device == device


def test_auto_device_resolves_to_what_this_torch_sees():
    import torch

    from specter.build import resolve_device

    assert resolve_device(load_recipe({}).device) == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_model_must_be_bundled_or_a_directory(tmp_path):
    assert error_of({"model": "/x"}) == (
        "model: no such directory: /x; use a local Hugging Face checkpoint directory or "
        "bundled:NAME (tiny-moe, tiny-moe-x{m} (m a power of two, e.g. tiny-moe-x16))"
    )
    assert error_of({"model": "bundled:nope"}).startswith(
        "model: unknown bundled model 'nope'; allowed: bundled:NAME with NAME one of tiny-moe, tiny-moe-x{m}")
    assert load_recipe({"model": str(tmp_path)}).model_path() == tmp_path
    assert load_recipe({}).model_path() == BUNDLED_MODELS["tiny-moe"]


def test_relative_paths_resolve_against_the_recipe_directory(tmp_path, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "p.txt").write_text("one whole prompt\n")
    path = tmp_path / "r.yaml"
    path.write_text("model: ckpt\nprompts_file: p.txt\n")
    monkeypatch.chdir(tmp_path.parent)
    recipe = load_recipe(path)
    assert recipe.model_path() == tmp_path / "ckpt"
    assert recipe.resolved_prompts() == ["one whole prompt\n"]
    again = load_recipe(recipe, ["max_new_tokens=3"])
    assert again.source_dir == recipe.source_dir and again.max_new_tokens == 3
    assert again.resolved_prompts() == ["one whole prompt\n"]


def test_only_one_prompt_source():
    message = error_of({"prompt": "a", "prompts": ["b"]})
    assert message.startswith("prompts: set at most one of prompt, prompts, prompts_file; got prompt and prompts")


def test_missing_prompts_file():
    assert error_of({"prompts_file": "no/such/prompts.jsonl"}).startswith(
        "prompts_file: no such file: no/such/prompts.jsonl"
    )


def test_prompts_sources_and_max_prompts(tmp_path):
    assert load_recipe({}).resolved_prompts() == list(DEFAULT_PROMPTS)
    assert load_recipe({"max_prompts": 1}).resolved_prompts() == [DEFAULT_PROMPTS[0]]
    assert load_recipe({"prompt": "hi"}).resolved_prompts() == ["hi"]
    assert load_recipe({"prompts": ["a", "b", "c"], "max_prompts": 2}).resolved_prompts() == ["a", "b"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    with pytest.raises(RecipeError, match=r"^prompts_file: .*bad.jsonl:2: no string \"prompt\" field"):
        load_recipe({"prompts_file": str(bad)}).resolved_prompts()


def test_file_errors_are_one_line(tmp_path):
    assert error_of(tmp_path / "missing.yaml").startswith("recipe: no such file: ")
    broken = tmp_path / "broken.yaml"
    broken.write_text("engine: ondemand\noffload: {expert_budget: 0.5\nthreads: 2\n")
    message = error_of(broken)
    assert message.startswith("recipe: ") and "broken.yaml:" in message and "invalid YAML" in message
    listed = tmp_path / "list.yaml"
    listed.write_text("- engine: ondemand\n")
    assert error_of(listed).startswith("recipe: the top level must be a mapping of keys to values, got list")


def test_yaml_error_names_the_line(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("engine: ondemand\nthreads: 2\nsampling: [1, 2\n")
    with pytest.raises(yaml.YAMLError) as yaml_error:
        yaml.safe_load(path.read_text())
    line = yaml_error.value.problem_mark.line + 1
    assert f"r.yaml:{line}:" in error_of(path)


# ----------------------------------------------------------------------------- overrides


def test_overrides_are_parsed_as_yaml():
    recipe = load_recipe(
        {},
        [
            "offload.expert_budget=0.25",
            "compile=true",
            "prompts=[a, b]",
            "speculation.governor.k=8",
            "offload.cache_policy.name=lfu",
            "offload.cache_policy.options.history=true",
            "sampling.temperature=0",
        ],
    )
    assert recipe.offload.expert_budget == ExpertBudget("fraction", 0.25)
    assert recipe.compile is True
    assert recipe.prompts == ["a", "b"]
    assert recipe.speculation.governor.k == 8
    assert recipe.offload.cache_policy.options == {"history": True}
    assert recipe.sampling.temperature == 0.0
    gib = load_recipe({}, ["offload.expert_budget=2GiB"]).offload.expert_budget
    assert gib == ExpertBudget("bytes", 2 * 2**30)
    per_layer = load_recipe({"offload": {"expert_budget": 0.1}}, ["offload.expert_budget={per_layer: 8}"])
    assert per_layer.offload.expert_budget == ExpertBudget("per_layer", 8)


def test_overrides_replace_values_of_a_file_recipe(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("engine: ondemand\noffload:\n  link: {gbps: 1.0}\n")
    recipe = load_recipe(path, ["offload.link.gbps=4", "engine=resident"])
    assert recipe.offload.link.gbps == 4.0 and recipe.engine == "resident"


@pytest.mark.parametrize(
    "override, start",
    [
        ("max_new_token=3", "max_new_token: unknown key (in override 'max_new_token=3'); did you mean max_new_tokens?"),
        ("offload.lnk.gbps=3", "offload.lnk: unknown key"),
        ("compile", "compile: an override must look like dotted.key=value"),
        ("threads.x=1", "threads: takes a single value, not sub-keys"),
        ("threads=[1", "threads: cannot parse override value"),
        ("offload.expert_budget=-1", "offload.expert_budget: a number is a fraction"),
        ("offload.prefetch=eager", "offload.prefetch: "),
    ],
)
def test_bad_overrides_name_the_key(override, start):
    assert error_of({}, [override]).startswith(start)


# ----------------------------------------------------------------------------- plugins


class FakePlugins:
    """Recipe plugin names against the registry; registrations use names no built-in takes."""

    @hookimpl
    def register_cache_policies(self, register):
        register("test-recipe-policy", lambda **options: object())

    @hookimpl
    def register_links(self, register):
        register("test-recipe-link", lambda **options: object())

    @hookimpl
    def register_predictors(self, register):
        register("test-recipe-predictor", lambda **options: object())


def test_unknown_plugin_names_list_the_known_ones():
    message = error_of({"engine": "ondemand", "offload": {"cache_policy": {"name": "nope"}}})
    assert message.startswith("offload.cache_policy.name: unknown cache_policy 'nope'; known: ")
    for name in registry().names("cache_policy"):
        assert name in message


def test_unknown_governor_is_reported_for_the_specter_engine():
    register_plugin(FakePlugins())
    raw = {
        "engine": "specter",
        "offload": {"cache_policy": {"name": "test-recipe-policy"}, "link": {"kind": "test-recipe-link"}},
        "speculation": {"predictor": {"name": "test-recipe-predictor"}, "governor": {"name": "nope"}},
    }
    with pytest.raises(UnknownPluginError) as caught:
        load_recipe(raw)
    assert str(caught.value) == "speculation.governor.name: unknown governor 'nope'; known: fixed, roofline"
    raw["speculation"]["governor"]["name"] = "fixed"
    assert load_recipe(raw).speculation.governor.name == "fixed"


def test_every_plugin_name_is_checked_whichever_engine_runs():
    raw = {"engine": "resident", "offload": {"cache_policy": {"name": "nope"}}}
    with pytest.raises(UnknownPluginError, match="offload.cache_policy.name: unknown cache_policy 'nope'"):
        load_recipe(raw)
    with pytest.raises(UnknownPluginError, match="speculation.predictor.name: unknown predictor 'draf'; did you mean draft"):
        load_recipe({"engine": "resident", "speculation": {"predictor": {"name": "draf"}}})
    assert load_recipe(raw, check_plugins=False).engine == "resident"
    with pytest.raises(UnknownPluginError) as caught:
        load_recipe({"offload": {"link": {"kind": "emulatd"}}})
    assert str(caught.value) == ("offload.link.kind: unknown link 'emulatd'; did you mean emulated? "
                                 "known: auto, cuda, disk, emulated, local")  # auto is the engine's choice, listed too
    plugins = load_recipe({"engine": "specter"}, check_plugins=False).plugins_used()
    assert [choice.kind for choice in plugins] == ["engine", "cache_policy", "link", "predictor", "governor"]


def test_auto_link_is_left_to_the_engine():
    register_plugin(FakePlugins())
    raw = {"engine": "ondemand",
           "offload": {"cache_policy": {"name": "test-recipe-policy"}, "link": {"kind": "auto"}}}
    assert load_recipe(raw).offload.link.kind == "auto"


# ----------------------------------------------------------------------------- describe


def test_describe_lists_every_key_with_type_default_and_doc():
    text = describe()
    for key in recipe_keys():
        assert f"\n{key}: " in "\n" + text
    assert 'max_new_tokens: int = 64\n    tokens generated per prompt' in text
    assert "offload.expert_budget: float | {per_layer: int} | {experts: int} | str = 0.5" in text
    assert 'offload.link.kind: str = "auto"' in text


def test_schema_keeps_the_published_key_names():
    published = """model engine device dtype threads seed prompt prompts prompts_file max_prompts max_new_tokens
        sampling.temperature sampling.top_p sampling.top_k offload.expert_budget offload.link.kind
        offload.link.gbps offload.link.latency_us offload.link.options offload.cache_policy.name
        offload.cache_policy.options offload.prefetch offload.pin_memory offload.experts_on offload.host_budget offload.direct_io
        offload.transfer_timeout_s offload.verify_copies
        speculation.draft.bits speculation.draft.group_size speculation.predictor.name
        speculation.predictor.options speculation.governor.name speculation.governor.k
        speculation.governor.options compile huge_pages allow_pickle trust_remote_code check_lossless""".split()
    assert recipe_keys() == published


DESIGN_SKETCH = """
model: bundled:tiny-moe        # or a local Hugging Face checkpoint directory
engine: specter                # resident | ondemand | router-lookahead | specter | hf-offload
device: auto                   # cuda when present, else cpu
dtype: float32
threads: 1
seed: 0
prompts_file: recipes/prompts/eval.jsonl   # or prompt: / prompts:
max_new_tokens: 64
sampling: {temperature: 0.0, top_p: 1.0}
offload:
  expert_budget: 0.5           # fraction of all experts, {per_layer: 8}, or bytes "2GiB"
  link: {kind: emulated, gbps: 0.5, latency_us: 50}   # cuda | emulated | local
  cache_policy: {name: lru}
speculation:
  draft: {bits: 4, group_size: 64}
  predictor: {name: draft}     # draft | router-lookahead | ngram | none
  governor: {name: fixed, k: 4}   # fixed | roofline
compile: false
"""


def test_the_design_documents_recipe_sketch_loads_as_written(tmp_path, monkeypatch):
    """The sketch's names are ones programs outside the repository rely on (DESIGN.md)."""
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    path = tmp_path / "sketch.yaml"
    path.write_text(DESIGN_SKETCH)
    recipe = load_recipe(path, ["offload.expert_budget=0.25"])
    assert (recipe.speculation.draft.bits, recipe.offload.expert_budget.value, recipe.offload.link.gbps) == (4, 0.25, 0.5)
    with pytest.raises(SpecterError, match="speculation.draft.bits: invalid value 8; allowed: 4"):
        load_recipe(path, ["speculation.draft.bits=8"])




@pytest.mark.parametrize("name", ["quickstart", "specter", "offload-ondemand", "disk-tier"])
def test_every_run_recipe_in_the_repository_validates(name):
    from pathlib import Path

    recipe = load_recipe(Path(__file__).parents[2] / "recipes" / f"{name}.yaml")
    assert recipe.resolved_prompts()
    if name == "disk-tier":
        assert recipe.offload.experts_on == "disk" and recipe.offload.link.kind == "disk"
        assert recipe.check_lossless is False  # the check would load the whole model
