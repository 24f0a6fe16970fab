"""The recipe: one YAML file (plus ``--set dotted.key=value`` overrides) that describes a run.

Contract: ``load_recipe(source, overrides)`` returns a frozen ``Recipe`` or raises ``RecipeError``
(or ``UnknownPluginError`` for a plugin name) whose message is one line that starts with the
dotted key at fault, shows the offending value and says what is allowed. Every field carries a
type, a default and a one-line doc in its ``metadata``; ``describe()`` prints them all.

Sections validate themselves in ``__post_init__``, so a recipe built in Python
(``Recipe(engine="ondemand", offload={"expert_budget": 0.25})``) obeys the same rules as one read
from YAML; nested sections may be given as mappings. Relative paths (``model``, ``prompts_file``)
are looked up in the current directory first, then in the directory of the recipe file. Plugin
names are checked against ``specter.plugins.registry()`` only for the plugins the chosen engine
uses (``Recipe.plugins_used()``), so an unused section never blocks a run.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field, fields
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, NamedTuple, Sequence

import yaml

from specter.bundled import bundled_path, is_bundled, known_names
from specter.errors import RecipeError
from specter.governors import MAX_K

ENGINES = ("resident", "ondemand", "router-lookahead", "specter", "hf-offload")
DTYPES = ("float32", "bfloat16", "float16")
GROUP_SIZES = (32, 64, 128, 256)
DRAFT_BITS = (4,)
MAX_SEED = 2**32 - 1
MAX_THREADS = 1024
BUNDLED_PREFIX = "bundled:"
AUTO_LINK = "auto"  # the engine picks cuda on a CUDA device, else emulated

DEFAULT_PROMPTS = (
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "Permission is hereby granted, free of charge, to any person obtaining a copy",
)


class PluginChoice(NamedTuple):
    """A plugin a run needs: the recipe key naming it, the plugin kind and the chosen name."""

    key: str
    kind: str
    name: str


_OFFLOAD_PLUGINS = (
    ("offload.cache_policy.name", "cache_policy"),
    ("offload.link.kind", "link"),
)
ENGINE_PLUGINS: dict[str, tuple[tuple[str, str], ...]] = {
    "resident": (),
    "hf-offload": (),
    "ondemand": _OFFLOAD_PLUGINS,
    "router-lookahead": _OFFLOAD_PLUGINS,
    "specter": _OFFLOAD_PLUGINS
    + (("speculation.predictor.name", "predictor"), ("speculation.governor.name", "governor")),
}

_SAFE_KEY = re.compile(r"[A-Za-z0-9_\-]+")
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
_BYTE_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?|\.[0-9]+)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
_BYTE_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_FRACTION_TOLERANCE = 1e-9


# ----------------------------------------------------------------------------- error helpers


def display_key(key: object) -> str:
    """How a key (or key path segment) appears in messages: plain when simple, repr otherwise."""
    if isinstance(key, str) and _SAFE_KEY.fullmatch(key):
        return key
    return repr(key)


def _plain(text: str) -> str:
    return text if text.isprintable() else repr(text)


def _show(value: object, limit: int = 60) -> str:
    shown = repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _error(key: str, text: str) -> RecipeError:
    return RecipeError("\\n".join(f"{key}: {text}".splitlines()))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _suggest(word: object, choices: Sequence[str], prefix: str = "") -> str:
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean {_join(prefix, close[0])}? " if close else ""


# ----------------------------------------------------------------------------- field rules


def _field(
    doc: str,
    default: Any = dataclasses.MISSING,
    *,
    factory: Callable[[], Any] | None = None,
    check: Callable[[Any], bool] | None = None,
    allowed: str | None = None,
    parse: Callable[[Any, str], Any] | None = None,
    type_name: str | None = None,
    choices: Sequence[object] = (),
) -> Any:
    metadata = {
        "doc": doc, "check": check, "allowed": allowed, "parse": parse, "type_name": type_name,
        "choices": tuple(choices),
    }  # fmt: skip
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _at_least(low: float, what: str = "an integer") -> dict[str, Any]:
    return {"check": lambda v: v is None or v >= low, "allowed": f"{what} >= {_number(low)}"}


def _between(low: float, high: float, what: str, *, low_open: bool = False) -> dict[str, Any]:
    def check(value: Any) -> bool:
        return value is None or ((value > low) if low_open else (value >= low)) and value <= high

    opening = "(" if low_open else "["
    return {"check": check, "allowed": f"{what} in {opening}{_number(low)}, {_number(high)}]"}


def _one_of(*choices: object) -> dict[str, Any]:
    return {"check": lambda v: v in choices, "allowed": ", ".join(str(c) for c in choices), "choices": choices}


def _non_empty(what: str) -> dict[str, Any]:
    return {"check": lambda v: v is None or len(v) > 0, "allowed": f"a non-empty {what}"}


def _type_word(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        words = [_type_word(a) for a in typing.get_args(hint) if a is not type(None)]
        return " or ".join(words + ["null"])
    if origin is list:
        return "a list of strings"
    if hint is dict or origin is dict:
        return "a mapping of option names to values"
    if isinstance(hint, type) and issubclass(hint, _Section):
        return "a mapping"
    words = {str: "a string", int: "an integer", float: "a number", bool: "a boolean (true or false)"}
    return words.get(hint, getattr(hint, "__name__", str(hint)))


def _type_label(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_label(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "None"
    if origin is list:
        return "list[str]"
    if hint is dict or origin is dict:
        return "dict"
    return hint.__name__


def _coerce(value: Any, hint: Any, key: str, allowed: str) -> Any:
    """Return ``value`` converted to ``hint`` (int -> float, tuple -> list, mapping -> section)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
        origin = typing.get_origin(hint)
    if isinstance(hint, type) and issubclass(hint, _Section):
        if isinstance(value, hint):
            return value
        if value is None or isinstance(value, Mapping):
            return _from_mapping(hint, value)
    elif hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                number = math.inf
            if not math.isfinite(number):
                raise _error(key, f"expected a finite number, got {_show(value)}; allowed: {allowed}")
            return number
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin is list:
        if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
            return list(value)
    elif hint is dict or origin is dict:
        if isinstance(value, Mapping) and all(isinstance(name, str) for name in value):
            return dict(value)
    else:
        raise TypeError(f"recipe schema: unsupported field type {hint!r} at {key}")
    scalar = isinstance(value, (bool, int, float))
    quote_hint = " (quote it to make it a string)" if hint is str and scalar else ""
    raise _error(
        key,
        f"expected {_type_word(hint)}, got {_type_name(value)} {_show(value)}{quote_hint}; "
        f"allowed: {allowed}",
    )


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _schema_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in fields(cls) if not f.metadata.get("internal")]


