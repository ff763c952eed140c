// Exact causal attention for a prompt's prefill on the CPU, on Intel AMX tiles or,
// without them, in AVX-512 float32 multiply-adds (`AvxQueryTile`), as an XLA FFI
// handler.
//
// XLA:CPU runs the prefill's attention as float32 products of whole blocks,
// writing every score out and reading it back for the softmax. This kernel keeps
// a block of 64 keys x 16 queries in cache and runs both products on AMX's bf16
// tiles, keeping float32's precision by splitting: the scaled queries into three
// bf16 terms (hi + mid + lo, float32's 24 bits) and the probabilities into two
// (16 bits); keys and values are bf16 already, so every product is exact and
// sums in float32.
//
// The queries are scaled by log2(e) as well, so that the softmax runs on 2^x, the
// cheaper function (its vector work, not the tiles, sets this kernel's pace).
//
// A key block of one head takes 40 tile products, 26 tile loads and 8 stores; at
// this machine's slow moments the loads stop overlapping the products and those
// set the pace (benchmarks/amx_op_costs.cc). So the query heads of a KV group go
// through each key block in lockstep, its keys and values read from memory once,
// and each block's P V is summed in zeroed tiles and added to O^T in registers,
// which saves loading O^T into tiles (docs/results.md, "AMX prefill attention").
//
// Rows are keys and lanes are queries (S^T = K Q^T, O^T = V^T P^T): the online
// softmax runs down the columns with no horizontal sums, and a query's numbers
// depend on its own column alone, so it gets the same output in whatever tile
// or call it is computed (a prompt prefilled block by block or in one program).
//
// Same function as cpu_kernels/reference.py's `causal_attention`.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"

namespace ffi = xla::ffi;

namespace {

using namespace hisparse_cpu;  // NOLINT

constexpr int64_t kKeyBlock = 64;  // keys per online-softmax step: four 16-key tiles
constexpr int64_t kLockstep = 4;  // query heads of a group that share each key block

#if defined(__AVX512F__)
// A key block's online-softmax step before its probabilities, on either path: each
// query's future keys hidden in S^T (rows keys, lanes queries) when the block
// holds some, then the running maximum `m` taken over the block. Returns the new
// maximum; *corr gets 2^(m - new), which rescales the state (exactly 1 once a
// query's maximum has settled, as in most blocks).
inline __m512 BlockMax(float (*sc)[16], int64_t k0, bool diagonal, __m512i posv, __m512 m,
                       __m512* corr) {
  if (diagonal) {
    for (int64_t r = 0; r < kKeyBlock; ++r) {
      const __mmask16 future =
          _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(k0 + r)), posv);
      _mm512_mask_store_ps(sc[r], future, _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
    }
  }
  __m512 mx[4] = {m, m, m, m};  // four chains: max is exact in any order
  for (int64_t r = 0; r < kKeyBlock; r += 4)
    for (int i = 0; i < 4; ++i) mx[i] = _mm512_max_ps(mx[i], _mm512_load_ps(sc[r + i]));
  const __m512 m_new = _mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3]));
  *corr = Exp2x16<true>(_mm512_sub_ps(m, m_new));
  return m_new;
}
#endif

#if HISPARSE_AMX
// 16 floats -> bf16 bits (RNE), and those bf16 back as floats.
inline __m256i RoundBf16(__m512 x, __m512* back) {
  const __m256i bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
  *back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  return bits;
}

struct Interleave {
  alignas(64) int16_t idx[32];
  Interleave() {
    for (int c = 0; c < 16; ++c) idx[2 * c] = c, idx[2 * c + 1] = 16 + c;
  }
};
const Interleave kInterleave;

