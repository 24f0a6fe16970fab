"""``CopyRepair``: ``intact`` tells a slot holding the store's expert from flipped, zeroed or stale
bytes, checksumming the store once per key; ``reload`` copies the expert straight from the store
into the slot's views, warns once in a repair's life naming why, calls the link broken past
``MAX_RELOADS``, and with ``verify`` refuses a reload that is wrong too; ``total`` counts them."""

from __future__ import annotations

import warnings

import pytest
import torch

from specter.errors import SpecterError
from specter.memory import copy_repair
from specter.memory.copy_repair import MAX_RELOADS, CopyRepair
from specter.memory.link import copy_all
from specter.memory.store import ExpertStore

torch.set_num_threads(1)

WHY = "link 'test' failed copying expert (3, 1): DMA error"
FIRST_WARNING = (f"{WHY}; reloaded it directly from the store (further faults are counted in the report as "
                 f"cache reloads)")


def make_store(dtype: torch.dtype = torch.float32, n_experts: int = 4) -> ExpertStore:
    gen = torch.Generator().manual_seed(0)
    return ExpertStore({
        layer: {"gate_up_proj": torch.randn(n_experts, 6, 4, generator=gen).to(dtype),
                "down_proj": torch.randn(n_experts, 4, 3, generator=gen).to(dtype)}
        for layer in (0, 3)
    })


def slot_buffers(store: ExpertStore, n_slots: int = 3) -> dict[str, torch.Tensor]:
    """Slot buffers as the cache has them, filled with a sentinel so that untouched slots show."""
    return {name: torch.full((n_slots, *shape), 7, dtype=store.dtype) for name, shape in store.param_shapes.items()}


def views(buffers: dict[str, torch.Tensor], slot: int) -> dict[str, torch.Tensor]:
    return {name: buffer[slot] for name, buffer in buffers.items()}


def matches(dst: dict[str, torch.Tensor], expert: dict[str, torch.Tensor]) -> bool:
    return dst.keys() == expert.keys() and all(torch.equal(dst[name], expert[name]) for name in expert)


def reload_quietly(repair: CopyRepair, dst: dict[str, torch.Tensor], key: tuple[int, int],
                   verify: bool = False) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        repair.reload(dst, key, WHY, verify)


# ----------------------------------------------------------------------------- intact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_intact_accepts_the_stores_expert_and_refuses_flipped_zeroed_or_stale_bytes(dtype: torch.dtype) -> None:
    store = make_store(dtype)
    repair = CopyRepair(store)
    dst = views(slot_buffers(store), 1)
    copy_all(dst, store.expert(3, 1))
    assert repair.intact(dst, (3, 1))
    assert not repair.intact(dst, (3, 2)) and not repair.intact(dst, (0, 1))  # it holds another expert

    words = dst["down_proj"].view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    words[2, 1] ^= 1  # one bit flipped
    assert not repair.intact(dst, (3, 1))
    words[2, 1] ^= 1
    assert repair.intact(dst, (3, 1))

    dst["gate_up_proj"][4].zero_()
    assert not repair.intact(dst, (3, 1))
    copy_all(dst, store.expert(3, 2))  # stale: the expert that was there before
    assert not repair.intact(dst, (3, 1)) and repair.intact(dst, (3, 2))


