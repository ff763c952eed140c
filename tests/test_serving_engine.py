"""The serving engine on the real SmolLM2-135M: chunked prefill (`Engine.prefill_chunk`)
equals one-program prefill, and the scheduler interleaves a long prompt's blocks
with the running decodes, frees slots at once and bounds its queue."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from models_fixtures import smollm2

from hisparse_jax.attention.exact import PREFILL_CHUNK
from hisparse_jax.cache import state as st
from hisparse_jax.config import default_budget_tokens
from hisparse_jax.models.engine import Engine
from hisparse_jax.models.generate import stop_ids
from hisparse_jax.models.sampling import GREEDY, SamplingParams
from hisparse_jax.serving import metrics
from hisparse_jax.serving.batcher import Finish, QueueFull, Request, Scheduler, Token


@pytest.fixture(scope="module")
def model():
    return smollm2()


@pytest.fixture(scope="module")
def long_ids(model):
    ids = model[1].encode("The grass is green. The sky is blue. The sun is yellow. " * 80)
    return np.asarray(ids[:700])  # two blocks of 512; Engine.prefill pads it to 1024


@pytest.mark.parametrize("attention", ["hisparse", "dense"])
@pytest.mark.parametrize("implementation", [None, "xla"])
def test_chunked_prefill_equals_prefill(model, long_ids, attention, implementation):
    """Bit-equal, not close: the chunk program runs causal_prefill_attention's
    online softmax block by block in the same order (XLA), or the CPU kernel, whose
    queries do not depend on their block (the default where the CPU has AMX or
    AVX-512), and
    the HiSparse cache is filled from the same bf16 K/V (prefill_kv). Slot 0 by
    prefill, slot 1 by prefill_chunk; then both decode the same tokens with the
    same logits."""
    eng = Engine(model[0], max_seqs=2, max_context=1024, attention=attention,
                 implementation=implementation)
    samp = SamplingParams(temperature=0.7, seed=3)
    first = eng.prefill(0, long_ids, samp)
    ref = np.asarray(eng.logits)
    assert eng.prefill_chunk(1, long_ids, 0, samp) is None and eng.lens[1] == 0
    got = eng.prefill_chunk(1, long_ids, PREFILL_CHUNK, samp)
    assert got == first and eng.lens[1] == len(long_ids)
    np.testing.assert_array_equal(np.asarray(eng.logits), ref)
    # prefix reuse: the first block's K/V staged again, only the second block run
    k, v = eng.staged_kv(PREFILL_CHUNK)
    eng.stage_kv(1, k, v)
    assert eng.prefill_chunk(1, long_ids, PREFILL_CHUNK, samp) == first
    np.testing.assert_array_equal(np.asarray(eng.logits), ref)
    for _ in range(4):
        nxt = eng.decode_step()
        assert nxt[0] == nxt[1]
        lg = np.asarray(eng.logits)
        np.testing.assert_array_equal(lg[0], lg[1])
    with pytest.raises(ValueError, match="staged prompt"):
        eng.prefill_chunk(0, long_ids, PREFILL_CHUNK)  # blocks out of order


@pytest.mark.parametrize("max_stages", [1, 2])
def test_chunked_prefills_of_two_slots_interleave_up_to_max_stages(model, long_ids, max_stages):
    """Two prompts' blocks taking turns, each with its own K/V stage: each ends as
    it does alone (first token and logits bit-equal). With one stage the second
    prompt's first block abandons the first prompt's prefill, whose next block is
    refused."""
    eng = Engine(model[0], max_seqs=3, max_context=1024, max_stages=max_stages)
    other = long_ids[::-1].copy()
    refs = []
    for ids in (long_ids, other):
        refs.append((eng.prefill(2, ids), np.asarray(eng.logits)))
    assert eng.prefill_chunk(0, long_ids, 0) is None
    assert eng.prefill_chunk(1, other, 0) is None
    if max_stages == 1:
        with pytest.raises(ValueError, match=r"staged prompts \(slot: tokens\) are \{1: 512\}"):
            eng.prefill_chunk(0, long_ids, PREFILL_CHUNK)
        return
    assert eng.stages_free() == 0
    for slot, ids, (tok, logits) in ((1, other, refs[1]), (0, long_ids, refs[0])):
        assert eng.prefill_chunk(slot, ids, PREFILL_CHUNK) == tok
        np.testing.assert_array_equal(np.asarray(eng.logits), logits)
    assert eng.stages_free() == 2
    with pytest.raises(ValueError, match="max_stages"):
        Engine(model[0], max_seqs=2, max_context=1024, max_stages=3)


@pytest.mark.parametrize(("n", "start", "rows"), [
    (1, 0, 64), (64, 0, 64), (65, 0, 128), (512, 0, 512), (513, 0, 512), (513, 512, 64),
    (700, 512, 256), (1024, 512, 512), (1075, 1024, 64), (7870, 7680, 256)])
def test_a_prompts_last_block_is_padded_as_a_short_prompt(n, start, rows):
    """A 1,075-token prompt's last 51 tokens take 64 rows, not a whole block's 512."""
    assert Engine.block_length(n, start) == rows


@pytest.mark.parametrize("attention", ["hisparse", "dense"])
@pytest.mark.parametrize("implementation", [None, "xla"])
def test_a_batch_of_short_prompts_equals_each_alone(model, attention, implementation):
    """Bit-equal, not close: four prompts of 5-64 tokens (all padded to 64) in one
    program, in slots 0-3 out of order, against each prefilled alone in slots 4-7;
    then all eight decode together and each pair stays equal. Greedy and seeded
    sampling mixed."""
    m, _ = model
    eng = Engine(m, max_seqs=8, max_context=512, attention=attention,
                 implementation=implementation, budget_tokens=64)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, m.cfg.vocab_size, n) for n in (40, 5, 64, 17)]
    samplings = [GREEDY, SamplingParams(temperature=0.8, seed=5), GREEDY,
                 SamplingParams(temperature=1.0, top_p=0.9, seed=1)]
    slots = [2, 0, 3, 1]
    alone = []
    for i, (ids, sp) in enumerate(zip(prompts, samplings)):
        alone.append((eng.prefill(4 + i, ids, sp), np.asarray(eng.logits)))
    toks = eng.prefill_batch(slots, prompts, samplings)
    logits = np.asarray(eng.logits)
    for i, (first, lg) in enumerate(alone):
        assert toks[i] == first
        np.testing.assert_array_equal(logits[i], lg)
        assert eng.lens[slots[i]] == eng.lens[4 + i] == len(prompts[i])
    for _ in range(3):
        nxt = eng.decode_step()
        lg = np.asarray(eng.logits)
        for i, slot in enumerate(slots):
            assert nxt[slot] == nxt[4 + i]
            np.testing.assert_array_equal(lg[slot], lg[4 + i])


def test_a_batch_refuses_prompts_that_pad_apart(model):
    m, _ = model
    eng = Engine(m, max_seqs=4, max_context=512, attention="dense")
    ten, hundred = [5] * 10, [5] * 100
    with pytest.raises(ValueError, match="do not pad to one length"):
        eng.prefill_batch([0, 1], [ten, hundred], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="repeat"):
        eng.prefill_batch([1, 1], [ten, ten], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="as many slots"):
        eng.prefill_batch([0, 1], [ten], [GREEDY])


class Collect:
    def __init__(self):
        self.events = []

    def __call__(self, ev):
        self.events.append(ev)

    @property
    def ids(self):
        return [e.id for e in self.events if isinstance(e, Token) and e.id is not None]

    @property
    def finish(self):
        return next((e for e in self.events if isinstance(e, Finish)), None)


def test_scheduler_interleaves_long_prefill_with_decodes(model, long_ids):
    m, tok = model
    eng = Engine(m, max_seqs=2, max_context=1024)
    sched = Scheduler(eng, tok, max_waiting=0)  # a request needs a free slot
    short_ids = tok.encode("The capital of France is")
    a, b, c = Collect(), Collect(), Collect()
    ra = Request(short_ids, 12, GREEDY, a, eos=stop_ids(m, tok))
    sched.submit(ra)
    sched.step()  # admit and prefill the short prompt, one decode step
    assert len(a.ids) == 2
    sched.submit(Request(list(long_ids), 3, GREEDY, b))
    with pytest.raises(QueueFull):  # the free slot is promised to the long prompt
        sched.submit(Request(short_ids, 2, GREEDY, c))
    for blocks in (1, 2):  # each step: one block of the long prompt AND a decode step
        before = len(a.ids)
        sched.step()
        assert len(a.ids) == before + 1
        assert len(b.ids) == (0 if blocks == 1 else 2)
    while sched.running():
        sched.step()
    assert a.finish.reason == "length" and a.finish.completion_tokens == 12
    assert b.finish.reason == "length" and len(b.ids) == 3
    assert (eng.lens == 0).all()  # both slots freed at once
    # served alone (generate_batch) gives the same greedy tokens
    eng.prefill(0, short_ids)
    alone = [int(eng.tokens[0])] + [int(eng.decode_step(np.array([True, False]))[0])
                                    for _ in range(11)]
    eng.release(0)
    assert a.ids == alone
    # a cancelled request frees its slot at the next step, with reason "abort"
    d = Collect()
    rd = Request(short_ids, 50, GREEDY, d)
    sched.submit(rd)
    sched.step()
    sched.cancel(rd)
    sched.step()
    assert d.finish.reason == "abort" and sched.running() == 0 and eng.lens[0] == 0


def test_scheduler_prefills_short_prompts_together(model):
    """Five prompts waiting at once: the first four, of 64 rows, are prefilled in one
    program; the fifth pads to 128 rows, which ends the run (FIFO), and goes alone
    in the same step. Each answer equals the prompt served alone, and the pool's
    pages all come back."""
    m, tok = model
    eng = Engine(m, max_seqs=6, max_context=1024)
    sched = Scheduler(eng, tok)
    texts = ["The capital of France is", "Once upon a time", "def fib(n):",
             "1, 2, 3, 4,", "The grass is green. " * 14]  # the last pads to 128 rows
    reqs = [Request(tok.encode(t), 6, GREEDY, Collect()) for t in texts]
    batches = []
    real = eng.prefill_batch
    eng.prefill_batch = lambda slots, *a: batches.append(list(slots)) or real(slots, *a)
    for r in reqs:
        sched.submit(r)
    sched.step()
    assert batches == [[0, 1, 2, 3]] and all(len(r.sink.ids) == 2 for r in reqs)
    while sched.running():
        sched.step()
    for r in reqs:
        eng.prefill(5, r.ids)
        alone = [int(eng.tokens[5])] + [int(eng.decode_step(np.arange(6) == 5)[5])
                                        for _ in range(5)]
        eng.release(5)
        assert r.sink.ids == alone and r.sink.finish.reason == "length"
    assert eng.num_free == eng.cache_cfg.pool_pages


@pytest.mark.parametrize("slo, deferred", [(None, False), (1e6, False), (1e-9, True)])
def test_tpot_slo_defers_prompt_blocks_while_decodes_run(model, long_ids, slo, deferred):
    """With a TPOT target a long prompt's blocks wait while running them would put
    a decoding request over it (a target no step can meet: every block waits for
    the decodes to end), and run beside them where it would not (a generous
    target: as without one). The tokens are the same either way."""
    m, tok = model
    eng = Engine(m, max_seqs=2, max_context=1024)
    sched = Scheduler(eng, tok, tpot_slo=slo)
    short_ids = tok.encode("The capital of France is")
    warm = Collect()  # measures the long prompt's blocks (nothing decodes yet)
    sched.submit(Request(list(long_ids), 1, GREEDY, warm))
    while sched.waiting or sched.running():
        sched.step()
    last = Engine.block_length(len(long_ids), PREFILL_CHUNK)  # 188 tokens: 256 rows
    assert slo is None or set(sched.block_s) == {(0, PREFILL_CHUNK, False),
                                                 (PREFILL_CHUNK, last, True)}
    a, b = Collect(), Collect()
    sched.submit(Request(short_ids, 8, GREEDY, a))
    sched.step()
    rb = Request(list(long_ids), 3, GREEDY, b)
    sched.submit(rb)
    order, slot_b = [], None
    while sched.waiting or sched.running():
        sched.step()
        order += [x for x, c in (("a", a), ("b", b)) if c.finish and x not in order]
        if b.ids and "b first" not in order:
            order.append("b first")
            slot_b = next(i for i, s in enumerate(sched.slots) if s is not None and s.req is rb)
    assert (order.index("b first") > order.index("a")) == deferred
    assert (sched.deferred > 0) == deferred
    # a request takes its slot as its prefill starts: after a's, the lowest
    assert slot_b == (0 if deferred else 1)
    assert a.finish.completion_tokens == 8 and b.ids[0] == warm.ids[0] and len(b.ids) == 3


@pytest.mark.parametrize("slo, together", [(1e6, True), (1e-9, False)])
def test_gangs_start_streams_together_where_their_step_fits(model, long_ids, slo, together):
    """With a TPOT target and two prefill stages, two long prompts submitted
    together: the first one's last block waits for the second prompt's prefill,
    then both first tokens come in one step and the streams decode side by side
    (where a 2-wide step fits the target: once a 1-wide one did, it is tried).
    Under a target no step meets, the prompts go one after another. Either way
    each answer is the prompt's alone, and every slot and page comes back."""
    m, tok = model
    eng = Engine(m, max_seqs=2, max_context=1024, max_stages=2)
    reg = metrics.Metrics()
    bound = reg.bind("m")
    sched = Scheduler(eng, tok, tpot_slo=slo, metrics=bound)
    assert sched.gangs
    warm = Collect()  # one stream alone first: a 1-wide step measured
    sched.submit(Request(tok.encode("The capital of France is"), 3, GREEDY, warm))
    while sched.running() or sched.waiting:
        sched.step()
    other = long_ids[::-1].copy()
    a, b = Collect(), Collect()
    sched.submit(Request(list(long_ids), 6, GREEDY, a))
    sched.submit(Request(list(other), 6, GREEDY, b))
    steps = []
    while sched.running() or sched.waiting:
        sched.step()
        steps.append((len(a.ids), len(b.ids), list(sched.parked)))
    firsts = [next(i for i, s in enumerate(steps) if s[k] > 0) for k in (0, 1)]
    assert (firsts[0] == firsts[1]) == together
    assert any(p == [0] for *_, p in steps) == together  # a's last block parked
    assert (2 in sched.decode_s) == together
    assert bound.gang_streams._value.get() == (2 if together else 0)
    for ids, got in ((long_ids, a), (other, b)):
        eng.prefill(0, ids)
        alone = [int(eng.tokens[0])] + [int(eng.decode_step(np.array([True, False]))[0])
                                        for _ in range(5)]
        eng.release(0)
        assert got.ids == alone and got.finish.reason == "length"
    assert eng.pool_available() == eng.cache_cfg.pool_pages and eng.stages_free() == 2


