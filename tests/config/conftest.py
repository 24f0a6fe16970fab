"""Shared by the recipe tests: every test starts and ends with a clean plugin registry."""

from __future__ import annotations

import pytest

from specter.plugins import reset_plugins


@pytest.fixture(autouse=True)
def clean_plugins(monkeypatch):
    monkeypatch.delenv("SPECTER_PLUGINS", raising=False)
    reset_plugins()
    yield
    reset_plugins()
