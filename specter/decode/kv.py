"""Model-call helpers shared by every engine's decoding loop.

Contract: ``forward_logits`` runs the model over new token ids (batch 1) appending to a
transformers KV cache and returns fp32 logits; ``new_kv_cache`` makes a cache that can be
cropped (speculative rounds crop it), sliding-window layers included; ``synchronize`` closes a
timing bracket on devices that run asynchronously.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache



def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_logits(model, input_ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """Run the model over ``input_ids`` [1, T] appending to ``cache``; returns fp32 logits [T, V]."""
    out = model(input_ids=input_ids, cache=cache, use_cache=True)
    return out.logits[0].float()


def new_kv_cache(model) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    if hasattr(cache, "activate_past_recording"):  # sliding-window layers must be croppable
        cache.activate_past_recording()
    return cache


def crop_to(cache: DynamicCache, length: int) -> None:
    """Drop the newest entries so ``length`` positions remain (transformers 5 crops by a negative count)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)