// Two keys' 16 queries, a and b, rounded to bf16 (RNE) as one VNNI row: lane c
// holds (a_c, b_c), a_c in the low half. *a_back and *b_back get those bf16 as
// floats. One conversion and one permute for both keys.
inline __m512i PairRow(__m512 a, __m512 b, __m512i interleave, __m512* a_back, __m512* b_back) {
  const __m512i row = _mm512_permutexvar_epi16(
      interleave, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
  *a_back = _mm512_castsi512_ps(_mm512_slli_epi32(row, 16));
  *b_back = _mm512_castsi512_ps(_mm512_and_si512(row, _mm512_set1_epi32(
      static_cast<int32_t>(0xFFFF0000u))));
  return row;
}

struct Shapes {
  int64_t T, Hq, Hkv, D, S, start, kend, nkb;
};


// One query head's online-softmax state over its 16 queries.
struct HeadState {
  // Q^T as B tiles: [split][32 dims][16 dim pairs][16 queries] pairs of bf16, each
  // query scaled and split into hi + mid + lo (24 bits)
  alignas(64) uint32_t qw[3][kMaxDim / 32][16][16];
  alignas(64) float acc[kMaxDim][16];  // O^T
  __m512 m, l;
};

// Query heads h0..h0+nh-1 (one KV head's) over the same 16 queries q0.., in lockstep
// over the key blocks 0.. (causal), so that each block of keys and values, read
// from memory once, serves every head from the core's cache.
void QueryTile(const Shapes& s, const float* q, const uint16_t* kh, const uint16_t* vh,
               int64_t h0, int64_t nh, int64_t q0, float sm_scale, HeadState* state,
               float* out) {
  const int64_t D = s.D, nq = std::min<int64_t>(16, s.T - q0);
  alignas(64) int32_t pos[16];  // each lane's last key; padding lanes copy the last query
  for (int64_t c = 0; c < 16; ++c)
    pos[c] = static_cast<int32_t>(std::min(s.start + q0 + std::min(c, nq - 1), s.kend - 1));
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                              5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  const __m512 scale = _mm512_set1_ps(sm_scale * 1.4426950408889634f);  // log2 units
  for (int64_t j = 0; j < nh; ++j) {
    HeadState& st = state[j];
    for (int64_t c = 0; c < 16; ++c) {
      const float* qr = q + ((q0 + std::min(c, nq - 1)) * s.Hq + h0 + j) * D;
      for (int64_t d = 0; d < D; d += 32) {
        __m512 x[2], rest[2], back;
        __m256i bits[3][2];
        for (int i = 0; i < 2; ++i) {
          x[i] = _mm512_mul_ps(_mm512_loadu_ps(qr + d + 16 * i), scale);  // as the reference
          bits[0][i] = RoundBf16(x[i], &back);
          rest[i] = _mm512_sub_ps(x[i], back);
          bits[1][i] = RoundBf16(rest[i], &back);
          bits[2][i] = RoundBf16(_mm512_sub_ps(rest[i], back), &back);
        }
        for (int t = 0; t < 3; ++t) {  // 32 dims = 16 pairs: one column of the tile
          const __m512i pairs =
              _mm512_inserti64x4(_mm512_castsi256_si512(bits[t][0]), bits[t][1], 1);
          _mm512_i32scatter_epi32(&st.qw[t][d / 32][0][c], column, pairs, 4);
        }
      }
    }
    std::memset(st.acc, 0, sizeof(float) * 16 * D);
    st.m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    st.l = _mm512_setzero_ps();
  }
  alignas(64) float sc[kKeyBlock][16];    // S^T of a key block; a PV product after
  alignas(64) uint32_t pw[2][2][16][16];  // P^T as B tiles: [hi/lo][32 keys][key pair][query]
  const __m512i posv = _mm512_load_si512(pos);
  const __m512i interleave = _mm512_load_si512(kInterleave.idx);
  const TileConfig cfg;  // eight tiles of 16 rows x 64 bytes: 0-3 accumulators, 4 A, 5-7 B
  _tile_loadconfig(&cfg);
  const int64_t blocks = pos[15] / kKeyBlock + 1;
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const int64_t k0 = kb * kKeyBlock;
    const bool diagonal = k0 + kKeyBlock - 1 > pos[0];
    for (int64_t j = 0; j < nh; ++j) {
      HeadState& st = state[j];
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t part = 0; part < D / 32; ++part) {
        _tile_loadd(5, st.qw[0][part], 64);
        _tile_loadd(6, st.qw[1][part], 64);
        _tile_loadd(7, st.qw[2][part], 64);
        const uint16_t* kr = kh + k0 * D + part * 32;
#define HISPARSE_QK(t)                              \
  _tile_loadd(4, kr + (t) * 16 * D, 2 * D);         \
  _tile_dpbf16ps(t, 4, 5);                          \
  _tile_dpbf16ps(t, 4, 6);                          \
  _tile_dpbf16ps(t, 4, 7);
        HISPARSE_QK(0) HISPARSE_QK(1) HISPARSE_QK(2) HISPARSE_QK(3)
#undef HISPARSE_QK
      }
      _tile_stored(0, sc[0], 64);
      _tile_stored(1, sc[16], 64);
      _tile_stored(2, sc[32], 64);
      _tile_stored(3, sc[48], 64);
      // online softmax down the columns
      __m512 corr;
      const __m512 m = st.m = BlockMax(sc, k0, diagonal, posv, st.m, &corr);
      const bool rescale = _mm512_cmpneq_ps_mask(corr, _mm512_set1_ps(1.f)) != 0;
      __m512 sum = _mm512_setzero_ps();
      const auto probabilities = [&](auto clamp) {
        for (int64_t r = 0; r < kKeyBlock; r += 2) {
          const __m512 p0 = Exp2x16<clamp()>(_mm512_sub_ps(_mm512_load_ps(sc[r]), m));
          const __m512 p1 = Exp2x16<clamp()>(_mm512_sub_ps(_mm512_load_ps(sc[r + 1]), m));
          sum = _mm512_add_ps(_mm512_add_ps(sum, p0), p1);
          __m512 h0, h1, unused0, unused1;
          _mm512_store_si512(pw[0][r / 32][(r % 32) / 2], PairRow(p0, p1, interleave, &h0, &h1));
          _mm512_store_si512(pw[1][r / 32][(r % 32) / 2],
                             PairRow(_mm512_sub_ps(p0, h0), _mm512_sub_ps(p1, h1), interleave,
                                     &unused0, &unused1));
        }
      };
      if (diagonal)
        probabilities(std::true_type{});
      else
        probabilities(std::false_type{});
      st.l = _mm512_add_ps(_mm512_mul_ps(st.l, corr), sum);
      // this block's P V in zeroed tiles, added to O^T (scaled first if the max moved)
      for (int64_t dc = 0; dc < D; dc += 64) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t half = 0; half < 2; ++half) {
          _tile_loadd(5, pw[0][half], 64);
          _tile_loadd(6, pw[1][half], 64);
          const uint16_t* vb = vh + ((kb * 2 + half) * D + dc) * 32;
#define HISPARSE_PV(t)                      \
  _tile_loadd(4, vb + (t) * 16 * 32, 64);   \
  _tile_dpbf16ps(t, 4, 5);                  \
  _tile_dpbf16ps(t, 4, 6);
          HISPARSE_PV(0) HISPARSE_PV(1) HISPARSE_PV(2) HISPARSE_PV(3)
#undef HISPARSE_PV
        }
        _tile_stored(0, sc[0], 64);
        _tile_stored(1, sc[16], 64);
        _tile_stored(2, sc[32], 64);
        _tile_stored(3, sc[48], 64);
        for (int64_t d = dc; d < dc + 64; ++d) {
          const __m512 a = _mm512_load_ps(st.acc[d]);
          _mm512_store_ps(st.acc[d], _mm512_add_ps(rescale ? _mm512_mul_ps(a, corr) : a,
                                                   _mm512_load_ps(sc[d - dc])));
        }
      }
    }
  }
  _tile_release();
  for (int64_t j = 0; j < nh; ++j) {
    HeadState& st = state[j];
    for (int64_t d = 0; d < D; ++d)
      _mm512_store_ps(st.acc[d], _mm512_div_ps(_mm512_load_ps(st.acc[d]), st.l));
    for (int64_t c = 0; c < nq; ++c) {
      float* o = out + ((q0 + c) * s.Hq + h0 + j) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = st.acc[d][c];
    }
  }
}
#endif  // HISPARSE_AMX

