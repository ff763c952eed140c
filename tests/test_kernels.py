"""Pallas kernels vs their pure-jnp references (interpret mode on CPU), plus a
cross-lowering check of every kernel for the H200 (Triton backend, no GPU needed).

Adversarial inputs: odd lengths, several page sizes / head dims / GQA ratios,
NaN in every masked slot and unused pool page, empty selections.
Tolerances: encoders are bit exact; attention outputs (f32) rtol 1e-4 / atol 2e-5
with the default bf16x3 dots, rtol 1e-5 / atol 1e-6 with f32 dots; page scores
(bf16 products accumulated in f32, as the reference) rtol 1e-5 / atol 1e-5.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.lookup import kernel as lookup_kernel
from pallas_kernels.lookup import reference as lookup_ref
from pallas_kernels.quant import kernel as quant_kernel
from pallas_kernels.quant import reference as quant_ref
from pallas_kernels.sparse_decode import kernel as decode_kernel
from pallas_kernels.sparse_decode import reference as decode_ref

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)


def cross_lower(f, *args):
    """StableHLO text of f lowered for an H200 (CUDA) from this CPU host."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=H200)):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def assert_triton(txt, n_calls):
    assert "__gpu$xla.gpu.triton" in txt
    assert txt.count("__gpu$xla.gpu.triton") == n_calls


def keys(seed, n):
    return list(jax.random.split(jax.random.PRNGKey(seed), n))


def bits(x):
    """Exact comparison view: raw bytes of 1-byte dtypes, f32 values otherwise."""
    x = np.asarray(x)
    if x.dtype.itemsize == 1:
        return x.view(np.uint8)
    return x.astype(np.float32)


def assert_bit_exact(out, ref):
    assert len(out) == len(ref)
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype and o.shape == r.shape, (o.dtype, r.dtype, o.shape, r.shape)
        np.testing.assert_array_equal(bits(o), bits(r))


# ============================================================================ lookup


@dataclasses.dataclass(frozen=True)
class LookupCase:
    batch: int
    kv_heads: int
    group: int
    head_dim: int
    pages: int      # page-table width N (odd on purpose)
    pool: int       # pool pages P
    config: lookup_kernel.LookupConfig | None = None


LOOKUP_CASES = [
    LookupCase(2, 2, 1, 64, 37, 48),
    LookupCase(1, 2, 4, 128, 70, 96),
    LookupCase(2, 1, 8, 64, 13, 20, lookup_kernel.LookupConfig(block_pages=16)),
    LookupCase(1, 2, 8, 128, 5, 8),
]


