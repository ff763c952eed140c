"""KV strategies: what the engine's programs do with the KV cache, one per kind, and
the programs themselves, each one loop over the layers (`Llama.layers`).

A strategy is a frozen dataclass (a static argument of the programs: one compiled
program per strategy and shape) that answers the questions where the kinds differ:

- `DenseKV`: a bf16 K and V [L, B, Hkv, S, D] pair; exact float32 attention over
  every token (the baseline).
- `HiSparseKV`: the layer-stacked `CacheState` (`state.init_stacked`); prefill fills
  its tiers (`state.prefill_layer`), decode appends in place and attends sparsely
  (`attention.decode_layer`).
- `OffloadedKV`: the stacked state without cold codes, beside
  `offload.LayerColdStores` (every layer's cold codes in host memory, its working
  set, sample buffer and scheduler state on the device); decode copies each
  layer's missing pages in between its selection and its attention.

The programs take and return one pytree per strategy, `caches` (`pack` makes it
from the engine's `caches` and `cold`, `unpack` splits it again), donated, so that
every layer writes its part in place:

- `prefill`, `prefill_batch`: prompts through the model, exact attention
  (`attention.causal_block_attention`), each layer's K/V written by
  `write_prompt`;
- `fill`: the same writes from K/V computed elsewhere (a chunked prefill's stage);
- `decode`: one token per slot; `decode_loop` gives the layer loop's carry, the
  `attend` callback and what the carry becomes after the last layer.

The offloaded decode carries its per-layer extras (working sets, scheduler state,
held samples, copy counters, the layer below's candidates for the prefetch, the
new cold pages) through the same layer loop; the first layer plans without a
layer below (`offload.plan_copies`' has_below), as when it ran apart.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from hisparse_jax import attention as att
from hisparse_jax import backends
from hisparse_jax.attention.exact import (
    PREFILL_CHUNK,
    causal_block_attention,
    float32_decode_attention,
)
from hisparse_jax.backends import resolve_implementation
from hisparse_jax.cache import layout
from hisparse_jax.cache import state as st
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.models.sampling import sample_slots
from hisparse_jax.offload import policy as scheduler
from hisparse_jax.offload import store as off


def prefill_length(n: int) -> int:
    """Padded prompt length: 64, 128, 256, 512, then whole chunks, so a handful of
    programs serve every prompt length (each length is a program to compile)."""
    if n <= PREFILL_CHUNK:
        return max(64, 1 << (n - 1).bit_length())
    return -(-n // PREFILL_CHUNK) * PREFILL_CHUNK


def fill_length(n: int, max_context: int) -> int:
    """Padded length of the K/V an n-token prompt fills the HiSparse cache from:
    `prefill_length` up to a block, then powers of two up to the staging buffer's
    length (max_context in whole blocks). A fill program per length: a few for any
    context, where whole blocks made one per block count, for at most twice the
    fill's work (the padding is encoded, then dropped)."""
    if n <= PREFILL_CHUNK:
        return prefill_length(n)
    return min(1 << (n - 1).bit_length(), prefill_length(max_context))


class DecodeLoop(NamedTuple):
    """A decode step's layer loop, as a strategy sets it up: the carry it starts
    from, the `Llama.layers` callback, and the step's caches from the carry after
    the last layer."""
    carry: Any
    attend: Any   # llama.Attend
    done: Any     # carry -> caches


# ---------------------------------------------------------------- strategies

def _put_prompt(c, x, layer, slot):
    """A prompt's K or V [T, Hkv, D] into a dense cache's layer and slot, its first
    min(T, S) tokens."""
    n = min(x.shape[0], c.shape[3])
    return jax.lax.dynamic_update_slice(
        c, x[:n].transpose(1, 0, 2)[None, None].astype(c.dtype), (layer, slot, 0, 0, 0))


def dense_decode_layer(caches, layer, q, k, v, lens, active):
    """`attention.decode_layer` for the dense cache ([L, B, Hkv, S, D] pair): write
    each active slot's k, v at its length, in place, and attend exactly."""
    kc, vc = caches
    n = q.shape[0]  # slots 0..n-1
    at = (layer, jnp.arange(n), slice(None),  # indexed as [n, Hkv, D]
          jnp.where(active, lens, kc.shape[3]))        # inactive slots: dropped
    kc = kc.at[at].set(k.astype(kc.dtype), mode="drop")
    vc = vc.at[at].set(v.astype(vc.dtype), mode="drop")
    return float32_decode_attention(q, kc[layer, :n], vc[layer, :n], lens + active), (kc, vc)


