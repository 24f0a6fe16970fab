"""INT4 weight-only linear layers: symmetric group-wise quantization and the kernels that use it.

Contract:
- ``quantize_int4(weight [N, K], group_size=64) -> Int4Weight``. Each output row is split into
  groups of ``group_size`` along K; each group gets one scale and integers q in [-8, 7] with
  ``w ~= q * scale`` (no zero point). The math is torchao's
  (``choose_qparams_affine`` / ``quantize_affine`` with ``MappingType.SYMMETRIC_NO_CLIPPING_ERR``:
  scale = max(-min / 8, max / 7), so the full [-8, 7] range is used and nothing is clipped); the
  scale is then rounded to bfloat16, the dtype the kernels read, and q is computed against that
  rounded scale. Weights that are exactly ``scale * q`` (bf16 scale, a 7 or -8 in every group)
  round-trip exactly.
- The storage and kernel are chosen at quantization time from the weight's device and shape
  (``Int4Weight.backend``):
  ``"cpu-int4pack"``: PyTorch's ``aten._convert_weight_to_int4pack_for_cpu`` /
  ``aten._weight_int4pack_mm_for_cpu`` (needs N % 16 == 0, K % group_size == 0, group_size in
  {32, 64, 128, 256});
  ``"cuda-int4pack"``: PyTorch's tinygemm ``aten._convert_weight_to_int4pack`` /
  ``aten._weight_int4pack_mm`` (sm80+, same N and group rules, K % 32 == 0);
  ``"cpu-native"``: Specter's own kernel (``specter.kernels.int4_native``: int8-quantized
  activations, integer dot products, rows in blocks of eight; 2-2.5x PyTorch's CPU kernel for one
  row, ``scripts/int4_kernels.py``) where it builds on
  this machine (needs K % 64 == 0, group_size % 64 == 0, N % 8 == 0); preferred on CPU when it fits;
  ``"reference"``: two nibbles per byte, dequantized to the activation dtype then ``F.linear``
  (any shape; K is zero-padded to a whole number of groups). ``backend=`` forces one;
  ``choose_backend(n, k, group_size, device)`` names the fastest that fits, ``shared_backend(shapes,
  ...)`` the fastest that fits every weight of a set computed together.
  Both int4pack kernels are "tinygemm" style: ``w = (u - 8) * scale + zero`` for u in [0, 15]
  (checked empirically), so symmetric q is stored as u = q + 8 with zero = 0.
- ``Int4Weight.linear(x [..., K]) -> [..., N]`` in x's dtype; the int4pack kernels take bfloat16
  activations (x is cast; float32 activations hit a slow path on CPU), the native one float32
  (quantized to int8 inside), all accumulate in float32 (``kernel_dtype(backend)``).
  ``dequantize() -> [N, K]`` float32 (exact: q * scale). ``nbytes``: bytes held (packed weight +
  scales, zeros included where the kernel wants them).
- ``linear`` traces under torch.compile with ``fullgraph=True`` (the aten int4 ops have fake
  kernels; inductor calls them as extern kernels).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from specter.kernels import int4_native

Backend = Literal["cpu-native", "cpu-int4pack", "cuda-int4pack", "reference"]
BACKENDS: tuple[str, ...] = ("cpu-native", "cpu-int4pack", "cuda-int4pack", "reference")
KERNEL_GROUP_SIZES = (32, 64, 128, 256)
Q_MIN, Q_MAX = -8, 7
SCALE_DTYPE = torch.bfloat16  # what both int4pack kernels read
_DEQUANT_CHUNK = 512  # rows of the identity pushed through the kernel at once in dequantize()


def quantize_symmetric(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Group-wise symmetric INT4 of ``weight [..., N, Kp]`` (Kp a multiple of ``group_size``).

    Returns ``q [..., N, Kp]`` int8 in [-8, 7] and ``scales [..., N, Kp // group_size]`` bf16."""
    from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine

    w = weight.float()
    block = (1,) * (w.dim() - 1) + (group_size,)
    scale, _ = choose_qparams_affine(
        w, MappingType.SYMMETRIC_NO_CLIPPING_ERR, block, torch.int8, Q_MIN, Q_MAX,
        scale_dtype=torch.float32, zero_point_dtype=torch.int8, keepdim=True,
    )
    scale = scale.to(SCALE_DTYPE)
    zero = torch.zeros(scale.shape, dtype=torch.int8, device=w.device)
    q = quantize_affine(w, block, scale.float(), zero, torch.int8, Q_MIN, Q_MAX)
    return q, scale


def choose_backend(n: int, k: int, group_size: int, device: torch.device) -> Backend:
    """The fastest backend that can hold an [n, k] weight on ``device``."""
    return _fitting_backends(n, k, group_size, device)[0]


