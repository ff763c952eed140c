// A decode step's page selection on the CPU, as four XLA FFI handlers:
// - page scores: pallas_kernels/lookup/reference.py's `page_scores` (Quest's
//   bound per query head, and the group's estimated mass per page) for every
//   page of each sequence's page table;
// - the ranking: hisparse_jax/attention.py's `_select` after the scores (each
//   head's top bound pages and their neighbours, plain Quest's lead, then the
//   pages with the most mass), the same pages as XLA's from the same scores;
// - the tail sample: attention.py's `sample_tail`;
// - the re-rank of the candidates by their int4 logits: attention.py's `rerank`.
//
// XLA:CPU gathers each sequence's digest rows into a transposed copy before its
// two dots (a model's layer view copies the layer's digests as well): most of a
// decode step's selection at batch 8. Here each (sequence, KV head) reads its
// pages' digests straight from the pool, with its layer axis and the layer's
// index (see sparse_decode.cc), and computes both scores and the mass in one
// pass, in the same order whatever the batch.
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

// rows [B,H,G,D] bf16 (the query scaled by 1/sqrt(D), rounded to bf16 as the
// reference rounds it); center [L,H,P,D] bf16; radius [L,H,P,D] e4m3 (or its
// bits as u8); table [B,N] s32 (-1: not a candidate); layer s32[]
// -> bound [B,H,G,N] f32 = rows.c + |rows|.r, mass [B,H,N] f32 = the group's
// log estimated mass: log sum_g softmax_n(rows_g.c_n); -inf where table < 0.
ffi::Error PageScoresImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> rows,
                          ffi::Buffer<ffi::BF16> center, ffi::AnyBuffer radius,
                          ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> layer,
                          ffi::ResultBuffer<ffi::F32> bound, ffi::ResultBuffer<ffi::F32> mass) {
  auto qd = rows.dimensions();
  auto cd = center.dimensions();
  auto td = table.dimensions();
  if (qd.size() != 4 || cd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("hisparse page_scores: ranks");
  const int64_t B = qd[0], H = qd[1], G = qd[2], D = qd[3], N = td[1];
  if (D > kMaxDim || G > kMaxGroup || cd[1] != H || cd[3] != D || td[0] != B)
    return ffi::Error::InvalidArgument("hisparse page_scores: shapes");
  if (radius.element_type() != ffi::DataType::F8E4M3FN &&
      radius.element_type() != ffi::DataType::U8)
    return ffi::Error::InvalidArgument("hisparse page_scores: radius must be e4m3 (or its bits)");
  const Pool dpool = MakePool(cd, layer.typed_data()[0]);
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(rows.typed_data());
  const uint16_t* cp = reinterpret_cast<const uint16_t*>(center.typed_data());
  const uint8_t* rp = static_cast<const uint8_t*>(radius.untyped_data());
  const int32_t* tp = table.typed_data();
  const float inf = std::numeric_limits<float>::infinity();
  ParallelFor(pool, B * H, [&](int64_t bh) {
      const int64_t b = bh / H, h = bh % H;
      alignas(64) float q[kMaxGroup][kMaxDim], aq[kMaxGroup][kMaxDim];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) {
          q[g][d] = Bf16(qp[(bh * G + g) * D + d]);
          aq[g][d] = std::fabs(q[g][d]);
        }
      float* bo = bound->typed_data() + bh * G * N;
      std::vector<float> cen(G * N + 16);  // each head's centre logits
      const int32_t* ids = tp + b * N;
      for (int64_t n = 0; n < N; ++n) {
        if (ids[n] < 0) {
          for (int64_t g = 0; g < G; ++g) bo[g * N + n] = cen[g * N + n] = -inf;
          continue;
        }
        const uint16_t* c = cp + dpool.Page(h, ids[n]);
        const uint8_t* r = rp + dpool.Page(h, ids[n]);
#if defined(__AVX512F__)
        if (D % 16 == 0) {
          alignas(64) float cf[kMaxDim], rf[kMaxDim];  // the page's digest, decoded once
          for (int64_t d = 0; d < D; d += 16) {
            _mm512_store_ps(cf + d, Bf16x16(c + d));
            _mm512_store_ps(rf + d, E4m3x16(r + d));
          }
          for (int64_t g = 0; g < G; ++g) {  // two accumulators, in registers
            __m512 ac = _mm512_setzero_ps(), ar = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 16) {
              ac = _mm512_fmadd_ps(_mm512_load_ps(q[g] + d), _mm512_load_ps(cf + d), ac);
              ar = _mm512_fmadd_ps(_mm512_load_ps(aq[g] + d), _mm512_load_ps(rf + d), ar);
            }
            const float cs = _mm512_reduce_add_ps(ac);
            cen[g * N + n] = cs;
            bo[g * N + n] = cs + _mm512_reduce_add_ps(ar);
          }
          continue;
        }
#endif
        for (int64_t g = 0; g < G; ++g) {
          float cs = 0.f, rs = 0.f;
          for (int64_t d = 0; d < D; ++d) {
            cs += q[g][d] * Bf16(c[d]);
            rs += aq[g][d] * kE4m3.v[r[d]];
          }
          cen[g * N + n] = cs;
          bo[g * N + n] = cs + rs;
        }
      }
      // Each head's softmax over the pages (log), then the group's log-sum-exp
      // per page, as the reference's two logsumexps (NaN stays NaN).
      std::vector<float> p(N + 16);
      float lse[kMaxGroup];
      for (int64_t g = 0; g < G; ++g) {
        const float* x = cen.data() + g * N;
        const float m = SoftmaxShift(x, N);
        ExpShifted(x, m, N, p.data());
        lse[g] = std::log(Sum(p.data(), N)) + m;
      }
      float* mo = mass->typed_data() + bh * N;
      int64_t n = 0;
#if defined(__AVX512F__)
      for (; n + 16 <= N; n += 16) {
        __m512 y[kMaxGroup];
        __m512 top = _mm512_set1_ps(-inf);
        for (int64_t g = 0; g < G; ++g) {
          y[g] = _mm512_sub_ps(_mm512_loadu_ps(cen.data() + g * N + n), _mm512_set1_ps(lse[g]));
          top = _mm512_max_ps(top, y[g]);
        }
        // a shift of 0 where the maximum is not finite, as logsumexp's
        top = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(_mm512_sub_ps(top, top),
                                                     _mm512_setzero_ps(), _CMP_EQ_OQ), top);
        __m512 s = _mm512_setzero_ps();
        for (int64_t g = 0; g < G; ++g) s = _mm512_add_ps(s, Exp16(_mm512_sub_ps(y[g], top)));
        __m512 out = _mm512_add_ps(Log16(s), top);
        __mmask16 live = 0;
        for (int64_t i = 0; i < 16; ++i) live |= static_cast<__mmask16>((ids[n + i] >= 0) << i);
        _mm512_storeu_ps(mo + n, _mm512_mask_mov_ps(_mm512_set1_ps(-inf), live, out));
      }
#endif
      for (; n < N; ++n) {
        if (ids[n] < 0) {
          mo[n] = -inf;
          continue;
        }
        float y[kMaxGroup], top = -inf;
        bool nan = false;
        for (int64_t g = 0; g < G; ++g) {
          y[g] = cen[g * N + n] - lse[g];
          nan |= std::isnan(y[g]);
          top = y[g] > top ? y[g] : top;
        }
        top = std::isfinite(top) ? top : 0.f;
        float s = 0.f;
        for (int64_t g = 0; g < G; ++g) s += std::exp(y[g] - top);
        mo[n] = nan ? std::numeric_limits<float>::quiet_NaN() : std::log(s) + top;
      }
  });
  return ffi::Error::Success();
}

