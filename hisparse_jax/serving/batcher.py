"""Continuous batching over one `Engine`: fixed slots, a bounded wait queue,
chunked prefill interleaved with the running decodes.

One thread (`Scheduler.run`) owns the engine and makes every JAX call; other
threads only `submit` and `cancel` requests and read the events each request's
`sink` receives. One iteration (`step`):
1. drop cancelled requests (a waiting one leaves the queue, a running one frees
   its slot at once);
2. prefill: prompt blocks (`Engine.prefill_chunk`, at most 512 tokens each), up
   to `prefill_budget` tokens: the running prefill's, then the queue's, whose
   head takes the lowest free slot as its prefill starts (FIFO; so sequences
   that run one after another reuse the low slots, and a decode step, which
   computes the slots up to the highest one decoding, stays narrow);
3. one decode step for every slot past its prefill.
So a long prompt costs the running streams one block per step, never its whole
prefill. With a TPOT target (`tpot_slo`, `--tpot-slo-ms`) a block runs beside
running decodes only where no decoding request's time per output token (as
`hisparse bench serve` counts it: from its first token to its latest) would
exceed SLACK_SHARE of the target once the block and the next decode step are
done, judged from what the same block and step took before (`_over_slo`). Deferred blocks wait for
slack or for the decodes to end: the running streams keep their pace and a
waiting prompt pays in time to first token.

Gangs (a TPOT target and an engine of 2+ prefill stages, `Engine.max_stages`).
Under the target, streams that start one after another decode one at a time: a
second prompt's 7K prefill cannot run beside a stream without breaking its pace.
So a prompt stops before its last block (`parked`) while the next prompt
prefills, and the gang's last blocks then run back to back, their first tokens
sent together at the end of that step, and the streams decode side by side.
Several streams cost one step a little more than one (the weights are read once
for all): at 7.2K tokens in a 2-slot engine, 45 ms against 38 (docs/log/serving.md). A gang
is as wide as the widest decode step judged to fit SLACK_SHARE of the target (`_gang_width`: a
step's moving average plus two moving deviations, `_step_bound`; a width not yet
run, the narrower one's bound times UNTRIED_WIDTH_GROWTH), and a parked prompt
waits only while another can join (one in its prefill, or the
queue's head with a slot, a stage and pages). Nothing decodes beside a parked
prompt's last block: it waits for the running streams to end. The first of a
gang pays the others' prefill in time to first token. A running sequence is never
evicted: a request waits until a slot is free, and the queue's bound turns away
the rest (`QueueFull`, a 503).

Pages. A HiSparse sequence takes cold pages from the engine's shared pool as it
grows, and the pool's raw operations trust the caller to leave room (an empty
free stack would hand out a page another sequence holds). So admission reserves
each request's whole need up front: the cold pages of prompt + max_tokens tokens
(`pages_needed`), less those of an indexed equal prefix it will share (held from
admission on, `Engine.hold_prefix`). The head of the queue waits (FIFO, nothing
overtakes it) until the pool's available pages (free, or held only by unused
prefix entries, which are evicted on demand) cover what the running requests
may still take plus its own need; a request that needs more than the whole pool
is refused at `submit` (`TooLarge`, a 400), and one that needs more than the
pages prewarmed contexts leave unpinned fails once nothing else runs (its
"error" finish has code "kv_pool_too_small"). A running sequence therefore never
finds the pool empty, and none is evicted or overwritten to make room. With the
default pool (every slot's full context) the reservation never binds.

Non-finite values. After every prefill and decode step the sequences whose
logits are not all finite, or whose cache took a NaN/inf K or V (`poisoned`), are
stopped with an "error" finish before their token is sent: a poisoned request
gets a clear error, never garbage, and its slot and pages are freed. The other
sequences of the batch are untouched (their rows of the step are computed
independently; tests/test_serving_engine.py and tests/test_serving_api.py show
them bit-equal to the same requests served alone).

Prefixes. Every prompt's full cold pages are indexed by the engine, so a
prompt that starts like a running one (or a recent one) shares its cold pages
instead of storing them again. A prewarm request (`Request.prewarm`) is
prefilled like any other; then its pages are pinned in the index and its
prompt's whole-block bf16 K/V kept (`Prefix`), and its slot freed. A later prompt
that starts with a pinned prompt's ids resumes its prefill after them (the K/V)
and references its cold pages (the index).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
import traceback
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from hisparse_jax.attention.exact import PREFILL_CHUNK
from hisparse_jax.cache import state as st
from hisparse_jax.models.engine import Engine, prefill_length
from hisparse_jax.models.generate import TextStream
from hisparse_jax.models.sampling import SamplingParams
from hisparse_jax.validate import check_int, check_number

log = logging.getLogger("hisparse.serve")


class QueueFull(Exception):
    """The wait queue is full (or the server is shutting down): try again later."""


class TooLarge(ValueError):
    """The request needs more cold pool pages than the whole pool holds: it could
    never run (a 400, not a 503)."""


NONFINITE = ("non-finite values (NaN or inf) in this request's activations: it was "
             "stopped before they reached its output; other requests are unaffected")


@dataclasses.dataclass(frozen=True)
class Token:
    id: int | None  # None: text held back until the end, no new token
    text: str
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # (id, logprob) of the most likely ids


@dataclasses.dataclass(frozen=True)
class Finish:
    reason: str          # "stop" (EOS or a stop string), "length", "abort" or "error"
    prompt_tokens: int
    completion_tokens: int
    message: str = ""    # what went wrong, for "error"
    code: str | None = None  # "kv_pool_too_small": the request's fault (a 400), not the engine's


@dataclasses.dataclass(eq=False)
class Request:
    """One generation. `sink(event)` gets each `Token` and then one `Finish`, from
    the scheduler's thread (it must not block)."""

    ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    sink: Callable[[Token | Finish], None]
    stops: tuple[str, ...] = ()
    eos: tuple[int, ...] = ()
    logprobs: int | None = None  # None: none; k: the chosen token's and the top k
    prewarm: str | None = None   # a context id: prefill, pin the prompt's K/V, no tokens
    # Fault injection (tests only; the server accepts it only with --fault-injection):
    # after this many generated tokens the sequence's K/V are overwritten with NaN,
    # as if its activations had blown up.
    fault_nan_kv_after: int | None = None
    id: str = dataclasses.field(default_factory=lambda: f"req-{next(_ids)}")
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: bool = False


