"""Paged, tiered KV cache state for one layer, and the pure functions that fill it.

Layout (B = max_seqs, P = pool pages, Tb = sink + hot tokens, Tw = warm tokens):
- bf16 tier: per-sequence slots, the sink pages first, then a ring of hot pages.
- fp8 tier: per-sequence ring of warm pages, one scale per token per head.
- int4 tier: a shared pool of cold pages, reached through a page table; each pool
  page also holds the key digest (per-channel range as centre and radius).
Tier membership is a function of the sequence length only (see `slot_positions`),
so nothing but `seq_lens` records it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from hisparse_jax import backends
from hisparse_jax.config import HiSparseConfig
from pallas_kernels.quant import FP8_DTYPE, decode_fp8
from pallas_kernels.quant import reference as quant_ref


@struct.dataclass
class CacheState:
    bf16_k: jax.Array        # [B, Hkv, Tb, D] bf16: sink slots, then the hot ring
    bf16_v: jax.Array        # [B, Hkv, Tb, D] bf16
    fp8_k: jax.Array         # [B, Hkv, Tw, D] float8_e4m3fn: warm ring
    fp8_v: jax.Array         # [B, Hkv, Tw, D] float8_e4m3fn
    fp8_k_scale: jax.Array   # [B, Hkv, Tw] f32
    fp8_v_scale: jax.Array   # [B, Hkv, Tw] f32
    # Cold pool, head-major (a KV head's pages are contiguous: shards over heads,
    # and one GPU program per (sequence, head) reads one slab).
    int4_k: jax.Array        # [Hkv, P, page, D/2] uint8: keys per channel per page
    int4_v: jax.Array        # [Hkv, P, page, D/2] uint8: values per token in groups
    int4_v_scale: jax.Array  # [Hkv, P, page, D/group] bf16
    int4_v_zero: jax.Array   # [Hkv, P, page, D/group] bf16
    # The page digest: per-channel key range as centre and radius (Quest's bound
    # and the int4 key grid at once); the radius is rounded up to e4m3.
    digest_center: jax.Array  # [Hkv, P, D] bf16
    digest_radius: jax.Array  # [Hkv, P, D] float8_e4m3fn
    page_table: jax.Array    # [B, max_pages] int32: logical page -> pool page, -1 if not cold
    seq_lens: jax.Array      # [B] int32
    free_pages: jax.Array    # [P] int32: stack of free pool pages, top at num_free - 1
    num_free: jax.Array      # [] int32
    refcount: jax.Array      # [P] int32: page tables pointing at the page + 1 if a prefix
                             #   index holds it; a page is freed when this reaches 0
    last_selected: jax.Array  # [B, Hkv, max_pages] bool: the cold pages the last decode
                              #   step selected (`attention.remember`, cfg.sticky_nats)
    poisoned: jax.Array      # [B] bool: the sequence took a non-finite K or V value; its
                             #   attention outputs are NaN until release (never a silent
                             #   wrong answer: a NaN key would otherwise drop its page)


def init_state(cfg: HiSparseConfig) -> CacheState:
    b, h, d, pg = cfg.max_seqs, cfg.num_kv_heads, cfg.head_dim, cfg.page_size
    tb = (cfg.sink_pages + cfg.hot_pages) * pg
    tw = cfg.warm_pages * pg
    p = cfg.pool_pages
    ng = d // cfg.value_group
    z = jnp.zeros
    return CacheState(
        bf16_k=z((b, h, tb, d), jnp.bfloat16), bf16_v=z((b, h, tb, d), jnp.bfloat16),
        fp8_k=z((b, h, tw, d), FP8_DTYPE), fp8_v=z((b, h, tw, d), FP8_DTYPE),
        fp8_k_scale=z((b, h, tw), jnp.float32), fp8_v_scale=z((b, h, tw), jnp.float32),
        int4_k=z((h, p, pg, d // 2), jnp.uint8), int4_v=z((h, p, pg, d // 2), jnp.uint8),
        int4_v_scale=z((h, p, pg, ng), jnp.bfloat16), int4_v_zero=z((h, p, pg, ng), jnp.bfloat16),
        digest_center=z((h, p, d), jnp.bfloat16), digest_radius=z((h, p, d), FP8_DTYPE),
        page_table=jnp.full((b, cfg.max_pages), -1, jnp.int32),
        seq_lens=z((b,), jnp.int32),
        free_pages=jnp.arange(p - 1, -1, -1, dtype=jnp.int32),  # page 0 popped first
        num_free=jnp.array(p, jnp.int32),
        refcount=z((p,), jnp.int32),
        last_selected=z((b, h, cfg.max_pages), bool),
        poisoned=z((b,), bool),
    )


# ---------------------------------------------------------------- tier geometry

def slot_positions(cfg: HiSparseConfig, seq_lens: jax.Array):
    """Token position held by every bf16 and fp8 slot, -1 where the slot is not live.

    seq_lens [B] -> (bf16_pos [B, Tb], fp8_pos [B, Tw]) int32.
    Hot pages are the newest `hot_pages` pages (the last one may be partial); warm
    pages the `warm_pages` before them; both rings index pages from the first page
    after the sink, so a page keeps its slot while it stays in a tier.
    """
    pg, s, h, w = cfg.page_size, cfg.sink_pages, cfg.hot_pages, cfg.warm_pages
    L = seq_lens[:, None]
    last = (L - 1) // pg  # page of the newest token (-1 when empty)
    sink_pos = jnp.arange(s * pg)[None, :]
    sink_pos = jnp.where(sink_pos < L, sink_pos, -1)

    r, o = jnp.arange(h * pg) // pg, jnp.arange(h * pg) % pg
    hot_page = last - jnp.mod(last - s - r[None, :], h)
    hot_pos = hot_page * pg + o[None, :]
    hot_pos = jnp.where((hot_page >= s) & (hot_pos < L), hot_pos, -1)

    r, o = jnp.arange(w * pg) // pg, jnp.arange(w * pg) % pg
    top = last - h  # newest warm page
    warm_page = top - jnp.mod(top - s - r[None, :], max(w, 1))
    warm_pos = jnp.where(warm_page >= s, warm_page * pg + o[None, :], -1)
    return (jnp.concatenate([sink_pos, hot_pos], axis=1).astype(jnp.int32),
            warm_pos.astype(jnp.int32))


def num_cold_pages(cfg: HiSparseConfig, length):
    """Cold pages of a sequence of `length` tokens (numpy or jax ints)."""
    last = (length - 1) // cfg.page_size
    n = last - cfg.hot_pages - cfg.warm_pages - cfg.sink_pages + 1
    return n * (n > 0)


# ---------------------------------------------------------------- prefill

def _encoders(implementation, cfg: HiSparseConfig):
    """(encode_fp8, encode_cold_keys, encode_cold_values): Pallas kernels or the
    references (bit-identical; tests/test_kernels.py)."""
    return backends.kernel("tier_encoders", backends.resolve("tier_encoders", implementation,
                                                             cfg=cfg))()


@backends.register("tier_encoders", "xla")
def _reference_encoders():
    return quant_ref.encode_fp8, quant_ref.encode_cold_keys, quant_ref.encode_cold_values


@backends.register("tier_encoders", "pallas", why_not=backends.pallas_why_not)
def _pallas_encoders():
    from pallas_kernels.quant import kernel
    return kernel.encode_fp8, kernel.encode_cold_keys, kernel.encode_cold_values


# What offload mode stores per cold page (the digest stays on the device).
OFFLOAD_FIELDS = ("int4_k", "int4_v", "int4_v_scale", "int4_v_zero")
# The fields with a sequence axis (first, or second in a layer-stacked state); the
# others are the pool's and the free stack's, shared by every sequence.
SLOT_FIELDS = ("bf16_k", "bf16_v", "fp8_k", "fp8_v", "fp8_k_scale", "fp8_v_scale",
               "page_table", "seq_lens", "last_selected", "poisoned")


def decode_widths(max_seqs: int) -> list[int]:
    """The slot counts a decode program over slots 0..n-1 is compiled for: 1, 2, 4,
    8, ... up to max_seqs (one program each). A slot's numbers are the same at
    every width (a request served alone equals it served in a batch): XLA:CPU
    sums a row in an order that depends on the number of rows, so every sum over
    a sequence's own axis takes a form that does not
    (`sparse_decode.reference.row_sum`; the model pads its matmuls and norms;
    docs/log/serving.md, "Decode width", measures what one request saves)."""
    out, w = [], 1
    while w < max_seqs:
        out.append(w)
        w *= 2
    return out + [max_seqs]


def decode_width(max_seqs: int, top: int) -> int:
    """The narrowest of `decode_widths` that covers slots 0..top-1: a step that
    computes only those costs what a few slots need, not what max_seqs does."""
    return next(w for w in decode_widths(max_seqs) if w >= top)


# The window's tiers: the "cpu" window kernel reads the first n slots of a wider
# layer-stacked state in place, so a narrow step need not copy them (`first_slots`'
# keep: 4 slices and 4 updates; docs/log/code-timings.md, "window fields").
WINDOW_FIELDS = ("bf16_k", "bf16_v", "fp8_k", "fp8_v", "fp8_k_scale", "fp8_v_scale")


def first_slots(cfg: HiSparseConfig, state: CacheState, n: int, axis: int = 0,
                keep: tuple[str, ...] = ()):
    """(cfg, state) of slots 0..n-1 alone, for a step that computes only those
    (`decode_width`): their slot fields copied out, the pool shared; the fields in
    `keep` stay whole (every slot; their readers and writers index the first n).
    axis: the sequence axis of the slot fields (1 in a layer-stacked state).
    `put_first_slots` writes them back."""
    if n >= cfg.max_seqs:
        return cfg, state
    first = (slice(None),) * axis + (slice(0, n),)
    return (first_slots_config(cfg, n),
            state.replace(**{f: getattr(state, f)[first] for f in SLOT_FIELDS
                             if f not in keep}))


def first_slots_config(cfg: HiSparseConfig, n: int) -> HiSparseConfig:
    """`first_slots`' config: n slots over the same pool."""
    return cfg if n >= cfg.max_seqs else cfg.replace(max_seqs=n, num_pool_pages=cfg.pool_pages)


