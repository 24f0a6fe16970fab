// Float32 x @ W^T for few rows per weight, weights chosen per row group from a stack (a layer's
// experts or the expert cache's slots). Contract (see specter/kernels/native_rows.py):
//   grouped_rows(x float32 [P, K], w float32 [S, N, K], ends int64 [S]) -> float32 [P, N]
//   rows ends[s-1] .. ends[s] (ends[-1] = 0) are multiplied by w[s]^T; empty groups are skipped.
// Every weight row w[s, n] is read from memory once for all the rows of its group (up to four
// rows share the accumulators, a fifth re-reads it from L1; long rows go four weight rows at a
// time, sharing each load of x; with AVX-512, eight rows a pass), so a group of 2-8 rows costs
// less than twice one row's time: the memory-bound regime of decode and verification, where
// BLAS's small-M GEMM packs the weight first and runs at half a matrix-vector product's speed. A
// row's result depends on its values, the weight and K only, never on how many rows its group has.
//   normed_rows(h float32 [1, K], norm_weight [K], eps, weights [N_i, K]...) -> (normed [1, K],
//   [1, sum N_i]): an RMS norm, then every weight on the normed row, outputs side by side.
//   glu_expert_pairs(out [P, H], x [T, H], gate_up [S, 2I, H], down [S, H, I], weights [P], top_k,
//   groups, starts, pairs, blocked): for each listed expert g, the silu-gated MLP of its pairs'
//   tokens (pair p = t * top_k + j), scaled per pair, written into rows p of out (blocked: both
//   weights stored blocked, read with blocked_rows.cpp's kernel).
//   wide_rows(mode) -> 0 | 1: whether groups of two rows or more take the AVX-512 forms (below).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include "blocked_rows.h"
#include "rows_math.h"
#include "rows_math512.h"
#include "row_groups.h"

