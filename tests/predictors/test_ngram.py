"""The ``ngram`` predictor: prompt-lookup proposals, the routing memory it prefetches from, end to end."""

from __future__ import annotations

import pytest
import torch

import specter
from specter.errors import SpecterError
from specter.decode.kv import forward_logits, new_kv_cache
from specter.plugins import registry
from specter.predictors.ngram import NgramPredictor


def test_longest_suffix_match_wins_over_a_more_recent_shorter_one():
    context = [1, 2, 3, 10, 11, 9, 3, 20, 21, 1, 2, 3]
    assert NgramPredictor(max_ngram=3).propose(context, 2) == [10, 11]
    assert NgramPredictor(max_ngram=1).propose(context, 2) == [20, 21]


def test_most_recent_occurrence_and_k_truncation():
    context = [5, 6, 1, 5, 6, 2, 5, 6]
    predictor = NgramPredictor()
    assert predictor.propose(context, 1) == [2]
    assert predictor.propose(context, 4) == [2, 5, 6]  # the context ends after three tokens
    assert predictor.propose([4, 5, 6, 4], 10) == [5, 6, 4]
    assert predictor.propose([7, 7], 3) == [7]  # the continuation may run into the suffix itself


def test_no_match_proposes_nothing():
    predictor = NgramPredictor()
    assert predictor.propose([1, 2, 3], 4) == []
    assert predictor.propose([3], 4) == []
    assert predictor.propose([], 4) == []
    assert predictor.propose([1, 2, 1], 0) == []
    assert NgramPredictor(max_ngram=3, min_ngram=2).propose([1, 2, 3, 1], 2) == []


def test_options_are_validated_and_registered():
    assert "ngram" in registry().names("predictor")
    predictor = registry().create("predictor", "ngram", {"max_ngram": 4, "min_ngram": 2})
    assert (predictor.max_ngram, predictor.min_ngram, predictor.needs_draft) == (4, 2, False)
    with pytest.raises(SpecterError):
        registry().create("predictor", "ngram", {"min_ngram": 0})


def routes(positions, layer):
    """Distinct routing per (position, layer): experts [p, p + 1] at layer 0, [2p, 2p + 1] at layer 1."""
    return torch.tensor([[p * (layer + 1), p * (layer + 1) + 1] for p in positions])


def forward_pass(predictor, positions, mode="target", override=None):
    for layer in (0, 1):
        index = routes(positions, layer) if override is None else torch.full((len(positions), 2), override)
        predictor.observe(layer, torch.zeros(len(positions), 4), index, torch.ones(len(positions), 2), mode)


def test_prediction_replays_the_routing_of_the_copied_positions(recording_scheduler):
    predictor, scheduler = NgramPredictor(), recording_scheduler()
    predictor.bind(scheduler, {0: None, 1: None})
    predictor.reset()
    forward_pass(predictor, range(4))  # prefill of [10, 11, 12, 13]
    forward_pass(predictor, range(4, 6), override=15)  # verification over 10 and a rejected draft
    forward_pass(predictor, range(6), mode="draft", override=14)  # draft routing is not the target's
    predictor.rollback(5)
    assert predictor.length == 5
    # context [10, 11, 12, 13, 10, 11]: positions 0-4 are in the KV cache, 11 at 5 is not yet
    assert predictor.propose([10, 11, 12, 13, 10, 11], 2) == [12, 13]
    # verification will run over 11, 12, 13, last seen at positions 1, 2, 3
    assert scheduler.added == [(0, [1, 2, 3, 4], [1.0] * 4), (1, [2, 3, 4, 5, 6, 7], [1.0] * 6)]
    assert scheduler.flushes == 1


def test_rollback_drops_rejected_positions_and_later_passes_overwrite_them(recording_scheduler):
    predictor, scheduler = NgramPredictor(), recording_scheduler()
    predictor.bind(scheduler, {0: None, 1: None})
    forward_pass(predictor, range(3))
    forward_pass(predictor, range(3, 6), override=15)  # positions 4 and 5 rejected
    predictor.rollback(4)
    forward_pass(predictor, range(4, 5))  # the next round starts at position 4
    assert predictor.length == 5
    # context [20, 21, 22, 23, 21, 22]: last 22 at position 2 -> copies 23 (3) and 21 (4)
    assert predictor.propose([20, 21, 22, 23, 21, 22], 3) == [23, 21, 22]
    assert scheduler.added[0] == (0, [2, 3, 4, 5, 15], [1.0] * 5)  # 15: position 3's own verify routing
    predictor.reset()
    assert predictor.length == 0
    scheduler.added.clear()
    predictor.propose([20, 21, 22, 23, 21, 22], 3)
    assert scheduler.added == []  # nothing recorded for the new prompt yet


PROMPTS = [
    [1, 40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40, 41, 42],
    [1, 7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8, 100, 7, 8],
]


def test_specter_with_ngram_drafting_is_lossless_and_drafts(zoo_mixtral):
    common = {"model": zoo_mixtral, "max_new_tokens": 24, "threads": 1,
              "offload": {"link": {"kind": "local"}, "expert_budget": 0.25}}
    resident = specter.load(common | {"engine": "resident"}).generate(PROMPTS)
    engine = specter.load(common | {"engine": "specter",
                                    "speculation": {"predictor": {"name": "ngram"}, "governor": {"k": 4}}})
    result = engine.generate(PROMPTS)
    assert result.token_ids == resident.token_ids
    report = result.report
    histogram = report["k"]["histogram"]
    assert sum(int(k) * n for k, n in histogram.items()) > 0
    assert report["prediction"]["predictor"] == "ngram"
    assert report["draft"]["step"] == "predictor"  # the n-gram proposes the tokens, no draft step runs
    assert report["prediction"]["recall"] > 0  # replayed routing found experts the target used
    # positions stayed aligned with the KV cache through rounds and rollbacks: the memory equals the
    # routing of one teacher-forced pass over the last prompt's sequence (all but the last token)
    sequence = PROMPTS[-1] + result.token_ids[-1][:-1]
    assert engine.predictor.length == len(sequence)
    fresh = NgramPredictor()
    fresh.bind(None, engine.runtime.layers)
    engine.runtime.observers = [fresh.observe]
    with torch.inference_mode():
        forward_logits(engine.model, torch.tensor([sequence]), new_kv_cache(engine.model))
    for layer in engine.runtime.layers:
        assert [sorted(e) for e in engine.predictor.routing(layer)] == [sorted(e) for e in fresh.routing(layer)]
    engine.close()
