"""The backend against vLLM's real classes, outside an engine: the builder on a real
CommonAttentionMetadata, forward on mixed batches against a dense torch reference
(exact prefill, sparse decode), profiling runs and padding, the spec,
validate_configuration and supports_kv_cache_dtype.

It runs twice: against the CPU build (vLLM 0.32: the HISPARSE backend and the
CPU_ATTN override, with vLLM's real config objects), and against vLLM 0.33's
Python classes (test_bridge_vllm033.py runs this file with 0.33 first on
sys.path: the GPU path's HISPARSE backend; 0.33's CUDA build has no platform here,
so the engine config is a stand-in with the fields the builder reads)."""

from __future__ import annotations

import contextlib
import dataclasses
import types

import numpy as np
import pytest
import torch
import vllm
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec

from bridge import runtime as rt
from bridge import vllm_backend as vb

VLLM_033 = vllm.__version__.startswith("0.33")
if VLLM_033:
    BACKENDS = [vb.HiSparseBackend]
else:
    from vllm.config import (
        CacheConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from bridge import vllm_cpu
    BACKENDS = [vb.HiSparseBackend, vllm_cpu.HiSparseCPUBackend]

HQ, HKV, D, BS = 9, 3, 64, 16
NUM_BLOCKS = 64

# vLLM's CPU kernel (the CPU override's exact prefill) picks AMX where the CPU has it;
# outside an engine the process must ask for AMX tile permission first, or it dies
# with SIGILL (docs/log/vllm.md).
if hasattr(torch._C, "_cpu") and hasattr(torch._C._cpu, "_init_amx"):
    torch._C._cpu._init_amx()


def fake_config(prefix_caching=False):
    """The fields of a VllmConfig the builder and the impl read (vLLM 0.33 here)."""
    mc = types.SimpleNamespace(max_model_len=2048, get_num_attention_heads=lambda pc: HQ)
    return types.SimpleNamespace(
        model_config=mc, parallel_config=None, speculative_config=None,
        cache_config=types.SimpleNamespace(enable_prefix_caching=prefix_caching),
        scheduler_config=types.SimpleNamespace(max_num_seqs=4))


def config_context(vc):
    if VLLM_033:
        vb._MODEL["max_model_len"] = 2048
        return contextlib.nullcontext()
    return set_current_vllm_config(vc)


@pytest.fixture(scope="module")
def vllm_config(request):
    if VLLM_033:
        return fake_config()
    smollm2_hf = request.getfixturevalue("smollm2_hf")
    mc = ModelConfig(smollm2_hf, max_model_len=2048, dtype="bfloat16")
    return VllmConfig(model_config=mc,
                      cache_config=CacheConfig(block_size=BS, enable_prefix_caching=False),
                      scheduler_config=SchedulerConfig(max_num_seqs=4, max_model_len=2048,
                                                       is_encoder_decoder=False))


@pytest.fixture
def bridge(monkeypatch):
    fresh = vb._Bridge()
    monkeypatch.setattr(vb, "BRIDGE", fresh)
    return fresh


SPEC = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.bfloat16)


