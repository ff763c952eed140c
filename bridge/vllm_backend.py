"""HiSparse as a vLLM attention backend: `HiSparseBackend` (registered as
`HISPARSE`), its metadata builder and its impl. The CPU override of `CPU_ATTN`
(`bridge/vllm_cpu.py`) reuses all three.

    vllm serve MODEL --attention-backend HISPARSE --block-size 16 --no-enable-prefix-caching

What runs where (see docs/log/vllm.md):
- The builder makes one `runtime.StepPlan` per step on the host: which HiSparse
  slot each request lives in, which requests prefill (exact), convert or decode
  (sparse), and at which pool pages (vLLM's block ids) new cold pages go.
- The impl, once per layer, hands the step's q/k/v to JAX through DLPack
  (`bridge.dlpack`, zero-copy) and runs `runtime.LayerCache.step`; JAX owns the
  compressed cache (a `hisparse_jax.cache.state.CacheState` per layer). The results are
  written into vLLM's preallocated `output`.
- vLLM's own KV tensor is never read. `customize_spec` sizes vLLM's block pool
  with HiSparse's bytes per token (so vLLM's "KV cache size: N tokens" shows the
  capacity), and at the first forward the bridge frees vLLM's buffer (set
  HISPARSE_KEEP_VLLM_KV=1 to keep it) before JAX allocates the same budget.

Only this file and bridge/vllm_cpu.py, bridge/plugin.py import vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import ClassVar

# JAX shares the device with torch: on a GPU it must not take 75% of the memory at
# its first use, only what the HiSparse pools need. Set before jax is imported; this
# module loads only when vLLM picks a HiSparse backend.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from bridge import dlpack
from bridge import runtime as rt
from bridge.plugin import env_flag

# vLLM's own logger tree, so the capacity line shows wherever vLLM's log lines go
# (vllm serve, LLM(...)); the engine-independent runtime logs to "hisparse.bridge".
log = init_logger("vllm.hisparse_bridge")

NAME = "HISPARSE"


# ---------------------------------------------------------------- process-wide state

class _Bridge:
    """One per engine process (each vLLM worker holds its own): the slot table,
    shared by every layer, and the layers' caches."""

    def __init__(self):
        self.base = None        # HiSparseConfig without a pool size
        self.slots = None       # runtime.SlotTable
        self.layers: dict[str, rt.LayerCache] = {}
        self.freed_vllm_kv = False
        self.logged = False
        self.num_layers = 0
        self.seconds = {"plan": 0.0, "layers": 0.0}
        self.first_block: dict[str, int] = {}  # vLLM request id -> its first block
        self.content_bytes = None  # the spec's bytes per (token, KV head)
        self.budgeted = False      # the slots' tiers were taken out of an explicit budget

    def configure(self, *, num_kv_heads, num_heads, head_dim, page_size, max_model_len,
                  max_seqs, num_layers=0):
        self.num_layers = max(self.num_layers, num_layers)
        cfg = rt.make_config(num_kv_heads=num_kv_heads, num_heads=num_heads,
                             head_dim=head_dim, page_size=page_size,
                             max_model_len=max_model_len, max_seqs=max_seqs,
                             overrides=rt.config_overrides())
        if self.base is None:
            self.base = cfg
            # HISPARSE_EXACT=1: a debugging reference that keeps every request's exact
            # K/V staged and never decodes sparsely (no capacity gain).
            self.slots = rt.SlotTable(cfg, exact=env_flag("HISPARSE_EXACT"))
        elif cfg != self.base:
            raise ValueError(f"HiSparse bridge: layers with different shapes ({cfg} vs "
                             f"{self.base}) are not supported")
        return self.base

    def layer(self, name: str, impl, kv_cache: torch.Tensor) -> rt.LayerCache:
        lc = self.layers.get(name)
        if lc is not None:
            return lc
        num_blocks, _, block_size = kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[2]
        if block_size != self.base.page_size:
            raise ValueError(f"HiSparse bridge: kernel block size {block_size} != the "
                             f"page size {self.base.page_size} (use --block-size "
                             f"{self.base.page_size})")
        if not self.freed_vllm_kv and not env_flag("HISPARSE_KEEP_VLLM_KV"):
            # vLLM's buffer (one allocation behind every layer's view) is never read:
            # give its memory back before JAX allocates the HiSparse pools.
            kv_cache.untyped_storage().resize_(0)
            if kv_cache.is_cuda:  # back from torch's caching allocator to the device
                torch.cuda.empty_cache()
            self.freed_vllm_kv = True
        cfg = self.base.replace(num_pool_pages=int(num_blocks))
        self.log_capacity(int(num_blocks))
        # Exact prefill: the impl's kernel (vLLM's own on the CPU), or torch's SDPA,
        # or JAX's (HISPARSE_PREFILL=jax|torch picks one for comparisons).
        prefills = {"": impl.exact_attention, "jax": rt.jax_exact_attention,
                    "torch": torch_exact_attention}
        choice = os.environ.get("HISPARSE_PREFILL", "").strip().lower()
        if choice not in prefills:
            raise ValueError(f"HISPARSE_PREFILL={choice!r}: jax, torch, or unset (the "
                             "impl's own kernel)")
        exact = prefills[choice]
        lc = self.layers[name] = rt.LayerCache(cfg, impl.scale, exact_attention=exact)
        return lc

    def check_budget(self, num_blocks: int | None, spec, num_layers: int):
        """Refuse at start, in one line naming --max-num-seqs, if the HiSparse states
        (max_seqs slots' tiers and a num_blocks-page pool, num_layers layers) need
        more than the num_blocks blocks vLLM allocated at the spec's bytes per token.
        An explicit budget was sized to fit (`content_bytes`); one vLLM measured is
        checked here."""
        if not num_blocks or spec.state_content_bytes is None:
            return  # not the real pool yet (vLLM's profiling), or vLLM's own spec
        cfg, c = self.base, spec.state_content_bytes
        if rt.slots_fit(cfg, num_blocks, c):
            return
        slot, page, fixed = rt.state_parts(cfg)
        have = num_blocks * cfg.page_size * cfg.num_kv_heads * c * num_layers
        need = (cfg.max_seqs * slot + num_blocks * page + fixed) * num_layers
        fit = rt.max_seqs_within(cfg, lambda x: rt.slots_fit(x, num_blocks, c))
        raise ValueError(
            f"HiSparse bridge: --max-num-seqs {cfg.max_seqs} needs {need:,} B "
            f"({need / GiB:.2f} GiB: {slot:,} B of bf16/fp8 tiers per slot per layer, "
            f"{num_layers} layers, beside the {num_blocks:,}-block pool), over the "
            f"{have:,} B ({have / GiB:.2f} GiB) vLLM sized its KV cache at; the largest "
            f"--max-num-seqs that fits is {fit} (or give vLLM an explicit KV budget, "
            f"{BUDGET_FLAGS}, and the bridge takes the slots out of it)")

    def on_schedule(self, scheduler_output):
        """Before vLLM runs a step: learn each new request's first block (the slot
        table's key) and release the slots of requests vLLM says finished, were
        aborted or were preempted, with their staged exact K/V, at once (a request
        that never decodes would otherwise keep them until its slot is reused)."""
        # Finished first, as vLLM's model runner does: an aborted request id may come
        # back as a new request in the same step.
        done = set(scheduler_output.finished_req_ids)
        done |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for rid in done:
            first = self.first_block.pop(rid, None)
            s = None if first is None or self.slots is None else self.slots.finish(first)
            if s is not None:
                for lc in self.layers.values():
                    lc.release(s)
        for r in scheduler_output.scheduled_new_reqs:
            if r.block_ids and r.block_ids[0]:
                self.first_block[r.req_id] = int(r.block_ids[0][0])
        cached = scheduler_output.scheduled_cached_reqs
        for rid, ids in zip(cached.req_ids, cached.new_block_ids):
            # a resumed request starts again at 0 in new blocks (they replace its old)
            if rid in cached.resumed_req_ids and ids and ids[0]:
                self.first_block[rid] = int(ids[0][0])

    def log_capacity(self, num_blocks: int | None):
        """HiSparse's capacity line, once: at start-up where vLLM has set its block
        count before building the metadata builders, else at the first forward."""
        if self.logged or not num_blocks:
            return
        self.logged = True
        from hisparse_jax.cache import layout
        cfg, num_layers = self.base.replace(num_pool_pages=int(num_blocks)), self.num_layers or 1
        per = self.content_bytes or rt.vllm_content_bytes(cfg)
        bf16 = 2 * cfg.head_dim * 2
        b = layout.state_bytes(cfg)
        slot = rt.state_parts(cfg)[0]
        # The library's own line, for max_seqs sequences of max_context tokens.
        log.info("%s", layout.summary_line(cfg.replace(num_pool_pages=None)))
        log.info("HiSparse bridge: %d blocks x %d tokens = %s tokens per layer, "
                 "%d B per token per KV head (bf16 %d B: %.3fx capacity); "
                 "JAX holds %.1f MiB per layer, %.1f MiB over %d layers, of which "
                 "%d slots' tiers %.1f MiB (%s); budget %s cold tokens per KV head",
                 cfg.pool_pages, cfg.page_size, f"{cfg.pool_pages * cfg.page_size:,}", per,
                 bf16, bf16 / per, b.device / 2**20, num_layers * b.device / 2**20,
                 num_layers, cfg.max_seqs, num_layers * cfg.max_seqs * slot / 2**20,
                 "taken out of vLLM's explicit KV budget" if self.budgeted
                 else "within the pool vLLM sized",
                 "all" if cfg.budget_tokens < 0 else cfg.budget_tokens)
        share = cfg.max_seqs * slot / (cfg.pool_pages * cfg.page_size * cfg.num_kv_heads * per)
        if share > 0.5:  # vLLM's default max_num_seqs (128 to 1,024) on a small budget
            log.warning("HiSparse bridge: the slots of --max-num-seqs %d take %.0f%% of the "
                        "KV cache's memory; set it to the sequences you serve for more "
                        "tokens", cfg.max_seqs, 100 * share)

    def counters(self) -> dict:
        out = dict(self.slots.counters) if self.slots else {}
        out.update({f"dlpack_{k}": v for k, v in dlpack.stats().items()})
        out["layers"] = len(self.layers)
        # held now: slots with a request, and slots with staged exact K/V in any layer
        out["slots_in_use"] = self.slots.in_use() if self.slots else 0
        out["staged_slots"] = len({s for lc in self.layers.values() for s in lc.staged})
        out.update({f"seconds_{k}": round(v, 3) for k, v in self.seconds.items()})
        return out


