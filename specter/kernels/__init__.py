"""Expert kernels. ``int4``: symmetric group-wise INT4 weight-only linear (Specter's own CPU
kernel, ``int4_native``, where it builds; PyTorch's int4pack kernels on CPU and CUDA; a
dequantizing reference elsewhere). ``int4_experts``: INT4 copies of a
transformers MoE layer's routed experts, the resident draft. ``int4_rows``: the custom op that
runs rows through their own experts' INT4 weights in place (compiled draft steps on a CPU).
``grouped_experts``: a layer's chosen full-precision experts in one grouped pass over stacked
weights (cache slots), the CPU path, through ``native_rows`` (Specter's grouped float32 kernel)
where it builds (the native code is built by ``specter.native``).
``slot_experts``: the compiled paths' gather over the slot table where the native kernel does not
serve. ``blocked_rows``: the kernel of the K-major blocked layout large float32 experts are kept in on
a CPU (``specter.model.expert_layout``)."""

from specter.kernels.int4 import Int4Weight, quantize_int4
from specter.kernels.int4_experts import Int4Experts, quantize_model_experts

__all__ = ["Int4Experts", "Int4Weight", "quantize_int4", "quantize_model_experts"]
