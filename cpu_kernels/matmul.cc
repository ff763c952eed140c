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
// A second handler (`HisparseMatmulBlocks`, up to 16 rows) reads the weights as a
// GGUF file's Q4_1 or Q8_0 blocks and dequantizes each A tile just before its
// product (`Blocks`): a third of the bytes, bit-equal to the bf16 weights' product.
//
// Without AMX (or with `amx` 0), up to 16 rows run on AVX-512 instead
// (`AvxFewRows`): each output's dot product in float32 fused multiply-adds, 16
// inputs per lane, bf16 weights or blocks dequantized to the same bf16 values, so
// that those two are bit-equal to each other (not to XLA's, which sums in another
// order). More rows there are XLA's (`ops.matmul_unsupported`).
//
// Same function as cpu_kernels/reference.py's `matmul` (of blocks.dequantize's
// weights for the second).
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

// Where FewRows finds its A tiles (16 weight rows x 32 inputs, bf16 pairs along the
// input): `Tile(n0, c, buf)` is the tile of output rows n0.. and input chunk c,
// `stride` its rows' distance in bytes.
//
// Bf16Rows: weights [N, K] read where they lie.
struct Bf16Rows {
  const uint16_t* w;
  int64_t K, stride;
  Bf16Rows(const uint16_t* w, int64_t K) : w(w), K(K), stride(K * 2) {}
  const uint16_t* Tile(int64_t n0, int64_t c, uint16_t*) const { return w + n0 * K + c * 32; }
};

// One row of 32 bf16, float32 lanes rounded to the nearest even (as numpy's and
// ml_dtypes' casts round). The instruction reads subnormal inputs as zero; none
// arises here: a block's weights are multiples of its f16 scales' 2^-24 steps.
inline void StoreBf16Row(uint16_t* row, __m512 lo, __m512 hi) {
  _mm512_store_si512(row, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// Blocks: a GGUF file's 32-weight blocks, laid out in tiles by cpu_kernels/blocks.py
// (codes [N / 16, K / 32, R, 32 bytes], scales f16 [N / 16, K / 32, kScales, 16
// rows]) and dequantized one tile at a time into `buf` as the GGUF loader does it
// (float32, then rounded to bf16): Q4_1 (kCodes 16: R 8 row pairs, byte k holding
// weight k of the first row in its low nibble and of the second in its high one;
// weight = d * code + m, scales d then m) or Q8_0 (kCodes 32: R 16 rows; weight = d
// * the signed byte). d * q is exact in float32 (an f16 times at most 8 bits), so
// the fused multiply-add rounds once, as numpy's d * q + m does.
template <int kCodes>
struct Blocks {
  static constexpr int kScales = kCodes == 16 ? 2 : 1;
  const uint8_t* codes;
  const uint16_t* scales;
  int64_t chunks, stride = 64;
  const uint16_t* Tile(int64_t n0, int64_t c, uint16_t* buf) const {
    const int64_t t = n0 / 16 * chunks + c;
    const uint8_t* q = codes + t * 16 * kCodes;
    const uint16_t* sc = scales + t * kScales * 16;
    alignas(64) float d[16], m[16];
    _mm512_store_ps(d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc))));
    if (kScales == 2)
      _mm512_store_ps(m, _mm512_cvtph_ps(
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 16))));
    if constexpr (kCodes == 16) {
      // a row pair: each row's 16 possible values, as one table of 32 bf16 looked up
      // by the codes (+16 for the second row)
      const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      for (int r = 0; r < 16; r += 2) {
        const __m512 v0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(d[r]), _mm512_set1_ps(m[r]));
        const __m512 v1 = _mm512_fmadd_ps(iota, _mm512_set1_ps(d[r + 1]), _mm512_set1_ps(m[r + 1]));
        const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);
        const __m512i b = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * 16)));
        const __m512i first = _mm512_and_si512(b, _mm512_set1_epi16(15));
        const __m512i second = _mm512_or_si512(_mm512_srli_epi16(b, 4), _mm512_set1_epi16(16));
        _mm512_store_si512(buf + r * 32, _mm512_permutexvar_epi16(first, table));
        _mm512_store_si512(buf + r * 32 + 32, _mm512_permutexvar_epi16(second, table));
      }
    } else {
      for (int r = 0; r < 16; ++r) {
        const __m512 dr = _mm512_set1_ps(d[r]);
        const __m128i* row = reinterpret_cast<const __m128i*>(q + r * 32);
        const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row))), dr);
        const __m512 hi =
            _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row + 1))), dr);
        StoreBf16Row(buf + r * 32, lo, hi);
      }
    }
    return buf;
  }
};

