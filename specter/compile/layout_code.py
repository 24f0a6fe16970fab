"""The compiled decoder's step functions, one copy of their code per model layout.

Contract: ``per_layout(fn, key)`` returns ``fn`` (a plain function or a bound method) running the
same Python but on a code object that every call with an equal ``key`` shares and no other does.
torch.compile keeps its graphs and counts its recompile limit per code object, so
``torch.compile(per_layout(fn, key))`` gives decoders of one layout one set of graphs (the bench's
engines of one checkpoint compile each graph once, as before) and decoders of different layouts
their own. ``layout_key(...)`` is the key ``CompiledDecoder`` uses: what its graphs specialise on
(the model math's constants, dtype, device, the shapes of every dense weight, the experts' source,
the compile options that differ between decoders).

Why: every ``CompiledDecoder`` compiles the same functions (``attention_and_route``, its bound
``_target_graph`` ...), so their code objects, hence one recompile limit (8 graphs each), were
shared by every model of the process: compiling a third tiny Mixtral of another width (hidden 64,
32, then 48) in one process stopped with dynamo's ``FailOnRecompileLimitHit`` (``fullgraph=True``),
and so did every model after it (``/tmp`` script, 2026-12-07: nine layouts, two compiled engines
each: two ran, seven failed; with a copy per layout all nine ran).
"""

from __future__ import annotations

import types
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

_codes: dict[tuple, dict[str, types.CodeType]] = {}  # layout key -> function qualname -> its copy


def per_layout(fn: Callable, key: tuple) -> Callable:
    func = getattr(fn, "__func__", fn)
    codes = _codes.setdefault(key, {})
    code = codes.get(func.__qualname__)
    if code is None:
        code = codes[func.__qualname__] = func.__code__.replace()  # a new object, equal by value
    copy = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__, copy.__qualname__, copy.__module__ = func.__kwdefaults__, func.__qualname__, func.__module__
    bound_to = getattr(fn, "__self__", None)
    return copy if bound_to is None else types.MethodType(copy, bound_to)


def layout_key(constants: Any, dtype: torch.dtype, device: torch.device, weights: Iterable[Tensor | None],
               source: str, options: tuple = ()) -> tuple:
    """A hashable key of what a decoder's graphs specialise on: ``constants`` (hashable: the model
    math's ``Arch``), the dtype and device, each weight's shape (None where a layer has none),
    where the experts come from and the compile ``options`` that differ between decoders (CUDA
    graphs, the C++ wrapper: dynamo would otherwise recompile one code object per option set,
    against one recompile limit)."""
    shapes = tuple(tuple(w.shape) if isinstance(w, Tensor) else None for w in weights)
    return constants, str(dtype), str(device), shapes, source, tuple(options)
