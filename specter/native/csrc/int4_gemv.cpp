// Specter's INT4 draft kernels for few-row activations on x86 CPUs (one decode token: M = 1).
// Contract (see specter/kernels/int4_native.py, which builds and calls them):
//   int4_gemv(x float32 [M, K], packed uint8 [N, K/2], scales float32 [N, K/group], group)
//     -> float32 [M, N],  y[m, n] = sum_k x[m, k] * (u[n, k] - 8) * scales[n, k / group]
//   with packed and scales in int4_blocks.h's block layout (rows in blocks of eight, N % 8 == 0);
//   the arithmetic (x quantized per 64-value chunk, exact integer chunk sums) is int4_blocks.h's.
//   int4_rows, int4_glu_token: below.
// Blocks, not rows one at a time with a horizontal sum each (the layout before 2026-12-06): one
// thread, this project's AMD EPYC VM, both kernels in one process, 48 weights cycled from memory,
// five passes each: [8192, 256] 0.046-0.059 against 0.064-0.067 ms, [256, 4096] 0.026-0.031
// against 0.038-0.040 ms; one weight from the caches 0.034 against 0.054 and 0.018 against 0.037.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#include <cmath>
#include <cstdint>
#include <vector>
#include <immintrin.h>
#include "int4_blocks.h"

namespace {

using specter_int4::block_layout;
using specter_int4::kBlockRows;
using specter_int4::QuantizedRows;

// Rows [0, n) against one activation row, in blocks (a thread's share whole blocks).
void all_blocks(const QuantizedRows& xq, int64_t r, const uint8_t* w, const float* ws, int64_t n, float* out) {
  at::parallel_for(0, n / kBlockRows, 8, [&](int64_t b0, int64_t b1) { xq.block_dots(r, w, ws, b0, b1, out); });
}

// e^x for 8 floats (Cephes-style: 2^n * p(r), r = x - n ln 2, |r| <= ln 2 / 2; about 1 ulp
// for |x| < 87, saturating outside): the gate's SiLU without a call per value.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// a[i] = silu(h[i]) * h[i + width] (transformers' default gate: the first half is the gate).
void silu_glu(const float* h, int64_t width, float* a) {
  int64_t i = 0;
  for (; i + 8 <= width; i += 8) {
    const __m256 g = _mm256_loadu_ps(h + i);
    const __m256 sig = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    _mm256_storeu_ps(a + i, _mm256_mul_ps(sig, _mm256_loadu_ps(h + width + i)));
  }
  for (; i < width; ++i) a[i] = h[i] / (1.0f + std::exp(-h[i])) * h[width + i];
}

}  // namespace

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int4_gemv: x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "int4_gemv: packed must be a contiguous uint8 [N, K/2] tensor");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "int4_gemv: scales must be a contiguous float32 [N, K/group] tensor");
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0);
  TORCH_CHECK(block_layout(n, k, group),
              "int4_gemv: K and group must be multiples of 64 (and K of group), N of 8");
  TORCH_CHECK(packed.size(1) * 2 == k && scales.size(0) == n && scales.size(1) == k / group,
              "int4_gemv: packed / scales shapes do not match x");
  auto out = at::empty({m, n}, x.options());
  const QuantizedRows xq(x.data_ptr<float>(), m, k, group);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < m; ++r) all_blocks(xq, r, wp, sp, n, op + r * n);
  return out;
}

// Row s of x through expert ids[s]'s weights (packed [E, N, K/2], scales [E, N, K/group]): the
// draft's (token, slot) rows, each against its own expert, in one call (the loop a Python op ran).
at::Tensor int4_rows(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                     const at::Tensor& ids, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int4_rows: x must be a contiguous float32 [S, K] tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "int4_rows: packed must be a contiguous uint8 [E, N, K/2] tensor");
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "int4_rows: scales must be a contiguous float32 [E, N, K/group] tensor");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.size(0) == x.size(0),
              "int4_rows: ids must be an int64 [S] tensor, one expert per row of x");
  const int64_t rows = x.size(0), k = x.size(1), experts = packed.size(0), n = packed.size(1);
  TORCH_CHECK(block_layout(n, k, group),
              "int4_rows: K and group must be multiples of 64 (and K of group), N of 8");
  TORCH_CHECK(packed.size(2) * 2 == k && scales.size(0) == experts && scales.size(1) == n &&
                  scales.size(2) == k / group,
              "int4_rows: packed / scales shapes do not match x");
  auto ids_c = ids.contiguous();
  const int64_t* ip = ids_c.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(ip[r] >= 0 && ip[r] < experts, "int4_rows: expert id out of range");
  auto out = at::empty({rows, n}, x.options());
  const QuantizedRows xq(x.data_ptr<float>(), rows, k, group);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* we = wp + ip[r] * n * (k / 2);
    const float* se = sp + ip[r] * n * (k / group);
    all_blocks(xq, r, we, se, n, op + r * n);
  }
  return out;
}

