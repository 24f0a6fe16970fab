"""``python -m specter.bench RECIPE [options]`` runs a bench; ``python -m specter.bench plot
BENCH.json [--out DIR]`` redraws its plots (``plot``). See ``specter.bench.spec`` for the bench
recipe, ``specter.bench.sweep`` for what is measured and ``specter.bench.plots`` for the figures.

``plot(argv)`` takes the arguments after ``plot`` (a leading ``plot`` is dropped), writes next to
the JSON file unless ``--out`` is given, prints each written path and returns 0; it returns 2
(one line, ``error: ...``) when the file is not a readable ``specter.bench/2`` document or the
output folder cannot be written (``prepare_out_dir(path)``: creates it and tries a file in it,
else raises ``SpecterError("--out: cannot write to PATH: why")``; the bench's own ``--out`` is
checked the same way), and 1 when nothing could be drawn.

A mistake in the recipe or the options (the output folder included) is one line on stderr
(``error: ...``) and exit code 2, before any engine is built; Ctrl-C prints ``interrupted`` and
exits 130.
"""

from __future__ import annotations

import argparse
import errno
import json
import shlex
import sys
from pathlib import Path

DESCRIPTION = """\
Run engines side by side in one process: every cell of a sweep over expert budgets, links, fixed
k values, governors and eager/compiled, interleaved and repeated. Writes <title>.json
(specter.bench/2), <title>.md (the tables) and PNG plots into reports/<title>/ or --out.
RECIPE is a bench recipe (title, run, sweep: see specter/bench/spec.py) or a plain run recipe,
benched as one cell. The sweep options below replace the recipe's sweep keys."""

EPILOG = """\
python -m specter.bench plot BENCH.json [--out DIR]
  redraws the PNG plots of a bench's JSON file (next to it unless --out is given);
  see python -m specter.bench plot --help."""


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _bools(text: str) -> list[bool]:
    words = {"false": False, "eager": False, "true": True, "compiled": True}
    try:
        return [words[w.lower()] for w in _csv(text)]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected eager,compiled (or false,true), got {text!r}") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 2,4, got {text!r}") from None


def _yaml_option(text: str, expected: str, items: bool = False) -> object:
    """An option's value read as recipe files are (``config.loading.yaml_value``: ``1e-1`` a
    float, a key given twice refused), with ``items`` as a list of comma-separated values;
    ``expected`` says what a value that is not YAML should be."""
    import yaml

    from specter.config.loading import yaml_value

    try:
        return yaml_value(f"[{text}]" if items else text)
    except yaml.YAMLError as error:
        problem = " ".join(str(getattr(error, "problem", None) or error).split())
        raise argparse.ArgumentTypeError(f"expected {expected} ({problem}), got {text!r}") from None


def _budgets(text: str) -> list:
    """Comma-separated budgets, each as in a recipe (``0.25``, ``1e-1``, ``2MiB``, ``{per_layer: 8}``)."""
    return list(_yaml_option(text, "comma-separated budgets such as 0.25,0.5 or '{per_layer: 8},2MiB'", items=True))