class _Section:
    """Base of every recipe section: validates and normalizes its fields after ``__init__``."""

    _path: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in _schema_fields(self):
            key = _join(self._path, f.name)
            value = getattr(self, f.name)
            hint = hints[f.name]
            allowed = f.metadata["allowed"] or _type_word(hint)
            if f.metadata["parse"] is not None:
                value = f.metadata["parse"](value, key)
            else:
                value = _coerce(value, hint, key, allowed)
            check = f.metadata["check"]
            if check is not None and not check(value):
                choices = [c for c in f.metadata["choices"] if isinstance(c, str)]
                raise _error(
                    key, f"invalid value {_show(value)}; {_suggest(value, choices)}allowed: {allowed}"
                )
            object.__setattr__(self, f.name, value)
        self._check()

    def _check(self) -> None:
        """Cross-field rules; fields are already normalized when this runs."""

    def to_dict(self) -> dict[str, Any]:
        """The section as plain data (what YAML would hold); loading it back gives an equal one."""
        return {f.name: _plain_data(getattr(self, f.name)) for f in _schema_fields(self)}


def _plain_data(value: Any) -> Any:
    if isinstance(value, _Section):
        return value.to_dict()
    if isinstance(value, ExpertBudget):
        return value.to_recipe_value()
    return copy.deepcopy(value)


