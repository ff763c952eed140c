"""Capacity planner: how many bytes a model's HiSparse KV cache needs, per tier,
on the device and on the host, and how many sequences fit in a device budget.

Everything is composed from `hisparse_jax.cache.layout` (one layer's bytes) and, in
offload mode, `hisparse_jax.offload.policy.working_set_bytes` (the resident cold-page
working set and its bookkeeping). Nothing here repeats the per-array arithmetic.

Offload mode (DESIGN §2.3): the int4 codes and value scales of cold pages live
in host memory; the device keeps the sink/hot bf16 tier, the warm fp8 tier, the
digests of every cold page, the page tables and a working set of W resident cold
pages per (sequence, KV head) (default W = 2x the candidate pages of a step,
as `OffloadedCache`).
"""

from __future__ import annotations

import dataclasses
import re

from hisparse_jax.cache import layout
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.config import preset as get_preset
from hisparse_jax.validate import check_number, check_working_set, is_int

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int = 128

    @property
    def gqa_group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


# KV shapes from the models' published configs (only what the cache needs).
MODELS: dict[str, ModelShape] = {m.name: m for m in (
    ModelShape("llama3-8b", 32, 8, 32),
    ModelShape("llama3-70b", 80, 8, 64),
    ModelShape("llama3-405b", 126, 8, 128),
    ModelShape("qwen2.5-7b", 28, 4, 28),
    ModelShape("qwen2.5-72b", 80, 8, 64),
    ModelShape("mistral-7b", 32, 8, 32),
)}


# ---------------------------------------------------------------- sizes

