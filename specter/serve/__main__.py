"""Command line: ``python -m specter.serve RECIPE [--host 127.0.0.1] [--port 8000] [--set key=value ...]
[--api-key KEY] [--queue-depth N] [--model-name NAME] [--chat-template FILE]``.

Contract: validates the recipe (a mistake: one line on stderr, exit code 2, as ``python -m
specter.run``), checks that the address can be bound, loads the recipe's engine once, then serves
it with uvicorn until interrupted (Ctrl-C: waiting requests are answered 503 ``shutting_down`` at
once, the decoding one is stopped at its next step and told the same, a stream as its last event;
then the engine is closed). Binds to 127.0.0.1 unless ``--host`` says otherwise; the API key comes from
``--api-key`` or else the environment variable ``SPECTER_API_KEY`` (none: no check).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
from pathlib import Path

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

EXIT_USAGE = 2
API_KEY_ENV = "SPECTER_API_KEY"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from specter.serve import DEFAULT_QUEUE_DEPTH

    parser = argparse.ArgumentParser(
        prog="python -m specter.serve",
        description="Serve a Specter recipe's engine behind an OpenAI-compatible HTTP API "
                    "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics).",
    )
    parser.add_argument("recipe", help="recipe YAML file (see recipes/), e.g. recipes/quickstart.yaml")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=_port, default=8000, help="port, 1-65535 (default 8000)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key, e.g. --set offload.expert_budget=0.25 (repeatable)")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1 and /metrics (default: ${API_KEY_ENV} if set)")
    parser.add_argument("--queue-depth", type=int, default=DEFAULT_QUEUE_DEPTH, metavar="N",
                        help=f"requests that may wait while one decodes; beyond: 429 (default {DEFAULT_QUEUE_DEPTH})")
    parser.add_argument("--model-name", default=None,
                        help="the model id clients send and /v1/models lists (default: the recipe's model)")
    parser.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                        help="a Jinja chat template to use instead of the tokenizer's (e.g. for a model without one)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="uvicorn's log level (default info)")
    return parser.parse_args(argv)


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be 1-65535, got {port}")
    return port


def check_bindable(host: str, port: int) -> None:
    from specter.errors import SpecterError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as error:
        raise SpecterError(f"--host: cannot resolve {host!r}: {error}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            raise SpecterError(f"--port: cannot listen on {host}:{port}: {error.strerror or error}") from None


def make_server(app, **config):
    """A uvicorn server for ``app`` (``create_app``'s) whose Ctrl-C (or SIGTERM) first closes the
    app's scheduler, so every open request is told at once rather than after the grace time."""
    import uvicorn

    scheduler = app.state.server.scheduler

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            scheduler.close(timeout=0)
            super().handle_exit(sig, frame)

    return Server(uvicorn.Config(app, timeout_graceful_shutdown=5, **config))


def main(argv: list[str] | None = None) -> int:
    from specter.errors import SpecterError

    args = parse_args(argv)
    from specter.quiet import one_line_warnings

    one_line_warnings()
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None  # "" in env: unset
    try:
        if api_key is not None and not api_key.strip():
            raise SpecterError("--api-key: empty (an unset variable?); leave the option out to serve without a key")
        if args.queue_depth < 0:
            raise SpecterError(f"--queue-depth: must be >= 0, got {args.queue_depth}")
        from specter.api import as_recipe

        recipe = as_recipe(args.recipe, args.overrides)  # validate before the heavy work
        template = None
        if args.chat_template is not None:
            try:
                template = args.chat_template.read_text()
            except OSError as error:
                raise SpecterError(f"--chat-template: cannot read {args.chat_template}: {error.strerror}") from None
            from specter.serve.prompts import template_syntax_problem

            problem = template_syntax_problem(template)
            if problem is not None:
                raise SpecterError(f"--chat-template: {args.chat_template}: {problem}")
        check_bindable(args.host, args.port)
        if args.host not in LOOPBACK and not api_key:
            print(f"warning: serving on {args.host} without an API key: anyone who reaches this address can use it "
                  f"(set --api-key or ${API_KEY_ENV})", file=sys.stderr)
        print(f"loading {recipe.model} for engine {recipe.engine} ...", file=sys.stderr, flush=True)
        from specter.api import load

        engine = load(recipe)
    except SpecterError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

    from specter.serve.app import ServeConfig, create_app

    try:
        config = ServeConfig(model_name=args.model_name, api_key=api_key, queue_depth=args.queue_depth,
                             chat_template=template)
        app = create_app(engine, recipe, config)
        name = app.state.server.model_name
        shown = f"[{args.host}]" if ":" in args.host else args.host
        print(f"serving {name} (engine {recipe.engine}) at http://{shown}:{args.port}/v1"
              + (" (API key required)" if api_key else ""), file=sys.stderr, flush=True)
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn raises the signal it caught again once stopped
            make_server(app, host=args.host, port=args.port, log_level=args.log_level).run()
    except SpecterError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
