"""Engine: a model and its KV cache for `max_seqs` slots, driven a batch at a
time: `prefill` (one slot's prompt; `prefill_batch` several short ones,
`prefill_chunk` one block of a long one) and `decode_step` (one token for every
active slot), with the sampling hooks (penalties, logit bias) and the slots'
bookkeeping on the host.

What the cache is and how a program uses it is the engine's `KVStrategy`
(`models/kv.py`, which also holds the jitted programs): attention="hisparse",
every layer's `CacheState` stacked on a leading layer axis (`HiSparseKV`);
attention="dense", the same model with exact attention over a plain bf16 KV
cache of the same tokens (the baseline, `DenseKV`); offload=True, HiSparse with
every layer's cold codes in host memory (`OffloadedKV`). Prefill attention is
exact (`attention.causal_block_attention`). A decode step is one jitted program
for all layers and slots, one loop over the layers (`Llama.layers`) whatever the
strategy; the caches are donated and carried through it, so XLA updates them in
place, and the only host sync is reading the sampled tokens back.

Prefix sharing and the cold pool's free count (HiSparse) are the host's
bookkeeping in `pages.PoolPages` (`pages.NoPool` for a dense cache): a prompt
that starts with an indexed prompt's tokens references its cold pages instead of
storing its own.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax import backends
from hisparse_jax.attention.exact import PREFILL_CHUNK
from hisparse_jax.cache import state as st
from hisparse_jax.cache.handle import CacheFullError
from hisparse_jax.config import HiSparseConfig, model_preset
from hisparse_jax.models import kv as programs
from hisparse_jax.models.kv import DenseKV, HiSparseKV, OffloadedKV, fill_length, prefill_length
from hisparse_jax.models.llama import Llama
from hisparse_jax.models.pages import NoPool, PoolPages
from hisparse_jax.models.sampling import (
    GREEDY,
    SamplingParams,
    SlotSampling,
    bias_row,
    slot_params,
)
from hisparse_jax.offload import policy as scheduler
from hisparse_jax.offload import store as off
from hisparse_jax.validate import check_bool_mask, check_int, check_token_ids, check_working_set

__all__ = ["ATTENTIONS", "PREFILL_CHUNK", "Engine", "fill_length", "model_cache_config",
           "prefill_length"]

ATTENTIONS = ("hisparse", "dense")


# ---------------------------------------------------------------- small programs

@functools.partial(jax.jit, donate_argnums=0)
def _write_stage(stage, k, v):
    """K/V [L, n, Hkv, D] into the staging buffer's first n positions."""
    return tuple(jax.lax.dynamic_update_slice_in_dim(s, x.astype(s.dtype), 0, 1)
                 for s, x in zip(stage, (k, v)))


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _reset_slot(bias, counts, slot, row):
    """A new sequence in `slot`: its logit bias row [V], no token generated yet."""
    return bias.at[slot].set(row), counts.at[slot].set(0)


@functools.partial(jax.jit, donate_argnums=0)
def _count_tokens(counts, slots, tokens, weights):
    """counts [S, V] += weights at (slots, tokens), each [k]."""
    return counts.at[slots, tokens].add(weights)


# ---------------------------------------------------------------- the engine

def model_cache_config(mc, max_context: int, max_seqs: int, budget_tokens: int,
                       overrides: dict | None = None) -> HiSparseConfig:
    """The cache config a model's engine runs (and the server's planner sizes):
    `config.model_preset` for the model's shapes."""
    return model_preset(num_kv_heads=mc.num_kv_heads, gqa_group=mc.group,
                        head_dim=mc.head_dim, max_context=max_context, max_seqs=max_seqs,
                        budget_tokens=budget_tokens, **(overrides or {}))


