"""The predictor protocol (``specter.predictors.base``): the base class's defaults (predicts
nothing, keeps no state, ``propose`` refused), ``bind``, the old ``BasePredictor`` name, and on
the tiny random Mixtral what the ``specter`` engine does with a third-party subclass: it refuses an
object that is not a ``Predictor``, binds its scheduler and MoE layers, reports every routing with
``mode`` ``"target"`` or ``"draft"``, resets it per prompt and rolls it back after verification."""

from __future__ import annotations

import pytest
import torch

import specter
from specter.errors import SpecterError
from specter.hookspecs import hookimpl
from specter.plugins import register_plugin
from specter.predictors import base
from specter.predictors.base import BasePredictor, Predictor

PROMPTS = [[1, 17, 93, 4, 250, 31], [1, 200, 5, 77]]
MAX_NEW = 6
HIDDEN, TOP_K = 64, 2


pytestmark = pytest.mark.usefixtures("clean_plugins")


# ----------------------------------------------------------------------------- the base class


def test_class_defaults_say_a_plain_predictor() -> None:
    assert (Predictor.name, Predictor.needs_draft, Predictor.drafts_tokens) == ("base", False, False)


def test_a_new_predictor_is_unbound_with_layers_of_its_own() -> None:
    first, second = Predictor(), Predictor()
    assert first.scheduler is None and first.layers == {}
    first.layers[0] = "layer"
    assert second.layers == {}


def test_bind_keeps_the_schedulers_and_layers_objects(recording_scheduler) -> None:
    predictor, scheduler, layers = Predictor(), recording_scheduler(), {0: "moe0", 3: "moe3"}
    predictor.bind(scheduler, layers)
    assert predictor.scheduler is scheduler and predictor.layers is layers


def test_the_defaults_predict_nothing_and_keep_no_state(recording_scheduler) -> None:
    predictor, scheduler = Predictor(), recording_scheduler()
    layers = {1: "moe1"}
    predictor.bind(scheduler, layers)
    index, weights = torch.tensor([[1, 3], [2, 3]]), torch.full((2, 2), 0.5)
    for mode in ("target", "draft"):
        assert predictor.observe(1, torch.zeros(2, HIDDEN), index, weights, mode) is None
    assert predictor.reset() is None and predictor.rollback(3) is None
    assert (scheduler.added, scheduler.pumps, scheduler.flushes) == ([], 0, 0)
    assert predictor.scheduler is scheduler and predictor.layers is layers  # reset and rollback keep the binding


def test_propose_is_refused_naming_the_predictor() -> None:
    class Proposing(Predictor):
        name = "my-proposer"
        drafts_tokens = True

    with pytest.raises(NotImplementedError,
                       match=r"^predictor 'my-proposer' sets drafts_tokens but has no propose\(\)$"):
        Proposing().propose([1, 2, 3], 2)


def test_the_old_name_is_the_same_class() -> None:
    assert BasePredictor is Predictor and base.BasePredictor is base.Predictor


# ----------------------------------------------------------------------------- inside the specter engine


class Recording(Predictor):
    """Overrides every hook to record it; predicts nothing."""

    name = "test-base-recording"
    made: list[Recording] = []

    def __init__(self) -> None:
        super().__init__()
        self.bound: list[tuple[object, object]] = []
        self.events: list[tuple[str, object]] = []  # ("observe", (layer, mode, T, H, top_k)), ("reset", None), ...
        Recording.made.append(self)

    def bind(self, scheduler, layers) -> None:
        super().bind(scheduler, layers)
        self.bound.append((scheduler, layers))

    def observe(self, layer, hidden, top_k_index, top_k_weights, mode) -> None:
        assert top_k_weights.shape == top_k_index.shape
        self.events.append(("observe", (layer, mode, hidden.shape[0], hidden.shape[1], top_k_index.shape[1])))

    def reset(self) -> None:
        self.events.append(("reset", None))

    def rollback(self, length: int) -> None:
        self.events.append(("rollback", length))


class Plugins:
    @hookimpl
    def register_predictors(self, register):
        register("test-base-recording", Recording)
        register("test-base-not-a-predictor", lambda: object())


def recipe(path: str, predictor: str) -> dict:
    return {"model": path, "engine": "specter", "max_new_tokens": MAX_NEW, "threads": 1, "check_lossless": False,
            "offload": {"link": {"kind": "local"}, "expert_budget": 0.25},
            "speculation": {"predictor": {"name": predictor}, "governor": {"k": 2}}}


def test_the_engine_refuses_a_predictor_that_is_not_a_predictor(zoo_mixtral: str) -> None:
    register_plugin(Plugins())
    with pytest.raises(SpecterError, match="^speculation.predictor.name: predictor plugin 'test-base-not-a-predictor' "
                                           "returned a object, which is not a specter.predictors.base.Predictor; "
                                           "subclass it$"):
        specter.load(recipe(zoo_mixtral, "test-base-not-a-predictor"))


def test_the_specter_engine_drives_a_subclass_through_the_whole_protocol(zoo_mixtral: str) -> None:
    register_plugin(Plugins())
    Recording.made.clear()
    engine = specter.load(recipe(zoo_mixtral, "test-base-recording"))
    try:
        assert len(Recording.made) == 1
        predictor = Recording.made[0]
        assert predictor.bound == [(engine.scheduler, engine.runtime.layers)]
        assert engine.draft_step_kind != "predictor"  # drafts_tokens is off: the INT4 draft runs
        engine.generate(PROMPTS)
        assert engine.prediction_failure is None
    finally:
        engine.close()
    layers = sorted(engine.runtime.layers)
    events = predictor.events
    resets = [i for i, (kind, _) in enumerate(events) if kind == "reset"]
    assert len(resets) == len(PROMPTS) and resets[0] == 0
    for prompt, (start, end) in zip(PROMPTS, zip(resets, resets[1:] + [len(events)])):
        own = events[start + 1:end]
        observed = [detail for kind, detail in own if kind == "observe"]
        rollbacks = [detail for kind, detail in own if kind == "rollback"]
        # the prefill: every MoE layer routes the whole prompt, in the target
        assert observed[:len(layers)] == [(layer, "target", len(prompt), HIDDEN, TOP_K) for layer in layers]
        assert {mode for _, mode, _, _, _ in observed} == {"target", "draft"}
        assert {layer for layer, _, _, _, _ in observed} == set(layers)
        assert all(tokens == 1 for _, mode, tokens, _, _ in observed if mode == "draft")
        assert all(width == HIDDEN and k == TOP_K for _, _, _, width, k in observed)
        # one rollback per verification, to the kept length: past the prompt, short of the last token
        assert rollbacks and rollbacks == sorted(rollbacks)
        assert all(len(prompt) < length < len(prompt) + MAX_NEW for length in rollbacks)
