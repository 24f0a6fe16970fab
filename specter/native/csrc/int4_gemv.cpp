// Specter's INT4 x INT8 dot-product kernel for few-row activations on x86 CPUs (one decode
// token: M = 1). Contract (see specter/kernels/int4_native.py, which builds and calls it):
//   int4_gemv(x float32 [M, K], packed uint8 [N, K/2], scales float32 [N, K/group], group)
//     -> float32 [M, N],  y[m, n] = sum_k x[m, k] * (u[n, k] - 8) * scales[n, k / group]
// Weights: unsigned nibbles u = q + 8 in [0, 15]; each 64-value chunk of a row is 32 bytes,
// byte j holding u[j] in its low nibble and u[j + 32] in its high nibble. Activations are
// quantized per 64-value chunk to int8 (symmetric, scale max|x| / 127) inside the call, then
// each chunk is an integer dot product (AVX2: maddubs / madd) with the nibbles' "- 8" subtracted
// exactly in its int32 lanes, scaled once per chunk. Rows of K <= 1024 go four weight rows at a
// time (one load of each x chunk, one accumulator a row, one reduction): the short gate/up rows
// are bound by instructions, not memory; longer rows go one at a time with four accumulators (a
// chunk's fmadd does not wait on the previous one's). A row's arithmetic depends on K only, the
// same in a group of four or alone, so its result does not depend on its neighbours.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#include <cmath>
#include <cstdint>
#include <vector>
#include <immintrin.h>
#if !defined(__AVX2__) || !defined(__FMA__)
#error "int4_gemv.cpp is built with -mavx2 -mfma (specter/native/__init__.py)"
#endif

namespace {

constexpr int64_t kChunk = 64;
// Weight rows lie back to back, one stream: each line is prefetched this far ahead of its use.
// A cold weight (read from memory) stalls the kernel otherwise: one thread, this VM's Xeon, two
// [E, 8192, 128] + [E, 256, 2048] experts from 40 layers cycled, 0.52-0.56 ms a token's two
// experts without, 0.39-0.42 ms with (hot weights: 0.28-0.33 ms either way). 2 KiB rather than 1:
// widened model, 50% on local, k = 8, an eager engine's draft step 2.57 against 2.74 ms (1.5 KiB
// 2.69, 3 KiB 2.65, 4 KiB 2.66; six runs each, the distance switched per run in one process,
// 2026-12-05); [8192, 256] weights cycled from memory 0.115 against 0.127 ms, [256, 4096] 0.060
// against 0.068.
constexpr int64_t kPrefetchBytes = 2048;
constexpr int64_t kGroupedMaxK = 1024;  // longer rows stream one at a time (cold, four streams of long rows read slower)

// x [K] -> xq [K] int8 and one scale per chunk: q = nearbyint(x * 127 / max|x|) (the default
// rounding mode of cvtps), eight floats at a time.
void quantize_row(const float* x, int64_t k, int8_t* xq, float* xs) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i byte_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  for (int64_t c = 0; c < k / kChunk; ++c) {
    const float* xc = x + c * kChunk;
    __m256 v[8];
    __m256 amax8 = _mm256_setzero_ps();
    for (int i = 0; i < 8; ++i) {
      v[i] = _mm256_loadu_ps(xc + 8 * i);
      amax8 = _mm256_max_ps(amax8, _mm256_and_ps(v[i], abs_mask));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    xs[c] = amax / 127.f;
    for (int half = 0; half < 2; ++half) {
      const __m256* h = v + 4 * half;
      const __m256i pairs0 = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(h[0], inv)),
                                                _mm256_cvtps_epi32(_mm256_mul_ps(h[1], inv)));
      const __m256i pairs1 = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(h[2], inv)),
                                                _mm256_cvtps_epi32(_mm256_mul_ps(h[3], inv)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + c * kChunk + 32 * half),
                          _mm256_permutevar8x32_epi32(_mm256_packs_epi16(pairs0, pairs1), byte_order));
    }
  }
}

// The integer dot product of one 32-byte weight chunk with x's chunk, 8 int32 partial sums (lane
// i: bytes 4i .. 4i + 3 of both nibble halves).
inline __m256i chunk_sums(__m256i bytes, __m256i xl, __m256i xh) {
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(bytes, low_mask);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_mask);
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// Per chunk c of an activation row: xq (int8), scale[c], and lane_offset[8c .. 8c + 8): chunk_sums
// of a weight chunk of nibbles 8 against it, the "- 8" of every nibble subtracted exactly, lane
// by lane, in the integer sums.
struct XRow {
  const int8_t* q;
  const float* scale;
  const int32_t* lane_offset;
};