_UNITS = {"": 1, "B": 1,
          "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(text) -> int:
    """'141GB' -> 141e9, '80GiB' -> 80 * 2^30, '1.5T' -> 1.5 * 2^40, '4096' -> 4096.

    Decimal units (KB, MB, GB, TB) are powers of 10, binary ones (KiB, ..., or a
    bare K/M/G/T) powers of 2. Raises ValueError with the accepted forms otherwise.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*", str(text))
        unit = m.group(2).upper() if m else None
        if not m or unit not in _UNITS:
            raise ValueError(f"cannot parse size {text!r}: use bytes or a number with a unit "
                             "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 141GB or 80GiB")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return n


def parse_tokens(text) -> int:
    """Token counts: '1048576', '128K' (x1024), '1M' (x2^20)."""
    m = re.fullmatch(r"\s*([0-9]+)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise ValueError(f"cannot parse token count {text!r}: use an int or 128K / 1M")
    n = int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20}[m.group(2).upper()]
    if n < 1:
        raise ValueError(f"token count must be >= 1, got {text!r}")
    return n


def fmt_bytes(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


# ---------------------------------------------------------------- the plan

def _model(model: ModelShape | str) -> ModelShape:
    if isinstance(model, ModelShape):
        return model
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {sorted(MODELS)}")
    return MODELS[model]


def layer_config(model: ModelShape | str, context: int, preset: str | HiSparseConfig = "default",
                 **overrides) -> HiSparseConfig:
    """One layer's cache config: the preset's tiers and page size, the model's KV shapes."""
    m = _model(model)
    base = preset if isinstance(preset, HiSparseConfig) else get_preset(preset)
    pg = base.page_size
    ctx = max(pg, -(-context // pg) * pg)
    return base.replace(num_kv_heads=m.num_kv_heads, gqa_group=m.gqa_group,
                        head_dim=m.head_dim, max_context=ctx, max_seqs=1,
                        num_pool_pages=None, **overrides)


def working_set_pages_for(cfg: HiSparseConfig, multiple: float = 2.0,
                          pages: int | None = None) -> int:
    """Offload working set per (sequence, KV head): `pages`, or `multiple` x a step's
    candidate pages; checked as `OffloadedCache` checks it (validate.check_working_set)."""
    if pages is None:
        multiple = check_number("working_set_multiple", multiple, 0.0, above=True)
        pages = round(multiple * cfg.candidate_pages)
        if pages < cfg.candidate_pages:
            raise ValueError(f"a working set of {multiple:g}x the candidate pages is "
                             f"{pages} pages, below one step's {cfg.candidate_pages}: the "
                             "multiple must be >= 1")
    return check_working_set(cfg.candidate_pages, pages)


def plan(model: ModelShape | str, context: int, device_memory_bytes: int | None = None, *,
         offload: bool = False, preset: str | HiSparseConfig = "default",
         working_set_multiple: float = 2.0, working_set_pages: int | None = None,
         reserve_bytes: int = 0) -> dict:
    """Bytes of one sequence of `context` tokens, whole model (all layers), by tier.

    device_memory_bytes: the device budget for KV caches (minus `reserve_bytes`,
    e.g. the weights); gives the max concurrent sequences. working_set_pages
    (per (sequence, KV head)) overrides working_set_multiple x candidate pages.
    """
    m = _model(model)
    if not is_int(context) or context < 1:
        raise ValueError(f"context must be a positive int, got {context!r}")
    context = int(context)
    if not is_int(reserve_bytes) or reserve_bytes < 0:
        raise ValueError(f"reserve_bytes must be an int >= 0, got {reserve_bytes!r}")
    if device_memory_bytes is not None and (not is_int(device_memory_bytes)
                                            or device_memory_bytes < 1):
        raise ValueError(f"device_memory_bytes must be a positive int, got "
                         f"{device_memory_bytes!r}")
    cfg = layer_config(m, context, preset)
    L = m.num_layers
    b = layout.sequence_bytes(cfg, context)            # one layer, everything on device
    cold_codes = b.int4_tier
    tiers = {
        "sink_hot_bf16": b.bf16_tier,
        "warm_fp8": b.fp8_tier,
        "cold_int4_codes_scales": cold_codes,
        "digests": b.digests,
        "page_tables": b.page_tables,
        "working_set": 0,
    }
    host = 0
    ws_pages = 0
    if offload:
        from hisparse_jax.offload.policy import working_set_bytes
        ws_pages = working_set_pages_for(cfg, working_set_multiple, working_set_pages)
        n_cold = cold_codes // layout.per_page_cold_bytes(cfg)[0]
        ws_pages = max(0, min(ws_pages, n_cold))  # never more than the sequence has
        tiers["working_set"] = working_set_bytes(cfg, ws_pages) if ws_pages else 0
        tiers["cold_int4_codes_scales"] = 0
        host = cold_codes
    per_layer_device = sum(tiers.values())
    device = per_layer_device * L
    bf16 = layout.bf16_paged_bytes(cfg, context) * L
    per_tok = context * m.num_kv_heads * L
    out = {
        "model": m.name, "layers": L, "num_kv_heads": m.num_kv_heads,
        "num_q_heads": m.num_q_heads, "head_dim": m.head_dim,
        "context": context, "preset": preset if isinstance(preset, str) else "custom",
        "page_size": cfg.page_size, "budget_pages": cfg.budget_pages,
        "offload": offload,
        "working_set_pages_per_seq_head": ws_pages,
        "tiers_device_bytes": {k: v * L for k, v in tiers.items()},
        "device_bytes": device,
        "host_bytes": host * L,
        "bf16_paged_bytes": bf16,
        "device_bytes_per_token_per_kv_head": device / per_tok,
        "bf16_bytes_per_token_per_kv_head": bf16 / per_tok,
        "capacity_vs_bf16": bf16 / device,
    }
    if device_memory_bytes is not None:
        budget = device_memory_bytes - reserve_bytes
        if budget <= 0:
            raise ValueError(f"reserve_bytes={reserve_bytes} leaves no device memory of "
                             f"{device_memory_bytes}")
        out["device_memory_bytes"] = device_memory_bytes
        out["reserve_bytes"] = reserve_bytes
        out["max_sequences"] = int(budget // device)
        out["max_sequences_bf16"] = int(budget // bf16)
    return out


def log_line(p: dict) -> str:
    """'HiSparse KV cache: 17.8x capacity vs bf16 (device 6.1 GiB, host 41.0 GiB)'."""
    s = (f"HiSparse KV cache: {p['capacity_vs_bf16']:.1f}x capacity vs bf16 "
         f"(device {fmt_bytes(p['device_bytes'])}, host {fmt_bytes(p['host_bytes'])})")
    return s


def offload_target_check(model="llama3-8b", context=1 << 20, target=16.0) -> dict:
    """Does offload at `context`, default preset, reach `target`x fewer device bytes per
    token than bf16 with every device byte counted? And what would, if not."""
    rows = {
        "default (page 16)": plan(model, context, offload=True),
        "page32": plan(model, context, offload=True, preset="page32"),
    }
    return {name: {"capacity_vs_bf16": r["capacity_vs_bf16"],
                   "device_bytes_per_token_per_kv_head": r["device_bytes_per_token_per_kv_head"],
                   "meets_target": r["capacity_vs_bf16"] >= target} for name, r in rows.items()}
