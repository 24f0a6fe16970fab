// The row-group loop shared by grouped_rows (grouped_rows.cpp) and blocked_rows (blocked_rows.cpp):
// x float32 [P, K], w float32 [S, N, K] (one weight a group, in the caller's layout), ends int64 [S]
// (rows ends[s-1] .. ends[s] meet weight s). Checks the arguments (the caller checks its own
// layout's extra conditions first), then calls rows_times(x, start, end, weight, n, k, out) for
// every non-empty group and returns out float32 [P, N].
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <cstdint>

namespace specter_rows {

template <typename RowsTimesWeight>
at::Tensor for_each_row_group(const char* op, const at::Tensor& x, const at::Tensor& w, const at::Tensor& ends,
                              RowsTimesWeight rows_times) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be a contiguous float32 [P, K] tensor");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kFloat && w.is_contiguous(), op,
              ": the weights must be a contiguous float32 [S, N, K] tensor");
  TORCH_CHECK(ends.dim() == 1 && ends.scalar_type() == at::kLong && ends.size(0) == w.size(0), op,
              ": ends must be an int64 [S] tensor");
  const int64_t p = x.size(0), k = x.size(1), s = w.size(0), n = w.size(1);
  TORCH_CHECK(w.size(2) == k, op, ": the weights' last dimension must equal x's");
  auto ends_c = ends.contiguous();
  const int64_t* ep = ends_c.data_ptr<int64_t>();
  TORCH_CHECK(s == 0 || ep[s - 1] == p, op, ": ends[-1] must equal the number of rows");
  auto out = at::empty({p, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  int64_t start = 0;
  for (int64_t g = 0; g < s; ++g) {
    const int64_t end = ep[g];
    TORCH_CHECK(end >= start && end <= p, op, ": ends must be non-decreasing and at most P");
    if (end > start) rows_times(xp, start, end, wp + g * n * k, n, k, outp);
    start = end;
  }
  return out;
}

}  // namespace specter_rows
