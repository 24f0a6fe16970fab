"""The external reference engine ``hf-offload``: transformers + accelerate offloading, set up as a
user would, decoded by Specter's shared loop so its figures sit beside the other engines'.

Contract: ``build_hf_offload(recipe, path, tokenizer, device, dtype)`` returns an
``HFOffloadEngine`` (see its docstring for the placement on CUDA and on CPU); its report carries
``expert_budget`` (what was asked), ``device_bytes`` (what accelerate kept in memory) and
``offload`` (tier, bytes and modules offloaded, the offload folder, the page-cache mode). On the
disk tier its ``link`` entry and ``transfer_wait_s`` say what accelerate read and how long decoding
waited for it (``specter.decode.hf_offload_io``); with ``offload.experts_on: disk`` and
``offload.direct_io`` (the setting every engine of a disk-tier recipe runs in) the offloaded files'
pages are dropped after each read. ``close()`` removes the offload folder. A forward that cannot
read accelerate's offloaded weights (the offload folder or a checkpoint file gone or unreadable
while the engine lives, e.g. a temp-directory cleaner) is a ``SpecterError`` naming the file and
the folder, not a traceback from inside accelerate.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref

import torch

from specter.decode.engine import Engine, tensor_bytes
from specter.decode.hf_offload_io import OffloadReads
from specter.memory.budget import budget_slots
from specter.errors import SpecterError
from specter.model.loader import check_weights_format
from specter.quiet import loading_quietly

OFFLOAD_FOLDER_PREFIX = "specter-hf-offload-"


class HFOffloadEngine(Engine):
    """The external reference: transformers + accelerate offloading as a user would set it up.

    - CUDA: ``device_map="auto"`` with ``max_memory`` capping the GPU at dense + budget bytes; what
      does not fit stays in host memory and accelerate's hooks move it to the GPU per forward
      (offload tier ``cpu``).
    - CPU: the only offload a CPU user has is accelerate's disk offload. The device map keeps every
      dense weight and the experts modules of the first layers that fit the budget in memory and
      puts the other layers' experts modules on ``disk``: transformers re-saves those (converted)
      weights as safetensors in a temporary ``offload_folder`` and accelerate's hooks load them
      per forward (offload tier ``disk``). transformers 5 stores one layer's experts as ONE module
      with stacked parameters ([E, 2I, H], [E, H, I]), so this offload moves whole layers' experts,
      never single experts (a budget that is not a whole number of layers rounds down). Weights a
      checkpoint already stores in the model's layout (GPT-OSS) are not re-saved: accelerate reads
      them from the checkpoint's own safetensors and the folder stays empty.
      Not ``device_map="auto"`` with ``max_memory={"cpu": dense + budget}``: accelerate never splits
      a decoder layer (``_no_split_modules``), reserves one whole layer of the cpu cap for loading
      disk layers, and fills devices greedily in module order, so it puts whole decoder layers
      (attention, norms, ``lm_head`` included) on disk and keeps far less than the budget in memory
      (a 4-layer tiny Mixtral at 25%: only the embeddings stay in memory).

    On the disk tier, accelerate's loads are timed and their storage reads counted
    (``OffloadReads``); a recipe whose experts live on disk with ``direct_io`` (page cache
    bypassed for Specter's own reads) has accelerate's files dropped from the page cache after
    each forward too, so both read from the disk, as on a machine whose RAM cannot hold them.

    Decoding goes through the base ``Engine`` loop (the model's own forward with a DynamicCache),
    so greedy tokens equal the resident engine's. ``close()`` deletes the offload folder (it is
    also deleted at interpreter exit); ``generate`` then raises ``SpecterError`` (engine closed).
    """

    name = "hf-offload"

    def __init__(self, recipe, model, tokenizer, device, model_path, budget: dict, tier: str,
                 folder: str | None) -> None:
        super().__init__(recipe, model, tokenizer, device, model_path)
        self.expert_budget = budget
        self.offload_tier = tier
        self.offload_folder = folder
        self._remove_folder = weakref.finalize(self, _remove_folder, folder) if folder else None
        self.placement = offload_placement(model, tier)
        drop_pages = recipe.offload.experts_on == "disk" and recipe.offload.direct_io
        offloaded = tier == "disk" and self.placement["modules_offloaded"] > 0
        self.reads = OffloadReads.install(model, drop_pages) if offloaded else None
        self._prefill_wait_s = 0.0

    def reset_counters(self) -> None:
        self._prefill_wait_s = 0.0
        if self.reads is not None:
            self.reads.reset()

    def prefill(self, prompt_ids, kv, generator, metrics) -> int:
        before = self.reads.wait_s if self.reads is not None else 0.0
        token = super().prefill(prompt_ids, kv, generator, metrics)
        if self.reads is not None:
            self._prefill_wait_s += self.reads.wait_s - before
        return token

    def forward_logits(self, input_ids, kv):
        try:
            return super().forward_logits(input_ids, kv)
        except OSError as error:  # accelerate reads its offloaded weights from files during the forward
            folder = f" (offload folder {self.offload_folder})" if self.offload_folder else ""
            raise SpecterError(f"engine: hf-offload: accelerate could not read its offloaded weights{folder}: "
                               f"{type(error).__name__}: {error}; the offload files must stay in place while "
                               "the engine runs") from error

    def engine_report(self) -> dict:
        placed = self.placement
        disk = {} if self.reads is None else {
            "link": self.reads.describe(), "transfer_wait_s": self.reads.wait_s - self._prefill_wait_s}
        return {**disk,
            "expert_budget": dict(self.expert_budget),
            "device_bytes": {"draft": None, "cache": placed["expert_bytes_kept"], "dense": placed["dense_bytes_kept"],
                             "total": placed["expert_bytes_kept"] + placed["dense_bytes_kept"]},
            "offload": {"backend": "accelerate", "tier": self.offload_tier,
                        "offloaded_bytes": placed["offloaded_bytes"],
                        "modules_offloaded": placed["modules_offloaded"],
                        "folder": self.offload_folder,
                        "page_cache": None if self.reads is None else self.reads.mode},
        }

    def close(self) -> None:
        if self.reads is not None:
            self.reads.close()
        if self._remove_folder is not None:
            self._remove_folder()


def _remove_folder(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _map_lookup(device_map: dict, name: str):
    """The device ``device_map`` gives parameter ``name`` (its longest matching module prefix)."""
    parts = name.split(".")
    for end in range(len(parts), -1, -1):
        key = ".".join(parts[:end])
        if key in device_map:
            return device_map[key]
    raise SpecterError(f"engine: hf-offload: accelerate's device map does not place {name!r}")


def offload_placement(model, tier: str) -> dict:
    """Bytes of parameters in the memory tier and in the offload tier, from ``model.hf_device_map``.

    Offloaded: device-map values ``disk`` (tier ``disk``) or ``cpu``/``disk`` (tier ``cpu``, the GPU
    being the memory tier). Buffers are never offloaded (``offload_buffers=False``): dense, kept.
    """
    from specter.model.layout import moe_layers

    device_map = getattr(model, "hf_device_map", None) or {"": "cpu"}
    offload_values = {"disk"} if tier == "disk" else {"cpu", "disk"}
    expert_names = {f"{m.experts_name}.{n}" for m in moe_layers(model) for n in m.param_names}
    kept = {"expert": 0, "dense": 0}
    offloaded = 0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if _map_lookup(device_map, name) in offload_values:
            offloaded += size
        else:
            kept["expert" if name in expert_names else "dense"] += size
    kept["dense"] += tensor_bytes(model.buffers())
    return {
        "expert_bytes_kept": kept["expert"],
        "dense_bytes_kept": kept["dense"],
        "offloaded_bytes": offloaded,
        "modules_offloaded": sum(1 for value in device_map.values() if value in offload_values),
    }


def disk_offload_device_map(model, offloaded: set[str]) -> dict[str, str]:
    """A device map putting the modules named in ``offloaded`` on ``disk`` and everything else on
    ``cpu``, with no overlapping keys: modules that hold an offloaded module are split into their
    children (and own parameters and buffers)."""
    device_map: dict[str, str] = {}

    def visit(prefix: str, module) -> None:
        if prefix in offloaded:
            device_map[prefix] = "disk"
            return
        if not any(prefix == "" or name.startswith(prefix + ".") for name in offloaded):
            device_map[prefix] = "cpu"
            return
        join = (lambda n: f"{prefix}.{n}") if prefix else (lambda n: n)
        for name, _ in module.named_parameters(recurse=False):
            device_map[join(name)] = "cpu"
        for name, _ in module.named_buffers(recurse=False):
            device_map[join(name)] = "cpu"
        for name, child in module.named_children():
            visit(join(name), child)

    visit("", model)
    return device_map


def build_hf_offload(recipe, path, tokenizer, device: torch.device, dtype: torch.dtype) -> Engine:
    from transformers import AutoConfig, AutoModelForCausalLM

    from specter.model.layout import moe_layers

    if device.type not in ("cuda", "cpu"):
        raise SpecterError(f"device: hf-offload runs on cuda (offload to host memory) or cpu (offload to disk), "
                           f"not {device}")
    config = AutoConfig.from_pretrained(path, trust_remote_code=recipe.trust_remote_code)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=recipe.trust_remote_code)
    layers = moe_layers(skeleton)
    layer_bytes = [tensor_bytes(getattr(m.experts, n) for n in m.param_names) for m in layers]
    expert_bytes = sum(layer_bytes)
    dense_bytes = tensor_bytes(skeleton.parameters()) - expert_bytes
    n_experts = sum(m.num_experts for m in layers)
    per_expert = expert_bytes // n_experts
    budget = recipe.offload.expert_budget
    slots = budget_slots(budget, len(layers), layers[0].num_experts, per_expert, max(m.top_k for m in layers))
    budget_bytes = slots * per_expert
    asked = {"experts": slots, "bytes": budget_bytes, "fraction": slots / n_experts}
    check_weights_format(path, recipe.allow_pickle)

    folder = None
    if device.type == "cuda":
        tier = "cpu"
        placement = dict(device_map="auto", max_memory={device.index or 0: dense_bytes + budget_bytes, "cpu": 2**40})
    else:
        # Whole layers' experts modules, first layers first (accelerate's fill order), while they fit.
        tier, kept, offloaded = "disk", 0, set()
        for layer, size in zip(layers, layer_bytes):
            if not offloaded and kept + size <= budget_bytes:
                kept += size
            else:
                offloaded.add(layer.experts_name)
        placement = dict(device_map=disk_offload_device_map(skeleton, offloaded))
        if offloaded:
            folder = tempfile.mkdtemp(prefix=OFFLOAD_FOLDER_PREFIX)
            placement["offload_folder"] = folder
    try:
        with loading_quietly():  # transformers' weight-loading bar, as every other engine's load
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, trust_remote_code=recipe.trust_remote_code, **placement).eval()
    except BaseException as exc:
        if folder is not None:
            _remove_folder(folder)
        if isinstance(exc, (ValueError, RuntimeError)):
            reason = (str(exc).strip().splitlines() or [""])[0]
            raise SpecterError(f"offload.expert_budget: hf-offload: accelerate refused to place the model with "
                               f"{budget.describe()} ({type(exc).__name__}: {reason})") from exc
        raise
    return HFOffloadEngine(recipe, model, tokenizer, device, path, asked, tier, folder)
