"""The C++ decode kernels (cpu_kernels/) against their pure-jnp references.

Adversarial inputs as tests/test_kernels.py's: odd page sizes and head dims (the
vector paths and their scalar fallbacks), GQA ratios 1 to 8, NaN in every masked
slot and unused pool page, empty selections, ids past the pool. Tolerances: the
kernels sum in another order and take exp by a polynomial, so outputs agree to a
few float32 ulps, not bitwise (rtol 2e-5 / atol 2e-6 would fail on any wrong
term: a page dropped or counted twice moves the outputs by 1e-2 or more). A
sequence's numbers are bitwise the same whatever the batch or the layer axis.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import build, ops
from hisparse_jax.backends import resolve_implementation
from hisparse_jax.config import HiSparseConfig
from pallas_kernels.sparse_decode import reference as ref
from tests.test_kernels import DecodeCase as Case
from tests.test_kernels import make_decode, make_logw

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU kernels")

RTOL, ATOL = 2e-5, 2e-6


CASES = [  # page, head_dim, GQA ratio, bf16 slots, fp8 slots, cold pages per (b, h)
    Case(16, 64, 3, 80, 384, 31, batch=3, kv_heads=3, pool=40,    # SmolLM2 in a server
         value_group=64),
    Case(16, 64, 3, 144, 384, 31, batch=3, kv_heads=3, pool=40),  # ... in groups of 32
    Case(16, 64, 1, 21, 13, 5),
    Case(32, 128, 4, 19, 9, 3),                                    # Llama-3-8B's heads
    Case(64, 64, 8, 33, 7, 2, value_group=16),
    Case(16, 128, 8, 8, 0, 4, value_group=16),                     # empty fp8 part
    Case(8, 40, 7, 17, 5, 3, value_group=20),                      # scalar paths, half a vector
    Case(24, 48, 2, 30, 11, 4, value_group=16),                    # 16 + 8 tokens, 48 channels
    Case(16, 64, 4, 21, 13, 5, cold_empty=True),                   # all cold_ids -1
    Case(16, 64, 4, 21, 13, 0),                                    # no cold slots at all
    Case(16, 64, 4, 9, 0, 3, cold_empty=True, no_valid=True),      # nothing to attend
]


def make(c: Case, seed=0):
    """tests/test_kernels.py's synthetic attended set (NaN in every masked slot and
    unused pool page), its digest radii in the cache's dtype (e4m3; bf16 there, for
    Triton), and log weights, NaN on unused entries."""
    args = list(make_decode(c, seed))
    args[14] = args[14].astype(jnp.float8_e4m3fn)  # exact: they were e4m3 (or NaN)
    return tuple(args), jnp.where(args[15] >= 0, make_logw(c), jnp.nan)


def close(got, want, atol=ATOL):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=atol)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_sparse_decode_matches_reference(case):
    args, logw = make(case)
    scale = 1.0 / np.sqrt(case.head_dim)
    out, lse = jax.jit(functools.partial(ops.sparse_decode, sm_scale=scale))(*args,
                                                                             cold_logw=logw)
    ref_out, ref_lse = ref.sparse_decode(*args, sm_scale=scale, cold_logw=logw)
    assert np.isfinite(np.asarray(out)).all() and not np.isnan(np.asarray(lse)).any()
    close(out, ref_out)
    close(lse, ref_lse)
    if case.no_valid:
        np.testing.assert_array_equal(np.asarray(out), 0.0)


@pytest.mark.parametrize("case", CASES[:8], ids=str)
def test_each_kernel_matches_its_reference(case):
    """cold_logits, the window and attend_listed, each alone: the re-rank path lists
    candidates and a tail sample, then attends some of them in another order."""
    (q, bk, bv, bvalid, fk, fv, fks, fvs, fvalid, k4, v4, vs, vz, dc, dr, ids), logw = make(case)
    scale = 1.0 / np.sqrt(case.head_dim)
    live = (ids >= 0)[:, :, None, :, None]
    raw = ops.cold_logits(q, k4, dc, dr, ids)
    want = ref.cold_logits(q, k4, dc, dr, ids)
    # unscaled sums of 64 terms up to ~20: their rounding is relative to the largest
    close(jnp.where(live, raw, 0), jnp.where(live, want, 0),
          atol=RTOL * float(jnp.max(jnp.abs(want))))
    window = (q, bk, bv, bvalid, fk, fv, fks, fvs, fvalid)
    [(w_out, w_lse)] = ops.window_parts(*window, scale)
    r_out, r_lse = ref.merge_parts(ref.window_parts(*window, scale))
    close(w_out, r_out)
    close(w_lse, r_lse)
    # entries picked out of order, some twice, some none (-1)
    rng = np.random.default_rng(0)
    picked = rng.integers(-1, case.cold, ids.shape, dtype=np.int32) if case.cold else \
        np.zeros(ids.shape, np.int32)
    picked = jnp.asarray(picked)
    on = jnp.where(picked >= 0, jnp.take_along_axis(ids, jnp.maximum(picked, 0), -1), -1)
    w = jnp.where(on >= 0, jnp.nan_to_num(logw), jnp.nan)
    for got, exp in zip(
            ops.attend_listed(raw, picked, on, w, r_out, r_lse, v4, vs, vz, sm_scale=scale),
            ref.attend_listed(want, picked, on, w, r_out, r_lse, v4, vs, vz, sm_scale=scale)):
        close(got, exp)


def test_the_window_reads_the_first_slots_of_wider_tiers():
    """A narrow decode step's window: tiers of S = 5 slots (the last two NaN) read
    for the first B = 3, in place, bit-equal to tiers of those 3 slots; tiers of
    fewer slots than the queries are refused."""
    case = CASES[0]
    (q, bk, bv, bvalid, fk, fv, fks, fvs, fvalid, *_), _ = make(case)
    tiers = [bk, bv, fk, fv, fks, fvs]
    wide = [jnp.concatenate([t, jnp.full((2, *t.shape[1:]), jnp.nan, t.dtype)])[None]
            for t in tiers]
    f = jax.jit(functools.partial(ops.window_parts, sm_scale=0.125))
    window = lambda ts: (q, ts[0], ts[1], bvalid, ts[2], ts[3], ts[4], ts[5], fvalid)
    [got] = f(*window(wide), layer=jnp.int32(0))
    [want] = f(*window(tiers))
    for g, w in zip(got, want):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(Exception, match="hisparse window: shapes"):
        jax.block_until_ready(f(*window([t[:, :2] for t in wide]), layer=jnp.int32(0)))


def test_the_layer_axis_reads_that_layer_in_place():
    """Pool and tiers with a leading layer axis and a layer index: bit-equal to the
    same kernels on that layer's arrays (what the engine's stacked caches pass)."""
    case = CASES[0]
    layers = [make(case, seed=s)[0] for s in range(3)]
    args, logw = make(case, seed=1)
    stack = lambda i: jnp.stack([layer[i] for layer in layers])
    per_layer = {1, 2, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14}  # tiers and pool
    stacked = [stack(i) if i in per_layer else a for i, a in enumerate(args)]
    f = jax.jit(functools.partial(ops.sparse_decode, sm_scale=0.125))
    for layer in (0, 2):
        got = f(*stacked, cold_logw=logw, layer=jnp.int32(layer))
        alone = [layers[layer][i] if i in per_layer else a for i, a in enumerate(args)]
        want = f(*alone, cold_logw=logw)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # the reference's `layer` means the same
    got = ref.sparse_decode(*stacked, sm_scale=0.125, cold_logw=logw, layer=1)
    want = ref.sparse_decode(*[layers[1][i] if i in per_layer else a for i, a in enumerate(args)],
                             sm_scale=0.125, cold_logw=logw)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[6]], ids=str)
def test_a_sequence_does_not_depend_on_the_batch(case):
    """Served alone == served in a batch, bitwise (`state.decode_widths`)."""
    case = dataclasses.replace(case, batch=4)
    args, logw = make(case)
    logw = jnp.where(args[-1] >= 0, logw, 0.0)
    per_seq = {0, 1, 2, 3, 4, 5, 6, 7, 8, 15}
    f = jax.jit(functools.partial(ops.sparse_decode, sm_scale=0.125))
    wide = f(*args, cold_logw=logw)
    for b in (1, 3):
        cut = [a[:b] if i in per_seq else a for i, a in enumerate(args)]
        for got, want in zip(f(*cut, cold_logw=logw[:b]), wide, strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want)[:b])


def test_nan_in_one_sequence_stays_there():
    case = dataclasses.replace(CASES[0], batch=3)
    args, logw = make(case)
    f = jax.jit(functools.partial(ops.sparse_decode, sm_scale=0.125))
    clean = f(*args, cold_logw=logw)
    poisoned = list(args)
    poisoned[0] = args[0].at[1, 0, 0, 0].set(jnp.nan)
    out, lse = f(*poisoned, cold_logw=logw)
    assert np.isnan(np.asarray(out)[1, 0, 0]).all()
    for got, want in zip((out, lse), clean):
        for b in (0, 2):
            np.testing.assert_array_equal(np.asarray(got)[b], np.asarray(want)[b])


def test_ids_past_the_pool_are_clamped_as_xla_gathers_clamp():
    case = CASES[2]
    args, logw = make(case)
    args = list(args)
    for i in (9, 10, 11, 12, 13, 14):  # the last pool page holds page 1 (not NaN)
        args[i] = args[i].at[:, -1].set(args[i][:, 1])
    args[15] = args[15].at[0, 0, 0].set(case.pool + 7)  # reads page pool - 1, as jnp does
    scale = 0.125
    got = ops.sparse_decode(*args, sm_scale=scale, cold_logw=jnp.nan_to_num(logw))
    want = ref.sparse_decode(*args, sm_scale=scale, cold_logw=jnp.nan_to_num(logw))
    for g, w in zip(got, want):
        close(g, w)


@pytest.mark.parametrize("budget,rerank", [(256, 2.0), (128, 1.0), (4096, 2.0)])
def test_decode_attention_cpu_matches_xla(budget, rerank):
    """The cache's whole decode step on each implementation: the same pages
    selected, outputs within the kernels' tolerance (the re-rank path, the
    every-candidate path, and a budget past the context)."""
    from hisparse_jax import attention as att
    from hisparse_jax.cache import state as st
    cfg = HiSparseConfig(num_kv_heads=3, gqa_group=3, head_dim=64, max_context=3072, max_seqs=3,
                         budget_tokens=budget, rerank_multiple=rerank)
    rng = np.random.default_rng(0)
    s = st.init_state(cfg)
    for b, n in enumerate((3008, 2210, 1000)):  # rows padded to whole pages
        k = jnp.asarray(rng.standard_normal((3008, 3, 64)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((3008, 3, 64)), jnp.float32)
        s = st.prefill(cfg, s, b, k, v, n)
    q = jnp.asarray(rng.standard_normal((3, 9, 64)), jnp.float32) * 3
    out = {}
    for impl in ("xla", "cpu"):
        o, pages, _ = att.decode_step(cfg, s, q, implementation=impl)
        out[impl] = (np.asarray(o), np.asarray(pages))
    np.testing.assert_array_equal(out["cpu"][1], out["xla"][1])
    np.testing.assert_allclose(out["cpu"][0], out["xla"][0], rtol=RTOL, atol=1e-5)


def test_the_default_on_a_cpu_and_names_are_checked():
    assert resolve_implementation(None, HiSparseConfig()) == "cpu"
    assert resolve_implementation("xla", HiSparseConfig()) == "xla"
    with pytest.raises(ValueError, match="at most 16 query heads"):
        resolve_implementation("cpu", HiSparseConfig(num_kv_heads=1, gqa_group=32))
    assert resolve_implementation(None, HiSparseConfig(num_kv_heads=1, gqa_group=32)) == "xla"


def test_the_model_decodes_the_same_tokens_on_the_kernels():
    """SmolLM2 in an engine of 4 slots (a 64-token budget over prompts of 460 to
    1,100 tokens: the re-rank and the tail sample at work), the C++ kernels
    against XLA: the same greedy tokens for 16 steps, logits within what bf16
    activations carry a float32 ulp's difference to over 30 layers."""
    from models_fixtures import smollm2

    from hisparse_jax.models.engine import Engine
    m, tok = smollm2()
    text = ("In 1862 the survey ship reached the northern cape, where the crew counted "
            "forty-one seals, mended two sails and wrote the names of every island they "
            "passed into a log that is now kept in the city museum. ")
    doc = np.asarray(tok.encode(text * 40), np.int32)
    engines = {impl: Engine(m, max_seqs=4, max_context=1536, budget_tokens=64,
                            implementation=impl) for impl in ("xla", "cpu")}
    for e in engines.values():
        for slot, n in enumerate((460, 1100, 800, 700)):
            e.prefill(slot, doc[slot * 7:slot * 7 + n])
    worst = 0.0
    for _ in range(16):
        tokens = {impl: np.asarray(e.decode_step()) for impl, e in engines.items()}
        np.testing.assert_array_equal(tokens["cpu"], tokens["xla"])
        worst = max(worst, float(np.max(np.abs(np.asarray(engines["cpu"].logits)
                                               - np.asarray(engines["xla"].logits)))))
    assert worst < 1.0, worst


