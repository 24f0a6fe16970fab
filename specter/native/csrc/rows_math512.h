// AVX-512 forms of rows_math.h's dot products, for the CPUs that have it (chosen at run time by
// grouped_rows.cpp; the file is built with -mavx2 -mfma, these functions with a target attribute).
// Each gives every row the bits of its AVX2 form, lane for lane:
//   dot16<R> is dot_rows<R>: one 16-lane accumulator per row whose lanes 0-7 are dot_rows' a0 and
//   8-15 its a1 (the same weights and inputs meet in the same lanes in the same order), summed as
//   dot_rows sums a0 + a1.
//   quad16<R> is dot_rows_quad<R>: weight rows q and q + 1 share a 16-lane accumulator, lanes 0-7
//   for q and 8-15 for q + 1, against the row's eight inputs broadcast to both halves; each half
//   is summed alone.
// With 32 vector registers a pass takes up to kWideRows rows (AVX2's 16 held three to four), so a
// weight row is read once for more of a verification's rows, and each load and FMA does twice
// the work (measured in grouped_rows.cpp; there short weight rows take four rows a pass on AMD
// CPUs, short_pass_rows). dot16_any splits three rows as two and one, as dot_any.
#pragma once
#include "rows_math.h"

#define SPECTER_AVX512 __attribute__((target("avx512f,avx512dq,avx512vl")))

namespace specter_rows {

constexpr int kWideRows = 8;

// Whether this CPU runs the forms built with SPECTER_AVX512 (the row kernels' and blocked_rows').
inline bool avx512_supported() {
  static const bool supported = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                                __builtin_cpu_supports("avx512vl");
  return supported;
}

template <int R>
SPECTER_AVX512 inline void dot16(const float* w, const float* x, int64_t k, float* out, int64_t ldo, bool prefetch) {
  __m512 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + i + kPrefetchFloats), _MM_HINT_T0);
    const __m512 wv = _mm512_loadu_ps(w + i);
    for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * k + i), a[r]);
  }
  for (int r = 0; r < R; ++r)
    out[r * ldo] = hsum(_mm256_add_ps(_mm512_castps512_ps256(a[r]), _mm512_extractf32x8_ps(a[r], 1)));
}

template <int R>
SPECTER_AVX512 inline void quad16(const float* w, const float* x, int64_t k, float* out, int64_t ldo) {
  __m512 a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    const __m512 w01 = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(w + i)), _mm256_loadu_ps(w + k + i), 1);
    const __m512 w23 =
        _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(w + 2 * k + i)), _mm256_loadu_ps(w + 3 * k + i), 1);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + r * k + i));
      a[r][0] = _mm512_fmadd_ps(w01, xv, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(w23, xv, a[r][1]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < 2; ++p) {
      out[r * ldo + 2 * p] = hsum(_mm512_castps512_ps256(a[r][p]));
      out[r * ldo + 2 * p + 1] = hsum(_mm512_extractf32x8_ps(a[r][p], 1));
    }
}

// Up to kWideRows rows against one weight row (dot16) or four (quad16).
SPECTER_AVX512 inline void dot16_any(int rows, const float* w, const float* x, int64_t k, float* out, int64_t ldo,
                                     bool prefetch) {
  switch (rows) {
    case 1: dot16<1>(w, x, k, out, ldo, prefetch); break;
    case 2: dot16<2>(w, x, k, out, ldo, prefetch); break;
    case 3:
      dot16<2>(w, x, k, out, ldo, prefetch);
      dot16<1>(w, x + 2 * k, k, out + 2 * ldo, ldo, prefetch);
      break;
    case 4: dot16<4>(w, x, k, out, ldo, prefetch); break;
    case 5: dot16<5>(w, x, k, out, ldo, prefetch); break;
    case 6: dot16<6>(w, x, k, out, ldo, prefetch); break;
    case 7: dot16<7>(w, x, k, out, ldo, prefetch); break;
    default: dot16<8>(w, x, k, out, ldo, prefetch); break;
  }
}

SPECTER_AVX512 inline void quad16_any(int rows, const float* w, const float* x, int64_t k, float* out, int64_t ldo) {
  switch (rows) {
    case 1: quad16<1>(w, x, k, out, ldo); break;
    case 2: quad16<2>(w, x, k, out, ldo); break;
    case 3: quad16<3>(w, x, k, out, ldo); break;
    case 4: quad16<4>(w, x, k, out, ldo); break;
    case 5: quad16<5>(w, x, k, out, ldo); break;
    case 6: quad16<6>(w, x, k, out, ldo); break;
    case 7: quad16<7>(w, x, k, out, ldo); break;
    default: quad16<8>(w, x, k, out, ldo); break;
  }
}

}  // namespace specter_rows