#if defined(__AVX512F__)
// Without AMX: the same layout (rows are keys, lanes are queries) in float32 fused
// multiply-adds, each key and value converted from bf16 once per call, exactly.
// A query head's scaled Q^T and its O^T stay in the core's cache; a key block's
// scores go 8 keys at a time (8 independent sums hide the multiply-add's latency).
struct AvxHead {
  alignas(64) float qt[kMaxDim][16];   // Q^T, scaled (log2 units)
  alignas(64) float acc[kMaxDim][16];  // O^T
  __m512 m, l;
};

constexpr int64_t kAvxRows = 8;  // keys (QK) or value dims (PV) per pass

void AvxQueryTile(int64_t T, int64_t Hq, int64_t D, int64_t start, int64_t kend,
                  const float* q, const float* kh, const float* vh, int64_t h0, int64_t nh,
                  int64_t q0, float sm_scale, AvxHead* state, float* out) {
  const int64_t nq = std::min<int64_t>(16, T - q0);
  alignas(64) int32_t pos[16];  // each lane's last key; padding lanes copy the last query
  for (int64_t c = 0; c < 16; ++c)
    pos[c] = static_cast<int32_t>(std::min(start + q0 + std::min(c, nq - 1), kend - 1));
  const float scale = sm_scale * 1.4426950408889634f;  // log2 units
  for (int64_t j = 0; j < nh; ++j) {
    AvxHead& st = state[j];
    for (int64_t c = 0; c < 16; ++c) {
      const float* qr = q + ((q0 + std::min(c, nq - 1)) * Hq + h0 + j) * D;
      for (int64_t d = 0; d < D; ++d) st.qt[d][c] = qr[d] * scale;
    }
    std::memset(st.acc, 0, sizeof(float) * 16 * D);
    st.m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    st.l = _mm512_setzero_ps();
  }
  alignas(64) float sc[kKeyBlock][16];  // S^T of a key block, then P^T
  const __m512i posv = _mm512_load_si512(pos);
  const int64_t blocks = pos[15] / kKeyBlock + 1;
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const int64_t k0 = kb * kKeyBlock;
    const bool diagonal = k0 + kKeyBlock - 1 > pos[0];
    const float* kblock = kh + k0 * D;
    const float* vblock = vh + k0 * D;
    for (int64_t j = 0; j < nh; ++j) {
      AvxHead& st = state[j];
      for (int64_t r0 = 0; r0 < kKeyBlock; r0 += kAvxRows) {
        __m512 a[kAvxRows];
        for (int i = 0; i < kAvxRows; ++i) a[i] = _mm512_setzero_ps();
        const float* kr = kblock + r0 * D;
        for (int64_t d = 0; d < D; ++d) {
          const __m512 qv = _mm512_load_ps(st.qt[d]);
          for (int i = 0; i < kAvxRows; ++i)
            a[i] = _mm512_fmadd_ps(_mm512_set1_ps(kr[i * D + d]), qv, a[i]);
        }
        for (int i = 0; i < kAvxRows; ++i) _mm512_store_ps(sc[r0 + i], a[i]);
      }
      __m512 corr;
      const __m512 m = st.m = BlockMax(sc, k0, diagonal, posv, st.m, &corr);
      const bool rescale = _mm512_cmpneq_ps_mask(corr, _mm512_set1_ps(1.f)) != 0;
      __m512 sum = _mm512_setzero_ps();
      const auto probabilities = [&](auto clamp) {
        for (int64_t r = 0; r < kKeyBlock; ++r) {
          const __m512 p = Exp2x16<clamp()>(_mm512_sub_ps(_mm512_load_ps(sc[r]), m));
          sum = _mm512_add_ps(sum, p);
          _mm512_store_ps(sc[r], p);
        }
      };
      if (diagonal)
        probabilities(std::true_type{});
      else
        probabilities(std::false_type{});
      st.l = _mm512_add_ps(_mm512_mul_ps(st.l, corr), sum);
      for (int64_t d0 = 0; d0 < D; d0 += kAvxRows) {  // O^T = corr O^T + V^T P^T
        __m512 o[kAvxRows];
        for (int i = 0; i < kAvxRows; ++i) {
          o[i] = _mm512_load_ps(st.acc[d0 + i]);
          if (rescale) o[i] = _mm512_mul_ps(o[i], corr);
        }
        for (int64_t r = 0; r < kKeyBlock; ++r) {
          const __m512 p = _mm512_load_ps(sc[r]);
          const float* vr = vblock + r * D + d0;
          for (int i = 0; i < kAvxRows; ++i)
            o[i] = _mm512_fmadd_ps(_mm512_set1_ps(vr[i]), p, o[i]);
        }
        for (int i = 0; i < kAvxRows; ++i) _mm512_store_ps(st.acc[d0 + i], o[i]);
      }
    }
  }
  for (int64_t j = 0; j < nh; ++j) {
    AvxHead& st = state[j];
    for (int64_t d = 0; d < D; ++d)
      _mm512_store_ps(st.acc[d], _mm512_div_ps(_mm512_load_ps(st.acc[d]), st.l));
    for (int64_t c = 0; c < nq; ++c) {
      float* o = out + ((q0 + c) * Hq + h0 + j) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = st.acc[d][c];
    }
  }
}
#endif  // __AVX512F__


