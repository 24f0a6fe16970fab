"""Times Specter's float32 row kernel on an expert's weights as stored today (``grouped_rows``) against
the same weights in the K-major blocked layout (``specter.kernels.blocked_rows``), rows an expert
from one to many, the weights cycled through more memory than the CPU caches hold, the two forms
called in turns.

Run: python scripts/blocked_rows_bench.py [--threads 1] [--experts 40] [--hidden 256] [--inter 4096]
     [--rows 1,2,3,4,6,8,12] [--calls 200]
Prints, per weight ([2I, H] up projection, [H, I] down projection) and rows, the median
microseconds a call of each form and blocked / today. Needs Specter's native kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specter import native
from specter.kernels import blocked_rows, native_rows


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of whole numbers of at least 1 (an argparse type)."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of whole numbers: {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"every value must be at least 1: {text!r}")
    return values


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--experts", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--inter", type=int, default=4096)
    parser.add_argument("--rows", type=positive_ints, default="1,2,3,4,6,8,12", help="rows a call (comma-separated)")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    if args.experts < 1:
        parser.error("--experts must be at least 1")
    if args.hidden < 1:
        parser.error("--hidden must be at least 1")
    if args.inter < 1:
        parser.error("--inter must be at least 1")
    if args.calls < 1:
        parser.error("--calls must be at least 1")
    if not native.available():
        raise SystemExit(f"native kernels unavailable: {native.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shapes = {"up [2I, H]": (2 * args.inter, args.hidden), "down [H, I]": (args.hidden, args.inter)}
    print(f"threads {args.threads}, {args.experts} experts cycled, wide forms: today "
          f"{native_rows.wide_rows()}, blocked {blocked_rows.wide()}")
    print("weight       rows  today us  blocked us  blocked / today")
    for name, (n, k) in shapes.items():
        # each expert's two layouts allocated one after the other, so both forms read the same mix of
        # pages (on some VMs a few pages read 15-20% slower for as long as they are held)
        today_w, blocked_w = [], []
        for _ in range(args.experts):
            today_w.append((torch.randn(1, n, k, generator=gen) * 0.02).contiguous())
            blocked_w.append(blocked_rows.block(today_w[-1]))
        for rows in args.rows:
            x, ends = torch.randn(rows, k, generator=gen), torch.tensor([rows])
            times: dict[str, list[float]] = {"today": [], "blocked": []}
            for call in range(2 * args.calls):
                expert = (call // 2) % args.experts
                form = "today" if (call + call // (2 * args.experts)) % 2 == 0 else "blocked"
                start = time.perf_counter()
                if form == "today":
                    native_rows.grouped_rows(x, today_w[expert], ends)
                else:
                    blocked_rows.blocked_rows(x, blocked_w[expert], ends)
                times[form].append((time.perf_counter() - start) * 1e6)
            today, blocked = statistics.median(times["today"]), statistics.median(times["blocked"])
            print(f"{name:12} {rows:>4}  {today:>8.0f}  {blocked:>10.0f}  {blocked / today:>15.2f}")


if __name__ == "__main__":
    main()