def make_lookup(c: LookupCase, seed=0):
    k = keys(seed, 5)
    q = jax.random.normal(k[0], (c.batch, c.kv_heads, c.group, c.head_dim)) * 2.0
    center = jax.random.normal(k[1], (c.kv_heads, c.pool, c.head_dim))
    radius = jax.random.uniform(k[2], (c.kv_heads, c.pool, c.head_dim))
    # Pool page 0 and the top quarter of the pool are unused: NaN digests.
    unused = (jnp.arange(c.pool) == 0) | (jnp.arange(c.pool) >= c.pool * 3 // 4)
    center = jnp.where(unused[None, :, None], jnp.nan, center).astype(jnp.bfloat16)
    radius = jnp.where(unused[None, :, None], jnp.nan, radius).astype(jnp.float8_e4m3fn)
    table = jax.random.randint(k[3], (c.batch, c.pages), 1, c.pool * 3 // 4)
    table = jnp.where(jax.random.uniform(k[4], table.shape) < 0.3, -1, table)
    table = table.at[-1, c.pages // 2:].set(-1)  # a ragged tail
    return q, center, radius, table.astype(jnp.int32)


@pytest.mark.parametrize("case", LOOKUP_CASES, ids=str)
def test_lookup_matches_reference(case):
    args = make_lookup(case)
    bound, center = lookup_kernel.page_scores(*args, interpret=True, config=case.config)
    rb, rc = lookup_ref.page_scores(*args)
    for out, ref in ((bound, rb), (center, rc)):
        assert out.shape == ref.shape and out.dtype == jnp.float32
        assert not np.isnan(np.asarray(out)).any()
        np.testing.assert_array_equal(np.isneginf(out), np.isneginf(ref))
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", [*LOOKUP_CASES, LookupCase(2, 2, 4, 64, 5, 64)], ids=str)
def test_lookup_reference_pool_and_row_scoring_agree(case, monkeypatch):
    """The reference scores the whole pool when it is small, else gathers each
    sequence's digest rows: the same scores up to f32 summation order. Run
    eagerly, so each call reads the ratio (a jit reuses the first trace: the
    earlier jitted version of this test compared one branch with itself)."""
    args = make_lookup(case)
    results = []
    for ratio in (0, 10**9):  # rows first, then pool first
        monkeypatch.setattr(lookup_ref, "POOL_SCORING_RATIO", ratio)
        results.append(lookup_ref.page_scores(*args))
    for rows, pool in zip(*results):
        np.testing.assert_array_equal(np.isneginf(rows), np.isneginf(pool))
        np.testing.assert_allclose(rows, pool, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("kv_heads", "group", "pages", "pool"),
                         [(3, 3, 96, 800), (3, 3, 60, 200), (3, 3, 512, 4096), (2, 4, 33, 300)])
def test_lookup_reference_scores_of_a_sequence_do_not_depend_on_the_batch(kv_heads, group,
                                                                         pages, pool):
    """A sequence's scores are bit-equal whatever number of sequences the call
    scores beside it: a decode step over the first slot must equal one over 2, 4
    or 8 (`state.decode_widths`; served alone == served in a batch). XLA:CPU sums
    a row in another order once the whole reduction passes ~4,096 elements, so the
    mass's log-sum-exps, over all sequences at once, put SmolLM2's logits 0.2 apart
    after 8 steps in a narrow step; they now run one sequence at a time. And it
    runs one sequence's gathered-digest dots (a pool over 4x the table) in
    another order than two or more (the first and last cases differed at 1);
    one sequence is scored as two."""
    rng = np.random.default_rng(pages)
    dc = jnp.asarray(rng.standard_normal((kv_heads, pool, 64)), jnp.bfloat16)
    dr = jnp.asarray(np.abs(rng.standard_normal((kv_heads, pool, 64))) * 0.1,
                     jnp.float8_e4m3fn)
    table = rng.integers(0, pool, (16, pages)).astype(np.int32)
    table[:, pages // 2 + 1:] = -1  # odd lengths, empty tails
    table[3] = -1
    q = jnp.asarray(rng.standard_normal((16, kv_heads, group, 64)) * 2, jnp.float32)
    f = jax.jit(lookup_ref.page_scores)
    wide = f(q, dc, dr, jnp.asarray(table))
    for b in (1, 2, 4, 8):
        for got, want in zip(f(q[:b], dc, dr, jnp.asarray(table[:b])), wide, strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want)[:b])


def test_lookup_all_empty_row():
    case = LookupCase(2, 2, 4, 64, 9, 16)
    q, dc, dr, table = make_lookup(case)
    table = table.at[0].set(-1)
    bound, center = lookup_kernel.page_scores(q, dc, dr, table, interpret=True)
    assert np.isneginf(bound[0]).all() and np.isneginf(center[0]).all()


def test_lookup_config_validation():
    with pytest.raises(ValueError):
        lookup_kernel.LookupConfig(block_pages=24)
    with pytest.raises(ValueError):
        lookup_kernel.LookupConfig(num_warps=3)


def test_lookup_cross_lowers_for_h200():
    args = make_lookup(LookupCase(2, 8, 4, 128, 100, 128))
    txt = cross_lower(lambda *a: lookup_kernel.page_scores(*a, interpret=False), *args)
    assert_triton(txt, 1)


# ============================================================================ quant


@pytest.mark.parametrize("shape", [(3, 5, 64), (2, 2, 17, 128), (1, 64)])
def test_encode_fp8_bit_exact(shape):
    x = jax.random.normal(keys(1, 1)[0], shape) * 5.0
    x = x.at[..., 0, :].set(0.0)  # all-zero row -> scale 1
    out = quant_kernel.encode_fp8(x, interpret=True)
    assert_bit_exact(out, quant_ref.encode_fp8(x))


@pytest.mark.parametrize("page,head_dim", [(16, 64), (32, 128), (64, 64)])
def test_encode_cold_keys_bit_exact(page, head_dim):
    k = jax.random.normal(keys(2, 1)[0], (3, 2, page, head_dim)) * 3.0
    k = k.at[0, 0, :, 3].set(0.7)                       # constant channel: zero step
    k = k.astype(jnp.bfloat16)                          # bf16 input, as stored hot
    out = quant_kernel.encode_cold_keys(k, interpret=True)
    assert_bit_exact(out, quant_ref.encode_cold_keys(k))


@pytest.mark.parametrize("head_dim,group", [(64, 16), (64, 32), (64, 64), (128, 32), (128, 128)])
def test_encode_cold_values_bit_exact(head_dim, group):
    v = jax.random.normal(keys(3, 1)[0], (2, 3, 19, head_dim)) * 2.0
    v = v.at[0, 0, 0, :].set(-1.5)                      # constant row: zero step
    out = quant_kernel.encode_cold_values(v, group, interpret=True)
    assert_bit_exact(out, quant_ref.encode_cold_values(v, group))


def test_quant_cross_lowers_for_h200():
    x = jax.ShapeDtypeStruct((4, 2, 32, 128), jnp.bfloat16)
    for f, n in ((lambda a: quant_kernel.encode_fp8(a, interpret=False), 1),
                 (lambda a: quant_kernel.encode_cold_keys(a, interpret=False), 1),
                 (lambda a: quant_kernel.encode_cold_values(a, 32, interpret=False), 1),
                 (lambda a: quant_kernel.encode_cold_values(a, 128, interpret=False), 1)):
        txt = cross_lower(f, x)
        assert_triton(txt, n)


# ============================================================================ sparse decode


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    page: int
    head_dim: int
    group: int           # GQA ratio G
    bf16_len: int        # Tb
    fp8_len: int         # Tw (0 = empty warm part)
    cold: int            # K selected pages per (b, h)
    value_group: int = 32
    batch: int = 2
    kv_heads: int = 2
    pool: int = 12
    cold_empty: bool = False     # all cold_ids == -1
    no_valid: bool = False       # bf16 and fp8 slots all invalid
    config: decode_kernel.DecodeConfig | None = None
    rtol: float = 1e-4
    atol: float = 2e-5


F32 = decode_kernel.DecodeConfig(precision="f32", block_tokens=16, num_splits=3)

DECODE_CASES = [
    DecodeCase(16, 64, 1, 21, 13, 5),
    DecodeCase(32, 128, 4, 19, 9, 3),
    DecodeCase(64, 64, 8, 33, 7, 2, value_group=16),
    DecodeCase(16, 128, 8, 8, 0, 4, value_group=16),                 # empty fp8 part
    DecodeCase(32, 64, 4, 21, 13, 3, cold_empty=True),               # all cold_ids -1
    DecodeCase(16, 64, 4, 21, 13, 0),                                # no cold slots at all
    DecodeCase(16, 64, 4, 9, 0, 3, cold_empty=True, no_valid=True),  # nothing to attend
    DecodeCase(16, 64, 4, 21, 13, 5, config=F32, rtol=1e-5, atol=1e-6),
    DecodeCase(64, 128, 1, 40, 24, 3, batch=1, kv_heads=3, config=F32, rtol=1e-5, atol=1e-6),
]


def make_decode(c: DecodeCase, seed=0):
    """Synthetic attended set; every masked slot and unused pool page holds NaN."""
    k = keys(seed, 12)
    b, h, g, d = c.batch, c.kv_heads, c.group, c.head_dim
    q = jax.random.normal(k[0], (b, h, g, d))
    bvalid = jax.random.uniform(k[1], (b, c.bf16_len)) < 0.7
    fvalid = jax.random.uniform(k[2], (b, c.fp8_len)) < 0.7
    if c.no_valid:
        bvalid = jnp.zeros_like(bvalid)
        fvalid = jnp.zeros_like(fvalid)
    nan4 = lambda x, ok: jnp.where(ok[:, None, :, None], x, jnp.nan)
    bk = nan4(jax.random.normal(k[3], (b, h, c.bf16_len, d)), bvalid).astype(jnp.bfloat16)
    bv = nan4(jax.random.normal(k[4], (b, h, c.bf16_len, d)), bvalid).astype(jnp.bfloat16)
    fk, fks = quant_ref.encode_fp8(jax.random.normal(k[5], (b, h, c.fp8_len, d)) * 2.0)
    fv, fvs = quant_ref.encode_fp8(jax.random.normal(k[6], (b, h, c.fp8_len, d)))
    fk, fv = nan4(fk, fvalid).astype(fk.dtype), nan4(fv, fvalid).astype(fv.dtype)
    fks = jnp.where(fvalid[:, None, :], fks, jnp.nan)
    fvs = jnp.where(fvalid[:, None, :], fvs, jnp.nan)
    # Head-major cold pool [Hkv, P, ...], encoded by the reference codecs.
    k4, dc, dr = quant_ref.encode_cold_keys(
        jax.random.normal(k[7], (h, c.pool, c.page, d)) * 1.5)
    v4, vs, vz = quant_ref.encode_cold_values(
        jax.random.normal(k[8], (h, c.pool, c.page, d)), c.value_group)
    # Pool page 0 (what cold_ids == -1 clamps to) and the top pages are unused: NaN.
    unused = (jnp.arange(c.pool) == 0) | (jnp.arange(c.pool) >= c.pool - 2)
    dc = jnp.where(unused[None, :, None], jnp.nan, dc).astype(jnp.bfloat16)
    dr = jnp.where(unused[None, :, None], jnp.nan, dr).astype(jnp.bfloat16)
    vs = jnp.where(unused[None, :, None, None], jnp.nan, vs).astype(jnp.bfloat16)
    vz = jnp.where(unused[None, :, None, None], jnp.nan, vz).astype(jnp.bfloat16)
    ids = jax.random.randint(k[9], (b, h, c.cold), 1, c.pool - 2)
    ids = jnp.where(jax.random.uniform(k[10], ids.shape) < 0.3, -1, ids)
    if c.cold_empty:
        ids = jnp.full_like(ids, -1)
    return (q, bk, bv, bvalid, fk, fv, fks, fvs, fvalid, k4, v4, vs, vz, dc, dr,
            ids.astype(jnp.int32))


def make_logw(c: DecodeCase, seed=1):
    """Importance weights of the cold entries: log w in [-1, 5] (w up to ~150), as
    sampled pages carry (attention.sample_tail)."""
    return jax.random.uniform(jax.random.key(seed), (c.batch, c.kv_heads, c.cold), minval=-1.0,
                              maxval=5.0)


@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_sparse_decode_matches_reference(case):
    args = make_decode(case)
    scale = 1.0 / np.sqrt(case.head_dim)
    logw = jnp.where(args[-1] >= 0, make_logw(case), jnp.nan)  # unused entries: NaN
    out, lse = decode_kernel.sparse_decode(*args, sm_scale=scale, cold_logw=logw,
                                           interpret=True, config=case.config)
    ref_out, ref_lse = decode_ref.sparse_decode(*args, sm_scale=scale, cold_logw=logw)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert np.isfinite(np.asarray(out)).all()
    assert not np.isnan(np.asarray(lse)).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_allclose(out, ref_out, rtol=case.rtol, atol=case.atol)
    np.testing.assert_allclose(lse, ref_lse, rtol=case.rtol, atol=case.atol)
    if case.no_valid:
        np.testing.assert_array_equal(np.asarray(out), 0.0)


@pytest.mark.parametrize("case", [DecodeCase(16, 64, 3, 130, 0, 9, batch=4, kv_heads=3, pool=40),
                                  DecodeCase(16, 64, 3, 128, 64, 31, batch=4, kv_heads=3, pool=40),
                                  DecodeCase(32, 128, 4, 21, 13, 5, batch=4),
                                  DecodeCase(16, 64, 1, 192, 0, 3, batch=4, kv_heads=3)], ids=str)
def test_sparse_decode_reference_of_a_sequence_does_not_depend_on_the_batch(case):
    """A sequence's output and lse are bit-equal whatever number of sequences the
    call computes beside it (a decode step over 1 or 2 slots must equal one over
    4: served alone == served in a batch, `state.decode_widths`). With the
    softmax's sums as `jnp.sum` (not `row_sum`) two or three of the cases differ
    at 1 and 2 sequences (XLA:CPU sums a row in another order for fewer rows)."""
    args = make_decode(case)
    logw = jnp.where(args[-1] >= 0, make_logw(case), 0.0)
    per_seq = {0, 1, 2, 3, 4, 5, 6, 7, 8, 15}  # the arguments with a sequence axis
    f = jax.jit(functools.partial(decode_ref.sparse_decode, sm_scale=0.125))
    wide = f(*args, cold_logw=logw)
    for b in (1, 2, 3):
        cut = [a[:b] if i in per_seq else a for i, a in enumerate(args)]
        for got, want in zip(f(*cut, cold_logw=logw[:b]), wide, strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want)[:b])


def test_cold_log_weight_counts_a_page_w_times():
    """A page with log weight log(3) attends like three copies of it."""
    case = DecodeCase(16, 64, 4, 21, 13, 3)
    args = list(make_decode(case))
    ids = args[-1]
    scale = 1.0 / np.sqrt(case.head_dim)
    once = decode_ref.sparse_decode(*args[:-1], ids[..., :1], sm_scale=scale,
                                    cold_logw=jnp.full(ids[..., :1].shape, np.log(3.0)))
    thrice = decode_ref.sparse_decode(*args[:-1], jnp.repeat(ids[..., :1], 3, axis=-1),
                                      sm_scale=scale)
    for a, b in zip(once, thrice):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    plain = decode_ref.sparse_decode(*args[:-1], ids[..., :1], sm_scale=scale)
    assert not np.allclose(once[1], plain[1])  # the weight is not ignored


def test_decode_config_validation():
    with pytest.raises(ValueError):
        decode_kernel.DecodeConfig(block_tokens=48)
    with pytest.raises(ValueError):
        decode_kernel.DecodeConfig(precision="fp8")
    with pytest.raises(ValueError):
        decode_kernel.DecodeConfig(num_splits=0)


@pytest.mark.parametrize("page,head_dim,group", [(16, 64, 1), (64, 128, 8), (32, 128, 4)])
def test_sparse_decode_cross_lowers_for_h200(page, head_dim, group):
    case = DecodeCase(page, head_dim, group, 21, 13, 5)
    args = make_decode(case)
    txt = cross_lower(lambda *a: decode_kernel.sparse_decode(
        *a[:-1], sm_scale=0.1, cold_logw=a[-1], interpret=False), *args, make_logw(case))
    assert_triton(txt, 3)  # bf16, fp8 and int4 parts


def test_attention_uses_these_kernels(monkeypatch):
    """implementation="pallas" runs these kernels: each replaced by a spy that
    records the call and returns its reference's result (the same signature)."""
    from hisparse_jax import backends
    from hisparse_jax.attention import decode_attention
    from hisparse_jax.cache.handle import HiSparseCache
    from hisparse_jax.config import HiSparseConfig
    called = []

    def spy(name, reference):
        def fn(*args, interpret=None, **kwargs):
            called.append(name)
            return reference(*args, **kwargs)
        return fn

    assert {op for op, names in backends.registered().items() if "pallas" in names} >= {
        "page_scores", "attend_cold", "tier_encoders"}
    cfg = HiSparseConfig(num_kv_heads=2, gqa_group=2, head_dim=64, max_context=2048,
                         budget_tokens=128, max_seqs=1)
    rng = np.random.default_rng(0)
    cache = HiSparseCache(cfg, "xla")
    k, v = (rng.normal(size=(1500, 2, 64)).astype(np.float32) for _ in range(2))
    cache.prefill(0, k, v)
    q = jnp.asarray(rng.normal(size=(1, 4, 64)), jnp.float32)
    want = decode_attention(cfg, cache.state, q, implementation="xla")
    monkeypatch.setattr(lookup_kernel, "page_scores", spy("lookup", lookup_ref.page_scores))
    monkeypatch.setattr(decode_kernel, "sparse_decode", spy("decode", decode_ref.sparse_decode))
    jax.clear_caches()
    got = decode_attention(cfg, cache.state, q, implementation="pallas")
    jax.clear_caches()
    assert sorted(set(called)) == ["decode", "lookup"]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def _cold_only_expected(args, sm_scale):
    """Cold part by dequantizing whole pages (quant.reference decoders) + attend_part:
    an independent check that also covers value groups spanning both halves (group == D)."""
    q, k4, v4, vs, vz, dc, dr, ids = (args[0], args[9], args[10], args[11], args[12], args[13],
                                      args[14], args[15])
    b, h, _, d = q.shape
    heads = jnp.arange(h)[None, :, None]
    sel = jnp.maximum(ids, 0)
    k = quant_ref.decode_cold_keys(k4[heads, sel], dc[heads, sel], dr[heads, sel])
    v = quant_ref.decode_cold_values(v4[heads, sel], vs[heads, sel], vz[heads, sel])
    kk, page = ids.shape[2], k.shape[3]
    valid = jnp.broadcast_to((ids >= 0)[..., None], (b, h, kk, page)).reshape(b, h, kk * page)
    return decode_ref.attend_part(q, k.reshape(b, h, kk * page, d),
                                  v.reshape(b, h, kk * page, d), valid, sm_scale)


@pytest.mark.parametrize("page,head_dim,value_group", [(16, 64, 64), (32, 128, 128), (16, 64, 16)])
def test_sparse_decode_cold_only_any_value_group(page, head_dim, value_group):
    case = DecodeCase(page, head_dim, 4, 3, 0, 5, value_group=value_group, no_valid=True)
    args = make_decode(case)
    scale = 1.0 / np.sqrt(head_dim)
    out, lse = decode_kernel.sparse_decode(*args, sm_scale=scale, interpret=True)
    ref_out, ref_lse = _cold_only_expected(args, scale)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-4, atol=2e-5)


def test_sparse_decode_cross_lowers_group_equals_head_dim():
    case = DecodeCase(64, 128, 4, 16, 16, 3, value_group=128)
    args = make_decode(case)
    txt = cross_lower(lambda *a: decode_kernel.sparse_decode(
        *a, sm_scale=0.1, interpret=False,
        config=decode_kernel.DecodeConfig(block_tokens=32, num_warps=8, num_stages=3)), *args)
    assert_triton(txt, 3)
