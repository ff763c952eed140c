"""Engine: a model, one KV cache per layer for `max_seqs` slots, and the two jitted
programs that run it: `prefill` (one slot's prompt) and `decode_step` (one token
for every active slot).

attention="hisparse": one `CacheState` per layer, stacked on a leading layer
axis (`state.init_stacked`). Prefill attention is exact (on the CPU kernel where
it runs, `cpu_kernels/causal_attention.cc`: AMX tiles or AVX-512, else XLA's
`causal_prefill_attention`: `config.resolve_prefill`) and fills the cache
(`state.prefill`); decode
appends the new token in place (`state.append_layer`) and attends sparsely
(`attention.decode_step`).
attention="dense": the same model with exact attention over a plain bf16 KV
cache of the same tokens (the baseline).

A decode step is one jitted program for all layers and slots (a `lax.scan` over
the layers, no host sync inside); the caches are donated and carried through the
scan, and each layer writes only what changes at its layer index, so XLA updates
them in place. The only host sync is reading the sampled tokens back. Its weight
products read each layer's weights in place on AMX tiles where the CPU has them
(`cpu_kernels/matmul.cc`, `config.resolve_products`).

Prefix sharing (HiSparse): every prompt's full cold pages go into one
`PrefixIndex` for all layers (an entry's pages are one global id per layer,
layer * pool_pages + page). A later prompt that starts with the same tokens
references those pool pages instead of storing its own (a prefill given the ids:
`prefill`, `prefill_chunk`, `prefill_kv(..., ids=)`), so N sequences over one
document hold its cold pages once. `pin` keeps a prompt's pages after its
sequence ends (a prewarmed document); unpinned pages nobody uses stay indexed
and are evicted, oldest first, when the pool runs short (`pool_available`
counts them as free).

Offload mode (`offload=True`, HiSparse): the stacked state holds no cold codes;
every layer's live in host memory (`offload.LayerColdStores`). Prefill writes a
prompt's new cold pages there; a decode step is one program (`_decode_offloaded`)
in which each layer copies its missing pages from the host between its selection
and its attention. The same bytes are attended, so the tokens equal the
all-resident engine's.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cpu_kernels import ops as cpu_ops
from hisparse_jax import attention as att
from hisparse_jax.cache import layout
from hisparse_jax.cache import state as st
from hisparse_jax.cache.handle import CacheFullError
from hisparse_jax.cache.prefix import PrefixIndex
from hisparse_jax.config import (
    HiSparseConfig,
    model_preset,
    resolve_implementation,
    resolve_prefill,
    resolve_products,
)
from hisparse_jax.models.llama import Llama
from hisparse_jax.models.sampling import (
    GREEDY,
    SamplingParams,
    SlotSampling,
    bias_row,
    sample_slots,
    slot_params,
)
from hisparse_jax.offload import policy as scheduler
from hisparse_jax.offload import store as off
from hisparse_jax.offload.store import attend_planned, plan_copies
from hisparse_jax.validate import check_bool_mask, check_int, check_token_ids, check_working_set

ATTENTIONS = ("hisparse", "dense")
PREFILL_CHUNK = 512  # causal_prefill_attention's query/key block


def prefill_length(n: int) -> int:
    """Padded prompt length: 64, 128, 256, 512, then whole chunks, so a handful of
    programs serve every prompt length (each costs a 10-20 s compile here)."""
    if n <= PREFILL_CHUNK:
        return max(64, 1 << (n - 1).bit_length())
    return -(-n // PREFILL_CHUNK) * PREFILL_CHUNK


def fill_length(n: int, max_context: int) -> int:
    """Padded length of the K/V an n-token prompt fills the HiSparse cache from:
    `prefill_length` up to a block, then powers of two up to the staging buffer's
    length (max_context in whole blocks). A fill program (seconds to compile) per
    length: a few for any context, where whole blocks made one per block count,
    for at most twice the fill's work (the padding is encoded, then dropped)."""
    if n <= PREFILL_CHUNK:
        return prefill_length(n)
    return min(1 << (n - 1).bit_length(), prefill_length(max_context))


# ---------------------------------------------------------------- jitted programs

