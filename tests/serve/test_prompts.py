"""specter.serve.prompts without a model: requests become prompt ids the way the engine encodes
text (no special tokens; an empty text is the BOS token) with a private copy of the tokenizer;
token-id prompts are checked against the vocabulary; chat messages go through the chat template
with the generation prompt, and a missing or refusing template is a 400, a broken one (the
tokenizer's, not parsing: a warning at start; or failing on valid messages) a 500 naming
``--chat-template``; ``max_tokens`` takes the
request's value or the default capped to the context left, and a prompt that does not fit is a
400 naming the right field. The bundled model's real tokenizer is used where its behaviour matters
(copying, chat templates), a character-level fake where exact ids do."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from serve_support import CHAT_MESSAGES, CHAT_RENDERED, CHAT_TEMPLATE
from specter.decode.engine import Engine
from specter.errors import SpecterError
from specter.serve.prompts import Prompts
from specter.serve.protocol import ApiError, ChatRequest, CompletionRequest, parse

TOKENIZER = Path(__file__).resolve().parents[2] / "specter" / "data" / "tiny-moe"


class CharTokenizer:
    """An HF-like tokenizer: one id per character (its code point), BOS 1 added only when asked
    for special tokens (as HF tokenizers add them by default)."""

    bos_token_id = 1

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self.chat_template: str | None = None

    def __len__(self) -> int:
        return self.size

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + [ord(c) for c in text]}


class FakeEngine:
    """What Prompts uses of an engine: its tokenizer, context length and ``check_context`` (the
    real engine's check, run on this object, with every call logged)."""

    model_path = "fake-model"
    compiled = None

    def __init__(self, tokenizer, context_length: int | None = 64) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.checked: list[tuple[list[int], int]] = []

    def check_context(self, prompt_ids, max_new_tokens: int, label: str = "prompt") -> None:
        self.checked.append((list(prompt_ids), max_new_tokens))
        Engine.check_context(self, prompt_ids, max_new_tokens, label)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER))


def completion(prompt) -> CompletionRequest:
    return parse(json.dumps({"prompt": prompt}).encode(), CompletionRequest)


def chat(messages: list[dict]) -> ChatRequest:
    return parse(json.dumps({"messages": messages}).encode(), ChatRequest)


def refused(call, *args) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call(*args)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize("text", ["def fibonacci(n):\n", "  héllo wörld → 世界", "\n\n", "x"])
def test_text_is_encoded_as_the_engine_encodes_it(tokenizer, text):
    engine = FakeEngine(tokenizer)
    prompts = Prompts(engine, 16)
    expected = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert expected and prompts.encode(text) == expected == Engine.encode(engine, text)
    assert prompts.completion_ids(completion(text)) == expected
    assert prompts.completion_ids(completion([text])) == expected


def test_no_special_tokens_are_added_and_an_empty_text_is_the_bos_token():
    prompts = Prompts(FakeEngine(CharTokenizer()), 16)
    assert prompts.encode("ab") == [97, 98]
    assert prompts.encode("") == [CharTokenizer.bos_token_id]
    assert prompts.completion_ids(completion("")) == [1]


def test_the_tokenizer_is_a_private_copy(tokenizer):
    engine = FakeEngine(tokenizer)
    prompts = Prompts(engine, 16)
    assert prompts.tokenizer is not tokenizer and type(prompts.tokenizer) is type(tokenizer)
    assert prompts.vocab_size == len(tokenizer) == 4096
    assert prompts.chat_template is None
    prompts.chat_template = CHAT_TEMPLATE
    assert prompts.chat_template == CHAT_TEMPLATE and tokenizer.chat_template is None  # the engine's is untouched
    assert prompts.encode("import os") == Engine.encode(engine, "import os")


def test_token_id_prompts_are_checked_against_the_vocabulary():
    prompts = Prompts(FakeEngine(CharTokenizer(size=256)), 16)
    assert prompts.completion_ids(completion([5, 255, 0])) == [5, 255, 0]
    assert prompts.completion_ids(completion([[7, 8]])) == [7, 8]
    error = refused(prompts.completion_ids, completion([3, 256, 9]))
    assert error.param == "prompt"
    assert error.message == "prompt: token id 256 is outside the vocabulary (size 256)"