namespace {

using specter_rows::dot_rows;
using specter_rows::hsum;

// out[r * ldo + q] = dot(w + q * K [K], x[r * K ..]) for q < 4 and R <= 3 rows: four weight rows
// share each load of x, which for long rows (K >= kQuadK) comes from L2, not L1 (12 accumulators,
// 4 weight vectors and one x vector fill the 16 AVX2 registers at R = 3).
template <int R>
inline void dot_rows_quad(const float* w, const float* x, int64_t k, float* out, int64_t ldo) {
  __m256 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) a[r][q] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + k + i);
    const __m256 w2 = _mm256_loadu_ps(w + 2 * k + i), w3 = _mm256_loadu_ps(w + 3 * k + i);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * k + i);
      a[r][0] = _mm256_fmadd_ps(w0, xv, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(w1, xv, a[r][1]);
      a[r][2] = _mm256_fmadd_ps(w2, xv, a[r][2]);
      a[r][3] = _mm256_fmadd_ps(w3, xv, a[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) out[r * ldo + q] = hsum(a[r][q]);
}

// Rows at least this long are read four weight rows at a time, whatever the number of rows
// (measured on this project's CPU, one thread, a [256, 4096] weight: 2 / 3 / 4 rows per expert
// 0.20 / 0.23 / 0.29 ms against 0.36 / 0.44 / 0.50 ms one weight row at a time; one row, 24 such
// weights cycled so they come from memory, 0.24-0.26 ms against 0.32-0.33 ms; short rows,
// [8192, 256], ran about twice as slow this way, so they keep one weight row at a time). So a row's
// arithmetic depends on K only, never on how many rows share its weight.
constexpr int64_t kQuadK = 1024;

// Up to four rows against one short weight row; three go as two and one (dot_rows<3> ran slower
// than <2> then <1> re-reading the weight row from L1: 24 [8192, 256] weights cycled, 0.54-0.56
// against 0.59-0.63 ms). Every row's arithmetic is dot_rows' whatever the split.
void dot_any(int rows, const float* w, const float* x, int64_t k, float* out, int64_t ldo, bool prefetch) {
  switch (rows) {
    case 1: dot_rows<1>(w, x, k, out, ldo, prefetch); break;
    case 2: dot_rows<2>(w, x, k, out, ldo, prefetch); break;
    case 3:
      dot_rows<2>(w, x, k, out, ldo, prefetch);
      dot_rows<1>(w, x + 2 * k, k, out + 2 * ldo, ldo, prefetch);
      break;
    default: dot_rows<4>(w, x, k, out, ldo, prefetch); break;
  }
}

void dot_any_quad(int rows, const float* w, const float* x, int64_t k, float* out, int64_t ldo) {
  switch (rows) {
    case 1: dot_rows_quad<1>(w, x, k, out, ldo); break;
    case 2: dot_rows_quad<2>(w, x, k, out, ldo); break;
    default: dot_rows_quad<3>(w, x, k, out, ldo); break;
  }
}

// Two rows or more go through the AVX-512 forms (rows_math512.h: the same bits) where the CPU has
// them, up to kWideRows rows a pass. One thread, this VM's Xeon, 24 [8192, 256] + [256, 4096]
// experts cycled (from memory), one expert's rows through its gated MLP (glu_rows), AVX2
// against AVX-512: 2 / 3 / 4 / 8 / 12 rows 1.02 / 1.07 / 1.14 / 1.33 / 1.52 against 0.95 / 1.05 /
// 1.09 / 1.24 / 1.39 ms; from the caches (one expert) 4 / 8 / 12 rows 0.52 / 0.82 / 1.13 against
// 0.49 / 0.70 / 0.95. One row stays in AVX2 (0.94 ms either way), and three rows of a short
// weight row go as two and one, as in dot_any (from the caches 0.49 against 0.53 ms as three).
std::atomic<bool> wide_enabled{true};

// Short weight rows (K < kQuadK) take at most this many rows a pass of dot16; more go in further
// passes that re-read the weight row from L1. Four on AMD CPUs, kWideRows elsewhere. One thread,
// this project's AMD EPYC VM (Zen 4: AVX-512 as two 256-bit halves), 40 widened experts cycled from
// memory, call by call: [8192, 256] gate_up at 5 / 6 / 8 / 12 / 16 rows 0.796 / 0.665 / 0.797 /
// 0.917 / 1.087 ms in passes of eight against 0.461 / 0.522 / 0.714 / 0.812 / 1.007 in passes of
// four; a whole expert through glu_expert_pairs 5 / 7 / 8 / 12 rows 1.129 / 1.268 / 1.055 / 1.331
// against 0.924 / 1.062 / 1.015 / 1.266; in the engine (compiled, 50% local, eight runs each,
// flipped per run) k = 32's kernels 1.057 -> 0.963 ms an expert read (1.07x tok/s), k = 8 and 16
// unchanged (0.735 / 0.870 against 0.755 / 0.873; few experts get five rows there). On stops
// 42-60's Xeons passes of eight were the faster (see wide_enabled). short_pass_rows op: sets it.
int64_t default_short_pass_rows() {
  __builtin_cpu_init();  // a static initializer may run before libgcc has read the CPU model
  return __builtin_cpu_is("amd") ? 4 : specter_rows::kWideRows;
}
std::atomic<int64_t> short_pass_rows{default_short_pass_rows()};

// The four-weight-row forms (long rows) leave their four streams to the hardware prefetcher at any
// number of rows: one thread, this project's AMD EPYC VM, 40 widened experts' [256, 4096] down
// weights cycled from memory, interleaved call by call, 4 / 8 / 16 / 24 rows 0.293 / 0.327 / 0.525 /
// 0.685 ms without software prefetch against 0.323 / 0.355 / 0.552 / 0.714 with it (2 rows: 0.264
// either way); the AVX2 form (wide_rows off) 4 / 8 / 16 rows 0.352 / 0.416 / 0.627 against 0.398 /
// 0.448 / 0.676; the short rows' one-at-a-time form still prefetches from prefetch_min_rows rows
// (its [8192, 256] gate_up, 5 / 6 / 8 rows: 0.73 / 0.62 / 0.69 ms with, 0.87 / 0.81 / 0.96 without).
SPECTER_AVX512 void rows_times_weight_wide(const float* xp, int64_t start, int64_t end, const float* wg,
                                           int64_t begin, int64_t stop, int64_t k, int64_t n, float* op,
                                           bool prefetch) {
  using specter_rows::kWideRows;
  int64_t j = begin;
  if (k >= kQuadK)
    for (; j + 3 < stop; j += 4)
      for (int64_t r = start; r < end; r += kWideRows)
        specter_rows::quad16_any(static_cast<int>(std::min<int64_t>(kWideRows, end - r)), wg + j * k, xp + r * k, k,
                                 op + r * n + j, n);
  const int64_t chunk = k < kQuadK ? short_pass_rows.load(std::memory_order_relaxed) : kWideRows;
  for (; j < stop; ++j)
    for (int64_t r = start; r < end; r += chunk)
      specter_rows::dot16_any(static_cast<int>(std::min<int64_t>(chunk, end - r)), wg + j * k, xp + r * k, k,
                              op + r * n + j, n, prefetch);
}

// Rows start .. end of x [P, k] times the weight wg [n, k]^T into out [P, n].
void rows_times_weight(const float* xp, int64_t start, int64_t end, const float* wg, int64_t n, int64_t k,
                       float* op) {
  const bool wide =
      end - start >= 2 && wide_enabled.load(std::memory_order_relaxed) && specter_rows::avx512_supported();
  const bool prefetch = specter_rows::prefetch_for(end - start);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t stop) {
    if (wide) {
      rows_times_weight_wide(xp, start, end, wg, begin, stop, k, n, op, prefetch);
      return;
    }
    int64_t j = begin;
    if (k >= kQuadK)
      for (; j + 3 < stop; j += 4)
        for (int64_t r = start; r < end; r += 3)
          dot_any_quad(static_cast<int>(std::min<int64_t>(3, end - r)), wg + j * k, xp + r * k, k, op + r * n + j, n);
    for (; j < stop; ++j)
      for (int64_t r = start; r < end; r += 4)
        dot_any(static_cast<int>(std::min<int64_t>(4, end - r)), wg + j * k, xp + r * k, k, op + r * n + j, n, prefetch);
  });
}

