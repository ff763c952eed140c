// HiSparse's cold-page attention on the CPU, as XLA FFI handlers.
//
// XLA:CPU runs the int4 pages' logits and value products as many tiny batched
// matrix products (3 x 32 by 32 x 16 per page) after slow gathers; here each
// (sequence, KV head) is one loop that reads its pages straight from the pool.
// The pool arrives with its layer axis and the layer's index, so that a layer
// of a stacked cache is read in place: a custom call's operand cannot be a
// slice, and XLA would copy the layer's whole pool to make one.
//
// Same functions as pallas_kernels/sparse_decode/reference.py's `cold_logits`
// and `attend_cold_logits`; cpu_kernels/ops.py binds them and says how they
// differ (summation order, exp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"

namespace ffi = xla::ffi;

namespace {

using namespace hisparse_cpu;  // NOLINT

// q [B,H,G,D] f32; int4_k [L,H,P,T,D/2] u8 (dims [0,D/2) in the low nibble, [D/2,D)
// in the high one); center [L,H,P,D] bf16; radius [L,H,P,D] e4m3 (or its bits as u8,
// a stacked cache's form); ids [B,H,K] s32
// (-1: none); layer s32[] -> logits [B,H,G,K,T] f32 = q.lo + sum_d (q_d step_d)
// code_d(t), unscaled, with lo = c - r and step = r 2/15; 0 where ids < 0.
ffi::Error ColdLogitsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U8> int4_k,
                          ffi::Buffer<ffi::BF16> center, ffi::AnyBuffer radius,
                          ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> layer,
                          ffi::ResultBuffer<ffi::F32> logits) {
  auto qd = q.dimensions();
  auto kd = int4_k.dimensions();
  auto idd = ids.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || idd.size() != 3)
    return ffi::Error::InvalidArgument("hisparse cold_logits: ranks");
  const int64_t B = qd[0], H = qd[1], G = qd[2], D = qd[3], K = idd[2], T = kd[3];
  const int64_t half = D / 2;
  if (D > kMaxDim || D % 2 || kd[4] != half || kd[1] != H || G > kMaxGroup)
    return ffi::Error::InvalidArgument("hisparse cold_logits: shapes");
  if (radius.element_type() != ffi::DataType::F8E4M3FN &&
      radius.element_type() != ffi::DataType::U8)
    return ffi::Error::InvalidArgument("hisparse cold_logits: radius must be e4m3 (or its bits)");
  const int32_t l = layer.typed_data()[0];
  const Pool kpool = MakePool(kd, l), dpool = MakePool(center.dimensions(), l);
  const float* qp = q.typed_data();
  const uint8_t* kp = int4_k.typed_data();
  const uint16_t* cp = reinterpret_cast<const uint16_t*>(center.typed_data());
  const uint8_t* rp = static_cast<const uint8_t*>(radius.untyped_data());
  const int32_t* ip = ids.typed_data();
  float* out = logits->typed_data();
  ParallelFor(pool, B * H, [&](int64_t bh) {
      const int64_t h = bh % H;
      alignas(64) float w[kMaxGroup][kMaxDim];
      float base[kMaxGroup];
      for (int64_t k = 0; k < K; ++k) {
        const int32_t id = ip[bh * K + k];
        if (id < 0) {
          for (int64_t g = 0; g < G; ++g)
            std::fill_n(out + ((bh * G + g) * K + k) * T, T, 0.f);
          continue;
        }
        const uint16_t* c = cp + dpool.Page(h, id);
        const uint8_t* r = rp + dpool.Page(h, id);
#if defined(__AVX512F__)
        if (D % 16 == 0) {
          __m512 base_acc[kMaxGroup];
          for (int64_t g = 0; g < G; ++g) base_acc[g] = _mm512_setzero_ps();
          for (int64_t d = 0; d < D; d += 16) {
            const __m512 rad = E4m3x16(r + d);
            const __m512 cen = Bf16x16(c + d);
            const __m512 lo = _mm512_sub_ps(cen, rad);
            const __m512 st = _mm512_mul_ps(rad, _mm512_set1_ps(kInt4Step));
            for (int64_t g = 0; g < G; ++g) {
              const __m512 qv = _mm512_loadu_ps(qp + (bh * G + g) * D + d);
              base_acc[g] = _mm512_fmadd_ps(qv, lo, base_acc[g]);
              _mm512_store_ps(w[g] + d, _mm512_mul_ps(qv, st));
            }
          }
          for (int64_t g = 0; g < G; ++g) base[g] = _mm512_reduce_add_ps(base_acc[g]);
        } else
#endif
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qp + (bh * G + g) * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) {
            const float rad = kE4m3.v[r[d]];
            s += qg[d] * (Bf16(c[d]) - rad);
            w[g][d] = qg[d] * (rad * kInt4Step);
          }
          base[g] = s;
        }
        const uint8_t* page = kp + kpool.Page(h, id);
#if defined(__AVX512F__)
        if (half % 4 == 0) {
          // 16 tokens per vector: each gather takes 4 code bytes (8 channels) of
          // every token, so no sum runs across lanes.
          const __m512i mask = _mm512_set1_epi32(0xF);
          for (int64_t t0 = 0; t0 < T; t0 += 16) {
            const __mmask16 live =
                static_cast<__mmask16>((1u << std::min<int64_t>(16, T - t0)) - 1);
            const __m512i at = _mm512_mullo_epi32(
                _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(t0)),
                                 _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                                   13, 14, 15)),
                _mm512_set1_epi32(static_cast<int32_t>(half)));
            __m512 acc[kMaxGroup];
            for (int64_t g = 0; g < G; ++g) acc[g] = _mm512_set1_ps(base[g]);
            for (int64_t c4 = 0; c4 < half; c4 += 4) {
              const __m512i x = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, at,
                                                            page + c4, 1);
              for (int j = 0; j < 4; ++j) {
                const __m512i byte = _mm512_srli_epi32(x, 8 * j);
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(byte, mask));
                const __m512 hi = _mm512_cvtepi32_ps(
                    _mm512_and_si512(_mm512_srli_epi32(byte, 4), mask));
                for (int64_t g = 0; g < G; ++g) {
                  acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(w[g][c4 + j]), lo, acc[g]);
                  acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(w[g][half + c4 + j]), hi, acc[g]);
                }
              }
            }
            for (int64_t g = 0; g < G; ++g)
              _mm512_mask_storeu_ps(out + ((bh * G + g) * K + k) * T + t0, live, acc[g]);
          }
          continue;
        }
