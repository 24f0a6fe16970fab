// Float32 x @ W^T for few rows per weight, the weights in a K-major blocked layout. Contract (see
// specter/kernels/blocked_rows.py):
//   blocked_rows(x float32 [P, K], wb float32 [S, N, K] blocked, ends int64 [S]) -> float32 [P, N]
//   rows ends[s-1] .. ends[s] (ends[-1] = 0) are multiplied by weight s; empty groups are skipped.
// A weight [N, K] (N % 16 == 0) is stored blocked as [N / 16, K, 16]: the 16 outputs of a block side
// by side for each k, so one vector load of weights serves every row of the group (x[r, k]
// broadcast) and each output stays in one lane: no x vectors to load, no sums across lanes, one
// contiguous stream. Each output is one float32 FMA chain over k in order (out = fma(x[K-1],
// w[K-1], ... fma(x[0], w[0], 0))): its bits depend on its row, the weight and K only, never on
// how many rows its group has, and the AVX2 form (two 8-lane halves) gives the AVX-512 form's bits.
//   blocked_wide(mode) -> 0 | 1: whether the AVX-512 form runs (mode 1: where the CPU has it, 0:
//   never, -1: unchanged).
//   blocked_ahead(floats) -> floats: the software prefetch distance (floats >= 0 sets it, 0: none);
//   blocked_prefetch_min_rows(rows) -> rows: the fewest rows a group for which it runs (rows >= 1
//   sets it). Neither changes a bit.
// Measured in place (scripts/blocked_rows_bench.py, this project's AMD EPYC VM, one thread, 40
// widened experts cycled, each expert's two layouts allocated side by side, two runs): [8192, 256]
// at 1 / 2 / 4 / 8 rows 0.98 / 0.88-0.91 / 0.75-0.87 / 0.74-0.80 of grouped_rows' time, [256, 4096]
// 0.92-1.01 / 0.73-0.89 / 0.67-0.79 / 0.85. Software prefetch from two rows, 4 KiB ahead: one row
// reads fastest from the hardware prefetcher alone (the weight is one contiguous stream); with
// more rows the loads come later in each line's time and need it (tuned with the two ops above).
#include <ATen/core/Tensor.h>
#include <torch/library.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <immintrin.h>
#include "blocked_rows.h"
#include "row_groups.h"
#include "rows_math512.h"

namespace {

constexpr int64_t kBlock = 16;             // outputs a block
std::atomic<int64_t> ahead_floats{1024};  // each weight line is prefetched this far ahead (0: none)
std::atomic<int64_t> prefetch_from_rows{2};  // fewer rows a group: the hardware prefetcher alone
constexpr int kNarrowRows = 6;             // rows a pass, AVX2 (12 accumulators, two halves each)

std::atomic<bool> wide_enabled{true};

// One block (16 outputs) of one weight for R rows of x (row stride k), into out (row stride ldo).
template <int R>
SPECTER_AVX512 void block16(const float* wb, const float* x, int64_t k, float* out, int64_t ldo, int64_t ahead) {
  __m512 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(wb + i * kBlock + ahead), _MM_HINT_T0);
    const __m512 w = _mm512_loadu_ps(wb + i * kBlock);
    for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * k + i]), w, a[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, a[r]);
}

template <int R>
void block8x2(const float* wb, const float* x, int64_t k, float* out, int64_t ldo, int64_t ahead) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(wb + i * kBlock + ahead), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(wb + i * kBlock), w1 = _mm256_loadu_ps(wb + i * kBlock + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_set1_ps(x[r * k + i]);
      lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * ldo, lo[r]);
    _mm256_storeu_ps(out + r * ldo + 8, hi[r]);
  }
}