using RowsTimes = void (*)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float*);

// One expert's gated MLP on rows x [R, H] into out [R, H]: out = (down @ (silu(gate) * up)) * weights
// with [gate | up] = gate_up @ x, the bits of grouped_rows (blocked_rows where the weights are
// stored blocked: rows_times), PyTorch's silu and mul, the rows kernel and mul called one by one
// (the same kernels).
void glu_rows(at::Tensor out, const at::Tensor& x, const float* gate_up, const float* down,
              const at::Tensor& weights, int64_t inter, RowsTimes rows_times) {
  const int64_t r = x.size(0), h = x.size(1);
  auto hidden = at::empty({r, 2 * inter}, x.options());
  rows_times(x.data_ptr<float>(), 0, r, gate_up, 2 * inter, h, hidden.data_ptr<float>());
  auto gated = at::mul(at::silu(hidden.narrow(1, 0, inter)), hidden.narrow(1, inter, inter)).contiguous();
  auto rows = at::empty({r, h}, x.options());
  rows_times(gated.data_ptr<float>(), 0, r, down, h, inter, rows.data_ptr<float>());
  at::mul_out(out, rows, weights);
}

}  // namespace

at::Tensor grouped_rows(const at::Tensor& x, const at::Tensor& w, const at::Tensor& ends) {
  TORCH_CHECK(x.dim() != 2 || x.size(1) % 16 == 0, "grouped_rows: K must be a multiple of 16");
  return specter_rows::for_each_row_group("grouped_rows", x, w, ends, rows_times_weight);
}