class _OnDevice:
    """The defaults of a cache the programs take as the engine holds it, every part
    on the device (`DenseKV`, `HiSparseKV`)."""

    batch_prefill = True

    def pack(self, caches, cold):
        """The programs' caches from the engine's `caches` and `cold` parts."""
        return caches

    def unpack(self, caches):
        """`pack`'s inverse: (caches, cold)."""
        return caches, None

    def begin_prompt(self, caches, t: int):
        """What a prompt's layer loop (of t tokens) carries."""
        return caches

    def end_prompt(self, caches, carry):
        """The caches after a prompt's layer loop: `caches` as the loop began, `carry`
        as it ended."""
        return carry

    def decode_rows(self, b: int, n: int) -> int:
        """How many slots' rows a step over the first n of b slots computes."""
        return n

    def fill_tokens(self, n: int, max_context: int, staged: int) -> int:
        """How many of a chunked prefill's `staged` tokens (an n-token prompt's)
        `fill` encodes: `fill_length`'s."""
        return fill_length(n, max_context)


@dataclasses.dataclass(frozen=True)
class DenseKV(_OnDevice):
    """A plain bf16 KV cache of every token: the exact baseline."""

    cfg = None  # no HiSparse config

    def init(self, layers: int, max_seqs: int, num_kv_heads: int, max_context: int,
             head_dim: int):
        shape = (layers, max_seqs, num_kv_heads, max_context, head_dim)
        return jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)

    def write_prompt(self, caches, layer, slot, k, v, length, shared, implementation):
        """A prompt's K/V [T, Hkv, D] (bf16) into `slot` of layer `layer`."""
        return _put_prompt(caches[0], k, layer, slot), _put_prompt(caches[1], v, layer, slot)

    def fill_tokens(self, n: int, max_context: int, staged: int) -> int:
        """How many of a chunked prefill's `staged` tokens (an n-token prompt's)
        `fill` copies in: all of them (a copy of any length is one program)."""
        return staged

    def decode_loop(self, caches, lens, active, n: int, implementation) -> DecodeLoop:
        attend = lambda caches, layer, q, k, v: dense_decode_layer(caches, layer, q, k, v,
                                                                   lens, active)
        return DecodeLoop(caches, attend, lambda caches: caches)

    def release(self, caches, slot: int):
        return caches

    def capacity_line(self, caches, layers: int) -> str:
        nbytes = sum(c.size * c.dtype.itemsize for c in caches)
        return f"dense bf16 KV cache: device {nbytes / 2**20:.1f} MiB, {layers} layers"


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _release(cfg: HiSparseConfig, caches, slot):
    return jax.vmap(lambda s: st.stored(st.release(cfg, st.live(cfg, s), slot)))(caches)


@dataclasses.dataclass(frozen=True)
class HiSparseKV(_OnDevice):
    """Every layer's `CacheState` stacked on a leading layer axis."""

    cfg: HiSparseConfig

    def init(self, layers: int):
        return st.init_stacked(self.cfg, layers)

    def write_prompt(self, caches, layer, slot, k, v, length, shared, implementation):
        """`state.prefill_layer` of a prompt's K/V [T, Hkv, D] (bf16); shared [T /
        page]: pool pages it references instead of storing (-1: none)."""
        return st.prefill_layer(self.cfg, caches, layer, slot, k, v, length, shared,
                                implementation=implementation)[0]

    def decode_loop(self, caches, lens, active, n: int, implementation) -> DecodeLoop:
        """Slots 0..n-1's own fields copied out of the stacked caches and back (the
        pool stays in place, and on the "cpu" kernels the window's tiers too:
        `state.WINDOW_FIELDS`)."""
        hcfg = self.cfg
        keep = backends.reads_in_place("attend_cold", resolve_implementation(implementation, hcfg))
        hcfg, part = st.first_slots(hcfg, caches, n, axis=1, keep=keep)
        attend = lambda part, layer, q, k, v: att.decode_layer(hcfg, part, layer, q, k, v, active,
                                                               implementation=implementation)
        return DecodeLoop(part, attend, lambda part: st.put_first_slots(caches, part, axis=1))

    def release(self, caches, slot: int):
        return _release(self.cfg, caches, jnp.int32(slot))

    def capacity_line(self, caches, layers: int) -> str:
        return f"{layout.summary_line(self.cfg)} per layer, {layers} layers"


