"""Engine: a model, one KV cache per layer for `max_seqs` slots, and the two jitted
programs that run it: `prefill` (one slot's prompt) and `decode_step` (one token
for every active slot).

attention="hisparse": one `CacheState` per layer (stacked on a leading layer
axis). Prefill attention is exact (`causal_prefill_attention`) and fills the
cache (`state.prefill`); decode appends the new token (`state.append_token`)
and attends sparsely (`attention.decode_step`).
attention="dense": the same model with exact attention over a plain bf16 KV
cache of the same tokens (the baseline).

A decode step is one jitted program for all layers and slots (a `lax.scan` over
the layers, no host sync inside); the caches are donated, so XLA updates them in
place. The only host sync is reading the sampled tokens back.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax import attention as att
from hisparse_jax import layout
from hisparse_jax import state as st
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.models.llama import Llama
from hisparse_jax.models.sampling import GREEDY, SamplingParams, sample
from hisparse_jax.validate import check_bool_mask, check_int, check_token_ids
from pallas_kernels.quant import FP8_DTYPE

ATTENTIONS = ("hisparse", "dense")
PREFILL_CHUNK = 512  # causal_prefill_attention's query/key block


def prefill_length(n: int) -> int:
    """Padded prompt length: 64, 128, 256, 512, then whole chunks, so a handful of
    programs serve every prompt length (each costs a 10-20 s compile here)."""
    if n <= PREFILL_CHUNK:
        return max(64, 1 << (n - 1).bit_length())
    return -(-n // PREFILL_CHUNK) * PREFILL_CHUNK


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


# The layer-stacked HiSparse state keeps its fp8 arrays as uint8 (the same bytes):
# XLA:CPU updates a float8 array in a loop by converting all of it, every layer's
# slice each layer (a decode step at batch 8 took 3.0 s, as uint8 0.3-0.5 s).
def _stored(state: st.CacheState) -> st.CacheState:
    return jax.tree.map(lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8)
                        if a.dtype == FP8_DTYPE else a, state)


def _live(cfg: HiSparseConfig, state: st.CacheState) -> st.CacheState:
    """`_stored`'s inverse: every array back to `init_state`'s dtype."""
    ref = jax.eval_shape(lambda: st.init_state(cfg))
    return jax.tree.map(lambda a, r: a if a.dtype == r.dtype
                        else jax.lax.bitcast_convert_type(a, r.dtype), state, ref)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _init_hisparse(cfg: HiSparseConfig, layers: int):
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (layers, *a.shape)).copy(),
                        _stored(st.init_state(cfg)))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _release(cfg: HiSparseConfig, caches, slot):
    return jax.vmap(lambda s: _stored(st.release(cfg, _live(cfg, s), slot)))(caches)


@functools.partial(jax.jit, static_argnames=("graphdef", "hcfg", "implementation"),
                   donate_argnames="caches")
def _prefill(params, caches, slot, ids, length, samp, *, graphdef, hcfg, implementation):
    """One slot's prompt ids [Tp] (the first `length` real, the rest padding) ->
    (first generated token [], its logits [V], caches)."""
    model = nnx.merge(graphdef, params)
    t = ids.shape[0]
    chunk = min(t, PREFILL_CHUNK)

    def attend(cache, q, k, v):
        # Exact attention over the K/V as the cache stores them (bf16), so that a
        # decode step gives what a prefill one token longer would (a bf16 rounding
        # of K/V alone moves SmolLM2's logits by up to 0.3).
        k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
        out = att.causal_prefill_attention(q, k, v, chunk=chunk)
        if hcfg is None:  # dense: [B, Hkv, S, D] pair; write the first min(T, S) tokens
            kc, vc = cache
            n = min(t, kc.shape[2])
            put = lambda c, x: jax.lax.dynamic_update_slice(
                c, x[:n].transpose(1, 0, 2)[None].astype(c.dtype), (slot, 0, 0, 0))
            return out, (put(kc, k), put(vc, v))
        cache = st.release(hcfg, _live(hcfg, cache), slot)
        return out, _stored(st.prefill(hcfg, cache, slot, k, v, length,
                                       implementation=implementation))

    x, caches = model.layers(model.embed_tokens(ids), jnp.arange(t), caches, attend)
    logits = model.logits(x[length - 1][None])
    tok = sample(logits, length[None], *(a[None] for a in samp))
    return tok[0], logits[0], caches


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _prefill_kv(hcfg: HiSparseConfig, caches, slot, k, v, length):
    """Fill `slot` of every layer's cache from K/V [L, T, Hkv, D] (bf16)."""
    def one(cache, k, v):
        cache = st.release(hcfg, _live(hcfg, cache), slot)
        return _stored(st.prefill(hcfg, cache, slot, k, v, length))
    return jax.vmap(one)(caches, k, v)


