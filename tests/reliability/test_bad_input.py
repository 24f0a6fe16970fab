"""Bad input through the command line: each case exits 2 with one line and no traceback, before
the work it would waste, and nothing hangs."""

from __future__ import annotations

import shutil
import time

import pytest
import yaml


def write(tmp_path, data: dict | str, name: str = "r.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


def base(checkpoint, **extra) -> dict:
    data = {"model": str(checkpoint), "engine": "ondemand", "max_new_tokens": 4, "threads": 1,
            "offload": {"link": {"kind": "local"}}, "prompt": "def f(x):"}
    data.update(extra)
    return data


def one_error_line(result, starts: str) -> None:
    code, _, err = result
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith(f"error: {starts}"), err


def test_prompt_longer_than_the_context_is_refused(tiny_mixtral, tmp_path, cli):
    one_error_line(cli(write(tmp_path, base(tiny_mixtral, prompt="x" * 5000)), "--quiet"), "prompt 1: 5000 tokens")


def test_a_huge_max_new_tokens_is_refused(tiny_mixtral, tmp_path, cli):
    result = cli(write(tmp_path, base(tiny_mixtral, max_new_tokens=1_000_000_000)), "--quiet")
    one_error_line(result, "prompt 1: ")
    assert "exceed the model's context length" in result[2][0]


@pytest.mark.parametrize("where", ["value", "options"])
def test_a_yaml_alias_bomb_is_refused_quickly(tmp_path, cli, where):
    levels = "\n".join(f"  l{i}: &l{i} [*l{i - 1}, *l{i - 1}, *l{i - 1}, *l{i - 1}, *l{i - 1}, *l{i - 1}, "
                       f"*l{i - 1}, *l{i - 1}, *l{i - 1}]" for i in range(1, 10))
    target = "prompts: *l9" if where == "value" else "offload: {cache_policy: {name: lru, options: {x: *l9}}}"
    text = f"bomb:\n  l0: &l0 [lol]\n{levels}\n{target}\n"
    started = time.perf_counter()
    code, _, err = cli(write(tmp_path, text), "--quiet")
    assert time.perf_counter() - started < 5
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ")


def test_deeply_nested_recipe_data_is_refused(tmp_path, cli):
    deep: list = []
    node = deep
    for _ in range(100):
        node.append([])
        node = node[0]
    one_error_line(cli(write(tmp_path, {"prompts": deep}), "--quiet"), "recipe: nested deeper than 32 levels")


@pytest.mark.parametrize("damage", ["truncate", "garbage-header", "empty"])
def test_a_corrupt_checkpoint_is_refused_naming_the_file(tiny_mixtral, tmp_path, cli, damage):
    copy = tmp_path / "ckpt"
    shutil.copytree(tiny_mixtral, copy)
    weights = next(copy.glob("*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes({"truncate": data[: len(data) // 2], "garbage-header": b"\xff" * 64,
                         "empty": b""}[damage])
    result = cli(write(tmp_path, base(copy)), "--quiet")
    one_error_line(result, f"model: {weights} is truncated or corrupt")


@pytest.mark.parametrize("key, value", [("offload.cache_policy.name", "nope"), ("speculation.predictor.name", "nope"),
                                        ("speculation.governor.name", "nope"), ("offload.link.kind", "nope")])
def test_unknown_plugins_exit_2_even_on_the_resident_engine(tiny_mixtral, tmp_path, cli, key, value):
    result = cli(write(tmp_path, base(tiny_mixtral, engine="resident")), "--quiet", "--set", f"{key}={value}")
    one_error_line(result, f"{key}: unknown ")


def test_an_unwritable_report_path_is_refused_before_the_run(tiny_mixtral, tmp_path, cli):
    blocker = tmp_path / "file"
    blocker.write_text("")
    started = time.perf_counter()
    result = cli(write(tmp_path, base(tiny_mixtral)), "--quiet", "--report", str(blocker / "r.json"))
    one_error_line(result, f"--report: cannot write {blocker / 'r.json'}")
    assert time.perf_counter() - started < 2  # no model was loaded


def test_a_directory_as_report_path_is_refused(tiny_mixtral, tmp_path, cli):
    one_error_line(cli(write(tmp_path, base(tiny_mixtral)), "--quiet", "--report", str(tmp_path)), "--report: ")
