// A large host-memory copy with non-temporal (streaming) stores, for the links' expert copies on a
// CPU device. Contract (see specter/kernels/stream_copy.py): stream_copy(dst, src) copies
// src.nbytes() bytes of the contiguous src into the contiguous dst (same byte size). Streaming
// stores write the destination without first reading it into the caches, so a 12 MiB expert
// costs two passes over memory instead of three and does not evict what compute keeps cached.
#include <ATen/core/Tensor.h>
#include <torch/library.h>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#if !defined(__AVX2__)
#error "stream_copy.cpp is built with -mavx2 (specter/kernels/native.py)"
#endif

void stream_copy(at::Tensor dst, const at::Tensor& src) {
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "stream_copy: dst and src must be contiguous");
  TORCH_CHECK(dst.nbytes() == src.nbytes(), "stream_copy: dst and src must have the same byte size");
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu(), "stream_copy: dst and src must be on the CPU");
  const int64_t n = static_cast<int64_t>(src.nbytes());
  char* d = static_cast<char*>(dst.data_ptr());
  const char* s = static_cast<const char*>(src.data_ptr());
  int64_t head = (32 - static_cast<int64_t>(reinterpret_cast<uintptr_t>(d) & 31)) & 31;
  head = head < n ? head : n;
  std::memcpy(d, s, head);  // streaming stores need a 32-byte aligned destination
  int64_t i = head;
  for (; i + 128 <= n; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
  }
  _mm_sfence();  // streaming stores are weakly ordered: complete them before the copy is reported done
  std::memcpy(d + i, s + i, n - i);
}

TORCH_LIBRARY_FRAGMENT(specter_native, m) { m.def("stream_copy(Tensor(a!) dst, Tensor src) -> ()"); }

TORCH_LIBRARY_IMPL(specter_native, CPU, m) { m.impl("stream_copy", &stream_copy); }
