"""An engine's prompt side: text to token ids and back, the context length and its check, the
end-of-sequence ids (``Engine`` inherits it; ``specter.decode.engine``).

Contract: ``PromptIO`` reads the engine's ``model``, ``tokenizer``, ``model_path`` and ``compiled``.
- ``encode(prompt)``: a text through the tokenizer without special tokens (an empty result is the
  BOS id, else 0; no tokenizer: ``SpecterError``), token ids as ``prompt_check.as_token_ids`` takes them.
- ``context_length``: the model's ``max_position_embeddings`` (None if it gives none), or a compiled
  decoder's static KV cache where that holds fewer; ``check_context(ids, max_new_tokens)`` refuses,
  before any work, an empty prompt or one whose length plus ``max_new_tokens`` exceeds it.
- ``decode_text(ids)``: the tokenizer's text ("" without one).
- ``eos_token_ids``: every id that ends a prompt, as in transformers' generate (Qwen2/3-MoE and
  GPT-OSS list several; ``eos_ids(generation_config)`` reads them); ``eos_token_id`` the first
  (None: none), and setting it makes it the only one.
"""

from __future__ import annotations

from typing import Sequence

from specter.decode.prompt_check import as_token_ids
from specter.errors import SpecterError


def eos_ids(generation_config) -> tuple[int, ...]:
    eos = getattr(generation_config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        return tuple(int(token) for token in eos)
    return () if eos is None else (int(eos),)


class PromptIO:
    eos_token_ids: tuple[int, ...] = ()

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @eos_token_id.setter
    def eos_token_id(self, token: int | None) -> None:
        self.eos_token_ids = () if token is None else (int(token),)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise SpecterError(f"model: {self.model_path} ships no tokenizer; pass token ids instead of text")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            return ids or [self.tokenizer.bos_token_id or 0]
        return as_token_ids(prompt)

    @property
    def context_length(self) -> int | None:
        limit = getattr(self.model.config, "max_position_embeddings", None)
        limit = int(limit) if isinstance(limit, int) and limit > 0 else None
        if self.compiled is not None and (limit is None or self.compiled.max_len < limit):
            return self.compiled.max_len
        return limit

    def check_context(self, prompt_ids: Sequence[int], max_new_tokens: int, label: str = "prompt") -> None:
        """(The speculative round's k draft positions are cut to fit the rest.)"""
        limit = self.context_length
        if not prompt_ids:
            raise SpecterError(f"{label}: empty after tokenisation")
        if limit is not None and len(prompt_ids) + max_new_tokens > limit:
            whose = "the model's" if self.compiled is None or limit != self.compiled.max_len else \
                "the compiled decoder's (its static KV cache)"
            raise SpecterError(
                f"{label}: {len(prompt_ids)} tokens + max_new_tokens {max_new_tokens} = "
                f"{len(prompt_ids) + max_new_tokens} positions exceed {whose} context length {limit}; "
                f"shorten the prompt or lower max_new_tokens"
            )

    def decode_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""