// q [T,Hq,D] f32 (query i at position start+i); k, v [L,S,Hkv,D] bf16, of which
// layer s32[] is read in place (a chunked prefill's staged K/V: slicing it in XLA
// copies the whole layer every block); start s32[]
// -> out [T,Hq,D] f32: softmax(sm_scale q.k) v over keys 0..min(start+i, S-1).
ffi::Error CausalAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::BF16> k, ffi::Buffer<ffi::BF16> v,
                               ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> start,
                               ffi::ResultBuffer<ffi::F32> out, float sm_scale, int32_t amx) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto vd = v.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || vd.size() != 4 ||
      !std::equal(kd.begin(), kd.end(), vd.begin()))
    return ffi::Error::InvalidArgument("hisparse causal_attention: ranks or k/v shapes");
  const int64_t T = qd[0], Hq = qd[1], D = qd[2], S = kd[1], Hkv = kd[2];
  const int64_t first = std::max<int64_t>(start.typed_data()[0], 0);
  if (D % 64 || D > kMaxDim || kd[3] != D || Hkv == 0 || Hq % Hkv || S == 0)
    return ffi::Error::InvalidArgument("hisparse causal_attention: shapes");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= kd[0])
    return ffi::Error::InvalidArgument("hisparse causal_attention: layer out of range");
  const bool tiles = UseAmx(amx);