@functools.partial(jax.jit, static_argnums=(0, 1))
def _without_cold_codes(hcfg: HiSparseConfig, layers: int):
    """`state.init_stacked` without the cold codes (their pool axis empty)."""
    caches = st.init_stacked(hcfg, layers)
    return caches.replace(**{f: jnp.zeros(x.shape[:2] + (0,) + x.shape[3:], x.dtype)
                             for f in st.OFFLOAD_FIELDS for x in [getattr(caches, f)]})


class _Prompt(NamedTuple):
    """An offloaded prefill's layer-loop carry: the state and the prompt's new cold
    pages of every layer (pool ids [L, T / page], codes {OFFLOAD_FIELDS: [L, T /
    page, Hkv, ...]}), stored in the host pools after the last layer."""
    state: Any
    pool_ids: jax.Array
    codes: dict


class _Step(NamedTuple):
    """The offloaded decode step's layer-loop carry: the state, the device parts of
    `LayerColdStores` (stacked on the layer axis), the layer below's candidates
    [B, Hkv, C] (its prediction for the prefetch) and the pages that became cold,
    pool ids [L, B] and codes {field: [L, B, Hkv, ...]} (to the host pools after the
    last layer; a layer that selects one takes it from these)."""
    state: Any
    ws: dict
    sample_ws: dict
    held: jax.Array
    sched: scheduler.SchedulerState
    copied: jax.Array
    below: jax.Array
    pool_ids: jax.Array
    codes: dict


@dataclasses.dataclass(frozen=True)
class OffloadedKV:
    """The stacked state without cold codes; every layer's live in host memory
    (`offload.LayerColdStores`). The same bytes are attended as `HiSparseKV`'s, so
    the tokens equal its. shardings: (host, device) (`offload.shardings`)."""

    cfg: HiSparseConfig
    shardings: tuple
    batch_prefill = False  # one prompt at a time: its new pages go to the host after it

    def init(self, layers: int):
        return _without_cold_codes(self.cfg, layers)

    def pack(self, caches, cold):
        return caches, cold

    def unpack(self, caches):
        return caches

    def begin_prompt(self, caches, t: int):
        state, _ = caches
        layers = state.page_table.shape[0]
        shapes = jax.eval_shape(lambda: st.init_state(self.cfg))
        npg = t // self.cfg.page_size
        codes = {f: jnp.zeros((layers, npg, self.cfg.num_kv_heads,
                               *getattr(shapes, f).shape[2:]), getattr(shapes, f).dtype)
                 for f in st.OFFLOAD_FIELDS}
        return _Prompt(state, jnp.full((layers, npg), self.cfg.pool_pages, jnp.int32), codes)

    def end_prompt(self, caches, prompt: _Prompt):
        cold = caches[1]
        host = off.store_pages(self.shardings[0], cold.host, prompt.pool_ids, prompt.codes)
        return prompt.state, cold._replace(host=host)

    def write_prompt(self, prompt: _Prompt, layer, slot, k, v, length, shared, implementation):
        state, ids, codes = st.prefill_layer(self.cfg, prompt.state, layer, slot, k, v, length,
                                             shared, implementation=implementation)
        return prompt._replace(state=state, pool_ids=prompt.pool_ids.at[layer].set(ids),
                               codes={f: prompt.codes[f].at[layer].set(codes[f])
                                      for f in prompt.codes})

    def fill_tokens(self, n: int, max_context: int, staged: int) -> int:
        return fill_length(n, max_context)

    def decode_rows(self, b: int, n: int) -> int:
        """Every slot's projections; the selection and attention over the first n
        (`offload.plan_copies`' width)."""
        return b

    def decode_loop(self, caches, lens, active, n: int, implementation) -> DecodeLoop:
        """Each layer appends its token, plans (`offload.plan_copies`: the prefetch of
        the layer below's candidates, the selection, the scheduler), copies the
        missing pages in from the host (`copy_pages`) and attends the resident ones
        (`attend_planned`). The pages that become cold go to the host pools after
        the layers, in the same program whether or not there are any."""
        hcfg, shardings = self.cfg, self.shardings
        state, cold = caches
        w = cold.working_set
        at = lambda tree, layer: jax.tree.map(lambda a: a[layer], tree)
        layers, b = state.page_table.shape[:2]
        query = jax.ShapeDtypeStruct((b, hcfg.num_kv_heads * hcfg.gqa_group, hcfg.head_dim),
                                     jnp.float32)
        candidates = jax.eval_shape(
            lambda s, q: att.select(hcfg, st.layer_view(hcfg, s, 0), q,
                                    implementation=implementation).pages, state, query)
        codes = {f: jnp.zeros((layers, b, *x.shape[1:2], *x.shape[3:]), x.dtype)
                 for f, x in cold.host.items()}
        carry = _Step(state, cold.ws, cold.sample_ws, cold.sample_held, cold.sched, cold.copied,
                      jnp.full(candidates.shape, -1, jnp.int32),
                      jnp.zeros((layers, b), jnp.int32), codes)

        def attend(c: _Step, layer, q, k, v):
            state, pool_ids, codes = st.append_layer(hcfg, c.state, layer, k, v, active,
                                                     implementation=implementation)
            view = st.layer_view(hcfg, state, layer)
            sched_l, held_l, planned = off.plan_copies(
                hcfg, view, q, at(c.sched, layer), c.held[layer], c.below, width=n,
                implementation=implementation, has_below=layer > 0)
            ws, sample_ws, counts = off.copy_pages(shardings, cold.host, layer, c.ws,
                                                   c.sample_ws, planned.copies, w,
                                                   (pool_ids, codes))
            out, below, _, last = off.attend_planned(hcfg, view, q, at(ws, layer),
                                                     at(sample_ws, layer), sched_l, held_l,
                                                     planned, implementation=implementation)
            state = state.replace(last_selected=state.last_selected.at[layer].set(last))
            sched = jax.tree.map(lambda a, x: a.at[layer].set(x), c.sched, sched_l)
            return out, _Step(state, ws, sample_ws, c.held.at[layer].set(held_l), sched,
                              c.copied + counts, below, c.pool_ids.at[layer].set(pool_ids),
                              {f: c.codes[f].at[layer].set(codes[f]) for f in c.codes})

        def done(c: _Step):
            host = off.store_pages(shardings[0], cold.host, c.pool_ids, c.codes)
            return c.state, off.LayerColdStores(host, c.ws, c.sample_ws, c.held, c.sched,
                                                c.copied)

        return DecodeLoop(carry, attend, done)

    def release(self, caches, slot: int):
        """Its pages leave the working sets too."""
        state, cold = caches
        return _release(self.cfg, state, jnp.int32(slot)), cold.forget(slot)

    def capacity_line(self, caches, layers: int) -> str:
        state, cold = caches
        device = layout.nbytes(state) + cold.device_bytes()
        host = layout.nbytes(cold.host)
        return (f"{layout.summary_line(self.cfg, device // layers, host // layers)} "
                f"per layer, {layers} layers, cold pages offloaded to host memory "
                f"(working set {cold.working_set} pages per sequence and KV head)")


