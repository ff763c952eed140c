"""Hashed-key lookup as a Pallas (Triton backend) kernel: digest scores of every
candidate page, same signature and semantics as `reference.page_scores`.

Grid (batch, kv head, page block). Each program loads `block_pages` entries of
the page table, gathers the matching digest rows (centre c, radius r) straight
from the head-major pools (`ref[rows, :]`, no copy of a pool) and writes, per
query head of the group, the reference's two logits

    center = q.c            bound = q.c + |q|.r   (Quest's upper bound on q.k)

with q / sqrt(D) rounded to bf16 (as the reference) and products summed in f32
(broadcast-multiply-reduce, one query row at a time: exact bf16 products, no
tl.dot M >= 16 padding; the digest gather, not the arithmetic, is the cost).
Non-candidates (page_table < 0) are written as -inf; their clamped digest reads
are zeroed with `where`, so NaN in unused pool pages never reaches the output.

The bound is returned per query head, as the kernel writes it. The centre is
combined over the group in XLA on the [B, Hkv, G, N] logits with the
reference's formula: each head's centres become a softmax over all pages of the
row (which crosses page blocks) before the heads' shares are summed.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common import is_pow2, pow2_ceil, resolve_interpret


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
        if not is_pow2(self.block_pages):
            raise ValueError(f"block_pages must be a power of two, got {self.block_pages}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_stages must be in 1..8, got {self.num_stages}")

    @staticmethod
    def default(num_pages: int, head_dim: int, group: int) -> LookupConfig:
        # 64 pages x D channels x 2 pools of bf16 is 32 KiB per program at D=128:
        # enough bytes in flight per SM; fewer pages when the table is short so
        # that no program is mostly padding. Wide heads with big groups keep
        # 4 warps (one [pages, D] f32 tile live per query row).
        bp = min(64, pow2_ceil(max(num_pages, 1)))
        bp = max(bp, 16)
        return LookupConfig(block_pages=bp, num_warps=4, num_stages=2)


def _lookup_kernel(qc_ref, qa_ref, pt_ref, c_ref, r_ref, bound_ref, center_ref, *,
                   group, num_pages_pool):
    # qc_ref:   [G, D] f32      bf16(q / sqrt(D)) of this (b, h)
    # qa_ref:   [G, D] f32      bf16(|q| / sqrt(D))
    # pt_ref:   [BN] int32      page-table entries of this block, -1 = none
    # c_ref, r_ref: [Hkv * P, D] bf16 / e4m3  whole pools (memory_space=ANY), row = h*P + page
    # bound_ref, center_ref: [G, BN] f32  per query head, -inf for non-candidates
    h = pl.program_id(1)
    ids = pt_ref[...]                                       # [BN]
    ok = ids >= 0
    rows = h * num_pages_pool + jnp.maximum(ids, 0)         # [BN]
    c = jnp.where(ok[:, None], c_ref[rows, :].astype(jnp.float32), 0.0)  # [BN, D]
    r = jnp.where(ok[:, None], r_ref[rows, :].astype(jnp.float32), 0.0)
    for g in range(group):                                  # static: G is small
        cen = jnp.sum(qc_ref[g, :][None, :] * c, axis=1)    # [BN]
        bnd = cen + jnp.sum(qa_ref[g, :][None, :] * r, axis=1)
        center_ref[g, :] = jnp.where(ok, cen, -jnp.inf)
        bound_ref[g, :] = jnp.where(ok, bnd, -jnp.inf)


def group_spikes(x: jax.Array, ok: jax.Array) -> jax.Array:
    """[B, Hkv, G, N] per-head logits -> [B, Hkv, N]: log-sum-exp over the group
    (~ the group's largest logit), -inf for non-candidates (reference bound)."""
    return jnp.where(ok[:, None, :], jax.nn.logsumexp(x, axis=2), -jnp.inf)


def group_mass(x: jax.Array, ok: jax.Array) -> jax.Array:
    """[B, Hkv, G, N] per-head logits -> [B, Hkv, N] (reference center): each head's
    logits become a softmax over the pages (its mass shares), summed over the group."""
    x = jnp.where(ok[:, None, None, :], x, -jnp.inf)
    return group_spikes(x - jax.nn.logsumexp(x, axis=3, keepdims=True), ok)


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def page_scores(q: jax.Array, digest_center: jax.Array, digest_radius: jax.Array,
                page_table: jax.Array, *, interpret=None, config: LookupConfig | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """Pallas version of `reference.page_scores` (same arguments, same results).

    q:             [B, Hkv, G, D] float  (query heads grouped by their KV head)
    digest_center: [Hkv, P, D] bf16      per-channel key range centre of each pool page
    digest_radius: [Hkv, P, D] e4m3      ... and half-width
    page_table:    [B, N] int32          logical page -> pool page, -1 = not a candidate
    returns        bound [B, Hkv, G, N] (per query head) and center [B, Hkv, N]
                   (group mass) float32, -inf for non-candidates
    interpret:     None = interpret mode unless on GPU.
    config:        LookupConfig, None = `LookupConfig.default(...)`.
    """
    interpret = resolve_interpret(interpret)
    b, hkv, g, d = q.shape
    p = digest_center.shape[1]
    n = page_table.shape[1]
    if not is_pow2(d):
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
    # The reference's query rows: q / sqrt(D) rounded to bf16 (held in f32).
    qs = q.astype(jnp.float32) * (1.0 / math.sqrt(d))
    qc = qs.astype(jnp.bfloat16).astype(jnp.float32)
    qa = jnp.abs(qs).astype(jnp.bfloat16).astype(jnp.float32)
    kernel = functools.partial(_lookup_kernel, group=g, num_pages_pool=p)
    q_spec = pl.BlockSpec((None, None, g, d), lambda i, j, k: (i, j, 0, 0))
    out_spec = pl.BlockSpec((None, None, g, bn), lambda i, j, k: (i, j, 0, k))
    out_shape = jax.ShapeDtypeStruct((b, hkv, g, n_pad), jnp.float32)
    bound, center = pl.pallas_call(
        kernel,
        grid=(b, hkv, n_pad // bn),
        in_specs=[q_spec, q_spec,
                  pl.BlockSpec((None, bn), lambda i, j, k: (i, k)),
                  pl.BlockSpec(memory_space=pl.ANY),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[out_spec, out_spec],
        out_shape=[out_shape, out_shape],
        interpret=interpret,
        compiler_params=pltr.CompilerParams(num_warps=cfg.num_warps,
                                            num_stages=cfg.num_stages),
        name="hisparse_page_scores",
    )(qc, qa, pt, digest_center.reshape(hkv * p, d), digest_radius.reshape(hkv * p, d))
    ok = page_table >= 0
    return bound[..., :n], group_mass(center[..., :n], ok)