def put_first_slots(full: CacheState, part: CacheState, axis: int = 0) -> CacheState:
    """`part` (from `first_slots(.., full, n, axis)`, then stepped) with the other
    slots' fields of `full`: the whole state again."""
    n = part.seq_lens.shape[axis]
    if n == full.seq_lens.shape[axis]:
        return part
    first = (slice(None),) * axis + (slice(0, n),)
    return part.replace(**{f: getattr(full, f).at[first].set(getattr(part, f))
                           for f in SLOT_FIELDS
                           if getattr(part, f).shape != getattr(full, f).shape})


def _encode_cold(cfg, k_pages, v_pages, implementation):
    """Whole pages [n, Hkv, page, D] (f32) -> their pool codes {int4_k, int4_v,
    int4_v_scale, int4_v_zero, digest_center, digest_radius}, each [n, Hkv, ...]."""
    _, encode_cold_keys, encode_cold_values = _encoders(implementation, cfg)
    # the pages materialized first: fused into the encoders' loops, their transpose
    # from token order was redone per code (most of a long prompt's fill time:
    # benchmarks/prefill_fill.py)
    k_pages, v_pages = jax.lax.optimization_barrier((k_pages, v_pages))
    kq, center, radius = encode_cold_keys(k_pages)
    vq, vs, vz = encode_cold_values(v_pages, cfg.value_group)
    return {"int4_k": kq, "int4_v": vq, "int4_v_scale": vs, "int4_v_zero": vz,
            "digest_center": center, "digest_radius": radius}


