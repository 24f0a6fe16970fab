// Specter's INT4 x INT8 dot-product kernel for few-row activations on x86 CPUs (one decode
// token: M = 1). Contract (see specter/kernels/int4_native.py, which builds and calls it):
//   int4_gemv(x float32 [M, K], packed uint8 [N, K/2], scales float32 [N, K/group], group)
//     -> float32 [M, N],  y[m, n] = sum_k x[m, k] * (u[n, k] - 8) * scales[n, k / group]
// Weights: unsigned nibbles u = q + 8 in [0, 15]; each 64-value chunk of a row is 32 bytes,
// byte j holding u[j] in its low nibble and u[j + 32] in its high nibble. Activations are
// quantized per 64-value chunk to int8 (symmetric, scale max|x| / 127) inside the call, then
// each chunk is an integer dot product (AVX2: maddubs / madd), scaled once per chunk.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <cmath>
#include <cstdint>
#include <vector>
#include <immintrin.h>
#if !defined(__AVX2__) || !defined(__FMA__)
#error "int4_gemv.cpp is built with -mavx2 -mfma (specter/kernels/int4_native.py)"
#endif

namespace {

constexpr int64_t kChunk = 64;

// x [K] -> xq [K] int8, one scale and one sum of the int8 values per chunk.
void quantize_row(const float* x, int64_t k, int8_t* xq, float* xs, int32_t* xsum) {
  for (int64_t c = 0; c < k / kChunk; ++c) {
    const float* xc = x + c * kChunk;
    float amax = 0.f;
    for (int64_t i = 0; i < kChunk; ++i) amax = std::max(amax, std::fabs(xc[i]));
    const float scale = amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < kChunk; ++i) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xc[i] * inv));
      xq[c * kChunk + i] = static_cast<int8_t>(v);
      sum += v;
    }
    xs[c] = scale;
    xsum[c] = sum;
  }
}

inline float row_dot(const uint8_t* w, const float* ws, int64_t chunks, int64_t chunks_per_group,
                     const int8_t* xq, const float* xs, const int32_t* xsum) {
  float offset = 0.f;  // sum over chunks of 8 * sum(xq) * scale: the "- 8" of every nibble
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const float scale = xs[c] * ws[c / chunks_per_group];
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 32));
    const __m256i lo = _mm256_and_si256(bytes, low_mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_mask);
    const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * kChunk));
    const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + c * kChunk + 32));
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
    const __m256i sums = _mm256_madd_epi16(pairs, ones);  // 8 x int32
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(scale), acc);
    offset += 8.f * static_cast<float>(xsum[c]) * scale;
  }
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
  const __m128 one = _mm_add_ss(quad, _mm_shuffle_ps(quad, quad, 1));
  return _mm_cvtss_f32(one) - offset;
}

// x [rows, K] quantized once per call (int8 per chunk, a scale and a sum per chunk);
// dot(r, w, ws, i) = row r against weight row i of (w [N, K/2], ws [N, K/group]).
struct QuantizedRows {
  int64_t k, chunks, chunks_per_group, group;
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> sum;
  QuantizedRows(const float* x, int64_t rows, int64_t k_, int64_t group_)
      : k(k_), chunks(k_ / kChunk), chunks_per_group(group_ / kChunk), group(group_),
        q(rows * k_), scale(rows * (k_ / kChunk)), sum(rows * (k_ / kChunk)) {
    for (int64_t r = 0; r < rows; ++r)
      quantize_row(x + r * k, k, q.data() + r * k, scale.data() + r * chunks, sum.data() + r * chunks);
  }
  float dot(int64_t r, const uint8_t* w, const float* ws, int64_t i) const {
    return row_dot(w + i * (k / 2), ws + i * (k / group), chunks, chunks_per_group, q.data() + r * k,
                   scale.data() + r * chunks, sum.data() + r * chunks);
  }
};

}  // namespace

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int4_gemv: x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "int4_gemv: packed must be a contiguous uint8 [N, K/2] tensor");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "int4_gemv: scales must be a contiguous float32 [N, K/group] tensor");
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0);
  TORCH_CHECK(k % kChunk == 0 && group % kChunk == 0 && k % group == 0,
              "int4_gemv: K and group must be multiples of 64 (and K of group)");
  TORCH_CHECK(packed.size(1) * 2 == k && scales.size(0) == n && scales.size(1) == k / group,
              "int4_gemv: packed / scales shapes do not match x");
  auto out = at::empty({m, n}, x.options());
  const QuantizedRows xq(x.data_ptr<float>(), m, k, group);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < m; ++r)
      for (int64_t i = begin; i < end; ++i) op[r * n + i] = xq.dot(r, wp, sp, i);
  });
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
  TORCH_CHECK(k % kChunk == 0 && group % kChunk == 0 && k % group == 0,
              "int4_rows: K and group must be multiples of 64 (and K of group)");
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
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) op[r * n + i] = xq.dot(r, we, se, i);
    });
  }
  return out;
}

TORCH_LIBRARY(specter_native, m) {
  m.def("int4_gemv(Tensor x, Tensor packed, Tensor scales, int group) -> Tensor");
  m.def("int4_rows(Tensor x, Tensor packed, Tensor scales, Tensor ids, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(specter_native, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int4_rows", &int4_rows);
}