def test_a_parked_prompt_cancelled_frees_its_slot_and_stage(model, long_ids):
    m, tok = model
    eng = Engine(m, max_seqs=2, max_context=1024, max_stages=2)
    sched = Scheduler(eng, tok, tpot_slo=1e6)
    sched.decode_s = {1: 0.01}  # a 2-wide gang is tried
    a, b = Collect(), Collect()
    ra = Request(list(long_ids), 4, GREEDY, a)
    sched.submit(ra)
    sched.submit(Request(list(long_ids[::-1]), 4, GREEDY, b))
    sched.step()  # a's first block, then its last one parks (b's first waits for a step)
    assert sched.parked == [0] and not a.ids
    sched.cancel(ra)
    while sched.running() or sched.waiting:
        sched.step()
    assert a.finish.reason == "abort" and not a.ids and len(b.ids) == 4
    assert eng.pool_available() == eng.cache_cfg.pool_pages and eng.stages_free() == 2


@pytest.mark.parametrize("decode_s, decode_dev, slo, stages, width", [
    ({}, {}, 0.06, 2, 1),                                 # nothing measured: one stream
    ({1: 0.03}, {}, 0.06, 2, 2),                          # 2 untried: 0.03 x 1.6 fits
    ({1: 0.04}, {}, 0.06, 2, 1),                          # 0.064 does not
    ({1: 0.03}, {1: 0.01}, 0.06, 2, 1),                   # (0.03 + 2 x 0.01) x 1.6
    ({1: 0.03, 2: 0.05}, {}, 0.06, 2, 2),
    ({1: 0.03, 2: 0.05}, {2: 0.006}, 0.06, 2, 1),         # 0.05 + 2 x 0.006 > 0.06
    ({1: 0.03, 2: 0.07}, {}, 0.06, 2, 1),                 # 2 measured over the target
    ({1: 0.07}, {}, 0.06, 2, 1),
    ({1: 0.015, 2: 0.02}, {}, 0.06, 4, 4),                # 3 and 4 untried: 0.032, 0.0512
    ({1: 0.02, 2: 0.03}, {}, 0.06, 4, 3),                 # 3 untried: 0.048; 4: 0.0768
    ({1: 0.03, 2: 0.05}, {}, 0.06, 4, 2),                 # 3 untried: 0.08
    ({1: 0.03, 2: 0.05, 3: 0.052, 4: 0.053}, {}, 0.06, 4, 4),
    ({1: 0.03, 2: 0.05, 3: 0.055, 4: 0.053}, {}, 0.06, 4, 2),  # 0.055 > 0.9 x 0.06
    ({1: 0.035}, {}, 0.06, 2, 1),                         # untried 0.056: within 0.06, not 0.054
    ({1: 0.03, 2: 0.05, 3: 0.065, 4: 0.058}, {}, 0.06, 4, 2),  # the first over stops it
])
def test_gang_width_table(decode_s, decode_dev, slo, stages, width):
    sched = Scheduler(SimpleNamespace(max_seqs=4, cache_cfg=None, max_stages=stages), None,
                      tpot_slo=slo)
    sched.decode_s, sched.decode_dev = dict(decode_s), dict(decode_dev)
    assert sched._gang_width() == width


