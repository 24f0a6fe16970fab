// The blocked layout's rows kernel (blocked_rows.cpp), for the other kernels that read experts stored
// blocked (glu_expert_pairs in grouped_rows.cpp): rows start .. end of x [P, k] times one weight
// [n, k] stored as [n / 16, k, 16] (n % 16 == 0), into out [P, n]; the same arguments as
// grouped_rows.cpp's rows_times_weight, each output one float32 FMA chain over k in order.
#pragma once
#include <cstdint>

namespace specter_blocked {

void rows_times_blocked(const float* xp, int64_t start, int64_t end, const float* wb, int64_t n, int64_t k,
                        float* op);

}  // namespace specter_blocked