def _from_mapping(cls: type, raw: Mapping | None, **internal: Any) -> Any:
    """Build section ``cls`` from a mapping, rejecting unknown keys with a close-match hint."""
    path = cls._path or "recipe"
    known = [f.name for f in _schema_fields(cls)]
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise _error(
            path,
            f"expected a mapping of keys to values, got {_type_name(raw)} {_show(raw)}; "
            f"allowed keys: {', '.join(known)}",
        )
    for name in raw:
        if name not in known:
            where = f" under {cls._path}" if cls._path else ""
            raise _error(
                _join(cls._path, display_key(name)),
                f"unknown key; {_suggest(name, known, cls._path)}allowed keys{where}: {', '.join(known)}",
            )
    return cls(**raw, **internal)


# ----------------------------------------------------------------------------- expert budget


@dataclass(frozen=True)
class ExpertBudget:
    """How many full-precision experts the device cache may hold.

    ``kind`` is ``fraction`` (of all experts, in (0, 1]), ``per_layer`` (slots per MoE layer),
    ``experts`` (slots in total) or ``bytes`` (a byte budget). ``resolve`` turns any of them into
    a total slot count for a given model.
    """

    kind: str
    value: float | int
    KINDS: ClassVar[tuple[str, ...]] = ("fraction", "per_layer", "experts", "bytes")
    KEY: ClassVar[str] = "offload.expert_budget"
    ALLOWED: ClassVar[str] = (
        'a fraction in (0, 1], {per_layer: N}, {experts: N} (N >= 1), or a byte size such as '
        '"2GiB", "512MiB", "1.5GB", "1000000" (KB/MB/GB = 10^3.., KiB/MiB/GiB = 2^10..)'
    )

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            kinds = ", ".join(self.KINDS)
            raise _error(self.KEY, f"unknown budget kind {_show(self.kind)}; allowed: {kinds}")
        if self.kind == "fraction":
            is_number = isinstance(self.value, (int, float)) and not isinstance(self.value, bool)
            if not (is_number and 0 < self.value <= 1):
                raise _error(
                    self.KEY, f"fraction must be in (0, 1], got {_show(self.value)}; allowed: {self.ALLOWED}"
                )
            object.__setattr__(self, "value", float(self.value))
        elif not (isinstance(self.value, int) and not isinstance(self.value, bool) and self.value >= 1):
            unit = "bytes" if self.kind == "bytes" else "N"
            raise _error(
                self.KEY,
                f"{self.kind} {unit} must be an integer >= 1, got {_show(self.value)}; allowed: {self.ALLOWED}",
            )

    @classmethod
    def parse(cls, value: Any, key: str = KEY) -> ExpertBudget:
        """Parse a recipe value: a number, ``{per_layer: N}``, ``{experts: N}`` or a byte string."""

        def fail(problem: str, advice: str = "") -> RecipeError:
            got = f"{_type_name(value)} {_show(value)}"
            return _error(key, f"{problem}, got {got}; {advice}allowed: {cls.ALLOWED}")

        if isinstance(value, ExpertBudget):
            return value
        if isinstance(value, bool) or value is None:
            raise fail("expected a budget")
        if isinstance(value, (int, float)):
            if not 0 < value <= 1:
                advice = "for a byte count write a string, for a count {experts: N}; "
                raise fail("a number is a fraction of all experts and must be in (0, 1]",
                           advice if isinstance(value, int) and value > 1 else "")
            return cls("fraction", float(value))
        if isinstance(value, Mapping):
            if len(value) != 1 or next(iter(value)) not in ("per_layer", "experts"):
                raise fail("a mapping budget must have exactly one key, per_layer or experts")
            ((kind, count),) = value.items()
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise fail(f"{kind} must be an integer >= 1")
            return cls(kind, count)
        if isinstance(value, str):
            match = _BYTE_SIZE.fullmatch(value)
            if match is None:
                raise fail("not a byte size")
            number, unit = match.groups()
            if unit is None and "." in number:
                raise fail("a byte count without a unit must be a whole number")
            n_bytes = int(Decimal(number) * _BYTE_UNITS[(unit or "b").lower()])
            if n_bytes < 1:
                raise fail("a byte budget must be at least 1 byte")
            return cls("bytes", n_bytes)
        raise fail("expected a budget")

    def resolve(self, n_layers: int, n_experts: int, expert_bytes: int) -> int:
        """Total expert slots for a model with ``n_layers`` MoE layers of ``n_experts`` experts.

        Rounding: fraction -> floor(fraction * n_layers * n_experts) (with a 1e-9 tolerance, so 0.3
        of 10 experts is 3); bytes -> floor(bytes / expert_bytes). The result is capped at
        ``n_layers * n_experts`` (more slots than experts are useless) and is never negative; it
        may be 0 or too small for one step: the caller decides whether it is enough.
        """
        for name, number in (("n_layers", n_layers), ("n_experts", n_experts), ("expert_bytes", expert_bytes)):
            if isinstance(number, bool) or not isinstance(number, int) or number < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {number!r}")
        total = n_layers * n_experts
        if self.kind == "fraction":
            slots = math.floor(self.value * total + _FRACTION_TOLERANCE)
        elif self.kind == "per_layer":
            slots = self.value * n_layers
        elif self.kind == "experts":
            slots = self.value
        else:
            if expert_bytes == 0:
                raise ValueError("expert_bytes must be >= 1 to resolve a byte budget")
            slots = self.value // expert_bytes
        return max(0, min(int(slots), total))

    def to_recipe_value(self) -> float | dict[str, int] | str:
        """The recipe spelling of this budget; ``ExpertBudget.parse`` of it gives it back."""
        if self.kind == "fraction":
            return self.value
        if self.kind == "bytes":
            return str(self.value)
        return {self.kind: self.value}

    def describe(self) -> str:
        """Human wording of the budget, e.g. ``0.5 of all experts`` or ``8 experts per layer``."""
        return str(self)

    def __str__(self) -> str:
        if self.kind == "fraction":
            return f"{self.value:g} of all experts"
        if self.kind == "per_layer":
            return f"{self.value} experts per layer"
        if self.kind == "experts":
            return f"{self.value} experts"
        return f"{self.value} bytes ({self.value / 2**30:.3g} GiB)"


