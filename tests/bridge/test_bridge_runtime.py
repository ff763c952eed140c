"""The bridge's request -> slot mapping and per-layer cache, against exact attention
(no torch, no vLLM: runs in the main suite, jax 0.11.2, and in the bridge env, jax
0.10.2). A small fake scheduler hands out vLLM-style block tables."""

from __future__ import annotations

import re

import numpy as np
import pytest

from bridge import runtime as rt
from hisparse_jax.config import FULL_BUDGET

HKV, G, D, PG = 3, 3, 64, 16
HQ = HKV * G
SCALE = D ** -0.5


def dense(q, k, v, qpos):
    """Exact causal attention, float64: q [n, Hq, D] at positions qpos; k, v [S, Hkv, D]."""
    kk = np.repeat(k.astype(np.float64), G, axis=1)
    vv = np.repeat(v.astype(np.float64), G, axis=1)
    logits = np.einsum("qhd,khd->hqk", q.astype(np.float64), kk) * SCALE
    mask = np.arange(k.shape[0])[None, :] <= np.asarray(qpos)[:, None]
    logits = np.where(mask[None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, vv)


def bf16(x):
    import ml_dtypes
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


class FakeVllm:
    """Block allocation like vLLM's: a free list, blocks freed when a request ends."""

    def __init__(self, num_blocks, seed=0):
        self.free = list(range(num_blocks))
        self.rng = np.random.default_rng(seed)
        self.rng.shuffle(self.free)
        self.reqs = {}  # name -> dict(blocks, k, v, len)

    def start(self, name, total):
        r = self.rng.standard_normal
        self.reqs[name] = {"blocks": [], "k": bf16(r((total, HKV, D))),
                           "v": bf16(r((total, HKV, D))), "q": bf16(r((total, HQ, D))),
                           "done": 0}

    def finish(self, name):
        self.free.extend(self.reqs.pop(name)["blocks"])

    def batch(self, sched):
        """sched: [(name, n tokens)] -> (metadata arrays, q, k, v, expected rows info)."""
        qsl, sl, bts, q, k, v, info = [0], [], [], [], [], [], []
        for name, n in sched:
            r = self.reqs[name]
            end = r["done"] + n
            while len(r["blocks"]) * PG < end:
                r["blocks"].append(self.free.pop())
            qsl.append(qsl[-1] + n)
            sl.append(end)
            bts.append(r["blocks"])
            q.append(r["q"][r["done"]:end]); k.append(r["k"][r["done"]:end])
            v.append(r["v"][r["done"]:end])
            info.append((name, r["done"], end))
            r["done"] = end
        w = max(len(b) for b in bts)
        bt = np.zeros((len(sched), w), np.int32)
        for i, b in enumerate(bts):
            bt[i, :len(b)] = b
        return (np.array(qsl), np.array(sl), bt, np.concatenate(q), np.concatenate(k),
                np.concatenate(v), info)

    def expected(self, info):
        out = []
        for name, a, b in info:
            r = self.reqs[name]
            out.append(dense(r["q"][a:b], r["k"][:b], r["v"][:b], np.arange(a, b)))
        return np.concatenate(out)


def run_step(table, layer, fake, sched):
    qsl, sl, bt, q, k, v, info = fake.batch(sched)
    plan = table.plan(qsl, sl, bt, len(sched), int(qsl[-1]))
    res = layer.step(plan, rt.ArrayBatch(q, k, v))
    return rt.scatter_results(res, int(qsl[-1]), HQ, D), fake.expected(info), plan


def setup(budget=FULL_BUDGET, max_seqs=3, num_blocks=600, max_model_len=2048, seed=0):
    cfg = rt.make_config(num_kv_heads=HKV, num_heads=HQ, head_dim=D, page_size=PG,
                         max_model_len=max_model_len, max_seqs=max_seqs,
                         num_blocks=num_blocks, overrides={"budget_tokens": budget})
    return cfg, rt.SlotTable(cfg), rt.LayerCache(cfg, SCALE), FakeVllm(num_blocks, seed)


def rel(a, b):
    return np.linalg.norm(a - b, axis=-1).max() / np.linalg.norm(b, axis=-1).mean()


def test_short_requests_exact_mixed_batches():
    """Everything in sink + hot (bf16): prefill and decode equal exact attention, in
    mixed batches of a new prefill, a chunked prefill and decodes."""
    _, table, layer, fake = setup()
    fake.start("a", 100); fake.start("b", 100); fake.start("c", 100)
    got, want, plan = run_step(table, layer, fake, [("a", 37)])
    assert [r.kind for r in plan.reqs] == [rt.STAGE]
    np.testing.assert_allclose(got, want, atol=2e-5)
    got, want, plan = run_step(table, layer, fake, [("a", 1), ("b", 20), ("c", 5)])
    assert [r.kind for r in plan.reqs] == [rt.CONVERT, rt.STAGE, rt.STAGE]
    np.testing.assert_allclose(got, want, atol=2e-5)
    got, want, plan = run_step(table, layer, fake, [("a", 1), ("b", 13), ("c", 1)])
    assert [r.kind for r in plan.reqs] == [rt.DECODE, rt.STAGE, rt.CONVERT]
    np.testing.assert_allclose(got, want, atol=2e-5)
    for _ in range(20):
        got, want, plan = run_step(table, layer, fake, [("a", 1), ("b", 1), ("c", 1)])
        np.testing.assert_allclose(got, want, atol=2e-5)
    assert table.counters["converted"] == 3


@pytest.mark.parametrize("budget", [FULL_BUDGET, 256])
def test_long_request_equals_the_library_cache(budget):
    """Past the hot window (fp8 warm, int4 cold): a chunked prefill is exact, and
    decode equals HiSparseCache fed the same K/V (the bridge drives the library,
    it does not change it); cold pages sit at the request's block ids."""
    from hisparse_jax.cache.handle import HiSparseCache

    cfg, table, layer, fake = setup(budget=budget)
    fake.start("a", 1300)
    for n in (512, 512, 200):  # a chunked prefill
        got, want, _ = run_step(table, layer, fake, [("a", n)])
        np.testing.assert_allclose(got, want, atol=5e-5)
    ref = HiSparseCache(cfg.replace(max_seqs=1, num_pool_pages=None))
    r = fake.reqs["a"]
    ref.prefill(0, r["k"][:1224], r["v"][:1224])
    for t in range(1224, 1264):
        got, want, _ = run_step(table, layer, fake, [("a", 1)])
        ref.append(r["k"][t:t + 1], r["v"][t:t + 1])
        np.testing.assert_allclose(got, np.asarray(ref.attend(r["q"][t:t + 1])), atol=1e-5)
        if budget == FULL_BUDGET:  # int4 on random Gaussian K/V: a loose sanity bound
            assert rel(got, want) < 0.3
    slot = int(table.key.tolist().index(fake.reqs["a"]["blocks"][0]))
    row = np.asarray(layer.state.page_table[slot])
    blocks = np.asarray(fake.reqs["a"]["blocks"])
    cold = row >= 0
    np.testing.assert_array_equal(row[cold], blocks[np.flatnonzero(cold)])
    assert cold.sum() == int(rt.st.num_cold_pages(cfg, 1264))


def test_reused_blocks_show_no_stale_pages():
    """Request b gets the blocks of finished request a (and a's slot): its outputs
    are bit-equal to b run alone on a fresh cache."""
    def run_b(table, layer, fake):
        fake.start("b", 1100)
        outs = [run_step(table, layer, fake, [("b", 1000)])[0]]
        outs += [run_step(table, layer, fake, [("b", 1)])[0] for _ in range(30)]
        return np.concatenate(outs)

    _, table, layer, fake = setup(budget=128, max_seqs=1, num_blocks=80, seed=1)
    fake.start("a", 1250)
    run_step(table, layer, fake, [("a", 1200)])
    for _ in range(20):
        run_step(table, layer, fake, [("a", 1)])
    used = list(fake.reqs["a"]["blocks"])
    fake.finish("a")
    fake.free = [b for b in fake.free if b not in used] + used[::-1]  # pop() gives a's first
    got = run_b(table, layer, fake)
    assert set(fake.reqs["b"]["blocks"][:20]) <= set(used)

    _, table2, layer2, fake2 = setup(budget=128, max_seqs=1, num_blocks=80, seed=1)
    fake2.start("a", 1250)  # same random draws as above, different block ids
    fake2.reqs.pop("a")
    want = run_b(table2, layer2, fake2)
    np.testing.assert_array_equal(got, want)


def test_a_narrow_decode_step_equals_the_full_one(monkeypatch):
    """Two requests in slots 0 and 1 of 8 decode in the 2-slot program
    (`state.decode_width`): outputs and cache bit-equal to computing all 8 slots."""
    def run(width_rule):
        monkeypatch.setattr(rt.st, "decode_width", width_rule)
        _, table, layer, fake = setup(budget=256, max_seqs=8)
        fake.start("a", 1300); fake.start("b", 1000)
        outs = [run_step(table, layer, fake, [("a", 1200), ("b", 900)])[0]]
        outs += [run_step(table, layer, fake, [("a", 1), ("b", 1)])[0] for _ in range(40)]
        return np.concatenate(outs), layer.state

    widths = []

    def narrow(max_seqs, top):
        widths.append(real(max_seqs, top))
        return widths[-1]

    real = rt.st.decode_width
    got, state = run(narrow)
    assert set(widths) == {2}
    want, ref = run(lambda max_seqs, top: max_seqs)
    np.testing.assert_array_equal(got, want)
    for f in rt.st.CacheState.__dataclass_fields__:
        np.testing.assert_array_equal(np.asarray(getattr(state, f)), np.asarray(getattr(ref, f)),
                                      err_msg=f)


def test_finished_slot_is_reclaimed_and_prefix_hits_refused():
    _, table, layer, fake = setup(max_seqs=2)
    for name in ("a", "b"):
        fake.start(name, 40)
        run_step(table, layer, fake, [(name, 30)])
    fake.finish("a"); fake.finish("b")
    fake.start("c", 40)
    run_step(table, layer, fake, [("c", 30)])  # a slot comes back (stale or LRU)
    assert table.counters["released_stale"] + table.counters["evicted_lru"] >= 1
    # A request that continues without a start here (a prefix-cache hit) is refused.
    fake.start("d", 40)
    fake.reqs["d"]["done"] = 16
    qsl, sl, bt, *_ = fake.batch([("d", 8)])
    with pytest.raises(rt.BridgeError, match="prefix"):
        table.plan(qsl, sl, bt, 1, 8)


def test_a_finished_request_frees_its_slot_and_staged_kv():
    """A request that never decodes (max_tokens 1, or aborted mid-prefill): when vLLM
    says it finished, its slot and staged exact K/V go at once, and the slot serves
    the next request exactly."""
    _, table, layer, fake = setup(max_seqs=2)
    fake.start("a", 60)
    run_step(table, layer, fake, [("a", 40)])  # a first prefill chunk: staged, then done
    first, (slot,) = fake.reqs["a"]["blocks"][0], layer.staged
    assert table.in_use() == 1
    assert table.finish(first) == slot
    layer.release(slot)
    assert not layer.staged and table.in_use() == 0
    assert table.counters["released_finished"] == 1
    assert table.finish(first) is None  # told twice, or a request that never ran
    fake.finish("a")
    fake.start("b", 30)
    got, want, plan = run_step(table, layer, fake, [("b", 30)])
    assert plan.reqs[0].slot == slot and not plan.releases
    assert rel(got, want) < 2e-2


# SmolLM2's shapes (3 KV heads of 64, 30 layers) at max_model_len 8192: each slot
# holds 221,701 B of tiers and page-table row in every layer, whatever the pool.
# content: bytes per (token, KV head) for vLLM's pool (None: refused); most: the
# largest max_seqs up to this one that the budget takes
@pytest.mark.parametrize("max_seqs, budget_gib, content, most", [
    (8, 1, 86, 8),          # the docs' commands: the 86 B the per-token figure gives
    (8, 2, 84, 8),          # a bigger budget spreads the slots thinner
    (152, 1, 1378, 152),    # the most slots that leave 1 GiB room for one 8K sequence
    (153, 1, None, 152),
    (128, 1, 388, 128),     # vLLM's CPU server default, at VLLM_CPU_KVCACHE_SPACE=1
    (128, 2, 134, 128),
    (1024, 2, None, 313),   # vLLM's default on a big GPU
    (1024, 8, 388, 1024),
])
def test_slots_are_taken_out_of_an_explicit_budget(max_seqs, budget_gib, content, most):
    from hisparse_jax.cache import layout
    cfg = rt.make_config(num_kv_heads=HKV, num_heads=HQ, head_dim=D, page_size=PG,
                         max_model_len=8192, max_seqs=max_seqs)
    budget, layers = budget_gib * 2**30, 30
    assert rt.state_parts(cfg)[0] == 221_701
    c = rt.budget_content_bytes(cfg, budget, layers)
    assert c == content
    assert rt.max_seqs_within(cfg, lambda x: rt.budget_content_bytes(x, budget, layers)) \
        == most
    if c is None:
        return
    per_block = PG * HKV * c  # one layer's block at c bytes per (token, KV head)
    blocks = budget // (layers * per_block)  # vLLM's own division
    # JAX's states (slots and a pool page per block) within what vLLM allocates ...
    total = layers * layout.state_bytes(cfg.replace(num_pool_pages=blocks)).device
    assert total <= layers * blocks * per_block <= budget
    assert blocks - 1 >= cfg.max_pages  # ... which holds one 8K sequence (+ a null block)
    # and c is the least that does: 2 B less per token would not hold the slots
    fewer = budget // (layers * PG * HKV * (c - 2))
    assert (layers * layout.state_bytes(cfg.replace(num_pool_pages=fewer)).device
            > layers * fewer * PG * HKV * (c - 2))


def test_pool_ids_follow_append_order():
    cfg = rt.make_config(num_kv_heads=HKV, num_heads=HQ, head_dim=D, page_size=PG,
                         max_model_len=4096, max_seqs=2)
    blocks = np.arange(100, 400)
    first_cold = (cfg.sink_pages + cfg.hot_pages + cfg.warm_pages) * PG
    assert rt.append_pool_id(cfg, first_cold - 1, blocks) == -1
    assert rt.append_pool_id(cfg, first_cold, blocks) == 100 + cfg.sink_pages
    assert rt.append_pool_id(cfg, first_cold + 1, blocks) == -1
    np.testing.assert_array_equal(rt.prefill_pool_ids(cfg, first_cold + 33, blocks),
                                  100 + cfg.sink_pages + np.arange(3))


@pytest.mark.parametrize("env, message", [
    ({"HISPARSE_CONFIG": "{hot_tokens: 64}"}, "HISPARSE_CONFIG='{hot_tokens: 64}': not JSON"),
    ({"HISPARSE_CONFIG": "[64]"}, "must be a JSON object of HiSparseConfig fields"),
    ({"HISPARSE_CONFIG": '{"hot_token": 64}'}, "HISPARSE_CONFIG: hot_token: not HiSparseConfig"),
    # the shapes are the model's and vLLM's: max_seqs here failed requests mid-serving
    ({"HISPARSE_CONFIG": '{"max_seqs": 2, "max_context": 1024}'},
     "HISPARSE_CONFIG: max_context, max_seqs: set by the model and vLLM"),
    ({"HISPARSE_BUDGET_TOKENS": "1e3"}, "HISPARSE_BUDGET_TOKENS='1e3': an int"),
    ({"HISPARSE_BUDGET_TOKENS": "lots"}, "HISPARSE_BUDGET_TOKENS='lots': an int"),
])
def test_a_bad_setting_is_an_error_naming_the_variable(env, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        rt.config_overrides(env)


def test_config_from_environment():
    assert rt.config_overrides({"HISPARSE_BUDGET_TOKENS": "all"}) == {"budget_tokens": -1}
    assert rt.config_overrides({"HISPARSE_BUDGET_TOKENS": " ALL "}) == {"budget_tokens": -1}
    assert rt.config_overrides({"HISPARSE_CONFIG": '{"hot_tokens": 64}',
                                "HISPARSE_BUDGET_TOKENS": "480"}) == {
        "hot_tokens": 64, "budget_tokens": 480}
    cfg = rt.make_config(num_kv_heads=3, num_heads=9, head_dim=64, page_size=16,
                         max_model_len=8192, max_seqs=4)
    # SmolLM2 shapes: ~3x fewer bytes per token than vLLM's bf16 (256 B per head).
    assert 2.5 < 256 / rt.bytes_per_token_per_head(cfg) < 3.2


@pytest.mark.parametrize("page", [16, 32, 128])
def test_the_bridge_runs_what_the_engine_runs(page):
    """One function (config.model_preset) makes both: the same selection, tiers and
    value group for the same shapes, the windows and the context in whole blocks."""
    from hisparse_jax.models.engine import model_cache_config
    from hisparse_jax.models.llama import LlamaConfig
    smollm2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
    bridge = rt.make_config(num_kv_heads=3, num_heads=9, head_dim=64, page_size=page,
                            max_model_len=8000, max_seqs=4)
    engine = model_cache_config(smollm2, 8000, 4, bridge.budget_tokens,
                                {"page_size": page})
    assert bridge == engine
    assert (bridge.value_group, bridge.rerank_multiple) == (64, 2.0)
    for n in (bridge.sink_tokens, bridge.hot_tokens, bridge.warm_tokens, bridge.max_context):
        assert n % page == 0
    assert bridge.hot_tokens == max(64, page) and bridge.max_context >= 8000


@pytest.mark.parametrize("max_model_len, page, budget", [
    (2048, 16, 512), (8192, 16, 512), (16384, 16, 1024), (12000, 128, 640),
    (32768, 16, 2048), (131072, 128, 2048)])
def test_default_budget_follows_max_model_len(max_model_len, page, budget):
    """Without HISPARSE_BUDGET_TOKENS the bridge decodes with `hisparse serve`'s
    budget for the same context (a 16th, whole pages, 512-2048); the variable wins."""
    kw = {"num_kv_heads": 3, "num_heads": 9, "head_dim": 64, "page_size": page,
          "max_model_len": max_model_len, "max_seqs": 2}
    assert rt.make_config(**kw).budget_tokens == budget
    env = rt.config_overrides({"HISPARSE_BUDGET_TOKENS": "1024"})
    assert rt.make_config(**kw, overrides=env).budget_tokens == 1024