// One token through its k experts, SiLU-gated: out = sum_s weights[s] * down_e(silu(g) * u) with
// [g; u] = up_e(x), e = ids[s] (up_packed [E, 2I, K/2], down_packed [E, H, I/2]). Each matmul is
// int4_rows' (x and each gated row quantized per 64-value chunk); the slots are summed in order.
at::Tensor int4_glu_token(const at::Tensor& x, const at::Tensor& up_packed, const at::Tensor& up_scales,
                          const at::Tensor& down_packed, const at::Tensor& down_scales, const at::Tensor& ids,
                          const at::Tensor& weights, int64_t up_group, int64_t down_group) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int4_glu_token: x must be a contiguous float32 [1, K] tensor");
  for (const at::Tensor* t : {&up_packed, &down_packed})
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kByte && t->is_contiguous(),
                "int4_glu_token: packed weights must be contiguous uint8 [E, N, K/2] tensors");
  for (const at::Tensor* t : {&up_scales, &down_scales})
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "int4_glu_token: scales must be contiguous float32 [E, N, K/group] tensors");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "int4_glu_token: ids must be int64 [S]");
  TORCH_CHECK(weights.dim() == 1 && weights.scalar_type() == at::kFloat && weights.size(0) == ids.size(0),
              "int4_glu_token: weights must be float32 [S], one per id");
  const int64_t experts = up_packed.size(0), k = x.size(1), up_n = up_packed.size(1), width = up_n / 2;
  const int64_t h = down_packed.size(1);
  TORCH_CHECK(up_n % 2 == 0 && up_packed.size(2) * 2 == k && down_packed.size(0) == experts &&
                  down_packed.size(2) * 2 == width,
              "int4_glu_token: up must be [E, 2I, K/2] and down [E, H, I/2] for x [1, K]");
  TORCH_CHECK(block_layout(up_n, k, up_group) && block_layout(h, width, down_group),
              "int4_glu_token: K, I and the groups must be multiples of 64 (K and I of their groups), H of 8");
  TORCH_CHECK(up_scales.size(0) == experts && up_scales.size(1) == up_n && up_scales.size(2) == k / up_group &&
                  down_scales.size(0) == experts && down_scales.size(1) == h && down_scales.size(2) == width / down_group,
              "int4_glu_token: scales shapes do not match the packed weights");
  auto ids_c = ids.contiguous();
  auto weights_c = weights.contiguous();
  const int64_t* ip = ids_c.data_ptr<int64_t>();
  const float* wp = weights_c.data_ptr<float>();
  for (int64_t s = 0; s < ids.size(0); ++s)
    TORCH_CHECK(ip[s] >= 0 && ip[s] < experts, "int4_glu_token: expert id out of range");
  auto out = at::zeros({1, h}, x.options());
  float* op = out.data_ptr<float>();
  const QuantizedRows xq(x.data_ptr<float>(), 1, k, up_group);
  std::vector<float> gate_up(up_n), gated(width), y(h);
  const uint8_t* upw = up_packed.data_ptr<uint8_t>();
  const float* ups = up_scales.data_ptr<float>();
  const uint8_t* dnw = down_packed.data_ptr<uint8_t>();
  const float* dns = down_scales.data_ptr<float>();
  for (int64_t s = 0; s < ids.size(0); ++s) {
    const int64_t e = ip[s];
    all_blocks(xq, 0, upw + e * up_n * (k / 2), ups + e * up_n * (k / up_group), up_n, gate_up.data());
    silu_glu(gate_up.data(), width, gated.data());
    const QuantizedRows aq(gated.data(), 1, width, down_group);
    all_blocks(aq, 0, dnw + e * h * (width / 2), dns + e * h * (width / down_group), h, y.data());
    for (int64_t j = 0; j < h; ++j) op[j] += wp[s] * y[j];
  }
  return out;
}

TORCH_LIBRARY(specter_native, m) {
  m.def("int4_gemv(Tensor x, Tensor packed, Tensor scales, int group) -> Tensor");
  m.def("int4_rows(Tensor x, Tensor packed, Tensor scales, Tensor ids, int group) -> Tensor");
  m.def("int4_glu_token(Tensor x, Tensor up_packed, Tensor up_scales, Tensor down_packed, Tensor down_scales, "
        "Tensor ids, Tensor weights, int up_group, int down_group) -> Tensor");
}

TORCH_LIBRARY_IMPL(specter_native, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int4_rows", &int4_rows);
  m.impl("int4_glu_token", &int4_glu_token);
}