def _write_cold(stacked, pool_ids, codes, layer):
    """Codes [n, Hkv, ...] (`_encode_cold`) into pool pages `pool_ids` [n] (entries
    >= pool size are dropped) of layer `layer` of a stacked state."""
    return stacked.replace(**{f: _put(getattr(stacked, f), (layer, slice(None), pool_ids), val)
                              for f, val in codes.items()})  # indexed as [n, Hkv, ...]


def _put(a, idx, val):
    """a.at[idx].set(val) in a's dtype, out-of-range entries dropped (fp8 values
    into a stored, uint8 array as their bytes)."""
    if a.dtype == jnp.uint8 and val.dtype == FP8_DTYPE:
        val = jax.lax.bitcast_convert_type(val, jnp.uint8)
    return a.at[idx].set(val.astype(a.dtype), mode="drop")


@functools.partial(jax.jit, static_argnums=0, static_argnames="implementation",
                   donate_argnums=1)
def prefill(cfg: HiSparseConfig, state: CacheState, seq: jax.Array, k: jax.Array,
            v: jax.Array, length: jax.Array, shared: jax.Array | None = None, *,
            implementation=None) -> CacheState:
    """Fill the empty sequence `seq` with the first `length` tokens of k, v.
    See `_prefill`."""
    return _prefill(cfg, state, seq, k, v, length, shared, implementation)[0]


@functools.partial(jax.jit, static_argnums=0, static_argnames="implementation",
                   donate_argnums=1)
def prefill_offload(cfg: HiSparseConfig, state: CacheState, seq: jax.Array, k: jax.Array,
                    v: jax.Array, length: jax.Array, shared: jax.Array | None = None, *,
                    implementation=None):
    """`prefill` for a state whose int4 pool lives elsewhere (offload mode): also
    returns the new cold pages for the caller to store.

    returns (state, pool_ids [T/page] int32 (>= pool size where the page is not a
             new cold page), {int4_k, int4_v, int4_v_scale, int4_v_zero}: [T/page, Hkv, page, ...])
    """
    return _prefill(cfg, state, seq, k, v, length, shared, implementation)


