"""Recipe settings the chosen built-in engine never reads, so the CLI can say so instead of
running as if they mattered.

Contract: ``override_keys(overrides) -> set[str]``: the dotted keys ``key=value`` overrides set,
and, for an override whose value is a mapping, its leaves (``offload.link={kind: local, gbps: 1}``
gives ``offload.link.kind`` and ``offload.link.gbps``; an ``options`` mapping counts as one key).
Only overrides count: a recipe file often carries settings for several engines and is switched
between them by its ``engine`` key. ``unused_settings(recipe, given) -> list[tuple[str, str]]``:
the given keys that ``recipe.engine`` does not read, each with the reason
(``("offload.expert_budget", "engine resident keeps every expert on the device and does not
speculate")``), sorted; empty for an engine that is not built in (a plugin may read any key).
Keys a built-in engine ignores: every ``offload`` and ``speculation`` key for ``resident``;
``speculation`` for ``ondemand``, ``router-lookahead`` and ``hf-offload``; for ``hf-offload``
also the link, cache policy, prefetch, host tier, pinning, timeout and copy checks (accelerate
places and moves its weights); ``offload.link.gbps`` / ``latency_us`` where the link is not
emulated (``auto`` on a CPU is); ``offload.direct_io`` unless ``offload.experts_on`` is ``disk``.
``under(key, prefixes)``: whether a dotted key is one of the prefixes or inside one.
``leaves(raw, prefix="")``: the dotted keys of a raw recipe mapping's settings, as
``override_keys`` counts them.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import yaml

from specter.config.loading import yaml_value

HF_OFFLOAD_READS = ("offload.expert_budget", "offload.experts_on", "offload.direct_io")
PACED_ONLY = ("offload.link.gbps", "offload.link.latency_us")


def leaves(raw: Mapping, prefix: str = "") -> Iterable[str]:
    for key, value in raw.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value and key != "options":
            yield from leaves(value, dotted)
        else:
            yield dotted


def override_keys(overrides: Iterable[str]) -> set[str]:
    keys: set[str] = set()
    for item in overrides:
        key, _, text = item.partition("=")
        key = key.strip()
        try:
            value = yaml_value(text)
        except yaml.YAMLError:
            value = None
        is_section = isinstance(value, Mapping) and value and key.rsplit(".", 1)[-1] != "options"
        keys.update(leaves(value, key) if is_section else [key])
    return keys


def under(key: str, prefixes: Iterable[str]) -> bool:
    """Whether dotted ``key`` is one of ``prefixes`` or a key inside one (``offload.link.kind`` is
    under ``offload``; ``offloads`` is not)."""
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def unused_settings(recipe, given: Iterable[str]) -> list[tuple[str, str]]:
    engine = recipe.engine
    unused: list[tuple[str, str]] = []
    for key in sorted(given):
        reason = None
        if engine == "resident" and under(key, ("offload", "speculation")):
            reason = "engine resident keeps every expert on the device and does not speculate"
        elif engine in ("ondemand", "router-lookahead", "hf-offload") and under(key, ("speculation",)):
            reason = f"engine {engine} does not speculate"
        elif engine == "hf-offload" and under(key, ("offload",)) and not under(key, HF_OFFLOAD_READS):
            reason = "engine hf-offload leaves placing and moving weights to accelerate"
        elif key == "offload.direct_io" and recipe.offload.experts_on != "disk":
            reason = ("only the disk tier reads the checkpoint while decoding; offload.experts_on is "
                      f"{recipe.offload.experts_on}")
        elif key in PACED_ONLY and engine in ("ondemand", "router-lookahead", "specter") \
                and recipe.offload.link.kind in ("local", "cuda", "disk"):
            reason = f"only the emulated link is paced; this one is {recipe.offload.link.kind}"
        if reason is not None:
            unused.append((key, reason))
    return unused
