// A decoder layer's attention half for the draft's one token, in two calls around the K/V write
// (the caller appends k and v to its cache in between). Contract (see
// specter/kernels/draft_layer.py):
//   draft_qkv(h [1, H], input_norm [H], wq [nH*d, H], wk [nKV*d, H], wv [nKV*d, H],
//             q_norm [d] or [0], k_norm [d] or [0], cos [d], signed_sin [d], head_dim, eps)
//     -> (q [nH, d], k [nKV, d], v [nKV, d]): the RMS-normed row through q, k and v; q and k
//     per-head RMS-normed where q_norm / k_norm have d values; q and k rotated:
//     x * cos + roll(x, d/2) * signed_sin.
//   draft_attend_route(q [nH, d], keys [1, nKV, >=L, d], values (same), L, more_keys [1, nKV, >=M,
//             d], more_values (same), M, h [1, H], wo [H, nH*d], post_norm [H], router [E, H], eps,
//             scale, top_k, renormalize)
//     -> (h + o(attention) [1, H], its RMS norm x [1, H], top_k_weights [1, top_k] float32,
//     top_k_index [1, top_k] int64: the softmax of the router logits' top_k largest, largest
//     first, divided by their sum where `renormalize`, as the model's router): q attends the
//     cache's first L positions, then the first M of `more` (M = 0: none; the draft's own
//     positions of a round, kept beside the model's cache), any strides but the last; head n
//     reads kv head n / (nH / nKV); softmax in float32 with the maximum subtracted.
//   draft_layer(h, input_norm, wq, wk, wv, q_norm, k_norm, cos, signed_sin, head_dim, write_keys,
//             write_values, write_index, keys, values, length, more_keys, more_values, more_length, wo,
//             post_norm, router, eps, scale, top_k, renormalize, up_packed, up_scales, down_packed,
//             down_scales, up_group, down_group)
//     -> (h after the layer [1, H], x, top_k_weights, top_k_index as draft_attend_route's): a whole
//     draft layer in one call: draft_qkv; k and v written at position write_index of write_keys /
//     write_values ([1, nKV, >write_index, d], the last dimension dense: the cache itself, or the
//     round's positions held beside it, which keys / values or more_keys / more_values then
//     include); draft_attend_route; the routed experts' INT4 SiLU-gated sum (int4_glu_token, in
//     int4_gemv.cpp) added to the residual. The same arithmetic as the three calls it joins.
// Everything float32, contiguous but the cache; H, nH*d multiples of 16, d a multiple of 8. The
// weights are read once each through the row kernels' dot products (rows_math.h); the rest is a
// few microseconds of arithmetic that were 20-odd PyTorch ops a layer.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>
#include "rows_math.h"

