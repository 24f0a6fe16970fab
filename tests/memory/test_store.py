"""ExpertStore: shapes, byte counts, views and validation."""

from __future__ import annotations

import pytest
import torch

from specter.errors import SpecterError
from specter.memory.blocked_layout import block
from specter.memory.store import ExpertStore

torch.set_num_threads(1)


def make_layer(n_experts: int = 4, hidden: int = 6, inter: int = 3, bias: bool = False,
               dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    params = {
        "gate_up_proj": torch.randn(n_experts, 2 * inter, hidden).to(dtype),
        "down_proj": torch.randn(n_experts, hidden, inter).to(dtype),
    }
    if bias:
        params["gate_up_proj_bias"] = torch.randn(n_experts, 2 * inter).to(dtype)
    return params


def test_properties_of_a_non_contiguous_layer_set() -> None:
    store = ExpertStore({3: make_layer(bias=True), 1: make_layer(bias=True)})
    assert store.layers == [1, 3]
    assert store.n_experts == 4
    assert store.param_shapes == {"down_proj": (6, 3), "gate_up_proj": (6, 6), "gate_up_proj_bias": (6,)}
    assert store.dtype == torch.float32
    assert store.expert_bytes == (36 + 18 + 6) * 4
    assert store.total_bytes == store.expert_bytes * 4 * 2


def test_expert_returns_views_of_the_stacked_tensors() -> None:
    layer = make_layer()
    store = ExpertStore({0: layer})
    view = store.expert(0, 2)
    assert torch.equal(view["down_proj"], layer["down_proj"][2])
    assert view["down_proj"].data_ptr() == layer["down_proj"][2].data_ptr()


def test_expert_bytes_follow_dtype() -> None:
    assert ExpertStore({0: make_layer(dtype=torch.bfloat16)}).expert_bytes == (36 + 18) * 2


@pytest.mark.parametrize("other", [
    make_layer(n_experts=5),
    make_layer(hidden=7),
    make_layer(bias=True),
    make_layer(dtype=torch.float16),
])
def test_layers_must_agree(other: dict[str, torch.Tensor]) -> None:
    with pytest.raises(SpecterError, match="layer 2"):
        ExpertStore({0: make_layer(), 2: other})


def test_params_of_one_layer_must_agree_on_expert_count() -> None:
    bad = make_layer()
    bad["down_proj"] = bad["down_proj"][:3]
    with pytest.raises(SpecterError, match="n_experts"):
        ExpertStore({0: bad})


def test_empty_store_is_rejected() -> None:
    with pytest.raises(SpecterError):
        ExpertStore({})


def test_out_of_range_lookups() -> None:
    store = ExpertStore({1: make_layer()})
    with pytest.raises(KeyError):
        store.expert(0, 0)
    with pytest.raises(IndexError):
        store.expert(1, 4)


def test_pin_is_a_no_op_without_cuda() -> None:
    layer = make_layer()
    store = ExpertStore({0: layer}, pin=True)
    assert store.pinned == torch.cuda.is_available()
    assert torch.equal(store.expert(0, 1)["gate_up_proj"], layer["gate_up_proj"][1])


@pytest.mark.gpu
def test_pin_pins_every_tensor() -> None:
    store = ExpertStore({0: make_layer(), 1: make_layer()}, pin=True)
    assert store.pinned
    for layer in store.layers:
        assert all(t.is_pinned() for t in store.stacked(layer).values())


def test_standard_gives_a_blocked_store_s_layers_unblocked_and_a_standard_store_s_as_they_are() -> None:
    layer = make_layer(hidden=16, inter=8)  # gate_up [16, 16], down [16, 8]: whole blocks of 16 rows
    blocked = {name: block(tensor) for name, tensor in layer.items()}
    store = ExpertStore({0: blocked}, blocked=True)
    assert store.blocked
    assert all(torch.equal(store.standard(0)[name], layer[name]) for name in layer)
    assert store.stacked(0)["down_proj"] is blocked["down_proj"]  # the store's own tensors, blocked
    plain = ExpertStore({0: layer})
    assert not plain.blocked and plain.standard(0)["down_proj"] is layer["down_proj"]
