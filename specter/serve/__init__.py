"""An OpenAI-compatible HTTP server for one Specter engine: ``python -m specter.serve RECIPE``.

Contract (details: docs/serve.md):
- The recipe's engine is loaded once. Endpoints: ``GET /v1/models``, ``GET /v1/models/{id}``,
  ``POST /v1/completions``, ``POST /v1/chat/completions`` (the tokenizer's chat template, or
  ``--chat-template FILE``; a 400 with code ``chat_template_missing`` when there is none, a 500
  with code ``chat_template_invalid`` when the tokenizer's is broken),
  ``GET /health`` and ``GET /metrics`` (Prometheus text). Request fields: ``model``, ``prompt`` /
  ``messages``, ``max_tokens`` (chat: also ``max_completion_tokens``), ``temperature``,
  ``top_p``, ``seed``, ``stop``, ``n`` (1 only), ``stream`` (server-sent events in OpenAI's
  chunk format, ending ``data: [DONE]``) and ``stream_options.include_usage``. A field left out
  takes the recipe's value (sampling, ``max_new_tokens``); ``seed`` left out is random.
- One request decodes at a time (the engine is batch-1) on one worker thread; the others wait in
  arrival order, at most ``--queue-depth`` of them, beyond which the answer is 429 with
  ``Retry-After``. A client that disconnects leaves the queue, or stops its decoding at the next
  step.
- Responses carry ``usage`` (prompt, completion, total tokens) and the extension field
  ``specter`` (engine, queue wait, time to first token, tokens/s, hit rate, acceptance, bytes
  moved); streamed responses carry ``specter`` in the chunk with the finish reason.
- Bad requests get ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status and
  never reach the engine. The server binds to 127.0.0.1 unless told otherwise; with an API key
  (``--api-key`` or ``SPECTER_API_KEY``) every path but ``/health`` needs
  ``Authorization: Bearer KEY``.

Python: ``create_app(engine, recipe, ServeConfig(...))`` returns the ASGI app for any ASGI server.
"""

__all__ = ["DEFAULT_QUEUE_DEPTH", "ServeConfig", "create_app"]

DEFAULT_QUEUE_DEPTH = 32  # requests that may wait while one decodes (--queue-depth)


def __getattr__(name: str):
    if name in ("ServeConfig", "create_app"):  # lazily: the CLI and the pure modules (textstream, protocol) stay light to import
        from specter.serve import app

        return getattr(app, name)
    raise AttributeError(f"module 'specter.serve' has no attribute {name!r}")