def shared_backend(shapes: list[tuple[int, int]], group_size: int, device: torch.device) -> Backend:
    """The fastest backend that can hold every [n, k] weight of ``shapes`` on ``device`` (weights
    computed together, as an expert's up and down projections, must share one)."""
    fitting = [_fitting_backends(n, k, group_size, device) for n, k in shapes]
    return next(backend for backend in fitting[0] if all(backend in others for others in fitting[1:]))


def _fitting_backends(n: int, k: int, group_size: int, device: torch.device) -> list[Backend]:
    """Every backend that can hold an [n, k] weight on ``device``, fastest first (``reference`` last:
    it holds any)."""
    fitting: list[Backend] = []
    if device.type == "cpu" and native_fits(n, k, group_size) and int4_native.available():
        fitting.append("cpu-native")
    fits = n % 16 == 0 and k % group_size == 0 and group_size in KERNEL_GROUP_SIZES
    if device.type == "cpu" and fits:
        fitting.append("cpu-int4pack")
    if device.type == "cuda" and fits and k % 32 == 0 and torch.cuda.get_device_capability(device) >= (8, 0):
        fitting.append("cuda-int4pack")
    return [*fitting, "reference"]


def native_fits(n: int, k: int, group_size: int) -> bool:
    """Whether an [n, k] weight in groups of ``group_size`` has the native kernel's layout."""
    return int4_native.fits(n, k) and group_size % int4_native.CHUNK == 0 and k % group_size == 0


def kernel_dtype(backend: Backend, activation_dtype: torch.dtype) -> torch.dtype:
    """The activation dtype ``backend``'s kernel reads (converting to it once saves a cast per call)."""
    return {"reference": activation_dtype, "cpu-native": torch.float32}.get(backend, torch.bfloat16)


def _inner_k_tiles(k: int) -> int:
    return 8 if k % 128 == 0 else 4 if k % 64 == 0 else 2


def dequantize_reference(packed: Tensor, scales: Tensor, in_features: int, dtype: torch.dtype) -> Tensor:
    """Reference layout -> weight: ``packed [..., N, Kp/2]``, ``scales [..., N, G]`` -> [..., N, K]."""
    u = torch.stack([packed & 15, packed >> 4], dim=-1)  # [..., N, Kp/2, 2]
    q = u.reshape(*scales.shape, -1).to(torch.float32) - 8  # [..., N, G, g]
    w = (q * scales.float().unsqueeze(-1)).flatten(-2)  # [..., N, Kp]
    return w[..., :in_features].to(dtype)


def int4_matmul(
    x: Tensor, packed: Tensor, scales: Tensor, backend: Backend, shape: tuple[int, int], group_size: int
) -> Tensor:
    """``x [T, K] @ W.T -> [T, N]`` in x's dtype, W given by one Int4Weight's tensors (these may be
    views into stacked expert storage)."""
    if backend == "reference":
        return F.linear(x, dequantize_reference(packed, scales, shape[1], x.dtype))
    if backend == "cpu-native":
        return int4_native.gemv(x.to(torch.float32).contiguous(), packed, scales, group_size).to(x.dtype)
    xb = x.to(torch.bfloat16).contiguous()  # [T, K]
    if backend == "cpu-int4pack":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, group_size, scales)
    else:
        y = torch.ops.aten._weight_int4pack_mm(xb, packed, group_size, scales)
    return y.to(x.dtype)  # [T, N]


