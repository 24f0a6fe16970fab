"""The transformers version check: older releases are refused with the fix, not decoded wrongly."""

from __future__ import annotations

import sys

import pytest

import specter
from specter.errors import SpecterError
from specter.model.compat import MIN_TRANSFORMERS, require_supported_transformers


def test_the_installed_transformers_passes() -> None:
    require_supported_transformers()


@pytest.mark.parametrize("version", ["5.24.0", "5.24.1.dev0", "5.30.2"])
def test_supported_releases_pass(version: str) -> None:
    require_supported_transformers(version)


@pytest.mark.parametrize("version", ["5.23.0", "5.17.0", "4.57.1", "6.0.0"])
def test_other_releases_are_refused_with_the_fix(version: str) -> None:
    wanted = ".".join(map(str, MIN_TRANSFORMERS))
    with pytest.raises(SpecterError, match=rf"transformers {version} is installed.*pip install 'transformers>={wanted},<6'"):
        require_supported_transformers(version)


def test_load_and_offload_refuse_an_old_transformers_before_touching_anything(monkeypatch, tiny_mixtral) -> None:
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.17.0")  # the module compat imports
    with pytest.raises(SpecterError, match="transformers 5.17.0 is installed"):
        specter.load({"model": str(tiny_mixtral), "engine": "resident"})
    with pytest.raises(SpecterError, match="transformers 5.17.0 is installed"):
        specter.offload(object(), expert_budget=0.5)