#if !defined(__AVX512F__)
  if (!tiles)
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "hisparse causal_attention: built for a CPU with neither AMX-BF16 nor "
                      "AVX-512");
#endif
  if (T == 0) return ffi::Error::Success();
  const int64_t kend = std::min(S, first + T);  // the keys any query sees
  const int64_t nkb = (kend + kKeyBlock - 1) / kKeyBlock, keys = nkb * kKeyBlock;
  const int64_t layer_size = S * Hkv * D;
  const uint16_t* kin = reinterpret_cast<const uint16_t*>(k.typed_data()) + l * layer_size;
  const uint16_t* vin = reinterpret_cast<const uint16_t*>(v.typed_data()) + l * layer_size;
  const int64_t qtiles = (T + 15) / 16, group = Hq / Hkv;
  const int64_t chunks = (group + kLockstep - 1) / kLockstep;  // of a group's heads
  // units (KV head, heads chunk, query tile), the longest tiles first
  const auto unit = [&](int64_t u, int64_t* hk, int64_t* h0, int64_t* nh) {
    const int64_t per_tile = Hkv * chunks;
    *hk = u % per_tile / chunks;
    *h0 = *hk * group + u % chunks * kLockstep;
    *nh = std::min(kLockstep, (*hk + 1) * group - *h0);
    return (qtiles - 1 - u / per_tile) * 16;
  };
  if (tiles) {
#if HISPARSE_AMX
    Shapes s{T, Hq, Hkv, D, S, first, kend, nkb};
    // Each KV head's keys [keys, D] and values transposed by 32 keys [keys / 32, D, 32],
    // zero past kend (never read as garbage by the tiles)
    std::vector<uint16_t> kp(Hkv * keys * D), vt(Hkv * keys * D);
    ParallelFor(pool, Hkv * nkb, [&](int64_t u) {
      const int64_t hk = u / nkb, j0 = (u % nkb) * kKeyBlock;
      for (int64_t j = j0; j < j0 + kKeyBlock; ++j) {
        uint16_t* kdst = kp.data() + (hk * keys + j) * D;
        uint16_t* vdst = vt.data() + (hk * keys + j / 32 * 32) * D + j % 32;
        if (j < kend) {
          const int64_t at = (j * Hkv + hk) * D;
          std::memcpy(kdst, kin + at, sizeof(uint16_t) * D);
          for (int64_t d = 0; d < D; ++d) vdst[d * 32] = vin[at + d];
        } else {
          std::memset(kdst, 0, sizeof(uint16_t) * D);
          for (int64_t d = 0; d < D; ++d) vdst[d * 32] = 0;
        }
      }
    });
    ParallelFor(pool, Hkv * chunks * qtiles, [&](int64_t u) {
      int64_t hk, h0, nh;
      const int64_t q0 = unit(u, &hk, &h0, &nh);
      thread_local std::vector<HeadState> state(kLockstep);  // 160 KB: not per unit
      QueryTile(s, q.typed_data(), kp.data() + hk * keys * D, vt.data() + hk * keys * D, h0,
                nh, q0, sm_scale, state.data(), out->typed_data());
    });
#endif
    return ffi::Error::Success();
  }
