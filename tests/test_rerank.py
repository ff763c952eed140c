"""The re-rank inside the decode attention (attention.rerank): the candidates with
the most exact group mass are kept, the rejected ones' mass is estimated without
bias, NaN stays in its sequence, and the XLA path's fused attention computes the
same function as attending the chosen pages with the kernels."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax import attention
from hisparse_jax.cache.handle import HiSparseCache
from hisparse_jax.cache.state import slot_positions
from hisparse_jax.config import HiSparseConfig
from pallas_kernels.sparse_decode import reference as decode_ref

ROWS = 2000  # sequences, each with its own length and so its own draw


def _logits(seed, b, g, c, t, invalid=0.2, masked=0.1):
    """Scaled logits [B, 3, G, C, T], heavy-tailed per page, -inf on invalid
    candidates and masked tokens."""
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(1, 3, g, c, 1)) * 3 + rng.normal(size=(1, 3, g, c, t))).astype(
        np.float32)
    x = np.where(rng.random((1, 3, 1, c, 1)) < invalid, -np.inf, x)
    x = np.where(rng.random((1, 3, 1, c, t)) < masked, -np.inf, x)
    return np.broadcast_to(x, (b, 3, g, c, t))


def _group_share(x):  # numpy: sum over the group of each head's share of the candidates
    with np.errstate(divide="ignore", invalid="ignore"):
        page = np.log(np.exp(x).sum(-1))
        share = np.exp(page - np.log(np.exp(page).sum(-1, keepdims=True)))
    return np.nan_to_num(share).sum(1)


@pytest.mark.parametrize("g,c,k,t", [(1, 12, 8, 16), (4, 48, 32, 16), (8, 37, 24, 8),
                                     (4, 10, 10, 32)])
def test_keeps_the_candidates_with_the_most_group_mass(g, c, k, t):
    x = _logits(g + c, 2, g, c, t)
    cfg = HiSparseConfig(page_size=t, budget_tokens=k * t)
    kept, drawn, _ = (np.asarray(a) for a in attention.rerank(
        cfg, jnp.asarray(x), jnp.array([1000, 2000])))
    share = _group_share(x[0])
    for h in range(3):
        valid = np.flatnonzero(share[h] > 0)
        want = valid[np.argsort(-share[h, valid])][:k]
        got = kept[0, h][kept[0, h] >= 0]
        assert set(got) == set(want) and len(got) == len(want)
        # Draws come from the rejected valid candidates only.
        d = drawn[0, h][drawn[0, h] >= 0]
        assert not np.isin(d, want).any() and np.isin(d, valid).all()


@pytest.mark.parametrize("g,c,k,t", [(1, 12, 8, 16), (4, 48, 32, 16), (3, 37, 24, 8)])
def test_mass_weight_keeps_the_candidates_with_the_most_attended_mass(g, c, k, t):
    """rerank_weight="mass": each head's shares are weighted by its candidates' part
    of its mass on the window and the candidates (the window's log-sum-exp drawn
    per head over ~20 nats), so the kept set is the one with the most exact mass
    summed over the group, not the most shares."""
    x = _logits(g + c + 1, 2, g, c, t)
    rng = np.random.default_rng(c)
    wlse = (rng.normal(size=(2, 3, g)) * 6 + 6).astype(np.float32)
    cfg = HiSparseConfig(page_size=t, budget_tokens=k * t, rerank_weight="mass",
                         quest_floor_mass=1.0)
    kept, _, _ = (np.asarray(a) for a in attention.rerank(
        cfg, jnp.asarray(x), jnp.array([1000, 2000]), window_lse=jnp.asarray(wlse)))
    with np.errstate(divide="ignore", invalid="ignore"):
        page = np.log(np.exp(x[0].astype(np.float64)).sum(-1))           # [3, G, C]
        total = np.logaddexp(np.log(np.exp(page).sum(-1)), wlse[0])    # [3, G]
        mass = np.nan_to_num(np.exp(page - total[..., None])).sum(1)    # [3, C]
    share = _group_share(x[0])
    differs = 0
    for h in range(3):
        valid = np.flatnonzero(mass[h] > 0)
        want = valid[np.argsort(-mass[h, valid])][:k]
        got = kept[0, h][kept[0, h] >= 0]
        assert set(got) == set(want) and len(got) == len(want)
        differs += set(want) != set(valid[np.argsort(-share[h, valid])][:k])
    if g > 1 and k < c:  # the weights change the choice (else the test proves nothing)
        assert differs > 0
    with pytest.raises(ValueError, match="window"):
        attention.rerank(cfg, jnp.asarray(x), jnp.array([1000, 2000]))


@pytest.mark.parametrize("seed,c,k,m", [(0, 48, 32, 8), (1, 37, 20, 4), (2, 30, 24, 16)])
def test_rejected_mass_is_estimated_without_bias(seed, c, k, m):
    x = _logits(seed, ROWS, 4, c, 16)
    cfg = HiSparseConfig(budget_tokens=k * 16, rerank_sample_pages=m)
    kept, drawn, logw = (np.asarray(a) for a in attention.rerank(
        cfg, jnp.asarray(x), (jnp.arange(ROWS) * 3 + 7) * cfg.page_size))
    rejected = (_group_share(x[0]) > 0)
    np.put_along_axis(rejected, np.maximum(kept[0], 0), False, axis=1)
    assert (kept == kept[:1]).all()  # the kept set does not depend on the draw
    f = np.random.default_rng(seed).lognormal(sigma=1.5, size=(3, c))
    ok = drawn >= 0
    heads = np.arange(3)[None, :, None]
    est = np.sum(np.where(ok, f[heads, np.maximum(drawn, 0)] * np.exp(logw), 0.0), axis=-1)
    np.testing.assert_allclose(est.mean(axis=0), np.where(rejected, f, 0).sum(-1), rtol=0.03)


def test_nan_stays_in_its_sequence():
    x = np.array(_logits(5, 2, 4, 48, 16))
    bad = x.copy()
    bad[0, :, :, 3:9] = np.nan
    cfg = HiSparseConfig(budget_tokens=32 * 16)
    lens = jnp.array([700, 900])
    a = attention.rerank(cfg, jnp.asarray(x), lens)
    b = attention.rerank(cfg, jnp.asarray(bad), lens)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(np.asarray(u)[1], np.asarray(v)[1])
    kept, drawn, logw = (np.asarray(v)[0] for v in b)
    assert not np.isin(kept, np.arange(3, 9)).any() and not np.isin(drawn, np.arange(3, 9)).any()
    assert np.isfinite(logw).all()


def _cache(gqa, seed=0):
    cfg = HiSparseConfig(num_kv_heads=2, gqa_group=gqa, head_dim=64, max_context=4096,
                         max_seqs=2, budget_tokens=256)
    rng = np.random.default_rng(seed)
    cache = HiSparseCache(cfg, "xla")
    for seq, s in ((0, 3001), (1, 2222)):
        k, v = (rng.normal(size=(s, 2, 64)).astype(np.float32) for _ in range(2))
        k[rng.random(s) < 0.01] *= 4  # a few spiking keys
        cache.prefill(seq, k, v)
    q = jnp.asarray(rng.normal(size=(2, 2 * gqa, 64)), jnp.float32)
    return cfg, cache.state, q


@pytest.mark.parametrize("gqa", [1, 4])
def test_fused_attention_equals_attending_the_chosen_pages(gqa):
    """The XLA path reuses the kept candidates' logits; attending the pages it chose
    from scratch (the reference decode, as the Pallas path does) gives the same."""
    cfg, st, q = _cache(gqa)
    sel = attention.select(cfg, st, q, implementation="xla")
    assert sel.pages.shape[-1] == cfg.candidate_pages > cfg.budget_pages
    for row in np.asarray(sel.pages).reshape(-1, cfg.candidate_pages):
        valid = row[row >= 0]  # distinct pages in page order, none (-1) last
        assert (np.diff(valid) > 0).all() and (row[len(valid):] == -1).all()
    cold = tuple(getattr(st, f) for f in attention.COLD_FIELDS)
    slots = attention.pool_pages(st.page_table, sel.pages)
    sample_slots = attention.pool_pages(st.page_table, sel.sample)
    out, kept = attention.attend_cold_slots(cfg, st, q, cold, slots, sample_slots,
                                            sel.sample_logw, implementation="xla")
    # The same choice from the candidates' logits, then the plain reference decode.
    qg = attention.group_queries(cfg, q)
    sm = 1.0 / math.sqrt(cfg.head_dim)
    x = decode_ref.weighted_logits(
        decode_ref.cold_logits(qg, st.int4_k, st.digest_center, st.digest_radius, slots),
        slots, None, sm)
    bf16_pos, fp8_pos = slot_positions(cfg, st.seq_lens)
    window = (qg.astype(jnp.float32), st.bf16_k, st.bf16_v, bf16_pos >= 0, st.fp8_k, st.fp8_v,
              st.fp8_k_scale, st.fp8_v_scale, fp8_pos >= 0)
    kept2, drawn, drawn_logw = attention.rerank(
        cfg, x, st.seq_lens,
        attention.candidate_bounds(qg, st.int4_k, st.digest_center, st.digest_radius, slots),
        attention.window_lse(*window, sm))
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(kept2))
    ids = jnp.concatenate([attention.take_or_none(slots, jnp.concatenate([kept2, drawn], -1)),
                           sample_slots], axis=-1)
    logw = jnp.concatenate([jnp.zeros(kept2.shape), drawn_logw, sel.sample_logw], axis=-1)
    ref, _ = decode_ref.sparse_decode(
        qg, st.bf16_k, st.bf16_v, bf16_pos >= 0, st.fp8_k, st.fp8_v, st.fp8_k_scale,
        st.fp8_v_scale, fp8_pos >= 0, *cold, ids, sm_scale=sm, cold_logw=logw)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref).reshape(q.shape),
                               rtol=1e-5, atol=1e-6)
    # Candidates that were kept are real pages; the budget is filled.
    got = np.asarray(attention.take_or_none(sel.pages, kept))
    assert ((got >= 0).sum(-1) == cfg.budget_pages).all()


def test_off_attends_the_candidates():
    """rerank_multiple=1: the candidates are the attended pages, as before the re-rank."""
    cfg, st, q = _cache(4)
    off = cfg.replace(rerank_multiple=1)
    sel = attention.select(off, st, q, implementation="xla")
    out, pages = attention.decode_attention(off, st, q, implementation="xla",
                                            return_selection=True)
    np.testing.assert_array_equal(np.asarray(pages), np.asarray(sel.pages))
    want = attention.attend_pages(off, st, q, sel.pages, sel.sample, sel.sample_logw,
                                  implementation="xla")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    # With it on, the step attends the same number of pages, chosen from more.
    on_pages = attention.decode_attention(cfg, st, q, implementation="xla",
                                          return_selection=True)[1]
    assert on_pages.shape == pages.shape == (2, 2, cfg.budget_pages)