def test_token_ids_are_checked_against_the_models_embedding_where_it_has_one():
    """The model embeds ids below its embedding's rows: a tokenizer's added tokens past them are
    refused before they queue (they would fail inside generate), a padded embedding's rows beyond
    the tokenizer are taken; without a tokenizer the embedding still bounds them."""
    import torch

    for rows, tokenizer in ((200, CharTokenizer(size=256)), (300, CharTokenizer(size=256)), (200, None)):
        engine = FakeEngine(tokenizer)
        engine.model = torch.nn.Module()
        engine.model.get_input_embeddings = lambda rows=rows: torch.nn.Embedding(rows, 2)
        prompts = Prompts(engine, 16)
        assert prompts.vocab_size == rows
        assert prompts.completion_ids(completion([rows - 1])) == [rows - 1]
        error = refused(prompts.completion_ids, completion([rows]))
        assert error.message == f"prompt: token id {rows} is outside the vocabulary (size {rows})"


def test_a_chat_template_that_is_not_valid_jinja_is_refused_when_set(tokenizer):
    prompts = Prompts(FakeEngine(tokenizer), 16)
    with pytest.raises(SpecterError, match=r"^chat template: line 2: "):
        prompts.chat_template = "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}"
    assert prompts.chat_template is None  # left as it was
    prompts.chat_template = "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{% endfor %}"
    assert prompts.chat_template.startswith("{% for m")  # loop controls, as transformers allows


def test_without_a_tokenizer_only_token_ids_are_taken():
    prompts = Prompts(FakeEngine(None), 16)
    assert prompts.tokenizer is None and prompts.vocab_size is None and prompts.chat_template is None
    assert prompts.completion_ids(completion([10**6, 2])) == [10**6, 2]  # nothing to check them against
    error = refused(prompts.completion_ids, completion("def f():"))
    assert error.param == "prompt" and "token ids" in error.message
    error = refused(prompts.chat_ids, chat(CHAT_MESSAGES))
    assert (error.param, error.code) == ("messages", "chat_template_missing")
    with pytest.raises(SpecterError, match="no tokenizer"):
        prompts.chat_template = CHAT_TEMPLATE


def test_chat_messages_are_rendered_with_the_generation_prompt(tokenizer):
    prompts = Prompts(FakeEngine(tokenizer), 16)
    prompts.chat_template = CHAT_TEMPLATE
    expected = tokenizer(CHAT_RENDERED, add_special_tokens=False)["input_ids"]
    assert prompts.chat_ids(chat(CHAT_MESSAGES)) == expected  # CHAT_RENDERED ends "# assistant:"
    parts = [CHAT_MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "write "},
                                                             {"type": "text", "text": "a loop"}]}]
    assert prompts.chat_ids(chat(parts)) == expected  # text parts are joined


@pytest.mark.parametrize("template", [None, ""])
def test_chat_without_a_template_is_a_400_naming_the_way_out(tokenizer, template):
    prompts = Prompts(FakeEngine(tokenizer), 16)
    prompts.chat_template = CHAT_TEMPLATE
    prompts.chat_template = template  # set, then taken away again
    error = refused(prompts.chat_ids, chat(CHAT_MESSAGES))
    assert (error.param, error.code) == ("messages", "chat_template_missing")
    assert "--chat-template" in error.message and "/v1/completions" in error.message


def test_a_template_that_refuses_the_conversation_is_a_400(tokenizer):
    prompts = Prompts(FakeEngine(tokenizer), 16)
    prompts.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first, please') }}"
                             "{% endif %}{{ messages[0]['content'] }}")
    error = refused(prompts.chat_ids, chat(CHAT_MESSAGES))  # a system message first
    assert error.param == "messages" and error.code is None
    assert error.message.startswith("messages: the chat template refused them:")
    assert "user first, please" in error.message
    assert prompts.chat_ids(chat([{"role": "user", "content": "hi"}])) == prompts.encode("hi")


@pytest.mark.parametrize("requested, prompt_len, expected", [
    (None, 10, 16),  # the default
    (None, 60, 4),  # the default, capped to the 4 positions left
    (None, 63, 1),
    (20, 10, 20),  # the request's own value, above the default
    (54, 10, 54),  # exactly fills the context
])
def test_max_tokens_is_the_requests_or_the_default_capped_to_the_context(requested, prompt_len, expected):
    engine = FakeEngine(CharTokenizer(), context_length=64)
    ids = list(range(2, 2 + prompt_len))
    assert Prompts(engine, 16).max_tokens(requested, ids) == expected
    assert engine.checked == [(ids, expected)]


