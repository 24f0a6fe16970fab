"""How fast one thread reads the memory an engine's decoding reads most: a bench diagnostic.

Contract: ``read_rate(buffers) -> float``: GiB/s of one whole streaming read (``Tensor.sum``) of
the buffers, in turn, on this thread. ``engine_read_rate(engine, repeats=3) -> float | None``:
GiB/s, the median over
``repeats`` of one whole streaming read (``Tensor.sum``) of an offloaded engine's cache slots
(``engine.cache.slots``: what verification reads), else of the model's parameters of at least 2 MiB
(a ``resident`` engine's experts and LM head; all of them in a model without such); None where
there are none on a CPU (on a GPU the
host thread's read rate says nothing about the kernels').

Why: two identical engines of one bench run (its twins) have landed up to 18% apart, the same one
ahead in every repeat. On this project's KVM guest (stop 57), a few of the huge-page buffers a
process allocates can read 15-20% below the others for their whole life, and an engine whose
cache slots land there verifies that much slower. The bench records each row's rate
(``memory_read_gibps``) and prints it beside the twins, so a gap between two of them can be told
apart from a change in the code. The rate is the memory's only where the buffers outgrow the
last-level cache (the widened model's slots, 388 MiB at 50%); the bundled model's (12-24 MiB) sit
partly in it, and their rate follows what ran just before (12.3-18.8 GiB/s in one run, stop 57).
"""

from __future__ import annotations

import statistics
import time

import torch

LARGE_BYTES = 2 << 20


def read_rate(buffers: list[torch.Tensor]) -> float:
    started = time.perf_counter()
    for buffer in buffers:
        buffer.sum()
    return sum(buffer.nbytes for buffer in buffers) / 2**30 / (time.perf_counter() - started)


def engine_read_rate(engine, repeats: int = 3) -> float | None:
    buffers = _read_most(engine)
    return statistics.median(read_rate(buffers) for _ in range(repeats)) if buffers else None


def _read_most(engine) -> list[torch.Tensor]:
    cache = getattr(engine, "cache", None)
    if cache is not None and getattr(cache, "slots", None):
        tensors = list(cache.slots.values())
    else:
        model = getattr(engine, "model", None)
        weights = [p.detach() for p in model.parameters()] if model is not None else []
        tensors = [w for w in weights if w.nbytes >= LARGE_BYTES] or weights
    return [t for t in tensors if t.device.type == "cpu" and t.is_floating_point()]
