"""Next-token sampling on the device: greedy, temperature, top-k, top-p, seeded.

Each slot has its own parameters (arrays, so changing them does not recompile)
and its own random stream: the key of a draw is (seed, position of the drawn
token), so a request samples the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from hisparse_jax.validate import is_int, is_number


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = no top-k; top_p 1 = no nucleus cut."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (is_number(self.temperature) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature!r}: must be a finite number >= 0")
        if not (is_int(self.top_k) and self.top_k >= 0):
            raise ValueError(f"top_k={self.top_k!r}: must be an int >= 0")
        if not (is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r}: must be a number in (0, 1]")
        if not (is_int(self.seed) and 0 <= self.seed < 2**32):
            raise ValueError(f"seed={self.seed!r}: must be an int in [0, 2**32)")

GREEDY = SamplingParams()


def sample(logits: jax.Array, positions: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array, seed: jax.Array) -> jax.Array:
    """logits [B, V] float32 -> next tokens [B] int32. Per slot: temperature,
    top_p [B] float32, top_k [B] int32, seed [B] uint32; positions [B] the
    position the drawn token will take. Slots with temperature 0 are greedy.
    One program for every mix of parameters: `lax.cond` skips the draw when all
    slots are greedy and the sort when no slot filters (top-k/top-p)."""
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(_):
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        filters = jnp.any(((top_k > 0) | (top_p < 1)) & (temperature > 0))
        scaled = jax.lax.cond(filters, _filter, lambda s, *_: s, scaled, top_k, top_p)

        def one(s, p, row):
            return jax.random.categorical(jax.random.fold_in(jax.random.key(s), p), row)

        drawn = jax.vmap(one)(seed, positions, scaled).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, best)

    return jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: best, None)


def _filter(scaled, top_k, top_p):
    """Scaled logits outside each row's top-k, then outside its top-p nucleus
    (HF's order), set to -inf. The best token always stays."""
    desc = -jnp.sort(-scaled, axis=-1)
    rank = jnp.arange(scaled.shape[-1])[None, :]
    desc = jnp.where((top_k[:, None] <= 0) | (rank < top_k[:, None]), desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]  # mass ranked above < p
    cutoff = jnp.min(jnp.where(keep & (desc > -jnp.inf), desc, jnp.inf), axis=-1)
    return jnp.where(scaled >= cutoff[:, None], scaled, -jnp.inf)