def dense_attention(q, k, v, lengths):
    """Exact decode attention over a bf16 cache, in float32 (the library's
    `dense_decode_attention` rounds q and the probabilities to the cache's dtype,
    which moved SmolLM2's logits by up to 0.3 against float32 attention).
    q [B, Hq, D]; k, v [B, Hkv, S, D]; lengths [B] -> [B, Hq, D] float32."""
    b, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d).astype(jnp.float32)
    logits = jnp.einsum("bhgd,bhsd->bhgs", qg, k.astype(jnp.float32)) / np.sqrt(d)
    valid = (jnp.arange(s)[None, :] < lengths[:, None])[:, None, None, :]
    p = jax.nn.softmax(jnp.where(valid, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhgs,bhsd->bhgd", p, v.astype(jnp.float32)).reshape(b, hq, d)


def dense_decode_layer(caches, layer, q, k, v, lens, active):
    """`attention.decode_layer` for the dense cache ([L, B, Hkv, S, D] pair): write
    each active slot's k, v at its length, in place, and attend exactly."""
    kc, vc = caches
    n = q.shape[0]  # slots 0..n-1
    at = (layer, jnp.arange(n), slice(None),  # indexed as [n, Hkv, D]
          jnp.where(active, lens, kc.shape[3]))        # inactive slots: dropped
    kc = kc.at[at].set(k.astype(kc.dtype), mode="drop")
    vc = vc.at[at].set(v.astype(vc.dtype), mode="drop")
    return dense_attention(q, kc[layer, :n], vc[layer, :n], lens + active), (kc, vc)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _release(cfg: HiSparseConfig, caches, slot):
    return jax.vmap(lambda s: st.stored(st.release(cfg, st.live(cfg, s), slot)))(caches)


@functools.partial(jax.jit, static_argnums=(0, 3), donate_argnums=1)
def _page_refs(cfg: HiSparseConfig, caches, pages, retain: bool):
    """Take (retain) or drop one prefix-index reference on each pool page of
    pages [L, n] (-1 = skip), layer by layer."""
    f = st.retain_pages if retain else st.drop_pages
    return jax.vmap(lambda s, p: st.stored(f(cfg, st.live(cfg, s), p)))(caches, pages)


def _exact_attention(q, k, v, start, chunk: int, prefill: str, layer=None):
    """Exact causal attention of queries q [C, Hq, D] at positions start..start+C
    over k, v [S, Hkv, D] (bf16), or k[layer], v[layer] of a stack [L, S, Hkv, D]
    read where it lies (a chunked prefill's staged K/V; slicing a layer out copies
    all of it every block) -> [C, Hq, D] float32, on the CPU kernel (prefill
    "cpu", `config.resolve_prefill`: AMX tiles or AVX-512) or in XLA (`attention.causal_query_block`, key
    blocks of `chunk`, start a multiple of it, C at most `chunk`). Each query's
    output is the same whatever block it is computed in, so a prompt prefilled
    block by block gets the numbers of one program."""
    if prefill == "cpu":
        return cpu_ops.causal_attention(q, k, v, start, layer=layer)
    if isinstance(start, int):  # a whole prompt (from 0): its own K/V, never a stack
        return att.causal_prefill_attention(q, k, v, chunk=chunk)
    if layer is None:
        k, v, layer = k[None], v[None], 0
    kv = lambda j: tuple(jax.lax.dynamic_slice(s, (layer, j * chunk, 0, 0), (1, chunk, *s.shape[2:]))[0]
                         .astype(jnp.float32).transpose(1, 0, 2) for s in (k, v))
    # A prompt's last block may be shorter: its queries are padded back to a whole
    # block here, because XLA's products of fewer rows sum differently (4e-8), which
    # flips bf16 roundings of later layers' K/V (SmolLM2's logits then move by 0.17)
    c = q.shape[0]
    q = jnp.pad(q, ((0, chunk - c), (0, 0), (0, 0)))
    out = att.causal_query_block(att.query_rows(q, k.shape[2]), kv, start // chunk, chunk)
    return att.query_rows_back(out, chunk)[:c]


@functools.partial(jax.jit, static_argnames=("graphdef", "hcfg", "implementation", "products",
                                             "offload", "prefill"),
                   donate_argnames="caches")
def _prefill(params, caches, slot, ids, length, shared, samp, *, graphdef, hcfg,
             implementation, products, offload=False, prefill="xla"):
    """One slot's prompt ids [Tp] (the first `length` real, the rest padding) ->
    (first generated token [], its logits [V], caches). shared [L, Tp / page]:
    pool pages the prompt references instead of storing (-1: none). offload: the
    caches hold no cold codes (`_offloaded`); also returns the new cold pages,
    (pool ids [L, Tp / page], codes {OFFLOAD_FIELDS: [L, Tp / page, Hkv, ...]}), for
    the host pool."""
    model = nnx.merge(graphdef, params)
    t = ids.shape[0]
    chunk = min(t, PREFILL_CHUNK)
    if offload:
        caches = (caches, _new_cold_buffer(hcfg, caches.page_table.shape[0], t))

    def attend(caches, layer, q, k, v):
        # Exact attention over the K/V as the cache stores them (bf16), so that a
        # decode step gives what a prefill one token longer would (a bf16 rounding
        # of K/V alone moves SmolLM2's logits by up to 0.3).
        k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
        out = _exact_attention(q, k, v, 0, chunk, prefill)
        if hcfg is None:  # dense: [L, B, Hkv, S, D] pair; write the first min(T, S) tokens
            n = min(t, caches[0].shape[3])
            put = lambda c, x: jax.lax.dynamic_update_slice(
                c, x[:n].transpose(1, 0, 2)[None, None].astype(c.dtype), (layer, slot, 0, 0, 0))
            return out, (put(caches[0], k), put(caches[1], v))
        if not offload:
            return out, st.prefill_layer(hcfg, caches, layer, slot, k, v, length, shared[layer],
                                         implementation=implementation)[0]
        caches, (pool_ids, codes) = caches
        caches, ids_l, codes_l = st.prefill_layer(hcfg, caches, layer, slot, k, v, length,
                                                  shared[layer], implementation=implementation)
        new = (pool_ids.at[layer].set(ids_l),
               {f: codes[f].at[layer].set(codes_l[f]) for f in codes})
        return out, (caches, new)

    x, caches = model.layers(model.embed_tokens(ids), jnp.arange(t), caches, attend,
                             products=products)
    logits = model.logits(x[length - 1][None], products=products)
    tok = sample_slots(logits, length[None], samp)
    if offload:
        return tok[0], logits[0], caches[0], *caches[1]
    return tok[0], logits[0], caches


@functools.partial(jax.jit, static_argnames=("graphdef", "hcfg", "implementation", "products",
                                             "prefill"),
                   donate_argnames="caches")
def _prefill_batch(params, caches, slots, ids, lengths, shared, samp, *, graphdef, hcfg,
                   implementation, products, prefill="xla"):
    """Several slots' prompts of one padded length at once: ids [B, Tp] (row i's first
    lengths[i] real), slots [B], shared [B, L, Tp / page] as `_prefill`'s ->
    (first generated tokens [B], their logits [B, V], caches). The weight products
    take all B * Tp rows together; each prompt's attention and cache fill are its
    own (a loop over the rows), so every row gets `_prefill`'s numbers alone."""
    model = nnx.merge(graphdef, params)
    b, t = ids.shape

    def attend(caches, layer, q, k, v):
        q, k, v = (x.reshape(b, t, *x.shape[1:]) for x in (q, k.astype(jnp.bfloat16),
                                                           v.astype(jnp.bfloat16)))

        def one(i, carry):
            out, caches = carry
            out = out.at[i].set(_exact_attention(q[i], k[i], v[i], 0, t, prefill))
            if hcfg is None:  # dense: as `_prefill`'s
                n = min(t, caches[0].shape[3])
                put = lambda c, x: jax.lax.dynamic_update_slice(
                    c, x[:n].transpose(1, 0, 2)[None, None].astype(c.dtype),
                    (layer, slots[i], 0, 0, 0))
                return out, (put(caches[0], k[i]), put(caches[1], v[i]))
            return out, st.prefill_layer(hcfg, caches, layer, slots[i], k[i], v[i], lengths[i],
                                         shared[i, layer], implementation=implementation)[0]

        out, caches = jax.lax.fori_loop(0, b, one, (jnp.zeros(q.shape, jnp.float32), caches))
        return out.reshape(b * t, *out.shape[2:]), caches

    x, caches = model.layers(model.embed_tokens(ids.reshape(-1)), jnp.tile(jnp.arange(t), b),
                             caches, attend, products=products)
    last = x.reshape(b, t, -1)[jnp.arange(b), lengths - 1]
    logits = model.logits(last, products=products)
    return sample_slots(logits, lengths, samp), logits, caches


def _new_cold_buffer(hcfg: HiSparseConfig, layers: int, t: int):
    """A prefill's new cold pages of every layer: (pool ids [L, t / page] (none yet),
    codes {OFFLOAD_FIELDS: [L, t / page, Hkv, ...]})."""
    shapes = jax.eval_shape(lambda: st.init_state(hcfg))
    npg = t // hcfg.page_size
    codes = {f: jnp.zeros((layers, npg, hcfg.num_kv_heads, *getattr(shapes, f).shape[2:]),
                          getattr(shapes, f).dtype) for f in st.OFFLOAD_FIELDS}
    return jnp.full((layers, npg), hcfg.pool_pages, jnp.int32), codes


@functools.partial(jax.jit, static_argnums=(0, 1))
def _offloaded(hcfg: HiSparseConfig, layers: int):
    """`state.init_stacked` without the cold codes (their pool axis empty): offload
    mode keeps them in host memory (`offload.LayerColdStores`)."""
    caches = st.init_stacked(hcfg, layers)
    return caches.replace(**{f: jnp.zeros(x.shape[:2] + (0,) + x.shape[3:], x.dtype)
                             for f in st.OFFLOAD_FIELDS for x in [getattr(caches, f)]})


@functools.partial(jax.jit, static_argnums=(0, 7), donate_argnums=1)
def _prefill_kv(hcfg: HiSparseConfig, caches, slot, k, v, length, shared, offload=False):
    """Fill `slot` of every layer's cache from K/V [L, T, Hkv, D] (bf16), shared
    [L, T / page] as `_prefill`'s (offload: also returns the new cold pages, as
    `_prefill`'s). A loop over the layers, each written in place
    (`state.prefill_layer`)."""
    def one(caches, xs):
        layer, k, v, shared = xs
        caches, pool_ids, codes = st.prefill_layer(hcfg, caches, layer, slot, k, v, length,
                                                   shared)
        return caches, (pool_ids, codes)
    layers = jnp.arange(k.shape[0], dtype=jnp.int32)
    caches, (pool_ids, codes) = jax.lax.scan(one, caches, (layers, k, v, shared))
    return (caches, pool_ids, codes) if offload else caches


@functools.partial(jax.jit, static_argnames=("graphdef", "products", "prefill"),
                   donate_argnames="stage")
def _prefill_chunk(params, stage, ids, start, last, samp, *, graphdef, products, prefill="xla"):
    """One block of a prompt: ids [C] at positions start..start+C (C: PREFILL_CHUNK,
    or `block_length` of a last block) -> (the token sampled after row `last` [],
    its logits [V], stage). stage: (K, V) [L, S, Hkv, D] bf16, the prompt's K/V so
    far; this block's are written into it."""
    model = nnx.merge(graphdef, params)
    c = ids.shape[0]

    def attend(stage, layer, q, k, v):
        ks, vs = (jax.lax.dynamic_update_slice(s, x.astype(jnp.bfloat16)[None], (layer, start, 0, 0))
                  for s, x in zip(stage, (k, v)))
        return _exact_attention(q, ks, vs, start, PREFILL_CHUNK, prefill, layer), (ks, vs)

    x, stage = model.layers(model.embed_tokens(ids), start + jnp.arange(c), stage, attend,
                            products=products)
    logits = model.logits(x[last][None], products=products)
    tok = sample_slots(logits, (start + last + 1)[None], samp)
    return tok[0], logits[0], stage


@jax.jit
def _slot_pages(page_table, poisoned, slot):
    """`slot`'s page table [L, max_pages] and whether a layer poisoned it: one program
    for every slot and prompt length (indexing with Python ints compiles one each)."""
    return page_table[:, slot], jnp.any(poisoned[:, slot])


@functools.partial(jax.jit, donate_argnums=0)
def _write_stage(stage, k, v):
    """K/V [L, n, Hkv, D] into the staging buffer's first n positions."""
    return tuple(jax.lax.dynamic_update_slice_in_dim(s, x.astype(s.dtype), 0, 1)
                 for s, x in zip(stage, (k, v)))


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _reset_slot(bias, counts, slot, row):
    """A new sequence in `slot`: its logit bias row [V], no token generated yet."""
    return bias.at[slot].set(row), counts.at[slot].set(0)


@functools.partial(jax.jit, donate_argnums=0)
def _count_tokens(counts, slots, tokens, weights):
    """counts [S, V] += weights at (slots, tokens), each [k]."""
    return counts.at[slots, tokens].add(weights)


@functools.partial(jax.jit, donate_argnums=0)
def _stage_to_dense(caches, slot, k, v):
    """Copy staged K/V [L, S, Hkv, D] into a dense cache's `slot` ([L, B, Hkv, S', D])."""
    s = caches[0].shape[3]
    put = lambda c, x: jax.lax.dynamic_update_slice(
        c, x[:, :s].transpose(0, 2, 1, 3)[:, None], (0, slot, 0, 0, 0))
    return put(caches[0], k), put(caches[1], v)


@functools.partial(jax.jit, static_argnames=("graphdef", "hcfg", "implementation", "products",
                                             "n"),
                   donate_argnames="caches")
def _decode(params, caches, tokens, lens, active, samp, *, graphdef, hcfg, implementation,
            products, n):
    """tokens [B] at positions lens [B] (active [B] slots) -> (next tokens [B],
    logits [B, V], caches), computing slots 0..n-1 only (the rest must be
    inactive: their rows come back 0). A HiSparse step copies those slots' own
    fields out of the stacked caches and back (the pool stays in place, and on the
    "cpu" kernels the window's tiers too: `state.WINDOW_FIELDS`); a dense step
    reads n slots of each layer's cache."""
    model = nnx.merge(graphdef, params)
    b = tokens.shape[0]
    tokens, lens, active = tokens[:n], lens[:n], active[:n]
    samp = jax.tree.map(lambda a: a[:n], samp)
    full = caches
    if hcfg is not None:
        keep = st.WINDOW_FIELDS if resolve_implementation(implementation, hcfg) == "cpu" else ()
        hcfg, caches = st.first_slots(hcfg, caches, n, axis=1, keep=keep)

    def attend(caches, layer, q, k, v):
        if hcfg is None:
            return dense_decode_layer(caches, layer, q, k, v, lens, active)
        return att.decode_layer(hcfg, caches, layer, q, k, v, active,
                                implementation=implementation)

    x, caches = model.layers(model.embed_tokens(tokens), lens, caches, attend,
                             products=products)
    if hcfg is not None:
        caches = st.put_first_slots(full, caches, axis=1)
    logits = model.logits(x, products=products)
    nxt = sample_slots(logits, lens + 1, samp)
    pad = lambda a: jnp.zeros((b, *a.shape[1:]), a.dtype).at[:n].set(a)
    return pad(nxt), pad(logits), caches


@functools.partial(jax.jit, static_argnames=("graphdef", "hcfg", "implementation", "products",
                                             "width", "shardings"),
                   donate_argnames=("caches", "cold"))
def _decode_offloaded(params, caches, cold, tokens, lens, active, samp, *, graphdef, hcfg,
                      implementation, products, width, shardings):
    """Offload mode's decode step, one program: `_decode`'s, with each layer's cold
    pages read from its working set after the layer copied in what its selection
    needs (`offload.plan_copies`, `copy_pages`, `attend_planned`). cold:
    `offload.LayerColdStores`. The first `width` slots are selected and attended.
    The pages that become cold in the step go to the host pools after the layers
    (a layer that selects one in this step takes it from the device); one program
    whether or not there are any (a second per width doubled the engine's
    warm-up). -> (next tokens [B], logits [B, V], caches, cold)."""
    model = nnx.merge(graphdef, params)
    rope = model.rope()
    w = cold.working_set
    at = lambda tree, layer: jax.tree.map(lambda a: a[layer], tree)
    put = lambda tree, layer, new: jax.tree.map(lambda a, b: a.at[layer].set(b), tree, new)

    def layer_step(x, caches, parts, layer, below):
        ws, sample_ws, held, sched, copied = parts
        q, k, v = model.blocks.attention_inputs(x, lens, rope, layer, products)
        caches, pool_ids, codes = st.append_layer(hcfg, caches, layer, k, v, active,
                                                  implementation=implementation)
        view = st.layer_view(hcfg, caches, layer)
        sched_l, held_l, planned = plan_copies(hcfg, view, q, at(sched, layer), held[layer],
                                               below, width=width,
                                               implementation=implementation)
        ws, sample_ws, counts = off.copy_pages(shardings, cold.host, layer, ws, sample_ws,
                                               planned.copies, w, (pool_ids, codes))
        out, candidates, _, last = attend_planned(hcfg, view, q, at(ws, layer),
                                                  at(sample_ws, layer), sched_l, held_l,
                                                  planned, implementation=implementation)
        caches = caches.replace(last_selected=caches.last_selected.at[layer].set(last))
        x = model.blocks.finish(x, out, layer, products)
        parts = (ws, sample_ws, held.at[layer].set(held_l), put(sched, layer, sched_l),
                 copied + counts)
        return x, caches, parts, candidates, (pool_ids, codes)

    parts = (cold.ws, cold.sample_ws, cold.sample_held, cold.sched, cold.copied)
    # the first layer has no layer below to prefetch for it
    x, caches, parts, below, new0 = layer_step(model.embed_tokens(tokens), caches, parts,
                                                jnp.int32(0), None)

    def body(carry, layer):
        x, caches, parts, below = carry
        x, caches, parts, below, new = layer_step(x, caches, parts, layer, below)
        return (x, caches, parts, below), new

    layers = jnp.arange(1, model.cfg.num_layers, dtype=jnp.int32)
    (x, caches, parts, _), new = jax.lax.scan(body, (x, caches, parts, below), layers)
    pool_ids, codes = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), new0, new)
    host = off.store_pages(shardings[0], cold.host, pool_ids, codes)
    logits = model.logits(x, products=products)
    return (sample_slots(logits, lens + 1, samp), logits, caches,
            off.LayerColdStores(host, *parts))


# ---------------------------------------------------------------- the engine

def model_cache_config(mc, max_context: int, max_seqs: int, budget_tokens: int,
                       overrides: dict | None = None) -> HiSparseConfig:
    """The cache config a model's engine runs (and the server's planner sizes):
    `config.model_preset` for the model's shapes."""
    return model_preset(num_kv_heads=mc.num_kv_heads, gqa_group=mc.group,
                        head_dim=mc.head_dim, max_context=max_context, max_seqs=max_seqs,
                        budget_tokens=budget_tokens, **(overrides or {}))


class Engine:
    """Slots 0..max_seqs-1, each a sequence in the caches.

    `prefill(slot, ids, sampling)` fills a slot with a prompt and returns the first
    generated token; `decode_step(active)` appends every active slot's last token
    and returns the next ones. The host mirrors each slot's length (`lens`), so
    checks need no device round trip. `prefill_chunk` runs a prompt block by block;
    up to `max_stages` slots can be in such a prefill at once, each holding a bf16
    K/V stage of max_context tokens (made on first use, kept for reuse).
    """

    def __init__(self, model: Llama, *, max_seqs: int = 1, max_context: int | None = None,
                 attention: str = "hisparse", budget_tokens: int = 2048,
                 cache_overrides: dict | None = None, implementation=None,
                 offload: bool = False, working_set: int | None = None,
                 policy: scheduler.Policy | None = None, max_stages: int = 1):
        if attention not in ATTENTIONS:
            raise ValueError(f"attention={attention!r}: choose from {ATTENTIONS}")
        if not isinstance(offload, bool):
            raise ValueError(f"offload must be a bool, got {offload!r}")  # noqa: TRY004
        if (offload or working_set is not None) and attention != "hisparse":
            raise ValueError("offload mode (and its working_set) needs attention='hisparse'")
        if (working_set is not None or policy is not None) and not offload:
            raise ValueError("working_set and policy are offload mode's: pass offload=True")
        if policy is not None and not isinstance(policy, scheduler.Policy):
            raise ValueError(f"policy must be a scheduler.Policy, got {policy!r}")
        mc = model.cfg
        if max_context is None:
            max_context = mc.max_position
        max_context = check_int("max_context", max_context, minimum=1)
        max_seqs = check_int("max_seqs", max_seqs, minimum=1)
        self.max_stages = check_int("max_stages", max_stages, minimum=1, maximum=max_seqs)
        self.model = model
        self.attention = attention
        self.max_seqs, self.max_context = max_seqs, max_context
        self.implementation = implementation
        self.prefill_implementation = resolve_prefill(implementation, mc.head_dim)
        self.product_implementation = resolve_products(implementation)
        self.graphdef, self.params = nnx.split(model)
        layers = mc.num_layers
        if attention == "hisparse":
            self.cache_cfg = model_cache_config(mc, max_context, max_seqs, budget_tokens,
                                                cache_overrides)
            # committed to the device, as every later value is (one program per shape)
            self.caches = jax.device_put((_offloaded if offload else st.init_stacked)(
                self.cache_cfg, layers), jax.devices()[0])
            self.cold = None  # offload mode: every layer's cold pools (LayerColdStores)
            if offload:
                c = self.cache_cfg
                # as the capacity planner sizes it: 2x a step's candidates, never
                # more than a sequence's cold pages
                self.working_set = check_working_set(c.candidate_pages, min(
                    2 * c.candidate_pages, c._cold_pages) if working_set is None else working_set)
                device = next(iter(self.caches.seq_lens.devices()))
                self.shardings = off.shardings(device)
                self.cold = off.LayerColdStores.empty(self.cache_cfg, layers, device,
                                                      self.working_set, policy)
                # the device's int32 counters, moved here (int64) when read
                self.counted = np.zeros(len(scheduler.COUNTERS), np.int64)
                self.copied = np.zeros(3, np.int64)  # pages copied, rows moved, sampled
            self.prefix = PrefixIndex(self.cache_cfg.page_size)
            self.prefix.bind(self._drop_pages)
            self.evicted_pages = 0  # per layer
            self.num_free = self.cache_cfg.pool_pages  # per layer (every layer holds the same)
        else:
            if cache_overrides:
                raise ValueError("cache_overrides apply to attention='hisparse' only")
            self.cache_cfg, self.cold = None, None
            shape = (layers, max_seqs, mc.num_kv_heads, max_context, mc.head_dim)
            self.caches = (jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16))
            self.prefix, self.num_free = None, 0
        self._holds: dict[int, tuple[list, list]] = {}  # slot -> (hashes, pages) to share
        self._refs: dict[int, list] = {}  # slot -> prefix hashes its sequence references
        self.lens = np.zeros(max_seqs, np.int32)
        self.tokens = np.zeros(max_seqs, np.int32)  # each slot's last token (next input)
        self.sampling = [GREEDY] * max_seqs
        # each slot's logit bias and generated-token counts, on the device (the penalties)
        vocab = model.cfg.vocab_size
        self.bias = jnp.zeros((max_seqs, vocab), jnp.float32)
        self.counts = jnp.zeros((max_seqs, vocab), jnp.float32)
        self.logits = None  # the last program's logits (device array)
        # chunked prefills in progress (prefill_chunk): slot -> [its bf16 K/V stage
        # (K, V) [L, S, Hkv, D], tokens staged so far], at most max_stages (oldest first)
        self._stages: dict[int, list] = {}
        self._spare: list = []    # stages no prefill holds (made on first use, reused)
        self._last = None         # the [stage, staged] a block last ran on (staged_kv)

    def _static(self):
        return {"graphdef": self.graphdef, "hcfg": self.cache_cfg,
                "implementation": self.implementation, "products": self.product_implementation}

    @property
    def offload(self) -> bool:
        return self.cold is not None

    def _store_cold(self, pool_ids, codes):
        """Offload mode: a prefill's new cold pages (pool ids [L, n], codes
        {field: [L, n, ...]}) into each layer's host pool."""
        self.cold = self.cold.store(pool_ids, codes)

    def _samp(self, slot: int | list[int] | None = None) -> SlotSampling:
        """The sampling arrays of every slot, of `slot` alone (a batch of one), or of
        a list of slots (in its order)."""
        if slot is None:
            return SlotSampling(*slot_params(self.sampling), self.bias, self.counts)
        slots = list(slot) if isinstance(slot, (list, tuple)) else [int(slot)]
        at = np.asarray(slots, np.int32)
        return SlotSampling(*slot_params([self.sampling[s] for s in slots]), self.bias[at],
                            self.counts[at])

    def _bias_row(self, sampling: SamplingParams) -> np.ndarray:
        """`sampling`'s logit bias as a [V] row; a caller makes it before it changes
        anything, so that a bad id (ValueError) leaves the engine as it was."""
        return bias_row(sampling, self.model.cfg.vocab_size)

    def _set_sampling(self, slot: int, sampling: SamplingParams, row: np.ndarray):
        """A new sequence's sampling in `slot`: its logit bias row, its counts emptied."""
        self.sampling[slot] = sampling
        self.bias, self.counts = _reset_slot(self.bias, self.counts, np.int32(slot), row)

    def _count(self, slots, tokens, weights):
        """The penalties' counts: each of `tokens` [k] generated once more in its slot."""
        self.counts = _count_tokens(self.counts, np.asarray(slots, np.int32), tokens,
                                    np.asarray(weights, np.float32))

    def _check_slot(self, slot) -> int:
        return check_int("slot", slot, minimum=0, maximum=self.max_seqs - 1)

    def _make_room(self, need: int):
        """CacheFullError unless `need` more cold pool pages (per layer) are free,
        after evicting unused, unpinned prefixes (oldest first). The pool's raw
        operations trust their caller: on an empty free stack they would hand out
        a page another sequence holds. Every layer holds the same tokens, so one
        count on the host decides."""
        if self.cache_cfg is None:
            return
        if need > self.num_free:  # `_drop_pages` frees what the index lets go
            self.prefix.evict(max_pages=(need - self.num_free) * self.model.cfg.num_layers)
        if need > self.num_free:
            raise CacheFullError(f"the cold KV pool holds {self.cache_cfg.pool_pages} pages per "
                                 f"layer, {self.num_free} free; {need} more are needed: "
                                 "nothing was written")

    def _cold(self, n) -> int:
        return int(st.num_cold_pages(self.cache_cfg, n)) if n else 0

    def _drop_pages(self, pages: list):
        """The prefix index evicted entries: drop its references to their pages."""
        self.caches = _page_refs(self.cache_cfg, self.caches, self._per_layer(pages), False)
        self.num_free = int(jnp.min(self.caches.num_free))
        self.evicted_pages += len(pages) // self.model.cfg.num_layers

    def _per_layer(self, pages) -> jax.Array:
        """Global page ids (layer * pool_pages + page) -> [L, n] pages, -1 padded to a
        power of two (a few program shapes)."""
        p, layers = self.cache_cfg.pool_pages, self.model.cfg.num_layers
        by = [[] for _ in range(layers)]
        for g in sorted(pages):
            by[g // p].append(g % p)
        out = np.full((layers, 1 << (max(1, *map(len, by)) - 1).bit_length()), -1, np.int32)
        for layer, row in enumerate(by):
            out[layer, :len(row)] = row
        return jnp.asarray(out)

    def hold_prefix(self, slot: int, ids, count: bool = False) -> int:
        """Reference, for `slot`'s coming prefill of prompt `ids`, the cold pages of
        the longest indexed prefix of `ids` (they cannot be evicted until the
        prefill or `release`); returns how many pages per layer it will share.
        The prefill holds again itself: a hold taken early (at admission) only
        makes sure those pages stay. The index's hit / miss counts move only with
        `count` (the prefill's own hold), once per prompt."""
        slot = self._check_slot(slot)
        if self.prefix is None:
            return 0
        ids = self._check_prompt(ids)
        c = self.cache_cfg
        n, pages = self.prefix.match(ids, count)
        m = min(n, c.sink_pages + self._cold(len(ids)))
        hashes = self.prefix.hashes(ids)[:m]
        with self.prefix.writer():
            self.prefix.acquire(hashes)
            old = self._holds.pop(slot, None)
            if old:
                self.prefix.release(old[0])
        self._holds[slot] = (hashes, pages[:m])
        return sum(1 for pg in pages[c.sink_pages:m] if pg)

    def _shared(self, slot: int, t: int) -> jax.Array:
        """[L, t / page] pool pages `slot`'s hold shares (-1: the prompt stores its own)."""
        layers, p = self.model.cfg.num_layers, self.cache_cfg.pool_pages
        out = np.full((layers, t // self.cache_cfg.page_size), -1, np.int32)
        for i, pg in enumerate(self._holds.get(slot, ((), ()))[1]):
            if pg and i >= self.cache_cfg.sink_pages:
                out[:, i] = [g - layer * p for layer, g in enumerate(pg)]
        return jnp.asarray(out)

    def _begin_fill(self, slot: int, ids, n: int, count: bool = True, taken: int = 0) -> int:
        """Before a prefill of n tokens into `slot` (emptied): hold the prompt's
        indexed prefix (with `ids`; without, no page is shared) and make room,
        beside `taken` pages that other prompts of the same batch will take; the
        new pages it will take."""
        if self.cache_cfg is None:
            return 0
        need = self._cold(n)
        if ids is not None:
            need -= self.hold_prefix(slot, ids, count)
        else:
            self.drop_hold(slot)
        self._make_room(need + taken)
        return need

    def _end_fill(self, slot: int, ids, need: int):
        """After a prefill: count its pages, index its full cold pages (with `ids`;
        never a poisoned sequence's) and let its hold go (the index references
        now cover the shared pages)."""
        if self.cache_cfg is None:
            return
        self.num_free -= need
        hold = self._holds.pop(slot, None)
        if ids is not None:
            rows, poisoned = _slot_pages(self.caches.page_table, self.caches.poisoned,
                                         jnp.int32(slot))
            if not bool(poisoned):
                self._index(slot, ids, np.asarray(rows))
        if hold:
            with self.prefix.writer():
                self.prefix.release(hold[0])

    def _index(self, slot: int, ids, rows: np.ndarray):
        """Index the prompt's sink and cold pages (only cold pages are shared; the
        window's pages are the sequence's own), bounding the index's size. rows: the
        slot's page table [L, max_pages]."""
        c, layers = self.cache_cfg, self.model.cfg.num_layers
        full = min(len(ids) // c.page_size, c.sink_pages + self._cold(len(ids)))
        if full <= c.sink_pages:
            return  # no cold page: nothing to share
        rows = rows[:, :full]
        base = np.arange(layers)[:, None] * c.pool_pages
        pages = [tuple(int(x) for x in rows[:, i] + base[:, 0]) if rows[:, i].min() >= 0
                 else () for i in range(full)]
        before = self.prefix.live_pages()
        with self.prefix.writer():
            hashes = self.prefix.insert(ids[:full * c.page_size], pages)
            self.prefix.acquire(hashes)
        self._refs[slot] = hashes
        new = self.prefix.live_pages() - before
        if new:  # the index's own reference: the pages outlive the sequence
            self.caches = _page_refs(c, self.caches, self._per_layer(new), True)
        if len(self.prefix) > 2 * c.pool_pages + 1024:  # pages plus each chain's sink root
            self.prefix.evict(len(self.prefix) - 2 * c.pool_pages - 1024)

    def pin(self, slot: int, context_id: str):
        """Keep `slot`'s prompt pages indexed under `context_id` after its sequence
        ends (a prewarmed document), until `unpin`."""
        slot = self._check_slot(slot)
        hashes = self._refs.get(slot)
        if self.prefix is None or not hashes:
            return
        self.unpin(context_id)  # pinned again: the new prompt's pages
        entries = [self.prefix.entries[h] for h in hashes]
        with self.prefix.writer():
            self.prefix.prewarm(context_id, [t for e in entries for t in e.tokens],
                                [e.pages for e in entries])

    def unpin(self, context_id: str):
        """Let a pinned document's pages go (evicted when unused and the pool is short)."""
        if self.prefix is not None and context_id in self.prefix.contexts:
            self.prefix.unpin(context_id)

    def pool_available(self) -> int:
        """Cold pool pages (per layer) free or held only by the prefix index's
        unused, unpinned entries (evicted on demand)."""
        if self.prefix is None:
            return 0
        return self.num_free + self.cached_pages()

    def cached_pages(self) -> int:
        """Pool pages (per layer) that only unused, unpinned prefix entries hold."""
        if self.prefix is None:
            return 0
        return sum(1 for e in self.prefix.entries.values()
                   if e.pages and not e.refcount and not e.pinned)

    def prefix_stats(self) -> dict[str, int]:
        """The prefix index's counts of prompt pages looked up (hits, misses,
        collisions), and of cold pool pages per layer: evicted, held pinned, held
        cached (unused)."""
        if self.prefix is None:
            return {}
        pinned = sum(1 for e in self.prefix.entries.values() if e.pages and e.pinned)
        return {**self.prefix.stats, "evictions": self.evicted_pages, "pinned_pages": pinned,
                "cached_pages": self.cached_pages()}

    def prefill(self, slot: int, ids, sampling: SamplingParams = GREEDY) -> int:
        """Empty `slot` and fill it with prompt `ids`; returns the first generated
        token (the logits are left in `self.logits`, shape [V])."""
        slot = self._check_slot(slot)
        ids = self._check_prompt(ids)
        n = ids.shape[0]
        row = self._bias_row(sampling)
        self._empty(slot)
        need = self._begin_fill(slot, ids, n)
        self._set_sampling(slot, sampling, row)
        padded = np.zeros(prefill_length(n), np.int32)
        padded[:n] = ids
        shared = self._shared(slot, len(padded)) if self.cache_cfg is not None else None
        tok, self.logits, self.caches, *new = _prefill(
            self.params, self.caches, jnp.int32(slot), jnp.asarray(padded), jnp.int32(n),
            shared, self._samp(slot), **self._static(), offload=self.offload,
            prefill=self.prefill_implementation)
        if new:
            self._store_cold(*new)
        self._end_fill(slot, ids, need)
        self.lens[slot] = n
        self.tokens[slot] = int(tok)
        return int(tok)

    def prefill_batch(self, slots, prompts, samplings) -> list[int]:
        """`prefill` of several slots at once, one program: prompts of at most
        PREFILL_CHUNK tokens that pad to the same length (`prefill_length`). Each
        slot ends as `prefill` alone would leave it, bit for bit, first token and
        logits included (`self.logits` [B, V], in `slots`' order); what the batch
        saves is the fixed cost of a program per prompt (a 40-token prompt's
        weight products take a quarter of what eight such prompts' take together).
        Not in offload mode."""
        if not len(slots) == len(prompts) == len(samplings) >= 1:
            raise ValueError("prefill_batch: as many slots, prompts and samplings, at least one")
        slots = [self._check_slot(s) for s in slots]
        if len(set(slots)) != len(slots):
            raise ValueError(f"prefill_batch: slots {slots} repeat")
        prompts = [self._check_prompt(p) for p in prompts]
        if len(slots) == 1:
            return [self.prefill(slots[0], prompts[0], samplings[0])]
        if self.offload:
            raise ValueError("prefill_batch: not in offload mode (prefill one prompt at a time)")
        lengths = [len(p) for p in prompts]
        t = prefill_length(lengths[0])
        if max(lengths) > PREFILL_CHUNK or any(prefill_length(n) != t for n in lengths):
            raise ValueError(f"prefill_batch: prompts of {lengths} tokens do not pad to one "
                             f"length of at most {PREFILL_CHUNK}")
        rows = [self._bias_row(s) for s in samplings]
        needs = []
        try:
            for slot, ids in zip(slots, prompts):
                self._empty(slot)
                needs.append(self._begin_fill(slot, ids, len(ids), taken=sum(needs)))
        except CacheFullError:
            for slot in slots:
                self.drop_hold(slot)
            raise
        for slot, sampling, row in zip(slots, samplings, rows):
            self._set_sampling(slot, sampling, row)
        padded = np.zeros((len(slots), t), np.int32)
        for i, ids in enumerate(prompts):
            padded[i, :len(ids)] = ids
        shared = (None if self.cache_cfg is None
                  else jnp.stack([self._shared(slot, t) for slot in slots]))
        toks, self.logits, self.caches = _prefill_batch(
            self.params, self.caches, jnp.asarray(slots, jnp.int32), jnp.asarray(padded),
            jnp.asarray(lengths, jnp.int32), shared, self._samp(slots), **self._static(),
            prefill=self.prefill_implementation)
        toks = [int(x) for x in np.asarray(toks)]
        for slot, ids, need, tok in zip(slots, prompts, needs, toks):
            self._end_fill(slot, ids, need)
            self.lens[slot] = len(ids)
            self.tokens[slot] = tok
        return toks

    def _check_prompt(self, ids) -> np.ndarray:
        ids = check_token_ids("ids", ids)
        n = ids.shape[0]
        if n == 0:
            raise ValueError("prompt is empty: prefill needs at least one token")
        if n >= self.max_context:
            raise ValueError(f"prompt of {n} tokens does not fit max_context="
                             f"{self.max_context} (it needs room for one generated token)")
        vocab = self.model.cfg.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"prompt ids must be in [0, {vocab}), got {ids.min()}..{ids.max()}")
        return ids

    @staticmethod
    def prefill_blocks(n: int) -> int:
        """How many `prefill_chunk` calls a prompt of n tokens takes."""
        return 1 if n <= PREFILL_CHUNK else -(-n // PREFILL_CHUNK)

    @staticmethod
    def block_length(n: int, start: int) -> int:
        """Rows the `prefill_chunk` call at `start` of an n-token prompt computes:
        a whole block, or the last one padded as `prefill_length` pads (a 1,075-token
        prompt's last 51 tokens take 64 rows, not 512)."""
        return prefill_length(min(n - start, PREFILL_CHUNK))

    def prefill_chunk(self, slot: int, ids, start: int,
                      sampling: SamplingParams = GREEDY) -> int | None:
        """`prefill`, one block of PREFILL_CHUNK tokens per call, so that a caller
        can run decode steps between the blocks (the server's chunked prefill).
        Call with start = 0, PREFILL_CHUNK, 2 * PREFILL_CHUNK, ... (the whole
        prompt `ids` each time); after the last block the slot holds the prompt as
        after `prefill` and the first generated token is returned (None before).
        A prompt of one block is `prefill` itself. The blocks' K/V are staged in a
        bf16 buffer [L, S, Hkv, D] of the slot's own, so up to `max_stages` slots at
        a time are in a chunked prefill (start=0 on one more abandons the oldest);
        the HiSparse cache is filled once, from the whole prompt (as `prefill_kv`)."""
        slot = self._check_slot(slot)
        ids = self._check_prompt(ids)
        n = ids.shape[0]
        if n <= PREFILL_CHUNK:
            if start != 0:
                raise ValueError(f"start={start!r}: a prompt of {n} tokens is one block")
            return self.prefill(slot, ids, sampling)
        start = check_int("start", start, minimum=0, maximum=n - 1)
        row = self._bias_row(sampling)
        if start == 0:
            self._empty(slot)
            self._begin_fill(slot, ids, n, count=False)  # fails early if the pool is short
            self._open_stage(slot)
        elif self._stages.get(slot, [None, None])[1] != start:
            staged = {s: st_[1] for s, st_ in self._stages.items()}
            raise ValueError(f"prefill_chunk(slot={slot}, start={start}): the staged prompts "
                             f"(slot: tokens) are {staged}")
        entry = self._last = self._stages[slot]
        block = np.zeros(self.block_length(n, start), np.int32)
        real = ids[start:start + PREFILL_CHUNK]
        block[:len(real)] = real
        if start == 0 or self.sampling[slot] != sampling:
            self._set_sampling(slot, sampling, row)
        tok, self.logits, entry[0] = _prefill_chunk(
            self.params, entry[0], jnp.asarray(block), jnp.int32(start),
            jnp.int32(len(real) - 1), self._samp(slot), graphdef=self.graphdef,
            products=self.product_implementation, prefill=self.prefill_implementation)
        entry[1] = start + len(real)
        if entry[1] < n:
            return None
        # decode steps between the blocks may have taken pages (and other prompts
        # indexed theirs): hold and check again
        need = self._begin_fill(slot, ids, n)
        k, v = entry[0]
        if self.cache_cfg is None:
            self.caches = _stage_to_dense(self.caches, jnp.int32(slot), k, v)
        else:
            t = fill_length(n, self.max_context)
            self._fill_kv(slot, k[:, :t], v[:, :t], n, self._shared(slot, t))
        self._end_fill(slot, ids, need)
        self._close_stage(slot)
        self.lens[slot] = n
        self.tokens[slot] = int(tok)
        return int(tok)

    def _spare_stage(self):
        """A K/V stage no prefill holds (one sequence long; made on first use)."""
        if not self._spare:
            mc = self.model.cfg
            shape = (mc.num_layers, -(-self.max_context // PREFILL_CHUNK) * PREFILL_CHUNK,
                     mc.num_kv_heads, mc.head_dim)
            self._spare.append((jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)))
        return self._spare[-1]

    def _open_stage(self, slot: int) -> list:
        """Give `slot`'s chunked prefill a stage (0 tokens staged), abandoning the
        oldest other prefill if max_stages are in progress."""
        self._close_stage(slot)
        if len(self._stages) >= self.max_stages:
            self._close_stage(next(iter(self._stages)))
        self._spare_stage()
        self._stages[slot] = [self._spare.pop(), 0]
        return self._stages[slot]

    def _close_stage(self, slot: int):
        """`slot`'s prefill is done or abandoned: its stage is spare again (its K/V
        stays readable by `staged_kv` until a prefill takes it)."""
        entry = self._stages.pop(slot, None)
        if entry is not None:
            self._spare.append(entry[0])

    def stages_free(self) -> int:
        """How many more chunked prefills can start without abandoning one."""
        return self.max_stages - len(self._stages)

    def staged_kv(self, n: int) -> tuple[jax.Array, jax.Array]:
        """Copies of the staged K/V [L, n, Hkv, D] bf16 of the first n tokens of the
        chunked prefill that last ran a block (valid until the next chunked prefill
        starts): what `stage_kv` takes to skip those tokens' prefill next time
        (prefix reuse)."""
        n = check_int("n", n, minimum=1)
        staged = 0 if self._last is None else self._last[1]
        if n > staged:
            raise ValueError(f"staged_kv({n}): {staged} tokens are staged")
        return tuple(x[:, :n] for x in self._last[0])

    def stage_kv(self, slot: int, k, v):
        """Begin a chunked prefill of `slot` with its prompt's first n tokens already
        computed: k, v [L, n, Hkv, D] from `staged_kv` of a prompt with the same
        first n tokens (n a multiple of PREFILL_CHUNK). Continue with
        prefill_chunk(slot, ids, start=n): the result is bit-equal to prefilling
        the whole prompt (the same blocks, the same K/V)."""
        slot = self._check_slot(slot)
        n = k.shape[1]
        if n % PREFILL_CHUNK or n < PREFILL_CHUNK or v.shape != k.shape:
            raise ValueError(f"stage_kv: k, v [L, n, Hkv, D] with n a multiple of "
                             f"{PREFILL_CHUNK}, got {tuple(k.shape)}, {tuple(v.shape)}")
        if n >= self.max_context:
            raise ValueError(f"stage_kv: {n} tokens do not fit max_context={self.max_context}")
        self._empty(slot)
        entry = self._open_stage(slot)
        entry[0] = _write_stage(entry[0], k, v)
        entry[1] = n

    def kv(self, slot: int) -> tuple[jax.Array, jax.Array]:
        """A dense engine's K/V of `slot`'s tokens: two [L, n, Hkv, D] bf16 arrays
        (what `prefill_kv` takes), so one exact prefill can seed several caches."""
        slot = self._check_slot(slot)
        if self.cache_cfg is not None:
            raise ValueError("kv() reads a dense engine's cache (attention='dense')")
        n = int(self.lens[slot])
        return tuple(c[:, slot, :, :n].transpose(0, 2, 1, 3) for c in self.caches)

    def prefill_kv(self, slot: int, k, v, next_token: int,
                   sampling: SamplingParams = GREEDY, ids=None):
        """Fill `slot` with a prompt whose K/V [L, n, Hkv, D] were computed elsewhere
        (an exact prefill's: `kv`, `staged_kv`); `next_token` is the token that
        prefill sampled, the next decode step's input. Equal to `prefill` on the
        same prompt, without running the model. With the prompt's n token `ids`,
        its cold pages are shared and indexed as `prefill`'s."""
        slot = self._check_slot(slot)
        mc = self.model.cfg
        want = (mc.num_layers, None, mc.num_kv_heads, mc.head_dim)
        for name, x in (("k", k), ("v", v)):
            if x.ndim != 4 or any(w is not None and w != g for w, g in zip(want, x.shape)):
                raise ValueError(f"{name}: expected [L={want[0]}, n, Hkv={want[2]}, "
                                 f"D={want[3]}], got {tuple(x.shape)}")
        n = k.shape[1]
        if v.shape != k.shape:
            raise ValueError(f"v {tuple(v.shape)} does not match k {tuple(k.shape)}")
        if not 0 < n < self.max_context:
            raise ValueError(f"prompt of {n} tokens does not fit max_context={self.max_context}")
        next_token = check_int("next_token", next_token, minimum=0,
                               maximum=mc.vocab_size - 1)
        row = self._bias_row(sampling)
        if ids is not None:
            ids = self._check_prompt(ids)
            if len(ids) != n:
                raise ValueError(f"ids: {len(ids)} token ids for K/V of {n} tokens")
        self._empty(slot)
        need = self._begin_fill(slot, ids, n)
        pad = fill_length(n, self.max_context) - n
        pad_to = lambda x: jnp.pad(jnp.asarray(x, jnp.bfloat16), ((0, 0), (0, pad), (0, 0),
                                                                   (0, 0)))
        if self.cache_cfg is None:
            self.caches = _stage_to_dense(self.caches, jnp.int32(slot), pad_to(k), pad_to(v))
        else:
            self._fill_kv(slot, pad_to(k), pad_to(v), n, self._shared(slot, n + pad))
        self._end_fill(slot, ids, need)
        self._set_sampling(slot, sampling, row)
        self.lens[slot] = n
        self.tokens[slot] = next_token

    def _fill_kv(self, slot: int, k, v, n: int, shared):
        out = _prefill_kv(self.cache_cfg, self.caches, jnp.int32(slot), k, v, jnp.int32(n),
                          shared, self.offload)
        if self.offload:
            self.caches, pool_ids, codes = out
            self._store_cold(pool_ids, codes)
        else:
            self.caches = out

    def decode_step(self, active=None, tokens=None) -> np.ndarray:
        """Append each active slot's last token, attend, sample: next tokens [B]
        (inactive slots keep their last token). active: [B] bool, default all
        slots holding a sequence. tokens [B]: the inputs instead of the last
        sampled tokens (teacher forcing: scoring a text)."""
        active = (self.lens > 0) if active is None else check_bool_mask("active", active,
                                                                        self.max_seqs)
        if tokens is not None:
            tokens = check_token_ids("tokens", tokens)
            if tokens.shape != (self.max_seqs,) or tokens.max() >= self.model.cfg.vocab_size:
                raise ValueError(f"tokens: expected {self.max_seqs} ids below "
                                 f"{self.model.cfg.vocab_size}, got shape {tokens.shape}")
            self.tokens = np.where(active, tokens, self.tokens).astype(np.int32)
        if np.any(active & (self.lens == 0)):
            raise ValueError(f"slots {np.flatnonzero(active & (self.lens == 0)).tolist()} "
                             "are empty: prefill them first")
        full = active & (self.lens >= self.max_context)
        if np.any(full):
            raise ValueError(f"slots {np.flatnonzero(full).tolist()} are full: "
                             f"max_context={self.max_context} tokens")
        need = 0
        if self.cache_cfg is not None:
            before = self.lens.astype(np.int64)
            need = int(np.sum((st.num_cold_pages(self.cache_cfg, before + active)
                               - st.num_cold_pages(self.cache_cfg, before)) * (before > 0)))
            self._make_room(need)
        # the penalties count the tokens each sequence has generated: its input now
        # (only where a slot has a penalty: other slots never read their counts)
        counted = active & np.array([p.presence_penalty != 0 or p.frequency_penalty != 0
                                     for p in self.sampling])
        if counted.any():
            self._count(np.arange(self.max_seqs), self.tokens, counted)
        if self.offload:
            nxt, self.logits = self._decode_offloaded(active, self.decode_width(active))
        else:
            nxt, self.logits, self.caches = _decode(
                self.params, self.caches, jnp.asarray(self.tokens), jnp.asarray(self.lens),
                jnp.asarray(active), self._samp(), **self._static(),
                n=self.decode_width(active))
        nxt = np.asarray(nxt)
        self.tokens = np.where(active, nxt, self.tokens).astype(np.int32)
        self.lens = self.lens + active
        self.num_free -= need
        return self.tokens.copy()

    def _decode_offloaded(self, active: np.ndarray, width: int):
        """Offload mode's decode step (one program, `_decode_offloaded`) over the
        first `width` slots. -> (next tokens [B], logits [B, V])."""
        nxt, logits, self.caches, self.cold = _decode_offloaded(
            self.params, self.caches, self.cold, jnp.asarray(self.tokens),
            jnp.asarray(self.lens), jnp.asarray(active), self._samp(), **self._static(),
            width=width, shardings=self.shardings)
        return nxt, logits

    def offload_counters(self) -> dict[str, int | float]:
        """Offload mode's counters summed over the layers: cold pages selected
        (per KV head), found resident (hits), copied in (misses and prefetches),
        evicted, the resident hit rate and the host-to-device bytes copied; {}
        without offload."""
        if not self.offload:
            return {}
        self.cold, self.counted, self.copied = self.cold.take_counts(self.counted, self.copied)
        out = scheduler.counters(self.cold.sched.replace(counters=self.counted))
        page = scheduler.page_bytes(self.cache_cfg)
        out.update(resident_pages=int(jnp.sum(self.cold.sched.resident >= 0)),
                   sample_pages_copied=int(self.copied[2]),
                   host_to_device_bytes_copied=int(self.copied[0]) * page,
                   host_to_device_bytes_moved=int(self.copied[1]) * page)
        return out

    def decode_widths(self) -> list[int]:
        """The slot counts a decode program is compiled for (`state.decode_widths`;
        dense attention's numbers are equal at every width, the sparse one's from
        4 slots on)."""
        return st.decode_widths(self.max_seqs)

    def decode_width(self, active: np.ndarray) -> int:
        """How many slots a decode step computes: the narrowest width that covers
        the highest active slot (the scheduler fills the lowest free slot, so at
        low concurrency a step costs what a few slots need, not what max_seqs
        does)."""
        top = int(np.flatnonzero(active).max()) + 1 if np.any(active) else 1
        return st.decode_width(self.max_seqs, top)

    def release(self, slot: int):
        """Empty `slot`: a HiSparse cache frees its cold pages but those the prefix
        index holds (and lets go of the slot's hold)."""
        slot = self._check_slot(slot)
        self._empty(slot)
        self.drop_hold(slot)

    def drop_hold(self, slot: int):
        """Let go of `hold_prefix`'s references for `slot` (host only)."""
        hold = self._holds.pop(slot, None)
        if hold:
            with self.prefix.writer():
                self.prefix.release(hold[0])

    def _empty(self, slot: int):
        """`release`, keeping the slot's hold (for the prefill about to fill it)."""
        if self.cache_cfg is not None:
            self.caches = _release(self.cache_cfg, self.caches, jnp.int32(slot))
            if self.offload:  # its pages leave the working sets
                self.cold = self.cold.forget(slot)
            refs = self._refs.pop(slot, None)
            if refs:
                with self.prefix.writer():
                    self.prefix.release(refs)
            self.num_free = int(jnp.min(self.caches.num_free))  # shared pages: data dependent
        self.lens[slot] = 0
        self._close_stage(slot)  # a chunked prefill abandoned

    def pool_usage(self) -> tuple[int, int]:
        """(cold pool pages in use, pool pages), summed over the layers, read from
        the live pool (a device read); pages only the prefix index's unused,
        unpinned entries hold count as free (`cached_pages`). (0, 0) for a dense
        engine."""
        if self.cache_cfg is None:
            return 0, 0
        layers = self.model.cfg.num_layers
        total = self.cache_cfg.pool_pages * layers
        return total - int(jnp.sum(self.caches.num_free)) - self.cached_pages() * layers, total

    def tier_tokens(self) -> dict[str, int]:
        """Tokens per tier (sink, hot, warm, cold) over the slots, from the lengths
        (the arithmetic of `HiSparseCache.counters`); {} for a dense engine."""
        c = self.cache_cfg
        if c is None:
            return {}
        lens, pg = self.lens.astype(np.int64), c.page_size
        held = lens > 0
        cold = st.num_cold_pages(c, lens) * held * pg
        sink = np.minimum(lens, c.sink_pages * pg)
        hot_start = np.maximum(c.sink_pages, (lens - 1) // pg - c.hot_pages + 1)
        hot = np.maximum(0, lens - hot_start * pg) * held
        warm = lens - sink - hot - cold
        return {"sink": int(sink.sum()), "hot": int(hot.sum()), "warm": int(warm.sum()),
                "cold": int(cold.sum())}

    def room(self, slot: int) -> int:
        """Tokens slot `slot` can still take."""
        return self.max_context - int(self.lens[slot])

    def capacity_line(self) -> str:
        layers = self.model.cfg.num_layers
        if self.offload:
            device = layout.nbytes(self.caches) + self.cold.device_bytes()
            host = layout.nbytes(self.cold.host)
            return (f"{layout.summary_line(self.cache_cfg, device // layers, host // layers)} "
                    f"per layer, {layers} layers, cold pages offloaded to host memory "
                    f"(working set {self.working_set} pages per sequence and KV head)")
        if self.cache_cfg is not None:
            return f"{layout.summary_line(self.cache_cfg)} per layer, {layers} layers"
        nbytes = sum(c.size * c.dtype.itemsize for c in self.caches)
        return f"dense bf16 KV cache: device {nbytes / 2**20:.1f} MiB, {layers} layers"

    def warmup(self, prompt_len: int = 16) -> float:
        """Compile prefill (for prompts of `prompt_len`'s padded length, whole and
        block by block: `prefill_chunk`, `prefill_kv`) and decode, without running
        them (XLA keeps the executables for the real calls: a 7K prompt's prefill
        would cost as much again as compiling it); returns seconds."""
        t0 = time.perf_counter()
        n = prefill_length(min(prompt_len, self.max_context - 1))
        samp = self._samp(0)
        shared = None if self.cache_cfg is None else self._shared(-1, n)
        _prefill.lower(self.params, self.caches, jnp.int32(0), jnp.zeros(n, jnp.int32),
                       jnp.int32(1), shared, samp, **self._static(),
                       offload=self.offload, prefill=self.prefill_implementation).compile()
        if n > PREFILL_CHUNK:
            stage = self._spare_stage()
            m = min(prompt_len, self.max_context - 1)
            last = (m - 1) // PREFILL_CHUNK * PREFILL_CHUNK  # the last block's start
            for rows in sorted({PREFILL_CHUNK, self.block_length(m, last)}):
                _prefill_chunk.lower(self.params, stage, jnp.zeros(rows, jnp.int32),
                                     jnp.int32(0), jnp.int32(0), samp, graphdef=self.graphdef,
                                     products=self.product_implementation,
                                     prefill=self.prefill_implementation).compile()
            filled = fill_length(m, self.max_context)
            kv = [x[:, :filled] for x in stage]
            if self.cache_cfg is None:
                _stage_to_dense.lower(self.caches, jnp.int32(0), *stage).compile()
                _stage_to_dense.lower(self.caches, jnp.int32(0), *kv).compile()
            else:
                _prefill_kv.lower(self.cache_cfg, self.caches, jnp.int32(0), *kv,
                                  jnp.int32(1), self._shared(-1, filled), self.offload).compile()
        if self.offload:
            for n in self.decode_widths():
                _decode_offloaded.lower(
                    self.params, self.caches, self.cold, jnp.asarray(self.tokens),
                    jnp.asarray(self.lens), jnp.zeros(self.max_seqs, bool), self._samp(),
                    **self._static(), width=n, shardings=self.shardings).compile()
            return time.perf_counter() - t0
        for n in self.decode_widths():
            _decode.lower(self.params, self.caches, jnp.asarray(self.tokens),
                          jnp.asarray(self.lens), jnp.zeros(self.max_seqs, bool),
                          self._samp(), **self._static(), n=n).compile()
        return time.perf_counter() - t0