def _prefill(cfg, state, seq, k, v, length, shared, implementation):
    """`prefill_layer` on a single state, without its release (the sequence is
    empty, or its caller loaded the free stack: the bridge). -> (state, pool ids [T/page] (pool size: not a new cold page), the
    new cold codes {OFFLOAD_FIELDS: [T/page, Hkv, ...]})."""
    stacked = stored(jax.tree.map(lambda a: a[None], state))
    stacked, pool_ids, cold = prefill_layer(cfg, stacked, jnp.int32(0), seq, k, v, length,
                                            shared, release_first=False,
                                            implementation=implementation)
    return live(cfg, jax.tree.map(lambda a: a[0], stacked)), pool_ids, cold


def _prefill_rows(cfg, free_pages, num_free, refcount, k, v, length, shared, implementation):
    """An empty sequence filled with the first `length` tokens of k, v, as values to
    write: its row of every SLOT_FIELDS array, the pool's refcount and free count
    after it, and its new cold pages (pool ids [T/page], pool size where none;
    codes and digests {field: [T/page, Hkv, ...]}).

    k, v: [T, Hkv, D] with T a multiple of page_size (padding after `length` is
    ignored, whatever it holds). Every page goes straight to its final tier,
    encoded from the bf16 source. shared [T/page] int32: a pool page already
    holding that logical page (an equal prefix), -1 = none; a shared cold page is
    referenced, not copied. New cold pages pop the free stack (free_pages,
    num_free).
    """
    pg, s = cfg.page_size, cfg.sink_pages
    t = k.shape[0]
    npg = t // pg
    tok_valid = jnp.arange(t) < length
    poisoned = ~(jnp.all(jnp.isfinite(k) | ~tok_valid[:, None, None])
                 & jnp.all(jnp.isfinite(v) | ~tok_valid[:, None, None]))
    k = jnp.where(tok_valid[:, None, None], k.astype(jnp.float32), 0.0)
    v = jnp.where(tok_valid[:, None, None], v.astype(jnp.float32), 0.0)
    # [npg, Hkv, page, D]
    k_pages = k.reshape(npg, pg, *k.shape[1:]).transpose(0, 2, 1, 3)
    v_pages = v.reshape(npg, pg, *v.shape[1:]).transpose(0, 2, 1, 3)
    flat_k = k.transpose(1, 0, 2)  # [Hkv, T, D]
    flat_v = v.transpose(1, 0, 2)

    bf16_pos, fp8_pos = slot_positions(cfg, length[None])
    bf16_pos, fp8_pos = bf16_pos[0], fp8_pos[0]

    def gather(x, pos):  # [Hkv, T, D] at positions (invalid -> 0)
        return jnp.where((pos >= 0)[None, :, None], x[:, jnp.clip(pos, 0, t - 1)], 0.0)

    encode_fp8 = _encoders(implementation, cfg)[0]
    fk, fks = encode_fp8(gather(flat_k, fp8_pos))
    fv, fvs = encode_fp8(gather(flat_v, fp8_pos))

    n_cold = num_cold_pages(cfg, length)
    j = jnp.arange(npg) - s
    is_cold = (j >= 0) & (j < n_cold)
    if shared is None:
        shared = jnp.full((npg,), -1, jnp.int32)
    is_shared = is_cold & (shared >= 0)
    is_new = is_cold & ~is_shared
    rank = jnp.cumsum(is_new) - 1  # rank of page among newly stored cold pages
    pool_ids = jnp.where(is_new, free_pages[jnp.clip(num_free - 1 - rank, 0)], cfg.pool_pages)
    row = jnp.where(is_shared, shared, jnp.where(is_new, pool_ids, -1)).astype(jnp.int32)
    rows = {
        "bf16_k": gather(flat_k, bf16_pos).astype(jnp.bfloat16),
        "bf16_v": gather(flat_v, bf16_pos).astype(jnp.bfloat16),
        "fp8_k": fk, "fp8_v": fv, "fp8_k_scale": fks, "fp8_v_scale": fvs,
        "page_table": jnp.full((cfg.max_pages,), -1, jnp.int32).at[jnp.arange(npg)].set(
            row, mode="drop"),
        "seq_lens": length, "last_selected": jnp.zeros((cfg.num_kv_heads, cfg.max_pages), bool),
        "poisoned": poisoned}
    refcount = refcount.at[jnp.where(row >= 0, row, cfg.pool_pages)].add(1, mode="drop")
    return (rows, refcount, num_free - jnp.sum(is_new).astype(jnp.int32),
            pool_ids.astype(jnp.int32), _encode_cold(cfg, k_pages, v_pages, implementation))


# ---------------------------------------------------------------- decode append

@functools.partial(jax.jit, static_argnums=0, static_argnames="implementation",
                   donate_argnums=1)
