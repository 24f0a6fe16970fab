"""Shared by the predictor tests: a scheduler stand-in that records what a predictor hands it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


class RecordingScheduler:
    """Records ``add``/``add_many`` predictions, ``reading`` (a layer's routed experts), pumps and
    flushes; ``cache.in_flight`` is settable (the ``draft`` predictor hands a step over at once while
    the link is idle)."""

    def __init__(self, in_flight: int = 0) -> None:
        self.added: list[tuple[int, list[int], list[float]]] = []
        self.read: list[tuple[int, list[int]]] = []
        self.pumps = self.flushes = 0
        self.cache = SimpleNamespace(in_flight=in_flight)  # transfers on the link

    def add(self, layer, experts, confidences) -> None:
        self.added.append((layer, list(experts), list(confidences)))

    def add_many(self, predictions) -> None:
        for prediction in predictions:
            self.add(*prediction)

    def reading(self, layer, experts) -> None:
        self.read.append((layer, list(experts)))

    def pump(self) -> None:
        self.pumps += 1

    def flush(self) -> None:
        self.flushes += 1


@pytest.fixture
def recording_scheduler() -> type[RecordingScheduler]:
    """The ``RecordingScheduler`` class: call it (``in_flight=...``) for a fresh one."""
    return RecordingScheduler