# ----------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class Sampling(_Section):
    """How tokens are picked from the target's distribution."""

    _path = "sampling"
    temperature: float = _field("softmax temperature; 0 means greedy decoding", 0.0,
                                **_at_least(0, "a number"))
    top_p: float = _field("nucleus sampling: keep the smallest set of tokens with this much mass", 1.0,
                          **_between(0, 1, "a number", low_open=True))
    top_k: int = _field("keep only the k likeliest tokens; 0 turns it off", 0, **_at_least(0))


@dataclass(frozen=True)
class LinkConfig(_Section):
    """The host-to-device link that expert bytes cross."""

    _path = "offload.link"
    kind: str = _field("link plugin moving expert bytes host->device (see --list-plugins), or auto "
                       "(cuda on a CUDA device, else emulated)", "auto",
                       **_non_empty("plugin name"))
    gbps: float = _field("bandwidth in GB/s (the emulated link paces copies to it)", 2.0,
                         check=lambda v: v > 0, allowed="a number > 0")
    latency_us: float = _field("fixed cost per transfer in microseconds (emulated link)", 20.0,
                               **_at_least(0, "a number"))


@dataclass(frozen=True)
class CachePolicyConfig(_Section):
    """Which expert the device cache evicts."""

    _path = "offload.cache_policy"
    name: str = _field("cache policy plugin (see --list-plugins)", "lru", **_non_empty("plugin name"))
    options: dict = _field("keyword arguments for the policy's factory", factory=dict)


