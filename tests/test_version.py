"""specter.version: one version, the package's, the installed distribution's and pyproject's
alike, and it is what reports carry."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import specter
from specter.version import __version__

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_the_version_is_pyprojects_and_the_installed_distributions():
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
    assert __version__ == declared == specter.__version__
    assert importlib.metadata.version("specter-moe") == declared  # the editable install is not stale
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)?", __version__)


def test_reports_carry_the_version():
    from specter.report.schema import versions

    assert versions()["specter"] == __version__