#endif
        for (int64_t t = 0; t < T; ++t) {
          const uint8_t* row = page + t * half;
          for (int64_t g = 0; g < G; ++g) {
            float s = 0.f;
            for (int64_t c2 = 0; c2 < half; ++c2)
              s += w[g][c2] * (row[c2] & 0xF) + w[g][c2 + half] * (row[c2] >> 4);
            out[((bh * G + g) * K + k) * T + t] = base[g] + s;
          }
        }
      }
  });
  return ffi::Error::Success();
}

// o[0, D) += sum_{t < n} p[t] rows[t] for rows of D floats (aligned to 64 bytes),
// the sums held in registers across the rows.
inline void AddWeighted(const float* rows, int64_t n, const float* p, int64_t D, float* o) {
  int64_t d0 = 0;
#if defined(__AVX512F__)
  for (; d0 + 64 <= D; d0 += 64) {
    __m512 a0 = _mm512_loadu_ps(o + d0), a1 = _mm512_loadu_ps(o + d0 + 16),
           a2 = _mm512_loadu_ps(o + d0 + 32), a3 = _mm512_loadu_ps(o + d0 + 48);
    for (int64_t t = 0; t < n; ++t) {
      const __m512 w = _mm512_set1_ps(p[t]);
      const float* r = rows + t * D + d0;
      a0 = _mm512_fmadd_ps(w, _mm512_load_ps(r), a0);
      a1 = _mm512_fmadd_ps(w, _mm512_load_ps(r + 16), a1);
      a2 = _mm512_fmadd_ps(w, _mm512_load_ps(r + 32), a2);
      a3 = _mm512_fmadd_ps(w, _mm512_load_ps(r + 48), a3);
    }
    _mm512_storeu_ps(o + d0, a0);
    _mm512_storeu_ps(o + d0 + 16, a1);
    _mm512_storeu_ps(o + d0 + 32, a2);
    _mm512_storeu_ps(o + d0 + 48, a3);
  }
  for (; D % 16 == 0 && d0 < D; d0 += 16) {
    __m512 a = _mm512_loadu_ps(o + d0);
    for (int64_t t = 0; t < n; ++t)
      a = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_load_ps(rows + t * D + d0), a);
    _mm512_storeu_ps(o + d0, a);
  }
