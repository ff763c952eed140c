"""Byte accounting from the layout alone (DESIGN §3): every array the cache holds.

`state_bytes` counts a cache sized for `max_seqs` sequences of `max_context`
tokens; tests check it equals the summed nbytes of a real `init_state`, so no
array can be left out of the figures.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from hisparse_jax.config import HiSparseConfig

BF16, F32, I32, U8, FP8, BOOL = 2, 4, 4, 1, 1, 1


@dataclasses.dataclass(frozen=True)
class Bytes:
    """Bytes of one layer's cache, by part."""
    bf16_tier: int      # sink + hot K/V
    fp8_tier: int       # warm K/V + scales
    int4_tier: int      # cold K/V codes + value scales/zeros
    digests: int        # per-page key range (centre, radius)
    page_tables: int    # page table, lengths, free-page stack, page refcounts, last
                        # selection, poisoned flags
    host: int = 0       # bytes kept off the device (offload mode)

    @property
    def device(self) -> int:
        return self.bf16_tier + self.fp8_tier + self.int4_tier + self.digests + self.page_tables

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["device"] = self.device
        return d


def per_page_cold_bytes(cfg: HiSparseConfig) -> tuple[int, int]:
    """(int4 codes + value scales, digest) bytes of one pool page, all KV heads."""
    h, d, pg = cfg.num_kv_heads, cfg.head_dim, cfg.page_size
    codes = 2 * h * pg * (d // 2) * U8 + 2 * h * pg * (d // cfg.value_group) * BF16
    digest = h * d * (BF16 + FP8)  # bf16 centre, e4m3 radius
    return codes, digest


def state_bytes(cfg: HiSparseConfig) -> Bytes:
    """Bytes of `init_state(cfg)`: max_seqs sequences, a pool of `pool_pages` pages."""
    h, d, pg, b = cfg.num_kv_heads, cfg.head_dim, cfg.page_size, cfg.max_seqs
    tb = (cfg.sink_pages + cfg.hot_pages) * pg
    tw = cfg.warm_pages * pg
    codes, digest = per_page_cold_bytes(cfg)
    return Bytes(
        bf16_tier=2 * b * h * tb * d * BF16,
        fp8_tier=2 * b * h * tw * (d * FP8 + F32),
        int4_tier=cfg.pool_pages * codes,
        digests=cfg.pool_pages * digest,
        page_tables=b * cfg.max_pages * I32 + b * I32 + 2 * cfg.pool_pages * I32 + I32
        + b * h * cfg.max_pages * BOOL + b * BOOL)


def sequence_bytes(cfg: HiSparseConfig, context: int) -> Bytes:
    """Device bytes one sequence of `context` tokens needs (its share of the pool:
    exactly its cold pages; its own bf16/fp8 slots; its page-table row)."""
    from hisparse_jax.cache.state import num_cold_pages
    one = cfg.replace(max_seqs=1, max_context=max(cfg.page_size,
                                                  -(-context // cfg.page_size) * cfg.page_size),
                      num_pool_pages=max(1, int(num_cold_pages(cfg, context))))
    full = state_bytes(one)
    n_cold = int(num_cold_pages(cfg, context))
    codes, digest = per_page_cold_bytes(cfg)
    return dataclasses.replace(full, int4_tier=n_cold * codes, digests=n_cold * digest,
                               page_tables=one.max_pages * I32 + I32 + 2 * n_cold * I32
                               + cfg.num_kv_heads * one.max_pages * BOOL + BOOL)


def bf16_paged_bytes(cfg: HiSparseConfig, context: int) -> int:
    """A bf16 paged cache of the same shapes: K+V for every token, plus its page table."""
    pages = -(-context // cfg.page_size)
    return pages * cfg.page_size * cfg.num_kv_heads * 2 * cfg.head_dim * BF16 + pages * I32


def capacity_report(cfg: HiSparseConfig, context: int) -> dict:
    """Per-token bytes (per KV head) and the capacity multiple against bf16."""
    b = sequence_bytes(cfg, context)
    base = bf16_paged_bytes(cfg, context)
    per = context * cfg.num_kv_heads
    return {
        "context": context,
        "bytes": b.as_dict(),
        "device_bytes_per_token": b.device / per,
        "bf16_bytes_per_token": base / per,
        "capacity_vs_bf16": base / b.device,
    }


def nbytes(tree) -> int:
    import jax
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def summary_line(cfg: HiSparseConfig, device_bytes: int | None = None, host_bytes: int = 0) -> str:
    """The line logged when a cache is built, e.g. "HiSparse KV cache: 2.9x capacity
    vs bf16 (device 44.0 GiB, host 0.0 MiB)": a bf16 paged cache for the same
    sequences and context against the bytes this cache holds on the device."""
    device = state_bytes(cfg).device if device_bytes is None else device_bytes
    base = cfg.max_seqs * bf16_paged_bytes(cfg, cfg.max_context)
    return (f"HiSparse KV cache: {base / device:.1f}x capacity vs bf16 "
            f"(device {_gib(device)}, host {_gib(host_bytes)})")
