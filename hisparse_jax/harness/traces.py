"""Selection traces and the residency simulator: the decode steps' selections
recorded from generated workloads (`make_trace`) or drawn (`synthetic_trace`),
replayed through a residency policy (`evaluate`) beside Belady's optimum
(`belady_hit_rate`); `bench_scheduler` is `hisparse bench scheduler`."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.attention import decode_attention, remember, select_pages
from hisparse_jax.cache.handle import HiSparseCache
from hisparse_jax.config import HiSparseConfig, preset
from hisparse_jax.harness.evaluation import selection_recall
from hisparse_jax.harness.workloads import make_workload
from hisparse_jax.offload.policy import LRU, Policy, counters, init_state, run_trace


@dataclasses.dataclass(frozen=True)
class Trace:
    name: str
    selected: np.ndarray      # [T, 1, Hkv, K] logical pages: each step's candidates (what
                              # offload keeps resident; the re-rank attends a budget of them)
    prev_layer: np.ndarray    # [T, 1, Hkv, K] a synthetic adjacent layer's selection
    candidates: np.ndarray    # [T, 1, Hkv, K + C] a wider top-k of the same scores
    cfg: HiSparseConfig
    info: dict


def _overlap(a, b):
    """Mean share of a's pages (per row) also in b. a, b [..., K]."""
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    tot = hit = 0
    for x, y in zip(a2, b2):
        xs = set(x[x >= 0].tolist())
        tot += len(xs)
        hit += len(xs & set(y[y >= 0].tolist()))
    return hit / max(1, tot)