@dataclass(frozen=True)
class OffloadConfig(_Section):
    """Where experts live and how they reach the device."""

    _path = "offload"
    expert_budget: ExpertBudget = _field(
        "device cache size for full-precision experts",
        ExpertBudget("fraction", 0.5),
        parse=ExpertBudget.parse,
        allowed=ExpertBudget.ALLOWED,
        type_name="float | {per_layer: int} | {experts: int} | str",
    )
    link: LinkConfig = _field("host-to-device link", factory=LinkConfig)
    cache_policy: CachePolicyConfig = _field("device cache eviction policy", factory=CachePolicyConfig)
    pin_memory: bool = _field("pin host expert memory when the device is CUDA", True)


@dataclass(frozen=True)
class DraftConfig(_Section):
    """The resident quantized copy of the experts that drafts tokens."""

    _path = "speculation.draft"
    bits: int = _field("weight bits of the draft experts", 4, **_one_of(*DRAFT_BITS))
    group_size: int = _field("quantization group size along the input dimension", 64,
                             **_one_of(*GROUP_SIZES))


@dataclass(frozen=True)
class PredictorConfig(_Section):
    """Who predicts the experts the next steps need."""

    _path = "speculation.predictor"
    name: str = _field("expert predictor plugin (see --list-plugins)", "draft", **_non_empty("plugin name"))
    options: dict = _field("keyword arguments for the predictor's factory", factory=dict)


@dataclass(frozen=True)
class GovernorConfig(_Section):
    """Who picks k, the number of draft tokens per speculative step."""

    _path = "speculation.governor"
    name: str = _field("speculation governor plugin (see --list-plugins)", "fixed", **_non_empty("plugin name"))
    k: int = _field("draft tokens per step (the fixed k, or the starting k of an adaptive governor)", 4,
                    **_between(1, MAX_K, "an integer"))
    options: dict = _field("keyword arguments for the governor's factory", factory=dict)


@dataclass(frozen=True)
class SpeculationConfig(_Section):
    """Speculative decoding with the quantized self-draft (engine ``specter``)."""

    _path = "speculation"
    draft: DraftConfig = _field("the quantized draft", factory=DraftConfig)
    predictor: PredictorConfig = _field("the expert predictor", factory=PredictorConfig)
    governor: GovernorConfig = _field("the speculation governor", factory=GovernorConfig)


