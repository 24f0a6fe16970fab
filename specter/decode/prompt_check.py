"""The checks ``Engine.generate`` / ``generate_by_prompt`` run on their arguments, once per call and
before any decoding (no per-token cost during decoding).

Contract: every ``check_*`` function returns the argument in the form the engine uses (or
nothing) or raises a ``SpecterError`` whose message starts with the argument's name (``prompts``, ``prompts[i]``,
``max_new_tokens``, ``sampling``, ``seed``, ``progress``, ``on_tokens``) and says what is allowed.

- ``prompts``: any iterable of prompts (a list, a tuple, a generator, a 2-D integer tensor ...),
  materialised to a list; an empty one is allowed (the call returns an empty result). Refused as
  the whole argument: ``None``, a single ``str`` / ``bytes`` (wrap one prompt in a list: the result
  always has one entry per prompt), a 1-D tensor (one prompt: wrap it too), a mapping, a set (no
  order to match results to). Each prompt
  is a ``str`` or a sequence of token ids: Python or NumPy integers, or a 1-D integer tensor; never
  bytes, floats or bools. ``check_token_range`` bounds ids by the model's input embedding rows:
  ``0 <= id < rows``.
- ``max_new_tokens``: an integer >= 1 (the recipe key's rule).
- ``sampling``: ``None``, a ``SamplingParams``, or a mapping of its fields (``temperature``,
  ``top_p``, ``top_k``), converted with ``SamplingParams(**mapping)`` (fields left out take
  ``SamplingParams``' defaults: greedy, no top-p, no top-k; not the recipe's values).
- ``seed``: an integer torch's generator takes, ``-2**63 <= seed <= 2**64 - 1`` (not a bool).
- ``progress`` / ``on_tokens``: ``None`` or a callable.

``check_generate_args`` runs them all for an engine, then tokenises the text prompts
(``engine.encode``), bounds every id (``check_token_range``) and checks each prompt against the
context length (``engine.check_context``).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from typing import Sequence

import torch

from specter.decode.sampling import SamplingParams
from specter.errors import SpecterError, bounded_repr

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
_WRAP = "wrap a single prompt in a list: generate([prompt])"


def _shown(value) -> str:
    return f"{type(value).__name__} {bounded_repr(value)}"


def check_prompts(prompts) -> list[str | list[int]]:
    """The prompts as a list of texts and token-id lists (see the module docstring)."""
    if prompts is None:
        raise SpecterError(f"prompts: expected a list of prompts (texts or token-id lists), got None; {_WRAP}")
    if isinstance(prompts, str):
        raise SpecterError(f"prompts: expected a list of prompts, got a single str {bounded_repr(prompts)} "
                           f"(a str would run one prompt per character); {_WRAP}")
    if isinstance(prompts, (bytes, bytearray, memoryview)):
        raise SpecterError(f"prompts: expected a list of prompts, got {type(prompts).__name__}; bytes are not a "
                           f"prompt: decode them to a str ({_WRAP}) or pass token ids as [[id, ...]]")
    if isinstance(prompts, (Mapping, set, frozenset)):
        raise SpecterError(f"prompts: expected an ordered list of prompts, got {type(prompts).__name__}; "
                           f"pass a list (results come back in its order)")
    if isinstance(prompts, torch.Tensor) and prompts.dim() != 2:
        raise SpecterError(f"prompts: a tensor of prompts must be 2-D [prompts, tokens], got shape "
                           f"{list(prompts.shape)}; wrap one prompt's 1-D ids in a list: generate([ids])")
    if not isinstance(prompts, Iterable):
        raise SpecterError(f"prompts: expected a list of prompts (texts or token-id lists), got {_shown(prompts)}; "
                           f"{_WRAP}")
    return [_check_prompt(prompt, f"prompts[{index}]") for index, prompt in enumerate(prompts)]


def _check_prompt(prompt, where: str) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise SpecterError(f"{where}: bytes are not a prompt; decode them to a str (e.g. data.decode('utf-8')) "
                           f"or pass token ids as a list of integers")
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool:
            raise SpecterError(f"{where}: a tensor prompt must be 1-D token ids of an integer dtype, got shape "
                               f"{list(prompt.shape)} {prompt.dtype}")
        return prompt.tolist()
    if isinstance(prompt, (Mapping, set, frozenset)) or not isinstance(prompt, Iterable):
        hint = (f"; one prompt's token ids go in a list of their own: generate([[{prompt}, ...]])"
                if isinstance(prompt, int) and not isinstance(prompt, bool) else "")
        raise SpecterError(f"{where}: expected a str or a sequence of token ids, got {_shown(prompt)}{hint}")
    return as_token_ids(prompt, where)


def as_token_ids(ids: Sequence, where: str = "prompt") -> list[int]:
    """``ids`` as a list of Python ints: integers only (Python, NumPy, one-element integer tensors),
    no bools and no floats (1.7 is refused, not truncated)."""
    out = []
    for position, value in enumerate(ids):
        if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
            raise SpecterError(f"{where}[{position}]: token ids must be integers, got bool {value!r}")
        try:
            out.append(operator.index(value))
        except TypeError:
            raise SpecterError(f"{where}[{position}]: token ids must be integers, got {_shown(value)}") from None
    return out


def embedding_rows(model) -> int | None:
    """Rows of ``model``'s input embedding (the token ids it takes are ``0 <= id < rows``), None
    where the model does not say."""
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    rows = getattr(embedding, "num_embeddings", None)
    return rows if isinstance(rows, int) else None


def check_token_range(ids: Sequence[int], rows: int | None, where: str) -> None:
    """Refuse a token id the model's input embedding has no row for (negative, or >= ``rows``)."""
    if not ids:
        return
    low, high = min(ids), max(ids)
    if low < 0 or (rows is not None and high >= rows):
        bad = low if low < 0 else high
        allowed = f"0 <= id < {rows}, the rows of the model's input embedding" if rows is not None else "id >= 0"
        raise SpecterError(f"{where}: token id {bad} at position {ids.index(bad)} is out of range; allowed: {allowed}")