def test_step_times_are_a_moving_average_and_deviation():
    sched = Scheduler(SimpleNamespace(max_seqs=2, cache_cfg=None, max_stages=2), None,
                      tpot_slo=0.06)
    for took in (0.04, 0.08, 0.04):
        sched._time_step(2, took)
    # mean 0.04 -> 0.05 -> 0.0475; deviation 0 -> 0.01 -> 0.01 (its distance, 0.01)
    assert sched.decode_s[2] == pytest.approx(0.0475)
    assert sched.decode_dev[2] == pytest.approx(0.01)
    assert sched._step_bound(2) == pytest.approx(0.0675)
    assert sched._step_bound(1) is None


@pytest.mark.parametrize("block_s, decode_s, first_ago, generated, slo, over", [
    ({(0, 512, False): 0.2}, {1: 0.03}, 0.5, 10, 0.1, False),   # (0.5 + 0.23) / 10
    ({(0, 512, False): 0.2}, {1: 0.03}, 0.5, 10, 0.08, True),   # over 0.9 x the target
    ({(0, 512, False): 0.2}, {1: 0.03}, 0.5, 10, 0.05, True),
    ({(0, 512, False): 0.2}, {1: 0.03}, 0.0, 1, 0.2, True),     # right after its first
    ({(0, 512, False): 0.2}, {}, 0.5, 10, 0.1, False),          # no step measured: 0
    ({(512, 512, False): 0.9}, {1: 0.03}, 0.5, 10, 0.1, True),  # unknown: the slowest
    ({}, {1: 0.03}, 100.0, 10_000, 1.0, True),                  # none measured: too long
    ({}, {}, 0.5, 10, None, False),                             # no target
])
def test_over_slo_table(block_s, decode_s, first_ago, generated, slo, over):
    import time

    from hisparse_jax.serving.batcher import _Seq
    sched = Scheduler(SimpleNamespace(max_seqs=1, cache_cfg=None, max_stages=1), None, tpot_slo=slo)
    sched.block_s, sched.decode_s = dict(block_s), dict(decode_s)
    seq = _Seq(Request([1], 4, GREEDY, Collect()), None, decoding=True, generated=generated,
               first=time.perf_counter() - first_ago)
    assert sched._over_slo((0, 512, False), [seq]) == over


