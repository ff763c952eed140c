// Helpers shared by the CPU kernels (sparse_decode.cc, selection.cc,
// causal_attention.cc, matmul.cc).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HISPARSE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define HISPARSE_AMX 0
#endif

#include "xla/ffi/api/ffi.h"

namespace hisparse_cpu {

namespace ffi = xla::ffi;

// The kernels' fixed buffers (build.unsupported says so to callers).
constexpr int64_t kMaxDim = 256;   // head_dim
constexpr int64_t kMaxGroup = 16;  // query heads per KV head
constexpr float kInt4Step = static_cast<float>(2.0 / 15.0);  // int4 codes: INT4_LEVELS = 15

inline float Bf16(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

#if HISPARSE_AMX
// Linux gives a process AMX's tile state only when asked (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); the grant covers all its threads.
inline bool AmxReady() {
  static const bool ready = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ready;
}

// An AMX tile configuration: eight tiles of 16 rows x 64 bytes unless changed.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = 16;
  }
};
#endif

// A kernel's AMX path runs: built with AMX-BF16, asked for (`amx`, the handlers'
// attribute: 0 takes the AVX-512 path, which AMX CPUs have too), and granted.
inline bool UseAmx(int32_t amx) {
#if HISPARSE_AMX
  return amx && AmxReady();
#else
  return false;
#endif
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
// 2^x on 16 lanes for x <= 0 (Cephes' exp2f polynomial on the fraction in
// [-0.5, 0.5], ~2e-7 relative): for scores kept in log2 units, it saves Exp16's
// multiply and its two-step range reduction (causal_attention.cc). Without
// `clamp` x must not be -inf (a masked score is); a very negative x gives 0, NaN
// stays NaN.
template <bool clamp>
inline __m512 Exp2x16(__m512 x) {
  if (clamp) x = _mm512_max_ps(_mm512_set1_ps(-200.f), x);  // NaN in x is returned as x
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
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

// e4m3fn bits -> f32, exactly.
struct E4m3Table {
  float v[256];
  E4m3Table() {
    for (int b = 0; b < 256; ++b) {
      const int sign = b >> 7, e = (b >> 3) & 0xF, m = b & 7;
      float x;
      if (e == 15 && m == 7) x = std::numeric_limits<float>::quiet_NaN();
      else if (e == 0) x = std::ldexp(m / 8.0f, -6);
      else x = std::ldexp(1.0f + m / 8.0f, e - 7);
      v[b] = sign ? -x : x;
    }
  }
};
inline const E4m3Table kE4m3;

// A layer of a pool laid out [L, H, P, ...]: the element offset of page `id`
// of head `h`, its ids clamped as XLA's gathers clamp them.
struct Pool {
  int64_t layer, H, P, per_page;
  int64_t Page(int64_t h, int64_t id) const {
    id = std::min<int64_t>(std::max<int64_t>(id, 0), P - 1);
    return ((layer * H + h) * P + id) * per_page;
  }
};

inline Pool MakePool(ffi::Span<const int64_t> dims, int32_t layer) {
  int64_t per_page = 1;
  for (size_t i = 3; i < dims.size(); ++i) per_page *= dims[i];
  const int64_t L = dims[0];
  return Pool{std::min<int64_t>(std::max<int64_t>(layer, 0), L - 1), dims[1], dims[2], per_page};
}

#if defined(__AVX512F__)
// 16 e4m3fn bytes -> f32 (exact): normals by moving the bits, subnormals by
// scaling their mantissa, 0x7F / 0xFF -> NaN.
inline __m512 E4m3x16(const uint8_t* bytes) {
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m512i em = _mm512_and_si512(x, _mm512_set1_epi32(0x7F));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  __m512i bits = _mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23));
  const __mmask16 sub = _mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(8));
  const __m512 subv = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(1.0f / 512));
  bits = _mm512_mask_mov_epi32(bits, sub, _mm512_castps_si512(subv));
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7F)),
                               _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(_mm512_or_si512(bits, sign));
}

// log on 16 lanes (Cephes' polynomial, ~1 ulp); 0 -> -inf, inf -> inf, NaN and
// negative -> NaN.
inline __m512 Log16(__m512 x) {
  __m512 e = _mm512_getexp_ps(x);
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_nan);  // [1, 2)
  const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));  // m in [sqrt(1/2), sqrt(2))
  e = _mm512_mask_add_ps(e, big, e, _mm512_set1_ps(1.f));
  const __m512 r = _mm512_sub_ps(m, _mm512_set1_ps(1.f));
  const __m512 z = _mm512_mul_ps(r, r);
  __m512 p = _mm512_set1_ps(7.0376836292e-2f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(-1.1514610310e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.1676998740e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(-1.2420140846e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.4249322787e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(-1.6668057665e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.0000714765e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(-2.4999993993e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(3.3333331174e-1f));
  __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, r), z);
  y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
  y = _mm512_fnmadd_ps(z, _mm512_set1_ps(0.5f), y);
  __m512 out = _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), _mm512_add_ps(r, y));
  const float inf = std::numeric_limits<float>::infinity();
  out = _mm512_mask_mov_ps(out, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_EQ_OQ),
                           _mm512_set1_ps(-inf));
  out = _mm512_mask_mov_ps(out, _mm512_cmp_ps_mask(x, _mm512_set1_ps(inf), _CMP_EQ_OQ),
                           _mm512_set1_ps(inf));
  return _mm512_mask_mov_ps(out, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NGE_UQ),
                            _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}

#endif

// The softmax's shift for x[0, n): the max, NaN if any is NaN, 0 if none is finite.
inline float SoftmaxShift(const float* x, int64_t n) {
  const float inf = std::numeric_limits<float>::infinity();
  float mx = -inf;
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vmax = _mm512_set1_ps(-inf);
  __mmask16 unordered = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vmax = _mm512_max_ps(vmax, v);
  }
  mx = _mm512_reduce_max_ps(vmax);
  nan = unordered != 0;
#endif
  for (; i < n; ++i) {
    nan |= std::isnan(x[i]);
    mx = x[i] > mx ? x[i] : mx;
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : (std::isfinite(mx) ? mx : 0.f);
}

// sum of x[0, n).
inline float Sum(const float* x, int64_t n) {
  float s = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(x + i));
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) s += x[i];
  return s;
}

// p[i] = exp(x[i] - m) for i < n.
inline void ExpShifted(const float* x, float m, int64_t n, float* p) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(p + i, Exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(m))));
  if (i < n) {
    const __mmask16 live = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(p + i, live, Exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, x + i),
                                                           _mm512_set1_ps(m))));
    i = n;
  }
#endif
  for (; i < n; ++i) p[i] = std::exp(x[i] - m);
}

}  // namespace hisparse_cpu
