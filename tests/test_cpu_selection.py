"""The C++ selection kernels (cpu_kernels/selection.cc) against the XLA path.

- `page_scores` against `lookup_ref.page_scores` (tests/test_kernels.py's lookup
  cases: NaN digests on unused pool pages, tables with holes and a ragged tail, GQA
  1 to 8, head dims 64 and 128, and 40 / 48 for the scalar path): within 1e-5;
  it sums in another order, and a wrong or missing channel moves a score by 1e-2
  or more.
- `_rank`: the same candidate pages as XLA's from the same scores, bit for bit,
  on scores with ties (top_k's lower-index rule decides at the budget's edge),
  holes in the table, peaks, stickiness, and each config that changes the
  candidate lists.
- `sample_tail`: the same uniform draws; the weighted draws the same but where a
  draw falls within rounding of a page's edge (its cumulative sum runs in
  another order).
A sequence's numbers never depend on the batch or on NaN in another sequence.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import build, ops
from hisparse_jax import attention as att
from hisparse_jax.attention import selection
from hisparse_jax.cache import state as st
from hisparse_jax.config import HiSparseConfig
from pallas_kernels.lookup import reference as lookup_ref
from pallas_kernels.sparse_decode import reference as decode_ref
from tests.test_kernels import LOOKUP_CASES, LookupCase, make_lookup

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or build.unavailable() is not None,
                                reason="the C++ kernels (CPU, with a compiler)")

SCORE_CASES = [*LOOKUP_CASES,
               LookupCase(3, 3, 3, 64, 61, 200),   # SmolLM2's heads
               LookupCase(2, 2, 7, 40, 29, 40),    # the scalar path
               LookupCase(1, 1, 2, 48, 17, 24)]


def _finite_close(got, want, atol=1e-5):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("case", SCORE_CASES, ids=str)
def test_page_scores_match_the_reference(case):
    args = make_lookup(case)
    for got, want in zip(jax.jit(ops.page_scores)(*args), lookup_ref.page_scores(*args),
                         strict=True):
        assert not np.isnan(np.asarray(got)).any()
        _finite_close(got, want)


def test_page_scores_read_a_layer_in_place_and_do_not_depend_on_the_batch():
    case = LookupCase(4, 3, 3, 64, 61, 200)
    layers = [make_lookup(case, seed=s) for s in range(3)]
    q, _, _, table = layers[0]
    center = jnp.stack([a[1] for a in layers])
    radius = jnp.stack([a[2] for a in layers]).view(jnp.uint8)  # a stacked cache's form
    f = jax.jit(ops.page_scores)
    for layer in (0, 2):
        got = f(q, center, radius, table, layer=jnp.int32(layer))
        want = f(q, layers[layer][1], layers[layer][2], table)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    wide = f(q, center, radius, table, layer=1)
    for b in (1, 3):
        for g, w in zip(f(q[:b], center, radius, table[:b], layer=1), wide, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w)[:b])


def test_page_scores_nan_in_one_sequence_stays_there():
    q, center, radius, table = make_lookup(LookupCase(3, 2, 4, 64, 37, 48))
    clean = ops.page_scores(q, center, radius, table)
    got = ops.page_scores(q.at[1, 0, 0, 0].set(jnp.nan), center, radius, table)
    assert np.isnan(np.asarray(got[1])[1, 0][np.asarray(table[1]) >= 0]).all()
    for g, w in zip(got, clean, strict=True):
        for b in (0, 2):
            np.testing.assert_array_equal(np.asarray(g)[b], np.asarray(w)[b])


BASE = HiSparseConfig(num_kv_heads=3, gqa_group=3, head_dim=64, max_context=3072, max_seqs=4,
                      budget_tokens=256)
RANK_CONFIGS = {
    "default": BASE,
    "no_peak": BASE.replace(peak_pages=0),
    "no_lead": BASE.replace(quest_lead=0.0),
    "no_quest": BASE.replace(peak_pages=0, quest_lead=0.0),
    "not_sticky": BASE.replace(sticky_nats=0.0),
    "no_bound_share": BASE.replace(bound_share=0.0),
    "gqa_8_tiny_budget": BASE.replace(num_kv_heads=1, gqa_group=8, budget_tokens=64),
    "no_rerank": BASE.replace(rerank_multiple=1.0, budget_tokens=1024),
}


def _rank_case(cfg, seed):
    """A state with tables of 4 lengths (holes where -1), remembered pages, and
    scores with ties, a far peak and a -inf hole; -inf where the table is -1."""
    rng = np.random.default_rng(seed)
    b, h, g, n = 4, cfg.num_kv_heads, cfg.gqa_group, cfg.max_pages
    table = np.full((b, n), -1, np.int32)
    for i, length in enumerate((n, n // 2 + 1, 7, 0)):
        table[i, :length] = rng.permutation(length)
    table[0, 3] = -1
    s = st.init_state(cfg).replace(page_table=jnp.asarray(table),
                                   last_selected=jnp.asarray(rng.random((b, h, n)) < 0.1))
    bound = rng.standard_normal((b, h, g, n)).astype(np.float32)
    mass = rng.standard_normal((b, h, n)).astype(np.float32)
    if seed % 2:  # ties everywhere
        bound, mass = np.round(bound * 2) / 2, np.round(mass)
    bound[0, 0, 0, n - 5] = 25.0  # a page far above the bulk (peaked bounds)
    bound[1, -1, :, 2] = -np.inf
    ok = table >= 0
    bound = np.where(ok[:, None, None], bound, -np.inf).astype(np.float32)
    mass = np.where(ok[:, None], mass, -np.inf).astype(np.float32)
    return s, jnp.asarray(bound), jnp.asarray(mass)


@pytest.mark.parametrize("name", RANK_CONFIGS)
def test_rank_pages_picks_the_same_pages_as_xla(name):
    cfg = RANK_CONFIGS[name]
    for seed in range(6):
        s, bound, mass = _rank_case(cfg, seed)
        want = np.asarray(selection._rank(cfg, s, bound, mass, "xla"))
        got = np.asarray(selection._rank(cfg, s, bound, mass, "cpu"))
        np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}")
        assert (want[0] >= 0).sum() > 0 and (want[3] == -1).all()


def test_rank_pages_ties_at_the_edge_go_to_the_lower_index():
    """All bounds equal: each head's picks are its first pages (top_k's rule), and
    the centre ranks the rest by index too; both paths agree."""
    cfg = RANK_CONFIGS["no_quest"]
    s, bound, mass = _rank_case(cfg, 0)
    ok = np.asarray(s.page_table) >= 0
    bound = jnp.broadcast_to(jnp.where(ok[:, None, None], 1.0, -jnp.inf), bound.shape)
    mass = jnp.broadcast_to(jnp.where(ok[:, None], 0.0, -jnp.inf), mass.shape)
    s = s.replace(last_selected=jnp.zeros_like(s.last_selected))
    got = np.asarray(selection._rank(cfg, s, bound, mass, "cpu"))
    np.testing.assert_array_equal(got, np.asarray(selection._rank(cfg, s, bound, mass, "xla")))
    # table[0, 3] is a hole
    np.testing.assert_array_equal(got[0, 0], np.delete(np.arange(got.shape[-1] + 1), 3))


def _tail_case(seed, b=4, h=3, n=300, k=40):
    rng = np.random.default_rng(seed)
    mass = (rng.standard_normal((b, h, n)) * (1 + 3 * seed)).astype(np.float32)
    mass[:, :, 250:] = -np.inf          # not candidates
    mass[2] = -np.inf                   # a sequence with none
    pages = np.stack([np.stack([np.sort(rng.choice(250, k, replace=False))
                                for _ in range(h)]) for _ in range(b)]).astype(np.int32)
    pages[0, 0, -5:] = -1
    lens = jnp.asarray(rng.integers(1000, 4800, b), jnp.int32)
    return jnp.asarray(mass), jnp.asarray(pages), lens


def test_sample_tail_draws_as_xla():
    cfg = BASE.replace(max_context=4800)
    n_u = round(cfg.sample_pages * att.TAIL_UNIFORM_SHARE)
    total = same = 0
    for seed in range(8):
        mass, pages, lens = _tail_case(seed)
        (xi, xw), (ci, cw) = (att.sample_tail(cfg, mass, pages, lens, implementation=i)
                              for i in ("xla", "cpu"))
        xi, ci, xw, cw = map(np.asarray, (xi, ci, xw, cw))
        np.testing.assert_array_equal(ci[..., :n_u], xi[..., :n_u])  # uniform: exact sums
        assert (ci[2] == -1).all() and (cw[2] == 0).all()
        total, same = total + xi.size, same + (ci == xi).sum()
        eq = ci == xi
        np.testing.assert_allclose(cw[eq], xw[eq], rtol=1e-5, atol=1e-6)
    assert same >= total - 3, (same, total)


def test_sample_tail_nan_in_one_sequence_stays_there():
    cfg = BASE.replace(max_context=4800)
    mass, pages, lens = _tail_case(1)
    clean = att.sample_tail(cfg, mass, pages, lens, implementation="cpu")
    got = att.sample_tail(cfg, mass.at[1, 0, 5].set(jnp.nan), pages, lens, implementation="cpu")
    for g, w in zip(got, clean, strict=True):
        for b in (0, 2, 3):
            np.testing.assert_array_equal(np.asarray(g)[b], np.asarray(w)[b])
    wide = att.sample_tail(cfg, mass, pages, lens, implementation="cpu")
    narrow = att.sample_tail(cfg, mass[:1], pages[:1], lens[:1], implementation="cpu")
    for g, w in zip(narrow, wide, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w)[:1])


def test_the_decode_step_selects_on_the_kernels():
    """`select` on the "cpu" implementation calls the three kernels (not XLA's
    top_k and searchsorted)."""
    cfg = dataclasses.replace(BASE)
    s, _, _ = _rank_case(cfg, 0)
    q = jnp.ones((4, 9, 64), jnp.float32)
    text = {impl: jax.jit(lambda s, q, impl=impl: att.select(cfg, s, q, implementation=impl))
            .lower(s, q).as_text() for impl in ("cpu", "xla")}
    for target in ("hisparse_page_scores", "hisparse_rank_pages", "hisparse_sample_tail"):
        assert target in text["cpu"] and target not in text["xla"]
    assert "top_k" in text["xla"] and "top_k" not in text["cpu"]
    # XLA's searchsorted is a loop; the random offsets' loops remain on both
    assert text["cpu"].count("stablehlo.while") < text["xla"].count("stablehlo.while")


def _rerank_case(seed, b=3, h=2, g=3, c=24, n=6, t=16, d=64, pool=40, sharp=True):
    """Candidates' and samples' int4 logits from a real pool (codes and digests),
    with one head per group made sharp (one page far above the rest), holes (-1)
    among the slots, and a window's log-sum-exp at three scales."""
    from hisparse_jax.attention import candidate_pages
    rng = np.random.default_rng(seed)
    int4_k = jnp.asarray(rng.integers(0, 256, (h, pool, t, d // 2)), jnp.uint8)
    center = jnp.asarray(rng.standard_normal((h, pool, d)), jnp.bfloat16)
    radius = jnp.asarray(np.abs(rng.standard_normal((h, pool, d))) * 0.5, jnp.float8_e4m3fn)
    slots = np.stack([np.stack([rng.permutation(pool)[:c + n] for _ in range(h)])
                      for _ in range(b)]).astype(np.int32)
    slots[0, 0, 3] = slots[1, 1, c + 1] = -1
    q = rng.standard_normal((b, h, g, d)).astype(np.float32)
    if sharp:  # head 0 of every group points at its candidate 5's keys, hard
        lo = np.asarray(candidate_pages(int4_k, center, radius, jnp.asarray(slots))[1])
        q[:, :, 0] = 6.0 * lo[:, :, 5]
    q = jnp.asarray(q)
    raw = ops.cold_logits(q, int4_k, center, radius, jnp.asarray(slots))
    wl = jnp.asarray(rng.choice([-5.0, 2.0, 9.0], (b, h, g)), jnp.float32)
    return q, int4_k, center, radius, jnp.asarray(slots), raw, wl


@pytest.mark.parametrize("floor,weight,sharp", [(0.4, "share", True), (0.4, "share", False),
                                                (1.0, "share", True), (0.4, "mass", True)])
def test_rerank_keeps_the_pages_xla_keeps(floor, weight, sharp):
    cfg = BASE.replace(budget_tokens=16 * 10, rerank_multiple=2.4, quest_floor_mass=floor,
                       rerank_weight=weight)
    c, scale = 24, 0.125
    kept_same = drawn_same = total = 0
    for seed in range(6):
        q, int4_k, center, radius, slots, raw, wl = _rerank_case(seed, c=c, sharp=sharp)
        lens = jnp.asarray([3000, 1999, 4000], jnp.int32)
        cand = slots[..., :c]
        logits = decode_ref.weighted_logits(raw[:, :, :, :c], cand, None, scale)
        bound = att.candidate_bounds(q, int4_k, center, radius, cand)
        want = att.rerank(cfg, logits, lens, bound=bound if floor < 1 else None,
                          window_lse=wl)
        got = ops.rerank(raw, cand, wl, q, int4_k, center, radius,
                         selection._offsets(cfg, lens, selection._RERANK_KEY, (cand.shape[1],)),
                         k=min(cfg.budget_pages, c), m=cfg.rerank_samples, sm_scale=scale,
                         floor=floor, slack=att.QUEST_FLOOR_SLACK,
                         uniform_share=att.TAIL_UNIFORM_SHARE, mass_weight=weight == "mass")
        w, g_ = [np.asarray(x) for x in want], [np.asarray(x) for x in got]
        for i in range(w[0].shape[0]):  # kept: the same set (top_k's order within it)
            for j in range(w[0].shape[1]):
                kept_same += set(w[0][i, j]) == set(g_[0][i, j])
                total += 1
        eq = w[1] == g_[1]
        drawn_same += eq.all()
        np.testing.assert_allclose(g_[2][eq], w[2][eq], rtol=1e-4, atol=1e-5)
    assert kept_same == total
    assert drawn_same >= 5


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rerank_floor_keeps_a_sharp_heads_residual_mass(seed):
    """tests/test_sharp_heads.py's regression case (window-heavy heads outvote a
    sharp head for its spread remainder) on the kernel, whose floor reads Quest's
    bounds from the pool: a pool made so that every head's bound is the case's
    head-0 bound (channel 0 alone, radius 0), in bf16-exact steps. The kernel keeps
    the same candidates as XLA's re-rank, at least Quest's mass for the sharp head;
    without the floor, less."""
    from tests.test_sharp_heads import _residual_mass_case
    logits, _, window, quest, share = _residual_mass_case(seed)
    c, t, d, scale = 40, 16, 64, 0.125
    b0 = np.concatenate([[12.0], 10.0 - np.arange(30) * 0.0625, 6.0 - np.arange(9) * 0.03125])
    center = np.zeros((1, c, d), np.float32)
    center[0, :, 0] = b0
    q = np.zeros((1, 1, 3, d), np.float32)
    q[..., 0] = 1.0 / scale                    # scaled: 1, so the bound is the centre
    pool = (jnp.zeros((1, c, t, d // 2), jnp.uint8), jnp.asarray(center, jnp.bfloat16),
            jnp.zeros((1, c, d), jnp.float8_e4m3fn))
    slots = jnp.arange(c, dtype=jnp.int32)[None, None]
    bound = att.candidate_bounds(jnp.asarray(q), *pool, slots)
    np.testing.assert_array_equal(np.asarray(bound)[0, 0, 0], b0.astype(np.float32))
    cfg = HiSparseConfig(num_kv_heads=1, gqa_group=3, page_size=16, budget_tokens=31 * 16)
    lens = jnp.array([8000])
    mass = lambda kept: share[0, kept[kept >= 0]].sum()
    kept = {}
    for floor in (cfg.quest_floor_mass, 1.0):
        got = ops.rerank(logits / scale, slots, window, jnp.asarray(q), *pool,
                         selection._offsets(cfg, lens, selection._RERANK_KEY, (1,)), k=31,
                         m=cfg.rerank_samples, sm_scale=scale, floor=floor,
                         slack=att.QUEST_FLOOR_SLACK, uniform_share=att.TAIL_UNIFORM_SHARE,
                         mass_weight=False)
        want = att.rerank(cfg.replace(quest_floor_mass=floor), logits, lens, bound, window)
        kept[floor] = np.asarray(got[0])[0, 0]
        assert set(kept[floor]) == set(np.asarray(want[0])[0, 0])
    assert mass(kept[cfg.quest_floor_mass]) >= share[0, quest].sum() * (1 - 1e-6)
    assert mass(kept[1.0]) < share[0, quest].sum() - 0.01


def test_on_a_real_cache_the_kernels_attend_the_pages_xla_attends():
    """SmolLM2's caches after a real text (GPL-3's opening, 3K tokens, and the same
    reversed), every layer, queries made peaky from a key of the hot window: the
    C++ selection and re-rank attend exactly XLA's pages, and the outputs agree
    within the kernels' rounding."""
    from models_fixtures import smollm2

    from hisparse_jax.models.engine import Engine
    m, tok = smollm2()
    text = pathlib.Path("/usr/share/common-licenses/GPL-3").read_text()
    ids = np.asarray(tok.encode(text))[:3072]
    e = Engine(m, max_seqs=2, max_context=3200, budget_tokens=192)
    e.prefill(0, ids)
    e.prefill(1, ids[::-1].copy())
    for _ in range(4):
        e.decode_step()
    cfg = e.cache_cfg
    rng = np.random.default_rng(0)
    step = jax.jit(att.decode_step, static_argnames=("cfg", "implementation"))
    for layer in range(m.cfg.num_layers):
        view = st.layer_view(cfg, e.caches, layer)
        k = np.asarray(view.bf16_k, np.float32)[:, :, 5]
        q = np.repeat(k, cfg.gqa_group, axis=1) * 2 + rng.standard_normal((2, 9, 64)) * 0.5
        (xo, xp, _), (co, cp, _) = (step(cfg, view, jnp.asarray(q, jnp.float32),
                                         implementation=i) for i in ("xla", "cpu"))
        np.testing.assert_array_equal(np.asarray(cp), np.asarray(xp), err_msg=f"layer {layer}")
        np.testing.assert_allclose(np.asarray(co), np.asarray(xo), rtol=1e-4, atol=2e-4)