@dataclasses.dataclass(eq=False)
class Int4Weight:
    """One INT4 weight matrix in the layout its backend's kernel reads.

    ``packed``: cpu-native uint8 [N, K/2] (``int4_native.pack``); cpu-int4pack uint8 [N, K/2]
    (kernel's own order); cuda-int4pack int32
    [N/8, K/(16*tiles), 32, tiles/2]; reference uint8 [N, Kp/2], k even in the low nibble.
    ``scales``: int4pack backends [G, N, 2] bf16 (scale, zero = 0); cpu-native [N, G] float32
    (bf16-rounded values, in the kernel's blocks: ``int4_native.pack_scales``); reference [N, G] bf16."""

    backend: Backend
    shape: tuple[int, int]  # (N, K) of the original weight
    group_size: int
    packed: Tensor
    scales: Tensor

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes

    @classmethod
    def from_quantized(
        cls, q: Tensor, scales: Tensor, in_features: int, group_size: int, backend: Backend
    ) -> Int4Weight:
        """Packs ``q [N, Kp]`` int8 in [-8, 7] and ``scales [N, G]`` bf16 for ``backend``."""
        n, kp = q.shape
        if backend == "reference":
            u = (q.to(torch.int16) + 8).to(torch.uint8)  # [N, Kp] in [0, 15]
            packed = (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()  # [N, Kp/2]
            return cls(backend, (n, in_features), group_size, packed, scales.to(SCALE_DTYPE).contiguous())
        if kp != in_features:
            raise ValueError(f"{backend} needs K % group_size == 0, got K={in_features}, group_size={group_size}")
        if backend != "cpu-native" and group_size not in KERNEL_GROUP_SIZES:
            raise ValueError(f"{backend} needs a group_size in {KERNEL_GROUP_SIZES}, got {group_size}")
        if backend == "cpu-native":
            reason = int4_native.unavailable_reason()
            if reason is not None:
                raise ValueError(f"cpu-native INT4 kernel unavailable: {reason}")
            if not native_fits(n, kp, group_size):
                raise ValueError(f"cpu-native needs K and group_size multiples of {int4_native.CHUNK} and N of "
                                 f"{int4_native.BLOCK_ROWS}, got N={n}, K={kp}, group_size={group_size}")
            return cls(backend, (n, in_features), group_size, int4_native.pack(q), int4_native.pack_scales(scales))
        scales_and_zeros = torch.stack([scales.t(), torch.zeros_like(scales.t())], dim=-1)  # [G, N, 2]
        scales_and_zeros = scales_and_zeros.to(SCALE_DTYPE).contiguous()
        u = q.to(torch.int32) + 8  # [N, K] in [0, 15]
        if backend == "cpu-int4pack":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), _inner_k_tiles(kp))
        elif backend == "cuda-int4pack":
            nibbles = ((u[:, 0::2] << 4) | u[:, 1::2]).to(torch.uint8).contiguous()  # [N, K/2], even k high
            packed = torch.ops.aten._convert_weight_to_int4pack(nibbles, _inner_k_tiles(kp))
        else:
            raise ValueError(f"unknown int4 backend {backend!r}; known: {', '.join(BACKENDS)}")
        return cls(backend, (n, in_features), group_size, packed, scales_and_zeros)

    def linear(self, x: Tensor) -> Tensor:
        """``x [..., K] -> [..., N]`` in x's dtype."""
        n, k = self.shape
        y = int4_matmul(x.reshape(-1, k), self.packed, self.scales, self.backend, self.shape, self.group_size)
        return y.reshape(*x.shape[:-1], n)  # [..., N]

    def int_data(self) -> Tensor:
        """The integers q [N, K] int8 in [-8, 7]."""
        n, k = self.shape
        if self.backend == "reference":
            u = torch.stack([self.packed & 15, self.packed >> 4], dim=-1).reshape(n, -1)  # [N, Kp]
            return (u[:, :k].to(torch.int8) - 8).contiguous()
        if self.backend == "cpu-native":
            return int4_native.unpack(self.packed)
        # The kernel's packed order depends on the CPU's vector width, so read q back through the
        # kernel itself: identity rows with unit scales give (u - 8) exactly.
        unit = self.scales.clone()
        unit[..., 0] = 1
        eye = torch.eye(k, dtype=torch.bfloat16, device=self.device)
        cols = [
            int4_matmul(eye[i : i + _DEQUANT_CHUNK], self.packed, unit, self.backend, self.shape, self.group_size)
            for i in range(0, k, _DEQUANT_CHUNK)
        ]  # [K, N] in pieces
        return torch.cat(cols).t().to(torch.int8).contiguous()  # [N, K]

    def group_scales(self) -> Tensor:
        """Scales [N, G] bf16."""
        if self.backend == "cpu-native":
            return int4_native.unpack_scales(self.scales).to(SCALE_DTYPE)
        return self.scales if self.backend == "reference" else self.scales[..., 0].t()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``q * scale`` as [N, K] in ``dtype`` (computed in float32). The int4pack backends pay one
        matmul of K identity rows (see ``int_data``): for tests and conversions, not hot paths."""
        n, k = self.shape
        if self.backend == "reference":
            return dequantize_reference(self.packed, self.scales, k, dtype)
        q = self.int_data().to(torch.float32).reshape(n, -1, self.group_size)  # [N, G, g]
        return (q * self.group_scales().float().unsqueeze(-1)).reshape(n, k).to(dtype)


def quantize_int4(weight: Tensor, group_size: int = 64, backend: Backend | None = None) -> Int4Weight:
    """Symmetric group-wise INT4 copy of ``weight [N, K]`` on its device (see the module docstring)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_int4 takes a 2-D [out, in] weight, got shape {tuple(weight.shape)}")
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size must be a positive even number, got {group_size}")
    n, k = weight.shape
    if backend is None:
        backend = choose_backend(n, k, group_size, weight.device)
    elif backend not in BACKENDS:
        raise ValueError(f"unknown int4 backend {backend!r}; known: {', '.join(BACKENDS)}")
    pad = -k % group_size
    q, scales = quantize_symmetric(F.pad(weight, (0, pad)) if pad else weight, group_size)
    return Int4Weight.from_quantized(q, scales, k, group_size, backend)