@pytest.mark.parametrize("slo", [0, -1.0, float("nan")])
def test_tpot_slo_must_be_positive(slo):
    with pytest.raises(ValueError, match="tpot_slo"):
        Scheduler(SimpleNamespace(max_seqs=1, cache_cfg=None, max_stages=1), None, tpot_slo=slo)


def test_nan_in_one_sequence_never_reaches_another(model, long_ids):
    """A slot whose K/V hold NaN (poisoned) decodes next to a healthy one: the
    healthy slot's tokens and logits are bit-equal to those of an engine where
    it runs alone."""
    m, tok = model
    ids = tok.encode("The capital of France is")
    mc = m.cfg
    nan = np.full((mc.num_layers, 40, mc.num_kv_heads, mc.head_dim), np.nan, np.float32)
    both, alone = (Engine(m, max_seqs=2, max_context=1024) for _ in range(2))
    for eng in (both, alone):
        eng.prefill(0, ids)
    both.prefill_kv(1, nan, nan, next_token=5)
    assert np.asarray(both.caches.poisoned)[:, 1].all()
    for _ in range(3):
        a = both.decode_step(np.array([True, True]))
        b = alone.decode_step(np.array([True, False]))
        assert a[0] == b[0]
        np.testing.assert_array_equal(np.asarray(both.logits)[0], np.asarray(alone.logits)[0])
    assert np.isnan(np.asarray(both.logits)[1]).all()  # the poisoned one is NaN, visibly