def check_max_new_tokens(value) -> int:
    """The API's check of a per-call ``max_new_tokens``: an integer >= 1 (as the recipe requires)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecterError(f"max_new_tokens: must be an integer >= 1, got {value!r}")
    return value


def check_sampling(sampling) -> SamplingParams | None:
    if sampling is None or isinstance(sampling, SamplingParams):
        return sampling
    if isinstance(sampling, Mapping):
        fields = ("temperature", "top_p", "top_k")
        unknown = [key for key in sampling if key not in fields]
        if unknown:
            raise SpecterError(f"sampling: unknown key {bounded_repr(unknown[0])}; allowed keys: {', '.join(fields)}")
        values = dict(sampling)
        for key in ("temperature", "top_p"):
            if key in values:
                value = values[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise SpecterError(f"sampling.{key}: expected a number, got {_shown(value)}")
                values[key] = float(value)
        try:
            return SamplingParams(**values)
        except ValueError as error:  # SamplingParams names the field: "top_p: must be in (0, 1], got 0.0"
            raise SpecterError(f"sampling.{error}") from None
    raise SpecterError(f"sampling: expected a SamplingParams (specter.decode.sampling), a dict of temperature/"
                       f"top_p/top_k, or None, got {_shown(sampling)}")


def check_seed(seed) -> int:
    low, high = SEED_RANGE
    try:
        value = None if isinstance(seed, bool) else operator.index(seed)
    except TypeError:
        value = None
    if value is None or not low <= value <= high:
        raise SpecterError(f"seed: must be an integer in [-2**63, 2**64 - 1], got {_shown(seed)}")
    return value


def check_callback(name: str, value, signature: str) -> None:
    if value is not None and not callable(value):
        raise SpecterError(f"{name}: expected a callable {signature} or None, got {_shown(value)}")


def check_generate_args(engine, prompts, max_new_tokens, progress, sampling, seed, on_tokens):
    """Every check of one ``generate`` call on ``engine``: returns (the prompts' token ids,
    max_new_tokens, sampling or None, seed), the recipe's values where the call gave None."""
    prompts = check_prompts(prompts)
    max_new = engine.recipe.max_new_tokens if max_new_tokens is None else check_max_new_tokens(max_new_tokens)
    sampling = check_sampling(sampling)
    seed = engine.recipe.seed if seed is None else check_seed(seed)
    check_callback("progress", progress, "(prompt index, prompts, tokens so far)")
    check_callback("on_tokens", on_tokens, "(prompt index, new token ids so far)")
    encoded = [engine.encode(prompt) for prompt in prompts]
    rows = embedding_rows(engine.model)
    for index, prompt_ids in enumerate(encoded):
        check_token_range(prompt_ids, rows, f"prompts[{index}]")
        engine.check_context(prompt_ids, max_new, f"prompt {index + 1}")
    return encoded, max_new, sampling, seed
