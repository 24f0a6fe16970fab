"""Expert predictors (see ``base.Predictor``) and their plugin registration.

Built-ins: ``draft`` (the INT4 draft's routing while it drafts), ``router-lookahead`` (layer L's
hidden state through layer L+1's router) and ``none`` (no prediction: every miss loads on
demand). They register through the same ``register_predictors`` hook as third-party predictors.
"""

from __future__ import annotations

from specter.hookspecs import Register, hookimpl
from specter.predictors.base import Predictor
from specter.predictors.draft import DraftPredictor
from specter.predictors.ngram import NgramPredictor
from specter.predictors.router_lookahead import RouterLookaheadPredictor


class NonePredictor(Predictor):
    """Predicts nothing: every expert the target needs is loaded on demand (a baseline)."""

    name = "none"


@hookimpl
def register_predictors(register: Register) -> None:
    register("draft", DraftPredictor)
    register("router-lookahead", RouterLookaheadPredictor)
    register("ngram", NgramPredictor)
    register("none", NonePredictor)
