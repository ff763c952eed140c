"""Layer-stacked states (what a model keeps): `append_layer` and `prefill_layer`
update one layer in place and equal `append_token` and `release` + `prefill` on
that layer's own state, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.cache import state as st
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.models import engine as eng
from hisparse_jax.models import kv
from hisparse_jax.models.llama import Llama, LlamaConfig, random_weights

LAYERS = 3


def _bytes(a):
    return np.atleast_1d(np.asarray(a)).view(np.uint8)  # NaN == NaN, fp8 comparable


def _filled(cfg, lengths_per_layer, seed):
    """A stack of LAYERS states, each prefilled with its own K/V and lengths."""
    rng = np.random.default_rng(seed)
    layers = []
    for lengths in lengths_per_layer:
        s = st.init_state(cfg)
        for seq, n in enumerate(lengths):
            if n:
                t = -(-n // cfg.page_size) * cfg.page_size
                k, v = (jnp.asarray(rng.normal(size=(t, cfg.num_kv_heads, cfg.head_dim)),
                                    jnp.float32) for _ in range(2))
                s = st.prefill(cfg, s, jnp.int32(seq), k, v, jnp.int32(n))
        layers.append(s)
    return layers


def _check_layer(cfg, stacked, before, layer, want):
    """Layer `layer` of `stacked` is `want` (every field, bytes); the others are as
    in `before`."""
    got = st.layer_view(cfg, stacked, layer)
    for name, a, b in zip(st.CacheState.__dataclass_fields__, jax.tree.leaves(got),
                          jax.tree.leaves(want)):
        np.testing.assert_array_equal(_bytes(a), _bytes(b), err_msg=name)
    for other in set(range(LAYERS)) - {layer}:
        for a, b in zip(jax.tree.leaves(st.layer_view(cfg, stacked, other)),
                        jax.tree.leaves(st.layer_view(cfg, before, other))):
            assert np.array_equal(_bytes(a), _bytes(b))


@pytest.mark.parametrize("page,warm", [(16, 384), (16, 0), (32, 64)])
def test_append_layer_equals_append_token_and_leaves_other_layers(page, warm):
    cfg = HiSparseConfig(num_kv_heads=2, gqa_group=2, head_dim=64, max_context=2048,
                         max_seqs=3, page_size=page, warm_tokens=warm)
    # Lengths just before page boundaries, so that pages move hot -> warm -> cold
    # during the appends; sequence 2 of layer 0 is empty (inactive below).
    lengths = [(page * 40 - 2, page * 9 - 1, 0), (page * 30 - 1, 700, 1),
               (5, page * 50 - 3, page * 12)]
    layers = _filled(cfg, lengths, seed=page + warm)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *map(st.stored, layers))
    rng = np.random.default_rng(7)
    for step in range(2 * page + 3):
        layer = step % LAYERS
        active = np.asarray([True, step % 3 != 0, layer != 0])
        k = rng.normal(size=(3, cfg.num_kv_heads, cfg.head_dim)).astype(np.float32)
        v = rng.normal(size=k.shape).astype(np.float32)
        k[~active] = np.nan  # inactive rows are never read
        before = stacked
        stacked, ids, _ = st.append_layer(cfg, stacked, jnp.int32(layer), jnp.asarray(k),
                                          jnp.asarray(v), jnp.asarray(active))
        want, want_ids, _ = st.append_token_offload(cfg, layers[layer], jnp.asarray(k),
                                                    jnp.asarray(v), jnp.asarray(active))
        layers[layer] = want
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
        _check_layer(cfg, stacked, before, layer, want)
    assert int(np.sum(np.asarray(stacked.seq_lens))) > sum(map(sum, lengths))


@pytest.mark.parametrize("page,warm", [(16, 384), (16, 0), (32, 64)])
def test_prefill_layer_equals_release_and_prefill_and_leaves_other_layers(page, warm):
    """`prefill_layer` (the engine's fill, and `state.prefill`'s, written in place)
    against `prefill_plain` (release, and the same values written plainly into the
    layer's own state): every field bit for bit, the same new pool pages and codes, the other
    layers untouched. Slots that held a longer or a shorter sequence, an empty
    slot, prompts of odd lengths with NaN padding, and a prompt that shares
    another sequence's cold pages."""
    cfg = HiSparseConfig(num_kv_heads=2, gqa_group=2, head_dim=64, max_context=2048,
                         max_seqs=3, page_size=page, warm_tokens=warm)
    lengths = [(page * 40 - 2, page * 9 - 1, 0), (page * 30 - 1, 700, 1),
               (5, page * 50 - 3, page * 12)]
    layers = _filled(cfg, lengths, seed=page + warm + 1)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *map(st.stored, layers))
    rng = np.random.default_rng(11)
    cases = [(0, 1, page * 20 + 3, False), (1, 2, 1, False), (2, 0, page * 45 + 7, True),
             (0, 2, page * 3 - 1, False), (1, 0, page * 28, True)]
    for layer, seq, n, share in cases:
        t = -(-n // page) * page + page  # a padding page past the prompt
        k, v = (rng.normal(size=(t, cfg.num_kv_heads, cfg.head_dim)).astype(np.float32)
                for _ in range(2))
        k[n:], v[n:] = np.nan, np.inf  # padding is never read
        shared = np.full(t // page, -1, np.int32)
        if share:  # the first cold pages of the sequence in the next slot
            other = np.asarray(layers[layer].page_table[(seq + 1) % 3])
            m = min(4, int(np.sum(other >= 0)))
            shared[cfg.sink_pages:cfg.sink_pages + m] = other[cfg.sink_pages:][:m]
            assert m > 0
        args = (jnp.int32(seq), jnp.asarray(k), jnp.asarray(v), jnp.int32(n),
                jnp.asarray(shared))
        before = stacked
        stacked, ids, codes = jax.jit(st.prefill_layer, static_argnums=0)(
            cfg, stacked, jnp.int32(layer), *args)
        want, want_ids, want_codes = jax.jit(st.prefill_plain, static_argnums=0)(
            cfg, layers[layer], *args)
        layers[layer] = want
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
        for f in codes:
            np.testing.assert_array_equal(_bytes(codes[f]), _bytes(want_codes[f]), err_msg=f)
        _check_layer(cfg, stacked, before, layer, want)


@pytest.mark.parametrize("page", [16, 32])
def test_release_layer_equals_release_and_leaves_other_layers(page):
    """`release_layer` (the vLLM bridge's, in place) against `release` on the
    layer's own state: every field bit for bit (a slot released twice, an empty
    one), the other layers untouched."""
    cfg = HiSparseConfig(num_kv_heads=2, gqa_group=2, head_dim=64, max_context=2048,
                         max_seqs=3, page_size=page)
    layers = _filled(cfg, [(page * 40 - 2, page * 9 - 1, 0), (page * 30 - 1, 700, 5),
                           (0, 3, page * 20)][:LAYERS], seed=page)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *map(st.stored, layers))
    for layer, seq in ((0, 0), (1, 1), (1, 2), (0, 0)):
        before = stacked
        stacked = jax.jit(st.release_layer, static_argnums=0)(
            cfg, stacked, jnp.int32(layer), jnp.int32(seq))
        layers[layer] = st.release(cfg, layers[layer], jnp.int32(seq))
        _check_layer(cfg, stacked, before, layer, layers[layer])


def test_layer_loop_appends_in_place():
    """A 4-layer loop of appends needs no temporary the size of a layer's pool:
    nothing is copied (a per-layer slice written back whole copies every layer)."""
    cfg = HiSparseConfig(num_kv_heads=2, gqa_group=2, head_dim=64, max_context=4096,
                         max_seqs=2)
    stacked = st.init_stacked(cfg, 4)
    kv, active = jnp.ones((2, 2, 64), jnp.float32), jnp.ones(2, bool)

    def temp_bytes(in_place):
        def loop(s):
            def body(c, layer):
                if in_place:
                    return st.append_layer(cfg, c, layer, kv, kv, active)[0], None
                one = st.append_token(cfg, st.layer_view(cfg, c, layer), kv, kv, active)
                return st.set_layer(c, layer, one), None
            return jax.lax.scan(body, s, jnp.arange(4))[0]
        compiled = jax.jit(loop, donate_argnums=0).lower(stacked).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    pool = stacked.int4_k[0].nbytes
    assert temp_bytes(in_place=False) > pool  # the check can see a copy
    assert temp_bytes(in_place=True) < pool / 4


def test_engine_decode_step_updates_caches_in_place():
    """The whole decode step (30 layers in a scan) keeps its temporaries below half
    a layer's cache: the caches are updated where they lie. (The step's own
    temporaries hardly grow with the context: 4.07 MB at 16K and 32K with the
    model preset's 2x candidates, 2.84 / 3.13 MB at 1.25x; a layer is 11.2 MB
    at 32K.)"""
    mc = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=64, max_position=32768)
    engine = eng.Engine(Llama(mc, random_weights(mc)), max_seqs=2, max_context=32768,
                        budget_tokens=1024)
    compiled = kv.decode.lower(
        engine.params, engine.caches, jnp.asarray(engine.tokens), jnp.asarray(engine.lens),
        jnp.ones(2, bool), engine._samp(), **engine._static(), n=2).compile()
    layer_bytes = sum(a.nbytes for a in jax.tree.leaves(engine.caches)) / mc.num_layers
    assert compiled.memory_analysis().temp_size_in_bytes < layer_bytes / 2


