"""Giving an engine its compiled steps.

Contract: ``compile_engine(engine, max_k=None, cuda_graphs=None)`` builds the ``CompiledDecoder``
an engine needs (resident, ondemand, router-lookahead, specter; others raise ``SpecterError``),
warms it up and sets ``engine.compiled``; ``Engine.forward_logits`` / ``new_kv_cache`` then route
through it. ``max_k``: the most draft tokens a round may verify (default: the governor's ``k_max``, else
``MAX_K``). ``cuda_graphs``: the decoder's option (None: on a CUDA device); True on a CPU runs
the fused steps as a CUDA device does, with no call to the host from a graph (a cache step
drains the link first and reruns layered when an expert is missing, and replays the cache's
bookkeeping after), the tests' way to exercise that path without a GPU. A drafting engine's
lean step (``engine.lean_draft``, given before compiling by ``lean_draft.use_lean_draft``) that
the native row kernels serve becomes the decoder's ``lean_step``, which then runs every draft
step (no draft graph is compiled); ``engine.lean_draft`` is cleared either way (a compiled engine
drafts through its decoder).
"""

from __future__ import annotations

from specter.compile.decoder import CompiledDecoder
from specter.errors import SpecterError


def compile_engine(engine, max_k: int | None = None, cuda_graphs: bool | None = None) -> CompiledDecoder:
    """``engine.compiled`` = a warmed-up ``CompiledDecoder`` (see the module docstring)."""
    from specter.config.recipe import MAX_K

    if not engine.compilable:
        raise SpecterError(f"compile: true is not available for engine {engine.name!r}; set compile: false")
    runtime = getattr(engine, "runtime", None)
    decoder = CompiledDecoder(
        engine.model,
        experts="resident" if runtime is None else "cache",
        runtime=runtime,
        layered=engine.name == "router-lookahead",  # its predictor acts between layers
        cuda_graphs=cuda_graphs,
    )
    draft = getattr(engine, "draft", None)
    if draft:
        decoder.set_draft(draft)
        lean = getattr(engine, "lean_draft", None)
        if lean is not None and lean.native_rows:
            decoder.lean_step = lean
        engine.lean_draft = None
        if max_k is None:
            governor = getattr(engine, "governor", None)
            max_k = getattr(governor, "k_max", MAX_K)
    decoder.warm_up(max_verify_tokens=(max_k or 0) + 1, draft=bool(draft) and decoder.lean_step is None)
    engine.compiled = decoder
    return decoder
