"""Command line: ``python -m specter.run RECIPE [--set key=value ...] [--report out.json]``.

Contract: loads and validates the recipe (errors: one line on stderr, exit code 2, no traceback),
runs it through ``specter.api.run_recipe``, prints each prompt's generated text and a summary
table on stdout, progress on stderr, and with ``--report`` writes the JSON report.
``--list-plugins`` prints the registered plugins by kind; ``--explain`` every recipe key.
``--probe [TEXTFILE]`` (engine ``specter``) also measures teacher-forced draft/target agreement
(``specter.bench.probe``) on TEXTFILE or the recipe's prompts, prints it, and reports it under ``probe``.
The ``--report`` path is checked for writability before any work. ``--debug`` adds the traceback
to an error; ``--verbose`` lets third-party libraries print their own warnings and bars.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

EXIT_USAGE = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m specter.run",
        description="Run a Specter recipe: generate text with an MoE model whose experts are offloaded.",
    )
    parser.add_argument("recipe", nargs="?", help="recipe YAML file (see recipes/)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key, e.g. --set offload.expert_budget=0.25 (repeatable)")
    parser.add_argument("--report", type=Path, help="write the JSON report here")
    parser.add_argument("--list-plugins", action="store_true", help="print the registered plugins and exit")
    parser.add_argument("--explain", action="store_true", help="print every recipe key with its type, default and doc")
    parser.add_argument("--probe", nargs="?", const="", metavar="TEXTFILE",
                        help="engine specter: also measure teacher-forced draft/target agreement on TEXTFILE "
                             "(.jsonl or text; default: the recipe's prompts)")
    parser.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
    parser.add_argument("--verbose", action="store_true",
                        help="let third-party libraries print their own warnings and progress bars")
    parser.add_argument("--debug", action="store_true", help="on an error, print the traceback too")
    return parser.parse_args(argv)


def progress_printer(quiet: bool):
    started = time.perf_counter()

    def say(message: str) -> None:
        if not quiet:
            print(f"[{time.perf_counter() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    return say


def main(argv: list[str] | None = None) -> int:
    from specter.errors import SpecterError

    args = parse_args(argv)
    if args.verbose:
        from specter.quiet import unquiet

        unquiet()
    from specter.quiet import one_line_warnings

    one_line_warnings()
    try:
        if args.report:
            check_writable(args.report)
        if args.list_plugins:
            from specter.plugins import format_plugin_list

            print(format_plugin_list())
            return 0
        if args.explain:
            from specter.config import describe

            print(describe())
            return 0
        if not args.recipe:
            print("error: a recipe file is required (try recipes/quickstart.yaml)", file=sys.stderr)
            return EXIT_USAGE
        from specter.config import load_recipe
        from specter.interrupts import deferred

        with deferred():  # the plugin registry imports torch
            recipe = load_recipe(args.recipe, args.overrides)  # validate before the heavy imports
        from specter.config.unused import override_keys, unused_settings

        for key, reason in unused_settings(recipe, override_keys(args.overrides)):
            print(f"warning: {key} has no effect: {reason}", file=sys.stderr)
        with deferred():
            from specter.api import run_recipe
            from specter.report.schema import format_summary

        if args.probe is not None:
            from specter.bench.probe import probe_recipe, probe_texts

            texts = probe_texts(recipe, args.probe or None)
        say = progress_printer(args.quiet)
        result = run_recipe(recipe, progress=say)
        if args.probe is not None:
            say("probing draft/target agreement ...")
            result.report["probe"] = probe_recipe(recipe, texts)
    except SpecterError as error:
        if args.debug:
            import traceback

            traceback.print_exc()
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

    prompts_text = recipe.resolved_prompts()
    for index, (prompt, text) in enumerate(zip(prompts_text, result.texts)):
        prompt_shown = prompt if isinstance(prompt, str) else str(prompt)
        print(f"=== prompt {index + 1} ===")
        print(prompt_shown)
        print(f"--- continuation ({len(result.token_ids[index])} tokens) ---")
        print(f"\033[1m{text}\033[0m" if sys.stdout.isatty() else text)
    print("=== summary ===")
    print(format_summary(result.report))
    if "probe" in result.report:
        from specter.bench.probe import format_probe

        print("=== probe ===")
        print(format_probe(result.report["probe"]))
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(result.report, indent=2) + "\n")
        print(f"report written to {args.report}")
    return 0


def check_writable(path: Path) -> None:
    """Refuse, before any work, a ``--report`` path that cannot be written."""
    from specter.errors import SpecterError

    existed = path.exists()
    try:
        if path.is_dir():
            raise IsADirectoryError("it is a directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8"):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        raise SpecterError(f"--report: cannot write {path}: {reason}") from None
    if not existed:
        path.unlink()


def entry_point() -> int:
    try:
        code = main()
    except BrokenPipeError:  # e.g. `--explain | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    from specter.interrupts import exit_status

    return exit_status(code)


if __name__ == "__main__":
    sys.exit(entry_point())
