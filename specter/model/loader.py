"""Load a local Hugging Face MoE checkpoint and, for offloading engines, split its experts off.

Contract:
- ``checkpoint_dir(path)`` -> the path, if it is a checkpoint directory (SpecterError otherwise).
- ``check_weights_format(path, allow_pickle)``: safetensors files checked (``check_safetensors``),
  a shard the safetensors index names but the directory lacks refused naming it, pickle refused
  unless allowed.
- ``load_model(path, dtype=..., device=..., allow_pickle=False, trust_remote_code=False,
  keep_experts_on_host=False)`` loads with ``transformers.AutoModelForCausalLM`` from safetensors
  only (a pickle ``.bin`` checkpoint is refused unless ``allow_pickle``). With
  ``keep_experts_on_host`` the model is materialised in host memory (transformers streams the
  safetensors files; nothing is held twice), its routed-expert tensors are moved into an
  ``ExpertStore`` (pinned when the device is CUDA) and replaced in the model by empty
  placeholders, and only then is the rest (dense weights) moved to the device: the experts never
  all reach the device. With ``experts_on_disk`` as well, the routed experts are never loaded
  (``specter.model.disk_load``): they are read from the checkpoint's safetensors by the disk tier,
  so a model whose experts do not fit in RAM loads in the memory of its dense weights; a pickle
  checkpoint (``allow_pickle``) has no byte ranges to read and is refused for it.
  Engines of one process share the store of one checkpoint: while a store built from the same
  safetensors files (path, sizes, modification times), dtype and pinning is alive, the next
  ``keep_experts_on_host`` load reuses it and loads the model without its experts
  (``load_without_experts``), so a bench's dozen offloaded engines hold the experts once, not a
  dozen times (the store is read-only: links copy from it, the INT4 draft quantizes from it).
- ``split_experts(model, pin, device=None)`` does the expert split on an already loaded model
  (``specter.offload``). The store (and the disk tier's reads) hold the experts blocked where
  ``specter.model.expert_layout.chooses_blocked`` for the engine's device.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
from torch import nn

from specter.config.recipe import DTYPES as DTYPE_NAMES
from specter.errors import SpecterError
from specter.memory.blocked_layout import block_in_place
from specter.model import expert_layout
from specter.quiet import loading_quietly
from specter.model.layout import MoELayer, moe_layers
from specter.memory.store import ExpertStore

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # recipe dtype name -> torch dtype


def checkpoint_dir(path: Path) -> Path:
    """``path`` if it is a Hugging Face checkpoint directory (it holds config.json), else a
    ``SpecterError`` saying what is missing. Recipes resolve ``bundled:NAME`` and relative paths
    (``Recipe.model_path``); this checks what they point at."""
    if not path.is_dir():
        raise SpecterError(f"model: no such directory: {path}; use a local Hugging Face checkpoint directory or bundled:tiny-moe")
    if not (path / "config.json").is_file():
        raise SpecterError(f"model: {path} has no config.json; expected a Hugging Face checkpoint directory")
    return path


def check_weights_format(path: Path, allow_pickle: bool) -> bool:
    """True when the checkpoint has safetensors (each checked by ``check_safetensors``, and every
    shard its ``model.safetensors.index.json`` names present); raises if it has only pickle files
    and pickle is not allowed."""
    from specter.memory.disk import INDEX_NAME, indexed_shards

    files = sorted(path.glob("*.safetensors"))
    for shard in indexed_shards(path) or []:
        if not shard.is_file():
            raise SpecterError(f"model: shard {shard.name} named by {path / INDEX_NAME} is missing; "
                               "re-download the checkpoint (every shard the index names)")
    if files:
        for file in files:
            check_safetensors(file)
        return True
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        if not allow_pickle:
            raise SpecterError(
                f"model: {path} holds only pickle (.bin) weights, which can run arbitrary code when loaded; "
                "convert it to safetensors or set allow_pickle: true in the recipe"
            )
        return False
    raise SpecterError(f"model: {path} has no weights (*.safetensors)")


def check_safetensors(file: Path) -> None:
    """Refuse a truncated or corrupt safetensors file, naming it, before transformers reads it
    (``specter.memory.disk.read_header`` checks the header and every tensor's byte range)."""
    from specter.memory.disk import read_header

    read_header(file)


_shared_stores: "weakref.WeakValueDictionary[tuple, ExpertStore]" = weakref.WeakValueDictionary()


def _store_key(path: Path, dtype: torch.dtype, pin: bool, device: torch.device) -> tuple:
    """What makes two loads' expert stores equal: the checkpoint's safetensors files as they are
    now, the dtype, the pinning, and what decides the experts' layout besides the model (the
    device's kind, the switch ``expert_layout.enabled`` and its size floor)."""
    stats = [(f.name, f.stat()) for f in sorted(path.glob("*.safetensors"))]
    files = tuple((name, stat.st_size, stat.st_mtime_ns) for name, stat in stats)
    layout = device.type, expert_layout.enabled(), expert_layout.BLOCKED_MIN_BYTES
    return str(path.resolve()), files, str(dtype), pin, layout


def _leave_placeholders(info: MoELayer) -> None:
    """Replace the layer's stacked expert parameters by empty ones of the same per-expert shape."""
    for name in info.param_names:
        param = getattr(info.experts, name)
        device = "cpu" if param.device.type == "meta" else param.device
        placeholder = torch.empty((0,) + tuple(param.shape[1:]), dtype=param.dtype, device=device)
        setattr(info.experts, name, nn.Parameter(placeholder, requires_grad=False))


def split_experts(model: nn.Module, pin: bool,
                  device: torch.device | None = None) -> tuple[list[MoELayer], ExpertStore]:
    """Move every routed-expert tensor of ``model`` into a host ExpertStore; leave empty placeholders.
    The store is blocked where ``expert_layout.chooses_blocked`` for experts computed on ``device``
    (the model's own when None), each tensor rewritten in place once the model lets go of it."""
    layers = moe_layers(model)
    first = getattr(layers[0].experts, layers[0].param_names[0]) if layers else None
    blocked = first is not None and expert_layout.chooses_blocked(layers[0].experts, first.dtype,
                                                                  device or first.device)
    host: dict[int, dict[str, torch.Tensor]] = {}
    for info in layers:
        host[info.layer] = {name: getattr(info.experts, name).detach().to("cpu") for name in info.param_names}
        _leave_placeholders(info)
        if blocked:
            for tensor in host[info.layer].values():
                block_in_place(tensor)
    return layers, ExpertStore(host, pin=pin, blocked=blocked)


def experts_to_disk(model: nn.Module, path: Path, direct_io: bool, trust_remote_code: bool = False,
                    device: torch.device | None = None):
    """Serve ``model``'s routed experts (left on ``meta`` by ``load_without_experts``) from its
    checkpoint on disk (``specter.memory.disk``): the mapping is checked against expert 0 of the
    first MoE layer as transformers loads it, then empty placeholders take the experts' place.
    Reads are blocked where ``expert_layout.chooses_blocked`` for ``device`` (default: the CPU)."""
    from specter.memory.disk import CheckpointIndex, DiskExperts
    from specter.memory.disk_store import DiskStore
    from specter.model.disk_load import reference_layer

    layers = moe_layers(model)
    dtype = getattr(layers[0].experts, layers[0].param_names[0]).dtype
    disk = DiskExperts(CheckpointIndex(path), layers, dtype, direct=direct_io)
    first = layers[0]
    # in the dtype the experts are stored in (no conversion; a config's dtype may say another)
    reference = reference_layer(path, first.layer, trust_remote_code, disk.stored_dtype(first.layer))
    disk.check(first.layer, {name: getattr(reference, name).detach() for name in first.param_names})
    del reference
    disk.blocked = expert_layout.chooses_blocked(first.experts, dtype, device or torch.device("cpu"))
    for info in layers:
        _leave_placeholders(info)
    disk.reset_counters()
    return layers, DiskStore(disk, layers[0].num_experts)


def load_model(
    path: Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    keep_experts_on_host: bool = False,
    pin_memory: bool = True,
    experts_on_disk: bool = False,
    direct_io: bool = True,
):
    """Returns ``(model, layers, store)``; ``layers``/``store`` are None unless ``keep_experts_on_host``.
    The host store is pinned when the device is CUDA and ``pin_memory`` is set."""
    from transformers import AutoModelForCausalLM

    use_safetensors = check_weights_format(path, allow_pickle)
    if keep_experts_on_host and experts_on_disk and not use_safetensors:
        raise SpecterError(f"offload.experts_on: disk reads the experts from the checkpoint's safetensors files, but "
                           f"{path} holds only pickle (.bin) weights; convert it to safetensors or use "
                           "offload.experts_on: host")
    if keep_experts_on_host and experts_on_disk:
        from specter.model.disk_load import load_without_experts

        model = load_without_experts(path, dtype, trust_remote_code)
        layers, store = experts_to_disk(model, path, direct_io, trust_remote_code, device)
        model.to(device)
        return model, layers, store
    pin = pin_memory and device.type == "cuda"
    key = _store_key(path, dtype, pin, device) if keep_experts_on_host and use_safetensors else None
    shared = _shared_stores.get(key) if key is not None else None
    if shared is not None:
        from specter.model.disk_load import load_without_experts

        model = load_without_experts(path, dtype, trust_remote_code)
        layers = moe_layers(model)
        for info in layers:
            _leave_placeholders(info)
        model.to(device)
        return model, layers, shared
    with loading_quietly():
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, use_safetensors=use_safetensors, trust_remote_code=trust_remote_code,
        )
    model.eval()
    layers = store = None
    if keep_experts_on_host:
        layers, store = split_experts(model, pin=pin, device=device)
        if key is not None:
            _shared_stores[key] = store
    model.to(device)
    return model, layers, store


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    """The checkpoint's tokenizer, or None when it ships none (token ids must then be given)."""
    from transformers import AutoTokenizer

    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