SPECTER_AVX512 void block16_any(int rows, const float* wb, const float* x, int64_t k, float* out, int64_t ldo,
                                int64_t ahead) {
  switch (rows) {
    case 1: block16<1>(wb, x, k, out, ldo, ahead); break;
    case 2: block16<2>(wb, x, k, out, ldo, ahead); break;
    case 3: block16<3>(wb, x, k, out, ldo, ahead); break;
    case 4: block16<4>(wb, x, k, out, ldo, ahead); break;
    case 5: block16<5>(wb, x, k, out, ldo, ahead); break;
    case 6: block16<6>(wb, x, k, out, ldo, ahead); break;
    case 7: block16<7>(wb, x, k, out, ldo, ahead); break;
    default: block16<8>(wb, x, k, out, ldo, ahead); break;
  }
}

void block8x2_any(int rows, const float* wb, const float* x, int64_t k, float* out, int64_t ldo, int64_t ahead) {
  switch (rows) {
    case 1: block8x2<1>(wb, x, k, out, ldo, ahead); break;
    case 2: block8x2<2>(wb, x, k, out, ldo, ahead); break;
    case 3: block8x2<3>(wb, x, k, out, ldo, ahead); break;
    case 4: block8x2<4>(wb, x, k, out, ldo, ahead); break;
    case 5: block8x2<5>(wb, x, k, out, ldo, ahead); break;
    default: block8x2<6>(wb, x, k, out, ldo, ahead); break;
  }
}

}  // namespace

// Rows start .. end of x [P, k] times one blocked weight [n / 16, k, 16] into out [P, n].
void specter_blocked::rows_times_blocked(const float* xp, int64_t start, int64_t end, const float* wb, int64_t n,
                                         int64_t k, float* op) {
  const bool wide = wide_enabled.load(std::memory_order_relaxed) && specter_rows::avx512_supported();
  const int64_t pass = wide ? specter_rows::kWideRows : kNarrowRows;  // eight: 8 accumulators
  const int64_t ahead = end - start >= prefetch_from_rows.load(std::memory_order_relaxed)
                            ? ahead_floats.load(std::memory_order_relaxed) : 0;
  for (int64_t b = 0; b < n / kBlock; ++b)
    for (int64_t r = start; r < end; r += pass) {
      const int rows = static_cast<int>(std::min<int64_t>(pass, end - r));
      const float* block = wb + b * kBlock * k;
      if (wide)
        block16_any(rows, block, xp + r * k, k, op + r * n + b * kBlock, n, ahead);
      else
        block8x2_any(rows, block, xp + r * k, k, op + r * n + b * kBlock, n, ahead);
    }
}

at::Tensor blocked_rows(const at::Tensor& x, const at::Tensor& wb, const at::Tensor& ends) {
  TORCH_CHECK(wb.dim() != 3 || wb.size(1) % kBlock == 0, "blocked_rows: N must be a multiple of ", kBlock);
  return specter_rows::for_each_row_group("blocked_rows", x, wb, ends, specter_blocked::rows_times_blocked);
}

int64_t blocked_ahead(int64_t floats) {
  if (floats >= 0) ahead_floats.store(floats);
  return ahead_floats.load();
}

int64_t blocked_prefetch_min_rows(int64_t rows) {
  if (rows >= 1) prefetch_from_rows.store(rows);
  return prefetch_from_rows.load();
}

int64_t blocked_wide(int64_t mode) {
  if (mode >= 0) wide_enabled.store(mode > 0);
  return wide_enabled.load() && specter_rows::avx512_supported() ? 1 : 0;
}

TORCH_LIBRARY_FRAGMENT(specter_native, m) {
  m.def("blocked_wide(int mode) -> int", &blocked_wide);
  m.def("blocked_ahead(int floats) -> int", &blocked_ahead);
  m.def("blocked_prefetch_min_rows(int rows) -> int", &blocked_prefetch_min_rows);
  m.def("blocked_rows(Tensor x, Tensor wb, Tensor ends) -> Tensor");
}

TORCH_LIBRARY_IMPL(specter_native, CPU, m) {
  m.impl("blocked_rows", &blocked_rows);
}
