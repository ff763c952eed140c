"""The importance sample of unselected pages (attention.sample_tail): unbiased,
never a selected or non-candidate page, isolated per sequence."""

import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.attention import TAIL_UNIFORM_SHARE, sample_tail
from hisparse_jax.config import FULL_BUDGET, HiSparseConfig

ROWS = 2000  # sequences, each with its own length and so its own draw


def _problem(seed, npg, k, heads=3, cand_share=0.8):
    """mass [ROWS, H, N] (heavy-tailed log estimates, -inf = not a candidate), the
    same K selected candidates in every row, and a positive f per page."""
    rng = np.random.default_rng(seed)
    mass = rng.normal(scale=2.0, size=(heads, npg)).astype(np.float32)
    cand = rng.random((heads, npg)) < cand_share
    mass = np.where(cand, mass, -np.inf)
    pages = np.stack([rng.choice(np.flatnonzero(cand[h]), k, replace=False)
                      for h in range(heads)])
    f = rng.lognormal(sigma=1.5, size=(heads, npg)).astype(np.float32)
    free = cand.copy()
    np.put_along_axis(free, pages, False, axis=1)
    return (np.broadcast_to(mass, (ROWS, heads, npg)), np.broadcast_to(pages, (ROWS, heads, k)),
            f, free)


@pytest.mark.parametrize("seed,npg,k,n", [(0, 64, 8, 8), (1, 301, 20, 32), (2, 40, 30, 32)])
def test_estimate_is_unbiased(seed, npg, k, n):
    mass, pages, f, free = _problem(seed, npg, k)
    cfg = HiSparseConfig(tail_sample_pages=n)
    idx, logw = sample_tail(cfg, jnp.asarray(mass), jnp.asarray(pages, jnp.int32),
                            (jnp.arange(ROWS) * 7 + 100) * cfg.page_size)  # one draw each
    idx, logw = np.asarray(idx), np.asarray(logw)
    ok = idx >= 0
    np.testing.assert_array_equal(ok.any(axis=-1), np.broadcast_to(free.any(-1), ok.shape[:2]))
    heads = np.arange(3)[None, :, None]
    # Only free pages (candidates that were not selected) are ever drawn.
    assert free[np.broadcast_to(heads, idx.shape)[ok], idx[ok]].all()

    def estimate(f):  # per row: sum over drawn pages of f * weight, and the exact sum
        est = np.sum(np.where(ok, f[heads, np.maximum(idx, 0)] * np.exp(logw), 0.0), axis=-1)
        return est, np.sum(np.where(free, f, 0.0), axis=-1)

    # Unbiased for any f, even one the digest estimate knows nothing about.
    est, exact = estimate(f)
    np.testing.assert_allclose(est.mean(axis=0), exact, rtol=0.03)  # 0 = 0 where none free
    # When the digest's estimate is roughly right, each draw is itself accurate.
    rng = np.random.default_rng(seed)
    g = np.exp(np.where(np.isfinite(mass[0]), mass[0], -50.0)) * rng.lognormal(
        sigma=0.3, size=f.shape)
    est, exact = estimate(g)
    has = exact > 0
    assert np.median(np.abs(est[:, has] / exact[has] - 1)) < 0.15


def test_off_or_nothing_left():
    mass, pages, _, _ = _problem(0, 64, 8)
    lens = jnp.arange(ROWS)
    for cfg in (HiSparseConfig(tail_sample_pages=0), HiSparseConfig(budget_tokens=FULL_BUDGET)):
        idx, logw = sample_tail(cfg, jnp.asarray(mass), jnp.asarray(pages, jnp.int32), lens)
        assert idx.shape == logw.shape == (ROWS, 3, 0)
    # Every candidate selected: no draw at all.
    m = np.full((1, 1, 6), -np.inf, np.float32)
    m[..., :3] = 0.0
    idx, _ = sample_tail(HiSparseConfig(), jnp.asarray(m), jnp.array([[[0, 1, 2]]], jnp.int32),
                         jnp.array([100]))
    assert (np.asarray(idx) == -1).all()


def test_nan_estimates_stay_in_their_sequence():
    mass, pages, _, _ = _problem(3, 64, 8)
    mass = np.array(mass[:2])
    bad = mass.copy()
    bad[0, :, 5:40] = np.nan
    cfg = HiSparseConfig()
    lens = jnp.array([500, 501])
    a = sample_tail(cfg, jnp.asarray(mass), jnp.asarray(pages[:2], jnp.int32), lens)
    b = sample_tail(cfg, jnp.asarray(bad), jnp.asarray(pages[:2], jnp.int32), lens)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x)[1], np.asarray(y)[1])
    drawn = np.asarray(b[0])[0]
    assert np.isfinite(np.asarray(b[1])).all()
    assert not np.isin(drawn[drawn >= 0], np.arange(5, 40)).any()


def test_config_rejects_bad_sample_size():
    with pytest.raises(ValueError, match="tail_sample_pages"):
        HiSparseConfig(tail_sample_pages=-1)
    with pytest.raises(ValueError, match="tail_sample_pages"):
        HiSparseConfig(tail_sample_pages=2.5)



def test_uniform_draws_hold_for_a_page_of_steps():
    """Within one page of decode steps the uniform draws stay the same pages, whatever
    the query (offload mode keeps them on the device); the next page redraws."""
    mass, pages, _, _ = _problem(4, 301, 20)
    cfg = HiSparseConfig()
    n_u = round(cfg.tail_sample_pages * TAIL_UNIFORM_SHARE)
    m, p = jnp.asarray(mass[:1]), jnp.asarray(pages[:1], jnp.int32)
    other_query = m + jnp.asarray(np.random.default_rng(9).normal(size=m.shape), jnp.float32)
    first = sample_tail(cfg, m, p, jnp.array([100 * cfg.page_size]))[0]
    later = sample_tail(cfg, other_query, p, jnp.array([101 * cfg.page_size - 1]))[0]
    next_page = sample_tail(cfg, m, p, jnp.array([101 * cfg.page_size]))[0]
    np.testing.assert_array_equal(first[..., :n_u], later[..., :n_u])
    assert not np.array_equal(first[..., n_u:], later[..., n_u:])  # the digest part moves
    assert not np.array_equal(first[..., :n_u], next_page[..., :n_u])
