"""Times one activation row through one expert matrix with each CPU kernel: float32 ``F.linear``,
PyTorch's ``_weight_int4pack_mm_for_cpu`` and Specter's native INT4 kernel, at the widened
model's expert shapes (gate_up [8192, 256], down [256, 4096]) or the bundled model's
(``--shapes bundled``: [512, 256], [256, 256]).

Run: python scripts/int4_kernels.py [--shapes widened|bundled] [--threads 1] [--weights 48]
48 distinct weights per shape are cycled so they come from memory, not the CPU's caches (an
[8192, 256] float32 weight is 8 MiB); each figure is the median of 5 passes over them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from specter.kernels import int4_native
from specter.kernels.int4 import int4_matmul, quantize_int4

SHAPES = {"widened": [(8192, 256), (256, 4096)], "bundled": [(512, 256), (256, 256)]}  # gate_up, down: [N, K]


def per_call_ms(calls: list[Callable[[], object]]) -> float:
    for call in calls[:8]:
        call()
    passes = []
    for _ in range(5):
        start = time.perf_counter()
        for call in calls:
            call()
        passes.append((time.perf_counter() - start) / len(calls) * 1e3)
    return statistics.median(passes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="widened")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--weights", type=int, default=48)
    parser.add_argument("--group-size", type=int, default=64)
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    if args.weights < 1:
        parser.error("--weights must be at least 1")
    if args.group_size < 1:
        parser.error("--group-size must be at least 1")
    torch.set_num_threads(args.threads)
    group = args.group_size
    backends = ["cpu-int4pack"] + (["cpu-native"] if int4_native.available() else [])
    if len(backends) == 1:
        print(f"native kernel unavailable: {int4_native.unavailable_reason()}")
    print(f"threads {args.threads}, {args.weights} distinct weights per shape, INT4 group size {group}")
    for n, k in SHAPES[args.shapes]:
        weights = [torch.randn(n, k) * 0.02 for _ in range(args.weights)]
        x = torch.randn(1, k)
        row = {"float32 F.linear": per_call_ms([lambda w=w: F.linear(x, w) for w in weights])}
        for backend in backends:
            packed = [quantize_int4(w, group, backend=backend) for w in weights]
            row[backend] = per_call_ms([
                lambda p=p: int4_matmul(x, p.packed, p.scales, p.backend, p.shape, p.group_size) for p in packed])
        print(f"[{n}, {k}]  " + "  ".join(f"{name} {ms:.3f} ms" for name, ms in row.items()))


if __name__ == "__main__":
    main()
