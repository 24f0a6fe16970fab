"""The expert cache's device memory: ``allocate_slots`` gives one ``[n_slots, *shape]`` buffer per
parameter of the store, in its dtype, on the device (on zeroed 2 MiB pages when asked on a CPU,
ordinary memory elsewhere); ``SlotTable`` starts at -1 everywhere, has a row per layer in the order
given, and ``set`` writes one entry, seen through the tensor it exposes."""

from __future__ import annotations

import pytest
import torch

from specter.memory import huge_pages
from specter.memory.slots import SlotTable, allocate_slots
from specter.memory.store import ExpertStore

torch.set_num_threads(1)

CPU = torch.device("cpu")
needs_thp = pytest.mark.skipif(not huge_pages.supported(), reason="transparent huge pages not enabled here")


def make_store(params: dict[str, tuple[int, ...]], n_experts: int = 3, dtype: torch.dtype = torch.float32,
               layers: tuple[int, ...] = (0, 2)) -> ExpertStore:
    """A store whose experts have these per-expert shapes (zero-filled: only shapes and dtype matter here)."""
    return ExpertStore({layer: {name: torch.zeros((n_experts, *shape), dtype=dtype) for name, shape in params.items()}
                        for layer in layers})


# ----------------------------------------------------------------------------- allocate_slots


def test_one_buffer_per_parameter_of_n_slots_in_the_store_dtype_on_the_device() -> None:
    store = make_store({"gate_up_proj": (8, 4), "down_proj": (4, 4), "gate_up_proj_bias": (8,)}, dtype=torch.bfloat16)
    slots = allocate_slots(store, 5, CPU, huge_pages=False)
    assert {name: tuple(t.shape) for name, t in slots.items()} == {
        "down_proj": (5, 4, 4), "gate_up_proj": (5, 8, 4), "gate_up_proj_bias": (5, 8)}
    assert all(t.dtype == torch.bfloat16 and t.device == CPU and t.is_contiguous() for t in slots.values())
    assert len({t.untyped_storage().data_ptr() for t in slots.values()}) == 3  # separate memory each
    assert not any(huge_pages.is_huge(t) for t in slots.values())


def test_on_a_device_other_than_the_cpu_huge_pages_are_ignored() -> None:
    store = make_store({"w": (4, 2)}, dtype=torch.float16)
    slots = allocate_slots(store, 2, torch.device("meta"), huge_pages=True)
    assert list(slots) == ["w"]
    assert slots["w"].device.type == "meta" and slots["w"].shape == (2, 4, 2) and slots["w"].dtype == torch.float16


@needs_thp
def test_huge_pages_on_the_cpu_put_large_buffers_on_zeroed_2mib_pages_and_leave_small_ones_ordinary(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECTER_SETTLE_PAGES", "0")  # placement is page_placement's business, not timed here
    store = make_store({"w": (256, 1024), "b": (8,)}, n_experts=2)  # w: 1 MiB a slot, 2 MiB for two
    slots = allocate_slots(store, 2, CPU, huge_pages=True)
    assert slots["w"].shape == (2, 256, 1024) and slots["b"].shape == (2, 8)
    assert huge_pages.is_huge(slots["w"]) and slots["w"].data_ptr() % huge_pages.HUGE_PAGE == 0
    assert not huge_pages.is_huge(slots["b"])  # 64 bytes: below huge_pages.MIN_BYTES
    assert not slots["w"].any() and not slots["b"].any()
    assert not any(huge_pages.is_huge(t) for t in allocate_slots(store, 2, CPU, huge_pages=False).values())


def test_huge_pages_on_a_machine_without_them_give_ordinary_zeroed_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "supported", lambda: False)
    store = make_store({"w": (256, 1024)}, n_experts=2)
    slots = allocate_slots(store, 3, CPU, huge_pages=True)
    assert slots["w"].shape == (3, 256, 1024) and slots["w"].dtype == torch.float32
    assert not huge_pages.is_huge(slots["w"]) and not slots["w"].any()


# ----------------------------------------------------------------------------- SlotTable


def test_a_new_table_is_absent_everywhere_with_one_row_per_layer_in_the_order_given() -> None:
    table = SlotTable([5, 1, 3], 4, CPU)
    assert table.rows == {5: 0, 1: 1, 3: 2}  # position in the list, not sorted
    assert table.tensor.dtype == torch.int64 and table.tensor.device == CPU
    assert torch.equal(table.tensor, torch.full((3, 4), -1, dtype=torch.int64))


def test_set_writes_one_entry_that_the_exposed_tensor_shows_and_minus_one_clears_it() -> None:
    table = SlotTable([5, 1, 3], 4, CPU)
    exposed = table.tensor  # what compiled code holds on to (ExpertCache.slot_table)
    expected = torch.full((3, 4), -1, dtype=torch.int64)
    table.set((1, 2), 7)
    expected[1, 2] = 7
    assert torch.equal(exposed, expected)
    table.set((3, 0), 0)
    table.set((5, 3), 2**40)  # int64: any slot number fits
    expected[2, 0], expected[0, 3] = 0, 2**40
    assert torch.equal(exposed, expected)
    table.set((1, 2), 4)  # overwrites
    table.set((3, 0), -1)  # absent again
    expected[1, 2], expected[2, 0] = 4, -1
    assert torch.equal(exposed, expected)
    assert table.tensor is exposed


def test_set_of_a_layer_outside_the_table_raises_key_error_and_writes_nothing() -> None:
    table = SlotTable([0, 2], 3, CPU)
    with pytest.raises(KeyError):
        table.set((1, 0), 4)
    assert torch.equal(table.tensor, torch.full((2, 3), -1, dtype=torch.int64))


def test_the_table_lives_on_the_device_it_is_given_and_off_the_cpu_set_writes_through_the_tensor() -> None:
    table = SlotTable([0, 2], 3, torch.device("meta"))  # no NumPy view of memory that is not the host's
    assert table.tensor.device.type == "meta" and table.tensor.shape == (2, 3) and table.tensor.dtype == torch.int64
    assert table.rows == {0: 0, 2: 1}
    table.set((2, 1), 0)  # raises if set took the CPU's NumPy path off the CPU