namespace {

using specter_rows::dot_rows;
using specter_rows::rms_norm_row;

void check_row_weight(const at::Tensor& w, int64_t k, const char* what) {
  TORCH_CHECK(w.dim() == 2 && w.size(1) == k && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "draft layer: ", what, " must be a contiguous float32 [N, ", k, "] tensor");
}

void check_vector(const at::Tensor& v, int64_t n, const char* what) {
  TORCH_CHECK(v.dim() == 1 && v.size(0) == n && v.scalar_type() == at::kFloat && v.is_contiguous(),
              "draft layer: ", what, " must be a contiguous float32 [", n, "] tensor");
}

// out [N] = w [N, K] @ x [K]
void rows_of(const at::Tensor& w, const float* x, float* out) {
  const int64_t n = w.size(0), k = w.size(1);
  const float* wp = w.data_ptr<float>();
  const bool prefetch = specter_rows::prefetch_for(1);
  for (int64_t j = 0; j < n; ++j) dot_rows<1>(wp + j * k, x, k, out + j, 1, prefetch);
}

// Each of `heads` rows of d values: RMS-normed by `norm` (when given), then rotated.
void norm_and_rotate(float* rows, int64_t heads, int64_t d, const at::Tensor& norm, double eps, const float* cos,
                     const float* signed_sin) {
  std::vector<float> row(d);
  const int64_t half = d / 2;
  for (int64_t n = 0; n < heads; ++n) {
    float* x = rows + n * d;
    if (norm.numel()) rms_norm_row(x, norm.data_ptr<float>(), d, eps, x);
    std::copy(x, x + d, row.begin());
    for (int64_t i = 0; i < d; ++i) x[i] = row[i] * cos[i] + row[(i + half) % d] * signed_sin[i];
  }
}

// A cache's [1, nKV, >= length, d] keys and values: float32, the same shape and strides, the last
// dimension dense.
void check_cache(const at::Tensor& keys, const at::Tensor& values, int64_t length, int64_t d, const char* what,
                 const char* op = "draft_attend_route") {
  TORCH_CHECK(keys.dim() == 4 && keys.size(0) == 1 && keys.size(3) == d && keys.stride(3) == 1 &&
                  keys.scalar_type() == at::kFloat && values.sizes() == keys.sizes() &&
                  values.strides() == keys.strides() && values.scalar_type() == at::kFloat,
              op, ": ", what, " must be float32 [1, nKV, L, d] alike, the last dimension dense");
  TORCH_CHECK(length <= keys.size(2), op, ": a length must be at most its cache's L");
}

// One kv head's positions in a cache: position l at base + l * stride.
struct HeadRows {
  const float* base = nullptr;
  int64_t stride = 0;
  const float* at(int64_t l) const { return base + l * stride; }
};

HeadRows head_rows(const at::Tensor& cache, int64_t head, int64_t length) {
  if (!length) return {};
  return {cache.data_ptr<float>() + head * cache.stride(1), cache.stride(2)};
}

// logits -> softmax in place; the top_k largest probabilities, largest first (the lower index
// first among equals), divided by their sum where `renormalize`.
void select_top(std::vector<float>& logits, int64_t top_k, bool renormalize, float* weights, int64_t* index) {
  const float top = *std::max_element(logits.begin(), logits.end());
  float total = 0.0f;
  for (float& v : logits) total += (v = std::exp(v - top));
  for (float& v : logits) v /= total;
  std::vector<bool> taken(logits.size(), false);
  float chosen = 0.0f;
  for (int64_t j = 0; j < top_k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < static_cast<int64_t>(logits.size()); ++e)
      if (!taken[e] && (best < 0 || logits[e] > logits[best])) best = e;
    taken[best] = true;
    index[j] = best;
    weights[j] = logits[best];
    chosen += logits[best];
  }
  if (renormalize)
    for (int64_t j = 0; j < top_k; ++j) weights[j] /= chosen;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> draft_qkv(
    const at::Tensor& h, const at::Tensor& input_norm, const at::Tensor& wq, const at::Tensor& wk,
    const at::Tensor& wv, const at::Tensor& q_norm, const at::Tensor& k_norm, const at::Tensor& cos,
    const at::Tensor& signed_sin, int64_t head_dim, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.size(0) == 1 && h.scalar_type() == at::kFloat && h.is_contiguous(),
              "draft_qkv: h must be a contiguous float32 [1, H] tensor");
  const int64_t hidden = h.size(1), d = head_dim;
  TORCH_CHECK(hidden % 16 == 0 && d % 8 == 0, "draft_qkv: H must be a multiple of 16 and head_dim of 8");
  check_vector(input_norm, hidden, "input_norm");
  check_row_weight(wq, hidden, "wq");
  check_row_weight(wk, hidden, "wk");
  check_row_weight(wv, hidden, "wv");
  TORCH_CHECK(wq.size(0) % d == 0 && wk.size(0) % d == 0 && wv.size(0) == wk.size(0),
              "draft_qkv: q, k and v must have whole heads of head_dim rows, k and v alike");
  if (q_norm.numel() || k_norm.numel()) {
    check_vector(q_norm, d, "q_norm");
    check_vector(k_norm, d, "k_norm");
  }
  check_vector(cos, d, "cos");
  check_vector(signed_sin, d, "signed_sin");
  const int64_t n_heads = wq.size(0) / d, n_kv = wk.size(0) / d;
  std::vector<float> x(hidden);
  rms_norm_row(h.data_ptr<float>(), input_norm.data_ptr<float>(), hidden, eps, x.data());
  auto q = at::empty({n_heads, d}, h.options());
  auto k = at::empty({n_kv, d}, h.options());
  auto v = at::empty({n_kv, d}, h.options());
  rows_of(wq, x.data(), q.data_ptr<float>());
  rows_of(wk, x.data(), k.data_ptr<float>());
  rows_of(wv, x.data(), v.data_ptr<float>());
  norm_and_rotate(q.data_ptr<float>(), n_heads, d, q_norm, eps, cos.data_ptr<float>(), signed_sin.data_ptr<float>());
  norm_and_rotate(k.data_ptr<float>(), n_kv, d, k_norm, eps, cos.data_ptr<float>(), signed_sin.data_ptr<float>());
  return {q, k, v};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> draft_attend_route(
    const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t length, const at::Tensor& more_keys,
    const at::Tensor& more_values, int64_t more_length, const at::Tensor& h, const at::Tensor& wo,
    const at::Tensor& post_norm, const at::Tensor& router, double eps, double scale, int64_t top_k, bool renormalize) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "draft_attend_route: q must be a contiguous float32 [nH, d] tensor");
  const int64_t n_heads = q.size(0), d = q.size(1);
  check_cache(keys, values, length, d, "keys and values");
  const int64_t n_kv = keys.size(1);
  TORCH_CHECK(n_kv > 0 && n_heads % n_kv == 0, "draft_attend_route: nH must be a multiple of nKV");
  TORCH_CHECK(length > 0, "draft_attend_route: length must be at least 1");
  if (more_length) {
    check_cache(more_keys, more_values, more_length, d, "more_keys and more_values");
    TORCH_CHECK(more_keys.size(1) == n_kv, "draft_attend_route: more_keys must have the cache's nKV heads");
  }
  TORCH_CHECK(h.dim() == 2 && h.size(0) == 1 && h.scalar_type() == at::kFloat && h.is_contiguous(),
              "draft_attend_route: h must be a contiguous float32 [1, H] tensor");
  const int64_t hidden = h.size(1), width = n_heads * d;
  TORCH_CHECK(hidden % 16 == 0 && width % 16 == 0, "draft_attend_route: H and nH*d must be multiples of 16");
  check_row_weight(wo, width, "wo");
  TORCH_CHECK(wo.size(0) == hidden, "draft_attend_route: wo must be [H, nH*d]");
  check_vector(post_norm, hidden, "post_norm");
  check_row_weight(router, hidden, "router");
  const int64_t experts = router.size(0);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "draft_attend_route: top_k must be in 1..E");

  const int64_t group = n_heads / n_kv, total_length = length + more_length;
  const float* qp = q.data_ptr<float>();
  std::vector<float> attended(width, 0.0f), scores(total_length);
  for (int64_t n = 0; n < n_heads; ++n) {
    const float* qn = qp + n * d;
    const int64_t head = n / group;
    const HeadRows k_rows = head_rows(keys, head, length), more_k_rows = head_rows(more_keys, head, more_length);
    const HeadRows v_rows = head_rows(values, head, length), more_v_rows = head_rows(more_values, head, more_length);
    float top = -INFINITY;
    for (int64_t l = 0; l < total_length; ++l) {
      const float* kl = l < length ? k_rows.at(l) : more_k_rows.at(l - length);
      __m256 acc = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qn + i), _mm256_loadu_ps(kl + i), acc);
      scores[l] = specter_rows::hsum(acc) * static_cast<float>(scale);
      top = std::max(top, scores[l]);
    }
    float total = 0.0f;
    for (int64_t l = 0; l < total_length; ++l) total += (scores[l] = std::exp(scores[l] - top));
    float* out = attended.data() + n * d;
    for (int64_t l = 0; l < total_length; ++l) {
      const __m256 p = _mm256_set1_ps(scores[l] / total);
      const float* vl = l < length ? v_rows.at(l) : more_v_rows.at(l - length);
      for (int64_t i = 0; i < d; i += 8)
        _mm256_storeu_ps(out + i, _mm256_fmadd_ps(p, _mm256_loadu_ps(vl + i), _mm256_loadu_ps(out + i)));
    }
  }
  auto h_out = at::empty({1, hidden}, h.options());
  auto x = at::empty({1, hidden}, h.options());
  float* hp = h_out.data_ptr<float>();
  rows_of(wo, attended.data(), hp);
  const float* hin = h.data_ptr<float>();
  for (int64_t i = 0; i < hidden; ++i) hp[i] += hin[i];
  rms_norm_row(hp, post_norm.data_ptr<float>(), hidden, eps, x.data_ptr<float>());
  std::vector<float> probs(experts);
  rows_of(router, x.data_ptr<float>(), probs.data());
  auto weights = at::empty({1, top_k}, h.options());
  auto index = at::empty({1, top_k}, h.options().dtype(at::kLong));
  select_top(probs, top_k, renormalize, weights.data_ptr<float>(), index.data_ptr<int64_t>());
  return {h_out, x, weights, index};
}

