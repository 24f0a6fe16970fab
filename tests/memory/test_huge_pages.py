"""Huge-page tensors: aligned, advised, alive as long as a view is; re-homing keeps values and ties;
the expert cache, the store and the INT4 draft take them where asked."""

from __future__ import annotations

import gc

import pytest
import torch

from specter.memory import huge_pages
from specter.memory.cache import ExpertCache
from specter.memory.links import LocalLink
from specter.memory.store import ExpertStore
from specter.policies import LRUPolicy

MIB = 1 << 20
needs_thp = pytest.mark.skipif(not huge_pages.supported(), reason="transparent huge pages not enabled here")


@needs_thp
def test_a_large_tensor_starts_on_a_huge_page_and_its_mapping_lives_while_a_view_does() -> None:
    tensor = huge_pages.zeros((3, MIB), torch.float32)  # 12 MiB
    assert tensor.shape == (3, MIB) and tensor.dtype == torch.float32 and tensor.is_contiguous()
    assert not bool(tensor.any())
    assert tensor.data_ptr() % huge_pages.HUGE_PAGE == 0 and huge_pages.is_huge(tensor)
    tensor.fill_(2.0)
    row = tensor[1]
    start = tensor.untyped_storage().data_ptr()
    del tensor
    gc.collect()
    assert start in huge_pages._live and float(row.sum()) == 2.0 * MIB
    del row
    gc.collect()
    assert start not in huge_pages._live


def test_small_tensors_and_unsupported_machines_get_ordinary_memory(monkeypatch) -> None:
    small = huge_pages.zeros((4, 4), torch.float32)
    assert small.shape == (4, 4) and not huge_pages.is_huge(small)
    monkeypatch.setattr(huge_pages, "supported", lambda: False)
    large = huge_pages.zeros((MIB,), torch.float32)
    assert not huge_pages.is_huge(large)
    original = torch.randn(MIB)
    assert huge_pages.rehome(original) is original


@needs_thp
def test_rehome_copies_values_once_and_leaves_what_it_cannot_move() -> None:
    original = torch.randn(2, MIB)
    home = huge_pages.rehome(original)
    assert home is not original and huge_pages.is_huge(home) and torch.equal(home, original)
    assert huge_pages.rehome(home) is home  # already there
    strided = original.t()
    assert huge_pages.rehome(strided) is strided
    small = torch.randn(16)
    assert huge_pages.rehome(small) is small


@needs_thp
def test_rehome_module_keeps_values_and_tied_parameters() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(1024, 1024), torch.nn.Linear(1024, 1024, bias=True))
    model[1].weight = model[0].weight  # tied, as an LM head to its embedding
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    moved = huge_pages.rehome_module(model)
    assert moved == 1024 * 1024 * 4  # the tied weight once; the bias is small
    assert model[1].weight is model[0].weight and huge_pages.is_huge(model[0].weight)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert model[0].weight.requires_grad


@needs_thp
def test_the_cache_slots_the_store_and_the_draft_take_huge_pages_when_asked() -> None:
    from specter.kernels.int4_experts import Int4Experts
    from transformers import MixtralConfig, MixtralForCausalLM

    store = ExpertStore({0: {"gate_up_proj": torch.randn(4, 1024, 512), "down_proj": torch.randn(4, 512, 512)}})
    expert = {name: tensor.clone() for name, tensor in store.expert(0, 2).items()}
    store.move_storage(huge_pages.rehome)
    assert all(huge_pages.is_huge(t) for t in store.stacked(0).values())
    assert all(torch.equal(store.expert(0, 2)[name], expert[name]) for name in expert)
    on = ExpertCache(store, 3, torch.device("cpu"), LocalLink(copy_thread=False), LRUPolicy(), huge_pages=True)
    off = ExpertCache(store, 3, torch.device("cpu"), LocalLink(copy_thread=False), LRUPolicy())
    assert all(huge_pages.is_huge(t) for t in on.slots.values())
    assert not any(huge_pages.is_huge(t) for t in off.slots.values())
    slots = on.acquire(0, [2])
    assert all(torch.equal(on.slots[name][slots[0]], expert[name]) for name in expert)

    config = MixtralConfig(vocab_size=64, hidden_size=512, intermediate_size=1024, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    experts = MixtralForCausalLM(config).model.layers[0].mlp.experts
    draft = Int4Experts.from_module(experts)
    x, ids, weights = torch.randn(3, 512), torch.tensor([[0, 5], [5, 7], [1, 0]]), torch.rand(3, 2)
    before = draft(x, ids, weights)
    draft.move_storage(huge_pages.rehome)
    assert huge_pages.is_huge(draft.up_packed) and huge_pages.is_huge(draft.down_packed)
    assert draft.up[5].packed.data_ptr() == draft.up_packed[5].data_ptr()
    assert torch.equal(draft(x, ids, weights), before)


@needs_thp
def test_an_engine_built_with_huge_pages_keeps_its_tokens_and_places_its_buffers(tiny_mixtral, monkeypatch) -> None:
    import specter
    from specter.api import run_recipe

    monkeypatch.setattr(huge_pages, "MIN_BYTES", 4096)  # the tiny model's tensors are a few KiB
    base = {"model": str(tiny_mixtral), "engine": "specter", "prompts": ["def f(x):\n"], "max_new_tokens": 6,
            "threads": 1, "offload": {"link": {"kind": "local"}, "expert_budget": 0.5}}
    assert run_recipe({**base, "huge_pages": True}).report["lossless"] is True
    on = specter.load({**base, "huge_pages": True})
    off = specter.load({**base, "huge_pages": False})
    try:
        assert all(huge_pages.is_huge(t) for t in on.cache.slots.values())
        assert all(huge_pages.is_huge(t) for layer in on.store.layers for t in on.store.stacked(layer).values())
        assert all(huge_pages.is_huge(d.up_packed) for d in on.draft.values())
        assert huge_pages.is_huge(on.model.get_input_embeddings().weight)
        assert not any(huge_pages.is_huge(t) for t in off.cache.slots.values())
        assert not any(huge_pages.is_huge(d.up_packed) for d in off.draft.values())
        assert not huge_pages.is_huge(off.model.get_input_embeddings().weight)
    finally:
        on.close()
        off.close()