def append_token(cfg: HiSparseConfig, state: CacheState, k: jax.Array, v: jax.Array,
                 active: jax.Array, *, implementation=None) -> CacheState:
    """Append one token to every active sequence. k, v: [B, Hkv, D]; active: [B] bool.

    When the new token opens a page, the oldest hot page moves to warm (fp8 encode)
    and the oldest warm page to cold (int4 encode of the fp8 data, into a pool page
    popped from the free stack). The caller checks that the pool has room.
    """
    return _append_token(cfg, state, k, v, active, implementation)[0]


@functools.partial(jax.jit, static_argnums=0, static_argnames="implementation",
                   donate_argnums=1)
def append_token_offload(cfg: HiSparseConfig, state: CacheState, k: jax.Array, v: jax.Array,
                         active: jax.Array, *, implementation=None):
    """`append_token` for a state whose int4 pool lives elsewhere (offload mode):
    also returns the pages that became cold, for the caller to store.

    returns (state, pool_ids [B] int32 (>= pool size where no page became cold),
             {int4_k, int4_v, int4_v_scale, int4_v_zero}: [B, Hkv, page, ...])
    """
    return _append_token(cfg, state, k, v, active, implementation)


def _append_token(cfg, state, k, v, active, implementation):
    """`append_layer` on a single state."""
    stacked = stored(jax.tree.map(lambda a: a[None], state))
    stacked, pool_ids, new_cold = append_layer(cfg, stacked, jnp.int32(0), k, v, active,
                                               implementation=implementation)
    return live(cfg, jax.tree.map(lambda a: a[0], stacked)), pool_ids, new_cold


def append_layer(cfg: HiSparseConfig, stacked: CacheState, layer, k, v, active, *,
                 implementation=None):
    """`append_token_offload` on layer `layer` of a layer-stacked state (`init_stacked`),
    written in place: every write indexes the stacked arrays.

    When the new token opens a page, the oldest hot page moves to warm (fp8 encode)
    and the oldest warm page to cold (int4 encode of the fp8 data, into a pool page
    popped from the free stack). Both encodings run every step, for every sequence,
    and are written only where a page moves: two pages per sequence cost less than
    a branch, which passes the whole state through.
    returns (stacked, pool_ids [B] (pool size: no new cold page), the new cold
    codes {OFFLOAD_FIELDS}: [B, Hkv, page, ...], meaningful where pool_ids is not).
    """
    pg, s, h, w = cfg.page_size, cfg.sink_pages, cfg.hot_pages, cfg.warm_pages
    l = layer
    nb = stacked.seq_lens.shape[1]
    b = jnp.arange(nb)
    pos = stacked.seq_lens[l]
    page, off = pos // pg, pos % pg
    leave_hot = active & (off == 0) & (page - h >= s)        # page - h: hot -> warm
    leave_warm = leave_hot & (page - h - w >= s)             # page - h - w: warm -> cold
    hot_base = s * pg + jnp.mod(page - s, h) * pg            # ring slot of `page` (== of page - h)
    rows = lambda base: base[:, None] + jnp.arange(pg)       # [B, pg]: a page's ring slots

    def read_page(a, base):  # a [L, B, Hkv, T, ...] -> layer l's page [B, Hkv, pg, ...]
        x = jnp.swapaxes(a[l, b[:, None], :, rows(base)], 1, 2)
        return jax.lax.bitcast_convert_type(x, FP8_DTYPE) if x.dtype == jnp.uint8 else x

    out_k = read_page(stacked.bf16_k, hot_base).astype(jnp.float32)
    out_v = read_page(stacked.bf16_v, hot_base).astype(jnp.float32)
    if w:  # the cold page comes from the warm ring, re-encoded from fp8
        warm_base = jnp.mod(page - h - s, w) * pg
        old_k = decode_fp8(read_page(stacked.fp8_k, warm_base),
                           read_page(stacked.fp8_k_scale, warm_base))
        old_v = decode_fp8(read_page(stacked.fp8_v, warm_base),
                           read_page(stacked.fp8_v_scale, warm_base))
    else:  # or, without warm, from bf16
        old_k, old_v = out_k, out_v
    rank = jnp.cumsum(leave_warm) - 1
    free_top = stacked.num_free[l] - 1 - rank
    pool_ids = jnp.where(leave_warm, stacked.free_pages[l, jnp.clip(free_top, 0)],
                         cfg.pool_pages).astype(jnp.int32)
    cold = _encode_cold(cfg, old_k, old_v, implementation)
    warm = ()
    if w:
        encode_fp8 = _encoders(implementation, cfg)[0]
        warm = (*encode_fp8(out_k), *encode_fp8(out_v))
    # Every read above before any write below: a write into an array that is still
    # to be read makes XLA copy the array first.
    (cold, warm), stacked = jax.lax.optimization_barrier(((cold, warm), stacked))

    stacked = _write_cold(stacked, pool_ids, cold, l)
    if w:  # hot page -> warm ring slot of that page; indexed as [B, pg, Hkv, ...]
        at = (l, b[:, None], slice(None),
              jnp.where(leave_hot[:, None], rows(warm_base), w * pg))
        fk, fks, fv, fvs = (jnp.swapaxes(x, 1, 2) for x in warm)
        stacked = stacked.replace(
            fp8_k=_put(stacked.fp8_k, at, fk), fp8_v=_put(stacked.fp8_v, at, fv),
            fp8_k_scale=_put(stacked.fp8_k_scale, at, fks),
            fp8_v_scale=_put(stacked.fp8_v_scale, at, fvs))
    cold_page = jnp.where(leave_warm, page - h - w, cfg.max_pages)

    # The new token: a sink slot or its hot ring slot (inactive: dropped).
    slot = jnp.where(page < s, pos, hot_base + off)
    slot = jnp.where(active, slot, stacked.bf16_k.shape[3])
    at = (l, b, slice(None), slot)  # indexed as [B, Hkv, D]
    finite = jnp.all(jnp.isfinite(k), axis=(1, 2)) & jnp.all(jnp.isfinite(v), axis=(1, 2))
    stacked = stacked.replace(
        bf16_k=_put(stacked.bf16_k, at, k), bf16_v=_put(stacked.bf16_v, at, v),
        page_table=_put(stacked.page_table, (l, b, cold_page), pool_ids),
        refcount=_put(stacked.refcount, (l, pool_ids), jnp.ones(nb, jnp.int32)),
        num_free=stacked.num_free.at[l].add(-jnp.sum(leave_warm).astype(jnp.int32)),
        poisoned=stacked.poisoned.at[l].set(stacked.poisoned[l] | (active & ~finite)),
        seq_lens=stacked.seq_lens.at[l].add(active.astype(jnp.int32)))
    return stacked, pool_ids, {f: cold[f] for f in OFFLOAD_FIELDS}