@pytest.mark.parametrize("requested, prompt_len, param, message", [
    (55, 10, "max_tokens", "max_tokens: the prompt's 10 tokens + max_tokens 55 = 65 positions exceed the "
                           "model's context of 64; at most 54 fit"),  # the prompt fits, the tokens asked for do not
    (None, 64, "prompt", "prompt: 64 tokens leave no room to generate in the model's context of 64 positions; "
                         "shorten the prompt"),  # the prompt alone fills the context: no default to cut
    (4, 70, "prompt", "prompt: 70 tokens leave no room"),
    (1, 64, "prompt", "prompt: 64 tokens leave no room"),
])
def test_a_request_that_does_not_fit_the_context_is_a_400_naming_the_field(requested, prompt_len, param, message):
    engine = FakeEngine(CharTokenizer(), context_length=64)
    ids = list(range(2, 2 + prompt_len))
    error = refused(Prompts(engine, 16).max_tokens, requested, ids)
    assert (error.param, error.code) == (param, "context_length_exceeded")
    assert error.message.startswith(message)
    assert "max_new_tokens" not in error.message  # the recipe's name, not the request's field


def test_without_a_context_length_nothing_is_capped():
    engine = FakeEngine(CharTokenizer(), context_length=None)
    prompts = Prompts(engine, 16)
    assert prompts.max_tokens(None, [5] * 5000) == 16
    assert prompts.max_tokens(10**6, [5]) == 10**6
    assert engine.checked == [([5] * 5000, 16), ([5], 10**6)]


def refused_by_the_server(call, *args) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call(*args)
    assert caught.value.status == 500 and caught.value.type == "server_error"
    assert (caught.value.param, caught.value.code) == ("messages", "chat_template_invalid")
    assert "--chat-template FILE" in caught.value.message
    return caught.value


def test_a_shipped_template_that_does_not_parse_warns_at_start_and_fails_chat_as_the_servers_fault(
        tokenizer, caplog):
    shipped = copy.deepcopy(tokenizer)
    shipped.chat_template = "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}"
    with caplog.at_level("WARNING", logger="specter.serve"):
        prompts = Prompts(FakeEngine(shipped), 16)
    assert prompts.template_problem.startswith("line 2: ")
    assert any("does not parse (line 2: " in record.getMessage() for record in caplog.records)
    error = refused_by_the_server(prompts.chat_ids, chat(CHAT_MESSAGES))
    assert "does not parse (line 2: " in error.message
    assert prompts.completion_ids(completion("def f():")) == prompts.encode("def f():")  # completions still served
    prompts.chat_template = CHAT_TEMPLATE  # an operator's valid template replaces it
    assert prompts.template_problem is None
    assert prompts.chat_ids(chat(CHAT_MESSAGES)) == tokenizer(CHAT_RENDERED, add_special_tokens=False)["input_ids"]


def test_a_shipped_template_that_parses_raises_no_warning(tokenizer, caplog):
    shipped = copy.deepcopy(tokenizer)
    shipped.chat_template = CHAT_TEMPLATE
    with caplog.at_level("WARNING", logger="specter.serve"):
        prompts = Prompts(FakeEngine(shipped), 16)
    assert prompts.template_problem is None and not caplog.records


@pytest.mark.parametrize("template, named", [
    ("{{ messages[0]['content'] | no_such_filter }}", "no_such_filter"),  # parses; found when compiled
    ("{{ messages[0]['content'] + 1 }}", "TypeError"),  # a str plus an int: the template's bug
    ("{{ undefined_helper(messages) }}", "UndefinedError"),
])
def test_a_template_that_fails_on_valid_messages_is_the_servers_fault(tokenizer, template, named):
    prompts = Prompts(FakeEngine(tokenizer), 16)
    prompts.chat_template = template  # valid Jinja syntax: taken
    error = refused_by_the_server(prompts.chat_ids, chat(CHAT_MESSAGES))
    assert named in error.message