_ids = itertools.count()
MAX_PREFIXES = 8  # pinned contexts (each holds its bf16 K/V on the device)
IDLE_WAIT_S = 0.05  # a step that found nothing to do waits this long, or for news
# Waiting prompts that pad to this many rows or fewer are prefilled together, 2, 4
# or 8 in one program (`Engine.prefill_batch`): each such prompt alone pays a
# program's fixed cost for a few rows of work. Powers of two: three programs.
BATCH_PROMPT_ROWS = 64
BATCH_SIZES = (8, 4, 2)
# The weight of a decode step's newest time in `decode_s` (a moving average per
# batch size) and of its distance from that average in `decode_dev`: one step's
# time moves by 1.5x from minute to minute on a shared 2-core machine. The TPOT
# target judges a step by its average plus STEP_DEVIATIONS of those distances
# (`_step_bound`), so that a width whose steps vary gets room under the target.
STEP_SMOOTHING = 0.25
STEP_DEVIATIONS = 2.0
# A width not yet run is judged as the next narrower one's bound times this: the
# measured growth from 1 to 2 wide was up to about 1.5x (docs/log/serving.md, "Run 6
# and after: gangs" and "Without AMX"), and steps swing more than that.
UNTRIED_WIDTH_GROWTH = 1.6
# A prompt block fills a stream's slack only up to this share of the TPOT target
# (`_over_slo`), and a gang's step must be judged within it (`_gang_width`): a
# block or step here often runs slower than its last time, and a stream filled
# right up to the target ends over it (docs/log/code-timings.md, "slack").
SLACK_SHARE = 0.9


@dataclasses.dataclass(frozen=True)
class Prefix:
    """A prewarmed context: its prompt ids and the bf16 K/V of their first n tokens
    (n a multiple of the prefill block), which later prompts starting with those
    ids reuse instead of prefilling them."""
    ids: tuple[int, ...]
    n: int
    k: object
    v: object


@dataclasses.dataclass(eq=False)
class _Seq:
    """A request in a slot."""
    req: Request
    text: TextStream
    start: int = 0          # next prompt block
    decoding: bool = False  # prefill done
    resumed: bool = False   # looked for a pinned prefix to resume after
    generated: int = 0
    first: float = 0.0      # when its first token came
    last: float = 0.0       # when its last token came
    shared: int = 0         # cold pool pages (per layer) of an indexed prefix it shares


