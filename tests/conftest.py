"""Fixtures shared across the test tree: tiny random checkpoints of real MoE layouts (no
downloaded weights), one thread for every test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specter.zoo import save_byte_tokenizer, save_random_checkpoint

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory) -> Path:
    """A 4-layer, 16-expert top-2 random Mixtral (hidden 64) with a byte-level tokenizer."""
    path = save_random_checkpoint("mixtral", tmp_path_factory.mktemp("zoo") / "mixtral4", seed=0, layers=4)
    save_byte_tokenizer(path)
    return path