// The group's maximum of x [G][N] at page n, NaN if any is (jnp.max over the heads).
inline float GroupMax(const float* x, int64_t G, int64_t N, int64_t n) {
  float m = x[n];
  for (int64_t g = 1; g < G && !std::isnan(m); ++g) {
    const float y = x[g * N + n];
    m = std::isnan(y) || y > m ? y : m;
  }
  return m;
}

// The key jax.lax.top_k orders floats by (IEEE total order: NaN above inf, -NaN
// below -inf, -0 below +0).
inline int32_t OrderKey(float x) {
  int32_t i;
  std::memcpy(&i, &x, sizeof i);
  return i < 0 ? i ^ 0x7FFFFFFF : i;
}

// A t with exactly k of keys[0, n) >= t if there is one, else the largest t with
// at least k (the k-th largest key, which has ties), by binary search between
// the keys' extremes, counting 16 keys at a time.
int32_t KthLargest(const int32_t* keys, int64_t n, int64_t k) {
  int64_t lo = keys[0], hi = keys[0];
  for (int64_t i = 1; i < n; ++i) {
    lo = std::min<int64_t>(lo, keys[i]);
    hi = std::max<int64_t>(hi, keys[i]);
  }
  while (lo < hi) {  // count(keys >= lo) >= k throughout
    const int64_t mid = lo + (hi - lo + 1) / 2;
    int64_t count = 0, i = 0;
#if defined(__AVX512F__)
    const __m512i t = _mm512_set1_epi32(static_cast<int32_t>(mid));
    for (; i + 16 <= n; i += 16)
      count += __builtin_popcount(_mm512_cmpge_epi32_mask(_mm512_loadu_si512(keys + i), t));
#endif
    for (; i < n; ++i) count += keys[i] >= mid;
    if (count == k) return static_cast<int32_t>(mid);
    if (count > k) lo = mid; else hi = mid - 1;
  }
  return static_cast<int32_t>(lo);
}

