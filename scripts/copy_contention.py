"""What a link's copies cost the compute beside them on a CPU: the host and the "device" are one
memory, so every expert a copy thread moves is read and written through the bandwidth that
decoding streams its weights through.

Run: python scripts/copy_contention.py [--expert-mib 12] [--repeats 5]   (one thread, CPU, ~30 s)

Times three single-thread workloads alone and while a second thread copies expert-sized tensors
back to back (what the `local` link and an emulated link's copy thread do while a round runs):
a streaming read of 192 MiB (a memory-bound step: fp32 experts), the INT4 draft's experts of 16
widened-model steps (2 experts x 4 layers each, through ``Int4Experts`` of a random Mixtral with
the widened model's shapes), and 256-element elementwise ops (dispatch-bound: norms,
residuals). Then the same with a second thread running small matmuls (each op releases and
retakes the GIL), for comparison. Each figure is the best of ``--repeats``; the ratio is
with / alone.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Callable

import torch

from specter.kernels.int4_experts import quantize_model_experts
from specter.testing.zoo import random_model

torch.set_num_threads(1)
HIDDEN, INTER, EXPERTS, LAYERS, TOP_K = 256, 4096, 16, 4, 2  # the widened model's shapes


def best_ms(call: Callable[[], None], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1e3)
    return min(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expert-mib", type=float, default=12.0, help="bytes of one copied expert")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    big = torch.randn(192 * 1024 * 1024 // 4)
    model = random_model("mixtral", hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                         num_experts_per_tok=TOP_K, num_hidden_layers=LAYERS)
    layers = list(quantize_model_experts(model).values())
    x = torch.randn(1, HIDDEN)
    routes = [torch.randperm(EXPERTS)[:TOP_K][None] for _ in range(64)]
    weights = torch.full((1, TOP_K), 0.5)
    small = torch.randn(256)

    def stream() -> None:
        big.sum()

    def draft_experts() -> None:
        for route in routes:  # 16 steps of 4 layers, different experts each step
            for layer in layers:
                layer(x, route, weights)

    def tiny_ops() -> None:
        y = small
        for _ in range(5000):
            y = y * 1.0001

    workloads = {"streaming read, 192 MiB": stream, "INT4 draft experts, 16 steps": draft_experts,
                 "256-element ops x 5000": tiny_ops}
    stop = threading.Event()
    numel = int(args.expert_mib * 1024 * 1024 / 4)

    def copier() -> None:
        sources = [torch.randn(numel) for _ in range(4)]
        destination = torch.empty(numel)
        i = 0
        while not stop.is_set():
            destination.copy_(sources[i % len(sources)])
            i += 1

    def matmuls() -> None:
        a = torch.randn(64, 64)
        while not stop.is_set():
            a @ a

    alone = {name: best_ms(call, args.repeats) for name, call in workloads.items()}
    print(f"{'workload':32s} {'alone ms':>9s} {'+copy thread':>13s} {'+matmul thread':>15s}")
    beside = {}
    for label, background in (("copy", copier), ("matmul", matmuls)):
        stop.clear()
        thread = threading.Thread(target=background, daemon=True)
        thread.start()
        time.sleep(0.1)
        beside[label] = {name: best_ms(call, args.repeats) for name, call in workloads.items()}
        stop.set()
        thread.join()
    for name, ms in alone.items():
        print(f"{name:32s} {ms:9.2f} {beside['copy'][name]:8.2f} ({beside['copy'][name] / ms:.2f}x)"
              f" {beside['matmul'][name]:9.2f} ({beside['matmul'][name] / ms:.2f}x)")
    print(f"(copy thread: {args.expert_mib:g} MiB tensors back to back; one torch thread each)")


if __name__ == "__main__":
    main()
