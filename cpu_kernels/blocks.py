"""A GGUF file's quantized weights, kept in their 32-weight blocks for the decode
step's products (`ops.matmul_blocks`, cpu_kernels/matmul.cc's `Blocks`).

A decode step's weight products read every weight once for a few rows: on this
CPU their time is the bytes read. SmolLM2's GGUF holds its matrices as Q4_1
(20 bytes per 32 weights) and its embedding as Q8_0 (34), against 64 in bf16. The
kernel dequantizes each 16-row by 32-input tile exactly as the loader does
(`dequantize`: float32, then rounded to bf16), so its products are bit-equal to
the bf16 model's.

Layout ("tiles"), for a matrix of N rows (outputs) by K inputs, N % 16 == 0 and
K % 32 == 0: codes u8 [N / 16, K / 32, R, 32] and scales f16 [N / 16, K / 32, S,
16 rows], so that one 16 x 32 tile's blocks are contiguous:
- Q4_1: R 8 row pairs, byte k holding weight k of the pair's first row in its low
  nibble and of its second row in its high one (so that the kernel unpacks a pair
  with one mask and one shift); S 2 (d, then m): weight = d * code + m;
- Q8_0: R 16 rows of 32 signed bytes; S 1 (d): weight = d * code.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# GGUF type -> (code bytes per block, scales per block); a block's bytes in the
# file: the scales (f16) first, then the codes
FORMATS = {"Q4_1": (16, 2), "Q8_0": (32, 1)}


def tileable(kind: str, shape: tuple[int, ...]) -> bool:
    """Whether a GGUF tensor of this type and [rows, inputs] shape can be tiled."""
    return kind in FORMATS and len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % 32 == 0


def tile(raw: np.ndarray, kind: str, rows: int, inputs: int,
         row_order: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A GGUF tensor's raw blocks (u8, `rows` rows of `inputs` weights, as
    gguf.GGUFReader gives them) -> (codes, scales) in the tile layout. row_order:
    the rows to take, in order (e.g. the Q/K rows' un-permutation)."""
    nbytes, nscales = FORMATS[kind]
    blocks = np.ascontiguousarray(raw).reshape(rows, inputs // 32, 2 * nscales + nbytes)
    if row_order is not None:
        blocks = blocks[row_order]
    scales = blocks[..., :2 * nscales].copy().view(np.float16)  # [N, C, S]
    codes = blocks[..., 2 * nscales:]                             # [N, C, B]
    g, c = rows // 16, inputs // 32
    if kind == "Q4_1":  # GGUF: byte j holds weight j (low nibble) and 16 + j (high)
        codes = np.concatenate([codes & 15, codes >> 4], axis=-1)  # [N, C, 32] codes
        codes = codes.reshape(g, 8, 2, c, 32)
        codes = (codes[:, :, 0] | codes[:, :, 1] << 4).transpose(0, 2, 1, 3)
    else:
        codes = codes.reshape(g, 16, c, nbytes).transpose(0, 2, 1, 3)
    scales = scales.reshape(g, 16, c, nscales).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(codes), np.ascontiguousarray(scales)


def dequantize(codes, scales) -> jnp.ndarray:
    """Tiles [..., N / 16, K / 32, R, 32] and [..., N / 16, K / 32, S, 16] -> the
    weights [..., N, K] in bf16, as the GGUF loader makes them (gguf.quants'
    float32 values, rounded to bf16)."""
    codes, scales = jnp.asarray(codes), jnp.asarray(scales)
    *lead, g, c, pairs, _ = codes.shape
    d = scales[..., 0, :].astype(jnp.float32)[..., None]  # [..., G, C, 16, 1]
    if pairs == 8:  # Q4_1
        q = jnp.stack([codes & 15, codes >> 4], axis=-2).reshape(*lead, g, c, 16, 32)
        w = d * q.astype(jnp.float32) + scales[..., 1, :].astype(jnp.float32)[..., None]
    else:  # Q8_0
        w = d * codes.view(jnp.int8).astype(jnp.float32)
    w = jnp.swapaxes(w, -3, -2)  # [..., G, 16, C, 32]
    return w.reshape(*lead, g * 16, c * 32).astype(jnp.bfloat16)