@functools.partial(jax.jit, static_argnames=("graphdef", "hcfg", "implementation"),
                   donate_argnames="caches")
def _decode(params, caches, tokens, lens, active, samp, *, graphdef, hcfg, implementation):
    """tokens [B] at positions lens [B] (active [B] slots) -> (next tokens [B],
    logits [B, V], caches)."""
    model = nnx.merge(graphdef, params)
    b = tokens.shape[0]

    def attend(cache, q, k, v):
        if hcfg is None:
            kc, vc = cache
            at = jnp.where(active, lens, kc.shape[2])  # inactive slots: dropped
            kc = kc.at[jnp.arange(b), :, at].set(k.astype(kc.dtype), mode="drop")
            vc = vc.at[jnp.arange(b), :, at].set(v.astype(vc.dtype), mode="drop")
            return dense_attention(q, kc, vc, lens + active), (kc, vc)
        cache = st.append_token(hcfg, _live(hcfg, cache), k, v, active,
                                implementation=implementation)
        out, _, cache = att.decode_step(hcfg, cache, q, implementation=implementation)
        return out, _stored(cache)

    x, caches = model.layers(model.embed_tokens(tokens), lens, caches, attend)
    logits = model.logits(x)
    return sample(logits, lens + 1, *samp), logits, caches


# ---------------------------------------------------------------- the engine

