"""``python -m specter.bench RECIPE [options]`` runs a bench; ``python -m specter.bench plot
BENCH.json [--out DIR]`` redraws its plots (``plot``). See ``specter.bench.spec`` for the bench
recipe, ``specter.bench.sweep`` for what is measured, ``specter.bench.plots`` for the figures and
``specter.bench.output`` for the output folder.

``plot(argv)`` takes the arguments after ``plot`` (a leading ``plot`` is dropped), writes next to
the JSON file unless ``--out`` is given, prints each written path and returns 0; it returns 2
(one line, ``error: ...``) when the file is not a readable ``specter.bench/2`` document (one whose
fields have the wrong types included: ``output.document_problem``) or the output folder cannot
be written (``output.prepare_out_dir``; the bench's own ``--out`` is checked the same way), and 1
when nothing could be drawn.

A mistake in the recipe or the options (the output folder included) is one line on stderr
(``error: ...``; one about a sweep key given as an option names the option: ``--repeats
(sweep.repeats): ...``) and exit code 2, before any engine is built. ``--k`` or ``--governors``
without the specter engine is a warning. The bench writes ``<title>.json`` and ``<title>.md``
(each whole or not at all: ``output.write_atomic``) only once every cell has run, then the plots
(``<title>-<figure>.png``, the names ``plot`` redraws; ``--no-plots`` warns about an earlier
run's plots left in the folder). Ctrl-C prints one line starting ``interrupted`` (saying what was
written, and removing the output folder the run created while it is still empty) and exits 130.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from specter.bench.spec import BenchSpec

DESCRIPTION = """\
Run engines side by side in one process: every cell of a sweep over expert budgets, links, fixed
k values, governors and eager/compiled, interleaved and repeated. Writes <title>.json
(specter.bench/2), <title>.md (the tables) and PNG plots into reports/<title>/ or --out, once
every cell has run. RECIPE is a bench recipe (title, run, sweep: see specter/bench/spec.py) or a
plain run recipe, benched as one cell. The sweep options below replace the recipe's sweep keys.