KVStrategy = DenseKV | HiSparseKV | OffloadedKV


# ---------------------------------------------------------------- programs

def _layer(shared, *index):
    """shared's pages at `index` (None: a dense cache shares nothing)."""
    return None if shared is None else shared[index]


@functools.partial(jax.jit, static_argnames=("graphdef", "kv", "implementation", "products",
                                             "prefill"),
                   donate_argnames="caches")
def prefill(params, caches, slot, ids, length, shared, samp, *, graphdef, kv: KVStrategy,
            implementation, products, prefill="xla"):
    """One slot's prompt ids [Tp] (the first `length` real, the rest padding) ->
    (first generated token [], its logits [V], caches). shared [L, Tp / page]:
    pool pages the prompt references instead of storing (-1: none; None: dense)."""
    model = nnx.merge(graphdef, params)
    t = ids.shape[0]
    chunk = min(t, PREFILL_CHUNK)

    def attend(caches, layer, q, k, v):
        # Exact attention over the K/V as the cache stores them (bf16), so that a
        # decode step gives what a prefill one token longer would.
        k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
        out = causal_block_attention(q, k, v, 0, chunk, prefill)
        return out, kv.write_prompt(caches, layer, slot, k, v, length, _layer(shared, layer),
                                    implementation)

    x, carry = model.layers(model.embed_tokens(ids), jnp.arange(t), kv.begin_prompt(caches, t),
                            attend, products=products)
    logits = model.logits(x[length - 1][None], products=products)
    tok = sample_slots(logits, length[None], samp)
    return tok[0], logits[0], kv.end_prompt(caches, carry)


@functools.partial(jax.jit, static_argnames=("graphdef", "kv", "implementation", "products",
                                             "prefill"),
                   donate_argnames="caches")
