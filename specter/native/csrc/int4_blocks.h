// The INT4 x INT8 dot products of Specter's draft kernels (int4_gemv.cpp), for few-row activations
// on x86 CPUs. Built with -mavx2 -mfma.
//
// Weights: y[m, n] = sum_k x[m, k] * (u[n, k] - 8) * scales[n, k / group], u in [0, 15]. Each
// 64-value chunk of a row is 32 bytes, byte j holding u[j] in its low nibble and u[j + 32] in its
// high one. The rows go in blocks of eight, the block's bytes interleaved chunk by chunk so that
// one 32-byte load holds four bytes of each of its eight rows: block b, chunk c, load t (0..7),
// row r (0..7) at byte ((b * chunks + c) * 8 + t) * 32 + 4 * r = row 8b + r's chunk-c bytes 4t ..
// 4t + 3. Scales likewise: block b's [G, 8] (group g of its rows r = 0..7) at (b * G + g) * 8 + r.
// Each lane of a vector then sums one row: no horizontal reduction, and one load of x's four
// bytes (broadcast) serves eight rows.
//
// Activations are quantized per chunk to int8 (symmetric, scale max|x| / 127). A chunk's integer
// dot product is exact in int32 (64 * 15 * 127 < 2^24, so its float conversion is exact too), the
// nibbles' "- 8" subtracted as 8 * sum(x chunk); the float accumulator of a row adds the chunks in
// order, each as fma(float(isum), x_scale * w_scale): a row's result does not depend on the rows
// beside it. An AVX-512 VNNI form (dpbusd, the same integers) ran no faster on this project's AMD
// EPYC VM (one thread, 48 weights cycled: [8192, 256] 0.061-0.074 against 0.057-0.078 ms, [256,
// 4096] 0.027-0.036 against 0.028-0.035, three runs; its 512-bit units are two 256-bit halves) and
// was not kept.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <immintrin.h>
#if !defined(__AVX2__) || !defined(__FMA__)
#error "int4_blocks.h is built with -mavx2 -mfma (specter/native/__init__.py)"
#endif

namespace specter_int4 {

constexpr int64_t kChunk = 64;
constexpr int64_t kBlockRows = 8;
constexpr int64_t kBlockChunkBytes = 256;  // eight rows' 32 bytes

// Whether an [n, k] weight in groups of `group` values has the block layout.
inline bool block_layout(int64_t n, int64_t k, int64_t group) {
  return k % kChunk == 0 && group % kChunk == 0 && k % group == 0 && n % kBlockRows == 0;
}
// Each line of a block is prefetched this far ahead of its use (the blocks of a weight lie back to
// back, one stream). One thread, this project's AMD EPYC VM, 48 weights cycled so they come from
// memory, 2026-12-06: [8192, 256] 0.059 / 0.053 / 0.050 / 0.046-0.050 / 0.069 ms with none / 2 / 4 /
// 6-12 / 16 KiB, [256, 4096] 0.033 / 0.027 / 0.033 / 0.024-0.025 / 0.029.
constexpr int64_t kPrefetchBytes = 8192;

// x [K] -> xq [K] int8 and one scale per chunk: q = nearbyint(x * 127 / max|x|) (the default
// rounding mode of cvtps), eight floats at a time.
inline void quantize_row(const float* x, int64_t k, int8_t* xq, float* xs) {
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

// One activation row, quantized: q (int8 [K]), scale and offset (8 * sum of q) per chunk.
struct XRow {
  const int8_t* q;
  const float* scale;
  const int32_t* offset;
};

// What every block's chunk ends with: acc += float(isum - offset) * (x scale * the rows' scales).
inline __m256 add_chunk(__m256 acc, __m256i isum, const XRow& x, int64_t c, const float* scales8) {
  const __m256i sums = _mm256_sub_epi32(isum, _mm256_set1_epi32(x.offset[c]));
  const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(scales8), _mm256_set1_ps(x.scale[c]));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc);
}

// Four activation bytes as one int32 (to broadcast), read without aliasing int8 as int32.
inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void prefetch_block_chunk(const uint8_t* p) {
  for (int line = 0; line < 4; ++line)
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + 64 * line), _MM_HINT_T0);
}

// Blocks [b0, b1) of (w, ws) against one row: out[8b .. 8b + 8). maddubs pairs a nibble (u8) with
// an activation byte (s8): |15 * 127 * 2| fits int16 twice over, so nothing saturates.
inline void blocks(const uint8_t* w, const float* ws, int64_t chunks, int64_t chunks_per_group, int64_t b0,
                   int64_t b1, const XRow& x, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t groups = chunks / chunks_per_group;
  for (int64_t b = b0; b < b1; ++b) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const uint8_t* p = w + (b * chunks + c) * kBlockChunkBytes;
      prefetch_block_chunk(p);
      const int8_t* xc = x.q + c * kChunk;
      __m256i isum = _mm256_setzero_si256();
      for (int t = 0; t < 8; ++t) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * t));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(four_bytes(xc + 4 * t))),
                                               _mm256_maddubs_epi16(hi, _mm256_set1_epi32(four_bytes(xc + 32 + 4 * t))));
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pairs, ones));
      }
      acc = add_chunk(acc, isum, x, c, ws + (b * groups + c / chunks_per_group) * kBlockRows);
    }
    _mm256_storeu_ps(out + b * kBlockRows, acc);
  }
}

// x [rows, K] quantized once; block_dots(r, w, ws, b0, b1, out) = row r against the weight's
// blocks [b0, b1) (rows 8 * b0 .. 8 * b1) of the block layout (w [N, K/2], ws [N, K/group]).
struct QuantizedRows {
  int64_t k, chunks, chunks_per_group;
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> offset;
  QuantizedRows(const float* x, int64_t rows, int64_t k_, int64_t group)
      : k(k_), chunks(k_ / kChunk), chunks_per_group(group / kChunk), q(rows * k_), scale(rows * chunks),
        offset(rows * chunks) {
    for (int64_t r = 0; r < rows; ++r) {
      quantize_row(x + r * k, k, q.data() + r * k, scale.data() + r * chunks);
      for (int64_t c = 0; c < chunks; ++c) {
        int32_t sum = 0;
        for (int64_t i = 0; i < kChunk; ++i) sum += q[r * k + c * kChunk + i];
        offset[r * chunks + c] = 8 * sum;
      }
    }
  }
  void block_dots(int64_t r, const uint8_t* w, const float* ws, int64_t b0, int64_t b1, float* out) const {
    const XRow x{q.data() + r * k, scale.data() + r * chunks, offset.data() + r * chunks};
    blocks(w, ws, chunks, chunks_per_group, b0, b1, x, out);
  }
};

}  // namespace specter_int4
