"""Hashed-key lookup as a Pallas (Triton backend) kernel: digest scores of every
candidate page, same signature and semantics as `reference.page_scores`.

Grid (batch, kv head, page block). Each program loads `block_pages` entries of
the page table, gathers the matching digest rows straight from the pools
(`ref[rows]`, no copy of the pool), and writes the Quest bound and the centre
score, both combined over the GQA group by log-sum-exp. Non-candidates
(page_table < 0) get -inf; their (clamped) digest reads never reach the output
because they are removed with `where`.

The q.digest products are done as broadcast-multiply-reduce in f32 (one query
row at a time): exact f32 like the reference, no `tl.dot` M >= 16 constraint,
and the digest gather, not the arithmetic, is what costs here.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def resolve_interpret(interpret):
    """None -> interpret unless running on a GPU."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    return bool(interpret)


@dataclasses.dataclass(frozen=True)
class LookupConfig:
    """Tuning knobs of the lookup kernel (validated when built).

    block_pages: page-table entries per program (power of two: it is a tile dim).
    num_warps, num_stages: Triton launch parameters.
    """
    block_pages: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if not _is_pow2(self.block_pages):
            raise ValueError(f"block_pages must be a power of two, got {self.block_pages}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be in 1..8, got {self.num_stages}")

    @staticmethod
    def default(num_pages: int, head_dim: int, group: int) -> "LookupConfig":
        # 64 pages x D channels x 2 pools of bf16 is 32 KiB per program at D=128:
        # enough bytes in flight per SM; fewer pages when the table is short so
        # that no program is mostly padding. Wide heads with big groups keep
        # 4 warps (one [pages, D] f32 tile live per query row).
        bp = min(64, _pow2_ceil(max(num_pages, 1)))
        bp = max(bp, 16)
        return LookupConfig(block_pages=bp, num_warps=4, num_stages=2)


def _lookup_kernel(q_ref, pt_ref, dmin_ref, dmax_ref, bound_ref, center_ref, *,
                   group, num_kv_heads, head_dim, block_pages):
    # q_ref:      [G, D] f32       (this (b, h))
    # pt_ref:     [BN] int32       page-table entries of this block, -1 = none
    # dmin_ref:   [P * Hkv, D] bf16  whole pool (memory_space=ANY), row = page*Hkv + h
    # dmax_ref:   [P * Hkv, D] bf16
    # bound_ref, center_ref: [BN] f32
    h = pl.program_id(1)
    ids = pt_ref[...]                                   # [BN]
    ok = ids >= 0
    rows = jnp.maximum(ids, 0) * num_kv_heads + h       # [BN]
    lo = dmin_ref[rows, :].astype(jnp.float32)          # [BN, D]
    hi = dmax_ref[rows, :].astype(jnp.float32)
    mid = (hi + lo) * 0.5
    rad = (hi - lo) * 0.5
    inv = 1.0 / math.sqrt(head_dim)
    bounds, centers = [], []
    for g in range(group):                              # static, G <= 16 in practice
        qg = q_ref[g, :] * inv                          # [D]
        c = jnp.sum(qg[None, :] * mid, axis=1)          # [BN]
        r = jnp.sum(jnp.abs(qg)[None, :] * rad, axis=1)
        centers.append(c)
        bounds.append(c + r)

    def lse(xs):  # jax.nn.logsumexp over the group, written out
        m = xs[0]
        for x in xs[1:]:
            m = jnp.maximum(m, x)
        m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
        s = jnp.exp(xs[0] - m_safe)
        for x in xs[1:]:
            s = s + jnp.exp(x - m_safe)
        return jnp.log(s) + m_safe

    bound_ref[...] = jnp.where(ok, lse(bounds), -jnp.inf)
    center_ref[...] = jnp.where(ok, lse(centers), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def page_scores(q: jax.Array, digest_min: jax.Array, digest_max: jax.Array,
                page_table: jax.Array, *, interpret=None,
                config: LookupConfig | None = None) -> tuple[jax.Array, jax.Array]:
    """Pallas version of `reference.page_scores` (same arguments, same results).

    q:          [B, Hkv, G, D] float
    digest_min: [P, Hkv, D] bf16
    digest_max: [P, Hkv, D] bf16
    page_table: [B, N] int32, -1 = not a candidate
    returns     (bound, center), each [B, Hkv, N] float32, -inf for non-candidates
    interpret:  None = interpret mode unless on GPU.
    config:     LookupConfig, None = `LookupConfig.default(...)`.
    """
    interpret = resolve_interpret(interpret)
    b, hkv, g, d = q.shape
    p = digest_min.shape[0]
    n = page_table.shape[1]
    if not _is_pow2(d):
        raise ValueError(f"head_dim must be a power of two, got {d}")
    if n == 0:
        empty = jnp.zeros((b, hkv, 0), jnp.float32)
        return empty, empty
    cfg = config or LookupConfig.default(n, d, g)
    bn = cfg.block_pages
    n_pad = -(-n // bn) * bn
    pt = page_table.astype(jnp.int32)
    if n_pad != n:
        pt = jnp.pad(pt, ((0, 0), (0, n_pad - n)), constant_values=-1)
    kernel = functools.partial(_lookup_kernel, group=g, num_kv_heads=hkv, head_dim=d,
                               block_pages=bn)
    out_shape = jax.ShapeDtypeStruct((b, hkv, n_pad), jnp.float32)
    bound, center = pl.pallas_call(
        kernel,
        grid=(b, hkv, n_pad // bn),
        in_specs=[
            pl.BlockSpec((None, None, g, d), lambda i, j, k: (i, j, 0, 0)),
            pl.BlockSpec((None, bn), lambda i, j, k: (i, k)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=[
            pl.BlockSpec((None, None, bn), lambda i, j, k: (i, j, k)),
            pl.BlockSpec((None, None, bn), lambda i, j, k: (i, j, k)),
        ],
        out_shape=[out_shape, out_shape],
        interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=cfg.num_warps,
                                            num_stages=cfg.num_stages),
        name="hisparse_page_scores",
    )(q.astype(jnp.float32), pt, digest_min.reshape(p * hkv, d),
      digest_max.reshape(p * hkv, d))
    return bound[:, :, :n], center[:, :, :n]