at::Tensor int4_glu_token(const at::Tensor& x, const at::Tensor& up_packed, const at::Tensor& up_scales,
                          const at::Tensor& down_packed, const at::Tensor& down_scales, const at::Tensor& ids,
                          const at::Tensor& weights, int64_t up_group, int64_t down_group);  // int4_gemv.cpp

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> draft_layer(
    const at::Tensor& h, const at::Tensor& input_norm, const at::Tensor& wq, const at::Tensor& wk,
    const at::Tensor& wv, const at::Tensor& q_norm, const at::Tensor& k_norm, const at::Tensor& cos,
    const at::Tensor& signed_sin, int64_t head_dim, const at::Tensor& write_keys, const at::Tensor& write_values,
    int64_t write_index, const at::Tensor& keys, const at::Tensor& values, int64_t length,
    const at::Tensor& more_keys, const at::Tensor& more_values, int64_t more_length, const at::Tensor& wo,
    const at::Tensor& post_norm, const at::Tensor& router, double eps, double scale, int64_t top_k, bool renormalize,
    const at::Tensor& up_packed, const at::Tensor& up_scales, const at::Tensor& down_packed,
    const at::Tensor& down_scales, int64_t up_group, int64_t down_group) {
  auto [q, k, v] = draft_qkv(h, input_norm, wq, wk, wv, q_norm, k_norm, cos, signed_sin, head_dim, eps);
  const int64_t n_kv = k.size(0), d = k.size(1);
  check_cache(write_keys, write_values, 0, d, "write_keys and write_values", "draft_layer");
  TORCH_CHECK(write_keys.size(1) == n_kv && write_index >= 0 && write_index < write_keys.size(2),
              "draft_layer: write_keys must have nKV heads and more than write_index positions");
  float* kw = write_keys.data_ptr<float>();
  float* vw = write_values.data_ptr<float>();
  for (int64_t n = 0; n < n_kv; ++n) {
    const int64_t at = n * write_keys.stride(1) + write_index * write_keys.stride(2);
    std::copy(k.data_ptr<float>() + n * d, k.data_ptr<float>() + (n + 1) * d, kw + at);
    std::copy(v.data_ptr<float>() + n * d, v.data_ptr<float>() + (n + 1) * d, vw + at);
  }
  auto [h_out, x, weights, index] = draft_attend_route(q, keys, values, length, more_keys, more_values, more_length,
                                                       h, wo, post_norm, router, eps, scale, top_k, renormalize);
  h_out.add_(int4_glu_token(x, up_packed, up_scales, down_packed, down_scales, index[0], weights[0], up_group,
                            down_group));
  return {h_out, x, weights, index};
}