def test_intact_checksums_the_store_once_per_key(monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store()
    asked: list[tuple[int, int]] = []
    expert = store.expert

    def counting(layer: int, e: int) -> dict[str, torch.Tensor]:
        asked.append((layer, e))
        return expert(layer, e)

    monkeypatch.setattr(store, "expert", counting)
    repair = CopyRepair(store)
    dst = views(slot_buffers(store), 0)
    copy_all(dst, expert(0, 2))
    assert [repair.intact(dst, (0, 2)) for _ in range(3)] == [True, True, True]
    assert not repair.intact(dst, (0, 3))
    assert repair.intact(dst, (0, 2)) and not repair.intact(dst, (0, 3))
    assert asked == [(0, 2), (0, 3)]


# ----------------------------------------------------------------------------- reload


@pytest.mark.parametrize("verify", [False, True])
def test_reload_copies_the_expert_from_the_store_into_the_slot_and_nowhere_else(verify: bool) -> None:
    store = make_store()
    repair = CopyRepair(store)
    buffers = slot_buffers(store)
    reload_quietly(repair, views(buffers, 1), (3, 1), verify)
    assert matches(views(buffers, 1), store.expert(3, 1))
    assert all(bool((buffer[slot] == 7).all()) for buffer in buffers.values() for slot in (0, 2))
    assert repair.total == 1 and repair.intact(views(buffers, 1), (3, 1))


def test_the_first_reload_warns_naming_why_and_later_ones_are_silent() -> None:
    store = make_store()
    repair = CopyRepair(store)
    assert repair.total == 0
    buffers = slot_buffers(store)
    with pytest.warns(RuntimeWarning) as caught:
        repair.reload(views(buffers, 0), (3, 1), WHY, False)
    assert [str(w.message) for w in caught] == [FIRST_WARNING]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any further warning fails the test
        repair.reload(views(buffers, 1), (0, 2), "another fault", False)
        repair.reload(views(buffers, 2), (3, 1), "a third fault", True)
    assert repair.total == 3
    assert matches(views(buffers, 1), store.expert(0, 2)) and matches(views(buffers, 2), store.expert(3, 1))


def test_every_repair_warns_on_its_own_first_reload() -> None:
    store = make_store()
    first, second = CopyRepair(store), CopyRepair(store)
    reload_quietly(first, views(slot_buffers(store), 0), (0, 0))
    with pytest.warns(RuntimeWarning, match="reloaded it directly from the store"):
        second.reload(views(slot_buffers(store), 0), (0, 0), WHY, False)
    assert (first.total, second.total) == (1, 1)


def test_more_than_max_reloads_calls_the_link_broken() -> None:
    store = make_store()
    repair = CopyRepair(store)
    buffers = slot_buffers(store)
    for n in range(MAX_RELOADS):
        reload_quietly(repair, views(buffers, n % 3), (3, n % 4))
    assert repair.total == MAX_RELOADS
    with pytest.raises(SpecterError) as info:
        repair.reload(views(buffers, 0), (0, 1), "link 'test' failed again", False)
    assert str(info.value) == f"link 'test' failed again; {MAX_RELOADS} reloads already, the link is broken"


def corrupting_copy(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor], non_blocking: bool = False) -> None:
    copy_all(dst, src, non_blocking)
    dst["down_proj"][0, 0] += 1.0  # the direct copy arrives wrong too (bad memory, a broken copy path)


def test_with_verify_a_reload_that_is_wrong_too_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store()
    repair = CopyRepair(store)
    monkeypatch.setattr(copy_repair, "copy_all", corrupting_copy)
    dst = views(slot_buffers(store), 2)
    with pytest.raises(SpecterError) as info:
        reload_quietly(repair, dst, (3, 1), verify=True)
    assert str(info.value) == f"{WHY}; the reload from the store is wrong too"
    assert repair.total == 1


def test_without_verify_a_reload_is_trusted_unchecked(monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store()
    repair = CopyRepair(store)
    monkeypatch.setattr(copy_repair, "copy_all", corrupting_copy)
    dst = views(slot_buffers(store), 2)
    reload_quietly(repair, dst, (3, 1), verify=False)
    assert repair.total == 1
    assert not repair.intact(dst, (3, 1))  # the wrong bytes stayed: only verify looks at them


@pytest.mark.parametrize("shape", [(4, 3), (64, 48)], ids=["shorter-than-a-chunk", "many-chunks"])
def test_intact_refuses_the_right_bytes_at_the_wrong_offsets(shape: tuple[int, int]) -> None:
    """Rows reversed or two pieces swapped keep every byte (the plain sum of the words), so only
    the checksum's position-weighted part can tell: a link writing pieces at wrong offsets."""
    gen = torch.Generator().manual_seed(1)
    store = ExpertStore({0: {"down_proj": torch.randn(2, *shape, generator=gen)}})
    repair = CopyRepair(store)
    dst = views(slot_buffers(store, n_slots=1), 0)
    expert = store.expert(0, 1)["down_proj"]
    dst["down_proj"].copy_(expert.flip(0))
    assert not repair.intact(dst, (0, 1))
    half = shape[0] // 2
    dst["down_proj"].copy_(torch.cat([expert[half:], expert[:half]]))
    assert not repair.intact(dst, (0, 1))
    dst["down_proj"].copy_(expert)
    assert repair.intact(dst, (0, 1))
