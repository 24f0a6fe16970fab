"""The ASGI application: routes, authentication, request flow, errors.

Contract: ``create_app(engine, recipe, config)`` returns a Starlette app serving one loaded engine
(see ``specter.serve`` for the endpoints). It starts the engine's worker thread
(``specter.serve.scheduler``) at once and stops it on lifespan shutdown; it never closes the
engine (the caller owns it). Every request is checked on the event loop before it may queue:
API key (when ``config.api_key`` is set; ``/health`` stays open), body, model name, prompt
length against the context; any problem answers with the OpenAI error shape and a 4xx status (a 500
with code ``chat_template_invalid`` where the server's own chat template is broken) and touches
neither the queue nor the request decoding. Each request is counted in ``requests_total`` once:
an error answer by its ``ApiError.outcome`` (a job the scheduler ended was counted there). Each response carries ``usage`` and the
``specter`` extension field; a client that disconnects (streamed or not) cancels its job.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from specter.errors import SpecterError
from specter.serve import DEFAULT_QUEUE_DEPTH
from specter.serve.metrics import ServerMetrics
from specter.serve.prompts import Prompts
from specter.serve.protocol import ApiError, ChatRequest, CompletionRequest, parse
from specter.serve.responses import SSE_DONE, Shapes, sse
from specter.serve.scheduler import Cancelled, Delta, Done, Failed, Job, QueueFull, SamplingParams, Scheduler

log = logging.getLogger("specter.serve")


@dataclass
class ServeConfig:
    """model_name: the id clients send as ``model`` (default: the recipe's ``model``);
    api_key: required as ``Authorization: Bearer KEY`` when set; queue_depth: most requests
    waiting for the engine (the one decoding not counted); chat_template: a Jinja template that
    replaces the tokenizer's; default_max_tokens: ``max_tokens`` when a request gives none
    (default: the recipe's ``max_new_tokens``)."""

    model_name: str | None = None
    api_key: str | None = None
    queue_depth: int = DEFAULT_QUEUE_DEPTH
    chat_template: str | None = None
    default_max_tokens: int | None = None


class ServerState:
    def __init__(self, engine, recipe, config: ServeConfig) -> None:
        self.engine, self.recipe, self.config = engine, recipe, config
        self.model_name = config.model_name or str(recipe.model)
        self.engine_name = str(recipe.engine)
        self.started = int(time.time())
        self.metrics = ServerMetrics(self.model_name, self.engine_name, config.queue_depth)
        self.prompts = Prompts(engine, config.default_max_tokens or recipe.max_new_tokens)
        if config.chat_template is not None:
            self.prompts.chat_template = config.chat_template
        self.scheduler = Scheduler(engine, config.queue_depth, self.metrics, self.engine_name)

    # --- checks -------------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if not self.config.api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.config.api_key.encode()):
            raise ApiError(401, "invalid or missing API key: send it as 'Authorization: Bearer KEY'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def sampling(self, request) -> SamplingParams:
        recipe = self.recipe.sampling
        try:
            return SamplingParams(
                temperature=recipe.temperature if request.temperature is None else float(request.temperature),
                top_p=recipe.top_p if request.top_p is None else float(request.top_p),
                top_k=recipe.top_k,
            )
        except ValueError as error:
            raise ApiError(400, str(error), param=str(error).split(":")[0]) from None

    # --- the request flow ---------------------------------------------------------------------
    async def respond(self, request: Request, body, ids: list[int], shapes: Shapes) -> Response:
        max_tokens = self.prompts.max_tokens(body.max_tokens, ids)
        job = Job(prompt_ids=ids, max_tokens=max_tokens, sampling=self.sampling(body),
                  seed=body.seed if body.seed is not None else secrets.randbits(63), stop=body.stop_strings())
        try:
            self.scheduler.submit(job)
        except QueueFull as full:
            self.metrics.count_request("rejected_queue_full")
            raise ApiError(429, str(full), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(full.retry_after_s)}, outcome=None) from None
        except RuntimeError as error:
            raise ApiError(503, str(error), type="server_error", code="shutting_down", outcome=None) from None
        if body.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(self._stream(request, job, shapes, body.include_usage),
                                     media_type="text/event-stream", headers=headers)
        return await self._collect(request, job, shapes)

    async def _collect(self, request: Request, job: Job, shapes: Shapes) -> Response:
        watcher = asyncio.create_task(self._watch_disconnect(request, job))
        try:
            while True:
                event = await job.events.get()
                if isinstance(event, Done):
                    return JSONResponse(shapes.full(event))
                if isinstance(event, Failed):
                    raise _failure(event.error)
                if isinstance(event, Cancelled):
                    raise _cancelled(event)
        finally:
            watcher.cancel()
            self.scheduler.cancel(job)

    async def _stream(self, request: Request, job: Job, shapes: Shapes, include_usage: bool) -> AsyncIterator[bytes]:
        watcher = asyncio.create_task(self._watch_disconnect(request, job))
        try:
            opening = shapes.opening()
            if opening is not None:
                yield sse(opening)
            while True:
                event = await job.events.get()
                if isinstance(event, Delta):
                    yield sse(shapes.delta(event.text))
                elif isinstance(event, Done):
                    yield sse(shapes.closing(event))
                    if include_usage:
                        yield sse(shapes.usage_chunk(event))
                    yield SSE_DONE
                    return
                elif isinstance(event, Failed):
                    yield sse(_failure(event.error).body())
                    yield SSE_DONE
                    return
                elif event.by_shutdown:  # Cancelled: the client is still there to be told
                    yield sse(_cancelled(event).body())
                    yield SSE_DONE
                    return
                else:  # Cancelled: the client went away, nobody to tell
                    return
        finally:
            watcher.cancel()
            self.scheduler.cancel(job)

    async def _watch_disconnect(self, request: Request, job: Job) -> None:
        """Cancel ``job`` when the client goes away (the body has been read: what remains on
        the receive channel is the disconnect)."""
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    self.scheduler.cancel(job)
                    return


def _cancelled(event: Cancelled) -> ApiError:
    if event.by_shutdown:
        return ApiError(503, "the server is shutting down: the request was cancelled", type="server_error",
                        code="shutting_down", outcome=None)  # the scheduler counted the job
    return ApiError(503, "the request was cancelled (the client went away)", type="server_error", code="cancelled",
                    outcome=None)


def _failure(error: BaseException) -> ApiError:
    """A job that failed (the scheduler counted it as failed)."""
    if isinstance(error, SpecterError):
        return ApiError(400, str(error), outcome=None)
    log.error("generation failed", exc_info=(type(error), error, error.__traceback__))
    return ApiError(500, f"generation failed: {type(error).__name__}: {error}", type="server_error", outcome=None)


def _state(request: Request) -> ServerState:
    return request.app.state.server


# --- routes ------------------------------------------------------------------------------------
async def health(request: Request) -> Response:
    state = _state(request)
    return JSONResponse({"status": "ok", "model": state.model_name, "engine": state.engine_name,
                         "busy": state.scheduler.busy, "queue_depth": state.scheduler.queue_depth,
                         "queue_capacity": state.scheduler.depth})


async def metrics(request: Request) -> Response:
    state = _state(request)
    state.authorize(request)
    return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.started, "owned_by": "specter"}


async def list_models(request: Request) -> Response:
    state = _state(request)
    state.authorize(request)
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def get_model(request: Request) -> Response:
    state = _state(request)
    state.authorize(request)
    state.check_model(request.path_params["model"])
    return JSONResponse(_model_card(state))


async def completions(request: Request) -> Response:
    state = _state(request)
    state.authorize(request)
    body = parse(await request.body(), CompletionRequest)
    state.check_model(body.model)
    ids = state.prompts.completion_ids(body)
    return await state.respond(request, body, ids, Shapes("completion", state.model_name))


async def chat_completions(request: Request) -> Response:
    state = _state(request)
    state.authorize(request)
    body = parse(await request.body(), ChatRequest)
    state.check_model(body.model)
    ids = state.prompts.chat_ids(body)
    return await state.respond(request, body, ids, Shapes("chat", state.model_name))


# --- errors ------------------------------------------------------------------------------------
async def _api_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, ApiError)
    if error.outcome is not None:
        _state(request).metrics.count_request(error.outcome)
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    kind = "invalid_request_error" if error.status_code < 500 else "server_error"
    message = f"{request.method} {request.url.path}: {error.detail}"
    return JSONResponse(ApiError(error.status_code, message, type=kind).body(), status_code=error.status_code,
                        headers=dict(error.headers or {}))


async def _internal_error(request: Request, error: Exception) -> Response:
    log.error("unhandled error", exc_info=(type(error), error, error.__traceback__))
    return JSONResponse(ApiError(500, f"internal error: {type(error).__name__}", type="server_error").body(),
                        status_code=500)


def create_app(engine, recipe, config: ServeConfig | None = None) -> Starlette:
    state = ServerState(engine, recipe, config or ServeConfig())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        try:
            yield
        finally:
            state.scheduler.close()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    handlers = {ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.server = state
    return app
