"""Requests to prompt token ids, checked against the model before a request may queue.

Contract: ``Prompts(engine, default_max_tokens)`` tokenizes on the event loop with its own copy of
the engine's tokenizer (the engine's own is used only by the worker thread, so the two threads
never share a tokenizer object) and encodes text the way ``engine.encode`` does (no special
tokens added; an empty text becomes the BOS token), so greedy text through the server equals
``engine.generate``'s and ``python -m specter.run``'s for the same prompt.

- ``completion_ids(request)``: the prompt's ids (text or token ids as given); token ids must be
  below ``vocab_size``: the model's input embedding rows where the engine's model says (the ids
  the model can embed: a tokenizer's added tokens may lie past them, a padded embedding beyond the
  tokenizer), else the tokenizer's length; ``ApiError`` 400 naming the id otherwise.
- ``chat_ids(request)``: the messages rendered with the tokenizer's chat template
  (``add_generation_prompt=True``); ``ApiError`` 400 (code ``chat_template_missing``) when the
  tokenizer has none, 400 when the template refuses the conversation (its own
  ``raise_exception``: a rule about the messages); 500 (code ``chat_template_invalid``) when the
  template is broken, the server's fault rather than the request's: it does not parse (known at
  start: ``template_problem``, logged then as a warning) or it fails on these messages otherwise
  (an undefined name, a type error). Either way the message names ``--chat-template FILE``.
- ``max_tokens(requested, ids)``: ``requested`` (the request's ``max_tokens``), else the recipe's
  ``max_new_tokens`` capped to what the context has left; ``ApiError`` 400 (code
  ``context_length_exceeded``) when prompt plus ``max_tokens`` does not fit the model
  (``engine.check_context``).
- ``chat_template`` (read/write): the template in use; ``--chat-template FILE`` sets it. Setting
  one that is not valid Jinja raises ``SpecterError`` naming its line, so a broken template stops
  the server at start instead of answering every chat request with an error. The template the
  tokenizer ships is parsed when ``Prompts`` is made: one that does not parse leaves
  ``template_problem`` ("line N: ...") and a warning; completions are served as usual.
"""

from __future__ import annotations

import copy
import logging
from typing import Sequence

import jinja2

from specter.decode.prompt_check import embedding_rows
from specter.errors import SpecterError
from specter.serve.protocol import ApiError, ChatRequest, CompletionRequest

log = logging.getLogger("specter.serve")
_FIX = "start the server with --chat-template FILE (a Jinja chat template) to replace it"


class Prompts:
    def __init__(self, engine, default_max_tokens: int) -> None:
        self.engine = engine
        self.default_max_tokens = default_max_tokens
        self.tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
        rows = embedding_rows(getattr(engine, "model", None))
        self.vocab_size = rows if rows is not None else len(self.tokenizer) if self.tokenizer is not None else None
        self.template_problem = template_syntax_problem(self.chat_template) if self.chat_template else None
        if self.template_problem is not None:
            log.warning("the tokenizer's chat template does not parse (%s): chat requests will fail; %s",
                        self.template_problem, _FIX)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) if self.tokenizer is not None else None

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        if self.tokenizer is None:
            raise SpecterError("chat template: the model ships no tokenizer")
        problem = template_syntax_problem(template) if template is not None else None
        if problem is not None:
            raise SpecterError(f"chat template: {problem}")
        self.tokenizer.chat_template = template
        self.template_problem = None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "the model ships no tokenizer: send the prompt as token ids", param="prompt")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids or [self.tokenizer.bos_token_id or 0]

    def completion_ids(self, request: CompletionRequest) -> list[int]:
        prompt = request.single_prompt()
        if isinstance(prompt, str):
            return self.encode(prompt)
        if self.vocab_size is not None and max(prompt) >= self.vocab_size:
            raise ApiError(400, f"prompt: token id {max(prompt)} is outside the vocabulary (size {self.vocab_size})",
                           param="prompt")
        return prompt

    def chat_ids(self, request: ChatRequest) -> list[int]:
        if not self.chat_template:
            raise ApiError(
                400, "this model's tokenizer has no chat template, so /v1/chat/completions cannot format "
                     "messages; use /v1/completions with a plain prompt, or start the server with "
                     "--chat-template FILE", param="messages", code="chat_template_missing")
        if self.template_problem is not None:
            raise ApiError(500, f"the model's chat template does not parse ({self.template_problem}); {_FIX}",
                           type="server_error", param="messages", code="chat_template_invalid")
        conversation = request.conversation()
        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except jinja2.TemplateError as error:
            if type(error) is jinja2.TemplateError:  # the template's raise_exception: its rule about the messages
                raise ApiError(400, f"messages: the chat template refused them: {error}", param="messages") from None
            raise _broken(error) from None  # undefined names, a syntax error transformers found
        except Exception as error:  # a type error and the like inside the template: its bug, not the request's
            raise _broken(error) from None
        return self.encode(text)

    def max_tokens(self, requested: int | None, ids: Sequence[int]) -> int:
        limit = self.engine.context_length
        if requested is None:
            requested = self.default_max_tokens
            if limit is not None and len(ids) < limit:
                requested = min(requested, limit - len(ids))
        try:
            self.engine.check_context(ids, requested)
        except SpecterError as error:
            if limit is None or not ids:
                raise ApiError(400, f"{error}", param="prompt", code="context_length_exceeded") from None
            if len(ids) >= limit:
                message = (f"prompt: {len(ids)} tokens leave no room to generate in the model's context of "
                           f"{limit} positions; shorten the prompt")
            else:
                message = (f"max_tokens: the prompt's {len(ids)} tokens + max_tokens {requested} = "
                           f"{len(ids) + requested} positions exceed the model's context of {limit}; at most "
                           f"{limit - len(ids)} fit")
            raise ApiError(400, message, param="max_tokens" if len(ids) < limit else "prompt",
                           code="context_length_exceeded") from None
        return requested


def template_syntax_problem(template: str) -> str | None:
    """``"line N: message"`` where ``template`` is not valid Jinja, else None (parsing only, with
    the loop-control extension transformers' templates may use)."""
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as error:
        return f"line {error.lineno}: {error.message}"
    return None


def _broken(error: Exception) -> ApiError:
    return ApiError(500, f"the chat template failed on these messages ({type(error).__name__}: {error}); {_FIX}",
                    type="server_error", param="messages", code="chat_template_invalid")
