"""Fixtures shared across the test tree: tiny random checkpoints of real MoE layouts (no
downloaded weights), one thread for every test, expert copies checksummed on arrival."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specter.plugins import reset_plugins
from specter.testing.zoo import save_byte_tokenizer, save_random_checkpoint

torch.set_num_threads(1)
os.environ.setdefault("SPECTER_VERIFY_COPIES", "1")  # every engine the tests build checks its copies


class _BuiltOnFirstUse(dict):
    """Layout name -> the zoo's default random checkpoint of it (seed 0), saved on first lookup."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, arch: str) -> str:
        self[arch] = path = str(save_random_checkpoint(arch, self.root / arch, seed=0))
        return path


@pytest.fixture(scope="session")
def zoo_checkpoints(tmp_path_factory) -> dict[str, str]:
    """The zoo's default random checkpoint of every layout (2 MoE layers x 16 experts, top-2, hidden
    64, seed 0, no tokenizer), each built once for the whole session when a test first asks for it;
    tests read them, never write into them."""
    return _BuiltOnFirstUse(tmp_path_factory.mktemp("zoo"))


@pytest.fixture(scope="session")
def zoo_mixtral(zoo_checkpoints) -> str:
    """``zoo_checkpoints["mixtral"]``: for tests that only need some offloadable model."""
    return zoo_checkpoints["mixtral"]


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory) -> Path:
    """A 4-layer, 16-expert top-2 random Mixtral (hidden 64) with a byte-level tokenizer."""
    path = save_random_checkpoint("mixtral", tmp_path_factory.mktemp("zoo") / "mixtral4", seed=0, layers=4)
    save_byte_tokenizer(path)
    return path


def pytest_collection_modifyitems(config, items) -> None:
    """GPU-marked tests skip cleanly where this torch sees no CUDA device (``pytest -m gpu`` on a CPU
    machine reports them as skipped, not as failures)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def clean_plugins(monkeypatch):
    """A fresh plugin registry for the test, built from the built-ins and installed entry points
    (``SPECTER_PLUGINS`` unset), and a fresh one again after it. Modules that register plugins
    use it for every test (``pytestmark = pytest.mark.usefixtures("clean_plugins")``)."""
    monkeypatch.delenv("SPECTER_PLUGINS", raising=False)
    reset_plugins()
    yield
    reset_plugins()