#endif
  for (; d0 < D; ++d0)
    for (int64_t t = 0; t < n; ++t) o[d0] += p[t] * rows[t * D + d0];
}

// Writes the softmax's results for one (sequence, KV head): o /= denom, lse.
inline void Finish(float* o, float* lse, const float* m, const float* denom, int64_t G,
                   int64_t D) {
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < G; ++g) {
    const float dn = denom[g];
    const float div = dn > 0 ? dn : 1.f;
    for (int64_t d = 0; d < D; ++d) o[g * D + d] /= div;
    lse[g] = dn > 0 ? m[g] + std::log(dn) : -inf;  // NaN sums: -inf, as the reference
  }
}

// The final softmax of a decode step whose pages were listed and re-ranked (the
// reference's `attend_listed`): raw [B,H,G,C,T] f32, `cold_logits` of the listed
// pages; picked [B,H,K] s32, the attended entries as indices into raw's pages
// (-1: none); ids [B,H,K] s32, their pool pages (-1: none); logw [B,H,K] f32,
// each page's log weight; win_out [B,H,G,D] f32, win_lse [B,H,G] f32, the
// window's softmax; int4_v [L,H,P,T,D/2] u8; scale, zero [L,H,P,T,NG] bf16;
// layer s32[]; sm_scale -> out [B,H,G,D] f32, lse [B,H,G] f32: the picked pages'
// softmax (logits raw * sm_scale + logw), merged with the window's. Every
// rounding step of the attention after the re-rank is here, so that two programs
// that fuse the glue around it differently (a stacked cache and an offload working
// set) still agree bit for bit. Pages with ids < 0 are never read.
ffi::Error AttendListedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> raw,
                            ffi::Buffer<ffi::S32> picked, ffi::Buffer<ffi::S32> ids,
                            ffi::Buffer<ffi::F32> logw, ffi::Buffer<ffi::F32> win_out,
                            ffi::Buffer<ffi::F32> win_lse, ffi::Buffer<ffi::U8> int4_v,
                            ffi::Buffer<ffi::BF16> scale, ffi::Buffer<ffi::BF16> zero,
                            ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out,
                            ffi::ResultBuffer<ffi::F32> lse, float sm_scale) {
  auto rd = raw.dimensions();
  auto pd = picked.dimensions();
  auto vd = int4_v.dimensions();
  auto sd = scale.dimensions();
  if (rd.size() != 5 || pd.size() != 3 || vd.size() != 5 || sd.size() != 5)
    return ffi::Error::InvalidArgument("hisparse attend_listed: ranks");
  const int64_t B = rd[0], H = rd[1], G = rd[2], C = rd[3], T = rd[4], K = pd[2];
  const int64_t half = vd[4], D = 2 * half, NG = sd[4];
  if (D > kMaxDim || NG <= 0 || D % NG || vd[3] != T || G > kMaxGroup || pd[0] != B ||
      pd[1] != H || (K > 0 && C == 0))
    return ffi::Error::InvalidArgument("hisparse attend_listed: shapes");
  const int64_t gsize = D / NG;
  const int32_t l = layer.typed_data()[0];
  const Pool vpool = MakePool(vd, l), spool = MakePool(sd, l);
  const uint8_t* vp = int4_v.typed_data();
  const uint16_t* scp = reinterpret_cast<const uint16_t*>(scale.typed_data());
  const uint16_t* zp = reinterpret_cast<const uint16_t*>(zero.typed_data());
  const float inf = std::numeric_limits<float>::infinity();
  ParallelFor(pool, B * H, [&](int64_t bh) {
    const int64_t h = bh % H;
    const int32_t* pk = picked.typed_data() + bh * K;
    const int32_t* id = ids.typed_data() + bh * K;
    const float* lw = logw.typed_data() + bh * K;
    std::vector<float> logit(G * K * T);  // [G][K*T]
    for (int64_t g = 0; g < G; ++g) {
      const float* rg = raw.typed_data() + (bh * G + g) * C * T;
      for (int64_t k = 0; k < K; ++k) {
        float* x = logit.data() + (g * K + k) * T;
        if (id[k] < 0) {
          std::fill_n(x, T, -inf);
          continue;
        }
        const float* r = rg + std::min<int64_t>(std::max<int32_t>(pk[k], 0), C - 1) * T;
        for (int64_t t = 0; t < T; ++t) x[t] = r[t] * sm_scale + lw[k];
      }
    }
    alignas(64) float tile[16 * kMaxDim];  // 16 tokens' values
    alignas(64) float p[kMaxGroup][16];
    float m[kMaxGroup], denom[kMaxGroup], cold_lse[kMaxGroup];
    alignas(64) float cold[kMaxGroup * kMaxDim];
    std::fill_n(cold, G * D, 0.f);
    for (int64_t g = 0; g < G; ++g) {
      m[g] = SoftmaxShift(logit.data() + g * K * T, K * T);
      denom[g] = 0.f;
    }
    for (int64_t k = 0; k < K; ++k) {
      if (id[k] < 0) continue;
      const uint8_t* page = vp + vpool.Page(h, id[k]);
      const uint16_t* s = scp + spool.Page(h, id[k]);
      const uint16_t* z = zp + spool.Page(h, id[k]);
      for (int64_t t0 = 0; t0 < T; t0 += 16) {
        const int64_t n = std::min<int64_t>(16, T - t0);
        for (int64_t g = 0; g < G; ++g) {
          ExpShifted(logit.data() + (g * K + k) * T + t0, m[g], n, p[g]);
          denom[g] += Sum(p[g], n);
        }
        for (int64_t t = 0; t < n; ++t) {  // values: zero + code * scale per group
          const int64_t tt = t0 + t;
          const uint8_t* row = page + tt * half;
          float* v = tile + t * D;
          for (int64_t c = 0; c < half; ++c) {
            v[c] = static_cast<float>(row[c] & 0xF);
            v[c + half] = static_cast<float>(row[c] >> 4);
          }
          for (int64_t gr = 0; gr < NG; ++gr) {
            const float sc = Bf16(s[tt * NG + gr]), ze = Bf16(z[tt * NG + gr]);
            for (int64_t d = gr * gsize; d < (gr + 1) * gsize; ++d) v[d] = v[d] * sc + ze;
          }
        }
        for (int64_t g = 0; g < G; ++g) AddWeighted(tile, n, p[g], D, cold + g * D);
      }
    }
    Finish(cold, cold_lse, m, denom, G, D);
    // merged with the window as the reference's merge_parts
    for (int64_t g = 0; g < G; ++g) {
      const float wl = win_lse.typed_data()[bh * G + g], cl = cold_lse[g];
      const float mx = (std::isnan(wl) || std::isnan(cl)) ? std::numeric_limits<float>::quiet_NaN()
                                                          : std::max(wl, cl);
      const float ms = std::isfinite(mx) ? mx : 0.f;
      const float w0 = std::exp(wl - ms), w1 = std::exp(cl - ms), total = w0 + w1;
      const float div = total > 0 ? total : 1.f;
      const float* wo = win_out.typed_data() + (bh * G + g) * D;
      float* o = out->typed_data() + (bh * G + g) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = (w0 * wo[d] + w1 * cold[g * D + d]) / div;
      lse->typed_data()[bh * G + g] = total > 0 ? ms + std::log(total) : -inf;
    }
  });
  return ffi::Error::Success();
}

