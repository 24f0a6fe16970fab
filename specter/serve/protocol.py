"""OpenAI request bodies: parsing, type checks and the error shape.

Contract:
- ``parse(raw_body, CompletionRequest | ChatRequest)`` returns the validated request or raises
  ``ApiError`` (status 400): malformed JSON, a body that is not an object, a known field of the
  wrong type (types are strict: ``"5"`` is not an integer, ``true`` is not a number), or a value
  out of range (``max_tokens`` < 1, ``temperature`` outside [0, 2], ``top_p`` outside (0, 1],
  ``n`` other than 1, more than 4 stop strings, ...). Unknown fields are ignored, as OpenAI-style
  servers do; known OpenAI fields Specter does not implement (``logprobs``, ``echo``, ``suffix``,
  ``best_of`` > 1, ``logit_bias``, penalties, ``tools``, a non-text ``response_format``) are
  refused with a 400 naming the field when they ask for something.
- ``ApiError(status, message, ...)`` carries the OpenAI error object
  ``{"error": {"message", "type", "param", "code"}}`` and optional headers (``Retry-After``).
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MAX_STOP_STRINGS = 4


_FROM_STATUS = "from status"


class ApiError(Exception):
    """An OpenAI-shaped error answer. ``outcome``: what ``requests_total`` counts for it when it is
    answered: by default ``rejected_invalid`` for a 4xx and ``failed`` for a 5xx; None where the
    request was counted already (a full queue, a job the scheduler ended) or is no request outcome."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None,
                 outcome: str | None = _FROM_STATUS) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}
        self.outcome = ("rejected_invalid" if status < 500 else "failed") if outcome == _FROM_STATUS else outcome

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what torch's generator takes
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _check_common(self):
        if self.max_tokens is not None and self.max_tokens < 1:
            raise _field_error("max_tokens", f"must be an integer >= 1, got {self.max_tokens}")
        if self.n not in (None, 1):
            raise _field_error("n", f"only n=1 is supported (the engine decodes one sequence), got {self.n}")
        stops = self.stop_strings()
        if len(stops) > MAX_STOP_STRINGS:
            raise _field_error("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(s == "" for s in stops):
            raise _field_error("stop", "stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise _field_error(name, "is not supported by Specter (only 0)")
        if self.logit_bias:
            raise _field_error("logit_bias", "is not supported by Specter")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is a string, a list of one string, a list of token
    ids, or a list of one list of token ids."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check_completion(self):
        if self.logprobs is not None:
            raise _field_error("logprobs", "is not supported by Specter")
        if self.echo:
            raise _field_error("echo", "is not supported by Specter")
        if self.suffix:
            raise _field_error("suffix", "is not supported by Specter")
        if self.best_of not in (None, 1):
            raise _field_error("best_of", "only best_of=1 is supported")
        self.single_prompt()
        return self

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids); several prompts in one request are refused."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise _field_error("prompt", "must not be empty")
        if isinstance(prompt[0], int):
            return _token_ids(prompt)
        if len(prompt) != 1:
            raise _field_error("prompt", f"one prompt per request (the engine is batch-1), got {len(prompt)}")
        return prompt[0] if isinstance(prompt[0], str) else _token_ids(prompt[0])


def _token_ids(ids: list[int]) -> list[int]:
    if not ids:
        raise _field_error("prompt", "must not be empty")
    if any(i < 0 for i in ids):
        raise _field_error("prompt", "token ids must be >= 0")
    return list(ids)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"messages[{index}].content: only text parts are supported, got {part.type!r}",
                               param=f"messages[{index}].content")
            texts.append(part.text)
        return "".join(texts)


class ChatRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    response_format: dict | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 1:
                raise _field_error("max_completion_tokens", f"must be an integer >= 1, got {self.max_completion_tokens}")
            self.max_tokens = self.max_completion_tokens  # OpenAI's current name wins over max_tokens
        if self.logprobs or self.top_logprobs:
            raise _field_error("logprobs" if self.logprobs else "top_logprobs", "is not supported by Specter")
        if self.tools or self.functions or self.tool_choice not in (None, "none", "auto"):
            field = "tools" if self.tools else "functions" if self.functions else "tool_choice"
            raise _field_error(field, "tool calling is not supported by Specter")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise _field_error("response_format", "only {\"type\": \"text\"} is supported")
        return self

    def conversation(self) -> list[dict]:
        """The messages as the ``[{"role", "content"}]`` list chat templates expect."""
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]


class _FieldError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def _field_error(param: str, message: str) -> _FieldError:
    return _FieldError(param, message)


def parse(raw: bytes, model: type[_Common]) -> _Common:
    """Validate a request body; every problem becomes an ``ApiError`` with status 400."""
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        raise _api_error(error) from None


def _api_error(error: ValidationError) -> ApiError:
    first = error.errors(include_url=False)[0]
    kind, loc = first.get("type", ""), [str(p) for p in first.get("loc", ())]
    if kind == "json_invalid":
        return ApiError(400, f"malformed JSON in the request body: {first.get('msg')}")
    if kind == "model_type" and not loc:
        return ApiError(400, "the request body must be a JSON object")
    original = (first.get("ctx") or {}).get("error")
    if isinstance(original, _FieldError):
        return ApiError(400, str(original), param=original.param)
    if isinstance(original, ApiError):
        return original
    # pydantic names every member of a union it tried: keep the field path only
    fields = [p for p in loc if not _is_type_tag(p)]
    param = ".".join(fields) or None
    if kind == "missing":
        return ApiError(400, f"{param}: is required", param=param)
    return ApiError(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param=param)


def _is_type_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "dict", "list", "none") or part.startswith(("list[", "dict["))


__all__ = ["ApiError", "ChatRequest", "CompletionRequest", "Message", "parse"]