TORCH_LIBRARY_FRAGMENT(specter_native, m) {
  m.def("draft_layer(Tensor h, Tensor input_norm, Tensor wq, Tensor wk, Tensor wv, Tensor q_norm, Tensor k_norm, "
        "Tensor cos, Tensor signed_sin, int head_dim, Tensor(a!) write_keys, Tensor(b!) write_values, "
        "int write_index, Tensor keys, Tensor values, int length, Tensor more_keys, Tensor more_values, "
        "int more_length, Tensor wo, Tensor post_norm, Tensor router, float eps, float scale, int top_k, "
        "bool renormalize, Tensor up_packed, Tensor up_scales, Tensor down_packed, Tensor down_scales, int up_group, "
        "int down_group) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("draft_qkv(Tensor h, Tensor input_norm, Tensor wq, Tensor wk, Tensor wv, Tensor q_norm, Tensor k_norm, "
        "Tensor cos, Tensor signed_sin, int head_dim, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("draft_attend_route(Tensor q, Tensor keys, Tensor values, int length, Tensor more_keys, Tensor more_values, "
        "int more_length, Tensor h, Tensor wo, Tensor post_norm, Tensor router, float eps, float scale, int top_k, "
        "bool renormalize) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specter_native, CPU, m) {
  m.impl("draft_qkv", &draft_qkv);
  m.impl("draft_attend_route", &draft_attend_route);
  m.impl("draft_layer", &draft_layer);
}