def prefill_layer(cfg: HiSparseConfig, stacked: CacheState, layer, seq, k, v, length,
                  shared=None, *, release_first=True, implementation=None):
    """`release` (unless `release_first` is False: the slot is empty) then
    `prefill_offload` of sequence `seq` on layer `layer` of a layer-stacked state,
    written in place: the pool only at the prompt's new cold
    pages, the other arrays only at `seq`'s rows and the layer's free stack and
    refcounts (`prefill_plain` rewrites whole arrays: 6-9x the time of this for a
    short prompt, `benchmarks/prefill_fill.py`). Runs inside the caller's program
    (a model's layer loop). -> (stacked, pool_ids [T/page], the new cold codes {OFFLOAD_FIELDS}:
    [T/page, Hkv, ...]), as `prefill_offload`."""
    l = layer
    refcount, free_pages, num_free = (stacked.refcount[l], stacked.free_pages[l],
                                      stacked.num_free[l])
    if release_first:
        refcount, free_pages, num_free = _unref_arrays(cfg, refcount, free_pages, num_free,
                                                       stacked.page_table[l, seq])
    rows, refcount, num_free, pool_ids, cold = _prefill_rows(
        cfg, free_pages, num_free, refcount, k, v, length, shared, implementation)
    # every read of `stacked` above before the writes below (else XLA copies it)
    (rows, refcount, free_pages, num_free, pool_ids, cold), stacked = (
        jax.lax.optimization_barrier(((rows, refcount, free_pages, num_free, pool_ids, cold),
                                      stacked)))
    stacked = _write_cold(stacked, pool_ids, cold, l)
    return (stacked.replace(refcount=stacked.refcount.at[l].set(refcount),
                            free_pages=stacked.free_pages.at[l].set(free_pages),
                            num_free=stacked.num_free.at[l].set(num_free),
                            **{f: _put(getattr(stacked, f), (l, seq), x)
                               for f, x in rows.items()}),
            pool_ids, {f: cold[f] for f in OFFLOAD_FIELDS})


def prefill_plain(cfg: HiSparseConfig, state: CacheState, seq, k, v, length, shared=None):
    """`release` then `prefill_offload` on a single state, written with plain
    `.at[...].set`: how the fill was done before `prefill_layer` (whole arrays
    rewritten, and a row written into a float8 array converts all of it on
    XLA:CPU). The reference `prefill_layer` is tested (`tests/test_stacked.py`)
    and measured (`benchmarks/prefill_fill.py`) against."""
    state = release(cfg, state, seq)
    rows, refcount, num_free, pool_ids, cold = _prefill_rows(
        cfg, state.free_pages, state.num_free, state.refcount, k, v, length, shared, None)
    pool = {f: getattr(state, f).at[:, pool_ids].set(jnp.swapaxes(x, 0, 1), mode="drop")
            for f, x in cold.items()}
    state = state.replace(refcount=refcount, num_free=num_free, **pool,
                          **{f: getattr(state, f).at[seq].set(x) for f, x in rows.items()})
    return state, pool_ids, {f: cold[f] for f in OFFLOAD_FIELDS}