// Up to 16 rows (a decode step's): units of 64 outputs, four C tiles. The weights
// come from `src` (Bf16Rows or Blocks): the same tile products in the same order
// either way, so that a product of blocks is bit-equal to one of their bf16 values.
template <typename Src>
void FewRows(ffi::ThreadPool& pool, const Shapes& s, const uint32_t* xpairs, const Src& src,
             float* out) {
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
    alignas(64) uint16_t buf[4][16 * 32];  // Blocks' dequantized tiles
    const int64_t stride = src.stride;
    for (int64_t c = 0; c < chunks; ++c) {
      _tile_loadd(7, xt.data() + c * 16 * M, M * 4);
      _tile_loadd(4, src.Tile(n0, c, buf[0]), stride);
      _tile_dpbf16ps(0, 4, 7);
      if (tiles > 1) {
        _tile_loadd(4, src.Tile(n0 + 16, c, buf[1]), stride);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (tiles > 2) {
        _tile_loadd(4, src.Tile(n0 + 32, c, buf[2]), stride);
        _tile_dpbf16ps(2, 4, 7);
      }
      if (tiles > 3) {
        _tile_loadd(4, src.Tile(n0 + 48, c, buf[3]), stride);
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

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define HISPARSE_AVX512 1
// 16 bf16 (bits in 16-bit lanes) -> 16 floats.
inline __m512 Bf16x16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// 16 floats rounded to the nearest bf16 (ties to even, as numpy's and ml_dtypes'
// casts round), as floats. Integer arithmetic: no AVX512-BF16 here. Weights only:
// finite, so the carry into the exponent is the right rounding.
inline __m512 RoundToBf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// Where AvxFewRows finds two weight rows' 32 inputs of chunk c as floats
// (`Pair(n, c, w)`: w[0], w[1] inputs 0-15 and 16-31 of row n, w[2], w[3] of row
// n + 1; n even), with the values of Bf16Rows / Blocks above.
struct AvxBf16Rows {
  const uint16_t* w;
  int64_t K;
  void Pair(int64_t n, int64_t c, __m512 out[4]) const {
    for (int j = 0; j < 2; ++j) {
      const __m256i* p = reinterpret_cast<const __m256i*>(w + (n + j) * K + c * 32);
      out[2 * j] = Bf16x16(_mm256_loadu_si256(p));
      out[2 * j + 1] = Bf16x16(_mm256_loadu_si256(p + 1));
    }
  }
};

template <int kCodes>
struct AvxBlocks {
  static constexpr int kScales = kCodes == 16 ? 2 : 1;
  const uint8_t* codes;
  const uint16_t* scales;
  int64_t chunks;
  void Pair(int64_t n, int64_t c, __m512 out[4]) const {
    const int64_t t = n / 16 * chunks + c, r = n % 16;
    const uint16_t* sc = scales + t * kScales * 16 + r;
    if constexpr (kCodes == 16) {
      // each row's 16 values (d * code + m, rounded to bf16) as a table that the
      // codes index (vpermps reads an index's low 4 bits: the first row's nibble)
      const uint8_t* q = codes + t * 16 * kCodes + r / 2 * 32;
      const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512 t0 = RoundToBf16(_mm512_fmadd_ps(iota, _mm512_set1_ps(_cvtsh_ss(sc[0])),
                                                    _mm512_set1_ps(_cvtsh_ss(sc[16]))));
      const __m512 t1 = RoundToBf16(_mm512_fmadd_ps(iota, _mm512_set1_ps(_cvtsh_ss(sc[1])),
                                                    _mm512_set1_ps(_cvtsh_ss(sc[17]))));
      for (int h = 0; h < 2; ++h) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h)));
        out[h] = _mm512_permutexvar_ps(b, t0);
        out[2 + h] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), t1);
      }
    } else {
      for (int j = 0; j < 2; ++j) {
        const uint8_t* q = codes + t * 16 * kCodes + (r + j) * 32;
        const __m512 d = _mm512_set1_ps(_cvtsh_ss(sc[j]));
        for (int h = 0; h < 2; ++h) {
          const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h)));
          out[2 * j + h] = RoundToBf16(_mm512_mul_ps(_mm512_cvtepi32_ps(b), d));
        }
      }
    }
  }
};

