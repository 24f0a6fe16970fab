"""``python -m specter.bench RECIPE [options]`` runs a bench; ``python -m specter.bench plot
BENCH.json`` redraws its plots. See ``specter.bench.spec`` for the bench recipe and
``specter.bench.sweep`` for what is measured."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _bools(text: str) -> list[bool]:
    words = {"false": False, "eager": False, "true": True, "compiled": True}
    try:
        return [words[w.lower()] for w in _csv(text)]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected eager,compiled (or false,true), got {text!r}") from None


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m specter.bench", description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="a bench recipe (title/run/sweep) or a plain run recipe")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of the run recipe (repeatable)")
    parser.add_argument("--engines", type=_csv, help="comma-separated engines (replaces sweep.engines)")
    parser.add_argument("--budgets", type=lambda t: [float(x) if x.replace(".", "", 1).isdigit() else x for x in _csv(t)],
                        help="comma-separated expert budgets (replaces sweep.budgets)")
    parser.add_argument("--k", type=lambda t: [int(x) for x in _csv(t)], help="comma-separated fixed k values")
    parser.add_argument("--governors", type=_csv, help="comma-separated governors (one specter row each)")
    parser.add_argument("--compile", type=_bools, help="eager, compiled or eager,compiled")
    parser.add_argument("--links", help="JSON mapping of link names to offload.link settings")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--twins", type=_csv, help="comma-separated row labels run twice as identical engines "
                        "(A/A: the run's noise floor), e.g. 'specter k=4'")
    parser.add_argument("--out", type=Path, help="output directory (default: reports/<title>)")
    parser.add_argument("--no-plots", action="store_true", help="write JSON and markdown only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "plot":
        from specter.bench.plots import main as plot_main

        return plot_main(argv[1:])
    args = parse_args(argv)
    from specter.bench.spec import load_bench
    from specter.errors import SpecterError

    sweep = {key: getattr(args, key) for key in ("engines", "budgets", "k", "governors", "compile", "repeats", "twins")
             if getattr(args, key) is not None}
    try:
        if args.links is not None:
            sweep["links"] = json.loads(args.links)
        spec = load_bench(args.recipe, args.overrides, sweep)
        out_dir = args.out or Path("reports") / spec.title
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except json.JSONDecodeError as error:
        print(f"error: --links: not valid JSON ({error})", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"error: --out: cannot write to {args.out or out_dir}: {error.strerror}", file=sys.stderr)
        return 2
    except SpecterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from specter.bench.sweep import run_bench
    from specter.bench.tables import markdown

    command = "python -m specter.bench " + " ".join(shlex.quote(a) for a in argv)
    try:
        document = run_bench(spec, command)
    except SpecterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    json_path = out_dir / f"{spec.title}.json"
    json_path.write_text(json.dumps(document, indent=2) + "\n")
    table = markdown(document)
    (out_dir / f"{spec.title}.md").write_text(table)
    print(table)
    print(f"wrote {json_path} and {out_dir / (spec.title + '.md')}")
    if not args.no_plots:
        from specter.bench.plots import plot_all

        for path in plot_all(document, out_dir):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
