"""``int4_rows``: every row of an activation through the INT4 weight of its own expert, one op.

Contract: ``int4_rows(x [S, K], packed [E, ...], scales [E, ...], expert_ids [S], group_size,
out_features, backend) -> [S, out_features]`` in x's dtype, where row s equals ``int4_matmul`` of
``x[s:s+1]`` with expert ``expert_ids[s]``'s packed weights and scales on ``backend``, one of
``IN_PLACE_BACKENDS`` (the CPU kernels: ``cpu-native``, ``cpu-int4pack``): each expert's packed
weights are read in place by the kernel (no gathered copy), one call per row (a draft step's
rows, one token's top-k, are distinct experts). It is the torch custom op ``specter::int4_rows``
with a fake implementation, so a ``fullgraph=True`` compiled graph calls it as one opaque node
rather than gathering every chosen expert's weights into a copy (what
``Int4Experts.forward_gather`` does on other backends). CPU tensors only: the expert ids are read
on the host, which on a CUDA device would synchronise the stream inside a graph. On
``cpu-native`` the op runs the native row op (``int4_native.rows``); ``rows_in_place`` (what
``Int4Experts`` calls) goes to it directly, without the Python op in between.
"""

from __future__ import annotations

import torch
from torch import Tensor

from specter.kernels import int4_native
from specter.kernels.int4 import int4_matmul, kernel_dtype

IN_PLACE_BACKENDS = ("cpu-native", "cpu-int4pack")


@torch.library.custom_op("specter::int4_rows", mutates_args=())
def int4_rows(x: Tensor, packed: Tensor, scales: Tensor, expert_ids: Tensor, group_size: int,
              out_features: int, backend: str) -> Tensor:
    if x.device.type != "cpu":
        raise ValueError(f"specter::int4_rows runs on CPU tensors only, got {x.device}")
    if backend not in IN_PLACE_BACKENDS:
        raise ValueError(f"specter::int4_rows reads {' or '.join(IN_PLACE_BACKENDS)} weights, got {backend!r}")
    if backend == "cpu-native":
        return int4_native.rows(x, packed, scales, expert_ids, group_size).to(x.dtype)
    xk = x.to(kernel_dtype(backend, x.dtype)).contiguous()  # cast once, not per row
    shape = (out_features, x.shape[1])
    parts = [int4_matmul(xk[s : s + 1], packed[e], scales[e], backend, shape, group_size)
             for s, e in enumerate(expert_ids.tolist())]
    return torch.cat(parts).to(x.dtype)


def rows_in_place(x: Tensor, packed: Tensor, scales: Tensor, expert_ids: Tensor, group_size: int,
                  out_features: int, backend: str) -> Tensor:
    """``int4_rows``' result; on cpu-native straight through the native row op
    (``specter_native::int4_rows``), without the Python custom op between a compiled graph and the
    kernel (167 us a call in a compiled draft step on this project's CPU)."""
    if backend == "cpu-native":
        return int4_native.rows(x, packed, scales, expert_ids, group_size).to(x.dtype)
    return int4_rows(x, packed, scales, expert_ids, group_size, out_features, backend)


@int4_rows.register_fake
def _(x: Tensor, packed: Tensor, scales: Tensor, expert_ids: Tensor, group_size: int, out_features: int,
      backend: str) -> Tensor:
    return x.new_empty(x.shape[0], out_features)