def prefill_batch(params, caches, slots, ids, lengths, shared, samp, *, graphdef,
                  kv: KVStrategy, implementation, products, prefill="xla"):
    """Several slots' prompts of one padded length at once: ids [B, Tp] (row i's first
    lengths[i] real), slots [B], shared [B, L, Tp / page] as `prefill`'s ->
    (first generated tokens [B], their logits [B, V], caches). The weight products
    take all B * Tp rows together; each prompt's attention and cache fill are its
    own (a loop over the rows), so every row gets `prefill`'s numbers alone."""
    model = nnx.merge(graphdef, params)
    b, t = ids.shape

    def attend(caches, layer, q, k, v):
        q, k, v = (x.reshape(b, t, *x.shape[1:]) for x in (q, k.astype(jnp.bfloat16),
                                                           v.astype(jnp.bfloat16)))

        def one(i, carry):
            out, caches = carry
            out = out.at[i].set(causal_block_attention(q[i], k[i], v[i], 0, t, prefill))
            return out, kv.write_prompt(caches, layer, slots[i], k[i], v[i], lengths[i],
                                        _layer(shared, i, layer), implementation)

        out, caches = jax.lax.fori_loop(0, b, one, (jnp.zeros(q.shape, jnp.float32), caches))
        return out.reshape(b * t, *out.shape[2:]), caches

    x, caches = model.layers(model.embed_tokens(ids.reshape(-1)), jnp.tile(jnp.arange(t), b),
                             caches, attend, products=products)
    last = x.reshape(b, t, -1)[jnp.arange(b), lengths - 1]
    logits = model.logits(last, products=products)
    return sample_slots(logits, lengths, samp), logits, caches


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def fill(kv: KVStrategy, caches, slot, k, v, length, shared):
    """Fill `slot` of every layer's cache from K/V [L, T, Hkv, D] (bf16; a dense
    cache takes its first S tokens), shared [L, T / page] as `prefill`'s: a loop
    over the layers, each written in place (`write_prompt`)."""
    def one(caches, xs):
        layer, k, v, shared = xs
        return kv.write_prompt(caches, layer, slot, k, v, length, shared, None), None

    layers = jnp.arange(k.shape[0], dtype=jnp.int32)
    carry, _ = jax.lax.scan(one, kv.begin_prompt(caches, k.shape[1]), (layers, k, v, shared))
    return kv.end_prompt(caches, carry)


@functools.partial(jax.jit, static_argnames=("graphdef", "products", "prefill"),
                   donate_argnames="stage")
def prefill_chunk(params, stage, ids, start, last, samp, *, graphdef, products, prefill="xla"):
    """One block of a prompt: ids [C] at positions start..start+C (C: PREFILL_CHUNK,
    or a padded last block) -> (the token sampled after row `last` [], its logits
    [V], stage). stage: (K, V) [L, S, Hkv, D] bf16, the prompt's K/V so far; this
    block's are written into it (`fill` moves the whole prompt's into a cache)."""
    model = nnx.merge(graphdef, params)
    c = ids.shape[0]

    def attend(stage, layer, q, k, v):
        ks, vs = (jax.lax.dynamic_update_slice(s, x.astype(jnp.bfloat16)[None], (layer, start, 0, 0))
                  for s, x in zip(stage, (k, v)))
        return causal_block_attention(q, ks, vs, start, PREFILL_CHUNK, prefill, layer), (ks, vs)

    x, stage = model.layers(model.embed_tokens(ids), start + jnp.arange(c), stage, attend,
                            products=products)
    logits = model.logits(x[last][None], products=products)
    tok = sample_slots(logits, (start + last + 1)[None], samp)
    return tok[0], logits[0], stage


@functools.partial(jax.jit, static_argnames=("graphdef", "kv", "implementation", "products",
                                             "n"),
                   donate_argnames="caches")
def decode(params, caches, tokens, lens, active, samp, *, graphdef, kv: KVStrategy,
           implementation, products, n):
    """tokens [B] at positions lens [B] (active [B] slots) -> (next tokens [B],
    logits [B, V], caches), attending in slots 0..n-1 only (the rest must be
    inactive); the rows past the strategy's `decode_rows` come back 0. One loop
    over the layers, whatever the strategy (`decode_loop`)."""
    model = nnx.merge(graphdef, params)
    b = tokens.shape[0]
    rows = kv.decode_rows(b, n)
    tokens, lens, active = tokens[:rows], lens[:rows], active[:rows]
    samp = jax.tree.map(lambda a: a[:rows], samp)
    loop = kv.decode_loop(caches, lens, active, n, implementation)
    x, carry = model.layers(model.embed_tokens(tokens), lens, loop.carry, loop.attend,
                            products=products)
    caches = loop.done(carry)
    logits = model.logits(x, products=products)
    nxt = sample_slots(logits, lens + 1, samp)
    pad = lambda a: jnp.zeros((b, *a.shape[1:]), a.dtype).at[:rows].set(a)
    return pad(nxt), pad(logits), caches