// Pairs (token t, choice j) numbered p = t * top_k + j, tokens x [T, H], weights [P] (P = T * top_k):
// for the i-th expert g of `groups`, its pairs pairs[starts[i] .. starts[i + 1]] (their tokens'
// rows gathered in that order) through expert g's gated MLP (gate_up [S, 2I, H], down [S, H, I]),
// each scaled by its weight, into rows p of out [P, H]; other rows untouched. A verification wave
// (the experts whose copies have landed) in one call, the bits of glu_rows on the same rows. blocked:
// both weights are stored blocked ([N / 16, K, 16] each, blocked_rows.cpp), read with its kernel.
void glu_expert_pairs(at::Tensor out, const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                      const at::Tensor& weights, int64_t top_k, at::IntArrayRef groups, at::IntArrayRef starts,
                      at::IntArrayRef pairs, bool blocked) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "glu_expert_pairs: x must be a contiguous float32 [T, H] tensor");
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3,
              "glu_expert_pairs: gate_up and down must be [S, 2I, H] and [S, H, I]");
  const int64_t t = x.size(0), h = x.size(1), s = gate_up.size(0), two_i = gate_up.size(1), inter = two_i / 2;
  TORCH_CHECK(top_k >= 1, "glu_expert_pairs: top_k must be at least 1");
  const int64_t p = t * top_k;
  TORCH_CHECK(gate_up.size(2) == h && two_i % 2 == 0 && gate_up.scalar_type() == at::kFloat &&
                  gate_up.is_contiguous() && h % 16 == 0,
              "glu_expert_pairs: gate_up must be a contiguous float32 [S, 2I, H] tensor, H a multiple of 16");
  TORCH_CHECK(down.size(0) == s && down.size(1) == h && down.size(2) == inter &&
                  down.scalar_type() == at::kFloat && down.is_contiguous() && inter % 16 == 0,
              "glu_expert_pairs: down must be a contiguous float32 [S, H, I] tensor, I a multiple of 16");
  TORCH_CHECK(weights.dim() == 1 && weights.size(0) == p && weights.scalar_type() == at::kFloat &&
                  weights.is_contiguous(),
              "glu_expert_pairs: weights must be a contiguous float32 [T * top_k] tensor");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == p && out.size(1) == h && out.scalar_type() == at::kFloat &&
                  out.is_contiguous(),
              "glu_expert_pairs: out must be a contiguous float32 [T * top_k, H] tensor");
  TORCH_CHECK(starts.size() == groups.size() + 1 && starts[0] == 0 &&
                  starts[groups.size()] == static_cast<int64_t>(pairs.size()),
              "glu_expert_pairs: starts must run from 0 to len(pairs), one more than groups");
  const float* xp = x.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* gate_up_p = gate_up.data_ptr<float>();
  const float* down_p = down.data_ptr<float>();
  const RowsTimes rows_times = blocked ? specter_blocked::rows_times_blocked : rows_times_weight;
  for (size_t i = 0; i < groups.size(); ++i) {
    const int64_t g = groups[i], begin = starts[i], end = starts[i + 1], r = end - begin;
    TORCH_CHECK(0 <= g && g < s, "glu_expert_pairs: group ", g, " out of range 0..", s - 1);
    TORCH_CHECK(r >= 0 && end <= static_cast<int64_t>(pairs.size()),
                "glu_expert_pairs: starts must be non-decreasing, within 0..len(pairs)");
    if (r == 0) continue;
    auto rows = at::empty({r, h}, x.options());
    auto scale = at::empty({r, 1}, x.options());
    float* rp = rows.data_ptr<float>();
    float* sp = scale.data_ptr<float>();
    for (int64_t q = 0; q < r; ++q) {
      const int64_t pair = pairs[begin + q];
      TORCH_CHECK(0 <= pair && pair < p, "glu_expert_pairs: pair ", pair, " out of range 0..", p - 1);
      std::memcpy(rp + q * h, xp + (pair / top_k) * h, h * sizeof(float));
      sp[q] = wp[pair];
    }
    auto result = at::empty({r, h}, x.options());
    glu_rows(result, rows, gate_up_p + g * two_i * h, down_p + g * h * inter, scale, inter, rows_times);
    const float* res = result.data_ptr<float>();
    for (int64_t q = 0; q < r; ++q) std::memcpy(op + pairs[begin + q] * h, res + q * h, h * sizeof(float));
  }
}

