// Inline float32 helpers shared by the native row kernels (grouped_rows.cpp, draft_layer.cpp):
// a horizontal sum, R rows' dot products against one weight row, one row's RMS norm. Built with
// -mavx2 -mfma (specter/native/__init__.py).
#pragma once
#include <atomic>
#include <cmath>
#include <cstdint>
#include <immintrin.h>
#if !defined(__AVX2__) || !defined(__FMA__)
#error "the native row kernels are built with -mavx2 -mfma (specter/native/__init__.py)"
#endif

namespace specter_rows {

// Each line of a weight row is prefetched this far ahead of its use: the rows of a weight
// lie back to back, and a weight read from memory otherwise stalls the loop (one thread, this VM's
// Xeon, 24 [8192, 256] + [256, 4096] experts cycled: three rows 1.12 -> 1.00-1.01 ms an expert,
// one row 0.95 -> 0.93-0.94; in the engine, verification per expert read 1.23 -> 1.14-1.17 ms).
// 3 KiB rather than 1: widened model, 50% on local, k = 8, eight runs each, the distance switched
// per run in one process (2026-12-05): 128.3 against 123.5 tok/s, verification 36.2 against 37.4 ms
// a round (1.04 against 1.08 ms an expert read), draft step 2.45 against 2.54 ms (2 KiB: 124.9
// tok/s, 4 KiB: 126.9).
constexpr int64_t kPrefetchFloats = 768;

// A weight row shared by fewer rows than this is left to the hardware prefetcher: one thread, this
// project's AMD EPYC VM, 40 widened experts cycled from memory (glu_expert_pairs, three runs each),
// 1 / 2 / 3 rows 0.45-0.50 / 0.53-0.54 / 0.55-0.59 ms an expert without software prefetch against
// 0.49-0.57 / 0.58-0.60 / 0.60-0.66 with it, 4 / 12 rows 0.79-0.89 / 1.54-1.61 against 0.71-0.75 /
// 1.27-1.29 (5-8 rows either way, run to run): a loop with few FMAs a line reads fastest from the
// hardware's stream prefetch alone; one with many needs the lines early. On stops 42-60's Xeons
// software prefetch helped one row by 1-2% and three by 10%. prefetch_min_rows op: sets it.
inline std::atomic<int64_t> prefetch_min_rows{4};  // specter.kernels.native_rows.PREFETCH_MIN_ROWS

inline bool prefetch_for(int64_t rows) { return rows >= prefetch_min_rows.load(std::memory_order_relaxed); }

inline float hsum(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quad, _mm_shuffle_ps(quad, quad, 1)));
}

// out[r * ldo] = dot(w [K], x[r * K .. ]) for R rows; K % 16 == 0, two accumulators per row.
// ``prefetch``: each weight line kPrefetchFloats ahead (see prefetch_for); the bits do not change.
template <int R>
inline void dot_rows(const float* w, const float* x, int64_t k, float* out, int64_t ldo, bool prefetch) {
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + i + kPrefetchFloats), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * k + i), a0[r]);
      a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * k + i + 8), a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = hsum(_mm256_add_ps(a0[r], a1[r]));
}

// out = h * rsqrt(mean(h^2) + eps) * weight for one row h [K], K % 8 == 0 (the sum of squares in
// eight lanes, then across them: a different order from PyTorch's, equal to rounding).
inline void rms_norm_row(const float* h, const float* weight, int64_t k, double eps, float* out) {
  __m256 squares = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    const __m256 v = _mm256_loadu_ps(h + i);
    squares = _mm256_fmadd_ps(v, v, squares);
  }
  const float inv = 1.0f / std::sqrt(hsum(squares) / static_cast<float>(k) + static_cast<float>(eps));
  for (int64_t i = 0; i < k; ++i) out[i] = weight[i] * (h[i] * inv);
}

}  // namespace specter_rows
