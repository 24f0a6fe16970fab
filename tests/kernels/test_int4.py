"""INT4 weight-only linear: quantization convention, kernel vs reference, fallbacks, size, compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specter.kernels import int4_native
from specter.kernels.int4 import Int4Weight, quantize_int4

CPU_KERNELS = ["cpu-native", "cpu-int4pack"]
# the native kernel rounds the activations to int8 per 64 values, the int4pack one to bf16
ACTIVATION_ROUNDING = {"cpu-native": 8e-3, "cpu-int4pack": 4e-3}


def representable(n: int, k: int, group_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight that is exactly ``q * scale``: bf16 scales, q in [-8, 7], a 7 or -8 in every group."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k // group_size, group_size), generator=gen)
    q[..., 0] = torch.where(torch.rand(n, k // group_size, generator=gen) < 0.5, 7, -8)
    scales = (torch.rand(n, k // group_size, generator=gen) * 0.1 + 0.01).bfloat16().float()
    return (q * scales.unsqueeze(-1)).reshape(n, k), q.reshape(n, k), scales


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("backend", [*CPU_KERNELS, "reference"])
@pytest.mark.parametrize("group_size", [64, 128])
def test_representable_weights_round_trip_exactly(backend: str, group_size: int) -> None:
    w, q, scales = representable(32, 256, group_size)
    packed = quantize_int4(w, group_size, backend=backend)
    assert packed.backend == backend
    assert torch.equal(packed.int_data(), q.to(torch.int8))
    assert torch.equal(packed.group_scales().float(), scales)
    assert torch.equal(packed.dequantize(), w)


def test_the_native_kernel_is_the_cpu_default_where_it_builds() -> None:
    w = torch.randn(64, 256)
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):  # this project's machines
        assert int4_native.unavailable_reason() is None
        assert quantize_int4(w, 64).backend == "cpu-native"
        assert quantize_int4(w, 32).backend == "cpu-int4pack"  # groups of 32: not its layout
    else:
        assert quantize_int4(w, 64).backend == "cpu-int4pack"


@pytest.mark.parametrize("backend", CPU_KERNELS)
@pytest.mark.parametrize("group_size", [64, 128])
def test_kernel_computes_symmetric_q_times_scale(backend: str, group_size: int) -> None:
    # (u - 8) * scale (tinygemm: + zero with zero = 0; native: nibbles u = q + 8) must give x @ (q * scale).T
    w, _, _ = representable(64, 256, group_size, seed=1)
    x = torch.randn(5, 256).bfloat16().float()
    y = quantize_int4(w, group_size, backend=backend).linear(x)
    assert rel(y, x @ w.t()) < ACTIVATION_ROUNDING[backend]
    exact = torch.zeros(1, 256)
    exact[0, 3], exact[0, 200] = 1.0, -1.0  # two activations int8 and bf16 both hold exactly
    torch.testing.assert_close(quantize_int4(w, group_size, backend=backend).linear(exact), exact @ w.t(),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("backend", CPU_KERNELS)
@pytest.mark.parametrize("group_size", [64, 128])
def test_kernel_matches_dequantized_reference(backend: str, group_size: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(256, 512)
    packed = quantize_int4(w, group_size, backend=backend)
    assert packed.backend == backend
    for t in (1, 3, 16):
        x = torch.randn(t, 512)
        reference = F.linear(x, packed.dequantize())
        assert rel(packed.linear(x), reference) < 1e-2
    assert torch.equal(quantize_int4(w, group_size, backend="reference").dequantize(), packed.dequantize())


def test_quantization_error_of_random_normal_weights() -> None:
    torch.manual_seed(0)
    w = torch.randn(512, 1024)
    err = {g: rel(quantize_int4(w, g).dequantize(), w) for g in (64, 128)}
    assert 0.05 < err[64] < err[128] < 0.12  # symmetric RTN: about 0.10 and 0.11


def test_requantizing_a_dequantized_weight_is_idempotent() -> None:
    torch.manual_seed(0)
    first = quantize_int4(torch.randn(64, 256), 64)
    second = quantize_int4(first.dequantize(), 64)
    assert torch.equal(second.int_data(), first.int_data())
    assert torch.equal(second.dequantize(), first.dequantize())


@pytest.mark.parametrize(("n", "k", "group_size"), [(10, 128, 64), (32, 80, 64), (32, 64, 16), (16, 64, 128)])
def test_odd_shapes_fall_back_to_reference(n: int, k: int, group_size: int, monkeypatch) -> None:
    # without the native kernel (it takes any N): N % 16 != 0 does not fit int4pack either
    monkeypatch.setattr(int4_native, "available", lambda: False)
    torch.manual_seed(0)
    w = torch.randn(n, k)
    packed = quantize_int4(w, group_size)
    assert packed.backend == "reference"
    assert packed.dequantize().shape == (n, k)
    assert rel(packed.dequantize(), w) < 0.15
    x = torch.randn(3, k)
    assert packed.linear(x).shape == (3, n)
    assert rel(packed.linear(x), F.linear(x, packed.dequantize())) < 1e-5


def test_nbytes_is_about_an_eighth_of_fp32_plus_scales() -> None:
    n, k, g = 256, 1024, 128
    packed = quantize_int4(torch.randn(n, k), g, backend="cpu-int4pack")
    scale_bytes = (k // g) * n * 2 * 2  # bf16 (scale, zero) pairs
    assert packed.nbytes == n * k // 2 + scale_bytes
    assert packed.nbytes == packed.packed.nbytes + packed.scales.nbytes
    fp32 = n * k * 4
    assert fp32 / 8 < packed.nbytes < fp32 / 8 * 1.1
    reference = quantize_int4(torch.randn(n, k), g, backend="reference")
    assert reference.nbytes == n * k // 2 + (k // g) * n * 2
    native = quantize_int4(torch.randn(n, k), g, backend="cpu-native")
    assert native.nbytes == n * k // 2 + (k // g) * n * 4  # float32 scales, no zeros


@pytest.mark.parametrize("backend", CPU_KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_keeps_dtype_and_leading_dims(backend: str, dtype: torch.dtype) -> None:
    packed = quantize_int4(torch.randn(32, 128), 64, backend=backend)
    x = torch.randn(2, 3, 128, dtype=dtype)
    y = packed.linear(x)
    assert y.shape == (2, 3, 32) and y.dtype == dtype
    assert rel(y, F.linear(x.float(), packed.dequantize())) < 1e-2


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="2-D"):
        quantize_int4(torch.randn(4, 4, 4))
    with pytest.raises(ValueError, match="even"):
        quantize_int4(torch.randn(16, 64), 7)
    with pytest.raises(ValueError, match="unknown int4 backend"):
        quantize_int4(torch.randn(16, 64), 32, backend="npu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="K % group_size"):
        quantize_int4(torch.randn(16, 80), 64, backend="cpu-int4pack")


@pytest.mark.parametrize("backend", [*CPU_KERNELS, "reference"])
def test_linear_traces_without_graph_breaks(backend: str) -> None:
    packed = quantize_int4(torch.randn(64, 128), 64, backend=backend)
    x = torch.randn(4, 128)

    def f(x: torch.Tensor) -> torch.Tensor:
        return F.silu(packed.linear(x)) * 2

    assert torch._dynamo.explain(f)(x).graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), f(x))


@pytest.mark.slow
@pytest.mark.parametrize("backend", CPU_KERNELS)
def test_linear_compiles_with_inductor(backend: str) -> None:
    packed = quantize_int4(torch.randn(64, 128), 64, backend=backend)
    x = torch.randn(4, 128)

    def f(x: torch.Tensor) -> torch.Tensor:
        return F.silu(packed.linear(x)) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(x), f(x), rtol=1e-2, atol=1e-3)


@pytest.mark.gpu
def test_cuda_tinygemm_matches_dequantized_reference() -> None:
    torch.manual_seed(0)
    w = torch.randn(256, 512, device="cuda")
    for g in (64, 128):
        packed = quantize_int4(w, g)
        expected = "cuda-int4pack" if torch.cuda.get_device_capability() >= (8, 0) else "reference"
        assert packed.backend == expected
        assert rel(packed.dequantize(), w) < 0.12
        x = torch.randn(5, 512, device="cuda")
        assert rel(packed.linear(x), F.linear(x, packed.dequantize())) < 1e-2
    exact, q, _ = representable(64, 256, 64)
    cuda_exact = quantize_int4(exact.cuda(), 64)
    assert torch.equal(cuda_exact.int_data().cpu(), q.to(torch.int8))
    assert isinstance(cuda_exact, Int4Weight)


@pytest.mark.parametrize("group_size", [16, 512])
def test_packed_backends_refuse_a_group_size_their_kernel_lacks_when_packing(group_size: int) -> None:
    with pytest.raises(ValueError, match="cpu-int4pack needs a group_size in"):
        quantize_int4(torch.randn(32, 1024), group_size, "cpu-int4pack")
