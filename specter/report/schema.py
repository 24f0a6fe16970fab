"""The one report schema every engine writes (``specter.report/1``), and its text rendering.

Contract: ``build_report(engine, metrics, result)`` returns a JSON-serialisable dict carrying every
key of the schema in ../shared/DESIGN.md ("Report"); a figure that does not apply to the engine
is ``None``; beside them ``page_placement``, what settling this process's large buffers found
(``specter.memory.page_placement.stats``). ``format_summary(report)`` renders the short table the
CLI prints (a "round time" row where speculative rounds ran: each phase's share of their time;
a "slow memory swapped" row where any buffer was timed).

What the keys mean (``metrics``: ``specter.report.metrics.GenerationMetrics``):
- ``decode_tokens_per_s``: tokens emitted by decode steps (each prompt's first token, from the
  prefill, excluded) over ``decode_s``, the time of those steps (drafting included); ``ttft_s``:
  mean time to a prompt's first token; ``new_tokens``: every generated token.
- ``acceptance_rate``: accepted draft tokens / drafted; ``mean_accepted_per_step``: tokens emitted
  per round (the bonus/recovered token counted); ``k``: ``{mean, histogram}`` of drafted k per
  round; all three None for an engine that does not speculate.
- ``hit_rate``: of the distinct (layer, expert) keys each target step of the decode needed, the
  fraction that needed no new transfer (already on the device, or a prefetch in flight); None
  where the engine has no expert cache or no decode step looked one up.
- ``prefetch_precision``: prefetched experts used before eviction / prefetched; None when nothing
  was prefetched.
- ``bytes_transferred``: expert bytes copied into the device cache (prefill and decode);
  ``transfer_wait_s``: time the decode steps waited on those copies (a synchronous link, ``local``
  without a copy thread, copies inside ``submit``: that time is in the steps, not here);
  ``io_wait_share``: ``transfer_wait_s / decode_s`` (capped at 1); ``copies_per_token``: experts
  copied during the decode per decode token; ``prefetch_precision`` counts this call's
  prefetches only.
- ``link``: ``{kind, gbps, latency_us, emulated}`` always (None where the link does not know
  them; ``emulated`` a bool, True only for paced figures), plus the link's own figures; None for
  an engine without a link. ``expert_budget``: ``{experts, bytes, fraction}`` of the device cache;
  ``device_bytes``: ``{draft, cache, dense, total}``, ``total`` the sum of the others.
- ``lossless``: the tokens equal the ``resident`` engine's greedy tokens (set by
  ``specter.api.run_recipe`` when checked, else None).
"""

from __future__ import annotations

import platform

import torch

from specter.memory import page_placement

SCHEMA = "specter.report/1"

REPORT_KEYS = (
    "schema", "engine", "model", "device", "dtype", "link", "expert_budget", "device_bytes", "prompts",
    "prompt_tokens", "new_tokens", "ttft_s", "decode_tokens_per_s", "wall_s", "acceptance_rate",
    "mean_accepted_per_step", "k", "hit_rate", "prefetch_precision", "bytes_transferred", "transfer_wait_s",
    "io_wait_share", "copies_per_token", "lossless", "outputs", "threads", "versions",
)


def versions() -> dict:
    import transformers

    from specter.version import __version__

    return {"torch": torch.__version__, "transformers": transformers.__version__, "specter": __version__,
            "python": platform.python_version()}


def model_summary(engine) -> dict:
    from specter.model.layout import moe_layers

    layers = getattr(engine, "layers", None) or moe_layers(engine.model)
    store = getattr(engine, "store", None)
    if store is not None:
        expert_bytes = store.expert_bytes
    else:
        first = layers[0]
        expert_bytes = sum(getattr(first.experts, n)[0].numel() * getattr(first.experts, n).element_size()
                           for n in first.param_names)
    return {
        "arch": engine.model.config.model_type,
        "path": str(engine.model_path),
        "n_layers": engine.model.config.num_hidden_layers,
        "n_moe_layers": len(layers),
        "n_experts": layers[0].num_experts,
        "top_k": layers[0].top_k,
        "expert_bytes": expert_bytes,
    }