A quick check (about half a minute):
  python -m specter.bench recipes/bench-bundled.yaml --engines resident,specter --budgets 0.25 \\
    --links '{l: {kind: local}}' --k 4 --governors '' --compile eager --repeats 1 \\
    --warmup-tokens 4 --set max_prompts=1 --set max_new_tokens=8"""

EPILOG = """\
python -m specter.bench plot BENCH.json [--out DIR]
  redraws the PNG plots of a bench's JSON file (next to it unless --out is given);
  see python -m specter.bench plot --help."""

class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose mistakes are one line on stderr, ``error: ...``, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


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


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


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


def _out(text: str) -> Path:
    from specter.bench.output import out_dir_argument

    return out_dir_argument(text)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(
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
    parser.add_argument("--repeats", type=_int,
                        help="timed runs of every engine in every cell (replaces sweep.repeats)")
    parser.add_argument("--warmup-tokens", dest="warmup_tokens", type=_int, metavar="N",
                        help="untimed tokens every engine generates in every cell before its timed runs, at "
                             "least 1 (replaces sweep.warmup_tokens)")
    parser.add_argument("--twins", type=_csv, help="comma-separated row labels run twice as identical engines "
                        "(A/A: the run's noise floor), e.g. 'specter k=4'; '' for none. Twins of rows that "
                        "--engines, --k or --governors leave out are dropped")
    parser.add_argument("--out", type=_out, help="output directory (default: reports/<title>); files of an "
                                                 "earlier run of the same title there are replaced")
    parser.add_argument("--no-plots", action="store_true", help="write JSON and markdown only")
    return parser.parse_args(argv)


def naming_option(text: str, given: Iterable[str]) -> str:
    """``text`` (a ``load_bench`` mistake) naming the option where it is about a sweep key that
    the command line gave (``given``): ``sweep.repeats: ...`` -> ``--repeats (sweep.repeats): ...``."""
    from specter.bench.spec import SWEEP_OPTIONS

    head, sep, rest = text.partition(": ")
    for key in given:
        if sep and (head == f"sweep.{key}" or head.startswith((f"sweep.{key}.", f"sweep.{key}["))):
            return f"{SWEEP_OPTIONS[key]} ({head}): {rest}"
    return text


def run(argv: list[str]) -> int:
    args = parse_args(argv)
    from specter.interrupts import deferred
    from specter.quiet import one_line_warnings

    one_line_warnings()

    with deferred():  # torch, transformers: an interrupt inside an import leaves them half-initialised
        from specter.bench.output import prepare_out_dir
        from specter.bench.spec import SWEEP_OPTIONS, load_bench
        from specter.errors import SpecterError

    sweep = {key: getattr(args, key) for key in SWEEP_OPTIONS if getattr(args, key) is not None}
    try:
        spec = load_bench(args.recipe, args.overrides, sweep)
        for key, instead in spec.unused:
            print(f"warning: {key} has no effect: the bench sets it in every cell; {instead}", file=sys.stderr)
        for key in ("k", "governors"):
            if sweep.get(key) and "specter" not in spec.engines:
                print(f"warning: {SWEEP_OPTIONS[key]} has no effect: it makes specter rows, and the engines "
                      f"({', '.join(spec.engines)}) leave specter out", file=sys.stderr)
        out_dir = args.out or Path("reports") / spec.title
        created = prepare_out_dir(out_dir)
    except SpecterError as error:
        print(f"error: {naming_option(str(error), sweep)}", file=sys.stderr)
        return 2
    command = "python -m specter.bench " + " ".join(shlex.quote(a) for a in argv)
    document = _measure(spec, command, out_dir, created)
    if isinstance(document, int):
        return document
    return _write(document, spec.title, out_dir, args.no_plots)


def _measure(spec: BenchSpec, command: str, out_dir: Path, created: Path | None) -> dict | int:
    """The bench's document, or the exit code of a run that stopped (any other exception goes
    on); a run that stops removes the output folder it created while still empty."""
    from specter.bench.output import drop_if_empty
    from specter.bench.sweep import run_bench
    from specter.errors import SpecterError

    try:
        return run_bench(spec, command)
    except BaseException as error:
        drop_if_empty(out_dir, created)
        if isinstance(error, KeyboardInterrupt):
            print(f"interrupted: nothing written (the bench writes {spec.title}.json and .md once every cell "
                  "has run)", file=sys.stderr)
            return 130
        if isinstance(error, SpecterError):
            print(f"error: {error}", file=sys.stderr)
            return 2
        raise


def _write(document: dict, title: str, out_dir: Path, no_plots: bool) -> int:
    from specter.bench.output import earlier_plots, write_atomic
    from specter.bench.tables import markdown

    json_path, md_path = out_dir / f"{title}.json", out_dir / f"{title}.md"
    write_atomic(json_path, json.dumps(document, indent=2) + "\n")
    table = markdown(document)
    write_atomic(md_path, table)
    print(table)
    print(f"wrote {json_path} and {md_path}")
    redraw = f"python -m specter.bench plot {shlex.quote(str(json_path))}"
    if no_plots:
        if earlier := earlier_plots(out_dir, title):
            print(f"warning: {out_dir} holds {len(earlier)} plot(s) of an earlier run ({earlier[0].name}, ...), "
                  f"not of this one; redraw them with {redraw}", file=sys.stderr)
        return 0
    from specter.bench.plots import plot_all

    try:
        for path in plot_all(document, out_dir, stem=title):
            print(f"wrote {path}")
    except KeyboardInterrupt:
        print(f"interrupted while drawing the plots ({json_path.name} and {md_path.name} are written); redraw them "
              f"with {redraw}", file=sys.stderr)
        return 130
    return 0


def plot(argv: list[str]) -> int:
    """The ``plot`` subcommand (see the module docstring)."""
    from specter.bench.output import document_problem, prepare_out_dir
    from specter.bench.plots import plot_all
    from specter.errors import SpecterError

    args = list(argv)
    if args[:1] == ["plot"]:
        args = args[1:]
    parser = OneLineParser(prog="python -m specter.bench plot",
                           description="Render a specter.bench/2 JSON file as PNG figures.")
    parser.add_argument("bench", type=Path, help="bench JSON written by python -m specter.bench")
    parser.add_argument("--out", type=_out, default=None, help="output folder (default: the JSON file's folder)")
    ns = parser.parse_args(args)
    try:
        bench = json.loads(ns.bench.read_text())
    except (OSError, ValueError) as exc:
        print(f"error: cannot read {ns.bench}: {exc}", file=sys.stderr)
        return 2
    problem = document_problem(bench)
    if problem is not None:
        print(f"error: {ns.bench} is {problem}" if problem.startswith("not a ")
              else f"error: {ns.bench} is not a valid specter.bench/2 document: {problem}", file=sys.stderr)
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
