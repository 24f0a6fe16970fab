"""``Engine.generate`` / ``generate_by_prompt`` misuse: every bad argument is a ``SpecterError`` naming
the argument, raised before any decoding (``specter.decode.prompt_check``); the forms the API accepts
give the same tokens as a plain list; a closed engine, of any class, refuses to generate.

Token-id cases run on the zoo's random Mixtral (no tokenizer); text cases on the bundled tiny-moe."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specter
from specter.decode.engine import ResidentEngine
from specter.decode.sampling import SamplingParams
from specter.errors import SpecterError

torch.set_num_threads(1)

IDS = [[1, 17, 93, 4, 250], [1, 200, 5, 77, 12]]
MAX_NEW = 3


def recipe(path: str, engine: str = "resident", **extra) -> dict:
    return {"model": path, "engine": engine, "max_new_tokens": MAX_NEW, "threads": 1,
            "offload": {"link": {"kind": "local"}, "expert_budget": 0.5}, "speculation": {"governor": {"k": 2}},
            **extra}


@pytest.fixture(scope="module")
def engine(zoo_checkpoints):
    with specter.load(recipe(zoo_checkpoints["mixtral"])) as built:
        yield built


@pytest.fixture(scope="module")
def text_engine():
    with specter.load({"model": "bundled:tiny-moe", "engine": "resident", "threads": 1,
                       "max_new_tokens": MAX_NEW}) as built:
        yield built


@pytest.fixture(scope="module")
def reference(engine) -> list[list[int]]:
    return engine.generate(IDS).token_ids


# ----------------------------------------------------------------------------- refused arguments


@pytest.mark.parametrize("prompts, match", [
    ("ab", r"^prompts: .*single str 'ab'.*wrap a single prompt in a list"),
    (b"ab", r"^prompts: .*bytes"),
    (None, r"^prompts: .*got None"),
    (5, r"^prompts: .*got int 5"),
    ({"a": 1}, r"^prompts: .*ordered list"),
    ({"a"}, r"^prompts: .*ordered list"),
    (torch.tensor([1, 2]), r"^prompts: a tensor of prompts must be 2-D"),
    ([5], r"^prompts\[0\]: .*got int 5.*\[\[5, \.\.\.\]\]"),
    ([None], r"^prompts\[0\]: .*got NoneType None"),
    ([b"import"], r"^prompts\[0\]: bytes are not a prompt"),
    ([["a", "b"]], r"^prompts\[0\]\[0\]: token ids must be integers, got str 'a'"),
    ([[1.7]], r"^prompts\[0\]\[0\]: token ids must be integers, got float 1.7"),
    ([[1, True]], r"^prompts\[0\]\[1\]: token ids must be integers, got bool True"),
    ([[np.float64(3.0)]], r"^prompts\[0\]\[0\]: token ids must be integers"),
    ([torch.tensor([1.5])], r"^prompts\[0\]: a tensor prompt must be 1-D token ids of an integer dtype"),
    ([[10**6]], r"^prompts\[0\]: token id 1000000 at position 0 is out of range; allowed: 0 <= id < 256"),
    ([[3, -5]], r"^prompts\[0\]: token id -5 at position 1 is out of range"),
    ([[1, 2], [3, 256]], r"^prompts\[1\]: token id 256 at position 1 is out of range; allowed: 0 <= id < 256"),
])
def test_bad_prompts_are_refused_naming_the_argument(prompts, match, engine):
    with pytest.raises(SpecterError, match=match):
        engine.generate(prompts)


def test_bad_text_prompts_are_refused_naming_the_argument(text_engine):
    with pytest.raises(SpecterError, match=r"^prompts: .*single str"):
        text_engine.generate("import os\n")  # not one prompt per character
    with pytest.raises(SpecterError, match=r"^prompts\[1\]: bytes"):
        text_engine.generate(["import os\n", b"import sys\n"])


@pytest.mark.parametrize("kwargs, match", [
    ({"seed": "abc"}, r"^seed: must be an integer.*got str 'abc'"),
    ({"seed": 1.5}, r"^seed: must be an integer.*got float 1.5"),
    ({"seed": True}, r"^seed: must be an integer"),
    ({"seed": 2**64}, r"^seed: must be an integer in \[-2\*\*63, 2\*\*64 - 1\]"),
    ({"sampling": "greedy"}, r"^sampling: expected a SamplingParams"),
    ({"sampling": {"temp": 1.0}}, r"^sampling: unknown key 'temp'; allowed keys: temperature, top_p, top_k"),
    ({"sampling": {"top_p": 0.0}}, r"^sampling\.top_p: must be in \(0, 1\]"),
    ({"sampling": {"temperature": -1}}, r"^sampling\.temperature: must be >= 0"),
    ({"sampling": {"temperature": "hot"}}, r"^sampling\.temperature: expected a number, got str 'hot'"),
    ({"sampling": {"top_k": 1.5}}, r"^sampling\.top_k: must be an integer >= 0"),
    ({"progress": 3}, r"^progress: expected a callable"),
    ({"on_tokens": "print"}, r"^on_tokens: expected a callable"),
])
def test_bad_options_are_refused_naming_the_argument(kwargs, match, engine):
    with pytest.raises(SpecterError, match=match):
        engine.generate(IDS, **kwargs)


def test_a_refused_call_decodes_nothing(zoo_mixtral):
    """The checks run over every prompt before the first one is decoded."""
    with specter.load(recipe(zoo_mixtral, "ondemand")) as engine:
        steps: list = []
        for bad in ([IDS[0], [1, 10**6]], [IDS[0], 5], [IDS[0], [1.5]]):
            with pytest.raises(SpecterError, match=r"^prompts\[1\]"):
                engine.generate(bad, on_tokens=lambda index, ids: steps.append(index))
        assert steps == [] and engine.cache.stats.acquired_keys == 0


def test_generate_by_prompt_checks_its_arguments_when_called(engine):
    with pytest.raises(SpecterError, match=r"^prompts: .*single str"):
        engine.generate_by_prompt("ab")  # at the call, not at the first next()
    with pytest.raises(SpecterError, match=r"^seed:"):
        engine.generate_by_prompt(IDS, seed="abc")


# ----------------------------------------------------------------------------- accepted forms


def test_any_iterable_of_prompts_gives_the_list_result(engine, reference):
    assert engine.generate(tuple(IDS)).token_ids == reference
    assert engine.generate(prompt for prompt in IDS).token_ids == reference
    steps = engine.generate_by_prompt(iter(IDS), progress=lambda *args: None)
    assert next(steps) == 0
    with pytest.raises(StopIteration) as finished:
        next(steps)
    assert finished.value.value.token_ids == reference


def test_integer_arrays_and_tensors_are_token_ids(engine, reference):
    assert engine.generate([np.array(ids) for ids in IDS]).token_ids == reference
    assert engine.generate([[np.int64(t) for t in ids] for ids in IDS]).token_ids == reference
    assert engine.generate([torch.tensor(ids) for ids in IDS]).token_ids == reference
    assert engine.generate(torch.tensor(IDS)).token_ids == reference  # 2-D: one row per prompt
    assert engine.generate([[255]]).token_ids  # the last embedding row is a token


def test_an_empty_prompt_list_gives_an_empty_result_with_a_report(engine):
    result = engine.generate([])
    assert (result.texts, result.token_ids, result.prompt_ids) == ([], [], [])
    assert result.report["prompts"] == 0 and result.report["new_tokens"] == 0 and result.report["outputs"] == []
    with pytest.raises(StopIteration) as finished:
        next(engine.generate_by_prompt([]))  # nothing to yield
    assert finished.value.value.token_ids == []


def test_a_sampling_dict_is_a_sampling_params(engine):
    hot = SamplingParams(temperature=5.0)
    expected = engine.generate(IDS[:1], sampling=hot, seed=7).token_ids
    assert engine.generate(IDS[:1], sampling={"temperature": 5.0}, seed=7).token_ids == expected
    assert engine.generate(IDS[:1], sampling={"temperature": 5}, seed=np.int64(7)).token_ids == expected


def test_generate_by_prompt_yields_every_prompt_but_the_last(engine):
    """As its docstring says: n prompts, n - 1 yields, then the result (the bench relies on it)."""
    steps = engine.generate_by_prompt(IDS + IDS[:1])
    assert [next(steps), next(steps)] == [0, 1]
    with pytest.raises(StopIteration) as finished:
        next(steps)
    assert len(finished.value.value.token_ids) == 3
    with pytest.raises(StopIteration):
        next(engine.generate_by_prompt(IDS[:1]))


# ----------------------------------------------------------------------------- closed engines


@pytest.mark.parametrize("name", ("resident", "ondemand", "router-lookahead", "specter", "hf-offload"))
def test_a_closed_engine_refuses_to_generate(name, zoo_mixtral):
    engine = specter.load(recipe(zoo_mixtral, name))
    assert engine.generate(IDS[:1]).token_ids
    engine.close()
    with pytest.raises(SpecterError, match=f"this {name} engine is closed"):
        engine.generate(IDS[:1])
    with pytest.raises(SpecterError, match="engine is closed"):
        engine.generate_by_prompt(IDS[:1])
    engine.close()  # a second close does no harm
    assert engine.closed


def test_closing_between_prompts_stops_generate_by_prompt(zoo_mixtral):
    engine = specter.load(recipe(zoo_mixtral, "ondemand"))
    steps = engine.generate_by_prompt(IDS)
    assert next(steps) == 0
    engine.close()
    with pytest.raises(SpecterError, match="engine is closed"):
        next(steps)


def test_a_subclass_close_that_skips_super_still_marks_the_engine_closed(engine):
    class Custom(ResidentEngine):
        name = "custom"

        def close(self) -> None:  # a plugin engine's own close, no super().close()
            self.released = True

    custom = Custom(engine.recipe, engine.model, engine.tokenizer, engine.device, engine.model_path)
    assert custom.generate(IDS[:1]).token_ids
    with custom:
        pass
    assert custom.released and custom.closed
    with pytest.raises(SpecterError, match="this custom engine is closed"):
        custom.generate(IDS[:1])