def common(reqs, pad=0):
    """reqs: [(ctx, n, blocks)] -> CommonAttentionMetadata (+ `pad` padding tokens)."""
    qsl = np.cumsum([0] + [n for _, n, _ in reqs])
    seq = [c + n for c, n, _ in reqs]
    w = max(len(b) for *_, b in reqs)
    bt = torch.zeros(len(reqs), w, dtype=torch.int32)
    slots = []
    for i, (c, n, b) in enumerate(reqs):
        bt[i, :len(b)] = torch.tensor(b)
        slots += [b[p // BS] * BS + p % BS for p in range(c, c + n)]
    slots += [-1] * pad
    q = torch.tensor(qsl, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=q, query_start_loc_cpu=q, seq_lens=torch.tensor(seq, dtype=torch.int32),
        num_reqs=len(reqs), num_actual_tokens=int(qsl[-1]), max_query_len=max(
            n for _, n, _ in reqs), max_seq_len=max(seq), block_table_tensor=bt,
        slot_mapping=torch.tensor(slots, dtype=torch.int64))


def dense_ref(q, k, v, qpos):
    kk = k.double().repeat_interleave(HQ // HKV, dim=1)
    vv = v.double().repeat_interleave(HQ // HKV, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.double(), kk) / D ** 0.5
    mask = torch.arange(k.shape[0])[None, :] <= torch.as_tensor(qpos)[:, None]
    p = torch.softmax(logits.masked_fill(~mask[None], float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", p, vv)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_mixed_batches_equal_dense(vllm_config, bridge, backend):
    g = torch.Generator().manual_seed(0)
    tot = {"a": 60, "b": 30}
    Q = {r: torch.randn(n, HQ, D, generator=g).bfloat16() for r, n in tot.items()}
    K = {r: torch.randn(n, HKV, D, generator=g).bfloat16() for r, n in tot.items()}
    V = {r: torch.randn(n, HKV, D, generator=g).bfloat16() for r, n in tot.items()}
    blocks = {"a": [5, 9, 2, 40], "b": [7, 3]}
    with config_context(vllm_config):
        builder = backend.get_builder_cls()(SPEC, ["l0"], vllm_config, torch.device("cpu"))
        impl = backend.get_impl_cls()(HQ, D, D ** -0.5, HKV, None, None, "auto")
    if backend.get_name() == "CPU_ATTN":
        assert isinstance(impl, CPUAttentionBackendImpl) and backend.get_name() == "CPU_ATTN"
    layer = types.SimpleNamespace(layer_name="l0")
    kv_cache = torch.zeros(NUM_BLOCKS, HKV, BS, 2 * D, dtype=torch.bfloat16)
    done = {"a": 0, "b": 0}
    # step 1: a prefills 50; step 2: a decodes (converts), b prefills 20 (+3 padding
    # tokens); step 3: both; then decodes.
    for sched, pad in [([("a", 50)], 0), ([("a", 1), ("b", 20)], 3),
                       ([("a", 1), ("b", 7)], 0)] + [([("a", 1), ("b", 1)], 1)] * 3:
        reqs = [(done[r], n, blocks[r]) for r, n in sched]
        m = common(reqs, pad)
        meta = builder.build(0, m)
        rows = [(r, done[r], done[r] + n) for r, n in sched]
        q = torch.cat([Q[r][a:b] for r, a, b in rows] + [torch.zeros(pad, HQ, D).bfloat16()])
        k = torch.cat([K[r][a:b] for r, a, b in rows] + [torch.zeros(pad, HKV, D).bfloat16()])
        v = torch.cat([V[r][a:b] for r, a, b in rows] + [torch.zeros(pad, HKV, D).bfloat16()])
        out = torch.full((q.shape[0], HQ * D), float("nan"), dtype=torch.bfloat16)
        assert impl.forward(layer, q, k, v, kv_cache, meta, out) is out
        want = torch.cat([dense_ref(Q[r][a:b], K[r][:b], V[r][:b], torch.arange(a, b))
                          for r, a, b in rows])
        got = out.view(-1, HQ, D)
        n = m.num_actual_tokens
        torch.testing.assert_close(got[:n].double(), want, atol=1e-2, rtol=1e-2)
        assert torch.isnan(got[n:]).all()  # padding rows are not written
        for r, nn in sched:
            done[r] += nn
    # profiling run: no metadata, output untouched
    out = torch.full((4, HQ * D), 3.0, dtype=torch.bfloat16)
    z = torch.zeros(4, HQ, D).bfloat16()
    assert impl.forward(layer, z, z[:, :HKV], z[:, :HKV], kv_cache, None, out) is out
    assert (out == 3.0).all()
    c = vb.counters()
    assert c["converted"] == 2 and c["dlpack_to_jax_copies"] == 0
    assert c["decode_tokens"] == 1 + 1 + 3 * 2  # steps 2 and 3: a; steps 4-6: a and b
    assert kv_cache.untyped_storage().nbytes() == 0  # vLLM's buffer was given back


def test_spec_is_sized_by_hisparse_bytes(vllm_config):
    with config_context(vllm_config):
        spec = vb.HiSparseBackend.customize_spec(SPEC)
    cfg = rt.make_config(num_kv_heads=HKV, num_heads=HKV, head_dim=D, page_size=BS,
                         max_model_len=2048, max_seqs=1)
    assert spec.state_content_bytes == rt.vllm_content_bytes(cfg)
    assert SPEC.page_size_bytes / spec.page_size_bytes == pytest.approx(
        rt.predicted_capacity_factor(cfg))
    assert 2.0 < rt.predicted_capacity_factor(cfg) < 3.2
    for backend in BACKENDS:
        assert backend.customize_spec(SPEC) == spec


GiB = 2**30


def budget_config(vllm_config, max_num_seqs, budget):
    """vLLM's config with an explicit KV budget (--kv-cache-memory-bytes;
    VLLM_CPU_KVCACHE_SPACE sets the same field) and --max-num-seqs."""
    if VLLM_033:  # the stand-in: what _record_model_config reads from a real one
        vc = fake_config()
        vc.scheduler_config.max_num_seqs = max_num_seqs
        vc.cache_config.kv_cache_memory_bytes = budget
        vc.model_config.get_num_layers_by_block_type = lambda pc, kind: 30
        return vc
    return VllmConfig(model_config=vllm_config.model_config,
                      cache_config=CacheConfig(block_size=BS, enable_prefix_caching=False,
                                               kv_cache_memory_bytes=budget),
                      scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                       max_model_len=2048,
                                                       is_encoder_decoder=False))


def budget_context(vc, monkeypatch):
    if VLLM_033:  # no current config on 0.33 here: record what a real one gives
        monkeypatch.setattr(vb, "_MODEL", {
            "max_model_len": 2048, "max_num_seqs": vc.scheduler_config.max_num_seqs,
            "kv_budget": vc.cache_config.kv_cache_memory_bytes, "num_layers": 30})
        return contextlib.nullcontext()
    return set_current_vllm_config(vc)


# SmolLM2 (30 layers) at max_model_len 2048 with a 1 GiB budget: a slot's tiers take
# 219,013 B a layer; 161 slots leave room for one 2K sequence. 128 and 256 are vLLM's
# CPU defaults (server, LLM class).
@pytest.mark.parametrize("max_num_seqs, fits", [(8, True), (128, True), (161, True),
                                                (162, False), (256, False)])
def test_spec_takes_the_slots_out_of_an_explicit_budget(vllm_config, bridge, monkeypatch,
                                                        max_num_seqs, fits):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # it would set the budget
    vc = budget_config(vllm_config, max_num_seqs, GiB)
    with budget_context(vc, monkeypatch):
        if not fits:
            with pytest.raises(ValueError) as e:
                vb.HiSparseBackend.customize_spec(SPEC)
            msg = str(e.value)
            assert "\n" not in msg and msg.startswith(
                f"HiSparse bridge: --max-num-seqs {max_num_seqs} needs "
                f"{max_num_seqs * 219_013 * 30:,} B")
            assert "KV budget of 1,073,741,824 B" in msg and "VLLM_CPU_KVCACHE_SPACE" in msg
            assert msg.endswith("the largest --max-num-seqs that fits is 161")
            return
        spec = vb.HiSparseBackend.customize_spec(SPEC)
    assert bridge.budgeted
    c = spec.state_content_bytes
    blocks = GiB // (30 * spec.page_size_bytes)  # vLLM's division
    cfg = rt.make_config(num_kv_heads=HKV, num_heads=HQ, head_dim=D, page_size=BS,
                         max_model_len=2048, max_seqs=max_num_seqs, num_blocks=blocks)
    from hisparse_jax.cache import layout
    assert 30 * layout.state_bytes(cfg).device <= 30 * blocks * spec.page_size_bytes <= GiB
    assert c == rt.budget_content_bytes(cfg, GiB, 30) and c % 2 == 0
    # without a budget (vLLM measures it later): the per-token figure, checked at start
    assert vb.content_bytes(SPEC, 2048, max_num_seqs) == 98


# vLLM measured its budget after the spec was sized (98 B per token per KV head at
# max_model_len 2048) and made 2,200 blocks: 8 slots fit beside that pool, 9 do not.
@pytest.mark.parametrize("max_num_seqs, fits", [(8, True), (9, False), (128, False)])
def test_builder_refuses_slots_past_the_pool_vllm_sized(bridge, max_num_seqs, fits):
    vc = fake_config()
    vc.scheduler_config.max_num_seqs = max_num_seqs
    vc.cache_config.num_gpu_blocks = 2200
    spec = dataclasses.replace(SPEC, state_content_bytes=98)
    layers = [f"l{i}" for i in range(30)]
    if fits:
        vb.HiSparseMetadataBuilder(spec, layers, vc, torch.device("cpu"))
        return
    with pytest.raises(ValueError) as e:
        vb.HiSparseMetadataBuilder(spec, layers, vc, torch.device("cpu"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"HiSparse bridge: --max-num-seqs {max_num_seqs} ")
    assert "the largest --max-num-seqs that fits is 8" in msg and "--kv-cache-memory-bytes" in msg


@pytest.mark.parametrize("device, jax_backend, refused", [
    ("cuda", "cpu", True),     # vLLM on a GPU, jax[cpu]: it would fail at the first forward
    ("cuda", "gpu", False),
    ("cpu", "cpu", False),
])
def test_builder_refuses_cuda_with_a_cpu_only_jax(bridge, monkeypatch, device, jax_backend,
                                                   refused):
    import jax
    monkeypatch.setattr(jax, "default_backend", lambda: jax_backend)

    def make():
        return vb.HiSparseMetadataBuilder(SPEC, ["l0"], fake_config(), torch.device(device))
    if not refused:
        make()
        return
    with pytest.raises(RuntimeError) as e:
        make()
    msg = str(e.value)
    assert "\n" not in msg and "CUDA" in msg and "'cpu'" in msg
    assert msg.endswith('pip install "hisparse[vllm,cuda12]"')


def new_request(req_id, blocks):
    from vllm.v1.core.sched.output import NewRequestData
    return NewRequestData(req_id=req_id, prompt_token_ids=None, mm_features=[],
                          sampling_params=None, pooling_params=None, block_ids=(blocks,),
                          num_computed_tokens=0, lora_request=None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_finished_requests_free_their_slots_and_staged_kv(vllm_config, bridge, monkeypatch,
                                                          backend):
    """A request that never decodes: `a` prefilled whole (max_tokens 1: vLLM samples its
    one token from the prefill) and `b` aborted after its first prefill chunk. When
    vLLM's scheduler output says they finished, their slots and staged K/V go before
    the step runs, and a new request gets a slot and exact attention."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_worker import Worker
    seen = []
    # vLLM's real Worker class, its step stubbed: the bridge's hook wraps what is there
    monkeypatch.setattr(Worker, "execute_model", lambda self, so: seen.append(so) or "ran")
    assert vb.install_finish_hook() and vb.install_finish_hook()  # idempotent
    g = torch.Generator().manual_seed(1)
    blocks = {"a": [5, 9, 2, 40], "b": [7, 3, 11, 12], "c": [8, 4]}
    with config_context(vllm_config):
        builder = backend.get_builder_cls()(SPEC, ["l0"], vllm_config, torch.device("cpu"))
        impl = backend.get_impl_cls()(HQ, D, D ** -0.5, HKV, None, None, "auto")
    layer = types.SimpleNamespace(layer_name="l0")
    kv_cache = torch.zeros(NUM_BLOCKS, HKV, BS, 2 * D, dtype=torch.bfloat16)

    def step(reqs, new=(), finished=()):
        so = SchedulerOutput.make_empty()
        so.scheduled_new_reqs = [new_request(r, blocks[r]) for r in new]
        so.finished_req_ids = set(finished)
        assert Worker.execute_model(object(), so) == "ran" and seen[-1] is so
        if not reqs:
            return None
        m = common([(0, n, blocks[r]) for r, n in reqs])
        t = m.num_actual_tokens
        q = torch.randn(t, HQ, D, generator=g).bfloat16()
        k, v = (torch.randn(t, HKV, D, generator=g).bfloat16() for _ in range(2))
        out = torch.empty(t, HQ * D, dtype=torch.bfloat16)
        impl.forward(layer, q, k, v, kv_cache, builder.build(0, m), out)
        return q, k, v, out

    step([("a", 50), ("b", 32)], new=("a", "b"))
    lc = bridge.layers["l0"]
    assert len(lc.staged) == 2 and bridge.slots.in_use() == 2
    step([], finished=("a", "b"))  # no tokens: vLLM's step that only reports them
    c = vb.counters()
    assert not lc.staged and c["staged_slots"] == 0 and c["slots_in_use"] == 0
    assert c["released_finished"] == 2 and not bridge.first_block
    q, k, v, out = step([("c", 20)], new=("c",))
    c = vb.counters()
    assert c["slots_in_use"] == 1 and c["evicted_lru"] == c["released_stale"] == 0
    torch.testing.assert_close(out.view(-1, HQ, D).double(), dense_ref(q, k, v, torch.arange(20)),
                               atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_validate_configuration(backend):
    """vLLM's own validate_configuration (0.32 and 0.33 take the same arguments)."""
    ok = {"head_size": 64, "dtype": torch.bfloat16, "kv_cache_dtype": "auto", "block_size": 16,
          "use_mla": False, "has_sink": False, "use_sparse": False, "use_mm_prefix": False,
          "use_per_head_quant_scales": False, "device_capability": None,
          "attn_type": "decoder"}
    assert backend.validate_configuration(**ok) == []
    bad = {"kv_cache_dtype": "fp8", "use_mla": True, "has_sink": True,
           "attn_type": "encoder_only"}
    for k, val in bad.items():
        assert backend.validate_configuration(**{**ok, k: val}), k
    assert backend.validate_configuration(**ok, has_sliding_window=True)
    assert backend.supports_kv_cache_dtype("auto") and backend.supports_kv_cache_dtype(None)
    assert not backend.supports_kv_cache_dtype("fp8")
    assert backend.supports_block_size(16) and backend.supports_block_size(64)
    if backend is vb.HiSparseBackend:
        assert not backend.supports_block_size(24)
        assert backend.get_name() == "HISPARSE"


def test_impl_refuses_what_it_cannot_serve(vllm_config):
    with config_context(vllm_config):
        for kw in ({"sliding_window": 128}, {"alibi_slopes": [1.0] * HQ},
                   {"logits_soft_cap": 30.0}, {"kv_cache_dtype": "fp8"}):
            args = {"num_heads": HQ, "head_size": D, "scale": 0.125, "num_kv_heads": HKV,
                    "alibi_slopes": None, "sliding_window": None, "kv_cache_dtype": "auto"}
            args.update(kw)
            with pytest.raises(NotImplementedError, match="HiSparse"):
                vb.HiSparseImpl(**args)


def test_builder_refuses_prefix_caching(request, bridge):
    if VLLM_033:
        vc = fake_config(prefix_caching=True)
    else:
        mc = ModelConfig(request.getfixturevalue("smollm2_hf"), max_model_len=2048,
                         dtype="bfloat16")
        vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BS,
                                                                  enable_prefix_caching=True))
    with pytest.raises(ValueError, match="prefix caching"):
        vb.HiSparseMetadataBuilder(SPEC, ["l0"], vc, torch.device("cpu"))


@pytest.mark.parametrize("change, message", [
    ("hybrid", "hybrid models"),  # freeing vLLM's buffer would free their layers' state
    ("head_size_v", "value head size equal to the key's"),
    ("parallel", "runs on one device, not 2"),
])
def test_builder_refuses_models_it_would_serve_wrong(bridge, change, message):
    vc, spec = fake_config(), SPEC
    if change == "hybrid":
        vc.model_config.is_hybrid = True
    elif change == "parallel":
        vc.parallel_config = types.SimpleNamespace(world_size=2)
    else:
        spec = dataclasses.replace(SPEC, head_size_v=D // 2)
    with pytest.raises(ValueError, match=message):
        vb.HiSparseMetadataBuilder(spec, ["l0"], vc, torch.device("cpu"))


def test_cpu_backend_takes_only_16_bit_models():
    """vLLM views the byte pool in the model dtype, and HiSparse's bytes per token are
    even, not a multiple of 4: float32 is refused by vLLM's own check, not by a torch
    view error mid-start."""
    from bridge.vllm_cpu import HiSparseCPUBackend
    assert HiSparseCPUBackend.supports_dtype(torch.bfloat16)
    assert not HiSparseCPUBackend.supports_dtype(torch.float32)


def test_plugin_registers_through_vllms_loader():
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    load_general_plugins()
    assert AttentionBackendEnum["HISPARSE"].get_class() is vb.HiSparseBackend
    assert vllm.__version__.startswith("0.33" if VLLM_033 else "0.32")
