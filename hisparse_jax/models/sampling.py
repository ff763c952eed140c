"""Next-token sampling on the device: greedy, temperature, top-k, top-p, seeded,
after a logit bias and presence and frequency penalties.

Each slot has its own parameters (arrays, so changing them does not recompile)
and its own random stream: the key of a draw is (seed, position of the drawn
token), so a request samples the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax.validate import is_int, is_number

MAX_PENALTY = 2.0     # OpenAI's range for presence and frequency penalties: [-2, 2]
MAX_LOGIT_BIAS = 100.0  # and for a logit bias: [-100, 100]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = no top-k; top_p 1 = no nucleus cut.
    presence_penalty / frequency_penalty: subtracted from the logit of every token
    already generated, once / per time (OpenAI's and vLLM's definition: the
    generated tokens, not the prompt's); logit_bias: {token id: added to its logit}
    (a dict or (id, bias) pairs; kept as sorted pairs)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        for name in ("presence_penalty", "frequency_penalty"):
            x = getattr(self, name)
            if not (is_number(x) and math.isfinite(x) and abs(x) <= MAX_PENALTY):
                raise ValueError(f"{name}={x!r}: must be a number in "
                                 f"[-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        bias = self.logit_bias
        pairs = list(bias.items() if isinstance(bias, dict) else bias)
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2 and is_int(pair[0])
                    and pair[0] >= 0 and is_number(pair[1]) and math.isfinite(pair[1])
                    and abs(pair[1]) <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias={bias!r}: must map token ids >= 0 to numbers "
                                 f"in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        object.__setattr__(self, "logit_bias",
                           tuple(sorted((int(i), float(b)) for i, b in pairs)))
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


class SlotSampling(NamedTuple):
    """A batch of slots' sampling parameters as arrays (`Engine` keeps bias and
    counts on the device): per slot [B] temperature, top_k, top_p, seed, presence
    and frequency penalties; [B, V] logit bias and how often each token has been
    generated so far (the penalties' counts)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    presence: jax.Array
    frequency: jax.Array
    bias: jax.Array
    counts: jax.Array


def slot_params(params: list[SamplingParams]) -> tuple:
    """The per-slot [B] fields of `SlotSampling` (host arrays), in its order."""
    return (np.asarray([p.temperature for p in params], np.float32),
            np.asarray([p.top_k for p in params], np.int32),
            np.asarray([p.top_p for p in params], np.float32),
            np.asarray([p.seed for p in params], np.uint32),
            np.asarray([p.presence_penalty for p in params], np.float32),
            np.asarray([p.frequency_penalty for p in params], np.float32))


def bias_row(params: SamplingParams, vocab: int) -> np.ndarray:
    """params' logit bias as a dense [V] row (ValueError for an id past the vocabulary)."""
    row = np.zeros(vocab, np.float32)
    for i, b in params.logit_bias:
        if i >= vocab:
            raise ValueError(f"logit_bias: token id {i} is not in the vocabulary [0, {vocab})")
        row[i] = b
    return row


def sample_slots(logits: jax.Array, positions: jax.Array, s: SlotSampling) -> jax.Array:
    """`sample` after each slot's logit bias and penalties: logits [B, V] + bias,
    less presence for every token generated so far and frequency per time
    (OpenAI's formula). The caller keeps the raw logits (logprobs report those)."""
    adjusted = (logits + s.bias - s.presence[:, None] * (s.counts > 0)
                - s.frequency[:, None] * s.counts)
    return sample(adjusted, positions, s.temperature, s.top_k, s.top_p, s.seed)


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
