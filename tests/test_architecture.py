"""The package layering (import-linter contracts in pyproject.toml) holds, and the check can fail."""

from __future__ import annotations

import sys
from pathlib import Path


import importlinter.cli as importlinter_cli  # a test dependency: missing, the check fails rather than skips

REPO = Path(__file__).resolve().parents[1]


def lint(config: Path, path: Path, monkeypatch) -> int:
    monkeypatch.chdir(path)
    monkeypatch.syspath_prepend(str(path))
    return importlinter_cli.lint_imports(config_filename=str(config))


def test_the_contracts_in_pyproject_hold(monkeypatch):
    assert lint(REPO / "pyproject.toml", REPO, monkeypatch) == 0


def test_an_upward_import_breaks_a_layers_contract(tmp_path, monkeypatch):
    package = tmp_path / "layered"
    (package / "low").mkdir(parents=True)
    (package / "high").mkdir()
    (package / "__init__.py").write_text("")
    (package / "high" / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("import layered.high\n")  # the low layer reaches up
    config = tmp_path / "setup.toml"
    config.write_text('[tool.importlinter]\nroot_package = "layered"\n\n[[tool.importlinter.contracts]]\n'
                      'name = "layers"\ntype = "layers"\nlayers = ["layered.high", "layered.low"]\n')
    sys.modules.pop("layered", None)
    assert lint(config, tmp_path, monkeypatch) != 0
