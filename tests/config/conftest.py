"""Shared by the recipe tests: every test starts and ends with a clean plugin registry."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _fresh_registry(clean_plugins) -> None:
    """Every recipe test runs with ``clean_plugins`` (tests/conftest.py)."""
