"""Compiled step functions per model layout: one code object per layout key, so decoders of one
layout share their graphs and decoders of different layouts do not share dynamo's recompile limit."""

from __future__ import annotations

import pytest
import torch

import specter
from specter.compile.layout_code import layout_key, per_layout
from specter.testing.zoo import save_random_checkpoint, tiny_config

torch.set_num_threads(1)


def scaled(x, factor=2, *, shift=0):
    return x * factor + shift


class Holder:
    def __init__(self, offset: int) -> None:
        self.offset = offset

    def add(self, x):
        return x + self.offset


def test_one_code_object_per_key_running_the_same_python():
    first, again, other = per_layout(scaled, ("a",)), per_layout(scaled, ("a",)), per_layout(scaled, ("b",))
    assert first.__code__ is again.__code__
    assert first.__code__ is not other.__code__ and first.__code__ is not scaled.__code__
    assert first(3) == other(3) == scaled(3) == 6 and first(3, 3, shift=1) == 10
    assert first.__qualname__ == scaled.__qualname__


def test_a_bound_method_stays_bound_to_its_object():
    one, two = Holder(1), Holder(5)
    add_one, add_five = per_layout(one.add, ("a",)), per_layout(two.add, ("a",))
    assert add_one(1) == 2 and add_five(1) == 6
    assert add_one.__func__.__code__ is add_five.__func__.__code__  # one layout: shared graphs


def test_the_key_follows_shapes_dtype_device_constants_source_and_options():
    weights = [torch.zeros(4, 8), None]
    base = layout_key(("arch",), torch.float32, torch.device("cpu"), weights, "resident")
    assert base == layout_key(("arch",), torch.float32, torch.device("cpu"), [torch.ones(4, 8), None], "resident")
    assert base != layout_key(("arch",), torch.float32, torch.device("cpu"), [torch.zeros(4, 4), None], "resident")
    assert base != layout_key(("arch",), torch.bfloat16, torch.device("cpu"), weights, "resident")
    assert base != layout_key(("other",), torch.float32, torch.device("cpu"), weights, "resident")
    assert base != layout_key(("arch",), torch.float32, torch.device("cpu"), weights, "cache")
    options = layout_key(("arch",), torch.float32, torch.device("cpu"), weights, "resident", (False, False))
    assert options == layout_key(("arch",), torch.float32, torch.device("cpu"), weights, "resident", [False, False])
    assert options != layout_key(("arch",), torch.float32, torch.device("cpu"), weights, "resident", (False, True))


@pytest.mark.slow
def test_one_process_compiles_models_of_several_widths(tmp_path):
    """Three widths of a tiny Mixtral, compiled `resident` and `specter` of each one after another
    in one process, give their eager tokens (the third width used to stop at dynamo's recompile
    limit)."""
    prompts = [[1, 17, 93, 4, 250, 31, 8], [1, 200, 5]]
    torch._dynamo.reset()  # the count starts here, whatever ran before
    for hidden in (64, 32, 48):
        path = str(save_random_checkpoint(tiny_config("mixtral", hidden=hidden), tmp_path / str(hidden), seed=0))
        recipe = {"model": path, "max_new_tokens": 12, "threads": 1,
                  "offload": {"link": {"kind": "local"}, "expert_budget": 0.5},
                  "speculation": {"governor": {"name": "fixed", "k": 3}}}
        eager = specter.load({**recipe, "engine": "resident"}).generate(prompts).token_ids
        for engine_name in ("resident", "specter"):
            engine = specter.load({**recipe, "engine": engine_name, "compile": True})
            report = engine.generate(prompts).report
            assert [o["token_ids"] for o in report["outputs"]] == eager, (hidden, engine_name)
            assert report["compile"]["late_graphs"] == 0
            engine.close()