LINK_KEYS = ("kind", "gbps", "latency_us", "emulated")


def link_entry(described: dict | None) -> dict | None:
    """A link's report entry with every key of ``LINK_KEYS``, first and in that order: what the
    link's ``describe()`` left out is None (``emulated``: False, made a bool), its own figures
    follow. None stays None (no link)."""
    if described is None:
        return None
    entry = {"kind": described.get("kind"), "gbps": described.get("gbps"),
             "latency_us": described.get("latency_us"), "emulated": bool(described.get("emulated", False))}
    return entry | {key: value for key, value in described.items() if key not in LINK_KEYS}


def link_summary(engine) -> dict | None:
    link = getattr(engine, "link", None)
    if link is None:
        return None
    return link.describe()  # build_report makes it a link_entry, as it does an engine's own


def build_report(engine, metrics, result) -> dict:
    report = dict.fromkeys(REPORT_KEYS)
    report.update({
        "schema": SCHEMA,
        "engine": engine.name,
        "model": model_summary(engine),
        "device": str(engine.device),
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "link": link_summary(engine),
        "prompts": metrics.prompts,
        "prompt_tokens": metrics.prompt_tokens,
        "new_tokens": metrics.new_tokens,
        "ttft_s": metrics.ttft_s,
        "decode_tokens_per_s": metrics.decode_tokens_per_s,
        "decode_s": metrics.decode_s,
        "wall_s": metrics.wall_s,
        "acceptance_rate": metrics.acceptance_rate,
        "mean_accepted_per_step": metrics.mean_accepted_per_step,
        "k": {"mean": metrics.mean_k, "histogram": {str(k): n for k, n in sorted(metrics.k_histogram.items())}}
        if metrics.rounds else None,
        "sampling": {"temperature": engine.sampling.temperature, "top_p": engine.sampling.top_p,
                     "top_k": engine.sampling.top_k},
        "outputs": [
            {"text": text, "token_ids": ids, "prompt_tokens": len(p)}
            for text, ids, p in zip(result.texts, result.token_ids, result.prompt_ids)
        ],
        "threads": torch.get_num_threads(),
        "versions": versions(),
    })
    report["page_placement"] = page_placement.stats()  # this process's, all engines built in it
    report["decode_step_s"] = metrics.decode_s / metrics.target_steps if metrics.target_steps else None
    report["phases"] = metrics.phase_report(report["model"]["n_moe_layers"])
    report.update(engine.engine_report())
    report["link"] = link_entry(report["link"])  # the link's, or the engine's own entry (hf-offload's reads)
    # decode-phase figures: transfer_wait_s, hit_rate and copies count the decode steps only
    looked_up = ((report.get("cache") or {}).get("decode") or {}).get("acquired_keys")
    if metrics.target_steps == 0 or looked_up == 0:
        report["hit_rate"] = None  # no decode step needed an expert: a rate of nothing, not 0
    if report["transfer_wait_s"] is not None and metrics.decode_s > 0:
        report["io_wait_share"] = min(1.0, report["transfer_wait_s"] / metrics.decode_s)
    if report.get("decode_bytes_transferred") is not None and metrics.decode_tokens:
        expert_bytes = report["model"]["expert_bytes"]
        report["copies_per_token"] = report["decode_bytes_transferred"] / expert_bytes / metrics.decode_tokens
    return report