#if defined(__AVX512F__)
  // Each KV head's keys and values [keys, D] as floats, zero past kend
  // (not zero-filled first: every row is written below, by all threads; clearing them
  // first would be a pass over them on one)
  std::unique_ptr<float[]> kf(new float[Hkv * keys * D]), vf(new float[Hkv * keys * D]);
  ParallelFor(pool, Hkv * nkb, [&](int64_t u) {
    const int64_t hk = u / nkb, j0 = (u % nkb) * kKeyBlock;
    for (int64_t j = j0; j < j0 + kKeyBlock; ++j) {
      float* kdst = kf.get() + (hk * keys + j) * D;
      float* vdst = vf.get() + (hk * keys + j) * D;
      if (j < kend) {
        const int64_t at = (j * Hkv + hk) * D;
        for (int64_t d = 0; d < D; d += 16) {
          _mm512_storeu_ps(kdst + d, Bf16x16(kin + at + d));
          _mm512_storeu_ps(vdst + d, Bf16x16(vin + at + d));
        }
      } else {
        std::memset(kdst, 0, sizeof(float) * D);
        std::memset(vdst, 0, sizeof(float) * D);
      }
    }
  });
  ParallelFor(pool, Hkv * chunks * qtiles, [&](int64_t u) {
    int64_t hk, h0, nh;
    const int64_t q0 = unit(u, &hk, &h0, &nh);
    thread_local std::vector<AvxHead> state(kLockstep);  // 128 KB: not per unit
    AvxQueryTile(T, Hq, D, first, kend, q.typed_data(), kf.get() + hk * keys * D,
                 vf.get() + hk * keys * D, h0, nh, q0, sm_scale, state.data(),
                 out->typed_data());
  });
#endif
  return ffi::Error::Success();
}

}  // namespace

// 1 where the AMX kernels run here: built with AMX-BF16, and the kernel (Linux)
// grants the process AMX's tile state.
extern "C" int HisparseAmxReady() {
#if HISPARSE_AMX
  return AmxReady() ? 1 : 0;
#else
  return 0;
#endif
}

// 1 where the causal-attention kernel runs: on AMX tiles, or without them on AVX-512.
extern "C" int HisparseCausalReady() {
#if defined(__AVX512F__)
  return 1;
#else
  return UseAmx(1) ? 1 : 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseCausalAttention, CausalAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("amx"));
