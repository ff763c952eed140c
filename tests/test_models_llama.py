"""The decoder (against a float64 reference), RoPE, the engine's caches and jitted
programs, and sampling, on tiny random models."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import AMX
from models_fixtures import bf16, hf_weights, model_weights, reference_logits, tiny_config

from hisparse_jax import backends
from hisparse_jax.models import engine as eng
from hisparse_jax.models import kv
from hisparse_jax.models.engine import Engine
from hisparse_jax.models.llama import (
    Llama,
    RopeScaling,
    apply_rope,
    matmul,
    rms_norm,
    rope_frequencies,
)
from hisparse_jax.models.sampling import (
    GREEDY,
    SamplingParams,
    SlotSampling,
    sample,
    sample_slots,
)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31])
def test_rms_norm_of_a_row_does_not_depend_on_the_batch(rows):
    """A row's norm is bit-equal in any batch: a decode step's slot must not change
    with how many slots the step computes (XLA:CPU sums fewer than 8 rows in
    another order; before the padding 28 of 30 random 4-row batches differed)."""
    rng = np.random.default_rng(rows)
    f = jax.jit(lambda x, w: rms_norm(x, w, 1e-5))
    w = jnp.asarray(rng.standard_normal(576), jnp.float32)
    for _ in range(10):
        x = jnp.asarray(rng.standard_normal((64, 576)) * 3, jnp.float32)
        np.testing.assert_array_equal(np.asarray(f(x[:rows], w)), np.asarray(f(x, w))[:rows])
        np.testing.assert_array_equal(np.asarray(f(x[:rows].reshape(rows, 1, 576), w))[:, 0],
                                      np.asarray(f(x, w))[:rows])


@pytest.mark.parametrize("products", ["xla", "cpu"])
@pytest.mark.parametrize(("rows", "shape"), [(1, (1536, 576)), (2, (192, 576)), (3, (576, 1536)),
                                           (2, (49152, 576)), (5, (576, 576))])
def test_matmul_of_a_row_does_not_depend_on_the_batch(rows, shape, products):
    """A row's product is bit-equal in any batch (XLA:CPU sums 1 or 2 rows in
    another order than 3 or more; before the padding to 4 rows 466 of 576 outputs
    of one row differed from the same row in a 16-row batch), in XLA and on the
    kernel, and the kernel's equals XLA's on AMX (on AVX-512 it sums in another
    order: within float32's rounding). Weights [out, in]; a stacked layer too."""
    if products == "cpu" and backends.resolve("weight_products") != "cpu":
        pytest.skip("the product kernels do not run here")
    rng = np.random.default_rng(rows)
    w = jnp.asarray(rng.standard_normal(shape) * 0.05, jnp.bfloat16)
    f = jax.jit(functools.partial(matmul, products=products))
    x = jnp.asarray(rng.standard_normal((16, shape[1])), jnp.float32)
    np.testing.assert_array_equal(np.asarray(f(x[:rows], w)), np.asarray(f(x, w))[:rows])
    stacked = jnp.stack([w[::-1], w, -w])
    g = jax.jit(lambda x, w, layer: matmul(x, w, layer, products=products))
    np.testing.assert_array_equal(np.asarray(g(x[:rows], stacked, 1)), np.asarray(f(x, w))[:rows])
    xla = np.asarray(jax.jit(matmul)(x[:rows], w))
    if products == "xla" or AMX:
        np.testing.assert_array_equal(np.asarray(f(x[:rows], w)), xla)
    else:
        np.testing.assert_allclose(np.asarray(f(x[:rows], w)), xla, rtol=1e-5,
                                   atol=1e-5 * np.abs(xla).max())


def _model(cfg, seed=0):
    hf = hf_weights(cfg, seed)
    return Llama(cfg, model_weights(cfg, hf)), hf


def _rounded(hf):
    return {k: ([{n: bf16(x) for n, x in layer.items()} for layer in v] if k == "layers"
                else bf16(v)) for k, v in hf.items()}


# ---------------------------------------------------------------- config

def test_config_validates():
    with pytest.raises(ValueError, match="num_heads=5 must be a multiple of num_kv_heads=2"):
        tiny_config(num_heads=5)
    with pytest.raises(ValueError, match="head_dim=63: must be even"):
        tiny_config(head_dim=63)
    with pytest.raises(ValueError, match="rope_theta=0"):
        tiny_config(rope_theta=0)
    with pytest.raises(ValueError, match="LlamaConfig.num_layers=0"):
        tiny_config(num_layers=0)
    with pytest.raises(ValueError, match="RopeScaling.kind='ntk'"):
        RopeScaling(kind="ntk", factor=2.0)
    with pytest.raises(ValueError, match="factor=0.5"):
        RopeScaling(kind="linear", factor=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny_config().num_layers = 3


def test_weights_checked():
    cfg = tiny_config()
    w = model_weights(cfg, hf_weights(cfg))
    w["layers"]["wk"] = w["layers"]["wk"][:, :, :64]
    with pytest.raises(ValueError, match=r"layer weight wk: expected \(2, 256, 128\), got "
                                         r"\(2, 256, 64\)"):
        Llama(cfg, w)


# ---------------------------------------------------------------- RoPE

def test_rope_frequencies():
    cfg = tiny_config(head_dim=128, num_heads=2, num_kv_heads=1, rope_theta=500000.0)
    plain, s = rope_frequencies(cfg)
    np.testing.assert_allclose(plain, 500000.0 ** (-np.arange(0, 128, 2) / 128), rtol=1e-6)
    assert s == 1.0
    lin, _ = rope_frequencies(cfg.replace(rope_scaling=RopeScaling("linear", 4.0)))
    np.testing.assert_allclose(lin, plain / 4, rtol=1e-6)
    # Llama 3.1's: wavelengths under 8192/4 unchanged, over 8192/1 divided by 8, between blended
    l3 = RopeScaling("llama3", 8.0, original_max_position=8192, low_freq_factor=1.0,
                     high_freq_factor=4.0)
    f, _ = rope_frequencies(cfg.replace(rope_scaling=l3))
    wavelen = 2 * np.pi / plain
    high, low = wavelen < 8192 / 4, wavelen > 8192
    np.testing.assert_allclose(f[high], plain[high], rtol=1e-6)
    np.testing.assert_allclose(f[low], plain[low] / 8, rtol=1e-6)
    mid = ~high & ~low
    assert mid.any() and np.all(f[mid] < plain[mid]) and np.all(f[mid] > plain[mid] / 8)
    assert np.all(np.diff(f) < 0)  # still monotone
    y, scale = rope_frequencies(cfg.replace(rope_scaling=RopeScaling("yarn", 4.0, 4096)))
    assert scale == pytest.approx(0.1 * math.log(4) + 1)
    np.testing.assert_allclose(y[:4], plain[:4], rtol=1e-6)       # fast dims extrapolate
    np.testing.assert_allclose(y[-4:], plain[-4:] / 4, rtol=1e-6)  # slow dims interpolate


def test_rope_is_relative():
    """q.k after RoPE depends only on the distance: the pairing of q and k agrees."""
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((1, 64)), jnp.float32) for _ in range(2))
    inv = jnp.asarray(rope_frequencies(tiny_config())[0])

    def dot(m, n):
        return float(jnp.sum(apply_rope(q, jnp.array(m), inv, 1.0)
                             * apply_rope(k, jnp.array(n), inv, 1.0)))

    assert dot(10, 3) == pytest.approx(dot(1007, 1000), rel=1e-4)
    assert dot(10, 3) != pytest.approx(dot(10, 4), rel=1e-3)
    x = apply_rope(q, jnp.array(123), inv, 1.0)
    assert float(jnp.linalg.norm(x)) == pytest.approx(float(jnp.linalg.norm(q)), rel=1e-5)


