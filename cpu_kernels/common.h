// Helpers shared by the CPU kernels (sparse_decode.cc, causal_attention.cc).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace hisparse_cpu {

namespace ffi = xla::ffi;

inline float Bf16(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// body(i) for i in [0, n) on XLA's intra-op threads and the caller's. Units are
// claimed from a shared counter, and the caller waits only for units that other
// threads are running, so it never waits on a task the pool has not started (the
// caller may be the pool's only thread). A task that starts after all units are
// claimed touches only the shared counters.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, const F& body) {
  const int64_t workers = std::min<int64_t>(pool.num_threads(), n);
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  struct Counters {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto counters = std::make_shared<Counters>();
  auto run = [counters, n, &body] {
    for (int64_t i; (i = counters->next.fetch_add(1)) < n;) {
      body(i);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t w = 1; w < workers; ++w) pool.Schedule([run] { run(); });
  run();
  while (counters->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

#if defined(__AVX512F__)
// exp on 16 lanes (Cephes' polynomial, ~1 ulp); -inf -> 0, NaN stays NaN.
inline __m512 Exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-110.f), x);  // NaN in x is returned as x
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX512F__)
// 16 bf16 -> f32.
inline __m512 Bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

}  // namespace hisparse_cpu