// One row through an RMS norm and then several weights: normed = h * rsqrt(mean(h^2) + eps) *
// norm_weight; out = [W_0 normed, W_1 normed, ...] concatenated. The draft step's "norm, then the
// q / k / v projections" (or the router, or the LM head) in one call instead of a dozen small ops.
std::tuple<at::Tensor, at::Tensor> normed_rows(const at::Tensor& h, const at::Tensor& norm_weight, double eps,
                                               at::TensorList weights) {
  TORCH_CHECK(h.dim() == 2 && h.size(0) == 1 && h.scalar_type() == at::kFloat && h.is_contiguous(),
              "normed_rows: h must be a contiguous float32 [1, K] tensor");
  const int64_t k = h.size(1);
  TORCH_CHECK(norm_weight.dim() == 1 && norm_weight.size(0) == k && norm_weight.scalar_type() == at::kFloat &&
                  norm_weight.is_contiguous(),
              "normed_rows: norm_weight must be a contiguous float32 [K] tensor");
  TORCH_CHECK(k % 16 == 0, "normed_rows: K must be a multiple of 16");
  int64_t total = 0;
  for (const at::Tensor& w : weights) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == k && w.scalar_type() == at::kFloat && w.is_contiguous(),
                "normed_rows: every weight must be a contiguous float32 [N, K] tensor");
    total += w.size(0);
  }
  auto normed = at::empty({1, k}, h.options());
  auto out = at::empty({1, total}, h.options());
  const float* hp = h.data_ptr<float>();
  const float* nw = norm_weight.data_ptr<float>();
  float* xp = normed.data_ptr<float>();
  specter_rows::rms_norm_row(hp, nw, k, eps, xp);
  float* op = out.data_ptr<float>();
  const bool prefetch = specter_rows::prefetch_for(1);
  for (const at::Tensor& w : weights) {
    const float* wp = w.data_ptr<float>();
    const int64_t n = w.size(0);
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t stop) {
      for (int64_t j = begin; j < stop; ++j) dot_rows<1>(wp + j * k, xp, k, op + j, 1, prefetch);
    });
    op += n;
  }
  return {normed, out};
}

// wide_rows(mode): whether two rows or more take the AVX-512 forms (mode 1: where the CPU has them,
// 0: never, -1: unchanged); returns whether they do now (tests and A/B timings).
int64_t wide_rows(int64_t mode) {
  if (mode >= 0) wide_enabled.store(mode > 0);
  return wide_enabled.load() && specter_rows::avx512_supported() ? 1 : 0;
}

// short_pass_rows(rows): the most rows a pass of the AVX-512 form takes over a short weight row
// (1 <= rows <= kWideRows sets it, else unchanged); returns it now.
int64_t short_pass_rows_op(int64_t rows) {
  TORCH_CHECK(rows <= specter_rows::kWideRows, "short_pass_rows: at most ", specter_rows::kWideRows, " rows a pass");
  if (rows >= 1) short_pass_rows.store(rows);
  return short_pass_rows.load();
}

// prefetch_min_rows(rows): the fewest rows sharing a weight row for which the float32 row kernels
// prefetch it in software (rows_math.h; rows >= 1 sets it, else unchanged); returns it now.
int64_t prefetch_min_rows(int64_t rows) {
  if (rows >= 1) specter_rows::prefetch_min_rows.store(rows);
  return specter_rows::prefetch_min_rows.load();
}

TORCH_LIBRARY_FRAGMENT(specter_native, m) {
  m.def("wide_rows(int mode) -> int", &wide_rows);  // no tensor: one kernel for every backend
  m.def("prefetch_min_rows(int rows) -> int", &prefetch_min_rows);
  m.def("short_pass_rows(int rows) -> int", &short_pass_rows_op);
  m.def("grouped_rows(Tensor x, Tensor w, Tensor ends) -> Tensor");
  m.def("normed_rows(Tensor h, Tensor norm_weight, float eps, Tensor[] weights) -> (Tensor, Tensor)");
  m.def("glu_expert_pairs(Tensor(a!) out, Tensor x, Tensor gate_up, Tensor down, Tensor weights, int top_k, "
        "int[] groups, int[] starts, int[] pairs, bool blocked=False) -> ()");
}

TORCH_LIBRARY_IMPL(specter_native, CPU, m) {
  m.impl("grouped_rows", &grouped_rows);
  m.impl("normed_rows", &normed_rows);
  m.impl("glu_expert_pairs", &glu_expert_pairs);
}
