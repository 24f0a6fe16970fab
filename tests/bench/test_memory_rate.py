"""``specter.bench.memory_rate``: what it reads is the engine's cache slots (else its large weights),
on a CPU only, and the rate it gives is bytes over time."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from specter.bench import memory_rate


def test_an_offloaded_engine_is_read_through_its_cache_slots(monkeypatch):
    slots = {"gate_up_proj": torch.ones(4, 512, 256), "down_proj": torch.ones(4, 256, 256)}
    engine = SimpleNamespace(cache=SimpleNamespace(slots=slots), model=nn.Linear(4096, 4096))
    assert memory_rate._read_most(engine) == list(slots.values())
    ticks = iter(range(100))
    monkeypatch.setattr(memory_rate.time, "perf_counter", lambda: next(ticks) * 0.5)  # every read takes 0.5 s
    nbytes = sum(t.nbytes for t in slots.values())
    assert memory_rate.engine_read_rate(engine, repeats=3) == nbytes / 2**30 / 0.5


def test_a_resident_engine_is_read_through_its_large_weights_only():
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(16, 16))  # 4 MiB weight; the rest small
    engine = SimpleNamespace(model=model)
    (read,) = memory_rate._read_most(engine)
    assert read.shape == (1024, 1024)
    assert memory_rate.engine_read_rate(engine) > 0
    small = SimpleNamespace(model=nn.Linear(16, 16))  # a tiny model: every weight
    assert [t.shape for t in memory_rate._read_most(small)] == [(16, 16), (16,)]


def test_nothing_on_a_cpu_gives_no_rate():
    engine = SimpleNamespace(cache=SimpleNamespace(slots={"w": torch.empty(4, 1024, 1024, device="meta")}))
    assert memory_rate.engine_read_rate(engine) is None
    assert memory_rate.engine_read_rate(SimpleNamespace()) is None
