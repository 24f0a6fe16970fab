"""The recipe: one YAML file (plus ``--set dotted.key=value`` overrides) that describes a run.

Contract: ``load_recipe(source, overrides)`` returns a frozen ``Recipe`` or raises ``RecipeError``
(or ``UnknownPluginError`` for a plugin name) whose message is one line that starts with the
dotted key at fault, shows the offending value and says what is allowed. Every field carries a
type, a default and a one-line doc in its ``metadata``; ``describe()`` prints them all.

Sections validate themselves in ``__post_init__``, so a recipe built in Python
(``Recipe(engine="ondemand", offload={"expert_budget": 0.25})``) obeys the same rules as one read
from YAML; nested sections may be given as mappings. Relative paths (``model``, ``prompts_file``)
are looked up in the current directory first, then in the directory of the recipe file. Plugin
names (the engine's included) are all checked against ``specter.plugins.registry()``
(``Recipe.plugins_used()``), whichever engine runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from specter.bundled import bundled_path, is_bundled, known_names
from specter.config.budget import ExpertBudget
from specter.config.files import _find, _read_prompts
from specter.config.schema import _DEVICE, _Section, _at_least, _between, _error, _field, _non_empty, _one_of, _plain, _show

DTYPES = ("float32", "bfloat16", "float16")
GROUP_SIZES = (32, 64, 128, 256)
MAX_K = 32  # the most draft tokens per speculative round (speculation.governor.k, a governor's next_k)
MAX_SEED = 2**32 - 1
MAX_THREADS = 1024
BUNDLED_PREFIX = "bundled:"
AUTO_LINK = "auto"  # the engine picks the link: see LinkConfig.kind

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


PLUGIN_KEYS = (
    ("engine", "engine"),
    ("offload.cache_policy.name", "cache_policy"),
    ("offload.link.kind", "link"),
    ("speculation.predictor.name", "predictor"),
    ("speculation.governor.name", "governor"),
)


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
                       "(disk where experts_on is disk without a host tier, else cuda on a CUDA device, "
                       "else emulated)", "auto",
                       **_non_empty("plugin name"))
    gbps: float = _field("bandwidth in GB/s (the emulated link paces copies to it)", 2.0,
                         check=lambda v: v > 0, allowed="a number > 0")
    latency_us: float = _field("fixed cost per transfer in microseconds (emulated link)", 20.0,
                               **_at_least(0, "a number"))
    options: dict = _field("further keyword arguments for the link's factory", factory=dict)

    def factory_options(self, kind: str) -> dict:
        """The options link ``kind``'s factory receives: ``options``, and for the built-in ``emulated``
        link ``gbps`` and ``latency_us`` before them (``options`` may override them)."""
        paced = {"gbps": self.gbps, "latency_us": self.latency_us} if kind == "emulated" else {}
        return {**paced, **self.options}


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
    prefetch: str = _field("when and how prefetches are issued: aggressive (while the draft runs; may evict a "
                           "prediction needed later in the round to load one needed sooner, but not, until the "
                           "draft is done, an expert the last round read: earliest arrival), "
                           "conservative (never evict a prediction of this round, except for the layer "
                           "verification needs next: fewer copies, for links slower than compute), lazy (nothing "
                           "while the draft runs, all at the flush with the round known: fewest copies, for links "
                           "that keep up) or auto (conservative while rounds wait on transfers for more than 30% of "
                           "their time, else aggressive)", "auto",
                           **_one_of("aggressive", "conservative", "lazy", "auto"))
    pin_memory: bool = _field("pin host expert memory when the device is CUDA", True)
    experts_on: str = _field("where the full-precision experts live below the cache: host (memory) or disk "
                             "(read from the checkpoint's safetensors; device cpu with link disk, or any device with "
                             "offload.host_budget)", "host",
                             **_one_of("host", "disk"))
    host_budget: ExpertBudget | None = _field(
        "experts_on: disk only: a tier of this many experts in host memory (pinned on CUDA) between the "
        "disk and the device cache, filled as soon as the draft predicts an expert, ahead of the device "
        "copies; offload.link is then the host-to-device link. null: no host tier (on a CPU the device "
        "cache already is host memory)", None,
        parse=lambda value, key: None if value is None else ExpertBudget.parse(value, key),
        allowed="null or " + ExpertBudget.ALLOWED,
        type_name="null | float | {per_layer: int} | {experts: int} | str",
    )
    direct_io: bool = _field("disk tier: bypass the page cache (O_DIRECT, or dropping pages after each read) "
                             "for honest disk figures; false lets the page cache serve repeated reads", True)
    transfer_timeout_s: float = _field("deadline of every wait on an expert copy; a copy not done by then "
                                       "ends the run (a stalled link)", 60.0,
                                       check=lambda v: v > 0, allowed="a number of seconds > 0")
    verify_copies: bool = _field("checksum every expert copy on arrival against the host store and reload "
                                 "a wrong one (also on when the environment sets SPECTER_VERIFY_COPIES=1)", False)

    def _check(self) -> None:
        if self.host_budget is not None and self.experts_on != "disk":
            raise _error("offload.host_budget", "a host tier sits between the disk and the device cache: set "
                                                "offload.experts_on: disk, or leave host_budget null")


@dataclass(frozen=True)
class DraftConfig(_Section):
    """The resident quantized copy of the experts that drafts tokens."""

    _path = "speculation.draft"
    bits: int = _field("bits per draft weight: 4, the symmetric INT4 the draft kernels implement (a name "
                       "DESIGN.md's recipe sketch gives; any other width is refused)", 4, **_one_of(4))
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
    engine: str = _field("engine plugin that runs the model (see --list-plugins): resident, ondemand, "
                         "router-lookahead, specter, hf-offload", "resident", **_non_empty("plugin name"))
    device: str = _field("auto picks cuda when available, else cpu", "auto",
                         check=lambda v: _DEVICE.fullmatch(v) is not None, allowed="auto, cpu, cuda, cuda:N")
    dtype: str = _field("dtype of the full-precision weights and activations", "float32", **_one_of(*DTYPES))
    threads: int = _field("torch.set_num_threads for the run", 1, **_between(1, MAX_THREADS, "an integer"))
    seed: int = _field("seed of every random number generator (sampled text repeats with it, except where an "
                       "adaptive governor picks k from timings)", 0, **_between(0, MAX_SEED, "an integer"))
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
    compile: bool = _field("torch.compile the decode step functions (every layout: Mixtral, Qwen3-MoE, OLMoE, "
                           "Qwen2-MoE, PhiMoE, DeepSeek-V2/V3, GPT-OSS; options the compiled math lacks are "
                           "refused, saying what)", False)
    huge_pages: bool = _field("on a CPU device, large weights, host experts and cache slots on 2 MiB transparent "
                              "huge pages where Linux allows them (THP always or madvise; else ordinary pages): "
                              "fewer page walks per expert read", True)
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

    def plugins_used(self) -> list[PluginChoice]:
        """Every plugin the recipe names, whichever engine runs (a misspelt name is a mistake even
        where the engine would not use it)."""
        return [PluginChoice(key, kind, _lookup(self, key)) for key, kind in PLUGIN_KEYS]

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