BRIDGE = _Bridge()


def counters() -> dict:
    """The bridge's counters in this process (slots, conversions, DLPack copies)."""
    return BRIDGE.counters()


# ---------------------------------------------------------------- spec

GiB = 2**30
# vLLM's explicit KV budget, which the bridge takes the slots' tiers out of
BUDGET_FLAGS = "--kv-cache-memory-bytes / VLLM_CPU_KVCACHE_SPACE"


def spec_config(spec, max_model_len: int | None, max_seqs: int = 1):
    """The HiSparse config a layer's spec implies (num_heads does not change bytes)."""
    return rt.make_config(num_kv_heads=spec.num_kv_heads, num_heads=spec.num_kv_heads,
                          head_dim=spec.head_size, page_size=spec.block_size,
                          max_model_len=max_model_len or 131072, max_seqs=max_seqs,
                          overrides=rt.config_overrides())


def content_bytes(spec, max_model_len: int | None, max_seqs: int | None = None,
                  budget: int | None = None, num_layers: int | None = None) -> int:
    """Bytes per (KV head, token) for vLLM's block pool, an even number (vLLM views
    the pool in the model dtype).

    With vLLM's KV budget known at start (`kv_cache_memory_bytes`: an explicit
    budget) and max_seqs, the smallest at which the block pool that budget buys
    also pays for max_seqs slots' bf16/fp8 tiers (`runtime.budget_content_bytes`),
    so the bridge's total stays within the budget; if what is left could not hold
    one max_model_len sequence, a one-line ValueError naming --max-num-seqs.
    Otherwise (a budget vLLM measures after this), HiSparse's device bytes per
    token of one max_model_len sequence, its tiers spread over its context
    (`runtime.vllm_content_bytes`); the builder checks the slots then."""
    if not (max_seqs and budget and num_layers):
        return rt.vllm_content_bytes(spec_config(spec, max_model_len))
    cfg = spec_config(spec, max_model_len, max_seqs)
    c = rt.budget_content_bytes(cfg, budget, num_layers)
    if c is None:
        slot = rt.state_parts(cfg)[0]
        fit = rt.max_seqs_within(
            cfg, lambda x: rt.budget_content_bytes(x, budget, num_layers) is not None)
        need = max_seqs * slot * num_layers
        raise ValueError(
            f"HiSparse bridge: --max-num-seqs {max_seqs} needs {need:,} B ({need / GiB:.2f} "
            f"GiB: {slot:,} B of bf16/fp8 tiers per slot per layer, {num_layers} layers) "
            f"outside vLLM's block pool, which leaves too little of vLLM's KV budget of "
            f"{budget:,} B ({budget / GiB:.2f} GiB, {BUDGET_FLAGS}) for one "
            f"{max_model_len:,}-token sequence; the largest --max-num-seqs that fits is {fit}")
    return c