struct TopKScratch {
  std::vector<int32_t> keys;
  std::vector<int64_t> above;
};

// jax.lax.top_k's indices: the k largest of x[0, n) by OrderKey, ties to the lower
// index, into idx[0, k) (k <= n), in that order.
void TopK(const float* x, int64_t n, int64_t k, std::vector<int32_t>& idx, TopKScratch& s) {
  idx.resize(k);
  if (k <= 0) return;
  s.keys.resize(n);
  for (int64_t i = 0; i < n; ++i) s.keys[i] = OrderKey(x[i]);
  const int32_t kth = KthLargest(s.keys.data(), n, k);
  // the keys above the k-th, ordered by key (then index); then the k-th's ties in
  // index order, as many as fit
  s.above.clear();
  for (int64_t i = 0; i < n; ++i)
    if (s.keys[i] > kth)
      s.above.push_back((static_cast<int64_t>(s.keys[i]) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(i)));
  std::sort(s.above.begin(), s.above.end(), std::greater<int64_t>());
  int64_t m = 0;
  for (int64_t key : s.above) idx[m++] = static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(key));
  for (int64_t i = 0; i < n && m < k; ++i)
    if (s.keys[i] == kth) idx[m++] = static_cast<int32_t>(i);
}

// attention._first_argmax: the first maximum's index, the first NaN's if any, 0 if
// every entry is -inf.
int64_t FirstArgmax(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

struct Entry {
  float score;
  int32_t page;
};

// bound [B,H,G,N] f32 and ranked [B,H,N] f32 (the stickiness bonus added), table
// [B,N] s32, lead [B,H] s32 (how many of plain Quest's top pages lead the group's
// candidates; read only when quest != 0) -> pages [B,H,k] s32: `_select`'s
// candidate logical pages in page order, -1 last. per_head: bound pages per query
// head; k: candidates.
ffi::Error RankPagesImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> bound,
                         ffi::Buffer<ffi::F32> ranked, ffi::Buffer<ffi::S32> table,
                         ffi::Buffer<ffi::S32> lead, ffi::ResultBuffer<ffi::S32> pages,
                         int64_t per_head, int64_t k, bool quest) {
  auto bd = bound.dimensions();
  if (bd.size() != 4 || ranked.dimensions().size() != 3 || table.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("hisparse rank_pages: ranks");
  const int64_t B = bd[0], H = bd[1], G = bd[2], N = bd[3];
  if (k > N || per_head > N || k < 0 || per_head < 0 || pages->dimensions()[2] != k)
    return ffi::Error::InvalidArgument("hisparse rank_pages: shapes");
  const float inf = std::numeric_limits<float>::infinity();
  ParallelFor(pool, B * H, [&](int64_t bh) {
      const int64_t b = bh / H;
      const float* bo = bound.typed_data() + bh * G * N;
      const int32_t* ids = table.typed_data() + b * N;
      std::vector<int32_t> idx;
      TopKScratch keys;
      std::vector<Entry> entries;  // in the order of XLA's concatenation
      if (quest) {
        std::vector<float> top(N);  // plain Quest's scores
        for (int64_t n = 0; n < N; ++n) top[n] = GroupMax(bo, G, N, n);
        TopK(top.data(), N, k, idx, keys);
        const int32_t use = lead.typed_data()[bh];
        for (int64_t i = 0; i < k; ++i) {
          const bool ok = i < use && top[idx[i]] > -inf;
          entries.push_back({ok ? 3.0f - static_cast<float>(i) / static_cast<float>(k) : -inf,
                             idx[i]});
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float* x = bo + g * N;
        TopK(x, N, per_head, idx, keys);
        for (int64_t i = 0; i < per_head; ++i)
          entries.push_back({x[idx[i]] > -inf ? 2.0f : -inf, idx[i]});
        const int64_t a = FirstArgmax(x, N);
        for (int64_t side : {a - 1, a + 1}) {
          const int64_t at = std::min<int64_t>(std::max<int64_t>(side, 0), N - 1);
          const bool ok = side >= 0 && side < N && ids[at] >= 0;
          entries.push_back({ok ? 1.5f : -inf, static_cast<int32_t>(at)});
        }
      }
      // A page listed twice keeps its best copy (Quest's, then a bound pick's, then
      // a side page's; the first of equals); the others score -inf.
      const int64_t E = entries.size();
      auto rank = [&](const Entry& e) {
        return e.score > 2.0f ? 0 : e.score == 2.0f ? 1 : e.score > -inf ? 2 : 3;
      };
      std::vector<float> center(ranked.typed_data() + bh * N, ranked.typed_data() + (bh + 1) * N);
      std::vector<int32_t> best(N, -1);  // each page's best copy
      for (int64_t i = 0; i < E; ++i) {
        const Entry& e = entries[i];
        if (e.score > -inf) center[e.page] = -inf;  // taken
        int32_t& b = best[e.page];
        if (b < 0 || rank(e) < rank(entries[b])) b = static_cast<int32_t>(i);
      }
      for (int64_t i = 0; i < E; ++i)
        if (best[entries[i].page] != i) entries[i].score = -inf;
      // Then the pages with the most estimated mass among those not taken.
      TopK(center.data(), N, k, idx, keys);
      for (int64_t i = 0; i < k; ++i)
        entries.push_back({center[idx[i]] > -inf ? 1.0f - static_cast<float>(i) / static_cast<float>(k)
                                                 : -inf, idx[i]});
      std::vector<float> priority(entries.size());
      for (size_t i = 0; i < entries.size(); ++i) priority[i] = entries[i].score;
      TopK(priority.data(), priority.size(), k, idx, keys);
      int32_t* out = pages->typed_data() + bh * k;
      for (int64_t i = 0; i < k; ++i)
        out[i] = priority[idx[i]] > -inf ? entries[idx[i]].page : static_cast<int32_t>(N);
      std::sort(out, out + k);
      for (int64_t i = 0; i < k; ++i) out[i] = out[i] < N ? out[i] : -1;
  });
  return ffi::Error::Success();
}

// Sums in the reference's order (attention.row_sum: a chain of adds, or a
// cumulative sum's last element; both left to right).
inline float ChainSum(const float* x, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += x[i];
  return s;
}

// Draw d of `draws` systematic draws with offset u from cdf [n] (not normalized),
// as attention._systematic: the first entry whose cdf passes the point.
inline int64_t SystematicDraw(const std::vector<float>& cdf, float u, int64_t d, int64_t draws) {
  const float point = (u + static_cast<float>(d)) / static_cast<float>(draws) * cdf.back();
  const int64_t at = std::upper_bound(cdf.begin(), cdf.end(), point) - cdf.begin();
  return std::min<int64_t>(at, static_cast<int64_t>(cdf.size()) - 1);
}

// mass [B,H,N] f32 (log estimated mass, -inf: not a candidate), pages [B,H,K] s32
// (the selection, -1: none), u [B,2,H] f32 (the two samples' offsets) ->
// idx [B,H,n_u+n_s] s32 (-1: none), logw [B,H,n_u+n_s] f32:
// attention.sample_tail's systematic samples of the unselected candidates, n_u
// uniform and n_s by estimated mass, each weighted by 1 / its expected draws.
ffi::Error SampleTailImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> mass,
                          ffi::Buffer<ffi::S32> pages, ffi::Buffer<ffi::F32> offsets,
                          ffi::ResultBuffer<ffi::S32> idx, ffi::ResultBuffer<ffi::F32> logw,
                          int64_t n_u, int64_t n_s) {
  auto md = mass.dimensions();
  auto pd = pages.dimensions();
  if (md.size() != 3 || pd.size() != 3 || offsets.dimensions().size() != 3)
    return ffi::Error::InvalidArgument("hisparse sample_tail: ranks");
  const int64_t B = md[0], H = md[1], N = md[2], K = pd[2], n = n_u + n_s;
  if (pd[0] != B || pd[1] != H || idx->dimensions()[2] != n || N == 0)
    return ffi::Error::InvalidArgument("hisparse sample_tail: shapes");
  const float inf = std::numeric_limits<float>::infinity();
  ParallelFor(pool, B * H, [&](int64_t bh) {
      const int64_t b = bh / H, h = bh % H;
      const float* m = mass.typed_data() + bh * N;
      std::vector<uint8_t> free(N);
      int64_t n_cand = 0;
      for (int64_t i = 0; i < N; ++i) {
        free[i] = m[i] > -inf;
        n_cand += free[i];
      }
      std::vector<float> cand_cdf(N), share(N), cdf(N);
      float run = 0.f;
      for (int64_t i = 0; i < N; ++i) cand_cdf[i] = run += free[i];
      const int32_t* sel = pages.typed_data() + bh * K;
      for (int64_t k = 0; k < K; ++k)
        if (sel[k] >= 0 && sel[k] < N) free[sel[k]] = 0;
      float top = -inf;
      for (int64_t i = 0; i < N; ++i)
        if (free[i] && m[i] > top) top = m[i];
      const float shift = std::isfinite(top) ? top : 0.f;
      for (int64_t i = 0; i < N; ++i) share[i] = free[i] ? std::exp(m[i] - shift) : 0.f;
      const float total = std::max(ChainSum(share.data(), N), 1e-30f);
      run = 0.f;
      for (int64_t i = 0; i < N; ++i) {
        share[i] /= total;
        cdf[i] = run += share[i];
      }
      int32_t* io = idx->typed_data() + bh * n;
      float* wo = logw->typed_data() + bh * n;
      const float cands = static_cast<float>(std::max<int64_t>(n_cand, 1));
      int64_t j = 0;
      for (int s = 0; s < 2; ++s) {
        const int64_t draws = s == 0 ? n_u : n_s;
        const std::vector<float>& c = s == 0 ? cand_cdf : cdf;
        const float u = offsets.typed_data()[(b * 2 + s) * H + h];
        for (int64_t d = 0; d < draws; ++d, ++j) {
          const int64_t at = SystematicDraw(c, u, d, draws);
          const float expected = static_cast<float>(n_u * free[at]) / cands
                                 + static_cast<float>(n_s) * share[at];
          const bool ok = free[at] && expected > 0;
          io[j] = ok ? static_cast<int32_t>(at) : -1;
          wo[j] = ok ? -std::log(expected) : 0.f;
        }
      }
  });
  return ffi::Error::Success();
}

// attention._quest_floor for one group: score [C] (-1: not valid) with every page
// outside the chosen set at -1. share [G][C] (0 where not valid), sharp [G], slack
// [G], bound [G][C] (Quest's bound of each candidate).
void QuestFloor(std::vector<float>& score, const std::vector<float>& share, const bool* sharp,
                const float* slack, const std::vector<float>& bound, int64_t G, int64_t C,
                int64_t k, TopKScratch& scratch) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> qb(C);
  std::vector<uint8_t> valid(C);
  for (int64_t c = 0; c < C; ++c) {
    valid[c] = score[c] > 0;
    const float m = GroupMax(bound.data(), G, C, c);
    qb[c] = valid[c] && !std::isnan(m) ? m : -inf;
  }
  std::vector<int32_t> order_s, order_q;
  TopK(score.data(), C, C, order_s, scratch);
  TopK(qb.data(), C, C, order_q, scratch);
  std::vector<int32_t> rank_s(C);
  for (int64_t i = 0; i < C; ++i) rank_s[order_s[i]] = static_cast<int32_t>(i);
  std::vector<uint8_t> member(C), best_member(C);
  std::vector<float> mass0(G), mass(G);
  float best_total = -inf;  // j = 0 (Quest's set) always qualifies: total >= 0
  for (int64_t j = 0; j <= k; ++j) {
    int64_t fill = 0;
    for (int64_t c = 0; c < C; ++c) member[c] = valid[c] && rank_s[c] < j;
    for (int64_t i = 0; i < C && fill < k - j; ++i) {
      const int32_t c = order_q[i];
      if (valid[c] && !member[c]) {
        member[c] = 1;
        ++fill;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.f;
      for (int64_t c = 0; c < C; ++c) sum += member[c] ? share[g * C + c] : 0.f;
      mass[g] = sum;
    }
    if (j == 0) mass0 = mass;
    bool ok = true;
    for (int64_t g = 0; g < G; ++g) ok &= mass[g] >= mass0[g] - slack[g] || !sharp[g];
    const float total = ok ? ChainSum(mass.data(), G) : -1.f;
    if (total >= best_total) {  // on ties the larger j
      best_total = total;
      best_member = member;
    }
  }
  for (int64_t c = 0; c < C; ++c)
    if (!best_member[c]) score[c] = -1.f;
}

// attention.rerank on the CPU, for `_attend_cpu`: raw [B,H,G,L,T] f32 (`cold_logits`
// of the listed pages, the C candidates first); slots [B,H,C] s32 (their pool
// pages, -1: none); win_lse [B,H,G] f32 (the window's log-sum-exp); q [B,H,G,D] f32
// (unscaled); int4_k [L',H,P,T,D/2] u8, center [L',H,P,D] bf16, radius [L',H,P,D]
// e4m3 (or its bits), layer s32[] (the candidates' Quest bounds, for the floor);
// u [B,H] f32 (the sample's offsets) -> kept [B,H,k] s32, drawn [B,H,m] s32 (indices
// into the candidates, -1: none), drawn_logw [B,H,m] f32. floor >= 1: no floor.
// The floor runs per group, where one of its heads is sharp (XLA's runs for every
// group once one is: the same set, where no head is sharp).
ffi::Error RerankImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> raw, ffi::Buffer<ffi::S32> slots,
                      ffi::Buffer<ffi::F32> win_lse, ffi::Buffer<ffi::F32> q,
                      ffi::Buffer<ffi::U8> int4_k, ffi::Buffer<ffi::BF16> center,
                      ffi::AnyBuffer radius, ffi::Buffer<ffi::S32> layer,
                      ffi::Buffer<ffi::F32> offsets, ffi::ResultBuffer<ffi::S32> kept,
                      ffi::ResultBuffer<ffi::S32> drawn, ffi::ResultBuffer<ffi::F32> drawn_logw,
                      float sm_scale, float floor, float slack_share, float uniform_share,
                      bool mass_weight) {
  auto rd = raw.dimensions();
  auto sd = slots.dimensions();
  auto kd = int4_k.dimensions();
  if (rd.size() != 5 || sd.size() != 3 || kd.size() != 5 || q.dimensions().size() != 4)
    return ffi::Error::InvalidArgument("hisparse rerank: ranks");
  const int64_t B = rd[0], H = rd[1], G = rd[2], L = rd[3], T = rd[4], C = sd[2];
  const int64_t D = q.dimensions()[3], half = D / 2;
  const int64_t k = kept->dimensions()[2], m = drawn->dimensions()[2];
  if (C > L || k > C || G > kMaxGroup || D > kMaxDim || kd[3] != T || kd[4] != half)
    return ffi::Error::InvalidArgument("hisparse rerank: shapes");
  if (radius.element_type() != ffi::DataType::F8E4M3FN &&
      radius.element_type() != ffi::DataType::U8)
    return ffi::Error::InvalidArgument("hisparse rerank: radius must be e4m3 (or its bits)");
  const int32_t l = layer.typed_data()[0];
  const Pool kpool = MakePool(kd, l), dpool = MakePool(center.dimensions(), l);
  const uint16_t* cp = reinterpret_cast<const uint16_t*>(center.typed_data());
  const uint8_t* rp = static_cast<const uint8_t*>(radius.untyped_data());
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  ParallelFor(pool, B * H, [&](int64_t bh) {
      const int64_t h = bh % H;
      const int32_t* sl = slots.typed_data() + bh * C;
      std::vector<float> share(G * C), page(T);
      float top[kMaxGroup], window[kMaxGroup];
      for (int64_t g = 0; g < G; ++g) {
        const float* r = raw.typed_data() + (bh * G + g) * L * T;
        float mx = -inf;
        bool has_nan = false;
        for (int64_t c = 0; c < C; ++c) {
          if (sl[c] < 0) continue;
          for (int64_t t = 0; t < T; ++t) {
            const float x = r[c * T + t] * sm_scale;
            has_nan |= std::isnan(x);
            mx = x > mx ? x : mx;
          }
        }
        top[g] = has_nan ? nan : mx;
        const float shift = std::isfinite(top[g]) ? top[g] : 0.f;
        for (int64_t c = 0; c < C; ++c) {
          if (sl[c] < 0) {
            share[g * C + c] = 0.f;
            continue;
          }
          for (int64_t t = 0; t < T; ++t) page[t] = std::exp(r[c * T + t] * sm_scale - shift);
          share[g * C + c] = ChainSum(page.data(), T);
        }
        const float total = ChainSum(share.data() + g * C, C);
        const float div = std::max(total, 1e-30f);
        for (int64_t c = 0; c < C; ++c) share[g * C + c] /= div;
        // each head's mass on the window, in units of its candidates' mass
        const float cand_lse = top[g] + std::log(total);
        const float w = std::exp(std::min(win_lse.typed_data()[bh * G + g] - cand_lse, 80.f));
        window[g] = std::isnan(w) ? 0.f : w;
      }
      std::vector<float> group(C), score(C);
      for (int64_t c = 0; c < C; ++c) {
        float sum = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          const float x = mass_weight ? share[g * C + c] / (1.f + window[g]) : share[g * C + c];
          sum = g ? sum + x : x;
        }
        group[c] = sum;
        score[c] = sum > 0 ? sum : -1.f;
      }
      TopKScratch scratch;
      if (floor < 1.f && k < C) {
        bool sharp[kMaxGroup], any = false;
        float slack[kMaxGroup];
        for (int64_t g = 0; g < G; ++g) {
          float mx = 0.f;
          for (int64_t c = 0; c < C; ++c) {
            if (!(group[c] > 0)) share[g * C + c] = 0.f;
            mx = std::max(mx, share[g * C + c]);
          }
          sharp[g] = mx > floor * (1.f + window[g]);
          any |= sharp[g];
          slack[g] = slack_share * (1.f + window[g]);
        }
        if (any) {  // the candidates' Quest bounds from their int4 codes' ranges
          std::vector<float> bound(G * C, -inf);
          const float* qb = q.typed_data() + bh * G * D;
          float lo[kMaxDim], hi[kMaxDim];
          for (int64_t c = 0; c < C; ++c) {
            if (sl[c] < 0) continue;
            const uint8_t* codes = int4_k.typed_data() + kpool.Page(h, sl[c]);
            const uint16_t* cen = cp + dpool.Page(h, sl[c]);
            const uint8_t* rad = rp + dpool.Page(h, sl[c]);
            uint8_t cmin[kMaxDim], cmax[kMaxDim];
            std::fill_n(cmin, D, 15);
            std::fill_n(cmax, D, 0);
            for (int64_t t = 0; t < T; ++t)
              for (int64_t d = 0; d < half; ++d) {
                const uint8_t b = codes[t * half + d], a = b & 0xF, z = b >> 4;
                cmin[d] = std::min(cmin[d], a); cmax[d] = std::max(cmax[d], a);
                cmin[d + half] = std::min(cmin[d + half], z);
                cmax[d + half] = std::max(cmax[d + half], z);
              }
            for (int64_t d = 0; d < D; ++d) {
              const float cv = Bf16(cen[d]), rv = kE4m3.v[rad[d]];
              const float base = cv - rv, step = rv * kInt4Step;
              lo[d] = base + step * cmin[d];
              hi[d] = base + step * cmax[d];
            }
            for (int64_t g = 0; g < G; ++g) {
              float pos = 0.f, neg = 0.f;
              for (int64_t d = 0; d < D; ++d) {
                const float x = qb[g * D + d] * sm_scale;
                pos += std::max(x, 0.f) * hi[d];
                neg += std::min(x, 0.f) * lo[d];
              }
              bound[g * C + c] = pos + neg;
            }
          }
          QuestFloor(score, share, sharp, slack, bound, G, C, k, scratch);
        }
      }
      std::vector<int32_t> idx;
      TopK(score.data(), C, k, idx, scratch);
      int32_t* ko = kept->typed_data() + bh * k;
      std::vector<uint8_t> free(C);
      int64_t n_free = 0;
      for (int64_t c = 0; c < C; ++c) free[c] = group[c] > 0;
      for (int64_t i = 0; i < k; ++i) {
        ko[i] = score[idx[i]] > 0 ? idx[i] : -1;
        if (ko[i] >= 0) free[ko[i]] = 0;
      }
      if (m == 0) return;
      std::vector<float> prob(C), cdf(C);
      for (int64_t c = 0; c < C; ++c) {
        prob[c] = free[c] ? group[c] : 0.f;
        n_free += free[c];
      }
      const float div = std::max(ChainSum(prob.data(), C), 1e-30f);
      const float nf = static_cast<float>(std::max<int64_t>(n_free, 1));
      float run = 0.f;
      for (int64_t c = 0; c < C; ++c) {
        prob[c] = uniform_share * (static_cast<float>(free[c]) / nf)
                  + (1.f - uniform_share) * (prob[c] / div);
        cdf[c] = run += prob[c];
      }
      const float u = offsets.typed_data()[bh];
      int32_t* dout = drawn->typed_data() + bh * m;
      float* wout = drawn_logw->typed_data() + bh * m;
      for (int64_t j = 0; j < m; ++j) {
        const int64_t at = SystematicDraw(cdf, u, j, m);
        const bool ok = free[at] && prob[at] > 0;
        dout[j] = ok ? static_cast<int32_t>(at) : -1;
        wout[j] = ok ? -std::log(static_cast<float>(m) * prob[at]) : 0.f;
      }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparsePageScores, PageScoresImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseRankPages, RankPagesImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("per_head")
                                  .Attr<int64_t>("k")
                                  .Attr<bool>("quest"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseSampleTail, SampleTailImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("n_u")
                                  .Attr<int64_t>("n_s"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HisparseRerank, RerankImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("floor")
                                  .Attr<float>("slack_share")
                                  .Attr<float>("uniform_share")
                                  .Attr<bool>("mass_weight"));