// Up to 16 rows on AVX-512: units of 16 outputs; in each, 4 outputs by up to 4 rows
// at a time in 16 accumulators, each lane summing every 16th input of its dot
// product down the input, then the lanes summed. A row's result never depends on
// the other rows.
template <typename Src>
void AvxFewRows(ffi::ThreadPool& pool, int64_t M, int64_t K, int64_t N, const uint16_t* x,
                const Src& src, float* out) {
  std::vector<float> xf(M * K);  // x as floats
  for (int64_t i = 0; i < M * K; i += 16)
    _mm512_storeu_ps(&xf[i], Bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i))));
  const int64_t chunks = K / 32;
  ParallelFor(pool, N / 16, [&](int64_t u) {
    for (int64_t n0 = u * 16; n0 < u * 16 + 16; n0 += 4) {
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int64_t rows = std::min<int64_t>(4, M - m0);
        __m512 acc[4][4];
        for (auto& a : acc)
          for (auto& b : a) b = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c) {
          __m512 w[8];  // rows n0..n0+3: inputs 0-15 and 16-31 of each
          src.Pair(n0, c, w);
          src.Pair(n0 + 2, c, w + 4);
          for (int64_t i = 0; i < rows; ++i) {
            const __m512 x0 = _mm512_loadu_ps(&xf[(m0 + i) * K + c * 32]);
            const __m512 x1 = _mm512_loadu_ps(&xf[(m0 + i) * K + c * 32 + 16]);
            for (int j = 0; j < 4; ++j)
              acc[i][j] = _mm512_fmadd_ps(w[2 * j + 1], x1, _mm512_fmadd_ps(w[2 * j], x0, acc[i][j]));
          }
        }
        for (int64_t i = 0; i < rows; ++i)
          for (int j = 0; j < 4; ++j) out[(m0 + i) * N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]);
      }
    }
  });
}
#else
#define HISPARSE_AVX512 0
#endif

// Whether the AMX path runs: built with it, asked for (`amx`), and granted.

// x [M, K] bf16, w [L, N, K] bf16, layer s32[] -> y [M, N] f32: y = x w[layer]^T.
// amx 0: the AVX-512 path even where AMX runs (tests).
ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, int32_t amx) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3)
    return ffi::Error::InvalidArgument("hisparse matmul: x [M, K] and w [L, N, K]");
  const int64_t M = xd[0], K = xd[1], N = wd[1], L = wd[0];
  if (wd[2] != K || M < 1 || K % 32 || N % 16)
    return ffi::Error::InvalidArgument(
        "hisparse matmul: shapes (M >= 1, K % 32 == 0, N % 16 == 0)");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("hisparse matmul: layer out of range");
  const uint16_t* wl = reinterpret_cast<const uint16_t*>(w.typed_data()) + l * N * K;
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.typed_data());
  if (UseAmx(amx)) {
#if HISPARSE_AMX
    const Shapes s{M, K, N};
    const uint32_t* xpairs = reinterpret_cast<const uint32_t*>(xb);
    if (M <= kGroup)
      FewRows(pool, s, xpairs, Bf16Rows(wl, K), y->typed_data());
    else
      ManyRows(pool, s, xpairs, wl, y->typed_data());
    return ffi::Error::Success();
#endif
  }