_MODEL: dict = {}  # from vLLM's config when the impls are built (the spec is sized later)


def _record_model_config():
    from vllm.config import get_current_vllm_config_or_none
    vc = get_current_vllm_config_or_none()
    if vc is None or vc.model_config is None:
        return
    mc = vc.model_config
    _MODEL["max_model_len"] = mc.max_model_len
    _MODEL["max_num_seqs"] = getattr(vc.scheduler_config, "max_num_seqs", None)
    _MODEL["kv_budget"] = getattr(vc.cache_config, "kv_cache_memory_bytes", None)
    try:  # attention layers on this device (one: the builder refuses parallelism)
        _MODEL["num_layers"] = mc.get_num_layers_by_block_type(vc.parallel_config, "attention")
    except Exception:  # noqa: BLE001  (a stand-in config: no budget accounting)
        _MODEL["num_layers"] = None


def customize_spec(spec):
    """vLLM's block pool sized by HiSparse's bytes: `state_content_bytes` per (KV head,
    token) = `content_bytes` (vLLM's bf16 K+V take 4 * head_size)."""
    if spec.state_content_bytes is not None or spec.head_size != spec.head_size_v:
        return spec
    _record_model_config()
    mml = _MODEL.get("max_model_len")
    if mml is None:
        log.warning("HiSparse bridge: max_model_len unknown when sizing the KV cache; "
                    "using the long-context figure")
    args = (_MODEL.get("max_num_seqs"), _MODEL.get("kv_budget"), _MODEL.get("num_layers"))
    BRIDGE.budgeted = all(args)
    return dataclasses.replace(spec, state_content_bytes=content_bytes(spec, mml, *args))


