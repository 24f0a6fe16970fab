"""What verification pays to read an expert that has just arrived, on a CPU device.

Run: python scripts/fresh_expert_reads.py [--rows 3] [--gbps 2.0] [--repeats 12]   (one thread, ~30 s)

Times Specter's native gated-MLP kernel (``native_rows.glu_expert_pairs``, what a verification
wave runs) on one float32 expert of the widened model's shape ([8192, 256] gate-up and [256, 4096]
down, 12 MiB, on huge pages where Linux allows, as in the engines) with ``--rows`` rows, the expert
read:
- cold: not read for a while (one of 40 experts, 600 MiB read before each call),
- again: the same expert once more, right after the cold call, on the same core,
- own copy: just copied into a cache slot by this thread (``Tensor.copy_``),
- link copy: just copied into a slot by another thread through the emulated link's paced copy
  (``stream_copy.paced_copy`` at ``--gbps``), the caller waiting meanwhile (a slow link's wave),
- link copy, followed: the same, the caller reading each 256 KiB piece as it lands,
- link copy, next copying: as link copy, but the kernel runs while the link copies the next
  expert into the other slot (what a slow link's wave meets: the copies never stop),
and the same bytes summed cold (``torch.sum``: the core's streaming read rate). Medians of
``--repeats`` calls. Why: on a slow link each verification wave computes an expert moments after
its copy landed, where a ``resident`` step re-reads experts that the large L3 partly keeps.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from specter import native
from specter.memory import huge_pages, stream_copy

EXPERTS, HIDDEN, INTER, PIECE_FLOATS = 40, 256, 4096, 65536


def widened_experts() -> tuple[torch.Tensor, torch.Tensor]:
    """One thread, Specter's native kernels (else exit), and ``EXPERTS`` float32 experts of the
    widened model's shape, gate-up and down stacked, on 2 MiB pages where Linux allows (as the
    engines' host store and cache slots are)."""
    torch.set_num_threads(1)
    if not native.available():
        raise SystemExit("Specter's native kernels are not available on this machine")
    gate_up = huge_pages.zeros((EXPERTS, 2 * INTER, HIDDEN), torch.float32).normal_(0, 0.01)
    down = huge_pages.zeros((EXPERTS, HIDDEN, INTER), torch.float32).normal_(0, 0.01)
    return gate_up, down


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=3)
    parser.add_argument("--gbps", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args(argv)
    if args.rows < 1:
        parser.error("--rows must be at least 1")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.gbps <= 0:
        parser.error("--gbps must be above 0")
    gate_up, down = widened_experts()
    slot_gate_up = huge_pages.zeros((2, 2 * INTER, HIDDEN), torch.float32)
    slot_down = huge_pages.zeros((2, HIDDEN, INTER), torch.float32)
    x, out, weights = torch.randn(args.rows, HIDDEN), torch.empty(args.rows, HIDDEN), torch.ones(args.rows)
    sweep = torch.empty(600 * 2**20 // 4)
    expert_bytes = gate_up[0].nbytes + down[0].nbytes
    wire_s = expert_bytes / (args.gbps * 1e9)

    def kernel(stack_gate_up: torch.Tensor, stack_down: torch.Tensor, index: int) -> float:
        started = time.perf_counter()
        torch.ops.specter_native.glu_expert_pairs(out, x, stack_gate_up, stack_down, weights, 1, [index],
                                                  [0, args.rows], list(range(args.rows)))
        return time.perf_counter() - started

    def start_copy(expert: int, slot: int) -> threading.Thread:
        dsts, srcs = [slot_gate_up[slot], slot_down[slot]], [gate_up[expert], down[expert]]
        copier = threading.Thread(target=stream_copy.paced_copy, args=(dsts, srcs, wire_s))
        copier.start()
        return copier

    def link_copy(expert: int, slot: int, follow: bool, next_copying: bool = False) -> float:
        dsts = [slot_gate_up[slot], slot_down[slot]]
        started = time.perf_counter()
        copier = start_copy(expert, slot)
        if follow:
            pieces = [p for d in dsts for p in d.view(-1).split(PIECE_FLOATS)]
            for i, piece in enumerate(pieces):
                while time.perf_counter() < started + wire_s * (i + 1) / len(pieces):
                    time.sleep(1e-4)
                piece.sum()
        copier.join()
        if not next_copying:
            return kernel(slot_gate_up, slot_down, slot)
        following = start_copy((expert + 1) % EXPERTS, 1 - slot)
        seconds = kernel(slot_gate_up, slot_down, slot)
        following.join()
        return seconds

    times: dict[str, list[float]] = {name: [] for name in
                                     ("cold", "again", "own copy", "link copy", "link copy, followed",
                                                  "link copy, next copying", "sum, cold")}
    for repeat in range(args.repeats):
        expert, slot = repeat % EXPERTS, repeat % 2
        sweep.sum()
        times["cold"].append(kernel(gate_up, down, expert))
        times["again"].append(kernel(gate_up, down, expert))
        sweep.sum()
        slot_gate_up[slot].copy_(gate_up[(expert + 7) % EXPERTS])
        slot_down[slot].copy_(down[(expert + 7) % EXPERTS])
        times["own copy"].append(kernel(slot_gate_up, slot_down, slot))
        for follow in (False, True) if repeat % 2 else (True, False):
            sweep.sum()
            name = "link copy, followed" if follow else "link copy"
            times[name].append(link_copy((expert + 13 + 7 * follow) % EXPERTS, slot, follow))
        sweep.sum()
        times["link copy, next copying"].append(link_copy((expert + 17) % EXPERTS, slot, False, next_copying=True))
        sweep.sum()
        started = time.perf_counter()
        gate_up[(expert + 21) % EXPERTS].sum()
        down[(expert + 21) % EXPERTS].sum()
        times["sum, cold"].append(time.perf_counter() - started)
    print(f"one {expert_bytes / 2**20:.0f} MiB float32 expert, {args.rows} rows, link {args.gbps:g} GB/s (emulated), "
          f"one thread, medians of {args.repeats}")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"  {name:24s} {median * 1e3:6.3f} ms  ({expert_bytes / median / 1e9:5.1f} GB/s)")


if __name__ == "__main__":
    main()