@pytest.mark.parametrize("context, page, budget", [
    (1024, 16, 512), (2048, 16, 512), (8000, 16, 512), (8192, 16, 512), (8193, 16, 512),
    (12000, 16, 736), (12000, 128, 640), (16384, 16, 1024), (32768, 16, 2048),
    (131072, 16, 2048), (131072, 128, 2048)])
def test_serve_default_budget_is_a_16th_of_the_context(context, page, budget):
    """`hisparse serve` without --budget-tokens: a 16th of the context in whole
    pages, within [512, 2048] (a fixed 2,048 made the 8K server slower than dense)."""
    assert default_budget_tokens(context, page) == budget


@pytest.mark.parametrize("argv, message", [
    (["serve", "--max-seqs", "0"], "argument --max-seqs: must be >= 1"),
    (["serve", "--kv-cache-memory", "12XB"], "cannot parse size '12XB'"),
    (["serve", "--attention", "sparse"], "argument --attention: invalid choice"),
    (["serve", "--kv-pool-pages", "0"], "argument --kv-pool-pages: must be >= 1"),
    (["serve", "--tpot-slo-ms", "0"], "argument --tpot-slo-ms: must be > 0.0"),
    (["serve", "--tpot-slo-ms", "nan"], "argument --tpot-slo-ms: must be a finite number"),
    (["serve", "--attention", "dense", "--kv-pool-pages", "8"],
     "kv_pool_pages: only attention='hisparse' has a page pool"),
    (["serve", "--max-context", "16384"],  # SmolLM2 is trained to 8,192: no garbage past it
     "--max-context 16384: past smollm2-135m's 8192 trained positions"),
    (["bench", "serve", "--slo", "latency=5"], "--slo 'latency=5': keys are ttft_ms"),
    (["bench", "serve", "--slo", "ttft_ms=-1"], "ttft_ms must be > 0"),
    (["bench", "serve", "--model", "m", "--tokenizer", "none", "--input-len", "5:2"],
     "length '5:2': needs 1 <= A <= B"),
    (["bench", "serve", "--model", "m", "--tokenizer", "none", "--dataset", "replay"],
     "--dataset replay needs --dataset-path"),
    (["bench", "serve", "--model", "m", "--tokenizer", "none", "--dataset", "replay",
      "--dataset-path", "/nonexistent.jsonl"], "--dataset-path /nonexistent.jsonl:"),
])
def test_cli_errors_are_one_line(capsys, argv, message):
    from tests.helpers import cli_error
    assert message in cli_error(capsys, argv)