#if HISPARSE_AVX512
  if (M <= kGroup) {
    AvxFewRows(pool, M, K, N, xb, AvxBf16Rows{wl, K}, y->typed_data());
    return ffi::Error::Success();
  }
#endif
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "hisparse matmul: more than 16 rows need AMX-BF16 (granted), and fewer AVX-512");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("amx"));

namespace {

// x [M, K] bf16 (M <= 16), codes u8 [L, N / 16, K / 32, R, 32], scales f16 [L, N / 16,
// K / 32, S, 16], layer s32[] -> y [M, N] f32: y = x w[layer]^T for the weights
// those blocks hold (R 8 and S 2: Q4_1; R 16 and S 1: Q8_0; see Blocks).
ffi::Error MatmulBlocksImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x,
                            ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F16> scales,
                            ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y,
                            int32_t amx) {
  auto xd = x.dimensions();
  auto cd = codes.dimensions();
  auto sd = scales.dimensions();
  if (xd.size() != 2 || cd.size() != 5 || sd.size() != 5)
    return ffi::Error::InvalidArgument(
        "hisparse matmul_blocks: x [M, K], codes [L, N/16, K/32, R, 32], scales [L, N/16, K/32, S, 16]");
  const int64_t L = cd[0], M = xd[0], K = xd[1], N = cd[1] * 16;
  const bool q4_1 = cd[3] == 8 && sd[3] == 2, q8_0 = cd[3] == 16 && sd[3] == 1;
  if (!(q4_1 || q8_0) || M < 1 || M > kGroup || cd[2] * 32 != K || cd[4] != 32 ||
      sd[0] != L || sd[1] != cd[1] || sd[2] != cd[2] || sd[4] != 16)
    return ffi::Error::InvalidArgument(
        "hisparse matmul_blocks: shapes (1 to 16 rows, Q4_1 or Q8_0 tiles of x's inputs)");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= L)
    return ffi::Error::InvalidArgument("hisparse matmul_blocks: layer out of range");
  const int64_t tiles = cd[1] * cd[2];
  const uint8_t* c = codes.typed_data() + l * tiles * cd[3] * 32;
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales.typed_data()) + l * tiles * sd[3] * 16;
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.typed_data());
  if (UseAmx(amx)) {
#if HISPARSE_AMX
    const Shapes s{M, K, N};
    const uint32_t* xpairs = reinterpret_cast<const uint32_t*>(xb);
    if (q4_1)
      FewRows(pool, s, xpairs, Blocks<16>{c, sc, cd[2]}, y->typed_data());
    else
      FewRows(pool, s, xpairs, Blocks<32>{c, sc, cd[2]}, y->typed_data());
    return ffi::Error::Success();
#endif
  }
#if HISPARSE_AVX512
  if (q4_1)
    AvxFewRows(pool, M, K, N, xb, AvxBlocks<16>{c, sc, cd[2]}, y->typed_data());
  else
    AvxFewRows(pool, M, K, N, xb, AvxBlocks<32>{c, sc, cd[2]}, y->typed_data());
  return ffi::Error::Success();
#else
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "hisparse matmul_blocks: built for a CPU without AMX-BF16 or AVX-512");
#endif
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseMatmulBlocks, MatmulBlocksImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("amx"));

// 1 where the weight products' kernels run: AMX-BF16 granted, or AVX-512 (up to 16
// rows).
extern "C" int HisparseProductsReady() {
  return UseAmx(1) || HISPARSE_AVX512;
}
