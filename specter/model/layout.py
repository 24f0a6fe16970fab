"""Find the routed-expert modules of a transformers 5.x MoE model, whatever its architecture.

Contract: ``moe_layers(model)`` returns one ``MoELayer`` per decoder layer that has routed experts,
in layer order. An experts module is recognised by the attributes transformers'
``use_experts_implementation`` decorator gives it (``has_gate``, ``is_transposed``, ...) and its
stacked 3-D parameters whose first dimension is ``num_experts``; the router is the sibling
module holding a ``weight`` of shape [num_experts, hidden]. No per-architecture table: Mixtral,
PhiMoE, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 and GPT-OSS all follow this shape.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from specter.errors import SpecterError

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclasses.dataclass
class MoELayer:
    """One decoder layer's routed experts."""

    layer: int  # decoder-layer index in the model
    experts_name: str  # dotted module name of the experts module
    experts: nn.Module
    router_name: str | None
    router: nn.Module | None
    num_experts: int
    top_k: int
    param_names: tuple[str, ...]  # stacked expert tensors: [num_experts, ...] each


def is_plain_gated(module: nn.Module) -> bool:
    """Whether a transformers experts module is gated with [out, in] weights, no biases and no
    post-expert norm (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek, PhiMoE): the layout Specter's grouped
    float32 kernels cover (``specter.kernels.grouped_experts.supports``)."""
    return (bool(getattr(module, "has_gate", False)) and not getattr(module, "has_bias", False)
            and not getattr(module, "is_transposed", False) and not getattr(module, "has_post_expert_norm", False))


def is_experts_module(module: nn.Module) -> bool:
    return hasattr(module, "has_gate") and hasattr(module, "is_transposed") and hasattr(module, "num_experts")


def expert_param_names(module: nn.Module) -> tuple[str, ...]:
    """Names of the module's own parameters stacked along the expert dimension (weights, then biases)."""
    names = [
        name for name, p in module.named_parameters(recurse=False)
        if p.dim() >= 2 and p.shape[0] == module.num_experts
    ]
    if not names:
        raise SpecterError(f"{type(module).__name__}: no stacked expert parameters found")
    return tuple(names)


def _find_router(parent: nn.Module, num_experts: int) -> tuple[str | None, nn.Module | None]:
    for name, child in parent.named_children():
        weight = getattr(child, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == num_experts and not is_experts_module(child):
            return name, child
    return None, None


def _top_k(model: nn.Module, router: nn.Module | None) -> int:
    for source in (router, model.config):
        for attr in ("top_k", "num_experts_per_tok", "moe_topk"):
            value = getattr(source, attr, None)
            if isinstance(value, int):
                return value
    raise SpecterError("cannot tell the model's top-k (no top_k / num_experts_per_tok)")


def moe_layers(model: nn.Module) -> list[MoELayer]:
    modules = dict(model.named_modules())
    found: list[MoELayer] = []
    for name, module in modules.items():
        if not is_experts_module(module):
            continue
        match = None
        for match in _LAYER_INDEX.finditer(name):
            pass
        if match is None:
            raise SpecterError(f"experts module {name!r} is not inside a numbered decoder layer")
        parent_name = name.rsplit(".", 1)[0]
        router_name, router = _find_router(modules[parent_name], module.num_experts)
        found.append(MoELayer(
            layer=int(match.group(1)),
            experts_name=name,
            experts=module,
            router_name=f"{parent_name}.{router_name}" if router_name else None,
            router=router,
            num_experts=module.num_experts,
            top_k=_top_k(model, router),
            param_names=expert_param_names(module),
        ))
    if not found:
        raise SpecterError(
            f"{type(model).__name__} has no routed-expert modules that Specter recognises "
            "(expected a transformers 5 MoE model: Mixtral, PhiMoE, Qwen2/3-MoE, OLMoE, DeepSeek-V3, GPT-OSS)"
        )
    found.sort(key=lambda m: m.layer)
    return found
