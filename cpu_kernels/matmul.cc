// The model's weight products on the CPU, on Intel AMX tiles, as an XLA FFI
// handler: y = x w[layer]^T for rows x (a decode step's tokens, or a short
// prefill block's) and one layer of stacked weights, read in place.
//
// Inside the model's layer loop XLA:CPU copies each layer's weights out of the
// stacked array before its dot (a dynamic slice: about a third of a short
// prompt's prefill), and its small-row products stream the weights slowly; this
// reads the layer where it lies, stored [out, in], 16 output rows per tile
// streaming along the input (a decode step's: 2.4-2.9x XLA's loop here,
// benchmarks/weight_products.py).
//
// y^T = w x^T on tiles: A = 16 weight rows x 32 inputs (as stored: bf16 pairs along
// the input), B = x^T packed once per call as 16 input pairs x up to 16 rows, C =
// 16 outputs x those rows in float32. Up to 16 rows (`FewRows`), four A tiles
// share one B; more rows (`ManyRows`) go 16 at a time, two A by two B. Either
// way each output is its own dot product over the input, 32 inputs at a time in
// one order, whatever M is, so a row's result never depends on the others.
//
// Same function as cpu_kernels/reference.py's `matmul`.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"

namespace ffi = xla::ffi;

namespace {

using namespace hisparse_cpu;  // NOLINT

constexpr int64_t kGroup = 16;  // x's rows per C tile: its columns

#if HISPARSE_AMX
struct Shapes {
  int64_t M, K, N;
};

// Up to 16 rows (a decode step's): units of 64 outputs, four C tiles.
void FewRows(ffi::ThreadPool& pool, const Shapes& s, const uint32_t* xpairs,
             const uint16_t* wl, float* out) {
  constexpr int64_t kUnitRows = 64;
  const int64_t M = s.M, K = s.K, N = s.N;
  // x^T as B tiles [K / 32][16 input pairs][M] of (x[m][2j], x[m][2j+1])
  const int64_t chunks = K / 32;
  std::vector<uint32_t> xt(chunks * 16 * M);
  for (int64_t j = 0; j < K / 2; ++j)
    for (int64_t m = 0; m < M; ++m) xt[j * M + m] = xpairs[m * (K / 2) + j];
  const int64_t units = (N + kUnitRows - 1) / kUnitRows;
  ParallelFor(pool, units, [&](int64_t u) {
    const int64_t n0 = u * kUnitRows, tiles = std::min<int64_t>(4, (N - n0) / 16);
    TileConfig cfg;  // 0-3: C (16 outputs x M), 4: A (16 weight rows x 32 inputs), 7: B
    for (int t : {0, 1, 2, 3, 7}) cfg.colsb[t] = static_cast<uint16_t>(M * 4);
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* a = wl + n0 * K;
    const int64_t stride = K * 2;
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(7, xt.data() + c * 16 * M, M * 4);
      _tile_loadd(4, a + c * 32, stride);
      _tile_dpbf16ps(0, 4, 7);
      if (tiles > 1) {
        _tile_loadd(4, a + 16 * K + c * 32, stride);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (tiles > 2) {
        _tile_loadd(4, a + 32 * K + c * 32, stride);
        _tile_dpbf16ps(2, 4, 7);
      }
      if (tiles > 3) {
        _tile_loadd(4, a + 48 * K + c * 32, stride);
        _tile_dpbf16ps(3, 4, 7);
      }
    }
    alignas(64) float acc[4][16][kGroup];
    _tile_stored(0, acc[0], sizeof(acc[0][0]));
    _tile_stored(1, acc[1], sizeof(acc[0][0]));
    _tile_stored(2, acc[2], sizeof(acc[0][0]));
    _tile_stored(3, acc[3], sizeof(acc[0][0]));
    _tile_release();
    for (int64_t t = 0; t < tiles; ++t)
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t m = 0; m < M; ++m) out[m * N + n0 + t * 16 + r] = acc[t][r][m];
  });
}

// r[i] = row i of a 16 x 16 matrix of 32-bit values, transposed in place: unpacks
// within 128-bit lanes, then lane shuffles.
inline void Transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  __m512i u[16];  // u[4a + b], lane L: column 4L + b of rows 4a..4a+3
  for (int a = 0; a < 16; a += 4) {
    u[a] = _mm512_unpacklo_epi64(t[a], t[a + 2]);
    u[a + 1] = _mm512_unpackhi_epi64(t[a], t[a + 2]);
    u[a + 2] = _mm512_unpacklo_epi64(t[a + 1], t[a + 3]);
    u[a + 3] = _mm512_unpackhi_epi64(t[a + 1], t[a + 3]);
  }
  for (int b = 0; b < 4; ++b) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0x88);
    const __m512i x1 = _mm512_shuffle_i32x4(u[b], u[4 + b], 0xDD);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0x88);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + b], u[12 + b], 0xDD);
    r[b] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[8 + b] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[4 + b] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + b] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// More rows: groups of 16; units of 32 outputs x up to 64 rows, two row groups at a