def make_trace(kind: str = "drift", *, context: int = 32768, steps: int = 256,
               segment: int = 32, num_kv_heads: int = 4, step_noise: float | None = None,
               step_overlap: float = 0.70, layer_noise: float = 0.3,
               extra_candidates: int = 64, sticky_nats: float | None = None,
               recall_every: int = 8, seed: int = 0, log=None) -> Trace:
    """A decode trace of real selections (`attention.select_pages` over a cache filled
    from `workloads.make_workload`), with queries that move over the steps. A
    step's selection is its candidate pages: offload keeps them all resident, and
    the attention's re-rank keeps a budget of them (recall is measured on those).

    kind "drift": the workload's mixed heads (sink, local, retrieval, diffuse); the
    query glides linearly from one anchor query to the next over `segment` steps,
    so the attended pages drift. kind "retrieval": every head a retrieval head;
    every `segment` steps the query jumps to one of 4 anchor queries (each asking for
    its own needle), so earlier needles are revisited. Both add per-step noise
    (`step_noise` x the query's norm, isotropic), the token-to-token jitter of real
    queries. With step_noise None it is solved (bisection, on the first steps) so
    that consecutive steps share `step_overlap` of their pages: 0.70 is the low end
    of the 70-100% published for real models (anchors.md), the hardest trace those
    reports allow; a fixed jitter instead gives lower overlap the longer the
    context. The adjacent layer is the same query with independent `layer_noise`.
    The context does not grow during the trace (pages turning cold are not modelled).

    The overlap is solved for selections without memory (`sticky_nats` 0: the
    plain top-k the published overlaps describe); the trace then decodes step by
    step with the config's `sticky_nats` (None: the default preset's), each layer
    remembering its own last step. info reports both overlaps and both recalls
    (DESIGN §4, every `recall_every`-th step), so the price of stickiness is in
    the same row as its hit rate.
    """
    if kind not in ("drift", "retrieval"):
        raise ValueError(f"trace kind must be 'drift' or 'retrieval', got {kind!r}")
    log = log or (lambda *_: None)
    rng = np.random.default_rng(seed + 1000)
    n_seg = -(-steps // segment)
    n_anchor = n_seg + 1 if kind == "drift" else 4
    log(f"workload {kind}: {context} tokens, {num_kv_heads} KV heads, {n_anchor} anchor queries")
    wl = make_workload(context=context, num_kv_heads=num_kv_heads, num_queries=n_anchor,
                       kinds=None if kind == "drift" else ["retrieval"] * num_kv_heads,
                       seed=seed)
    ctx = -(-context // 16) * 16
    cfg = preset("default").replace(num_kv_heads=num_kv_heads, max_context=ctx)
    if sticky_nats is not None:
        cfg = cfg.replace(sticky_nats=sticky_nats)
    plain = cfg.replace(sticky_nats=0.0)
    cache = HiSparseCache(cfg, implementation="xla")
    cache.prefill(0, wl.k, wl.v)
    anchors = wl.q  # [N, Hq, D]
    t = np.arange(steps)
    if kind == "drift":
        a, frac = t // segment, (t % segment) / segment
        q = (1 - frac)[:, None, None] * anchors[a] + frac[:, None, None] * anchors[a + 1]
    else:
        order = [0]
        for _ in range(n_seg - 1):
            order.append(int(rng.choice([i for i in range(n_anchor) if i != order[-1]])))
        q = anchors[np.array(order)[t // segment]]
    norm = np.linalg.norm(q, axis=-1, keepdims=True) / np.sqrt(q.shape[-1])
    z_step = rng.standard_normal(q.shape).astype(np.float32)
    z_layer = rng.standard_normal(q.shape).astype(np.float32)
    # The runner-ups: `extra_candidates` more candidates of the same scores.
    wide = cfg.replace(budget_tokens=(cfg.candidate_pages + extra_candidates) * cfg.page_size,
                       rerank_multiple=1)
    st = cache.state

    def independent(c):  # every step selected afresh
        return jax.jit(jax.vmap(lambda qq: select_pages(c, st, qq[None],
                                                        implementation="xla")[0]))

    @jax.jit
    def decode(qs):  # step by step, remembering the last step: (selected, wider top-k)
        def body(held, qq):
            s = st.replace(last_selected=held)
            pages = select_pages(cfg, s, qq[None], implementation="xla")[0]
            runner_ups = select_pages(wide, s, qq[None], implementation="xla")[0]
            return remember(cfg, s, pages).last_selected, (pages, runner_ups)
        return jax.lax.scan(body, st.last_selected, qs)[1]

    select_plain = independent(plain)
    if step_noise is None:
        step_noise = _solve_step_noise(select_plain, q, norm, z_step, step_overlap, log)
    q_step = jnp.asarray(q + step_noise * norm * z_step, jnp.float32)
    q_layer = jnp.asarray(q_step + layer_noise * norm * z_layer, jnp.float32)
    selected, cand = (np.asarray(x) for x in decode(q_step))
    prev = np.asarray(decode(q_layer)[0])
    selected_plain = np.asarray(select_plain(q_step))
    probe = range(0, steps, recall_every)

    def attended(c, sel):  # the pages the re-rank keeps from each probe step's candidates
        return np.stack([np.asarray(decode_attention(
            c, st if t == 0 else remember(c, st, jnp.asarray(sel[t - 1])), q_step[t][None],
            implementation="xla", return_selection=True)[1][0]) for t in probe])
    recall, recall_plain = (float(selection_recall(c, np.asarray(q_step)[list(probe)], wl.k,
                                                   attended(c, s)).mean())
                            for c, s in ((cfg, selected), (plain, selected_plain)))
    info = {"kind": kind, "context": context, "steps": steps, "segment": segment,
            "num_kv_heads": num_kv_heads, "budget_pages": cfg.budget_pages,
            "candidate_pages": cfg.candidate_pages,
            "bound_share": cfg.bound_share, "sticky_nats": cfg.sticky_nats,
            "cold_pages": int(np.sum(np.asarray(st.page_table[0]) >= 0)),
            "step_noise": step_noise, "layer_noise": layer_noise, "seed": seed,
            "overlap_consecutive_steps": _overlap(selected[1:], selected[:-1]),
            "overlap_consecutive_steps_plain": _overlap(selected_plain[1:],
                                                        selected_plain[:-1]),
            "overlap_adjacent_layer": _overlap(selected, prev),
            "overlap_runner_up_next_step": _overlap(selected[1:], cand[:-1]),
            "recall_mean": recall, "recall_mean_plain": recall_plain}
    return Trace(kind, selected, prev, cand, cfg, info)


def _solve_step_noise(select, q, norm, z, target, log, probe_steps=96, iters=8):
    """The per-step jitter at which consecutive selections share `target` of their
    pages (bisection on the first `probe_steps` steps; overlap falls as jitter grows)."""
    if not 0.0 < target < 1.0:
        raise ValueError(f"step_overlap must be in (0, 1), got {target!r}")
    n = min(probe_steps, q.shape[0])
    lo, hi = 0.0, 2.0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        s = np.asarray(select(jnp.asarray(q[:n] + mid * norm[:n] * z[:n], jnp.float32)))
        if _overlap(s[1:], s[:-1]) > target:
            lo = mid
        else:
            hi = mid
    noise = 0.5 * (lo + hi)
    log(f"step jitter {noise:.3f} x |q| gives consecutive-step overlap ~{target:.2f}")
    return noise


def synthetic_trace(*, steps: int = 64, num_pages: int = 512, k: int = 16, heads: int = 2,
                    drift: int = 2, seed: int = 0):
    """A fast, data-free drifting selection (tests): per head, K pages at a window
    that slides `drift` pages per step over a sticky core plus random pages.
    Returns (selected [T, 1, H, K], candidates [T, 1, H, K]) int32."""
    rng = np.random.default_rng(seed)
    sel = np.full((steps, 1, heads, k), -1, np.int32)
    cand = np.full((steps, 1, heads, k), -1, np.int32)
    core = rng.choice(num_pages, size=(heads, k // 4), replace=False)
    for h in range(heads):
        start = int(rng.integers(num_pages))
        for t in range(steps):
            win = (start + drift * t + np.arange(k // 2)) % num_pages
            rnd = rng.choice(num_pages, size=k, replace=False)
            pages = list(dict.fromkeys([*core[h], *win, *rnd]))[:k]
            sel[t, 0, h] = pages
            nxt = (start + drift * (t + 1) + np.arange(k // 2)) % num_pages
            c = [p for p in nxt if p not in pages]
            cand[t, 0, h, :len(c)] = c
    return sel, cand


# ---------------------------------------------------------------- bench

def evaluate(trace: Trace, working_set: int, policy: Policy, *, use_prev=True,
             use_cand=True) -> dict:
    sel = jnp.asarray(trace.selected)
    s0 = init_state(sel.shape[1], sel.shape[2], working_set, policy)
    s, _ = run_trace(s0, sel, jnp.asarray(trace.prev_layer), jnp.asarray(trace.candidates),
                     use_prev=use_prev, use_cand=use_cand)
    c = counters(s, trace.cfg)
    steps = sel.shape[0]
    c["h2d_bytes_per_step"] = c["host_to_device_bytes"] / steps
    c["h2d_bytes_per_step_per_head"] = c["h2d_bytes_per_step"] / (sel.shape[1] * sel.shape[2])
    return c


def belady_hit_rate(selected: np.ndarray, working_set: int) -> float:
    """Oracle bound for eviction alone (demand fetch, no prefetch): Belady's MIN, which
    evicts the resident page whose next selection is farthest in the future.
    selected [T, B, H, K] -> hit rate. Host-side numpy (a reference, not a policy)."""
    T = selected.shape[0]
    rows = selected.reshape(T, -1, selected.shape[-1])
    hits = total = 0
    for r in range(rows.shape[1]):
        steps = [set(x[x >= 0].tolist()) for x in rows[:, r]]
        uses: dict[int, list[int]] = {}
        for t, st in enumerate(steps):
            for p in st:
                uses.setdefault(p, []).append(t)
        ptr = {p: 0 for p in uses}
        res: set[int] = set()
        for t, st in enumerate(steps):
            hits += len(st & res)
            total += len(st)
            for p in st:
                ptr[p] += 1
            res |= st
            if len(res) > working_set:
                nxt = {p: uses[p][ptr[p]] if ptr[p] < len(uses[p]) else T + 1
                       for p in res - st}
                extra = sorted(nxt, key=nxt.__getitem__, reverse=True)
                res -= set(extra[:len(res) - working_set])
    return hits / max(1, total)


def bench_scheduler(*, context: int = 32768, steps: int = 256, multiples=(1, 2, 4),
                    kinds=("drift", "retrieval"), seed: int = 0,
                    step_noise: float | None = None, step_overlap: float = 0.70,
                    layer_noise: float = 0.3, max_prefetch=(32,), oracle: bool = False,
                    sticky_nats: float | None = None, log=None) -> list[dict]:
    """Resident hit rate and host->device bytes per step, predictive policy vs LRU,
    at working sets of `multiples` x a step's candidate pages (what must be
    resident), on real-selection traces."""
    log = log or (lambda *_: None)
    rows = []
    for kind in kinds:
        t0 = time.perf_counter()
        tr = make_trace(kind, context=context, steps=steps, seed=seed, step_noise=step_noise,
                        step_overlap=step_overlap, layer_noise=layer_noise,
                        sticky_nats=sticky_nats, log=log)
        log(f"trace {kind} built in {time.perf_counter() - t0:.1f}s: "
            + ", ".join(f"{k}={v:.4f}" for k, v in tr.info.items()
                        if k.startswith(("overlap", "recall"))))
        K = tr.selected.shape[-1]
        variants = [("lru", LRU, True, True),
                    # default: prefetch the layer below's pages, keep runner-ups resident
                    *((("predictive" if n == Policy().max_prefetch else f"predictive-pf{n}"),
                       Policy(max_prefetch=n), True, True) for n in max_prefetch),
                    # a first layer (no layer below): prefetch the runner-ups instead
                    ("predictive-runner-ups", Policy(prefetch_candidates=True), False, True),
                    # eviction by recency-weighted frequency alone, no prediction
                    ("frequency-only", Policy(max_prefetch=0), False, False)]
        for m in multiples:
            if oracle:
                rows.append({"case": f"scheduler_{kind}_{m}x", "trace": kind,
                             "policy": "belady-oracle-no-prefetch", "working_set_multiple": m,
                             "working_set_pages": int(m * K), **tr.info,
                             "hit_rate": belady_hit_rate(tr.selected, int(m * K))})
            for name, pol, up, uc in variants:
                c = evaluate(tr, int(m * K), pol, use_prev=up, use_cand=uc)
                rows.append({"case": f"scheduler_{kind}_{m}x", "trace": kind, "policy": name,
                             "working_set_multiple": m, "working_set_pages": int(m * K),
                             **tr.info, **c})
    return rows
