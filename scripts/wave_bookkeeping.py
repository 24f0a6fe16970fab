"""What a verification wave's host bookkeeping costs right after the wave's kernel, on a CPU device.

Run: python scripts/wave_bookkeeping.py [--rows 3] [--repeats 60]   (one thread, ~20 s)

Times the expert cache's own calls around one wave (``acquire(..., wait=False)``, ``await_any``,
``release`` of two experts of a 16-slot cache, every slot READY) in three states of the core's
caches: warm (the calls run back to back), right after a small kernel (a 64 x 256 ``sum``), and
right after Specter's native gated-MLP kernel (``native_rows.glu_expert_pairs``, what a wave runs)
read one of 40 12 MiB float32 experts of the widened model's shape (on huge pages where Linux
allows, as the engines' slots are), cycled, with ``--rows`` rows. Medians of
``--repeats`` (the first ten dropped). Why: on a slow link a verification wave computes one or two
experts, and the Python around it (the cache, the scheduler's streaming, the pairs' sort) runs
with whatever the kernel left in the core's caches; the bench's verification cost per expert
read counts that time as compute.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from specter.memory.cache import ExpertCache
from specter.memory.links import LocalLink
from specter.memory.store import ExpertStore
from specter.policies.lru import LRUPolicy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fresh_expert_reads import EXPERTS, HIDDEN, widened_experts  # noqa: E402  (a sibling script)

WARM_REPEATS = 10  # dropped from every median

LAYERS, SLOTS = 4, 16


def small_cache() -> ExpertCache:
    """A 16-slot cache over 4 layers x 16 tiny experts, every slot READY (the bookkeeping does not
    depend on an expert's size)."""
    store = ExpertStore({layer: {"gate_up_proj": torch.zeros(16, 8, 4), "down_proj": torch.zeros(16, 4, 4)}
                         for layer in range(LAYERS)})
    cache = ExpertCache(store, SLOTS, torch.device("cpu"), LocalLink(copy_thread=False), LRUPolicy())
    cache.preload([(layer, expert) for layer in range(LAYERS) for expert in range(4)])
    return cache


def wave_bookkeeping(cache: ExpertCache, repeat: int) -> float:
    """Seconds the cache's calls around one wave of two READY experts take (the ``repeat``-th)."""
    layer, experts = repeat % LAYERS, [repeat % 4, (repeat + 1) % 4]
    started = time.perf_counter()
    cache.acquire(layer, experts, wait=False)
    wave = cache.await_any(layer, experts)
    cache.release(layer, wave)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args(argv)
    if args.rows < 1:
        parser.error("--rows must be at least 1")
    if args.repeats <= WARM_REPEATS:
        parser.error(f"--repeats must be more than {WARM_REPEATS} (the first {WARM_REPEATS} are dropped as warm-up)")
    gate_up, down = widened_experts()
    x, out, weights = torch.randn(args.rows, HIDDEN), torch.empty(args.rows, HIDDEN), torch.ones(args.rows)
    small = torch.randn(64, HIDDEN)
    cache = small_cache()

    def wave_kernel(repeat: int) -> None:
        torch.ops.specter_native.glu_expert_pairs(out, x, gate_up, down, weights, 1, [repeat % EXPERTS],
                                                  [0, args.rows], list(range(args.rows)))

    before: dict[str, Callable[[int], object]] = {
        "warm (back to back)": lambda repeat: wave_bookkeeping(cache, repeat),
        "after a small kernel": lambda repeat: small.sum(),
        "after the wave kernel": wave_kernel,
    }
    print(f"the cache's acquire + await_any + release of two READY experts, one thread, "
          f"medians of {args.repeats - WARM_REPEATS}")
    for name, run_before in before.items():
        samples = []
        for repeat in range(args.repeats):
            run_before(repeat)
            samples.append(wave_bookkeeping(cache, repeat))
        print(f"  {name:24s} {statistics.median(samples[WARM_REPEATS:]) * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
