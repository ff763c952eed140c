"""Shared test helpers: an independent dequantized-cache reference."""

import jax.numpy as jnp
import numpy as np

from hisparse_jax.state import slot_positions
from pallas_kernels.quant import (
    decode_cold_keys,
    decode_cold_values,
    decode_fp8,
    encode_cold_keys,
    encode_cold_values,
    encode_fp8,
)


def dequantized_kv(cfg, k, v):
    """What a prefilled cache holds for k, v [S, Hkv, D], token by token (f32)."""
    s = k.shape[0]
    bf16_pos, fp8_pos = (np.asarray(x[0]) for x in slot_positions(cfg, jnp.array([s])))
    kh, vh = np.array(k, np.float32), np.array(v, np.float32)
    live_bf16 = bf16_pos[bf16_pos >= 0]
    live_fp8 = fp8_pos[fp8_pos >= 0]
    kh[live_bf16] = np.asarray(jnp.asarray(k[live_bf16]).astype(jnp.bfloat16), np.float32)
    vh[live_bf16] = np.asarray(jnp.asarray(v[live_bf16]).astype(jnp.bfloat16), np.float32)
    kh[live_fp8] = np.asarray(decode_fp8(*encode_fp8(jnp.asarray(k[live_fp8]))))
    vh[live_fp8] = np.asarray(decode_fp8(*encode_fp8(jnp.asarray(v[live_fp8]))))
    cold = np.ones(s, bool)
    cold[live_bf16] = False
    cold[live_fp8] = False
    pg = cfg.page_size
    for p in np.unique(np.flatnonzero(cold) // pg):
        sl = slice(p * pg, (p + 1) * pg)
        kp = jnp.asarray(k[sl]).transpose(1, 0, 2)  # [Hkv, pg, D]
        kh[sl] = np.asarray(decode_cold_keys(*encode_cold_keys(kp))).transpose(1, 0, 2)
        vh[sl] = np.asarray(decode_cold_values(*encode_cold_values(jnp.asarray(v[sl]),
                                                                   cfg.value_group)))
    return kh, vh, cold


def dense(q, k, v):
    """Exact attention, numpy: q [Hq, D], k/v [S, Hkv, D] -> [Hq, D]."""
    hq, d = q.shape
    g = hq // k.shape[1]
    out = np.empty((hq, d))
    for h in range(hq):
        lg = k[:, h // g] @ q[h] / np.sqrt(d)
        p = np.exp(lg - lg.max())
        out[h] = (p / p.sum()) @ v[:, h // g]
    return out