class Engine:
    """Slots 0..max_seqs-1, each a sequence in the caches.

    `prefill(slot, ids, sampling)` fills a slot with a prompt and returns the first
    generated token; `decode_step(active)` appends every active slot's last token
    and returns the next ones. The host mirrors each slot's length (`lens`), so
    checks need no device round trip. `prefill_chunk` runs a prompt block by block;
    up to `max_stages` slots can be in such a prefill at once, each holding a bf16
    K/V stage of max_context tokens (made on first use, kept for reuse).
    """

    def __init__(self, model: Llama, *, max_seqs: int = 1, max_context: int | None = None,
                 attention: str = "hisparse", budget_tokens: int = 2048,
                 cache_overrides: dict | None = None, implementation=None,
                 offload: bool = False, working_set: int | None = None,
                 policy: scheduler.Policy | None = None, max_stages: int = 1):
        if attention not in ATTENTIONS:
            raise ValueError(f"attention={attention!r}: choose from {ATTENTIONS}")
        if not isinstance(offload, bool):
            raise ValueError(f"offload must be a bool, got {offload!r}")  # noqa: TRY004
        if (offload or working_set is not None) and attention != "hisparse":
            raise ValueError("offload mode (and its working_set) needs attention='hisparse'")
        if (working_set is not None or policy is not None) and not offload:
            raise ValueError("working_set and policy are offload mode's: pass offload=True")
        if policy is not None and not isinstance(policy, scheduler.Policy):
            raise ValueError(f"policy must be a scheduler.Policy, got {policy!r}")
        mc = model.cfg
        if max_context is None:
            max_context = mc.max_position
        max_context = check_int("max_context", max_context, minimum=1)
        max_seqs = check_int("max_seqs", max_seqs, minimum=1)
        self.max_stages = check_int("max_stages", max_stages, minimum=1, maximum=max_seqs)
        self.model = model
        self.attention = attention
        self.max_seqs, self.max_context = max_seqs, max_context
        self.implementation = implementation
        self.prefill_implementation = backends.resolve("causal_attention", implementation,
                                                       head_dim=mc.head_dim)
        self.product_implementation = backends.resolve("weight_products", implementation)
        self.graphdef, self.params = nnx.split(model)
        layers = mc.num_layers
        self.cold = None  # offload mode: every layer's cold pools (LayerColdStores)
        if attention == "hisparse":
            self.cache_cfg = c = model_cache_config(mc, max_context, max_seqs, budget_tokens,
                                                    cache_overrides)
            device = jax.devices()[0]
            if offload:
                self.shardings = off.shardings(device)
                self.strategy = OffloadedKV(c, self.shardings)
            else:
                self.strategy = HiSparseKV(c)
            # committed to the device, as every later value is (one program per shape)
            self.caches = jax.device_put(self.strategy.init(layers), device)
            if offload:
                # as the capacity planner sizes it: 2x a step's candidates, never
                # more than a sequence's cold pages
                self.working_set = check_working_set(c.candidate_pages, min(
                    2 * c.candidate_pages, c._cold_pages) if working_set is None else working_set)
                self.cold = off.LayerColdStores.empty(c, layers, device, self.working_set, policy)
                # the device's int32 counters, moved here (int64) when read
                self.counted = np.zeros(len(scheduler.COUNTERS), np.int64)
                self.copied = np.zeros(3, np.int64)  # pages copied, rows moved, sampled
            self.pool = PoolPages(c, layers, lambda: self.caches, self._set_caches)
        else:
            if cache_overrides:
                raise ValueError("cache_overrides apply to attention='hisparse' only")
            self.cache_cfg, self.strategy = None, DenseKV()
            self.caches = self.strategy.init(layers, max_seqs, mc.num_kv_heads, max_context,
                                             mc.head_dim)
            self.pool = NoPool()
        self.lens = np.zeros(max_seqs, np.int32)
        self.tokens = np.zeros(max_seqs, np.int32)  # each slot's last token (next input)
        self.sampling = [GREEDY] * max_seqs
        # each slot's logit bias and generated-token counts, on the device (the penalties)
        vocab = model.cfg.vocab_size
        self.bias = jnp.zeros((max_seqs, vocab), jnp.float32)
        self.counts = jnp.zeros((max_seqs, vocab), jnp.float32)
        self.logits = None  # the last program's logits (device array)
        # chunked prefills in progress (prefill_chunk): slot -> [its bf16 K/V stage
        # (K, V) [L, S, Hkv, D], tokens staged so far], at most max_stages (oldest first)
        self._stages: dict[int, list] = {}
        self._spare: list = []    # stages no prefill holds (made on first use, reused)
        self._last = None         # the [stage, staged] a block last ran on (staged_kv)

    def _static(self):
        return {"graphdef": self.graphdef, "kv": self.strategy,
                "implementation": self.implementation, "products": self.product_implementation}

    @property
    def offload(self) -> bool:
        return self.cold is not None

    def _kv(self):
        """The caches as the programs take them (`KVStrategy.pack`)."""
        return self.strategy.pack(self.caches, self.cold)

    def _set_kv(self, caches):
        """A program's caches back into the engine's `caches` and `cold`."""
        self.caches, self.cold = self.strategy.unpack(caches)

    def _samp(self, slot: int | list[int] | None = None) -> SlotSampling:
        """The sampling arrays of every slot, of `slot` alone (a batch of one), or of
        a list of slots (in its order)."""
        if slot is None:
            return SlotSampling(*slot_params(self.sampling), self.bias, self.counts)
        slots = list(slot) if isinstance(slot, (list, tuple)) else [int(slot)]
        at = np.asarray(slots, np.int32)
        return SlotSampling(*slot_params([self.sampling[s] for s in slots]), self.bias[at],
                            self.counts[at])

    def _bias_row(self, sampling: SamplingParams) -> np.ndarray:
        """`sampling`'s logit bias as a [V] row; a caller makes it before it changes
        anything, so that a bad id (ValueError) leaves the engine as it was."""
        return bias_row(sampling, self.model.cfg.vocab_size)

    def _set_sampling(self, slot: int, sampling: SamplingParams, row: np.ndarray):
        """A new sequence's sampling in `slot`: its logit bias row, its counts emptied."""
        self.sampling[slot] = sampling
        self.bias, self.counts = _reset_slot(self.bias, self.counts, np.int32(slot), row)

    def _count(self, slots, tokens, weights):
        """The penalties' counts: each of `tokens` [k] generated once more in its slot."""
        self.counts = _count_tokens(self.counts, np.asarray(slots, np.int32), tokens,
                                    np.asarray(weights, np.float32))

    def _check_slot(self, slot) -> int:
        return check_int("slot", slot, minimum=0, maximum=self.max_seqs - 1)

    def _set_caches(self, caches):
        self.caches = caches

    @property
    def prefix(self):
        """The prefix index over prompts' cold pages (None: a dense cache)."""
        return self.pool.prefix

    @property
    def num_free(self) -> int:
        """Cold pool pages free per layer, as the host counts them."""
        return self.pool.num_free

    @property
    def evicted_pages(self) -> int:
        return self.pool.evicted_pages

    def hold_prefix(self, slot: int, ids, count: bool = False) -> int:
        """Reference, for `slot`'s coming prefill of prompt `ids`, the cold pages of
        the longest indexed prefix of `ids` (they cannot be evicted until the
        prefill or `release`); returns how many pages per layer it will share.
        The prefill holds again itself: a hold taken early (at admission) only
        makes sure those pages stay. The index's hit / miss counts move only with
        `count` (the prefill's own hold), once per prompt."""
        slot = self._check_slot(slot)
        return self.pool.hold_prefix(slot, ids, count, self._check_prompt)

    def _begin_fill(self, slot: int, ids, n: int, count: bool = True, taken: int = 0) -> int:
        """`PoolPages.begin_fill`: the new pages the prefill will take."""
        return self.pool.begin_fill(slot, ids, n, count, taken, self._check_prompt)

    def pin(self, slot: int, context_id: str):
        """Keep `slot`'s prompt pages indexed under `context_id` after its sequence
        ends (a prewarmed document), until `unpin`."""
        self.pool.pin(self._check_slot(slot), context_id)

    def unpin(self, context_id: str):
        """Let a pinned document's pages go (evicted when unused and the pool is short)."""
        self.pool.unpin(context_id)

    def pool_available(self) -> int:
        """Cold pool pages (per layer) free or held only by the prefix index's
        unused, unpinned entries (evicted on demand)."""
        return self.pool.available()

    def cached_pages(self) -> int:
        """Pool pages (per layer) that only unused, unpinned prefix entries hold."""
        return self.pool.cached_pages()

    def prefix_stats(self) -> dict[str, int]:
        """The prefix index's counts of prompt pages looked up (hits, misses,
        collisions), and of cold pool pages per layer: evicted, held pinned, held
        cached (unused)."""
        return self.pool.stats()

    def prefill(self, slot: int, ids, sampling: SamplingParams = GREEDY) -> int:
        """Empty `slot` and fill it with prompt `ids`; returns the first generated
        token (the logits are left in `self.logits`, shape [V])."""
        slot = self._check_slot(slot)
        ids = self._check_prompt(ids)
        n = ids.shape[0]
        row = self._bias_row(sampling)
        self._empty(slot)
        need = self._begin_fill(slot, ids, n)
        self._set_sampling(slot, sampling, row)
        padded = np.zeros(prefill_length(n), np.int32)
        padded[:n] = ids
        tok, self.logits, caches = programs.prefill(
            self.params, self._kv(), jnp.int32(slot), jnp.asarray(padded), jnp.int32(n),
            self.pool.shared(slot, len(padded)), self._samp(slot), **self._static(),
            prefill=self.prefill_implementation)
        self._set_kv(caches)
        self.pool.end_fill(slot, ids, need)
        self.lens[slot] = n
        self.tokens[slot] = int(tok)
        return int(tok)

    def prefill_batch(self, slots, prompts, samplings) -> list[int]:
        """`prefill` of several slots at once, one program: prompts of at most
        PREFILL_CHUNK tokens that pad to the same length (`prefill_length`). Each
        slot ends as `prefill` alone would leave it, bit for bit, first token and
        logits included (`self.logits` [B, V], in `slots`' order); what the batch
        saves is the fixed cost of a program per prompt (a 40-token prompt's
        weight products take a quarter of what eight such prompts' take together).
        Not in offload mode."""
        if not len(slots) == len(prompts) == len(samplings) >= 1:
            raise ValueError("prefill_batch: as many slots, prompts and samplings, at least one")
        slots = [self._check_slot(s) for s in slots]
        if len(set(slots)) != len(slots):
            raise ValueError(f"prefill_batch: slots {slots} repeat")
        prompts = [self._check_prompt(p) for p in prompts]
        if len(slots) == 1:
            return [self.prefill(slots[0], prompts[0], samplings[0])]
        if not self.strategy.batch_prefill:
            raise ValueError("prefill_batch: not in offload mode (prefill one prompt at a time)")
        lengths = [len(p) for p in prompts]
        t = prefill_length(lengths[0])
        if max(lengths) > PREFILL_CHUNK or any(prefill_length(n) != t for n in lengths):
            raise ValueError(f"prefill_batch: prompts of {lengths} tokens do not pad to one "
                             f"length of at most {PREFILL_CHUNK}")
        rows = [self._bias_row(s) for s in samplings]
        needs = []
        try:
            for slot, ids in zip(slots, prompts):
                self._empty(slot)
                needs.append(self._begin_fill(slot, ids, len(ids), taken=sum(needs)))
        except CacheFullError:
            for slot in slots:
                self.drop_hold(slot)
            raise
        for slot, sampling, row in zip(slots, samplings, rows):
            self._set_sampling(slot, sampling, row)
        padded = np.zeros((len(slots), t), np.int32)
        for i, ids in enumerate(prompts):
            padded[i, :len(ids)] = ids
        shared = self.pool.shared_batch(slots, t)
        toks, self.logits, caches = programs.prefill_batch(
            self.params, self._kv(), jnp.asarray(slots, jnp.int32), jnp.asarray(padded),
            jnp.asarray(lengths, jnp.int32), shared, self._samp(slots), **self._static(),
            prefill=self.prefill_implementation)
        self._set_kv(caches)
        toks = [int(x) for x in np.asarray(toks)]
        for slot, ids, need, tok in zip(slots, prompts, needs, toks):
            self.pool.end_fill(slot, ids, need)
            self.lens[slot] = len(ids)
            self.tokens[slot] = tok
        return toks

    def _check_prompt(self, ids) -> np.ndarray:
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
        return ids

    @staticmethod
    def prefill_blocks(n: int) -> int:
        """How many `prefill_chunk` calls a prompt of n tokens takes."""
        return 1 if n <= PREFILL_CHUNK else -(-n // PREFILL_CHUNK)

    @staticmethod
    def block_length(n: int, start: int) -> int:
        """Rows the `prefill_chunk` call at `start` of an n-token prompt computes:
        a whole block, or the last one padded as `prefill_length` pads (a 1,075-token
        prompt's last 51 tokens take 64 rows, not 512)."""
        return prefill_length(min(n - start, PREFILL_CHUNK))

    def prefill_chunk(self, slot: int, ids, start: int,
                      sampling: SamplingParams = GREEDY) -> int | None:
        """`prefill`, one block of PREFILL_CHUNK tokens per call, so that a caller
        can run decode steps between the blocks (the server's chunked prefill).
        Call with start = 0, PREFILL_CHUNK, 2 * PREFILL_CHUNK, ... (the whole
        prompt `ids` each time); after the last block the slot holds the prompt as
        after `prefill` and the first generated token is returned (None before).
        A prompt of one block is `prefill` itself. The blocks' K/V are staged in a
        bf16 buffer [L, S, Hkv, D] of the slot's own, so up to `max_stages` slots at
        a time are in a chunked prefill (start=0 on one more abandons the oldest);
        the HiSparse cache is filled once, from the whole prompt (as `prefill_kv`)."""
        slot = self._check_slot(slot)
        ids = self._check_prompt(ids)
        n = ids.shape[0]
        if n <= PREFILL_CHUNK:
            if start != 0:
                raise ValueError(f"start={start!r}: a prompt of {n} tokens is one block")
            return self.prefill(slot, ids, sampling)
        start = check_int("start", start, minimum=0, maximum=n - 1)
        row = self._bias_row(sampling)
        if start == 0:
            self._empty(slot)
            self._begin_fill(slot, ids, n, count=False)  # fails early if the pool is short
            self._open_stage(slot)
        elif self._stages.get(slot, [None, None])[1] != start:
            staged = {s: st_[1] for s, st_ in self._stages.items()}
            raise ValueError(f"prefill_chunk(slot={slot}, start={start}): the staged prompts "
                             f"(slot: tokens) are {staged}")
        entry = self._last = self._stages[slot]
        block = np.zeros(self.block_length(n, start), np.int32)
        real = ids[start:start + PREFILL_CHUNK]
        block[:len(real)] = real
        if start == 0 or self.sampling[slot] != sampling:
            self._set_sampling(slot, sampling, row)
        tok, self.logits, entry[0] = programs.prefill_chunk(
            self.params, entry[0], jnp.asarray(block), jnp.int32(start),
            jnp.int32(len(real) - 1), self._samp(slot), graphdef=self.graphdef,
            products=self.product_implementation, prefill=self.prefill_implementation)
        entry[1] = start + len(real)
        if entry[1] < n:
            return None
        # decode steps between the blocks may have taken pages (and other prompts
        # indexed theirs): hold and check again
        need = self._begin_fill(slot, ids, n)
        k, v = entry[0]
        t = self.strategy.fill_tokens(n, self.max_context, k.shape[1])
        self._fill(slot, k[:, :t], v[:, :t], n)
        self.pool.end_fill(slot, ids, need)
        self._close_stage(slot)
        self.lens[slot] = n
        self.tokens[slot] = int(tok)
        return int(tok)

    def _spare_stage(self):
        """A K/V stage no prefill holds (one sequence long; made on first use)."""
        if not self._spare:
            mc = self.model.cfg
            shape = (mc.num_layers, -(-self.max_context // PREFILL_CHUNK) * PREFILL_CHUNK,
                     mc.num_kv_heads, mc.head_dim)
            self._spare.append((jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)))
        return self._spare[-1]

    def _open_stage(self, slot: int) -> list:
        """Give `slot`'s chunked prefill a stage (0 tokens staged), abandoning the
        oldest other prefill if max_stages are in progress."""
        self._close_stage(slot)
        if len(self._stages) >= self.max_stages:
            self._close_stage(next(iter(self._stages)))
        self._spare_stage()
        self._stages[slot] = [self._spare.pop(), 0]
        return self._stages[slot]

    def _close_stage(self, slot: int):
        """`slot`'s prefill is done or abandoned: its stage is spare again (its K/V
        stays readable by `staged_kv` until a prefill takes it)."""
        entry = self._stages.pop(slot, None)
        if entry is not None:
            self._spare.append(entry[0])

    def stages_free(self) -> int:
        """How many more chunked prefills can start without abandoning one."""
        return self.max_stages - len(self._stages)

    def staged_kv(self, n: int) -> tuple[jax.Array, jax.Array]:
        """Copies of the staged K/V [L, n, Hkv, D] bf16 of the first n tokens of the
        chunked prefill that last ran a block (valid until the next chunked prefill
        starts): what `stage_kv` takes to skip those tokens' prefill next time
        (prefix reuse)."""
        n = check_int("n", n, minimum=1)
        staged = 0 if self._last is None else self._last[1]
        if n > staged:
            raise ValueError(f"staged_kv({n}): {staged} tokens are staged")
        return tuple(x[:, :n] for x in self._last[0])

    def stage_kv(self, slot: int, k, v):
        """Begin a chunked prefill of `slot` with its prompt's first n tokens already
        computed: k, v [L, n, Hkv, D] from `staged_kv` of a prompt with the same
        first n tokens (n a multiple of PREFILL_CHUNK). Continue with
        prefill_chunk(slot, ids, start=n): the result is bit-equal to prefilling
        the whole prompt (the same blocks, the same K/V)."""
        slot = self._check_slot(slot)
        n = k.shape[1]
        if n % PREFILL_CHUNK or n < PREFILL_CHUNK or v.shape != k.shape:
            raise ValueError(f"stage_kv: k, v [L, n, Hkv, D] with n a multiple of "
                             f"{PREFILL_CHUNK}, got {tuple(k.shape)}, {tuple(v.shape)}")
        if n >= self.max_context:
            raise ValueError(f"stage_kv: {n} tokens do not fit max_context={self.max_context}")
        self._empty(slot)
        entry = self._open_stage(slot)
        entry[0] = _write_stage(entry[0], k, v)
        entry[1] = n

    def kv(self, slot: int) -> tuple[jax.Array, jax.Array]:
        """A dense engine's K/V of `slot`'s tokens: two [L, n, Hkv, D] bf16 arrays
        (what `prefill_kv` takes), so one exact prefill can seed several caches."""
        slot = self._check_slot(slot)
        if self.cache_cfg is not None:
            raise ValueError("kv() reads a dense engine's cache (attention='dense')")
        n = int(self.lens[slot])
        return tuple(c[:, slot, :, :n].transpose(0, 2, 1, 3) for c in self.caches)

    def prefill_kv(self, slot: int, k, v, next_token: int,
                   sampling: SamplingParams = GREEDY, ids=None):
        """Fill `slot` with a prompt whose K/V [L, n, Hkv, D] were computed elsewhere
        (an exact prefill's: `kv`, `staged_kv`); `next_token` is the token that
        prefill sampled, the next decode step's input. Equal to `prefill` on the
        same prompt, without running the model. With the prompt's n token `ids`,
        its cold pages are shared and indexed as `prefill`'s."""
        slot = self._check_slot(slot)
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
        row = self._bias_row(sampling)
        if ids is not None:
            ids = self._check_prompt(ids)
            if len(ids) != n:
                raise ValueError(f"ids: {len(ids)} token ids for K/V of {n} tokens")
        self._empty(slot)
        need = self._begin_fill(slot, ids, n)
        pad = fill_length(n, self.max_context) - n
        pad_to = lambda x: jnp.pad(jnp.asarray(x, jnp.bfloat16), ((0, 0), (0, pad), (0, 0),
                                                                   (0, 0)))
        self._fill(slot, pad_to(k), pad_to(v), n)
        self.pool.end_fill(slot, ids, need)
        self._set_sampling(slot, sampling, row)
        self.lens[slot] = n
        self.tokens[slot] = next_token

    def _fill(self, slot: int, k, v, n: int):
        """Fill `slot` with an n-token prompt's K/V [L, T, Hkv, D] (T: padded)."""
        self._set_kv(programs.fill(self.strategy, self._kv(), jnp.int32(slot), k, v, jnp.int32(n),
                             self.pool.shared(slot, k.shape[1])))

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
        need = self.pool.step_pages(self.lens, active)
        # the penalties count the tokens each sequence has generated: its input now
        # (only where a slot has a penalty: other slots never read their counts)
        counted = active & np.array([p.presence_penalty != 0 or p.frequency_penalty != 0
                                     for p in self.sampling])
        if counted.any():
            self._count(np.arange(self.max_seqs), self.tokens, counted)
        nxt, self.logits, caches = programs.decode(
            self.params, self._kv(), jnp.asarray(self.tokens), jnp.asarray(self.lens),
            jnp.asarray(active), self._samp(), **self._static(), n=self.decode_width(active))
        self._set_kv(caches)
        nxt = np.asarray(nxt)
        self.tokens = np.where(active, nxt, self.tokens).astype(np.int32)
        self.lens = self.lens + active
        self.pool.take(need)
        return self.tokens.copy()

    def offload_counters(self) -> dict[str, int | float]:
        """Offload mode's counters summed over the layers: cold pages selected
        (per KV head), found resident (hits), copied in (misses and prefetches),
        evicted, the resident hit rate and the host-to-device bytes copied; {}
        without offload."""
        if not self.offload:
            return {}
        self.cold, self.counted, self.copied = self.cold.take_counts(self.counted, self.copied)
        out = scheduler.counters(self.cold.sched.replace(counters=self.counted))
        page = scheduler.page_bytes(self.cache_cfg)
        out.update(resident_pages=int(jnp.sum(self.cold.sched.resident >= 0)),
                   sample_pages_copied=int(self.copied[2]),
                   host_to_device_bytes_copied=int(self.copied[0]) * page,
                   host_to_device_bytes_moved=int(self.copied[1]) * page)
        return out

    def decode_widths(self) -> list[int]:
        """The slot counts a decode program is compiled for (`state.decode_widths`;
        dense attention's numbers are equal at every width, the sparse one's from
        4 slots on)."""
        return st.decode_widths(self.max_seqs)

    def decode_width(self, active: np.ndarray) -> int:
        """How many slots a decode step computes: the narrowest width that covers
        the highest active slot (the scheduler fills the lowest free slot, so at
        low concurrency a step costs what a few slots need, not what max_seqs
        does)."""
        top = int(np.flatnonzero(active).max()) + 1 if np.any(active) else 1
        return st.decode_width(self.max_seqs, top)

    def release(self, slot: int):
        """Empty `slot`: a HiSparse cache frees its cold pages but those the prefix
        index holds (and lets go of the slot's hold)."""
        slot = self._check_slot(slot)
        self._empty(slot)
        self.drop_hold(slot)

    def drop_hold(self, slot: int):
        """Let go of `hold_prefix`'s references for `slot` (host only)."""
        self.pool.drop_hold(slot)

    def _empty(self, slot: int):
        """`release`, keeping the slot's hold (for the prefill about to fill it)."""
        self._set_kv(self.strategy.release(self._kv(), slot))
        self.pool.release(slot)
        self.lens[slot] = 0
        self._close_stage(slot)  # a chunked prefill abandoned

    def pool_usage(self) -> tuple[int, int]:
        """(cold pool pages in use, pool pages), summed over the layers, read from
        the live pool (a device read); pages only the prefix index's unused,
        unpinned entries hold count as free (`cached_pages`). (0, 0) for a dense
        engine."""
        return self.pool.usage()

    def tier_tokens(self) -> dict[str, int]:
        """Tokens per tier (sink, hot, warm, cold) over the slots, from the lengths
        (the arithmetic of `HiSparseCache.counters`); {} for a dense engine."""
        return self.pool.tier_tokens(self.lens)

    def room(self, slot: int) -> int:
        """Tokens slot `slot` can still take."""
        return self.max_context - int(self.lens[slot])

    def capacity_line(self) -> str:
        return self.strategy.capacity_line(self._kv(), self.model.cfg.num_layers)

    def warmup(self, prompt_len: int = 16) -> float:
        """Compile prefill (for prompts of `prompt_len`'s padded length, whole and
        block by block: `prefill_chunk`, `prefill_kv`) and decode, without running
        them (XLA keeps the executables for the real calls: a long prompt's prefill
        would cost as much again as compiling it); returns seconds."""
        t0 = time.perf_counter()
        n = prefill_length(min(prompt_len, self.max_context - 1))
        samp = self._samp(0)
        programs.prefill.lower(self.params, self._kv(), jnp.int32(0), jnp.zeros(n, jnp.int32),
                         jnp.int32(1), self.pool.shared(-1, n), samp, **self._static(),
                         prefill=self.prefill_implementation).compile()
        if n > PREFILL_CHUNK:
            stage = self._spare_stage()
            m = min(prompt_len, self.max_context - 1)
            last = (m - 1) // PREFILL_CHUNK * PREFILL_CHUNK  # the last block's start
            for rows in sorted({PREFILL_CHUNK, self.block_length(m, last)}):
                programs.prefill_chunk.lower(self.params, stage, jnp.zeros(rows, jnp.int32),
                                       jnp.int32(0), jnp.int32(0), samp, graphdef=self.graphdef,
                                       products=self.product_implementation,
                                       prefill=self.prefill_implementation).compile()
            # the fills of prefill_chunk's last block and of prefill_kv
            for t in sorted({self.strategy.fill_tokens(m, self.max_context, stage[0].shape[1]),
                             fill_length(m, self.max_context)}):
                programs.fill.lower(self.strategy, self._kv(), jnp.int32(0),
                              *(x[:, :t] for x in stage), jnp.int32(1),
                              self.pool.shared(-1, t)).compile()
        for n in self.decode_widths():
            programs.decode.lower(self.params, self._kv(), jnp.asarray(self.tokens),
                            jnp.asarray(self.lens), jnp.zeros(self.max_seqs, bool),
                            self._samp(), **self._static(), n=n).compile()
        return time.perf_counter() - t0
