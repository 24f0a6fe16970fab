// A large host-memory copy with non-temporal (streaming) stores, for the links' expert copies on a
// CPU device. Contract (see specter/memory/stream_copy.py): stream_copy(dsts, srcs) copies each
// contiguous src's nbytes() bytes into its contiguous dst (same byte size), one after another, in
// one call (a copy thread takes Python's lock back once, not once a tensor). Streaming
// stores write the destination without first reading it into the caches, so a 12 MiB expert
// costs two passes over memory instead of three and does not evict what compute keeps cached.
// paced_copy(dsts, srcs, seconds) does the same copies, one tensor after another, in PACE_PIECE
// pieces spread over `seconds` from the call: each piece starts no earlier than its offset's share
// of all the bytes times `seconds` (at once when behind), so an emulated link's copy draws on
// memory at the link's rate instead of in one burst.
// A piece on time uses ordinary stores: at a link's rate the extra read of each destination line
// costs little, and the expert lands in the caches just before the verification wave that awaits
// it reads it; a piece behind time (a link faster than memcpy) streams. It holds no Python lock
// (a dispatcher op called from Python runs without the GIL).
#include <ATen/core/Tensor.h>
#include <torch/library.h>
#include <cstdint>
#include <chrono>
#include <cstring>
#include <thread>
#include <immintrin.h>
#if !defined(__AVX2__)
#error "stream_copy.cpp is built with -mavx2 (specter/native/__init__.py)"
#endif

namespace {

constexpr int64_t PACE_PIECE = 256 * 1024;

void check_pair(const at::Tensor& dst, const at::Tensor& src, const char* op) {
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), op, ": dst and src must be contiguous");
  TORCH_CHECK(dst.nbytes() == src.nbytes(), op, ": dst and src must have the same byte size");
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu(), op, ": dst and src must be on the CPU");
}

void stream_bytes(char* d, const char* s, int64_t n) {
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

}  // namespace

void stream_copy(at::TensorList dst, at::TensorList src) {
  TORCH_CHECK(dst.size() == src.size(), "stream_copy: as many destinations as sources");
  for (size_t t = 0; t < src.size(); ++t) check_pair(dst[t], src[t], "stream_copy");
  for (size_t t = 0; t < src.size(); ++t)
    stream_bytes(static_cast<char*>(dst[t].data_ptr()), static_cast<const char*>(src[t].data_ptr()),
                 static_cast<int64_t>(src[t].nbytes()));
}

void paced_copy(at::TensorList dst, at::TensorList src, double seconds) {
  TORCH_CHECK(dst.size() == src.size(), "paced_copy: as many destinations as sources");
  TORCH_CHECK(seconds >= 0.0, "paced_copy: seconds must be >= 0");
  int64_t total = 0;
  for (size_t t = 0; t < src.size(); ++t) {
    check_pair(dst[t], src[t], "paced_copy");
    total += static_cast<int64_t>(src[t].nbytes());
  }
  const auto start = std::chrono::steady_clock::now();
  int64_t before = 0;  // bytes of the tensors already copied
  for (size_t t = 0; t < src.size(); ++t) {
    const int64_t n = static_cast<int64_t>(src[t].nbytes());
    char* d = static_cast<char*>(dst[t].data_ptr());
    const char* s = static_cast<const char*>(src[t].data_ptr());
    for (int64_t done = 0; done < n; done += PACE_PIECE) {
      const int64_t piece = n - done < PACE_PIECE ? n - done : PACE_PIECE;
      const double share = static_cast<double>(before + done) / static_cast<double>(total);
      const auto due = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                   std::chrono::duration<double>(seconds * share));
      if (std::chrono::steady_clock::now() < due) {
        std::this_thread::sleep_until(due);
        std::memcpy(d + done, s + done, piece);
      } else {
        stream_bytes(d + done, s + done, piece);  // behind (a link faster than memcpy): the fastest copy
      }
    }
    before += n;
  }
}

TORCH_LIBRARY_FRAGMENT(specter_native, m) {
  m.def("stream_copy(Tensor(a!)[] dst, Tensor[] src) -> ()");
  m.def("paced_copy(Tensor(a!)[] dst, Tensor[] src, float seconds) -> ()");
}

TORCH_LIBRARY_IMPL(specter_native, CPU, m) {
  m.impl("stream_copy", &stream_copy);
  m.impl("paced_copy", &paced_copy);
}
