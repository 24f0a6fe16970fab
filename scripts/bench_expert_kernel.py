"""Times one MoE layer's experts on the CPU: transformers' grouped_mm_experts_forward against
Specter's grouped kernel (specter.kernels.grouped_experts) in its two forms, the
``torch._grouped_mm`` one and the native one (``specter.kernels.native_rows``, where it builds),
over cache-sized slot tensors.

Run: python scripts/bench_expert_kernel.py [--threads 1] [--slots 32] [--hidden 256] [--inter 4096]
Prints, per token count T (top-2 routing, distinct random experts per token), the milliseconds per
layer of each kernel, transformers' time over the native one and the milliseconds per distinct
expert read of each Specter form. Weights are float32 and spread over more memory than the CPU
caches hold, as a decode step reads them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers.integrations.moe import grouped_mm_experts_forward

from specter import native
from specter.kernels.grouped_experts import grouped_experts


class StackedExperts(torch.nn.Module):
    """The attributes transformers' grouped_mm_experts_forward reads from an experts module."""

    has_gate, has_bias, is_transposed, has_post_expert_norm, _is_expert_parallel = True, False, False, False, False

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj, self.num_experts = gate_up, down, gate_up.shape[0]
        self.inter = down.shape[2]

    def _apply_gate(self, t: torch.Tensor) -> torch.Tensor:
        return F.silu(t[..., : self.inter]) * t[..., self.inter :]


def median_ms(call, repeats: int = 5, inner: int = 10) -> float:
    samples = []
    for _ in range(repeats):
        call()
        start = time.perf_counter()
        for _ in range(inner):
            call()
        samples.append((time.perf_counter() - start) / inner * 1e3)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inter", type=int, default=4096)
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    if args.hidden < 1:
        parser.error("--hidden must be at least 1")
    if args.inter < 1:
        parser.error("--inter must be at least 1")
    if args.slots < 2:
        parser.error("--slots must be at least 2 (top-2 routing)")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    experts = StackedExperts(torch.randn(args.slots, 2 * args.inter, args.hidden, generator=gen) * 0.02,
                             torch.randn(args.slots, args.hidden, args.inter, generator=gen) * 0.02)
    expert_mib = (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()) * 4 / 2**20
    print(f"threads {args.threads}, {args.slots} slots of {expert_mib:.1f} MiB (fp32 experts), top-2")
    has_native = native.available()
    if not has_native:
        print(f"native kernel unavailable ({native.unavailable_reason()}): its column repeats the grouped_mm form")
    print("T  distinct  transformers ms  grouped_mm ms  native ms  speed-up  ms/expert grouped_mm  native")
    for tokens in (1, 2, 3, 5, 9):
        ids = torch.stack([torch.randperm(args.slots, generator=gen)[:2] for _ in range(tokens)])
        x, weights = torch.randn(tokens, args.hidden, generator=gen), torch.rand(tokens, 2, generator=gen)

        def ours() -> torch.Tensor:
            return grouped_experts(x, ids, weights, experts.gate_up_proj, experts.down_proj, experts._apply_gate)

        with torch.no_grad():
            theirs = median_ms(lambda: grouped_mm_experts_forward(experts, x, ids, weights))
            with_native = median_ms(ours)
            with native.disabled():  # the grouped_mm form
                without = median_ms(ours)
        distinct = ids.unique().numel()
        print(f"{tokens:<2} {distinct:>8}  {theirs:>15.2f}  {without:>13.2f}  {with_native:>9.2f}  "
              f"{theirs / with_native:>7.2f}x  {without / distinct:>20.3f}  {with_native / distinct:>6.3f}")


if __name__ == "__main__":
    main()
