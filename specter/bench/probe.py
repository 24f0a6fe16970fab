"""Quality probe: teacher-forced agreement of the INT4 draft (and of router lookahead) with the target.

Acceptance measured while generating is inflated when a small model's greedy text repeats itself;
this probe measures agreement on given text instead, position by position.

Contract:
- ``probe(engine, texts, max_tokens_per_text=256) -> dict`` takes a ``specter`` engine (one with
  ``runtime``, ``draft`` and ``model``) and texts or token-id lists. Each text (truncated to
  ``max_tokens_per_text`` tokens) is run through the target once (one forward over the whole
  sequence, a fresh KV cache, experts streamed through the engine's device cache as usual), then
  once more inside ``engine.runtime.drafting()`` (fresh KV cache). Per MoE layer it reports
  ``draft_exact`` (the draft's top-k expert set equals the target's) and ``draft_recall``
  (|draft ∩ target| / k), averaged over positions; ``lookahead_exact`` / ``lookahead_recall`` do
  the same for router lookahead (the target's hidden state entering the previous MoE layer
  through this layer's router, ``RouterLookaheadPredictor.predict_next``; ``None`` for the first
  MoE layer). Overall figures are means over layers (every layer sees the same positions).
  ``next_token_agreement``: the draft's argmax equals the target's. ``sampled_acceptance``: the
  mean over positions of sum_v min(p_target(v), p_draft(v)), the probability that speculative
  sampling accepts a drafted token, at temperature 1 (``temperature_1``) and under the engine's
  own sampling settings (``recipe``, ``None`` when those are greedy).
  The runtime's observers are swapped for the probe's own during the passes and restored after.
- ``read_texts(path)``: a ``.jsonl`` file gives one text per line (its ``"text"`` or ``"prompt"``
  field), any other file is one text.
- ``probe_texts(recipe, path=None)`` checks that the recipe's engine is ``specter`` and returns
  the texts to probe (``read_texts(path)``, or the recipe's prompts); ``probe_recipe(recipe, texts)``
  builds the recipe's engine, probes it and closes it. ``format_probe(result)`` renders the table
  the CLI prints (``python -m specter.run RECIPE --probe [TEXTFILE]``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Sequence

import torch

from specter.config.files import read_texts as read_text_file
from specter.errors import SpecterError
from specter.decode.kv import forward_logits, new_kv_cache
from specter.predictors.router_lookahead import RouterLookaheadPredictor
from specter.decode.sampling import logits_to_probs


def _set_match(predicted: torch.Tensor, actual: torch.Tensor) -> tuple[float, float]:
    """Summed (exact set match, recall) over rows of two [T, k] expert-id tensors."""
    hits = (predicted[:, :, None] == actual[:, None, :]).any(dim=1).sum(dim=-1)  # [T] actual ids found
    k = actual.shape[-1]
    return float((hits == k).sum()), float(hits.sum()) / k


def _overlap(p: torch.Tensor, q: torch.Tensor) -> float:
    """Summed over rows of [T, V] distributions: sum_v min(p, q)."""
    return float(torch.minimum(p, q).sum(dim=-1).sum())


@contextlib.contextmanager
def _only_observer(runtime, observer) -> Iterator[None]:
    saved = runtime.observers
    runtime.observers = [observer]
    try:
        yield
    finally:
        runtime.observers = saved


def _run(engine, ids: list[int], mode: str, lookahead: RouterLookaheadPredictor | None):
    """One teacher-forced pass: logits [T, V], each layer's top-k index [T, k], and (target pass
    with ``lookahead``) each layer's experts predicted from the previous MoE layer's hidden state."""
    routes: dict[int, torch.Tensor] = {}
    ahead: dict[int, torch.Tensor] = {}

    def record(layer, hidden, top_k_index, top_k_weights, seen_mode) -> None:
        if seen_mode != mode:
            return
        routes[layer] = top_k_index.detach().cpu()
        if lookahead is not None:
            predicted = lookahead.predict_next(layer, hidden)
            if predicted is not None:
                ahead[predicted[0]] = predicted[1].detach().cpu()

    runtime = engine.runtime
    drafting = runtime.drafting() if mode == "draft" else contextlib.nullcontext()
    with _only_observer(runtime, record), drafting:
        logits = forward_logits(engine.model, torch.tensor([ids], device=engine.device), new_kv_cache(engine.model))
    return logits, routes, ahead


def probe(engine, texts: Sequence[str | Sequence[int]] | str, max_tokens_per_text: int = 256) -> dict:
    if not getattr(engine, "draft", None) or getattr(engine, "runtime", None) is None:
        raise SpecterError(f"the probe needs engine: specter (an INT4 draft); got engine: {engine.name}")
    if max_tokens_per_text < 1:
        raise SpecterError(f"max_tokens_per_text: must be >= 1, got {max_tokens_per_text}")
    if isinstance(texts, str):
        texts = [texts]
    sequences = [engine.encode(text)[:max_tokens_per_text] for text in texts]
    sequences = [ids for ids in sequences if ids]
    if not sequences:
        raise SpecterError("the probe got no text to run on")

    layers = sorted(engine.runtime.layers)
    lookahead = RouterLookaheadPredictor()
    lookahead.bind(None, engine.runtime.layers)
    sums = {layer: {"draft_exact": 0.0, "draft_recall": 0.0, "lookahead_exact": 0.0, "lookahead_recall": 0.0}
            for layer in layers}
    positions = agree = overlap_t1 = overlap_recipe = 0.0
    sampled = not engine.sampling.greedy
    with torch.inference_mode():
        for ids in sequences:
            target_logits, target_routes, ahead = _run(engine, ids, "target", lookahead)
            draft_logits, draft_routes, _ = _run(engine, ids, "draft", None)
            for layer in layers:
                exact, recall = _set_match(draft_routes[layer], target_routes[layer])
                sums[layer]["draft_exact"] += exact
                sums[layer]["draft_recall"] += recall
                if layer in ahead:
                    exact, recall = _set_match(ahead[layer], target_routes[layer])
                    sums[layer]["lookahead_exact"] += exact
                    sums[layer]["lookahead_recall"] += recall
            positions += len(ids)
            agree += float((target_logits.argmax(dim=-1) == draft_logits.argmax(dim=-1)).sum())
            overlap_t1 += _overlap(target_logits.softmax(dim=-1), draft_logits.softmax(dim=-1))
            if sampled:
                overlap_recipe += _overlap(logits_to_probs(target_logits, engine.sampling),
                                           logits_to_probs(draft_logits, engine.sampling))

    first = layers[0]
    per_layer = []
    for layer in layers:
        entry = {"layer": layer}
        for name, total in sums[layer].items():
            entry[name] = None if name.startswith("lookahead") and layer == first else total / positions
        per_layer.append(entry)

    def mean(name: str) -> float | None:
        values = [entry[name] for entry in per_layer if entry[name] is not None]
        return sum(values) / len(values) if values else None

    return {
        "texts": len(sequences),
        "positions": int(positions),
        "max_tokens_per_text": max_tokens_per_text,
        "draft_exact": mean("draft_exact"),
        "draft_recall": mean("draft_recall"),
        "lookahead_exact": mean("lookahead_exact"),
        "lookahead_recall": mean("lookahead_recall"),
        "next_token_agreement": agree / positions,
        "sampled_acceptance": {
            "temperature_1": overlap_t1 / positions,
            "recipe": overlap_recipe / positions if sampled else None,
        },
        "sampling": {"temperature": engine.sampling.temperature, "top_p": engine.sampling.top_p,
                     "top_k": engine.sampling.top_k},
        "layers": per_layer,
    }


def read_texts(path: str | Path) -> list[str]:
    return read_text_file(Path(path), "--probe", ("text", "prompt"))


def probe_texts(recipe, path: str | Path | None = None) -> list[str]:
    if recipe.engine != "specter":
        raise SpecterError(f"--probe needs engine: specter (it compares the INT4 draft with the target); "
                           f"this recipe has engine: {recipe.engine}")
    return read_texts(path) if path else recipe.resolved_prompts()


def probe_recipe(recipe, texts: Sequence[str | Sequence[int]], max_tokens_per_text: int = 256) -> dict:
    from specter.build import build_engine

    engine = build_engine(recipe)
    try:
        return probe(engine, texts, max_tokens_per_text)
    finally:
        engine.close()


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:6.1%}"


def format_probe(result: dict) -> str:
    lines = [
        f"teacher-forced probe: {result['texts']} text(s), {result['positions']} positions",
        f"{'layer':>6}  {'draft exact':>11}  {'draft recall':>12}  {'lookahead exact':>15}  {'lookahead recall':>16}",
    ]
    rows = [(str(e["layer"]), e) for e in result["layers"]] + [("mean", result)]
    for name, entry in rows:
        lines.append(f"{name:>6}  {_pct(entry['draft_exact']):>11}  {_pct(entry['draft_recall']):>12}  "
                     f"{_pct(entry['lookahead_exact']):>15}  {_pct(entry['lookahead_recall']):>16}")
    sampled = result["sampled_acceptance"]
    lines.append(f"next-token agreement (argmax)       {_pct(result['next_token_agreement'])}")
    lines.append(f"sampled acceptance, temperature 1   {_pct(sampled['temperature_1'])}")
    if sampled["recipe"] is not None:
        s = result["sampling"]
        lines.append(f"sampled acceptance, recipe sampling {_pct(sampled['recipe'])} "
                     f"(temperature {s['temperature']}, top_p {s['top_p']}, top_k {s['top_k']})")
    return "\n".join(lines)
