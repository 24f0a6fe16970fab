"""Every script in scripts/ answers a bad argument the way argparse does: exit status 2, a usage
line and one ``SCRIPT: error: ...`` line on stderr, no traceback, before any heavy work; a recipe
that cannot be read is one such line too. The scripts' ``main(argv)`` runs in process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_modules: dict[str, object] = {}


def script(name: str):
    if name not in _modules:
        spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), ROOT / "scripts" / name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _modules[name] = module
    return _modules[name]


BAD = [
    ("acceptance_estimate_sim.py", ["--bogus"], "unrecognized arguments: --bogus"),
    ("acceptance_estimate_sim.py", ["--seeds", "0"], "--seeds must be at least 1"),
    ("bench_expert_kernel.py", ["--slots", "1"], "--slots must be at least 2"),
    ("bench_expert_kernel.py", ["--threads", "0"], "--threads must be at least 1"),
    ("blocked_rows_bench.py", ["--rows", "1,0"], "every value must be at least 1"),
    ("blocked_rows_bench.py", ["--calls", "0"], "--calls must be at least 1"),
    ("cache_replay.py", ["--slots", "0"], "every value must be at least 1"),
    ("cache_replay.py", ["--widths", "x"], "not a comma-separated list of whole numbers"),
    ("copy_contention.py", ["--repeats", "0"], "--repeats must be at least 1"),
    ("copy_contention.py", ["--paced-gbps", "0"], "must be above 0"),
    ("fresh_expert_reads.py", ["--gbps", "0"], "--gbps must be above 0"),
    ("fresh_expert_reads.py", ["--rows", "0"], "--rows must be at least 1"),
    ("governor_noise_sim.py", ["--seeds", "0"], "--seeds must be at least 1"),
    ("gpu_bench.py", ["--tokens", "1"], "--tokens must be at least 2"),
    ("gpu_bench.py", ["--budget", "0"], "--budget must be a fraction in (0, 1]"),
    ("int4_kernels.py", ["--weights", "0"], "--weights must be at least 1"),
    ("memory_placement.py", ["--buffers", "0"], "--buffers must be at least 1"),
    ("memory_placement.py", ["--repeats", "0"], "--repeats must be at least 1"),
    ("round_parts.py", ["--repeats", "0"], "--repeats must be at least 1"),
    ("round_parts.py", ["recipes/bench-bundled.yaml", "--link", "local"],
     "--link 'local' is not one of recipes/bench-bundled.yaml's links: slow, fast"),
    ("verify_beside_copies.py", ["--repeats", "0"], "--repeats must be at least 1"),
    ("wave_bookkeeping.py", ["--rows", "0"], "--rows must be at least 1"),
    ("wave_bookkeeping.py", ["--repeats", "5"], "--repeats must be more than 10"),
]
RECIPE_SCRIPTS = ["cache_replay.py", "draft_step_parts.py", "round_parts.py", "verify_beside_copies.py"]


def check_one_line_error(name: str, argv: list[str], expected: str, capsys, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [name])  # argparse's prog, as when run from the shell
    with pytest.raises(SystemExit) as exit_info:
        script(name).main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{name}: error: ") and expected in last, err


@pytest.mark.parametrize(("name", "argv", "expected"), BAD, ids=[f"{n}{' '.join(a)}" for n, a, _ in BAD])
def test_a_bad_argument_is_one_line_and_status_2(name, argv, expected, capsys, monkeypatch) -> None:
    check_one_line_error(name, argv, expected, capsys, monkeypatch)


@pytest.mark.parametrize("name", RECIPE_SCRIPTS)
def test_a_missing_recipe_is_one_line_and_status_2(name, capsys, monkeypatch) -> None:
    check_one_line_error(name, ["no-such-recipe.yaml"], "recipe: no such file: no-such-recipe.yaml", capsys, monkeypatch)


@pytest.mark.parametrize("name", ["cache_replay.py", "draft_step_parts.py"])
def test_a_recipe_given_runs_as_written_and_the_default_keeps_its_settings_under_set(name, monkeypatch, capsys) -> None:
    """The bench-proxy settings (the widened model) are the default recipe's, not laid over a
    recipe the user names; ``--set`` adds to them rather than dropping them."""
    from specter.errors import SpecterError

    module = script(name)
    loads = []

    def load(recipe, overrides):
        loads.append((recipe, overrides))
        raise SpecterError("stop")

    monkeypatch.setattr(module, "load", load)
    monkeypatch.chdir(ROOT)
    for argv in (["recipes/quickstart.yaml", "--set", "max_prompts=2"], ["--set", "max_prompts=2"]):
        with pytest.raises(SystemExit):
            module.main(argv)
    (named, named_overrides), (default, default_overrides) = loads
    assert named == "recipes/quickstart.yaml" and not any(o.startswith("model=") for o in named_overrides)
    assert "max_prompts=2" in named_overrides
    assert default == "recipes/specter.yaml" and "model=bundled:tiny-moe-x16" in default_overrides
    assert "max_prompts=2" in default_overrides
