"""Predictors: what each built-in feeds the prefetch scheduler for a given routing event."""

from __future__ import annotations

import torch

from specter.model.layout import moe_layers
from specter.plugins import registry
from specter.predictors import NonePredictor
from specter.predictors.draft import DraftPredictor
from specter.predictors.router_lookahead import RouterLookaheadPredictor
from specter.testing.zoo import random_model


def test_builtin_predictors_are_registered():
    assert {"draft", "router-lookahead", "none"} <= set(registry().names("predictor"))


def test_none_predictor_adds_nothing(recording_scheduler):
    predictor, scheduler = NonePredictor(), recording_scheduler()
    predictor.bind(scheduler, {})
    predictor.observe(0, torch.zeros(2, 8), torch.tensor([[1, 3], [2, 3]]), torch.ones(2, 2), "draft")
    assert scheduler.added == []


def test_draft_predictor_forwards_draft_routing_only(recording_scheduler):
    predictor, scheduler = DraftPredictor(), recording_scheduler()
    predictor.bind(scheduler, {})
    index, weights = torch.tensor([[1, 3]]), torch.tensor([[0.7, 0.3]])
    predictor.observe(2, torch.zeros(1, 8), index, weights, "target")
    assert scheduler.added == []
    predictor.observe(2, torch.zeros(1, 8), index, weights, "draft")
    assert scheduler.added == [(2, [1, 3], [0.699999988079071, 0.30000001192092896])]
    assert scheduler.pumps == 1


def test_draft_predictor_hands_a_step_over_at_its_last_layer_and_a_rounds_first_layer_at_once_on_an_idle_link(recording_scheduler):
    predictor, scheduler = DraftPredictor(), recording_scheduler(in_flight=1)
    predictor.bind(scheduler, {0: None, 1: None, 3: None})
    hidden = torch.zeros(1, 8)
    predictor.observe(0, hidden, torch.tensor([[1, 3]]), torch.tensor([[0.5, 0.5]]), "draft")
    predictor.observe(1, hidden, torch.tensor([[2, 0]]), torch.tensor([[0.75, 0.25]]), "draft")
    assert scheduler.added == [] and scheduler.pumps == 0  # the link is busy: wait for the step's end
    predictor.observe(3, hidden, torch.tensor([[4, 5]]), torch.tensor([[1.0, 0.0]]), "draft")
    assert scheduler.added == [(0, [1, 3], [0.5, 0.5]), (1, [2, 0], [0.75, 0.25]), (3, [4, 5], [1.0, 0.0])]
    assert scheduler.pumps == 1
    scheduler.cache.in_flight = 0  # later steps of the round wait for their last layer, idle link or not
    predictor.observe(0, hidden, torch.tensor([[6, 7]]), torch.tensor([[0.5, 0.5]]), "draft")
    assert scheduler.pumps == 1
    predictor.observe(3, hidden, torch.tensor([[4, 5]]), torch.tensor([[1.0, 0.0]]), "draft")
    assert scheduler.pumps == 2
    predictor.observe(0, hidden, torch.tensor([[1, 2]]), torch.tensor([[0.5, 0.5]]), "target")  # verification
    predictor.observe(0, hidden, torch.tensor([[6, 7]]), torch.tensor([[0.5, 0.5]]), "draft")
    assert scheduler.added[-1] == (0, [6, 7], [0.5, 0.5]) and scheduler.pumps == 3  # a new round: at once
    predictor.observe(1, hidden, torch.tensor([[2, 0]]), torch.tensor([[0.75, 0.25]]), "draft")
    assert scheduler.pumps == 3  # then the step's other layers wait for its end


def test_router_lookahead_uses_the_next_layers_router(recording_scheduler):
    torch.manual_seed(0)
    model = random_model("mixtral", seed=0)
    layers = {m.layer: m for m in moe_layers(model)}
    predictor, scheduler = RouterLookaheadPredictor(), recording_scheduler()
    predictor.bind(scheduler, layers)
    hidden = torch.randn(3, model.config.hidden_size)
    routed = torch.tensor([[0, 3], [1, 3], [0, 2]])
    predictor.observe(0, hidden, routed, torch.ones(3, 2), "target")
    expected = (hidden @ layers[1].router.weight.T).topk(2, dim=-1).indices.flatten().tolist()
    assert scheduler.added[0][0] == 1 and scheduler.added[0][1] == expected
    assert scheduler.read == [(0, [0, 3, 1, 3, 0, 2])]  # layer 0's own experts held through the prefetch
    assert scheduler.flushes == 1
    predictor.observe(1, hidden, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2), "target")
    assert len(scheduler.added) == 1  # the last MoE layer has no next router