// time, so that each A and B tile loaded serves two products.
void ManyRows(ffi::ThreadPool& pool, const Shapes& s, const uint32_t* xpairs,
              const uint16_t* wl, float* out) {
  constexpr int64_t kUnitRows = 32, kUnitGroups = 4;
  const int64_t M = s.M, K = s.K, N = s.N;
  // x^T as B tiles [K / 32][16 input pairs][Mp], its rows padded to whole groups
  // with zeros (their columns are computed, never stored)
  const int64_t chunks = K / 32, groups = (M + kGroup - 1) / kGroup, Mp = groups * kGroup;
  std::vector<uint32_t> xt(chunks * 16 * Mp);
  ParallelFor(pool, groups * chunks, [&](int64_t u) {
    const int64_t g = u / chunks, c = u % chunks;
    __m512i r[16];
    for (int64_t m = 0; m < 16; ++m)
      r[m] = g * kGroup + m < M ? _mm512_loadu_si512(xpairs + (g * kGroup + m) * (K / 2) + c * 16)
                                : _mm512_setzero_si512();
    Transpose16(r);
    for (int64_t j = 0; j < 16; ++j) _mm512_storeu_si512(&xt[(c * 16 + j) * Mp + g * kGroup], r[j]);
  });
  const int64_t units = (N + kUnitRows - 1) / kUnitRows;
  const int64_t blocks = (groups + kUnitGroups - 1) / kUnitGroups;
  ParallelFor(pool, units * blocks, [&](int64_t u) {
    const int64_t n0 = u / blocks * kUnitRows;
    const bool two = N - n0 >= 32;
    const int64_t g_end = std::min(groups, (u % blocks + 1) * kUnitGroups);
    const TileConfig cfg;  // C: 0 (out 0, rows 0), 1 (out 1, rows 0), 2 (out 0, rows 1),
                           // 3 (out 1, rows 1); A (16 weight rows x 32 inputs): 4, 5; B: 6, 7
    _tile_loadconfig(&cfg);
    const uint16_t* a = wl + n0 * K;
    const int64_t stride = K * 2;
    for (int64_t g = u % blocks * kUnitGroups; g < g_end; g += 2) {
      const bool pair = g + 1 < g_end;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t c = 0; c < chunks; ++c) {
        const uint32_t* b = xt.data() + c * 16 * Mp + g * kGroup;
        _tile_loadd(6, b, Mp * 4);
        _tile_loadd(4, a + c * 32, stride);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
          _tile_loadd(5, a + 16 * K + c * 32, stride);
          _tile_dpbf16ps(1, 5, 6);
        }
        if (pair) {
          _tile_loadd(7, b + kGroup, Mp * 4);
          _tile_dpbf16ps(2, 4, 7);
          if (two) _tile_dpbf16ps(3, 5, 7);
        }
      }
      alignas(64) float acc[4][16][kGroup];  // [C tile][output][row]
      _tile_stored(0, acc[0], 64);
      _tile_stored(1, acc[1], 64);
      _tile_stored(2, acc[2], 64);
      _tile_stored(3, acc[3], 64);
      for (int t = 0; t < 4; ++t) {
        const int64_t g_t = g + t / 2, out_t = t % 2;
        if ((out_t && !two) || (g_t > g && !pair)) continue;
        const int64_t rows = std::min<int64_t>(kGroup, M - g_t * kGroup);
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(acc[t][i]);
        Transpose16(r);  // [row][output]
        for (int64_t m = 0; m < rows; ++m)
          _mm512_storeu_si512(out + (g_t * kGroup + m) * N + n0 + out_t * 16, r[m]);
      }
    }
    _tile_release();
  });
}
#endif  // HISPARSE_AMX

// x [M, K] bf16, w [L, N, K] bf16, layer s32[] -> y [M, N] f32: y = x w[layer]^T.
ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
#if !HISPARSE_AMX
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "hisparse matmul: built for a CPU without AMX-BF16");
#else
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3)
    return ffi::Error::InvalidArgument("hisparse matmul: x [M, K] and w [L, N, K]");
  const Shapes s{xd[0], xd[1], wd[1]};
  const int64_t L = wd[0];
  if (wd[2] != s.K || s.M < 1 || s.K % 32 || s.N % 16)
    return ffi::Error::InvalidArgument(
        "hisparse matmul: shapes (M >= 1, K % 32 == 0, N % 16 == 0)");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("hisparse matmul: layer out of range");
  if (!AmxReady())
    return ffi::Error(ffi::ErrorCode::kUnavailable,
                      "hisparse matmul: the kernel refused AMX's tile state");
  const uint16_t* wl = reinterpret_cast<const uint16_t*>(w.typed_data()) + l * s.N * s.K;
  const uint32_t* xpairs = reinterpret_cast<const uint32_t*>(x.typed_data());
  if (s.M <= kGroup)
    FewRows(pool, s, xpairs, wl, y->typed_data());
  else
    ManyRows(pool, s, xpairs, wl, y->typed_data());
  return ffi::Error::Success();
#endif
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