def test_bench_datasets(model):
    """bench serve's prompts: lengths as asked (random ids decoded; re-encoding
    moves them a little), the lognormal-bimodal output mix, the shared prefix."""
    import argparse

    from hisparse_jax.cli.bench_serve import add_arguments, build_jobs
    tok = model[1]
    p = argparse.ArgumentParser()
    add_arguments(p)

    def jobs(*argv, tokenizer=tok):
        a = p.parse_args(["--num-prompts", "200", "--warmup", "0", *argv])
        a.num_prompts_given = True
        return build_jobs(a, tokenizer)

    rnd = jobs("--input-len", "40:60", "--output-len", "8")
    assert len(rnd) == 200 and {j.max_tokens for j in rnd} == {8}
    lens = [len(tok.encode(j.prompt)) for j in rnd]
    assert 30 <= np.median(lens) <= 80
    mix = jobs("--dataset", "lognormal-bimodal", "--input-len", "100", "--output-len", "16",
               "--long-output-len", "512", "--long-fraction", "0.2", "--max-input-len", "400")
    outs = np.array([j.max_tokens for j in mix])
    assert set(outs) == {16, 512} and 0.1 < np.mean(outs == 512) < 0.3
    ids = jobs("--dataset", "prefix", "--prefix-len", "300", "--input-len", "10",
               tokenizer=None)  # --tokenizer none: token ids
    assert all(j.prompt[:300] == ids[0].prompt[:300] for j in ids)
    assert {len(j.prompt) for j in ids} == {310}