# ---------------------------------------------------------------- the forward

def _all_logits(model, ids):
    e = Engine(model, max_context=64, attention="dense")
    out = []
    for n in range(1, len(ids) + 1):
        e.prefill(0, ids[:n])
        out.append(np.asarray(e.logits))
    return np.stack(out)


@pytest.mark.parametrize("heads,kv,tie,bias", [(4, 2, True, False), (4, 1, False, True),
                                               (4, 4, True, False)])
def test_forward_matches_reference(heads, kv, tie, bias):
    """GQA (grouped, multi-query, multi-head), tied/untied output, QKV bias."""
    cfg = tiny_config(num_heads=heads, num_kv_heads=kv, tie_embeddings=tie, qkv_bias=bias,
                      num_layers=3)
    model, hf = _model(cfg, seed=heads + kv)
    ids = [7, 120, 33, 250, 4, 99]
    ours = _all_logits(model, ids)
    ref = reference_logits(cfg, _rounded(hf), ids)
    tol = 0.02 * np.abs(ref).max()
    assert np.abs(ours - ref).max() < tol
    # the same greedy token wherever the reference's top two are further apart than
    # the tolerance (seed 5's position 3 is a tie to 8e-4: either token is right)
    top2 = np.sort(ref, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * tol
    assert clear.sum() >= len(ids) // 2
    assert (ours.argmax(-1) == ref.argmax(-1))[clear].all()


# ---------------------------------------------------------------- engine

@pytest.fixture(scope="module")
def tiny():
    return _model(tiny_config())[0]


def test_decode_equals_longer_prefill(tiny):
    """A decode step gives the logits of a prefill one token longer (both attend
    the bf16 K/V the cache holds), per slot, with slots at different lengths and
    one of them idle. Bit-equal on three CPUs; on an AMX-capable Xeon (2026-12-04)
    the step (3 rows) and the prefill (6 to 24 rows) sum in other orders, 7.6e-6
    apart at first, and a flipped bf16 rounding of a stored K/V then moved later
    steps' logits by up to 0.084 (5.4e-4 of the largest). So: within 2e-3 of the
    largest logit, the same greedy token unless the reference's top two are
    closer than that. A position off by one (RoPE at lens + 1) fails this."""
    e = Engine(tiny, max_seqs=3, max_context=128, attention="dense")
    ref = Engine(tiny, max_context=128, attention="dense")
    prompts = {0: [5, 6, 7, 8, 9], 2: list(range(20, 40))}
    for s, p in prompts.items():
        e.prefill(s, p)
    for step in range(4):
        before = e.tokens.copy()
        nxt = e.decode_step(np.array([True, False, True]))
        for s, p in prompts.items():
            p.append(int(before[s]))
            ref.prefill(0, p)
            want = np.asarray(ref.logits)
            tol = 2e-3 * np.abs(want).max()
            np.testing.assert_allclose(np.asarray(e.logits)[s], want, rtol=0, atol=tol)
            top2 = np.sort(want)[-2:]
            if top2[1] - top2[0] > 2 * tol:
                assert nxt[s] == int(np.argmax(want))
    assert list(e.lens) == [9, 0, 24]


def test_hisparse_engine_tracks_dense(tiny):
    """Through all tiers (sink, hot, fp8 warm, and int4 cold pages of which a budget
    of 4 is selected), the HiSparse model's logits stay close to dense attention's."""
    prompt = list(np.random.default_rng(0).integers(3, 300, 480))
    small = {"hot_tokens": 32, "warm_tokens": 64}  # cold from 112 tokens back
    out = {}
    for attention in ("dense", "hisparse"):
        e = Engine(tiny, max_context=512, attention=attention, budget_tokens=64,
                   cache_overrides=small if attention == "hisparse" else None)
        toks = [e.prefill(0, prompt)]
        logits = []
        for _ in range(6):
            toks.append(int(e.decode_step()[0]))
            logits.append(np.asarray(e.logits)[0])
        out[attention] = toks, np.stack(logits)
        if attention == "hisparse":
            st = jax.tree.map(lambda a: a[0], e.caches)  # layer 0
            assert int(st.seq_lens[0]) == 486
            cold = int(jnp.sum(st.page_table[0] >= 0))
            assert cold == (486 - 1) // 16 + 1 - 1 - 2 - 4 and cold > 4 * e.cache_cfg.budget_pages
    diff = np.abs(out["hisparse"][1] - out["dense"][1]).max() / np.abs(out["dense"][1]).max()
    assert diff < 0.03, diff  # measured 0.0087 (0.0116 with value groups of 32)


@pytest.mark.parametrize("page,group", [(16, None), (32, None), (16, 32)])
def test_hisparse_engine_pages_of_any_size(tiny, page, group):
    """An overridden page size rounds the engine's context to whole pages of it (500
    tokens: 512), an overridden value group replaces the preset's one a row, and the
    model still tracks dense attention through every tier."""
    prompt = list(np.random.default_rng(1).integers(3, 300, 470))
    small = {"page_size": page, "hot_tokens": 32, "warm_tokens": 64}
    if group is not None:
        small["value_group"] = group
    logits = {}
    for attention in ("dense", "hisparse"):
        e = Engine(tiny, max_context=500, attention=attention, budget_tokens=64,
                   cache_overrides=small if attention == "hisparse" else None)
        e.prefill(0, prompt)
        rows = [np.asarray(e.logits).reshape(-1)]  # one slot: [V] after a prefill, [1, V] after a step
        for t in (5, 7, 11):  # the same tokens fed to both
            e.decode_step(tokens=np.array([t]))
            rows.append(np.asarray(e.logits).reshape(-1))
        logits[attention] = np.stack(rows)
        if attention == "hisparse":
            assert (e.cache_cfg.page_size, e.cache_cfg.max_context) == (page, 512)
            assert e.cache_cfg.value_group == (group or 64)  # head_dim 64: one a row
    diff = np.abs(logits["hisparse"] - logits["dense"]).max() / np.abs(logits["dense"]).max()
    assert diff < 0.03, diff  # measured 0.0084 (pages of 16), 0.0054 (32), 0.0079 (groups of 32)
    with pytest.raises(ValueError, match="page_size"):
        Engine(tiny, max_context=500, cache_overrides={"page_size": 24})


def test_one_program_per_shape(tiny):
    e = Engine(tiny, max_seqs=2, max_context=64, attention="hisparse")
    e.prefill(0, [1, 2, 3, 4, 5])
    e.prefill(1, list(range(9, 20)))  # 5 and 11 tokens share the 64-token program
    n_prefill = kv.prefill._cache_size()
    caches = e.caches
    n_decode = kv.decode._cache_size()
    e.decode_step()
    assert caches.bf16_k.is_deleted()  # donated: updated in place
    e.decode_step(np.array([True, False]))
    assert e.decode_widths() == [1, 2]
    assert kv.decode._cache_size() == n_decode + 2  # one program per width
    n_decode += 2
    for active in ([True, False], [False, True], [True, True]):
        e.decode_step(np.array(active))
    assert kv.decode._cache_size() == n_decode
    e.prefill(0, [7] * 13)
    assert kv.prefill._cache_size() == n_prefill
    assert eng.prefill_length(5) == 64 and eng.prefill_length(700) == 1024
    # the fill's padded length: powers of two past a block, capped at the staging buffer
    for n, context, want in [(5, 8192, 64), (600, 8192, 1024), (1100, 2048, 2048),
                             (1100, 8192, 2048), (5000, 6000, 6144), (7800, 8192, 8192)]:
        assert eng.fill_length(n, context) == want, (n, context)


def test_generate_batch(tiny):
    """Prompts decoded together give each one's tokens alone (the others idle)."""
    from hisparse_jax.models.generate import generate_batch
    e = Engine(tiny, max_seqs=3, max_context=64, attention="dense")
    prompts = [[5, 6, 7], list(range(40, 60)), [200] * 9]
    together, timing = generate_batch(e, prompts, max_tokens=6)
    assert timing["decode_steps"] == 5 and all(len(t) == 6 for t in together)
    for i, p in enumerate(prompts):
        assert generate_batch(e, [p], max_tokens=6)[0][0] == together[i]
    eos = together[1][2]
    stopped, _ = generate_batch(e, prompts, max_tokens=6, eos=[eos])
    for t, s in zip(together, stopped):  # each stops at its first eos
        assert s == (t[:t.index(eos) + 1] if eos in t else t)
    assert e.lens.tolist() == [0, 0, 0]  # released


def test_engine_errors(tiny):
    e = Engine(tiny, max_seqs=2, max_context=32, attention="dense")
    with pytest.raises(ValueError, match="prompt of 32 tokens does not fit max_context=32"):
        e.prefill(0, [1] * 32)
    with pytest.raises(ValueError, match="prompt is empty"):
        e.prefill(0, [])
    with pytest.raises(ValueError, match=r"slot must be an int >= 0 and <= 1, got 2"):
        e.prefill(2, [1])
    with pytest.raises(ValueError, match="slot must be an int"):  # a bool is no slot
        e.prefill(True, [1])
    with pytest.raises(ValueError, match="integer token ids"):  # never truncated
        e.prefill(0, [1.5, 2.0])
    with pytest.raises(ValueError, match="active must be a bool array"):
        e.decode_step(["no", "no"])
    with pytest.raises(ValueError, match=r"prompt ids must be in \[0, 300\)"):
        e.prefill(0, [1, 300])
    with pytest.raises(ValueError, match=r"slots \[1\] are empty"):
        e.decode_step(np.array([False, True]))
    e.prefill(0, [1] * 31)
    e.decode_step(np.array([True, False]))
    with pytest.raises(ValueError, match=r"slots \[0\] are full: max_context=32"):
        e.decode_step(np.array([True, False]))
    with pytest.raises(ValueError, match="attention='sparse'"):
        Engine(tiny, attention="sparse")
    with pytest.raises(ValueError, match="budget_tokens=100"):
        Engine(tiny, max_context=64, budget_tokens=100)


# ---------------------------------------------------------------- sampling

def _draws(logits, n, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    """n draws from one row of logits at positions 0..n-1 (a fresh key each)."""
    b = n
    f = jax.jit(sample)
    return np.asarray(f(jnp.tile(jnp.asarray(logits, jnp.float32)[None], (b, 1)),
                        jnp.arange(b), jnp.full(b, temperature), jnp.full(b, top_k, jnp.int32),
                        jnp.full(b, top_p), jnp.full(b, seed, jnp.uint32)))


def test_sampling():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    assert set(_draws(logits, 200, temperature=0.0)) == {0}  # greedy
    assert set(_draws(logits, 200, top_k=1)) == {0}
    assert set(_draws(logits, 400, top_k=2)) == {0, 1}
    assert set(_draws(logits, 400, top_p=0.5)) == {0, 1}  # 0.4 + 0.3 covers 0.5
    assert set(_draws(logits, 200, top_p=0.3)) == {0}
    d = _draws(logits, 4000)
    freq = np.bincount(d, minlength=4) / len(d)
    np.testing.assert_allclose(freq, [0.4, 0.3, 0.2, 0.1], atol=0.03)
    hot = np.bincount(_draws(logits, 4000, temperature=0.5), minlength=4) / 4000
    want = np.array([0.4, 0.3, 0.2, 0.1]) ** 2
    np.testing.assert_allclose(hot, want / want.sum(), atol=0.03)
    np.testing.assert_array_equal(_draws(logits, 50, seed=3), _draws(logits, 50, seed=3))
    mixed = sample(jnp.tile(jnp.asarray(logits, jnp.float32)[None], (64, 1)), jnp.arange(64),
                   jnp.tile(jnp.array([0.0, 1.0]), 32), jnp.zeros(64, jnp.int32),
                   jnp.ones(64), jnp.zeros(64, jnp.uint32))
    assert set(np.asarray(mixed)[::2]) == {0} and len(set(np.asarray(mixed)[1::2])) > 1
    assert not np.array_equal(_draws(logits, 50, seed=3), _draws(logits, 50, seed=4))
    with pytest.raises(ValueError, match="top_p=0"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingParams(temperature=-1)


def _adjusted(logits, counts, presence=0.0, frequency=0.0, bias=None, temperature=0.0, n=1):
    """sample_slots on n copies of one row: logits and counts [V], bias {id: b}."""
    v = len(logits)
    row = np.zeros(v, np.float32)
    for i, b in (bias or {}).items():
        row[i] = b
    tile = lambda x: jnp.tile(jnp.asarray(x, jnp.float32)[None], (n, 1))
    s = SlotSampling(jnp.full(n, temperature), jnp.zeros(n, jnp.int32), jnp.ones(n),
                     jnp.zeros(n, jnp.uint32), jnp.full(n, presence), jnp.full(n, frequency),
                     tile(row), tile(counts))
    return np.asarray(jax.jit(sample_slots)(tile(logits), jnp.arange(n), s))


@pytest.mark.parametrize("counts, kw, want", [
    ([0, 0, 0, 0], {}, 0),
    ([0, 0, 0, 0], {"bias": {3: 3.0}}, 3),                 # 0 + 3 > 2
    ([0, 0, 0, 0], {"bias": {0: -100.0}}, 1),              # banned
    ([1, 0, 0, 0], {"presence": 1.5}, 1),                  # 2 - 1.5 < 1
    ([5, 0, 0, 0], {"presence": 0.9}, 0),                  # once, however often: 1.1 > 1
    ([3, 0, 0, 0], {"frequency": 0.4}, 1),                 # 2 - 1.2 < 1
    ([3, 0, 0, 0], {"frequency": 0.3}, 0),                 # 2 - 0.9 > 1
    ([1, 2, 0, 0], {"presence": 0.5, "frequency": 0.3}, 0),  # 2 - 0.8 = 1.2 > 1 - 1.1
    ([0, 0, 1, 0], {"presence": -2.0}, 2),                 # a negative penalty favours: 2.5
    ([0, 0, 1, 0], {"presence": -1.0}, 0),                 # 1.5 < 2
    ([0, 0, 0, 7], {"frequency": -0.3, "bias": {0: -0.2}}, 3),  # 2.1 > 1.8
])
def test_logit_bias_and_penalties(counts, kw, want):
    """OpenAI's formula, greedy: logit + bias - presence [count > 0] - frequency count."""
    logits = [2.0, 1.0, 0.5, 0.0]
    assert _adjusted(logits, counts, **kw)[0] == want


def test_logit_bias_rules_sampled_draws_and_params_validate():
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    assert set(_adjusted(logits, [0] * 4, bias={2: 100.0}, temperature=1.0, n=200)) == {2}
    assert 0 not in set(_adjusted(logits, [0] * 4, bias={0: -100.0}, temperature=1.0, n=400))
    assert SamplingParams(logit_bias={7: 1, 3: -2.5}).logit_bias == ((3, -2.5), (7, 1.0))
    assert SamplingParams(logit_bias={7: 1}) == SamplingParams(logit_bias=((7, 1.0),))
    for kw, match in (({"presence_penalty": 2.5}, "presence_penalty=2.5"),
                      ({"frequency_penalty": float("nan")}, "frequency_penalty=nan"),
                      ({"logit_bias": {1: 101}}, "logit_bias"),
                      ({"logit_bias": {-1: 1}}, "logit_bias"),
                      ({"logit_bias": {"5": 1}}, "logit_bias")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kw)


def test_penalties_count_each_slots_generated_tokens():
    """Each greedy token of a penalized slot is the argmax of its step's raw logits
    after its logit bias and its penalties over the tokens it has generated (the
    first, from the prefill, included); the neighbour slot decodes as alone; the
    slot's next sequence starts with no bias or counts left; a logit bias past the
    vocabulary fails before the slot changes."""
    tiny = _model(tiny_config(tie_embeddings=False))[0]  # tied, it repeats its input by ~100
    v, prompt = tiny.cfg.vocab_size, [5, 9, 9, 3, 7]
    plain = Engine(tiny, max_seqs=1, max_context=64, attention="dense")
    natural = [plain.prefill(0, prompt)] + [int(plain.decode_step()[0]) for _ in range(12)]
    # ban the first token it would choose, favour 17; a token generated once gains 0.8,
    # twice 0.4, then loses 0.4 per time more
    bias = np.zeros(v, np.float32)
    bias[[natural[0], 17]] = [-100, 2.5]
    p = SamplingParams(presence_penalty=-1.2, frequency_penalty=0.4,
                       logit_bias={natural[0]: -100, 17: 2.5})
    e = Engine(tiny, max_seqs=2, max_context=64, attention="dense")
    got = [e.prefill(0, prompt, p)]
    assert got[0] == int(np.argmax(np.asarray(e.logits) + bias)) != natural[0]
    e.prefill(1, [8, 8, 1], GREEDY)
    neighbour = []
    for _ in range(12):
        counts = np.bincount(got, minlength=v).astype(np.float32)  # the input's included
        toks = e.decode_step()
        raw = np.asarray(e.logits[0])  # the step's raw logits (what logprobs report)
        assert toks[0] == int(np.argmax(raw + bias + 1.2 * (counts > 0) - 0.4 * counts))
        got.append(int(toks[0]))
        neighbour.append(int(toks[1]))
    np.testing.assert_array_equal(np.asarray(e.counts[0]), np.bincount(got[:-1], minlength=v))
    assert 17 in got and max(np.bincount(got)) > 1  # the bias and the reward of repeats acted
    e.release(1)
    e.prefill(1, [8, 8, 1], GREEDY)
    alone = [int(e.decode_step(np.array([False, True]))[1]) for _ in range(12)]
    assert neighbour == alone
    for again in (GREEDY, p):  # the slot's next sequence: no bias left, no counts left
        e.release(0)
        e.prefill(0, prompt, again)
        fresh = Engine(tiny, max_seqs=2, max_context=64, attention="dense")
        fresh.prefill(0, prompt, again)
        for _ in range(6):
            assert e.decode_step(np.array([True, False]))[0] == \
                fresh.decode_step(np.array([True, False]))[0]
    lens = e.lens.copy()
    with pytest.raises(ValueError, match=f"token id {v} is not in the vocabulary"):
        e.prefill(0, prompt, SamplingParams(logit_bias={v: 1.0}))
    np.testing.assert_array_equal(e.lens, lens)


def test_sampling_is_per_slot(tiny):
    """A slot's draws depend on its seed and positions only, not on its neighbours."""
    e = Engine(tiny, max_seqs=2, max_context=64, attention="dense")
    p = SamplingParams(temperature=1.0, seed=11)
    e.prefill(0, [4, 5, 6], p)
    e.prefill(1, [9, 9, 9, 9], SamplingParams(temperature=0.7, top_k=5, seed=2))
    both = [e.decode_step()[0] for _ in range(5)]
    e.release(0)
    e.release(1)
    e.prefill(0, [4, 5, 6], p)
    alone = [e.decode_step(np.array([True, False]))[0] for _ in range(5)]
    assert both == alone