# ---------------------------------------------------------------- start-up checks, hooks

# The extra that brings JAX's CUDA build (pyproject.toml; README, docs/log/vllm.md)
CUDA_INSTALL = 'pip install "hisparse[vllm,cuda12]"'


def check_jax_device(device) -> None:
    """vLLM on CUDA needs JAX on the GPU too: a CPU-only jaxlib cannot take vLLM's CUDA
    tensors and would fail at the first forward, so refuse at start."""
    if torch.device(device).type != "cuda":
        return
    import jax
    backend = jax.default_backend()
    if backend != "gpu":
        raise RuntimeError(f"HiSparse bridge: vLLM runs on CUDA but JAX's default backend "
                           f"is {backend!r} (a CPU-only jaxlib?); install JAX's CUDA build: "
                           f"{CUDA_INSTALL}")


def install_finish_hook() -> bool:
    """Have vLLM's worker tell the bridge each step's scheduler output before it runs
    the step (`_Bridge.on_schedule`: finished, aborted and preempted requests free
    their slots and staged K/V). The attention builder never sees request ids or
    finished requests, so the bridge wraps `Worker.execute_model` (vLLM 0.32 and
    0.33: the CPU worker's and the GPU worker's, either model runner). Idempotent;
    False (and a warning) where vLLM has no such method."""
    from vllm.v1.worker.gpu_worker import Worker
    run = getattr(Worker, "execute_model", None)
    if run is None:
        log.warning("HiSparse bridge: vLLM's Worker has no execute_model; a request that "
                    "never decodes keeps its slot until the slot is reused")
        return False
    if getattr(run, "_hisparse", False):
        return True

    @functools.wraps(run)
    def execute_model(self, scheduler_output, *args, **kwargs):
        if scheduler_output is not None:
            BRIDGE.on_schedule(scheduler_output)
        return run(self, scheduler_output, *args, **kwargs)

    execute_model._hisparse = True
    Worker.execute_model = execute_model
    return True


# ---------------------------------------------------------------- metadata

@dataclasses.dataclass
class HiSparseMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    plan: rt.StepPlan
    causal: bool = True