class Scheduler:
    def __init__(self, engine: Engine, tokenizer, *, max_waiting: int = 64,
                 prefill_budget: int = PREFILL_CHUNK, tpot_slo: float | None = None,
                 metrics=None):
        self.engine, self.tokenizer = engine, tokenizer
        self.max_waiting = check_int("max_waiting", max_waiting, minimum=0)
        self.prefill_budget = check_int("prefill_budget", prefill_budget, minimum=1)
        self.tpot_slo = None if tpot_slo is None else check_number("tpot_slo", tpot_slo, 0.0, above=True)
        # seconds the last prefill block of each (start, tokens, last block?) took,
        # and a decode step of each batch size with its checks and sends (a moving
        # average and deviation, STEP_SMOOTHING): what the TPOT target judges by
        self.block_s: dict[tuple[int, int, bool], float] = {}
        self.decode_s: dict[int, float] = {}
        self.decode_dev: dict[int, float] = {}
        self.deferred = 0  # prefill blocks put off for the TPOT target
        self.metrics = metrics
        self.waiting: collections.deque[Request] = collections.deque()
        self.slots: list[_Seq | None] = [None] * engine.max_seqs
        self.prefilling: collections.deque[int] = collections.deque()  # slots, FIFO
        # Gangs (a TPOT target and an engine of 2+ prefill stages): the slots whose
        # prompt's last block waits, so that several streams start decoding together
        self.gangs = self.tpot_slo is not None and engine.max_stages > 1
        self.parked: list[int] = []
        self.cond = threading.Condition()
        self.admitting = True
        self.stopped = False
        self.prefixes: dict[str, Prefix] = {}  # context id -> pinned K/V
        self._unpinned: list[str] = []  # contexts whose pages the engine thread lets go
        self._index_stats: dict[str, int] = {}  # the engine's prefix counts, last reported
        self._offload_stats: dict[str, int] = {}  # and its offload counts
        self.busy_s = 0.0  # time spent in steps that had work (for the cost figure)
        self.generated = 0
        cfg = engine.cache_cfg
        self.pool_pages = 0 if cfg is None else cfg.pool_pages  # per layer
        self._thread: threading.Thread | None = None

    def pages_needed(self, req: Request) -> int:
        """Cold pool pages (per layer) `req` can take at most: those of a sequence of
        its prompt + max_tokens tokens (0 for a dense engine)."""
        cfg = self.engine.cache_cfg
        if cfg is None:
            return 0
        n = min(len(req.ids) + req.max_tokens, self.engine.max_context)
        return int(st.num_cold_pages(cfg, n))

    def reserved(self) -> int:
        """Cold pool pages (per layer) the requests in slots may still take: a
        decoding one up to prompt + max_tokens from its length, one still in its
        prefill all its pages but those it shares."""
        cfg, eng = self.engine.cache_cfg, self.engine
        if cfg is None:
            return 0
        out = 0
        for slot, s in enumerate(self.slots):
            if s is not None:
                took = int(st.num_cold_pages(cfg, eng.lens[slot])) if s.decoding else s.shared
                out += self.pages_needed(s.req) - took
        return out

    # ------------------------------------------------------------ any thread

    def submit(self, req: Request):
        """Queue `req`; QueueFull when the queue is full or the server is stopping,
        TooLarge when it needs more pages than the whole pool."""
        need = self.pages_needed(req)
        if need > self.pool_pages and self.engine.cache_cfg is not None:
            raise TooLarge(f"{len(req.ids)} prompt tokens + max_tokens={req.max_tokens} need "
                           f"{need} cold KV pool pages; the pool holds {self.pool_pages} "
                           f"(--kv-pool-pages): lower max_tokens or the prompt")
        with self.cond:
            if not self.admitting:
                raise QueueFull("the server is shutting down")
            free = self.slots.count(None)  # the waiting ones take them as they start
            if len(self.waiting) >= self.max_waiting + free:
                raise QueueFull(f"{len(self.waiting)} requests are waiting already "
                                f"(--max-waiting {self.max_waiting})")
            self.waiting.append(req)
            self._gauges()
            self.cond.notify()

    def cancel(self, req: Request):
        """Stop `req` (a client that went away): its slot is freed at the next step."""
        with self.cond:
            req.cancelled = True
            self.cond.notify()

    def unpin(self, context_id: str) -> bool:
        with self.cond:
            if self.prefixes.pop(context_id, None) is None:
                return False
            self._unpinned.append(context_id)  # the engine thread lets its pages go
            self.cond.notify()
            return True

    def running(self) -> int:
        return sum(s is not None for s in self.slots)

    def start(self):
        self._thread = threading.Thread(target=self.run, name="hisparse-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None):
        """Stop admitting; the loop finishes what it holds, then ends. After
        `timeout` seconds whatever still runs is cancelled."""
        with self.cond:
            self.admitting = False
            self.cond.notify()
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self.cond:
                for r in list(self.waiting) + [s.req for s in self.slots if s is not None]:
                    r.cancelled = True
                self.cond.notify()
            self._thread.join()

    # ------------------------------------------------------------ the engine thread

    def run(self):
        while True:
            with self.cond:
                while not (self.waiting or self.running() or self._unpinned or not self.admitting):
                    self.cond.wait()
                if not self.admitting and not self.waiting and not self.running():
                    self.stopped = True
                    return
            t = time.perf_counter()
            try:
                worked = self.step()
            except Exception as e:  # noqa: BLE001 (a bug: fail what runs, keep serving)
                log.error("engine step failed: %s", traceback.format_exc())
                for slot, seq in enumerate(self.slots):
                    if seq is not None:
                        self._finish(slot, "error", f"{type(e).__name__}: {e}")
                worked = True
            if worked:
                self.busy_s += time.perf_counter() - t
            else:  # the queue's head waits for pages, nothing runs: no busy loop
                with self.cond:
                    self.cond.wait(IDLE_WAIT_S)

    def step(self) -> bool:
        """One engine step: prefill blocks up to the budget, then one decode step
        for the running sequences. Whether it did any of that."""
        eng = self.engine
        with self.cond:
            for r in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(r)
                r.sink(Finish("abort", len(r.ids), 0))
                self._count_finish("abort")
            for slot, seq in enumerate(self.slots):
                if seq is not None and seq.req.cancelled:
                    self._finish(slot, "abort")
            for cid in self._unpinned:
                eng.unpin(cid)
            self._unpinned.clear()
            self._gauges()
        spent = 0
        stuck = False  # the queue's head waits for pages
        decoding = [s for s in self.slots if s is not None and s.decoding]
        while True:
            if self.prefilling:
                seq = self.slots[self.prefilling[0]]
                ids, start = seq.req.ids, seq.start
                if self._park(seq):
                    continue
            else:
                with self.cond:
                    head = self.waiting[0] if self.waiting and None in self.slots else None
                if head is None or (self.gangs and len(head.ids) > PREFILL_CHUNK
                                    and not eng.stages_free()):
                    break
                ids, start = head.ids, 0
            n = len(ids)
            cost = eng.block_length(n, start)
            if spent and spent + cost > self.prefill_budget:
                break
            if self._defer((start, cost, start + PREFILL_CHUNK >= n), decoding):
                break
            if not self.prefilling and cost <= BATCH_PROMPT_ROWS:
                batched = self._prefill_batch(self.prefill_budget - spent, decoding)
                if batched:
                    spent += batched
                    continue
            if not self.prefilling and not self._admit():
                stuck = True
                break  # the head waits for pages
            slot = self.prefilling[0]
            seq = self.slots[slot]
            if not seq.resumed:
                seq.resumed = True
                self._reuse_prefix(slot, seq)
            cost = eng.block_length(n, seq.start)
            if seq.start != start:  # a pinned prefix moved its first block
                if self._park(seq):
                    continue
                if self._defer(self._block_key(seq), decoding):
                    break
            spent += cost
            first = self._prefill_block(slot, seq)
            if first is not None:
                self._emit(*first)
        if (self.parked and not any(s is not None and s.decoding for s in self.slots)
                and self._gang_ready(stuck)):
            # the gang's last blocks back to back, its first tokens together (as one
            # batched step would give them): the streams' pace starts with the decode
            gang, self.parked = self.parked, []  # a block that fails finishes its slot
            if len(gang) > 1:
                bound = self._step_bound(len(gang))
                log.info("a gang of %d streams starts (its step judged %s%s)", len(gang),
                         "unknown" if bound is None else f"{1e3 * bound:.0f} ms",
                         "" if len(gang) in self.decode_s else ", not run yet")
                if self.metrics is not None:
                    self.metrics.gang_streams.inc(len(gang))
            firsts = [self._prefill_block(slot, self.slots[slot]) for slot in gang]
            for first in firsts:
                if first is not None:
                    self._emit(*first)
        live = np.array([s is not None and s.decoding for s in self.slots])
        t = time.perf_counter()
        if live.any():
            nxt = eng.decode_step(live)
            bad = self._nonfinite(live)
            logits = eng.logits if any(s is not None and s.req.logprobs is not None
                                       for s in self.slots) else None
            for slot in np.flatnonzero(live):
                if bad[slot]:
                    self._finish(int(slot), "error", NONFINITE)
                else:
                    self._emit(int(slot), int(nxt[slot]),
                               None if logits is None else logits[slot])
        with self.cond:
            self._gauges()
        self._cache_metrics(live)
        if live.any():  # a token's whole cost to its stream: the step, its checks and sends
            self._time_step(int(live.sum()), time.perf_counter() - t)
        return bool(spent or live.any())

    def _time_step(self, width: int, took: float):
        mean = self.decode_s.get(width, took)
        dev = self.decode_dev.get(width, 0.0)
        self.decode_dev[width] = dev + STEP_SMOOTHING * (abs(took - mean) - dev)
        self.decode_s[width] = mean + STEP_SMOOTHING * (took - mean)

    def _step_bound(self, width: int) -> float | None:
        """What a decode step of `width` streams is judged to take: its moving
        average plus STEP_DEVIATIONS of its moving deviation; a width not yet run,
        the next narrower one's bound times UNTRIED_WIDTH_GROWTH; None if neither
        has run."""
        if width in self.decode_s:
            return self.decode_s[width] + STEP_DEVIATIONS * self.decode_dev.get(width, 0.0)
        narrower = self._step_bound(width - 1) if width > 1 else None
        return None if narrower is None else narrower * UNTRIED_WIDTH_GROWTH

    def _block_key(self, seq: _Seq) -> tuple[int, int, bool]:
        """(start, rows, last block?) of `seq`'s next prompt block: what `block_s`
        times."""
        n = len(seq.req.ids)
        return seq.start, self.engine.block_length(n, seq.start), seq.start + PREFILL_CHUNK >= n

    def _prefill_block(self, slot: int, seq: _Seq) -> tuple | None:
        """Run `seq`'s next prompt block. After its last one: the first token's
        `_emit` arguments, or None (a prewarm pinned, or a non-finite value: the
        request is finished)."""
        eng = self.engine
        key = self._block_key(seq)
        t = time.perf_counter()
        tok = eng.prefill_chunk(slot, seq.req.ids, seq.start, seq.req.sampling)
        if self.tpot_slo is not None:  # the block's own time, not the next step's
            eng.logits.block_until_ready()
            self.block_s[key] = time.perf_counter() - t
        seq.start += PREFILL_CHUNK
        if tok is None:
            return None
        if slot in self.prefilling:
            self.prefilling.remove(slot)
        seq.decoding = True
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(seq.req.ids))
        if self._nonfinite(np.arange(eng.max_seqs) == slot, rows=[slot])[slot]:
            self._finish(slot, "error", NONFINITE)
        elif seq.req.prewarm is not None:
            self._pin(slot, seq)
        else:
            return slot, tok, eng.logits
        return None

    def _park(self, seq: _Seq) -> bool:
        """With gangs, whether the running prefill (`seq`, the head of
        `prefilling`) stops before its last block to wait for its gang (a
        prompt of one block never waits: it holds no stage)."""
        n = len(seq.req.ids)
        if not self.gangs or n <= PREFILL_CHUNK or seq.start + PREFILL_CHUNK < n:
            return False
        self.parked.append(self.prefilling.popleft())
        return True

    def _gang_width(self) -> int:
        """How many streams a gang starts: the widest decode step (up to the
        engine's prefill stages) judged to fit SLACK_SHARE of the TPOT target
        (`_step_bound`); one where none is."""
        width = 1
        for w in range(2, self.engine.max_stages + 1):
            bound = self._step_bound(w)
            if bound is None or bound > SLACK_SHARE * self.tpot_slo:
                break
            width = w
        return width

    def _gang_ready(self, stuck: bool) -> bool:
        """Whether the parked prompts' last blocks run now (nothing decodes): the
        gang is full, or no other prompt can join it (none in its prefill, and the
        queue's head has no slot, no stage or no pages)."""
        if len(self.parked) >= self._gang_width() or stuck:
            return True
        if self.prefilling:
            return False
        with self.cond:
            head = self.waiting[0] if self.waiting and None in self.slots else None
        return head is None or not self.engine.stages_free()

    def _prefill_batch(self, budget: int, decoding: list[_Seq]) -> int:
        """Prefill the queue's head and the short prompts right behind it in one
        program (FIFO, as many as the free slots, `budget` prompt rows and the pool
        allow, in a batch of BATCH_SIZES), and emit their first tokens. The rows
        it spent (0: fewer than two could go, nothing was done)."""
        eng = self.engine
        if eng.offload:
            return 0
        with self.cond:
            fit = 0
            for r in itertools.islice(self.waiting, min(self.slots.count(None),
                                                        budget // BATCH_PROMPT_ROWS)):
                if r.prewarm is not None or prefill_length(len(r.ids)) > BATCH_PROMPT_ROWS:
                    break
                fit += 1
        size = next((b for b in BATCH_SIZES if b <= fit), 0)
        key = (0, size * BATCH_PROMPT_ROWS, True)  # judged as one prompt of as many rows
        if not size or self._defer(key, decoding):
            return 0
        slots = []
        while len(slots) < size and self._admit():
            slots.append(self.prefilling[-1])
        size = next((b for b in BATCH_SIZES if b <= len(slots)), 0)
        if not size:
            return 0  # the one admitted (if any) goes on alone from self.prefilling
        slots = slots[:size]
        seqs = [self.slots[s] for s in slots]
        for slot, seq in zip(slots, seqs):
            seq.resumed = True
            self._reuse_prefix(slot, seq)  # counts its lookup (no pinned prefix is this short)
        t = time.perf_counter()
        toks = eng.prefill_batch(slots, [q.req.ids for q in seqs], [q.req.sampling for q in seqs])
        if self.metrics is not None:
            self.metrics.prefill_batched.inc(size)
        if self.tpot_slo is not None:
            eng.logits.block_until_ready()
            self.block_s[key] = time.perf_counter() - t
        bad = self._nonfinite(np.isin(np.arange(eng.max_seqs), slots), rows=slots)
        for i, (slot, seq, tok) in enumerate(zip(slots, seqs, toks)):
            self.prefilling.remove(slot)
            seq.decoding = True
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(seq.req.ids))
            if bad[slot]:
                self._finish(slot, "error", NONFINITE)
            else:
                self._emit(slot, tok, None if seq.req.logprobs is None else eng.logits[i])
        return size * BATCH_PROMPT_ROWS

    def _admit(self) -> bool:
        """Give the head of the queue the lowest free slot, as its prefill starts
        (so that sequences decoding one after another reuse the same low slots, and
        a decode step's width stays narrow), if the pool can take all it may still
        need; else it waits (FIFO: nothing overtakes it)."""
        eng = self.engine
        with self.cond:
            if not self.waiting or None not in self.slots:
                return False
            slot, r = self.slots.index(None), self.waiting[0]
            shared = eng.hold_prefix(slot, r.ids)
            need = self.pages_needed(r) - shared
            if eng.cache_cfg is not None and self.reserved() + need > eng.pool_available():
                eng.drop_hold(slot)
                if not self.running():  # nothing will free pages: only pins hold them
                    self.waiting.popleft()
                    r.sink(Finish("error", len(r.ids), 0, (
                        f"{len(r.ids)} prompt tokens + max_tokens={r.max_tokens} need {need} "
                        f"cold KV pool pages; {eng.pool_available()} of {self.pool_pages} are "
                        f"not pinned by prewarmed contexts (DELETE /v1/prewarm/ID frees "
                        f"theirs): lower max_tokens or the prompt"), code="kv_pool_too_small"))
                    self._count_finish("error")
                    self._gauges()
                return False
            self.waiting.popleft()
            self.slots[slot] = _Seq(r, TextStream(self.tokenizer, r.stops, r.eos), shared=shared)
            self.prefilling.append(slot)
            self._gauges()
            return True

    def _defer(self, key: tuple[int, int, bool], decoding: list[_Seq]) -> bool:
        """Whether prefill block `key` waits for the TPOT target (counted)."""
        if not decoding or not self._over_slo(key, decoding):
            return False
        self.deferred += 1
        if self.metrics is not None:
            self.metrics.prefill_deferred.inc()
        return True

    def _over_slo(self, key: tuple[int, int, bool], decoding: list[_Seq]) -> bool:
        """Whether running prefill block `key` now would put a decoding request's
        time per output token over SLACK_SHARE of the target: its next token comes
        after the block and a decode step of this batch (the block's last time, the
        step's bound; a block never measured counts as too long, a batch size
        never measured as the slowest step seen)."""
        if self.tpot_slo is None:
            return False
        block = self.block_s.get(key)
        if block is None:
            return True
        step = self._step_bound(len(decoding))
        if step is None:
            step = max(self.decode_s.values(), default=0.0)
        done = time.perf_counter() + block + step
        # after it, a request with g tokens has g + 1: g gaps since its first
        limit = SLACK_SHARE * self.tpot_slo
        return any((done - s.first) / max(s.generated, 1) > limit for s in decoding)

    def _nonfinite(self, mask: np.ndarray, rows: list[int] | None = None) -> np.ndarray:
        """[B] bool: the slots in `mask` whose last logits hold a NaN or inf, or
        whose cache is poisoned (a non-finite K/V). One small device read. rows:
        the slots a prefill's logits belong to, in order ([V] for one, [n, V] for
        a batch); None for a decode step's [max_seqs, V]."""
        eng = self.engine
        lg = eng.logits
        ok = jnp.all(jnp.isfinite(lg.reshape(-1, lg.shape[-1])), axis=-1)
        if rows is not None:
            ok = jnp.ones(eng.max_seqs, bool).at[np.asarray(rows)].set(ok)
        if eng.cache_cfg is not None:
            ok = ok & ~jnp.any(eng.caches.poisoned, axis=0)
        return mask & ~np.asarray(ok)

    def _inject_nan(self, slot: int, token: int):
        """Fault injection: overwrite `slot`'s K/V with NaN (every layer, every
        token so far), keeping its length and next token; the next decode step
        then runs it, poisoned, next to the others."""
        eng = self.engine
        mc = eng.model.cfg
        n = int(eng.lens[slot])
        nan = np.full((mc.num_layers, n, mc.num_kv_heads, mc.head_dim), np.nan, np.float32)
        log.warning("fault injection: NaN K/V in %s (slot %d)", self.slots[slot].req.id, slot)
        eng.prefill_kv(slot, nan, nan, next_token=token, sampling=eng.sampling[slot])

    def _cache_metrics(self, decoded: np.ndarray):
        """The cache's own figures after a step: pool pages in use (read from the
        live pool), tokens per tier, poisoned sequences, and the cold pages the
        step's decode read (each decoded sequence: min(its cold pages, the
        selection budget) per layer and KV head)."""
        m, eng = self.metrics, self.engine
        if m is None or eng.cache_cfg is None:
            return
        cfg, lens = eng.cache_cfg, eng.lens
        used, total = eng.pool_usage()
        m.pool_usage.set(used / total)
        layers = eng.model.cfg.num_layers
        m.pool_pages.labels(state="used").set(used)
        m.pool_pages.labels(state="total").set(total)
        stats = eng.prefix_stats()
        m.pool_pages.labels(state="pinned").set(stats["pinned_pages"] * layers)
        m.pool_pages.labels(state="cached").set(stats["cached_pages"] * layers)
        for key, result in (("hits", "hit"), ("misses", "miss"), ("collisions", "collision"),
                            ("evictions", "eviction")):
            m.prefix_pages.labels(result=result).inc(stats[key] - self._index_stats.get(key, 0))
        self._index_stats = stats
        with self.cond:
            m.pool_pages.labels(state="reserved").set(self.reserved() * layers)
        for tier, n in eng.tier_tokens().items():
            m.tier_tokens.labels(tier=tier).set(n)
        cold = st.num_cold_pages(cfg, lens) * (lens > 0)
        layers_heads = eng.model.cfg.num_layers * cfg.num_kv_heads
        read = np.minimum(cold, cfg.budget_pages)[decoded].sum() * layers_heads
        m.cold_pages_read.inc(int(read))
        m.poisoned.set(int(np.asarray(eng.caches.poisoned).any(axis=0).sum()))
        if eng.offload:
            off, last = eng.offload_counters(), self._offload_stats
            for key, result in (("hits", "hit"), ("misses", "miss"), ("prefetched", "prefetch")):
                m.offload_pages.labels(result=result).inc(off[key] - last.get(key, 0))
            m.offload_bytes.inc(off["host_to_device_bytes_copied"]
                                - last.get("host_to_device_bytes_copied", 0))
            m.offload_hit_rate.set(off["hit_rate"])
            self._offload_stats = off

    def _reuse_prefix(self, slot: int, seq: _Seq):
        """Start the prefill after the longest pinned prefix of the prompt."""
        ids = seq.req.ids
        best = max((p for p in self.prefixes.values()
                    if p.n < len(ids) and tuple(ids[:p.n]) == p.ids[:p.n]),
                   key=lambda p: p.n, default=None)
        if self.metrics is not None:
            self.metrics.prefix_queries.inc(len(ids))
            self.metrics.prefix_hits.inc(best.n if best else 0)
        if best is not None:
            self.engine.stage_kv(slot, best.k, best.v)
            seq.start = best.n

    def _pin(self, slot: int, seq: _Seq):
        """A prewarm request's prefill is done: keep its K/V, free the slot."""
        ids = seq.req.ids
        n = (len(ids) - 1) // PREFILL_CHUNK * PREFILL_CHUNK  # a later prompt adds >= 1
        with self.cond:
            if n and (seq.req.prewarm in self.prefixes or len(self.prefixes) < MAX_PREFIXES):
                self.prefixes[seq.req.prewarm] = Prefix(tuple(ids), n, *self.engine.staged_kv(n))
                self.engine.pin(slot, seq.req.prewarm)  # its cold pages outlive the slot
                reason = "stop"
            else:
                reason = "error"
        self._finish(slot, reason, "" if reason == "stop" else
                     f"{MAX_PREFIXES} contexts are pinned already: DELETE one first")

    def _emit(self, slot: int, token: int, logits):
        seq = self.slots[slot]
        req = seq.req
        now = time.perf_counter()
        m = self.metrics
        if m is not None:
            if seq.generated == 0:
                m.ttft.observe(now - req.arrival)
            else:
                m.itl.observe(now - seq.last)
            m.generation_tokens.inc()
        if seq.generated == 0:
            seq.first = now
        seq.generated += 1
        seq.last = now
        self.generated += 1
        text, done = seq.text.push(token)
        lp, top = None, ()
        if req.logprobs is not None:
            row = np.asarray(logits, np.float64)
            row = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
            lp = float(row[token])
            if req.logprobs:
                best = np.argsort(-row)[:req.logprobs]
                top = tuple((int(i), float(row[i])) for i in best)
        req.sink(Token(token, text, lp, top))
        if done:
            self._finish(slot, "stop")
        elif seq.generated >= req.max_tokens or self.engine.room(slot) <= 0:
            self._finish(slot, "length")
        elif req.fault_nan_kv_after == seq.generated:
            self._inject_nan(slot, token)

    def _finish(self, slot: int, reason: str, message: str = ""):
        """Free `slot` now and tell its request why it ended."""
        seq = self.slots[slot]
        self.slots[slot] = None
        if slot in self.prefilling:
            self.prefilling.remove(slot)
        if slot in self.parked:
            self.parked.remove(slot)
        self.engine.release(slot)
        rest = seq.text.flush() if reason == "length" else ""
        if rest:
            seq.req.sink(Token(None, rest))
        seq.req.sink(Finish(reason, len(seq.req.ids), seq.generated, message))
        self._count_finish(reason)
        if self.metrics is not None:
            self.metrics.e2e.observe(time.perf_counter() - seq.req.arrival)

    def _count_finish(self, reason: str):
        if self.metrics is not None:
            self.metrics.success.labels(finished_reason=reason).inc()

    def _gauges(self):
        m = self.metrics
        if m is None:
            return
        m.running.set(self.running())
        m.waiting.set(len(self.waiting))
        eng = self.engine
        m.kv_usage.set(float(np.sum(eng.lens)) / (eng.max_seqs * eng.max_context))
