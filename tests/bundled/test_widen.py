"""The widened benchmark model (``bundled:tiny-moe-x{m}``) is the bundled model's function: same
greedy tokens on the evaluation prompts, experts m times wider, built once into the cache dir."""

from __future__ import annotations

import json

import pytest
import torch

import specter
from specter.bundled import bundled_path, is_bundled
from specter.bundled.widen import parse_factor, widen_tensor
from specter.errors import RecipeError, SpecterError
from specter.config import load_recipe

FACTOR = 2  # small so the test stays fast; the function is preserved for any power of two


@pytest.fixture(scope="module")
def widened(tmp_path_factory):
    root = tmp_path_factory.mktemp("specter-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECTER_CACHE_DIR", str(root))
        yield bundled_path(f"tiny-moe-x{FACTOR}")


def test_widened_model_gives_the_bundled_models_greedy_tokens(widened, eval_prompts, bundled_recipe, resident_tokens):
    engine = specter.load(bundled_recipe("resident", model=str(widened)))
    assert engine.generate(eval_prompts).token_ids == resident_tokens


def test_widened_checkpoint_has_wider_experts_and_a_model_card(widened):
    source = json.loads((bundled_path("tiny-moe") / "config.json").read_text())
    config = json.loads((widened / "config.json").read_text())
    assert config["intermediate_size"] == FACTOR * source["intermediate_size"]
    assert {k: v for k, v in config.items() if k != "intermediate_size"} == {
        k: v for k, v in source.items() if k != "intermediate_size"}
    card = (widened / "MODEL_CARD.md").read_text()
    assert "What it is for" in card and "What it is not" in card
    assert (widened / "tokenizer.json").is_file()


def test_materialised_once_and_reused(widened, monkeypatch):
    monkeypatch.setenv("SPECTER_CACHE_DIR", str(widened.parent))
    before = (widened / "model.safetensors").stat().st_mtime_ns
    assert bundled_path(f"tiny-moe-x{FACTOR}") == widened
    assert (widened / "model.safetensors").stat().st_mtime_ns == before


def test_widening_one_expert_preserves_its_function():
    torch.manual_seed(0)
    gate, up, down = torch.randn(8, 16), torch.randn(8, 16), torch.randn(16, 8)
    x = torch.randn(3, 16)
    key = "model.layers.0.block_sparse_moe.experts.3.{}.weight"
    wide = {n: widen_tensor(key.format(n), t, 4) for n, t in (("w1", gate), ("w3", up), ("w2", down))}
    assert wide["w1"].shape == (32, 16) and wide["w2"].shape == (16, 32)
    expected = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    actual = (torch.nn.functional.silu(x @ wide["w1"].T) * (x @ wide["w3"].T)) @ wide["w2"].T
    torch.testing.assert_close(actual, expected)
    assert widen_tensor("model.layers.0.self_attn.q_proj.weight", gate, 4) is gate


@pytest.mark.parametrize("name", ["tiny-moe-x3", "tiny-moe-x1", "tiny-moe-x128"])
def test_bad_factors_are_refused_with_a_clear_error(name):
    with pytest.raises(ValueError, match="power of two"):
        parse_factor(name)
    with pytest.raises(RecipeError, match="^model: .*power of two"):
        load_recipe({"model": f"bundled:{name}"})


def test_validation_does_not_build_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECTER_CACHE_DIR", str(tmp_path))
    assert is_bundled("tiny-moe-x16") and not is_bundled("tiny-moe-y")
    load_recipe({"model": "bundled:tiny-moe-x16"})
    assert not any(tmp_path.iterdir())


def test_the_widened_folder_is_readable_by_every_user(widened):
    assert widened.stat().st_mode & 0o777 == 0o755  # tempfile.mkdtemp made it the owner's alone
    assert {f.stat().st_mode & 0o777 for f in widened.iterdir()} == {0o644}


def test_a_cache_directory_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SPECTER_CACHE_DIR", str(blocker / "cache"))  # a folder under a file: mkdir fails
    with pytest.raises(SpecterError, match=r"bundled:tiny-moe-x2 is built once into .*a-file/cache, which "
                                                   r"cannot be written .*set SPECTER_CACHE_DIR to a writable folder"):
        bundled_path(f"tiny-moe-x{FACTOR}")