class Engine:
    """Slots 0..max_seqs-1, each a sequence in the caches.

    `prefill(slot, ids, sampling)` fills a slot with a prompt and returns the first
    generated token; `decode_step(active)` appends every active slot's last token
    and returns the next ones. The host mirrors each slot's length (`lens`), so
    checks need no device round trip.
    """

    def __init__(self, model: Llama, *, max_seqs: int = 1, max_context: int | None = None,
                 attention: str = "hisparse", budget_tokens: int = 2048,
                 cache_overrides: dict | None = None, implementation=None):
        if attention not in ATTENTIONS:
            raise ValueError(f"attention={attention!r}: choose from {ATTENTIONS}")
        mc = model.cfg
        if max_context is None:
            max_context = mc.max_position
        max_context = check_int("max_context", max_context, minimum=1)
        max_seqs = check_int("max_seqs", max_seqs, minimum=1)
        self.model = model
        self.attention = attention
        self.max_seqs, self.max_context = max_seqs, max_context
        self.implementation = implementation
        self.graphdef, self.params = nnx.split(model)
        layers = mc.num_layers
        if attention == "hisparse":
            self.cache_cfg = HiSparseConfig(
                num_kv_heads=mc.num_kv_heads, gqa_group=mc.group, head_dim=mc.head_dim,
                max_context=-(-max_context // 16) * 16, max_seqs=max_seqs,
                budget_tokens=budget_tokens, **(cache_overrides or {}))
            self.caches = _init_hisparse(self.cache_cfg, layers)
        else:
            if cache_overrides:
                raise ValueError("cache_overrides apply to attention='hisparse' only")
            self.cache_cfg = None
            shape = (layers, max_seqs, mc.num_kv_heads, max_context, mc.head_dim)
            self.caches = (jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16))
        self.lens = np.zeros(max_seqs, np.int32)
        self.tokens = np.zeros(max_seqs, np.int32)  # each slot's last token (next input)
        self.sampling = [GREEDY] * max_seqs
        self.logits = None  # the last program's logits (device array)

    def _static(self):
        return {"graphdef": self.graphdef, "hcfg": self.cache_cfg,
                "implementation": self.implementation}

    def _samp(self, slots):
        ps = [self.sampling[s] for s in slots]
        return (jnp.asarray([p.temperature for p in ps], jnp.float32),
                jnp.asarray([p.top_k for p in ps], jnp.int32),
                jnp.asarray([p.top_p for p in ps], jnp.float32),
                jnp.asarray([p.seed for p in ps], jnp.uint32))

    def _check_slot(self, slot) -> int:
        return check_int("slot", slot, minimum=0, maximum=self.max_seqs - 1)

    def prefill(self, slot: int, ids, sampling: SamplingParams = GREEDY) -> int:
        """Empty `slot` and fill it with prompt `ids`; returns the first generated
        token (the logits are left in `self.logits`, shape [V])."""
        slot = self._check_slot(slot)
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
        self.sampling[slot] = sampling
        padded = np.zeros(prefill_length(n), np.int32)
        padded[:n] = ids
        tok, self.logits, self.caches = _prefill(
            self.params, self.caches, jnp.int32(slot), jnp.asarray(padded), jnp.int32(n),
            tuple(a[0] for a in self._samp([slot])), **self._static())
        self.lens[slot] = n
        self.tokens[slot] = int(tok)
        return int(tok)

    def kv(self, slot: int) -> tuple[jax.Array, jax.Array]:
        """A dense engine's K/V of `slot`'s tokens: two [L, n, Hkv, D] bf16 arrays
        (what `prefill_kv` takes), so one exact prefill can seed several caches."""
        slot = self._check_slot(slot)
        if self.cache_cfg is not None:
            raise ValueError("kv() reads a dense engine's cache (attention='dense')")
        n = int(self.lens[slot])
        return tuple(c[:, slot, :, :n].transpose(0, 2, 1, 3) for c in self.caches)

    def prefill_kv(self, slot: int, k, v, next_token: int,
                   sampling: SamplingParams = GREEDY):
        """Fill `slot` with a prompt whose K/V [L, n, Hkv, D] were computed elsewhere
        (another engine's exact prefill: `kv`); `next_token` is the token that
        prefill sampled, the next decode step's input. Equal to `prefill` on the
        same prompt, without running the model."""
        slot = self._check_slot(slot)
        if self.cache_cfg is None:
            raise ValueError("prefill_kv fills a HiSparse cache (attention='hisparse')")
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
        pad = prefill_length(n) - n
        pad_to = lambda x: jnp.pad(jnp.asarray(x, jnp.bfloat16), ((0, 0), (0, pad), (0, 0),
                                                                   (0, 0)))
        self.caches = _prefill_kv(self.cache_cfg, self.caches, jnp.int32(slot), pad_to(k),
                                  pad_to(v), jnp.int32(n))
        self.sampling[slot] = sampling
        self.lens[slot] = n
        self.tokens[slot] = next_token

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
        nxt, self.logits, self.caches = _decode(
            self.params, self.caches, jnp.asarray(self.tokens), jnp.asarray(self.lens),
            jnp.asarray(active), self._samp(range(self.max_seqs)), **self._static())
        nxt = np.asarray(nxt)
        self.tokens = np.where(active, nxt, self.tokens).astype(np.int32)
        self.lens = self.lens + active
        return self.tokens.copy()

    def release(self, slot: int):
        """Empty `slot` (a HiSparse cache frees its cold pages)."""
        slot = self._check_slot(slot)
        if self.cache_cfg is not None:
            self.caches = _release(self.cache_cfg, self.caches, jnp.int32(slot))
        self.lens[slot] = 0

    def room(self, slot: int) -> int:
        """Tokens slot `slot` can still take."""
        return self.max_context - int(self.lens[slot])

    def capacity_line(self) -> str:
        layers = self.model.cfg.num_layers
        if self.cache_cfg is not None:
            return f"{layout.summary_line(self.cache_cfg)} per layer, {layers} layers"
        nbytes = sum(c.size * c.dtype.itemsize for c in self.caches)
        return f"dense bf16 KV cache: device {nbytes / 2**20:.1f} MiB, {layers} layers"

    def warmup(self, prompt_len: int = 16) -> float:
        """Compile prefill (for prompts of `prompt_len`'s padded length) and decode;
        returns seconds. Leaves slot 0 empty."""
        t = time.perf_counter()
        self.prefill(0, np.zeros(min(prompt_len, self.max_context - 1), np.int64))
        self.decode_step(np.arange(self.max_seqs) == 0)
        self.release(0)
        return time.perf_counter() - t