@dataclass(frozen=True)
class Recipe(_Section):
    """A whole run. Build it with ``load_recipe``; ``to_dict()`` gives it back as plain data."""

    model: str = _field(
        f'"{BUNDLED_PREFIX}NAME" (known: {known_names()}) '
        "or a local Hugging Face checkpoint directory",
        "bundled:tiny-moe",
        **_non_empty("string"),
    )
    engine: str = _field("which engine runs the model", "resident", **_one_of(*ENGINES))
    device: str = _field("auto picks cuda when available, else cpu", "auto",
                         check=lambda v: _DEVICE.fullmatch(v) is not None, allowed="auto, cpu, cuda, cuda:N")
    dtype: str = _field("dtype of the full-precision weights and activations", "float32", **_one_of(*DTYPES))
    threads: int = _field("torch.set_num_threads for the run", 1, **_between(1, MAX_THREADS, "an integer"))
    seed: int = _field("seed of every random number generator", 0, **_between(0, MAX_SEED, "an integer"))
    prompt: str | None = _field("a single prompt (set at most one of prompt, prompts, prompts_file)", None,
                                **_non_empty("string"))
    prompts: list[str] | None = _field("a list of prompts", None,
                                       check=lambda v: v is None or (len(v) > 0 and all(v)),
                                       allowed="a non-empty list of non-empty strings")
    prompts_file: str | None = _field(
        '.jsonl: one object with a "prompt" field per line; other extensions: the whole file is one prompt',
        None, **_non_empty("path"),
    )
    max_prompts: int | None = _field("use only the first N prompts", None, **_at_least(1))
    max_new_tokens: int = _field("tokens generated per prompt", 64, **_at_least(1))
    sampling: Sampling = _field("token sampling", factory=Sampling)
    offload: OffloadConfig = _field("expert offloading", factory=OffloadConfig)
    speculation: SpeculationConfig = _field("speculative decoding", factory=SpeculationConfig)
    compile: bool = _field("torch.compile the decode step functions", False)
    allow_pickle: bool = _field("allow loading .bin (pickle) checkpoints, which can run code", False)
    trust_remote_code: bool = _field("let transformers run model code shipped with the checkpoint", False)
    check_lossless: bool = _field(
        "for greedy runs of non-resident engines, also run resident and compare tokens", True
    )
    source_dir: Path | None = field(
        default=None, compare=False, repr=False,
        metadata={"internal": True, "doc": "directory of the recipe file, for relative paths"},
    )

    def _check(self) -> None:
        chosen = [name for name in ("prompt", "prompts", "prompts_file") if getattr(self, name) is not None]
        if len(chosen) > 1:
            raise _error(
                chosen[1],
                f"set at most one of prompt, prompts, prompts_file; got {' and '.join(chosen)}; "
                "allowed: exactly one of them, or none for the built-in prompts",
            )
        if self.source_dir is not None and not isinstance(self.source_dir, Path):
            object.__setattr__(self, "source_dir", Path(self.source_dir))
        self.model_path(build=False)
        if self.prompts_file is not None and _find(self.prompts_file, self.source_dir, Path.is_file) is None:
            raise _error(
                "prompts_file",
                f"no such file: {_plain(self.prompts_file)} (looked in the current directory"
                f"{' and the recipe directory' if self.source_dir else ''}); "
                "allowed: a path to a .jsonl file or a text file",
            )

    def model_path(self, build: bool = True) -> Path:
        """The checkpoint directory: the bundled model's, or ``model`` resolved like any path.
        A widened bundled model is built on first use, unless ``build`` is false (validation)."""
        if self.model.startswith(BUNDLED_PREFIX):
            name = self.model[len(BUNDLED_PREFIX):]
            try:
                known = is_bundled(name)
            except ValueError as error:
                raise _error("model", str(error)) from None
            if not known:
                raise _error(
                    "model", f"unknown bundled model {_show(name)}; allowed: {BUNDLED_PREFIX}NAME with NAME one of "
                    f"{known_names()}, or a local Hugging Face checkpoint directory",
                )
            return bundled_path(name) if build else Path(name)
        found = _find(self.model, self.source_dir, Path.is_dir)
        if found is None:
            raise _error(
                "model",
                f"no such directory: {_plain(self.model)}; use a local Hugging Face checkpoint "
                f"directory or {BUNDLED_PREFIX}NAME ({known_names()})",
            )
        return found

    def resolved_device(self) -> str:
        """``device`` with ``auto`` replaced by ``cuda`` when CUDA is available, else ``cpu``."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def plugins_used(self) -> list[PluginChoice]:
        """The plugins the chosen engine instantiates (the only ones whose names are checked)."""
        return [PluginChoice(key, kind, _lookup(self, key)) for key, kind in ENGINE_PLUGINS[self.engine]]

    def resolved_prompts(self, base_dir: str | Path | None = None) -> list[str]:
        """The prompts of the run, at most ``max_prompts`` of them.

        ``prompts_file`` is looked up relative to the current directory first, then to
        ``base_dir`` (by default the directory of the recipe file). With no prompt source set,
        ``DEFAULT_PROMPTS`` is used.
        """
        if self.prompt is not None:
            prompts = [self.prompt]
        elif self.prompts is not None:
            prompts = list(self.prompts)
        elif self.prompts_file is not None:
            base = Path(base_dir) if base_dir is not None else self.source_dir
            path = _find(self.prompts_file, base, Path.is_file)
            if path is None:
                shown = _plain(self.prompts_file)
                raise _error("prompts_file", f"no such file: {shown}; allowed: an existing file")
            prompts = _read_prompts(path)
        else:
            prompts = list(DEFAULT_PROMPTS)
        return prompts[: self.max_prompts] if self.max_prompts is not None else prompts


def _lookup(section: _Section, dotted: str) -> Any:
    value: Any = section
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _find(path_text: str, base_dir: Path | None, predicate: Callable[[Path], bool]) -> Path | None:
    """First of ``path`` (cwd-relative) and ``base_dir / path`` satisfying ``predicate``."""
    try:
        path = Path(os.path.expanduser(path_text))
        candidates = [path] if path.is_absolute() else [Path.cwd() / path]
        if base_dir is not None and not path.is_absolute():
            candidates.append(base_dir / path)
        for candidate in candidates:
            if predicate(candidate):
                return candidate
    except (OSError, ValueError):
        return None
    return None


def _read_prompts(path: Path) -> list[str]:
    allowed = 'allowed: one JSON object per line with a non-empty string "prompt" field'
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise _error("prompts_file", f"cannot read {_plain(str(path))}: {exc}") from None
    if path.suffix != ".jsonl":
        if not text:
            raise _error("prompts_file", f"{_plain(str(path))} is empty; allowed: a non-empty text file")
        return [text]
    prompts = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{_plain(str(path))}:{line_number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _error("prompts_file", f"{where}: invalid JSON ({exc.msg}); {allowed}") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
            raise _error("prompts_file", f"{where}: no string \"prompt\" field; {allowed}")
        prompts.append(item["prompt"])
    if not prompts:
        raise _error("prompts_file", f"{_plain(str(path))} holds no prompts; {allowed}")
    return prompts


# ----------------------------------------------------------------------------- loading


def load_recipe(
    source: str | Path | Mapping[str, Any] | Recipe,
    overrides: Sequence[str] = (),
    *,
    check_plugins: bool = True,
    source_dir: str | Path | None = None,
) -> Recipe:
    """Read a recipe from a YAML file path or a mapping, apply ``key=value`` overrides, validate.

    A ``Recipe`` source is re-validated with the overrides and keeps its recipe directory (which
    ``load_recipe(recipe.to_dict())`` would lose, breaking relative paths).

    Override values are parsed with ``yaml.safe_load`` (``0.25`` is a float, ``true`` a bool,
    ``[a, b]`` a list, ``2GiB`` a string); keys under an ``options`` mapping are free-form. With
    ``check_plugins`` the names of the plugins the engine uses must be registered. ``source_dir``
    is where relative paths of a mapping source are looked up (after the current directory).
    """
    if isinstance(source, Recipe):
        raw: Any = source.to_dict()
        source_dir = source.source_dir
    elif isinstance(source, Mapping):
        raw = copy.deepcopy(dict(source))
        source_dir = Path(source_dir) if source_dir is not None else None
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        raw = _read_yaml(path)
        source_dir = path.resolve().parent
    else:
        got = _type_name(source)
        raise _error("recipe", f"expected a path or a mapping, got {got}; allowed: a YAML file path")
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        known = ", ".join(f.name for f in _schema_fields(Recipe))
        raise _error(
            "recipe",
            f"the top level must be a mapping of keys to values, got {_type_name(raw)} {_show(raw)}; "
            f"allowed keys: {known}",
        )
    raw = dict(raw)
    for item in [overrides] if isinstance(overrides, str) else overrides:
        _apply_override(raw, item)
    recipe = _from_mapping(Recipe, raw, source_dir=source_dir)
    if check_plugins:
        check_plugin_names(recipe)
    return recipe


def check_plugin_names(recipe: Recipe) -> None:
    """Raise ``UnknownPluginError`` (naming the recipe key) for an unregistered plugin the run uses.

    ``offload.link.kind: auto`` is not a plugin but a choice the engine makes, so it passes.
    """
    from specter.plugins import registry

    plugins = registry()
    for choice in recipe.plugins_used():
        if (choice.kind, choice.name) != ("link", AUTO_LINK):
            plugins.get(choice.kind, choice.name, key=choice.key)


def _read_yaml(path: Path) -> Any:
    shown = _plain(str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _error("recipe", f"no such file: {shown}; allowed: a path to a YAML recipe") from None
    except IsADirectoryError:
        raise _error("recipe", f"{shown} is a directory; allowed: a path to a YAML recipe") from None
    except UnicodeDecodeError:
        raise _error("recipe", f"{shown} is not UTF-8 text; allowed: a YAML recipe") from None
    except (OSError, ValueError) as exc:
        raise _error("recipe", f"cannot read {shown}: {exc}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{shown}:{mark.line + 1}:{mark.column + 1}" if mark is not None else shown
        problem = getattr(exc, "problem", None) or str(exc)
        raise _error("recipe", f"{where}: invalid YAML: {' '.join(str(problem).split())}") from None


def _apply_override(raw: dict[str, Any], item: object) -> None:
    """Set ``dotted.key=value`` in the raw recipe mapping, checking the key against the schema."""
    if not isinstance(item, str) or "=" not in item:
        raise _error(
            display_key(item),
            "an override must look like dotted.key=value (for example offload.expert_budget=0.25); "
            "allowed keys: see --explain",
        )
    dotted, text = item.split("=", 1)
    dotted = dotted.strip()
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        shown = _show(text)
        raise _error(display_key(dotted), f"cannot parse override value {shown} as YAML: {problem}") from None
    parts = dotted.split(".")
    section: type | None = Recipe
    node = raw
    for depth, part in enumerate(parts):
        path = ".".join(display_key(p) for p in parts[: depth + 1])
        last = depth == len(parts) - 1
        hint: Any = None
        if section is not None:
            known = {f.name: f for f in _schema_fields(section)}
            if part not in known:
                parent = section._path
                raise _error(
                    path,
                    f"unknown key (in override {_show(item)}); {_suggest(part, list(known), parent)}"
                    f"allowed keys{' under ' + parent if parent else ''}: {', '.join(known)}",
                )
            hint = _hints(section)[part]
        if last:
            node[part] = value
            return
        if section is not None and isinstance(hint, type) and issubclass(hint, _Section):
            next_section: type | None = hint
        elif section is None or hint is dict:
            next_section = None
        else:
            raise _error(path, f"takes a single value, not sub-keys (in override {_show(item)}); "
                               f"allowed: {path}=VALUE")
        child = node.get(part)
        if isinstance(child, _Section):
            child = child.to_dict()
        elif child is None:
            child = {}
        elif isinstance(child, Mapping):
            child = dict(child)
        else:
            raise _error(path, f"expected a mapping, got {_type_name(child)} {_show(child)} "
                               f"(in override {_show(item)}); allowed: a mapping")
        node[part] = child
        node, section = child, next_section


# ----------------------------------------------------------------------------- introspection


def _leaves(cls: type, prefix: str = "") -> list[tuple[str, dataclasses.Field, Any]]:
    found = []
    for f in _schema_fields(cls):
        key = _join(prefix, f.name)
        hint = _hints(cls)[f.name]
        if isinstance(hint, type) and issubclass(hint, _Section):
            found.extend(_leaves(hint, key))
        else:
            found.append((key, f, hint))
    return found


def recipe_keys() -> list[str]:
    """Every leaf key of the schema as a dotted path, in schema order."""
    return [key for key, _, _ in _leaves(Recipe)]


def describe() -> str:
    """Every recipe key with its type, default and doc (what ``specter.run --explain`` prints)."""
    lines = []
    for key, f, hint in _leaves(Recipe):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        label = f.metadata["type_name"] or _type_label(hint)
        allowed = f.metadata["allowed"] or _type_word(hint)
        lines.append(f"{key}: {label} = {json.dumps(_plain_data(default))}")
        lines.append(f"    {f.metadata['doc']}. Allowed: {allowed}.")
    return "\n".join(lines)