// Loads token rows of one (layer, sequence, KV head) as f32: bf16 rows, or e4m3
// rows (or their u8 bits) times a per-token scale.
struct Rows {
  const uint16_t* bf16 = nullptr;
  const uint8_t* e4m3 = nullptr;
  const float* scale = nullptr;
  int64_t D = 0;
  void Load(int64_t t, float* out) const {
#if defined(__AVX512F__)
    if (D % 16 == 0) {
      if (bf16) {
        for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(out + d, Bf16x16(bf16 + t * D + d));
      } else {
        const __m512 s = _mm512_set1_ps(scale[t]);
        for (int64_t d = 0; d < D; d += 16)
          _mm512_store_ps(out + d, _mm512_mul_ps(E4m3x16(e4m3 + t * D + d), s));
      }
      return;
    }
#endif
    for (int64_t d = 0; d < D; ++d)
      out[d] = bf16 ? Bf16(bf16[t * D + d]) : kE4m3.v[e4m3[t * D + d]] * scale[t];
  }
};

inline float Dot(const float* a, const float* b, int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_load_ps(b + d), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float s = 0.f;
  for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}


// The window: sink and hot tokens in bf16, warm tokens in e4m3 with a scale per
// token. q [B,H,G,D] f32; bf16_k, bf16_v [L,S,H,Tb,D] bf16 with S >= B slots, of
// which the first B are read (a narrow decode step reads a wider engine's tiers in
// place); bf16_valid [B,Tb]; fp8_k, fp8_v [L,S,H,Tw,D] e4m3 (or its u8 bits);
// fp8_k_scale, fp8_v_scale [L,S,H,Tw] f32; fp8_valid [B,Tw]; layer s32[]; sm_scale
// -> out [B,H,G,D] f32,
// lse [B,H,G] f32: one softmax over both tiers' valid tokens (the reference's two
// parts, merged). Invalid slots are never read.
ffi::Error WindowImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::BF16> bf16_k,
                      ffi::Buffer<ffi::BF16> bf16_v, ffi::Buffer<ffi::PRED> bf16_valid,
                      ffi::AnyBuffer fp8_k, ffi::AnyBuffer fp8_v,
                      ffi::Buffer<ffi::F32> fp8_k_scale, ffi::Buffer<ffi::F32> fp8_v_scale,
                      ffi::Buffer<ffi::PRED> fp8_valid, ffi::Buffer<ffi::S32> layer,
                      ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse,
                      float sm_scale) {
  auto qd = q.dimensions();
  auto bd = bf16_k.dimensions();
  auto fd = fp8_k.dimensions();
  if (qd.size() != 4 || bd.size() != 5 || fd.size() != 5)
    return ffi::Error::InvalidArgument("hisparse window: ranks");
  const int64_t B = qd[0], H = qd[1], G = qd[2], D = qd[3];
  const int64_t L = bd[0], S = bd[1], Tb = bd[3], Tw = fd[3];
  const auto ks = fp8_k_scale.dimensions(), vs = fp8_v_scale.dimensions();
  if (S < B || bd[2] != H || bd[4] != D || fd[0] != L || fd[1] != S || fd[2] != H ||
      fd[4] != D || D > kMaxDim || G > kMaxGroup || ks.size() != 4 || vs.size() != 4 ||
      ks[0] != L || ks[1] != S || ks[2] != H || ks[3] != Tw || vs[0] != L || vs[1] != S ||
      vs[2] != H || vs[3] != Tw)
    return ffi::Error::InvalidArgument("hisparse window: shapes");
  for (auto* a : {&fp8_k, &fp8_v})
    if (a->element_type() != ffi::DataType::F8E4M3FN && a->element_type() != ffi::DataType::U8)
      return ffi::Error::InvalidArgument("hisparse window: fp8 tiers must be e4m3 (or its bits)");
  const int64_t l = std::min<int64_t>(std::max<int64_t>(layer.typed_data()[0], 0), L - 1);
  const bool* bvalid = bf16_valid.typed_data();
  const bool* fvalid = fp8_valid.typed_data();
  const int64_t cap = Tb + Tw;
  ParallelFor(pool, B * H, [&](int64_t bh) {
      const int64_t b = bh / H, at = (l * S + b) * H + bh % H;
      std::vector<int64_t> token(cap);
      std::vector<float> logit(G * cap + 16), prob(G * cap + 16);
      alignas(64) float row[kMaxDim];
      Rows keys[2], values[2];
      keys[0].bf16 = reinterpret_cast<const uint16_t*>(bf16_k.typed_data()) + at * Tb * D;
      values[0].bf16 = reinterpret_cast<const uint16_t*>(bf16_v.typed_data()) + at * Tb * D;
      keys[1].e4m3 = static_cast<const uint8_t*>(fp8_k.untyped_data()) + at * Tw * D;
      values[1].e4m3 = static_cast<const uint8_t*>(fp8_v.untyped_data()) + at * Tw * D;
      keys[1].scale = fp8_k_scale.typed_data() + at * Tw;
      values[1].scale = fp8_v_scale.typed_data() + at * Tw;
      for (auto* r : {&keys[0], &keys[1], &values[0], &values[1]}) r->D = D;
      int64_t n = 0;  // valid tokens: bf16 slots t, then fp8 slots Tb + t
      for (int64_t t = 0; t < Tb; ++t) if (bvalid[b * Tb + t]) token[n++] = t;
      for (int64_t t = 0; t < Tw; ++t) if (fvalid[b * Tw + t]) token[n++] = Tb + t;
      const float* qb = q.typed_data() + bh * G * D;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = token[i];
        t < Tb ? keys[0].Load(t, row) : keys[1].Load(t - Tb, row);
        for (int64_t g = 0; g < G; ++g) logit[g * n + i] = Dot(qb + g * D, row, D) * sm_scale;
      }
      float* o = out->typed_data() + bh * G * D;
      std::fill_n(o, G * D, 0.f);
      float m[kMaxGroup], denom[kMaxGroup];
      for (int64_t g = 0; g < G; ++g) {
        m[g] = SoftmaxShift(logit.data() + g * n, n);
        ExpShifted(logit.data() + g * n, m[g], n, prob.data() + g * n);
        denom[g] = Sum(prob.data() + g * n, n);
      }
      alignas(64) float tile[16 * kMaxDim];  // 16 tokens' values
      for (int64_t i0 = 0; i0 < n; i0 += 16) {
        const int64_t cnt = std::min<int64_t>(16, n - i0);
        for (int64_t i = 0; i < cnt; ++i) {
          const int64_t t = token[i0 + i];
          t < Tb ? values[0].Load(t, tile + i * D) : values[1].Load(t - Tb, tile + i * D);
        }
        for (int64_t g = 0; g < G; ++g)
          AddWeighted(tile, cnt, prob.data() + g * n + i0, D, o + g * D);
      }
      Finish(o, lse->typed_data() + bh * G, m, denom, G, D);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseColdLogits, ColdLogitsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseAttendListed, AttendListedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseWindow, WindowImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale"));