def _links(text: str) -> object:
    """A mapping of link names to ``offload.link`` settings, JSON or YAML flow (a name given twice
    is refused); its contents are checked by ``load_bench``."""
    return _yaml_option(text, "a mapping such as '{\"local\": {\"kind\": \"local\"}}'")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m specter.bench", description=DESCRIPTION, epilog=EPILOG,
        usage="%(prog)s RECIPE [options]\n       %(prog)s plot BENCH.json [--out DIR]",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", metavar="RECIPE", help="a bench recipe (title/run/sweep) or a plain run recipe")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of the run recipe (repeatable); keys the sweep sets in every cell "
                             "(engine, compile, offload.expert_budget, offload.link, ...) are refused: use the "
                             "sweep options")
    parser.add_argument("--engines", type=_csv, help="comma-separated engines (replaces sweep.engines)")
    parser.add_argument("--budgets", type=_budgets,
                        help="comma-separated expert budgets (replaces sweep.budgets), each a fraction (0.25, 1e-1), "
                             "{per_layer: N}, {experts: N} or a byte size (2MiB)")
    parser.add_argument("--k", type=_ints,
                        help="comma-separated fixed k values, one specter row each (replaces sweep.k)")
    parser.add_argument("--governors", type=_csv,
                        help="comma-separated governors, one specter row each (replaces sweep.governors)")
    parser.add_argument("--compile", type=_bools, help="eager, compiled or eager,compiled (replaces sweep.compile)")
    parser.add_argument("--links", type=_links,
                        help="JSON (or YAML) mapping of link names to offload.link settings (replaces sweep.links), "
                             "e.g. '{\"local\": {\"kind\": \"local\"}}'")
    parser.add_argument("--repeats", type=int, help="timed runs of every engine in every cell (replaces sweep.repeats)")
    parser.add_argument("--twins", type=_csv, help="comma-separated row labels run twice as identical engines "
                        "(A/A: the run's noise floor), e.g. 'specter k=4'; '' for none. Twins of rows that "
                        "--engines, --k or --governors leave out are dropped")
    parser.add_argument("--out", type=Path, help="output directory (default: reports/<title>)")
    parser.add_argument("--no-plots", action="store_true", help="write JSON and markdown only")
    return parser.parse_args(argv)


def run(argv: list[str]) -> int:
    args = parse_args(argv)
    from specter.interrupts import deferred
    from specter.quiet import one_line_warnings

    one_line_warnings()

    with deferred():  # torch, transformers: an interrupt inside an import leaves them half-initialised
        from specter.bench.spec import load_bench
        from specter.bench.sweep import run_bench
        from specter.bench.tables import markdown
        from specter.errors import SpecterError

    sweep = {key: getattr(args, key) for key in ("engines", "budgets", "k", "governors", "compile", "repeats", "twins")
             if getattr(args, key) is not None}
    try:
        if args.links is not None:
            sweep["links"] = args.links
        spec = load_bench(args.recipe, args.overrides, sweep)
        for key, instead in spec.unused:
            print(f"warning: {key} has no effect: the bench sets it in every cell; {instead}", file=sys.stderr)
        out_dir = args.out or Path("reports") / spec.title
        prepare_out_dir(out_dir)
    except SpecterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
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


def prepare_out_dir(path: Path) -> None:
    """Create the folder ``path`` (and its parents) and check a file can be written in it."""
    from specter.errors import SpecterError

    try:
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "it is a file, not a folder")
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise SpecterError(f"--out: cannot write to {path}: {error.strerror or error}") from None


def plot(argv: list[str]) -> int:
    """The ``plot`` subcommand (see the module docstring)."""
    from specter.bench.plots import SCHEMA, plot_all
    from specter.errors import SpecterError

    args = list(argv)
    if args[:1] == ["plot"]:
        args = args[1:]
    parser = argparse.ArgumentParser(prog="python -m specter.bench plot",
                                     description="Render a specter.bench/2 JSON file as PNG figures.")
    parser.add_argument("bench", type=Path, help="bench JSON written by python -m specter.bench")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: the JSON file's folder)")
    ns = parser.parse_args(args)
    try:
        bench = json.loads(ns.bench.read_text())
    except (OSError, ValueError) as exc:
        print(f"error: cannot read {ns.bench}: {exc}", file=sys.stderr)
        return 2
    if not isinstance(bench, dict) or bench.get("schema") != SCHEMA:
        found = bench.get("schema") if isinstance(bench, dict) else type(bench).__name__
        print(f"error: {ns.bench} is not a {SCHEMA} document (found {found!r})", file=sys.stderr)
        return 2
    out_dir = ns.out if ns.out is not None else ns.bench.parent
    try:
        prepare_out_dir(out_dir)
    except SpecterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    written = plot_all(bench, out_dir, stem=ns.bench.stem)
    for path in written:
        print(path)
    if not written:
        print(f"error: nothing to plot in {ns.bench}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] == "plot":
            return plot(argv[1:])
        return run(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    from specter.interrupts import exit_status

    sys.exit(exit_status(main()))
