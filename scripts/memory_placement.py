"""Whether the large buffers of one process all read at one rate, and whether a slow one stays slow.

Run: python scripts/memory_placement.py [--buffers 48] [--mib 256] [--repeats 5] [--no-settle]   (one thread, ~1-2 min)

Allocates ``--buffers`` float32 buffers of ``--mib`` MiB each, on 2 MiB pages where Linux allows
(as the engines' cache slots, INT4 draft and weights are), then reads each one whole (``torch.sum``,
a streaming read on one core) in turn, ``--repeats`` times round-robin, so a slow spell of the
machine falls on every buffer alike. Prints each buffer's median rate, the spread, and the buffers
that read below ``--slow`` x the median in every repeat (persistently slow); for each of those, the
rate of a fresh buffer allocated while it is still held. The buffers are allocated as the kernel
places them (settling off); at the end each is settled (``specter.memory.page_placement``, what
the engines' large buffers get since stop 58: slow 8 MiB pieces swapped for fresh memory) and
all are read again.

Why: two identical engines in one bench run (its twins) have landed up to 18% apart, the same one
ahead in every repeat, in the eager and the compiled cell alike. On this project's 2-core KVM
guest (stop 57) a few of 48-64 such buffers, all on huge pages, read 15-20% below the others in
every repeat while fresh allocations read at the usual rate; in other runs none did. Where an
engine's cache slots or draft land is drawn when it is built, and it keeps that rate for its life
unless settled.
"""

from __future__ import annotations

import argparse
import statistics
import torch

from specter.bench.memory_rate import read_rate
from specter.memory import huge_pages, page_placement


def round_robin_rates(buffers: list[torch.Tensor], repeats: int) -> list[list[float]]:
    """Each buffer's read rate in each repeat (``rates[buffer][repeat]``), buffers read in turn."""
    rates: list[list[float]] = [[] for _ in buffers]
    for _ in range(repeats):
        for index, buffer in enumerate(buffers):
            rates[index].append(read_rate([buffer]))
    return rates


def persistently_slow(rates: list[list[float]], slow: float) -> list[int]:
    """The buffers that read below ``slow`` x the median of all buffers in every repeat."""
    repeats = len(rates[0]) if rates else 0
    medians = [statistics.median(r[repeat] for r in rates) for repeat in range(repeats)]
    return [index for index, row in enumerate(rates)
            if repeats and all(rate < slow * median for rate, median in zip(row, medians))]


def new_buffer(mib: int) -> torch.Tensor:
    """A written buffer on huge pages as the kernel placed it (``page_placement`` not run on it)."""
    with page_placement.disabled():
        return huge_pages.zeros((mib << 18,), torch.float32).add_(1.0)  # in place: stays on its pages


def summary(rates: list[list[float]], slow: float) -> str:
    medians = [statistics.median(row) for row in rates]
    overall = statistics.median(medians)
    return (f"median {overall:.2f}, slowest {min(medians):.2f} ({min(medians) / overall:.2f}x), fastest "
            f"{max(medians):.2f} ({max(medians) / overall:.2f}x); below {slow} x the median in every repeat: "
            f"{len(persistently_slow(rates, slow))} of {len(rates)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--buffers", type=int, default=48)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--slow", type=float, default=0.9)
    parser.add_argument("--no-settle", action="store_true",
                        help="skip settling the buffers (page_placement) at the end")
    args = parser.parse_args(argv)
    if args.buffers < 1:
        parser.error("--buffers must be at least 1")
    if args.mib < 1:
        parser.error("--mib must be at least 1")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if not 0 < args.slow <= 1:
        parser.error("--slow must be a fraction in (0, 1]")
    torch.set_num_threads(1)
    print(f"{args.buffers} buffers of {args.mib} MiB, {'huge pages' if huge_pages.supported() else '4 KiB pages'}, "
          f"{args.repeats} repeats, one thread")
    buffers = [new_buffer(args.mib) for _ in range(args.buffers)]
    rates = round_robin_rates(buffers, args.repeats)
    medians = [statistics.median(row) for row in rates]
    print("median GiB/s per buffer: " + " ".join(f"{m:.1f}" for m in medians))
    print(f"all: {summary(rates, args.slow)}")
    slow = persistently_slow(rates, args.slow)
    for index in slow:
        fresh = new_buffer(args.mib)
        fresh_rate = statistics.median(round_robin_rates([fresh], args.repeats)[0])
        again = statistics.median(round_robin_rates([buffers[index]], args.repeats)[0])
        print(f"  buffer {index}: {medians[index]:.2f} GiB/s, again {again:.2f}; a fresh buffer beside it {fresh_rate:.2f}")
        del fresh
    if args.no_settle or not page_placement.enabled() or not huge_pages.supported():
        return
    if args.mib << 20 < page_placement.MIN_BYTES:
        print(f"not settled: page_placement leaves buffers under {page_placement.MIN_BYTES >> 20} MiB as they are")
        return
    for buffer in buffers:
        page_placement.settle(buffer)
    totals = page_placement.stats()
    print(f"settled (specter.memory.page_placement, as every engine's large buffers are): {totals['slow']} of "
          f"{totals['pieces']} 8 MiB pieces slow, {totals['swapped']} swapped, in {totals['seconds']:.1f} s")
    print(f"all, settled: {summary(round_robin_rates(buffers, args.repeats), args.slow)}")


if __name__ == "__main__":
    main()