class HiSparseMetadataBuilder(AttentionMetadataBuilder[HiSparseMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        cc = vllm_config.cache_config
        if getattr(cc, "enable_prefix_caching", False):
            raise ValueError("the HiSparse bridge needs prefix caching off "
                             "(--no-enable-prefix-caching / enable_prefix_caching=False)")
        if vllm_config.speculative_config is not None:
            raise ValueError("the HiSparse bridge does not support speculative decoding")
        mc = vllm_config.model_config
        world = getattr(vllm_config.parallel_config, "world_size", 1)
        if world > 1:  # one JAX state per layer, on one device
            raise ValueError(f"the HiSparse bridge runs on one device, not {world} "
                             "(tensor, pipeline or data parallelism)")
        if getattr(mc, "is_hybrid", False):  # freeing vLLM's buffer would free their state
            raise ValueError("the HiSparse bridge does not support hybrid models (attention "
                             "with Mamba or linear-attention layers)")
        if kv_cache_spec.head_size != getattr(kv_cache_spec, "head_size_v",
                                              kv_cache_spec.head_size):
            raise ValueError(f"the HiSparse bridge needs the value head size equal to the "
                             f"key's ({kv_cache_spec.head_size_v} != {kv_cache_spec.head_size})")
        check_jax_device(device)
        BRIDGE.configure(
            num_kv_heads=kv_cache_spec.num_kv_heads,
            num_heads=mc.get_num_attention_heads(vllm_config.parallel_config),
            head_dim=kv_cache_spec.head_size, page_size=kv_cache_spec.block_size,
            max_model_len=mc.max_model_len,
            max_seqs=vllm_config.scheduler_config.max_num_seqs, num_layers=len(layer_names))
        BRIDGE.content_bytes = kv_cache_spec.state_content_bytes
        num_blocks = getattr(cc, "num_gpu_blocks", None)
        BRIDGE.check_budget(num_blocks, kv_cache_spec, len(layer_names))
        BRIDGE.log_capacity(num_blocks)
        install_finish_hook()

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> HiSparseMetadata:
        m = common_attn_metadata
        qsl = (m.query_start_loc_cpu if m.query_start_loc_cpu is not None
               else m.query_start_loc).cpu().numpy()
        seq_lens = m.seq_lens.cpu().numpy()
        bt = m.block_table_tensor.cpu().numpy()
        pre = m.is_prefilling.cpu().numpy() if getattr(m, "is_prefilling", None) is not None \
            else None
        if not (m.causal is True):
            raise ValueError("the HiSparse bridge serves causal decoder attention only")
        t0 = time.perf_counter()
        plan = BRIDGE.slots.plan(qsl, seq_lens, bt, m.num_reqs, m.num_actual_tokens, pre)
        BRIDGE.seconds["plan"] += time.perf_counter() - t0
        return HiSparseMetadata(
            num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len, query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens, block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping, plan=plan)


# ---------------------------------------------------------------- impl

class TorchBatch:
    """The step's q/k/v rows as JAX arrays, through DLPack (runtime.LayerCache's
    `batch`). Rows are gathered or zero-padded in torch into fresh (aligned,
    compact) tensors, so every crossing is zero-copy and JAX sees static shapes."""

    def __init__(self, query, key, value):
        self.t = (query, key, value)

    def rows(self, start, n, pad):
        out = []
        for x in self.t:
            y = torch.zeros((pad, *x.shape[1:]), dtype=x.dtype, device=x.device)
            y[:n] = x[start:start + n]
            out.append(dlpack.to_jax(y))
        return tuple(out)

    def gather(self, rows):
        idx = torch.from_numpy(np.asarray(rows, np.int64)).to(self.t[0].device)
        return tuple(dlpack.to_jax(torch.index_select(x, 0, idx).contiguous()) for x in self.t)


def _as_torch(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else dlpack.to_torch(x)


def write_results(out3: torch.Tensor, results) -> None:
    """Write LayerCache.step's results into vLLM's output, viewed as [T, Hq, D]."""
    for kind, a, b, *rest in results:
        if kind == "range":
            out3[a:a + b].copy_(_as_torch(rest[0])[:b])
        else:
            rows = torch.from_numpy(np.asarray(a, np.int64)).to(out3.device)
            src = _as_torch(b)[:len(rows)]
            out3.index_copy_(0, rows, src.to(out3.dtype))


def torch_exact_attention(q, kbuf, vbuf, ctx: int, n: int, scale: float) -> torch.Tensor:
    """Exact causal attention of a staged prefill chunk in torch: q [>= n, Hq, D] at
    positions ctx.. over kbuf, vbuf [cap, Hkv, D] rows [0, ctx + n) -> [n, Hq, D]
    float32.

    torch's CPU flash kernel (scaled_dot_product_attention), float32 like vLLM's CPU
    kernel, reads JAX's staging buffers through DLPack views (nothing is copied); the
    same math as runtime.jax_exact_attention and faster (docs/log/code-timings.md,
    "torch prefill"). A later chunk
    of a chunked prefill (ctx > 0) passes its causal mask explicitly."""
    f32 = torch.float32  # bf16 SDPA drifts from vLLM's CPU kernel sooner (measured)
    qt = dlpack.to_torch(q)[:n].to(f32).transpose(0, 1).unsqueeze(0)
    kt = dlpack.to_torch(kbuf)[:ctx + n].to(f32).transpose(0, 1).unsqueeze(0)
    vt = dlpack.to_torch(vbuf)[:ctx + n].to(f32).transpose(0, 1).unsqueeze(0)
    gqa = qt.shape[1] != kt.shape[1]
    if ctx == 0:
        o = torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        pos = torch.arange(ctx + n, device=qt.device)
        mask = pos[None, :] <= (ctx + torch.arange(n, device=qt.device))[:, None]
        o = torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)


class HiSparseImplMixin:
    """The forward pass shared by the HISPARSE impl and the CPU_ATTN override."""

    exact_attention = staticmethod(torch_exact_attention)

    def _hisparse_init(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                       sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                       kv_sharing_target_layer_name, sinks=None):
        why = unsupported(alibi_slopes=alibi_slopes, sliding_window=sliding_window,
                          kv_cache_dtype=kv_cache_dtype, logits_soft_cap=logits_soft_cap,
                          attn_type=attn_type, kv_sharing=kv_sharing_target_layer_name,
                          sinks=sinks, head_size=head_size)
        if why:
            raise NotImplementedError(f"HiSparse bridge: {why}")
        _record_model_config()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None
        self.alibi_slopes = None
        self.sliding_window = -1
        self.logits_soft_cap = 0
        self.sinks = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("HiSparse bridge: fused output quantization")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        t0 = time.perf_counter()
        lc = BRIDGE.layer(layer.layer_name, self, kv_cache)
        n = attn_metadata.num_actual_tokens
        results = lc.step(attn_metadata.plan, TorchBatch(query[:n], key[:n], value[:n]))
        if results:
            out3 = output.view(output.shape[0], self.num_heads, -1)
            write_results(out3, results)
        BRIDGE.seconds["layers"] += time.perf_counter() - t0
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        """Nothing: the cache is written in `forward` (forward_includes_kv_cache_update)."""
        return


def unsupported(*, alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto",
                logits_soft_cap=None, attn_type=AttentionType.DECODER, kv_sharing=None,
                sinks=None, head_size=64) -> str | None:
    """Why a layer cannot run on HiSparse, or None."""
    if attn_type != AttentionType.DECODER:
        return f"attention type {attn_type} (decoder self-attention only)"
    if alibi_slopes is not None:
        return "ALiBi"
    if sliding_window not in (None, -1):
        return "sliding-window attention"
    if logits_soft_cap not in (None, 0, 0.0):
        return "logits soft-capping"
    if sinks is not None:
        return "attention sinks"
    if kv_sharing is not None:
        return "cross-layer KV sharing"
    if kv_cache_dtype not in ("auto", "bfloat16", "float16"):
        return f"kv_cache_dtype {kv_cache_dtype!r} (HiSparse quantizes itself: use auto)"
    if head_size % 2:
        return f"odd head size {head_size}"
    return None


class HiSparseImpl(HiSparseImplMixin, AttentionImpl[HiSparseMetadata]):
    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None,
                 sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None,
                 attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None, **extra):
        self._hisparse_init(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                            sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                            kv_sharing_target_layer_name, sinks)


class HiSparseBackend(AttentionBackend):
    """vLLM attention backend `HISPARSE` (GPU path; on a CPU host see vllm_cpu)."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "bfloat16", "float16"]

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls():
        return HiSparseImpl

    @staticmethod
    def get_builder_cls():
        return HiSparseMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [MultipleOf(16)]

    @classmethod
    def supports_block_size(cls, block_size):
        return block_size is None or (block_size >= 16 and block_size & (block_size - 1) == 0)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [32, 64, 96, 128, 256]

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec):
        return customize_spec(spec)
