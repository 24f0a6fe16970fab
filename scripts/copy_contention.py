"""What a link's copies cost the compute beside them on a CPU: the host and the "device" are one
memory, so every expert a copy thread moves is read and written through the bandwidth that
decoding streams its weights through.

Run: python scripts/copy_contention.py [--expert-mib 12] [--paced-gbps 3] [--repeats 9]
     (one thread, CPU, about 25 s)

Times single-thread workloads alone and while a second thread copies expert-sized tensors back
to back (what the `local` link's copy thread does while a round runs), copies them paced to
``--paced-gbps`` (an emulated link's copy thread: ``stream_copy.paced_copy``, where Specter's
native kernels build), or runs small matmuls (each op releases and retakes the GIL), for
comparison. Workloads: a streaming read of 192 MiB (a memory-bound step), the fp32 experts of a
verification wave (``glu_expert_pairs``, two tokens an expert, 24 widened-model experts cycled on
huge pages, where the native kernels build), the INT4 draft's experts of 16 widened-model steps
(2 experts x 4 layers each, through ``Int4Experts`` of a random Mixtral with the widened model's
shapes), and 256-element elementwise ops (dispatch-bound: norms, residuals). Each figure is the
median of ``--repeats`` (the best of them hides the contention: a repeat that ran while the other
thread happened to wait looks like none); the ratio is with / alone.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Callable

import torch

from specter import native
from specter.kernels.int4_experts import quantize_model_experts
from specter.memory import huge_pages, stream_copy
from specter.testing.zoo import random_model

torch.set_num_threads(1)
HIDDEN, INTER, EXPERTS, LAYERS, TOP_K = 256, 4096, 16, 4, 2  # the widened model's shapes


def median_ms(call: Callable[[], None], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--expert-mib", type=float, default=12.0, help="bytes of one copied expert")
    parser.add_argument("--paced-gbps", type=float, default=3.0, help="the paced copy thread's rate")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.expert_mib <= 0 or args.paced_gbps <= 0:
        parser.error("--expert-mib and --paced-gbps must be above 0")
    has_native = native.available()

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

    workloads = {"streaming read, 192 MiB": stream}
    if has_native:
        gate_up = huge_pages.zeros((24, 2 * INTER, HIDDEN), torch.float32).normal_(0, 0.02)
        down = huge_pages.zeros((24, HIDDEN, INTER), torch.float32).normal_(0, 0.02)
        rows, pair_weights = torch.randn(16, HIDDEN), torch.rand(32)
        pairs_out = torch.zeros(32, HIDDEN)

        def fp32_experts() -> None:
            for expert in range(24):
                torch.ops.specter_native.glu_expert_pairs(pairs_out, rows, gate_up, down, pair_weights, TOP_K,
                                                          [expert], [0, 2], [0, 1])
        workloads["fp32 expert GLU x 24, 2 tokens"] = fp32_experts
    workloads.update({"INT4 draft experts, 16 steps": draft_experts, "256-element ops x 5000": tiny_ops})
    stop = threading.Event()
    numel = int(args.expert_mib * 1024 * 1024 / 4)

    def copier(gbps: float | None = None) -> None:
        sources = [torch.randn(numel) for _ in range(4)]
        destination = torch.empty(numel)
        seconds = numel * 4 / (gbps * 1e9) if gbps else 0.0
        i = 0
        while not stop.is_set():
            source = sources[i % len(sources)]
            if gbps and has_native:
                stream_copy.paced_copy(destination, source, seconds)
            elif gbps:
                started = time.perf_counter()
                destination.copy_(source)
                time.sleep(max(0.0, seconds - (time.perf_counter() - started)))
            else:
                destination.copy_(source)
            i += 1

    def matmuls() -> None:
        a = torch.randn(64, 64)
        while not stop.is_set():
            a @ a

    alone = {name: median_ms(call, args.repeats) for name, call in workloads.items()}
    backgrounds = {"+copy thread": copier, f"+emulated {args.paced_gbps:g} GB/s": lambda: copier(args.paced_gbps),
                   "+matmul thread": matmuls}
    print(f"{'workload':32s} {'alone ms':>9s}" + "".join(f" {label:>21s}" for label in backgrounds))
    beside = {}
    for label, background in backgrounds.items():
        stop.clear()
        thread = threading.Thread(target=background, daemon=True)
        thread.start()
        time.sleep(0.1)
        beside[label] = {name: median_ms(call, args.repeats) for name, call in workloads.items()}
        stop.set()
        thread.join()
    for name, ms in alone.items():
        print(f"{name:32s} {ms:9.2f}" + "".join(f" {beside[label][name]:12.2f} ({beside[label][name] / ms:.2f}x)"
                                                for label in backgrounds))
    paced = "stream_copy.paced_copy" if has_native else "copy_ then sleep (no native kernels)"
    print(f"(copy threads: {args.expert_mib:g} MiB tensors, back to back or paced as an emulated link's are ({paced}); "
          "one torch thread each)")


if __name__ == "__main__":
    main()
