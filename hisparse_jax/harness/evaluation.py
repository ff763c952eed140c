"""Quality of HiSparse against exact dense attention (DESIGN §4 definitions).

For N decode queries at position S over S cached tokens, per (query, query head):
- recall: exact softmax mass on the tokens HiSparse attends;
- rel_error: ||o_hisparse - o_dense|| / ||o_dense||, split into selection error
  (vs the same quantized cache with every page attended) and quantization error
  (that all-pages output vs dense);
- top10_recall: share of the 10 heaviest tokens attended;
- oracle_recall: recall of an oracle that, under the same budget and per KV head,
  keeps the cold pages with the most true mass (sink/hot/warm as HiSparse);
  oracle_selection_error is that oracle's selection error: what no selection
  within the budget can avoid on this attention, unless the mass it leaves out
  is estimated.
HiSparse estimates it from an importance sample of the pages it does not attend
(`attention.sample_tail`, and `attention.rerank` for rejected candidates);
unsampled_selection_error is its selection error without that estimate. Recall
counts the attended pages only (the budget the re-rank kept): a sampled page is
read, but it stands for many pages, not for its own mass.

The exact weights are reduced to per-page masses a few queries at a time
(`ExactMass`), so memory does not grow with queries x heads x context.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.attention import attend_pages, decode_attention, dense_decode_attention
from hisparse_jax.backends import resolve_implementation
from hisparse_jax.cache import layout
from hisparse_jax.cache.handle import HiSparseCache
from hisparse_jax.cache.state import slot_positions
from hisparse_jax.config import FULL_BUDGET, HiSparseConfig


def config_for(cfg: HiSparseConfig, k: np.ndarray, gqa_group: int) -> HiSparseConfig:
    """`cfg` reshaped to hold one sequence of k [S, Hkv, D]. The value group becomes
    the largest divisor of D/2 up to the preset's: 16 channels at head_dim 32, 24
    at 96, 20 at 80 (groups may not straddle the two packed halves)."""
    s, hkv, d = k.shape
    pg = cfg.page_size
    half = max(1, d // 2)
    group = max(x for x in range(1, min(cfg.value_group, half) + 1) if half % x == 0)
    return cfg.replace(num_kv_heads=hkv, gqa_group=gqa_group, head_dim=d, max_seqs=1,
                       value_group=group,
                       max_context=max(pg, -(-s // pg) * pg), num_pool_pages=None)


@jax.jit
def _softmax(qc: jax.Array, kk: jax.Array) -> jax.Array:
    """Exact softmax weights [c, Hq, S] (float32) of queries [c, Hq, D] over kk [Hkv, S, D]."""
    c, hq, d = qc.shape
    hkv = kk.shape[0]
    logits = jnp.einsum("nhgd,hsd->nhgs", qc.reshape(c, hkv, hq // hkv, d), kk) / math.sqrt(d)
    return jax.nn.softmax(logits, axis=-1).reshape(c, hq, -1)


@functools.partial(jax.jit, static_argnames=("page_size",))
def _page_masses(qc, kk, cold, *, page_size):
    """(mass on each page's candidate tokens [c, Hq, P], mass on the sink/hot/warm
    slots [c, Hq], the 10 heaviest tokens [c, Hq, min(10, S)]); cold [P * page] bool,
    False for those slots and for padding."""
    w = _softmax(qc, kk)
    s = w.shape[-1]
    wpad = jnp.pad(w, ((0, 0), (0, 0), (0, cold.shape[0] - s)))
    page = jnp.where(cold, wpad, 0.0).reshape(*w.shape[:2], -1, page_size).sum(-1)
    always = jnp.where(cold, 0.0, wpad).sum(-1)
    return page, always, jax.lax.top_k(w, min(10, s))[1]


def always_attended(cfg: HiSparseConfig, s: int) -> np.ndarray:
    """[S] bool: the live sink/hot/warm slots of a sequence of s tokens (attended by
    every query, never selection candidates)."""
    always = np.zeros(s, bool)
    for p in slot_positions(cfg, jnp.array([s])):
        p = np.asarray(p[0])
        always[p[p >= 0]] = True
    return always


@dataclasses.dataclass
class ExactMass:
    """Exact attention of N queries over one sequence, kept page by page.

    Recall, top-10 recall and the oracle need only each page's mass, so the
    [N, Hq, S] weights are never held at once: at 1M tokens and 32 query heads
    they are 128 MiB per query.
    """
    page_mass: np.ndarray    # [N, Hq, P] mass on each page's candidate tokens
    always_mass: np.ndarray  # [N, Hq] mass on the sink/hot/warm slots
    top10: np.ndarray        # [N, Hq, min(10, S)] the heaviest tokens
    always: np.ndarray       # [S] bool, the sink/hot/warm slots
    page_size: int
    q: np.ndarray            # [N, Hq, D] float32, kept to recompute token weights
    kk: jax.Array            # [Hkv, S, D] float32, the keys head-major (as dense attention)

    @classmethod
    def compute(cls, cfg: HiSparseConfig, q: np.ndarray, k: np.ndarray,
                chunk_bytes: int = 1 << 28) -> ExactMass:
        """For queries q [N, Hq, D] (float32) over keys k [S, Hkv, D] (any float dtype,
        read as float32 on the device), a few queries at a time (about `chunk_bytes`
        of weights each)."""
        n, hq, _ = q.shape
        s = k.shape[0]
        pg = cfg.page_size
        always = always_attended(cfg, s)
        cold = jnp.asarray(np.pad(~always, (0, -s % pg)))
        chunk = max(1, min(n, chunk_bytes // (hq * s * 4)))
        qpad = np.pad(q, ((0, -n % chunk), (0, 0), (0, 0)))  # one shape, one compile
        kk = jnp.asarray(k, jnp.float32).transpose(1, 0, 2)
        parts = [_page_masses(jnp.asarray(qpad[i:i + chunk]), kk, cold, page_size=pg)
                 for i in range(0, n, chunk)]
        page, alw, top10 = (np.concatenate([np.asarray(p[j]) for p in parts])[:n]
                            for j in range(3))
        return cls(page_mass=page, always_mass=alw, top10=top10, always=always,
                   page_size=pg, q=q, kk=kk)

    def token_weights(self, n: int) -> np.ndarray:
        """[Hq, S] exact weights of query n."""
        return np.asarray(_softmax(jnp.asarray(self.q[n:n + 1]), self.kk)[0])

    def page_mask(self, pages: np.ndarray) -> np.ndarray:
        """pages [N, Hkv, K] logical ids (-1 = none) -> [N, Hkv, P] bool."""
        pages = np.asarray(pages)
        npg = self.page_mass.shape[-1]
        mask = np.zeros((*pages.shape[:2], npg), bool)
        ni, hi, ki = np.nonzero((pages >= 0) & (pages < npg))
        mask[ni, hi, pages[ni, hi, ki]] = True
        return mask

    def _per_query_head(self, mask):
        return np.repeat(mask, self.page_mass.shape[1] // mask.shape[1], axis=1)

    def recall(self, pages: np.ndarray) -> np.ndarray:
        """[N, Hq]: the exact mass on the tokens attended when each KV head reads the
        sink/hot/warm slots and its `pages` [N, Hkv, K] (DESIGN §4)."""
        mask = self._per_query_head(self.page_mask(pages))
        return self.always_mass + np.sum(np.where(mask, self.page_mass, 0.0), axis=-1)

    def top10_recall(self, pages: np.ndarray) -> np.ndarray:
        """[N, Hq]: share of each head's 10 heaviest tokens that are attended."""
        mask = self._per_query_head(self.page_mask(pages))
        hit = np.take_along_axis(mask, self.top10 // self.page_size, axis=-1)
        return (hit | self.always[self.top10]).mean(-1)

    def attended_fraction(self, pages: np.ndarray) -> float:
        """Mean share of the sequence's tokens each KV head attends."""
        s, pg = self.always.size, self.page_size
        cold_tokens = np.pad(~self.always, (0, self.page_mass.shape[-1] * pg - s))
        cold_tokens = cold_tokens.reshape(-1, pg).sum(-1)
        return float((self.page_mask(pages) @ cold_tokens + self.always.sum()).mean() / s)

    def oracle(self, budget_pages: int) -> np.ndarray:
        """The oracle's selection [N, Hkv, budget_pages] (-1 = none): per KV head, the
        cold pages with the most exact mass summed over the group's query heads. This
        maximizes the group's summed recall: no selection of as many pages recalls
        more."""
        n, hq, npg = self.page_mass.shape
        hkv = self.kk.shape[0]
        group = self.page_mass.reshape(n, hkv, hq // hkv, npg).sum(axis=2)
        best = np.argsort(-group, axis=-1)[..., :min(budget_pages, npg)]
        return np.where(np.take_along_axis(group, best, axis=-1) > 0, best, -1)


@dataclasses.dataclass
class Evaluation:
    """Per (query, query head) arrays, plus what was attended."""
    recall: np.ndarray          # [N, Hq]
    oracle_recall: np.ndarray   # [N, Hq]
    rel_error: np.ndarray       # [N, Hq]
    selection_error: np.ndarray  # [N, Hq]
    oracle_selection_error: np.ndarray  # [N, Hq]
    unsampled_selection_error: np.ndarray  # [N, Hq] selected pages only, no tail estimate
    quant_error: np.ndarray     # [N, Hq]
    top10_recall: np.ndarray    # [N, Hq]
    attended_fraction: float
    selected_pages: np.ndarray  # [N, Hkv, K] logical pages (-1 = none)
    exact: ExactMass
    config: HiSparseConfig

    def oracle_recall_at(self, budget_tokens: int) -> np.ndarray:
        """Recall [N, Hq] of the oracle given `budget_tokens` of cold pages per KV
        head: how large a budget this attention needs, whatever the selection."""
        return self.exact.recall(self.exact.oracle(-(-budget_tokens // self.config.page_size)))

    def summary(self, heads=None, oracle_budgets=()) -> dict:
        """Metrics over the given query heads (all by default), and with
        `oracle_budgets` (cold tokens) the oracle's recall at each of them
        (`oracle_recall_at_budget`)."""
        sel = slice(None) if heads is None else np.asarray(heads)

        def m(x):
            return x[:, sel].ravel()
        cap = layout.capacity_report(self.config, self.config.max_context)
        out = {
            "recall_mean": float(m(self.recall).mean()),
            "recall_p5": float(np.percentile(m(self.recall), 5)),
            "oracle_recall_mean": float(m(self.oracle_recall).mean()),
            "recall_vs_oracle": float(m(self.recall).mean() / max(m(self.oracle_recall).mean(),
                                                                 1e-12)),
            "rel_error_mean": float(m(self.rel_error).mean()),
            "rel_error_p95": float(np.percentile(m(self.rel_error), 95)),
            "selection_error_mean": float(m(self.selection_error).mean()),
            "oracle_selection_error_mean": float(m(self.oracle_selection_error).mean()),
            "unsampled_selection_error_mean": float(m(self.unsampled_selection_error).mean()),
            "quant_error_mean": float(m(self.quant_error).mean()),
            "quant_error_p95": float(np.percentile(m(self.quant_error), 95)),
            "top10_recall": float(m(self.top10_recall).mean()),
            "attended_fraction": self.attended_fraction,
            "device_bytes_per_token": cap["device_bytes_per_token"],
            "capacity_vs_bf16": cap["capacity_vs_bf16"],
        }
        if oracle_budgets:
            out["oracle_recall_at_budget"] = {
                str(b): float(m(self.oracle_recall_at(b)).mean()) for b in oracle_budgets}
        return out


def _attend_all(cfg, state, q, implementation):
    def one(qi):
        return decode_attention(cfg, state, qi[None], implementation=implementation,
                                return_selection=True)
    outs, sel = [], []
    for i in range(q.shape[0]):  # one query at a time keeps memory flat at 1M tokens
        o, s = one(jnp.asarray(q[i]))
        outs.append(np.asarray(o[0]))
        sel.append(np.asarray(s[0]))
    return np.stack(outs), np.stack(sel)


def selection_recall(cfg: HiSparseConfig, q: np.ndarray, k: np.ndarray,
                     selected: np.ndarray) -> np.ndarray:
    """Attention-mass recall [N, Hq] of given selections (DESIGN §4): queries q
    [N, Hq, D] over one sequence's keys k [S, Hkv, D], selected [N, Hkv, K]."""
    exact = ExactMass.compute(cfg, np.asarray(q, np.float32), k)
    return exact.recall(selected)


def evaluate(cfg: HiSparseConfig, q: np.ndarray, k: np.ndarray, v: np.ndarray, *,
             implementation=None, log=None) -> Evaluation:
    """Evaluate HiSparse for queries q [N, Hq, D] over one sequence k, v [S, Hkv, D].
    `log` (e.g. print) gets a line per pass: at 1M tokens each takes minutes."""
    log = log or (lambda msg: None)
    # float16 k, v stay float16 on the host (half the bytes of a copy); the cache
    # and the exact attention read them as float32 on the device.
    q = np.asarray(q, np.float32)
    k, v = (x if x.dtype in (np.float16, np.float32) else x.astype(np.float32)
            for x in (np.asarray(k), np.asarray(v)))
    if q.ndim != 3 or k.ndim != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"q must be [N, Hq, D] and k, v [S, Hkv, D] with the same D, got "
                         f"q {q.shape}, k {k.shape}, v {v.shape}")
    if 0 in q.shape or 0 in k.shape:
        raise ValueError(f"empty input: q {q.shape}, k {k.shape}")
    n, hq, _ = q.shape
    s, hkv, _ = k.shape
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    cfg = config_for(cfg, k, hq // hkv)
    log(f"[1/5] filling the cache with {s} tokens "
        f"({resolve_implementation(implementation, cfg)} kernels) ...")
    cache = HiSparseCache(cfg, implementation)
    cache.prefill(0, k, v)
    log(f"[2/5] HiSparse decode attention, {n} queries ...")
    out, selected = _attend_all(cfg, cache.state, q, implementation)
    log(f"[3/5] every page attended (quantization error alone), {n} queries ...")
    out_all, _ = _attend_all(cfg.replace(budget_tokens=FULL_BUDGET), cache.state, q,
                             implementation)
    log(f"[4/5] exact dense attention, {n} queries ...")
    exact = ExactMass.compute(cfg, q, k)
    vd = jnp.asarray(v, jnp.float32).transpose(1, 0, 2)[None]
    dense = np.stack([np.asarray(dense_decode_attention(jnp.asarray(q[i:i + 1]), exact.kk[None],
                                                        vd, jnp.array([s]))[0]) for i in range(n)])
    del vd
    oracle_ids = exact.oracle(cfg.budget_pages)
    log(f"[5/5] the oracle's pages, and the selection without its tail estimate, "
        f"{n} queries ...")

    def attend_only(pages):  # [N, Hkv, K] logical -> outputs without a tail sample
        return np.stack([np.asarray(attend_pages(
            cfg, cache.state, jnp.asarray(q[i:i + 1]), jnp.asarray(pages[i:i + 1], jnp.int32),
            implementation=implementation)[0]) for i in range(n)])
    out_oracle = attend_only(oracle_ids)
    out_unsampled = attend_only(selected)

    def rel(a, b):
        return np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(b, axis=-1), 1e-30)

    return Evaluation(
        recall=exact.recall(selected), oracle_recall=exact.recall(oracle_ids),
        rel_error=rel(out, dense),
        selection_error=rel(out, out_all), oracle_selection_error=rel(out_oracle, out_all),
        unsampled_selection_error=rel(out_unsampled, out_all),
        quant_error=rel(out_all, dense),
        top10_recall=exact.top10_recall(selected),
        attended_fraction=exact.attended_fraction(selected),
        selected_pages=selected, exact=exact, config=cfg)


def _needle_pages(ev: Evaluation, targets: np.ndarray):
    """For each retrieval query head: ({page: exact mass of its needle tokens},
    pages attended anyway, pages selected). targets [N, Hq, 2]: the token span
    (start, end) each query head asks for, -1 where none."""
    pg, g = ev.config.page_size, ev.config.gqa_group
    live = set((np.flatnonzero(ev.exact.always) // pg).tolist())
    weights, weights_of = None, None
    for n, hq in zip(*np.nonzero(targets[..., 0] >= 0)):  # in query order
        if weights_of != n:
            weights, weights_of = ev.exact.token_weights(n), n
        start, end = targets[n, hq]
        masses = {p: float(weights[hq, max(start, p * pg):min(end, (p + 1) * pg)].sum())
                  for p in range(start // pg, (end - 1) // pg + 1)}
        yield masses, live, set(ev.selected_pages[n, hq // g].tolist())


def needle_pages_hit(ev: Evaluation, targets: np.ndarray, min_mass: float = 0.0
                     ) -> tuple[int, int]:
    """(needle cold pages selected, needle cold pages) over all retrieval queries.
    A page counts when its needle tokens carry more than `min_mass` of the head's
    exact attention (0 = every page the span touches) and it is a candidate."""
    hit = total = 0
    for masses, live, chosen in _needle_pages(ev, targets):
        for p, mass in masses.items():
            if p not in live and mass > min_mass:
                total += 1
                hit += p in chosen
    return hit, total


def needles_found(ev: Evaluation, targets: np.ndarray) -> tuple[int, int]:
    """(needles whose heaviest page was attended, needles asked for) over all
    retrieval queries: the needle was found at its depth."""
    found = total = 0
    for masses, live, chosen in _needle_pages(ev, targets):
        heaviest = max(masses, key=masses.get)
        total += 1
        found += heaviest in live or heaviest in chosen
    return found, total