def test_requests_over_a_prewarmed_document_share_its_cold_pages(model, long_ids):
    """A pool too small for two copies of a document runs two requests over it at
    once: each references the pinned document's cold pages and stores only its
    own tail; both answers equal the prompt served alone. A request the pin leaves
    too few pages gets an error, not an endless wait. After DELETE and their end,
    the document's pages are only cached (free on demand)."""
    m, tok = model
    doc = [int(x) for x in long_ids]
    qs = [doc + tok.encode(q) for q in (" What is green?", " And which colour is the sky?")]
    probe = Engine(m, max_seqs=1, max_context=1024)
    cold = lambda n: int(st.num_cold_pages(probe.cache_cfg, n))
    full = cold(len(qs[1]) + 8)
    pool = cold(len(doc)) + 2 * (full - cold(len(doc)))  # the doc once, two tails
    assert pool < cold(len(doc)) + 2 * full  # two unshared requests would not fit
    eng = Engine(m, max_seqs=2, max_context=1024, cache_overrides={"num_pool_pages": pool})
    sched = Scheduler(eng, tok)
    pin = Collect()
    sched.submit(Request(doc, 1, GREEDY, pin, prewarm="doc"))
    while pin.finish is None:
        sched.step()
    assert pin.finish.reason == "stop" and eng.prefix_stats()["pinned_pages"] == cold(len(doc))
    sinks = [Collect(), Collect()]
    for q, s in zip(qs, sinks):
        sched.submit(Request(q, 8, GREEDY, s))
    sched.step()  # the first prefills (its block after the document's), then the second
    sched.step()
    assert sched.running() == 2  # both in slots at once: the doc's pages are shared
    assert sinks[0].ids and not sinks[0].finish
    peak = 0
    while sched.running():
        sched.step()
        peak = max(peak, eng.pool_usage()[0] // m.cfg.num_layers)
    assert peak <= pool
    for q, s in zip(qs, sinks):
        probe.prefill(0, q)
        alone = [int(probe.tokens[0])] + [int(probe.decode_step()[0]) for _ in range(7)]
        probe.release(0)
        assert s.ids == alone and s.finish.reason == "length"
    # a request that shares nothing needs more pages than the pin leaves: once
    # nothing else runs it fails with a clear error (it waited forever, and the
    # engine thread spun, before), and after the DELETE it runs
    other = [int(x) for x in long_ids[::-1]]
    assert cold(len(other) + 8) > pool - cold(len(doc))
    starved = Collect()
    sched.submit(Request(other, 8, GREEDY, starved))
    for _ in range(3):
        sched.step()
    f = starved.finish
    assert f is not None and f.reason == "error" and f.code == "kv_pool_too_small"
    assert "pinned by prewarmed contexts" in f.message and not sched.waiting
    assert sched.unpin("doc")
    sched.step()  # the engine thread lets the document's pages go
    assert eng.prefix_stats()["pinned_pages"] == 0 and eng.pool_usage()[0] == 0
    fed = Collect()
    sched.submit(Request(other, 8, GREEDY, fed))
    while fed.finish is None:
        assert sched.step()
    assert fed.finish.reason == "length" and len(fed.ids) == 8


@pytest.mark.parametrize(("attention", "text"), [("hisparse", "grass"), ("dense", "grass"),
                                               ("hisparse", "gpl")])
def test_a_narrow_decode_step_equals_the_full_one(model, long_ids, attention, text):
    """At low concurrency a decode step computes only the slots up to the highest
    active one, rounded up to a width (1, 2, 4, 8): slot 0's tokens and logits are
    bit-equal whether it decodes alone (width 1), beside one other (width 2) or
    beside 7 others (width 8). (On the GPL's text they were 0.08 apart from the
    third step until the model's RMSNorm padded its rows, and up to 0.15 at widths
    1 and 2 until its matmuls padded theirs and the attention took its softmax
    sums through `row_sum`: `test_rms_norm_of_a_row_does_not_depend_on_the_batch`,
    `test_matmul_of_a_row_does_not_depend_on_the_batch`,
    `test_sparse_decode_reference_of_a_sequence_does_not_depend_on_the_batch`.)"""
    if text == "gpl":
        with open("/usr/share/common-licenses/GPL-3") as f:
            ids = model[1].encode(f.read())[:600]
    else:
        ids = list(long_ids[:600])  # cold pages, a sparse selection
    alone, pair, full = (Engine(model[0], max_seqs=8, max_context=1024, attention=attention)
                         for _ in range(3))
    assert alone.decode_widths() == [1, 2, 4, 8]
    assert alone.decode_width(np.arange(8) < 1) == 1
    assert alone.decode_width(np.arange(8) < 3) == 4
    assert alone.decode_width(np.arange(8) == 4) == 8
    alone.prefill(0, ids)
    for b in range(8):
        full.prefill(b, ids if b == 0 else ids[:300 + 20 * b])
        if b < 2:
            pair.prefill(b, ids if b == 0 else ids[:317])
    for _ in range(5):
        a = alone.decode_step(np.arange(8) == 0)[0]
        assert a == pair.decode_step(np.arange(8) < 2)[0] == full.decode_step()[0]
        for other in (pair, full):
            np.testing.assert_array_equal(np.asarray(alone.logits)[0],
                                          np.asarray(other.logits)[0])
