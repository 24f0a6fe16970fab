"""The lean draft step's native layer half (``native_rows.draft_qkv`` / ``draft_attend_route``):
a float64 reference of the same math (norms, projections, per-head norms, rotation, one query
attending a cache with GQA and strided positions, o, residual, post-norm, router top-k) to float32
rounding; what the ops refuse; when they serve."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specter import native
from specter.kernels import native_rows
from specter.testing.marks import needs_native


HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS = 64, 4, 2, 16, 6


def layer(gen: torch.Generator) -> dict[str, torch.Tensor]:
    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.2

    return {"input_norm": torch.rand(HIDDEN, generator=gen) + 0.5, "q": w(HEADS * HEAD_DIM, HIDDEN),
            "k": w(KV_HEADS * HEAD_DIM, HIDDEN), "v": w(KV_HEADS * HEAD_DIM, HIDDEN), "o": w(HIDDEN, HEADS * HEAD_DIM),
            "post_norm": torch.rand(HIDDEN, generator=gen) + 0.5, "router": w(EXPERTS, HIDDEN),
            "q_norm": torch.rand(HEAD_DIM, generator=gen) + 0.5, "k_norm": torch.rand(HEAD_DIM, generator=gen) + 0.5}


def rotary(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(HEAD_DIM // 2, generator=gen) * 6.0
    cos = torch.cat([angles.cos(), angles.cos()])
    sin = torch.cat([angles.sin(), angles.sin()])
    return cos, torch.cat([-sin[: HEAD_DIM // 2], sin[HEAD_DIM // 2:]])  # signed: rotate = x*cos + roll(x)*signed


def reference_qkv(h, w, cos, signed_sin, head_norms: bool):
    x = F.rms_norm(h.double(), (HIDDEN,), w["input_norm"].double(), 1e-5)
    q = (x @ w["q"].double().T).view(HEADS, HEAD_DIM)
    k = (x @ w["k"].double().T).view(KV_HEADS, HEAD_DIM)
    v = (x @ w["v"].double().T).view(KV_HEADS, HEAD_DIM)
    if head_norms:
        q = F.rms_norm(q, (HEAD_DIM,), w["q_norm"].double(), 1e-5)
        k = F.rms_norm(k, (HEAD_DIM,), w["k_norm"].double(), 1e-5)
    rotate = lambda t: t * cos.double() + t.roll(HEAD_DIM // 2, -1) * signed_sin.double()  # noqa: E731
    return rotate(q), rotate(k), v


@needs_native
@pytest.mark.parametrize("head_norms", [False, True])
def test_draft_qkv_is_the_normed_projections_per_head_norms_and_rotation(head_norms: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    w, (cos, signed_sin) = layer(gen), rotary(gen)
    h = torch.randn(1, HIDDEN, generator=gen) * 2
    q, k, v = native_rows.draft_qkv(h, w["input_norm"], w["q"], w["k"], w["v"], w["q_norm"] if head_norms else None,
                                    w["k_norm"] if head_norms else None, cos, signed_sin, HEAD_DIM, 1e-5)
    for got, expected in zip((q, k, v), reference_qkv(h, w, cos, signed_sin, head_norms)):
        assert got.shape == expected.shape
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("length, renormalize", [(1, True), (7, False), (40, True)])
def test_draft_attend_route_attends_the_first_positions_of_a_strided_cache_and_routes(length: int,
                                                                                     renormalize: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    w = layer(gen)
    buffers = torch.randn(2, 1, KV_HEADS, 64, HEAD_DIM, generator=gen)  # [K|V, 1, nKV, max_len, d]: a static cache
    buffers[:, :, :, length:] = float("nan")  # positions past `length` must not be read
    keys, values = buffers[0], buffers[1]
    q, h = torch.randn(HEADS, HEAD_DIM, generator=gen), torch.randn(1, HIDDEN, generator=gen)
    h_out, x, weights, index = native_rows.draft_attend_route(
        q, keys, values, length, h, w["o"], w["post_norm"], w["router"], 1e-5, HEAD_DIM ** -0.5, 2, renormalize)
    attended = F.scaled_dot_product_attention(
        q.double()[None, :, None], keys[:, :, :length].double(), values[:, :, :length].double(),
        scale=HEAD_DIM ** -0.5, enable_gqa=True)  # [1, nH, 1, d]
    expected_h = h.double() + attended.reshape(1, -1) @ w["o"].double().T
    expected_x = F.rms_norm(expected_h, (HIDDEN,), w["post_norm"].double(), 1e-5)
    torch.testing.assert_close(h_out.double(), expected_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.double(), expected_x, rtol=1e-5, atol=1e-5)
    expected_weights, expected_index = torch.topk(torch.softmax(expected_x @ w["router"].double().T, -1), 2)
    if renormalize:
        expected_weights = expected_weights / expected_weights.sum(-1, keepdim=True)
    assert torch.equal(index, expected_index) and index.dtype == torch.long and weights.dtype == torch.float32
    torch.testing.assert_close(weights.double(), expected_weights, rtol=1e-5, atol=1e-6)


@needs_native
@pytest.mark.parametrize("more_length", [0, 1, 5])
def test_draft_attend_route_attends_a_second_run_of_positions_after_the_first(more_length: int) -> None:
    gen = torch.Generator().manual_seed(13)
    w = layer(gen)
    cache = torch.randn(2, 1, KV_HEADS, 9, HEAD_DIM, generator=gen)  # a model's cache: 9 positions
    more = torch.randn(2, 1, KV_HEADS, 16, HEAD_DIM, generator=gen)  # the draft's own, beside it
    q, h = torch.randn(HEADS, HEAD_DIM, generator=gen), torch.randn(1, HIDDEN, generator=gen)
    args = (h, w["o"], w["post_norm"], w["router"], 1e-5, HEAD_DIM ** -0.5, 3, True)
    got = native_rows.draft_attend_route(q, cache[0], cache[1], 9, *args, more=(more[0], more[1], more_length))
    joined = torch.cat([cache, more[:, :, :, :more_length]], dim=3)  # the same positions in one cache
    expected = native_rows.draft_attend_route(q, joined[0].contiguous(), joined[1].contiguous(), 9 + more_length, *args)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # the expert ids exactly


@needs_native
def test_the_draft_layer_ops_refuse_what_they_cannot_compute() -> None:
    gen = torch.Generator().manual_seed(2)
    w, (cos, signed_sin) = layer(gen), rotary(gen)
    h = torch.randn(1, HIDDEN, generator=gen)
    with pytest.raises(RuntimeError, match="head_dim of 8"):
        native_rows.draft_qkv(h, w["input_norm"], w["q"], w["k"], w["v"], None, None, cos[:12], signed_sin[:12], 12, 1e-5)
    with pytest.raises(RuntimeError, match="whole heads"):
        native_rows.draft_qkv(h, w["input_norm"], w["q"], w["k"], w["v"][:8], None, None, cos, signed_sin, HEAD_DIM, 1e-5)
    cache = torch.randn(1, KV_HEADS, 8, HEAD_DIM)
    q = torch.randn(HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="at most its cache's L"):
        native_rows.draft_attend_route(q, cache, cache, 9, h, w["o"], w["post_norm"], w["router"], 1e-5, 0.25, 2, True)
    with pytest.raises(RuntimeError, match="top_k must be in 1..E"):
        native_rows.draft_attend_route(q, cache, cache, 4, h, w["o"], w["post_norm"], w["router"], 1e-5, 0.25,
                                       EXPERTS + 1, True)
    with pytest.raises(RuntimeError, match="multiple of nKV"):
        native_rows.draft_attend_route(q[:3], cache, cache, 4, h, w["o"], w["post_norm"], w["router"], 1e-5, 0.25, 2, True)
    with pytest.raises(RuntimeError, match="more_keys and more_values"):
        native_rows.draft_attend_route(q, cache, cache, 4, h, w["o"], w["post_norm"], w["router"], 1e-5, 0.25, 2, True,
                                       more=(cache, cache[:, :, :4], 2))
    with pytest.raises(RuntimeError, match="last dimension dense"):
        native_rows.draft_attend_route(q, cache.transpose(2, 3), cache.transpose(2, 3), 4, h, w["o"], w["post_norm"],
                                       w["router"], 1e-5, 0.25, 2, True)


def test_layer_serves_needs_whole_vectors_per_head_and_the_row_kernels(monkeypatch) -> None:
    h, weight = torch.randn(1, HIDDEN), torch.randn(8, HIDDEN)
    monkeypatch.setattr(native, "available", lambda: True)
    assert native_rows.layer_serves(h, HEAD_DIM, weight)
    assert not native_rows.layer_serves(h, 12, weight)  # a head of 12 values is not whole 8-float vectors
    assert not native_rows.layer_serves(h.double(), HEAD_DIM, weight.double())
    monkeypatch.setattr(native, "available", lambda: False)
    assert not native_rows.layer_serves(h, HEAD_DIM, weight)
