"""Load a local Hugging Face MoE checkpoint and, for offloading engines, split its experts off.

Contract:
- ``resolve_model_path("bundled:NAME" | directory)`` -> a checkpoint directory (SpecterError if absent).
- ``load_model(path, dtype=..., device=..., allow_pickle=False, trust_remote_code=False,
  keep_experts_on_host=False)`` loads with ``transformers.AutoModelForCausalLM`` from safetensors
  only (a pickle ``.bin`` checkpoint is refused unless ``allow_pickle``). With
  ``keep_experts_on_host`` the model is materialised in host memory (transformers streams the
  safetensors files; nothing is held twice), its routed-expert tensors are moved into an
  ``ExpertStore`` (pinned when the device is CUDA) and replaced in the model by empty
  placeholders, and only then is the rest (dense weights) moved to the device: the experts never
  all reach the device.
- ``split_experts(model, pin)`` does the expert split on an already loaded model (``specter.offload``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specter.bundled import bundled_path, is_bundled, known_names
from specter.errors import SpecterError
from specter.layout import MoELayer, moe_layers
from specter.store import ExpertStore

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(spec: str) -> Path:
    if spec.startswith("bundled:"):
        name = spec.split(":", 1)[1]
        try:
            known = is_bundled(name)
        except ValueError as error:
            raise SpecterError(f"model: {error}") from None
        if not known:
            raise SpecterError(f"model: unknown bundled model {name!r}; known: {known_names()}")
        path = bundled_path(name)
        if not (path / "config.json").is_file():
            raise SpecterError(f"model: bundled model {name!r} is missing from this installation ({path})")
        return path
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise SpecterError(f"model: no such directory: {spec}; use a local Hugging Face checkpoint directory or bundled:tiny-moe")
    if not (path / "config.json").is_file():
        raise SpecterError(f"model: {spec} has no config.json; expected a Hugging Face checkpoint directory")
    return path


def check_weights_format(path: Path, allow_pickle: bool) -> bool:
    """True when the checkpoint has safetensors; raises if it has only pickle files and pickle is not allowed."""
    if any(path.glob("*.safetensors")):
        return True
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        if not allow_pickle:
            raise SpecterError(
                f"model: {path} holds only pickle (.bin) weights, which can run arbitrary code when loaded; "
                "convert it to safetensors or set allow_pickle: true in the recipe"
            )
        return False
    raise SpecterError(f"model: {path} has no weights (*.safetensors)")


def split_experts(model: nn.Module, pin: bool) -> tuple[list[MoELayer], ExpertStore]:
    """Move every routed-expert tensor of ``model`` into a host ExpertStore; leave empty placeholders."""
    layers = moe_layers(model)
    host: dict[int, dict[str, torch.Tensor]] = {}
    for info in layers:
        tensors = {}
        for name in info.param_names:
            param = getattr(info.experts, name)
            tensors[name] = param.detach().to("cpu")
            placeholder = torch.empty((0,) + tuple(param.shape[1:]), dtype=param.dtype, device=param.device)
            setattr(info.experts, name, nn.Parameter(placeholder, requires_grad=False))
            del param
        host[info.layer] = tensors
    return layers, ExpertStore(host, pin=pin)


def load_model(
    path: Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    keep_experts_on_host: bool = False,
):
    """Returns ``(model, layers, store)``; ``layers``/``store`` are None unless ``keep_experts_on_host``."""
    from transformers import AutoModelForCausalLM

    use_safetensors = check_weights_format(path, allow_pickle)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, use_safetensors=use_safetensors, trust_remote_code=trust_remote_code,
    )
    model.eval()
    layers = store = None
    if keep_experts_on_host:
        layers, store = split_experts(model, pin=device.type == "cuda")
    model.to(device)
    return model, layers, store


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    """The checkpoint's tokenizer, or None when it ships none (token ids must then be given)."""
    from transformers import AutoTokenizer

    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
