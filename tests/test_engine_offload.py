"""The model engine's offload mode (`Engine(offload=True)`): the cold int4 codes
of every layer live in host memory (`offload.LayerColdStores`), the device state
holds none, and a decode step (one program) copies each layer's missing pages
between its selection and its attention. Served on the real model, the tokens and logits equal the
all-resident engine's bit for bit: long prompts (one program and block by block),
a shared prefix, a slot released and filled again."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models_fixtures import smollm2

from hisparse_jax import capacity
from hisparse_jax.attention.exact import PREFILL_CHUNK
from hisparse_jax.cache import state as st
from hisparse_jax.models.engine import Engine
from hisparse_jax.models.kv import decode
from hisparse_jax.offload import policy as scheduler


@pytest.fixture(scope="module")
def model():
    return smollm2()


def _prompts(tok):
    text = ("In 1862 the survey ship reached the northern cape, where the crew counted "
            "forty-one seals, mended two sails and wrote the names of every island they "
            "passed into a log that is now kept in the city museum. ")
    doc = np.asarray(tok.encode(text * 40), np.int32)
    other = np.asarray(tok.encode("A short question about gardens, weather and trains. " * 8))
    return doc[:460], doc[:1100], np.concatenate([doc[:800], other[:50]])


def _fill(eng, prompts):
    """Slot 0: a one-program prefill; slot 2: block by block (the server's path);
    slot 3: a prompt that shares slot 2's first 800 tokens."""
    first = [eng.prefill(0, prompts[0])]
    for slot, ids in ((2, prompts[1]), (3, prompts[2])):
        for start in range(0, len(ids), PREFILL_CHUNK):
            tok = eng.prefill_chunk(slot, ids, start)
        first.append(tok)
    return first


@pytest.mark.parametrize("policy", [None, scheduler.LRU], ids=["predictive", "lru"])
def test_offload_decodes_the_same_tokens_and_logits_as_all_resident(model, policy):
    """A budget of 64 cold tokens per head (4 pages of the prompts' 25-65 cold
    pages): selection decides what is read, pages move in and out of the working
    sets. 20 steps, then slot 0 is released and refilled with another prompt
    (its old pages must leave the working sets) and 8 more."""
    m, tok = model
    prompts = _prompts(tok)
    kw = {"max_seqs": 4, "max_context": 1536, "budget_tokens": 64}
    resident, off = Engine(m, **kw), Engine(m, **kw, offload=True, policy=policy)
    c = off.cache_cfg
    assert off.caches.int4_k.shape[2] == 0  # no cold codes on the device
    assert off.cold.host["int4_k"].sharding.memory_kind in ("pinned_host", "unpinned_host")
    assert _fill(off, prompts) == _fill(resident, prompts)
    np.testing.assert_array_equal(np.asarray(off.logits), np.asarray(resident.logits))
    off.warmup(16)  # its step with no active slot changes nothing
    assert off.prefix_stats()["hits"] > 0  # slot 3 shares slot 2's pages
    for step in range(28):
        if step == 20:
            for eng in (off, resident):
                eng.release(0)
                eng.prefill(0, prompts[2][::-1].copy())
        np.testing.assert_array_equal(off.decode_step(), resident.decode_step())
        np.testing.assert_array_equal(np.asarray(off.logits), np.asarray(resident.logits))
    got = off.offload_counters()
    assert got["selected"] > 0 and got["misses"] > 0 and got["hits"] > got["misses"]
    assert (got["prefetched"] > 0) == (policy is None)
    page = scheduler.page_bytes(c)
    assert got["host_to_device_bytes_copied"] == (got["fetched"] + got["sample_pages_copied"]) * page
    assert 0 < got["hit_rate"] < 1
    # the int32 device counters were moved to the host (a server never sees them wrap)
    assert not np.asarray(off.cold.sched.counters).any() and not np.asarray(off.cold.copied).any()
    assert off.offload_counters() == got
    # every layer's host pool holds what the resident pool holds, page for page
    live = np.flatnonzero(np.asarray(resident.caches.refcount[5]) > 0)
    np.testing.assert_array_equal(np.asarray(off.cold.host["int4_k"][5])[:, live],
                                  np.asarray(resident.caches.int4_k[5])[:, live])
    assert off.pool_usage() == resident.pool_usage()


def test_offload_mode_checks_its_arguments(model):
    m, _ = model
    with pytest.raises(ValueError, match="attention='hisparse'"):
        Engine(m, max_context=256, attention="dense", offload=True)
    with pytest.raises(ValueError, match="working_set must be an int >= "):
        Engine(m, max_context=4096, offload=True, working_set=1)
    with pytest.raises(ValueError, match="offload mode's: pass offload=True"):
        Engine(m, max_context=256, working_set=64)
    with pytest.raises(ValueError, match="offload must be a bool"):
        Engine(m, max_context=256, offload="yes")


def test_an_offloaded_engine_holds_less_on_the_device(model):
    """The capacity line names the host bytes; the device state is smaller by the
    cold codes (the working sets are what it holds of them)."""
    m, _ = model
    resident, off = (Engine(m, max_seqs=2, max_context=4096, offload=o) for o in (False, True))
    dev = lambda e: sum(x.nbytes for x in jax.tree.leaves(e.caches))
    codes = sum(getattr(resident.caches, f).nbytes for f in st.OFFLOAD_FIELDS)
    assert dev(resident) - dev(off) == codes
    host = sum(x.nbytes for x in off.cold.host.values())
    assert host == codes
    assert "offloaded to host memory" in off.capacity_line()
    # the working set is the one the capacity planner sizes (capped at the cold pages)
    mc = m.cfg
    shape = capacity.ModelShape("smollm2", mc.num_layers, mc.num_kv_heads, mc.num_heads,
                                mc.head_dim)
    plan = capacity.plan(shape, 4096, preset=off.cache_cfg, offload=True)
    assert plan["working_set_pages_per_seq_head"] == off.working_set
    assert off.working_set < 2 * off.cache_cfg.candidate_pages



def test_a_narrow_offloaded_step_equals_the_full_one(model):
    """Offload mode's step at low concurrency computes only the slots up to the
    highest active one (`Engine.decode_width`), as the resident step does: two
    sequences in slots 0-1 of 8 step at width 2, and their tokens, logits, every
    cache field and every layer's working set, sample buffer, scheduler state and
    counters equal the full-width step's (the step before widths) bit for bit."""
    m, tok = model
    prompts = _prompts(tok)
    kw = {"max_seqs": 8, "max_context": 1536, "budget_tokens": 64, "offload": True}
    narrow, full = Engine(m, **kw), Engine(m, **kw)
    full.decode_width = lambda active: full.max_seqs
    active = np.arange(8) < 2
    assert narrow.decode_width(active) == 2
    for eng in (narrow, full):
        eng.prefill(0, prompts[0][:440])  # its 16 steps stay within the 464-token window
        eng.prefill(1, prompts[2])
    used, lens = narrow.pool_usage()[0], narrow.lens.copy()
    for _ in range(16):  # slot 1 gets a new cold page (slot 0 none)
        np.testing.assert_array_equal(narrow.decode_step(active), full.decode_step(active))
        np.testing.assert_array_equal(np.asarray(narrow.logits)[:2],
                                      np.asarray(full.logits)[:2])
    c = narrow.cache_cfg
    new = st.num_cold_pages(c, narrow.lens) - st.num_cold_pages(c, lens)
    assert new.tolist()[:2] == [0, 1]
    assert narrow.pool_usage()[0] == used + m.cfg.num_layers  # stored in every layer's pool
    leaves = lambda eng: jax.tree.leaves((eng.caches, eng.cold))
    for a, b in zip(leaves(narrow), leaves(full), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    got = narrow.offload_counters()
    assert got == full.offload_counters() and got["misses"] > 0


def test_the_offloaded_step_lowers_for_an_h200_as_one_program(model):
    """The step lowered for an H200 from this CPU (XLA's attention: no CPU
    kernel): one program whose copies are host computations (`compute_on`) in
    while loops inside the layer loop, and no host callback (nothing waits on
    Python between layers)."""
    from test_kernels import cross_lower

    m, _ = model
    eng = Engine(m, max_seqs=2, max_context=1024, budget_tokens=64, offload=True)
    static = {**eng._static(), "implementation": "xla", "products": "xla"}
    step = functools.partial(decode, **static, n=2)
    txt = cross_lower(step, eng.params, (eng.caches, eng.cold), jnp.asarray(eng.tokens),
                      jnp.asarray(eng.lens), jnp.ones(2, bool), eng._samp())
    assert txt.count('_xla_compute_type = "host"') >= 2 * len(st.OFFLOAD_FIELDS)
    assert "stablehlo.while" in txt and "callback" not in txt