# ---------------------------------------------------------------- release

def _unref(cfg, state, pages):
    """Drop one reference to each pool page in `pages` [n] (-1 = skip; no repeats);
    pages left with none go back on the free stack."""
    refcount, free_pages, num_free = _unref_arrays(cfg, state.refcount, state.free_pages,
                                                   state.num_free, pages)
    return state.replace(refcount=refcount, free_pages=free_pages, num_free=num_free)


def _unref_arrays(cfg, refcount, free_pages, num_free, pages):
    """`_unref` on the three arrays it changes."""
    idx = jnp.where(pages >= 0, pages, cfg.pool_pages)
    refcount = refcount.at[idx].add(-1, mode="drop")
    freed = (pages >= 0) & (refcount[jnp.maximum(pages, 0)] == 0)
    rank = jnp.cumsum(freed) - 1
    dest = jnp.where(freed, num_free + rank, cfg.pool_pages)
    return (refcount, free_pages.at[dest].set(pages, mode="drop"),
            num_free + jnp.sum(freed).astype(jnp.int32))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def release(cfg: HiSparseConfig, state: CacheState, seq: jax.Array) -> CacheState:
    """Empty sequence `seq`: drop its page references (pages nobody else holds are
    freed)."""
    state = _unref(cfg, state, state.page_table[seq])
    return state.replace(page_table=state.page_table.at[seq].set(-1),
                         seq_lens=state.seq_lens.at[seq].set(0),
                         last_selected=state.last_selected.at[seq].set(False),
                         poisoned=state.poisoned.at[seq].set(False))


def release_layer(cfg: HiSparseConfig, stacked: CacheState, layer, seq) -> CacheState:
    """`release` of sequence `seq` on layer `layer` of a layer-stacked state, in
    place (the pool untouched)."""
    l = layer
    refcount, free_pages, num_free = _unref_arrays(
        cfg, stacked.refcount[l], stacked.free_pages[l], stacked.num_free[l],
        stacked.page_table[l, seq])
    return stacked.replace(refcount=stacked.refcount.at[l].set(refcount),
                           free_pages=stacked.free_pages.at[l].set(free_pages),
                           num_free=stacked.num_free.at[l].set(num_free),
                           page_table=stacked.page_table.at[l, seq].set(-1),
                           seq_lens=stacked.seq_lens.at[l, seq].set(0),
                           last_selected=stacked.last_selected.at[l, seq].set(False),
                           poisoned=stacked.poisoned.at[l, seq].set(False))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def retain_pages(cfg: HiSparseConfig, state: CacheState, pages: jax.Array) -> CacheState:
    """One more reference (a prefix index's) to each pool page in `pages` [n] (-1 = skip)."""
    idx = jnp.where(pages >= 0, pages, cfg.pool_pages)
    return state.replace(refcount=state.refcount.at[idx].add(1, mode="drop"))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def drop_pages(cfg: HiSparseConfig, state: CacheState, pages: jax.Array) -> CacheState:
    """Release references taken by `retain_pages` (pages [n], -1 = skip, no repeats)."""
    return _unref(cfg, state, pages)


# ---------------------------------------------------------------- moving the hot/warm boundary

