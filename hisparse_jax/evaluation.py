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
HiSparse estimates it from an importance sample of the unselected pages
(`attention.sample_tail`); unsampled_selection_error is its selection error
without that estimate. Recall counts the selected pages only: a sampled page is
read, but it stands for many pages, not for its own mass.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax import layout
from hisparse_jax.attention import attend_pages, decode_attention, dense_decode_attention
from hisparse_jax.cache import HiSparseCache
from hisparse_jax.config import FULL_BUDGET, HiSparseConfig
from hisparse_jax.state import slot_positions


def config_for(cfg: HiSparseConfig, k: np.ndarray, gqa_group: int) -> HiSparseConfig:
    """`cfg` reshaped to hold one sequence of k [S, Hkv, D] (the value group shrinks
    to D/2 for small heads, e.g. 16 channels at head_dim 32)."""
    s, hkv, d = k.shape
    pg = cfg.page_size
    return cfg.replace(num_kv_heads=hkv, gqa_group=gqa_group, head_dim=d, max_seqs=1,
                       value_group=min(cfg.value_group, max(1, d // 2)),
                       max_context=max(pg, -(-s // pg) * pg), num_pool_pages=None)


def _dense_weights(q, k, chunk=8):
    """Exact softmax weights [N, Hq, S] (float32), a few queries at a time."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    kk = jnp.asarray(k).transpose(1, 0, 2)  # [Hkv, S, D]

    @jax.jit
    def weights(qc):
        qg = qc.reshape(qc.shape[0], hkv, hq // hkv, d)
        logits = jnp.einsum("nhgd,hsd->nhgs", qg, kk) / math.sqrt(d)
        return jax.nn.softmax(logits, axis=-1).reshape(qc.shape[0], hq, -1)

    return np.concatenate([np.asarray(weights(jnp.asarray(q[i:i + chunk])))
                           for i in range(0, n, chunk)])


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
    weights: np.ndarray         # [N, Hq, S] exact softmax weights
    always_attended: np.ndarray  # [S] bool: sink/hot/warm tokens (never candidates)
    config: HiSparseConfig

    def oracle_recall_at(self, budget_tokens: int) -> np.ndarray:
        """Recall [N, Hq] of the oracle given `budget_tokens` of cold pages per KV
        head: how large a budget this attention needs, whatever the selection."""
        pages = -(-budget_tokens // self.config.page_size)
        attended, _ = oracle_pages(self.config, self.weights, self.always_attended, pages)
        return mass_on(attended, self.weights)

    def summary(self, heads=None) -> dict:
        """Metrics over the given query heads (all by default)."""
        sel = slice(None) if heads is None else np.asarray(heads)

        def m(x):
            return x[:, sel].ravel()
        cap = layout.capacity_report(self.config, self.config.max_context)
        return {
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


def attended_tokens(cfg: HiSparseConfig, s: int, selected: np.ndarray):
    """(attended [N, Hkv, S] bool: the live bf16/fp8 slots of a sequence of s tokens
    plus the tokens of each selected cold page (selected [N, Hkv, K] logical, -1 =
    none); always [S] bool: the bf16/fp8 slots alone)."""
    always = np.zeros(s, bool)
    for p in slot_positions(cfg, jnp.array([s])):
        p = np.asarray(p[0])
        always[p[p >= 0]] = True
    n, hkv, _ = selected.shape
    page_mask = np.zeros((n, hkv, cfg.max_pages), bool)
    ni, hi, ki = np.nonzero(selected >= 0)
    page_mask[ni, hi, selected[ni, hi, ki]] = True
    attended = np.repeat(page_mask, cfg.page_size, axis=2)[:, :, :s] | always[None, None, :]
    return attended, always


def mass_on(attended: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Recall [N, Hq]: the exact mass weights [N, Hq, S] puts on the tokens each KV
    head attends, attended [N, Hkv, S] bool."""
    g = weights.shape[1] // attended.shape[1]
    return np.sum(np.where(np.repeat(attended, g, axis=1), weights, 0.0), axis=-1)


def selection_recall(cfg: HiSparseConfig, q: np.ndarray, k: np.ndarray,
                     selected: np.ndarray) -> np.ndarray:
    """Attention-mass recall [N, Hq] of given selections (DESIGN §4): queries q
    [N, Hq, D] over one sequence's keys k [S, Hkv, D], selected [N, Hkv, K]."""
    attended, _ = attended_tokens(cfg, k.shape[0], np.asarray(selected))
    return mass_on(attended, _dense_weights(np.asarray(q, np.float32), np.asarray(k, np.float32)))


def oracle_pages(cfg: HiSparseConfig, weights: np.ndarray, always: np.ndarray,
                 budget_pages: int):
    """The oracle's selection: per KV head, the `budget_pages` cold pages with the
    most exact mass summed over the group's query heads (this maximizes the group's
    summed recall, so no selection of as many pages recalls more). weights [N, Hq,
    S] exact softmax weights, always [S] the bf16/fp8 slots -> (attended [N, Hkv, S]
    bool, the always-attended slots included; pages [N, Hkv, budget_pages], -1 =
    none)."""
    n, hq, s = weights.shape
    hkv, pg = cfg.num_kv_heads, cfg.page_size
    npg = -(-s // pg)
    wpad = np.pad(np.where(always[None, None], 0.0, weights), ((0, 0), (0, 0), (0, npg * pg - s)))
    page_mass = wpad.reshape(n, hkv, hq // hkv, npg, pg).sum(axis=(2, 4))  # [N, Hkv, npg]
    best = np.argsort(-page_mass, axis=-1)[..., :min(budget_pages, npg)]
    chosen = np.zeros((n, hkv, npg), bool)
    np.put_along_axis(chosen, best, True, axis=-1)
    chosen &= page_mass > 0
    attended = np.repeat(chosen, pg, axis=2)[:, :, :s] | always[None, None, :]
    return attended, np.where(np.take_along_axis(chosen, best, axis=-1), best, -1)


def evaluate(cfg: HiSparseConfig, q: np.ndarray, k: np.ndarray, v: np.ndarray, *,
             implementation=None) -> Evaluation:
    """Evaluate HiSparse for queries q [N, Hq, D] over one sequence k, v [S, Hkv, D]."""
    q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
    n, hq, _ = q.shape
    s, hkv, _ = k.shape
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    g = hq // hkv
    cfg = config_for(cfg, k, g)
    cache = HiSparseCache(cfg, implementation)
    cache.prefill(0, k, v)
    out, selected = _attend_all(cfg, cache.state, q, implementation)
    full_cfg = cfg.replace(budget_tokens=FULL_BUDGET)
    out_all, _ = _attend_all(full_cfg, cache.state, q, implementation)
    kd = jnp.asarray(k).transpose(1, 0, 2)[None]
    vd = jnp.asarray(v).transpose(1, 0, 2)[None]
    dense = np.stack([np.asarray(dense_decode_attention(jnp.asarray(q[i:i + 1]), kd, vd,
                                                        jnp.array([s]))[0]) for i in range(n)])

    attended, always = attended_tokens(cfg, s, selected)
    attended_q = np.repeat(attended, g, axis=1)  # [N, Hq, S]

    w = _dense_weights(q, k)  # [N, Hq, S]
    recall = mass_on(attended, w)
    top10 = np.argsort(-w, axis=-1)[..., :10]
    top10_recall = np.take_along_axis(attended_q, top10, axis=-1).mean(-1)

    oracle_att, oracle_ids = oracle_pages(cfg, w, always, cfg.budget_pages)
    oracle_recall = mass_on(oracle_att, w)

    def attend_only(pages):  # [N, Hkv, K] logical -> outputs without a tail sample
        return np.stack([np.asarray(attend_pages(
            cfg, cache.state, jnp.asarray(q[i:i + 1]), jnp.asarray(pages[i:i + 1], jnp.int32),
            implementation=implementation)[0]) for i in range(n)])
    out_oracle = attend_only(oracle_ids)
    out_unsampled = attend_only(selected)

    def rel(a, b):
        return np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(b, axis=-1), 1e-30)

    return Evaluation(
        recall=recall, oracle_recall=oracle_recall, rel_error=rel(out, dense),
        selection_error=rel(out, out_all), oracle_selection_error=rel(out_oracle, out_all),
        unsampled_selection_error=rel(out_unsampled, out_all),
        quant_error=rel(out_all, dense),
        top10_recall=top10_recall, attended_fraction=float(attended.mean()),
        selected_pages=selected, weights=w, always_attended=always, config=cfg)


def _needle_pages(ev: Evaluation, targets: np.ndarray):
    """For each retrieval query head: ({page: exact mass of its needle tokens},
    pages attended anyway, pages selected). targets [N, Hq, 2]: the token span
    (start, end) each query head asks for, -1 where none."""
    pg, g = ev.config.page_size, ev.config.gqa_group
    live = set((np.flatnonzero(ev.always_attended) // pg).tolist())
    for n, hq in zip(*np.nonzero(targets[..., 0] >= 0)):
        start, end = targets[n, hq]
        masses = {p: float(ev.weights[n, hq, max(start, p * pg):min(end, (p + 1) * pg)].sum())
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