def test_engine_refuses_what_the_pool_cannot_hold():
    """A pool smaller than the slots' contexts: the engine refuses the prefill or
    the decode step that would need a page nobody freed (CacheFullError, nothing
    written) instead of handing out a page another sequence holds."""
    from hisparse_jax.cache.handle import CacheFullError
    mc = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=64, max_position=2048)
    engine = eng.Engine(Llama(mc, random_weights(mc)), max_seqs=2, max_context=2048,
                        budget_tokens=256, cache_overrides={"num_pool_pages": 8})
    c = engine.cache_cfg
    n = (c.sink_pages + c.hot_pages + c.warm_pages + 8) * c.page_size  # 8 cold pages, full
    ids = np.arange(n) % 200
    engine.prefill(0, ids)
    with pytest.raises(CacheFullError, match="8 pages"):
        engine.prefill(1, (ids + 1) % 200)  # another prompt: 8 pages of its own
    assert engine.lens[1] == 0
    with pytest.raises(CacheFullError):  # the next token opens a page: a 9th goes cold
        engine.decode_step()
    assert engine.lens[0] == n
    engine.prefill(1, ids)  # the same prompt shares slot 0's cold pages: no new page
    assert engine.num_free == 0 and engine.pool_usage()[0] == 8 * mc.num_layers
    engine.release(0)
    engine.release(1)
    engine.prefill(1, ids[:200] + 3)
    assert engine.decode_step()[1] >= 0