// R weight rows (w + j * row_bytes, scales ws + j * ws_stride) against one activation row, their
// dot products into out[0 .. R). Each row keeps S float accumulators, chunk c going to c % S
// (S > 1 for long rows: independent chains instead of one fmadd latency a chunk), summed pairwise
// at the end; the x chunk and its offsets are loaded once for the R rows; one hadd tree reduces
// the rows. A row's arithmetic depends on K only (S is fixed by K), never on R, so its result
// does not depend on how rows were grouped.
template <int R, int S>
inline void rows_dot(const uint8_t* w, int64_t row_bytes, const float* ws, int64_t ws_stride, int64_t chunks,
                     int64_t chunks_per_group, const XRow& x, float* out) {
  __m256 acc[R][S];
  for (int j = 0; j < R; ++j)
    for (int s = 0; s < S; ++s) acc[j][s] = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + c * kChunk));
    const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + c * kChunk + 32));
    const __m256i offset = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.lane_offset + 8 * c));
    const int64_t g = chunks_per_group == 1 ? c : c / chunks_per_group;
    const int s = S == 1 ? 0 : static_cast<int>(c % S);
    for (int j = 0; j < R; ++j) {
      const uint8_t* chunk = w + j * row_bytes + c * 32;
      if ((c & 1) == 0)  // one prefetch a 64-byte line
        _mm_prefetch(reinterpret_cast<const char*>(chunk + kPrefetchBytes), _MM_HINT_T0);
      const __m256i sums = _mm256_sub_epi32(
          chunk_sums(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk)), xl, xh), offset);
      acc[j][s] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(x.scale[c] * ws[j * ws_stride + g]),
                                  acc[j][s]);
    }
  }
  __m256 row[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int j = 0; j < R; ++j) {
    if constexpr (S == 1) row[j] = acc[j][0];
    else if constexpr (S == 4) row[j] = _mm256_add_ps(_mm256_add_ps(acc[j][0], acc[j][1]), _mm256_add_ps(acc[j][2], acc[j][3]));
    else static_assert(S == 1 || S == 4, "rows_dot: one or four accumulators a row");
  }
  // lanes 0-3 of each 128-bit half: per row, ((a0 + a1) + (a2 + a3)) and ((a4 + a5) + (a6 + a7))
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(row[0], row[1]), _mm256_hadd_ps(row[2], row[3]));
  float sums[4];
  _mm_storeu_ps(sums, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
  for (int j = 0; j < R; ++j) out[j] = sums[j];
}

// x [rows, K] quantized once per call (int8 per chunk, a scale and the lane offsets per chunk);
// dots(r, w, ws, begin, end, out) = row r against weight rows [begin, end) of (w [N, K/2],
// ws [N, K/group]): short rows four at a time, long ones one at a time with four accumulators.
struct QuantizedRows {
  int64_t k, chunks, chunks_per_group, group;
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> lane_offset;
  QuantizedRows(const float* x, int64_t rows, int64_t k_, int64_t group_)
      : k(k_), chunks(k_ / kChunk), chunks_per_group(group_ / kChunk), group(group_),
        q(rows * k_), scale(rows * (k_ / kChunk)), lane_offset(rows * (k_ / kChunk) * 8) {
    const __m256i eights = _mm256_set1_epi8(static_cast<char>(0x88));  // every nibble 8
    for (int64_t r = 0; r < rows; ++r) {
      quantize_row(x + r * k, k, q.data() + r * k, scale.data() + r * chunks);
      for (int64_t c = 0; c < chunks; ++c) {
        const int8_t* xc = q.data() + r * k + c * kChunk;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(lane_offset.data() + (r * chunks + c) * 8),
                            chunk_sums(eights, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc)),
                                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + 32))));
      }
    }
  }
  void dots(int64_t r, const uint8_t* w, const float* ws, int64_t begin, int64_t end, float* out) const {
    const XRow x{q.data() + r * k, scale.data() + r * chunks, lane_offset.data() + r * chunks * 8};
    const int64_t row_bytes = k / 2, ws_stride = k / group;
    int64_t i = begin;
    if (k > kGroupedMaxK) {
      for (; i < end; ++i)
        rows_dot<1, 4>(w + i * row_bytes, row_bytes, ws + i * ws_stride, ws_stride, chunks, chunks_per_group, x, out + i);
      return;
    }
    for (; i + 4 <= end; i += 4)
      rows_dot<4, 1>(w + i * row_bytes, row_bytes, ws + i * ws_stride, ws_stride, chunks, chunks_per_group, x, out + i);
    for (; i < end; ++i)
      rows_dot<1, 1>(w + i * row_bytes, row_bytes, ws + i * ws_stride, ws_stride, chunks, chunks_per_group, x, out + i);
  }
};


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
    for (int64_t r = 0; r < m; ++r) xq.dots(r, wp, sp, begin, end, op + r * n);
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
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) { xq.dots(r, we, se, begin, end, op + r * n); });
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
  TORCH_CHECK(k % kChunk == 0 && width % kChunk == 0 && up_group % kChunk == 0 && down_group % kChunk == 0 &&
                  k % up_group == 0 && width % down_group == 0,
              "int4_glu_token: K, I and the groups must be multiples of 64 (K and I of their groups)");
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
    at::parallel_for(0, up_n, 64, [&](int64_t begin, int64_t end) {
      xq.dots(0, upw + e * up_n * (k / 2), ups + e * up_n * (k / up_group), begin, end, gate_up.data());
    });
    silu_glu(gate_up.data(), width, gated.data());
    const QuantizedRows aq(gated.data(), 1, width, down_group);
    at::parallel_for(0, h, 64, [&](int64_t begin, int64_t end) {
      aq.dots(0, dnw + e * h * (width / 2), dns + e * h * (width / down_group), begin, end, y.data());
    });
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