def _fmt(value, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _governor_text(governor: dict | None) -> str:
    if not governor:
        return "-"
    error, total = governor.get("prediction_error"), governor.get("prediction_total_error")
    if error is None:
        return f"{governor.get('name')}"
    where = governor.get("prediction_k")  # the width of most rounds, the one the errors are of
    rounds = governor.get("prediction_rounds")
    at = "" if where is None else f"at k = {where}" + ("" if rounds is None else f", {rounds} rounds") + ": "
    return f"{governor.get('name')} ({at}{error:.1%} median" + ("" if total is None else f", {total:.1%} total") + ")"


def _phases_text(phases: dict | None) -> str | None:
    """Where the speculative rounds' time went: each phase's share of the rounds' time (the
    verification's transfer wait, part of its share, as a share too) and the draft step's mean;
    None without rounds."""
    if not phases or not phases.get("rounds"):
        return None
    parts = {name: phases.get(f"{name}_s") or 0.0 for name in ("draft", "flush", "verify", "host")}
    total = sum(parts.values())
    if total <= 0:
        return None
    step = phases.get("draft_step_s")
    wait = phases.get("verify_io_wait_s") or 0.0
    return (f"draft {parts['draft'] / total:.0%}"
            + ("" if step is None else f" ({step * 1e3:.2f} ms a step)")
            + f", flush {parts['flush'] / total:.0%}, verify {parts['verify'] / total:.0%}"
            + (f" (transfer wait {wait / total:.0%})" if wait > 0 else "")
            + f", host {parts['host'] / total:.0%}; {phases['rounds']} rounds")


def format_summary(report: dict) -> str:
    budget = report.get("expert_budget") or {}
    link = report.get("link") or {}
    link_text = "-" if not link else " ".join(part for part in (
        link["kind"],
        None if link.get("gbps") is None else f"{link['gbps']} GB/s",
        None if link.get("gbps") is None or link.get("latency_us") is None else f"{link['latency_us']} us",
        "(emulated)" if link.get("emulated") else None,
    ) if part)
    rows = [
        ("engine", report["engine"]),
        ("model", f"{report['model']['arch']} ({report['model']['n_moe_layers']} MoE layers x "
                  f"{report['model']['n_experts']} experts, top-{report['model']['top_k']})"),
        ("device / dtype / threads", f"{report['device']} / {report['dtype']} / {report['threads']}"),
        ("prompts / prompt tokens / new tokens", f"{report['prompts']} / {report['prompt_tokens']} / {report['new_tokens']}"),
        ("time to first token (mean)", f"{_fmt(report['ttft_s'])} s"),
        ("decode tokens/s", _fmt(report["decode_tokens_per_s"], ".1f")),
        ("expert budget", "-" if not budget else f"{budget['experts']} experts, {budget['bytes']:,} bytes, "
                                                 f"{budget['fraction']:.0%}"),
        ("link", link_text),
        ("hit rate (decode)", _fmt(report["hit_rate"])),
        ("transfer wait / share of decode time",
         "-" if report["transfer_wait_s"] is None else
         f"{_fmt(report['transfer_wait_s'])} s / {_fmt(report['io_wait_share'])}"),
        ("expert copies per decode token", _fmt(report["copies_per_token"])),
        ("acceptance / tokens per step / mean k", f"{_fmt(report['acceptance_rate'])} / "
                                                  f"{_fmt(report['mean_accepted_per_step'])} / "
                                                  f"{_fmt((report['k'] or {}).get('mean'))}"),
        ("prefetch precision", _fmt(report["prefetch_precision"])),
        ("governor (round-time prediction error)", _governor_text(report.get("governor"))),
        ("lossless (vs resident greedy)", _fmt(report["lossless"])),
    ]
    phases = _phases_text(report.get("phases"))
    if phases:
        rows.insert(len(rows) - 1, ("round time (decode)", phases))  # beside the governor, before lossless
    placement = report.get("page_placement") or {}
    if placement.get("pieces"):
        slow = placement.get("slow", 0)
        rows.append(("slow memory swapped (this process)",
                     f"{placement.get('swapped', 0)} of {slow} slow 8 MiB pieces (of {placement['pieces']} timed)"
                     if slow else f"none slow of {placement['pieces']} 8 MiB pieces timed"))
    compiled = report.get("compile")
    if compiled:
        rows.append(("compiled (warm-up excluded above)", f"warm-up {_fmt(compiled.get('warmup_s'))} s, "
                                                          f"late graphs {_fmt(compiled.get('late_graphs'))}"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