def check_retier(old: HiSparseConfig, new: HiSparseConfig):
    """`retier` moves only the hot/warm boundary: everything else must match."""
    same = old.replace(hot_tokens=new.hot_tokens, warm_tokens=new.warm_tokens,
                       budget_tokens=new.budget_tokens)
    if same != new:
        raise ValueError("retier changes hot_tokens/warm_tokens (and budget_tokens) only")
    if new.hot_tokens > old.hot_tokens:
        raise ValueError(f"retier shrinks the hot window: {old.hot_tokens} -> "
                         f"{new.hot_tokens} tokens would need tokens fp8 no longer has in bf16")
    if new.hot_tokens + new.warm_tokens != old.hot_tokens + old.warm_tokens:
        raise ValueError("retier keeps the cold boundary: hot_tokens + warm_tokens must stay "
                         f"{old.hot_tokens + old.warm_tokens}, got "
                         f"{new.hot_tokens + new.warm_tokens}")


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames="implementation")
def retier(old: HiSparseConfig, new: HiSparseConfig, state: CacheState, *,
           implementation=None) -> CacheState:
    """The same sequences laid out for `new` (a smaller hot window, the warm tier
    grown by as much): tokens leaving the hot window are fp8-encoded from their bf16
    values, exactly as a decode append moves them, so the result equals a cache
    that ran under `new` all along. Cold pages, digests and page tables are not
    touched. `check_retier(old, new)` must hold."""
    bf16_old, fp8_old = slot_positions(old, state.seq_lens)   # [B, Tb], [B, Tw]
    bf16_new, fp8_new = slot_positions(new, state.seq_lens)

    def source(pos_new, pos_old):  # slot of each new position in an old ring, -1 if absent
        match = (pos_new[:, :, None] == pos_old[:, None, :]) & (pos_new[:, :, None] >= 0)
        return jnp.where(jnp.any(match, -1), jnp.argmax(match, -1), -1)

    def take(x, slots):  # x [B, Hkv, T, ...] at slots [B, T'] (-1 -> 0)
        idx = jnp.maximum(slots, 0)[:, None, :]
        idx = idx.reshape(idx.shape + (1,) * (x.ndim - 3))
        got = jnp.take_along_axis(x, idx, axis=2)
        return jnp.where((slots >= 0).reshape(slots.shape[0], 1, -1, *(1,) * (x.ndim - 3)),
                         got, jnp.zeros((), x.dtype))

    from_bf16 = source(bf16_new, bf16_old)
    from_fp8 = source(fp8_new, fp8_old)
    demoted = source(fp8_new, bf16_old)        # warm now, hot before: encode
    encode_fp8 = _encoders(implementation, new)[0]
    enc_k, enc_ks = encode_fp8(take(state.bf16_k, demoted).astype(jnp.float32))
    enc_v, enc_vs = encode_fp8(take(state.bf16_v, demoted).astype(jnp.float32))
    use_enc = (demoted >= 0)[:, None, :]

    def warm(codes, scales, enc, enc_s):
        kept, kept_s = take(codes, from_fp8), take(scales, from_fp8)
        return (jnp.where(use_enc[..., None], enc, kept),
                jnp.where(use_enc, enc_s, kept_s))

    fk, fks = warm(state.fp8_k, state.fp8_k_scale, enc_k, enc_ks)
    fv, fvs = warm(state.fp8_v, state.fp8_v_scale, enc_v, enc_vs)
    return state.replace(bf16_k=take(state.bf16_k, from_bf16),
                         bf16_v=take(state.bf16_v, from_bf16),
                         fp8_k=fk, fp8_v=fv, fp8_k_scale=fks, fp8_v_scale=fvs)
# ---------------------------------------------------------------- layer-stacked states

# A model keeps one state per layer, stacked on a leading layer axis, and updates
# layer l in place inside its layer loop: every write below indexes the stacked
# arrays at [l, ...], because a write into a layer's slice, or a per-layer state
# passed through the loop, copies that layer's whole pool (the cold pool is most
# of the cache; docs/log/code-timings.md, "pool copies"). The stacked form keeps
# fp8 arrays as uint8, the same bytes: XLA:CPU writes into a float8 array by
# converting all of it.

def stored(state: CacheState) -> CacheState:
    """`state` with its fp8 arrays as uint8 (the layer-stacked form's dtypes)."""
    return jax.tree.map(lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8)
                        if a.dtype == FP8_DTYPE else a, state)


def live(cfg: HiSparseConfig, state: CacheState) -> CacheState:
    """`stored`'s inverse: every array back to `init_state`'s dtype."""
    ref = jax.eval_shape(lambda: init_state(cfg))
    return jax.tree.map(lambda a, r: a if a.dtype == r.dtype
                        else jax.lax.bitcast_convert_type(a, r.dtype), state, ref)


@functools.partial(jax.jit, static_argnums=(0, 1))
def init_stacked(cfg: HiSparseConfig, layers: int) -> CacheState:
    """`layers` empty states stacked on a leading axis (stored form)."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (layers, *a.shape)).copy(),
                        stored(init_state(cfg)))


def layer_view(cfg: HiSparseConfig, stacked: CacheState, layer) -> CacheState:
    """Layer `layer` of a stacked state, as a state (for reading)."""
    return live(cfg, jax.tree.map(lambda a: a[layer], stacked))


def set_layer(stacked: CacheState, layer, state: CacheState) -> CacheState:
    """Write a whole state into layer `layer`. It copies the layer's pool: the
    engine writes in place instead (`append_layer`, `prefill_layer`); this is what
    they are measured and tested against (`decode_profile.py --state-loop`,
    `test_layer_loop_appends_in_place`)."""
    return jax.tree.map(lambda a, s: a.at[layer].set(s), stacked, stored(state))