def test_built_once_and_reused():
    path = build.library_path(os.environ.get("CXX", "g++"))
    assert build.unavailable() is None and path.exists()
    mtime = path.stat().st_mtime_ns
    code = ("from cpu_kernels import build; import sys; "
            "sys.exit(0 if build.unavailable() is None else 1)")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert path.stat().st_mtime_ns == mtime  # loaded, not rebuilt


def test_without_a_compiler_the_default_is_xla_and_naming_the_kernels_says_why(tmp_path):
    code = """if True:
        import jax
        from cpu_kernels import build
        from hisparse_jax.backends import resolve_implementation
        from hisparse_jax.config import HiSparseConfig
        why = build.unavailable()
        assert why and "no C++ compiler" in why, why
        assert resolve_implementation(None, HiSparseConfig()) == "xla"
        assert "no C++ compiler" in build.amx_unavailable()
        from hisparse_jax import backends
        from hisparse_jax.attention import exact
        assert backends.resolve("causal_attention", None, head_dim=64) == "xla"
        try:
            resolve_implementation("cpu", HiSparseConfig())
        except ValueError as e:
            assert "no C++ compiler" in str(e) and "implementation='xla'" in str(e), e
        else:
            raise AssertionError("no error")
        """
    env = dict(os.environ, CXX="/nonexistent/g++", HISPARSE_HOME=str(tmp_path),
               JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    assert not (tmp_path / "cpu_kernels").exists()
