"""Memory-pressure tiers (DESIGN §2.3): what a cache gives up, in order, when its
device budget shrinks.

Levels, least degraded first:
  0. the configured tiers;
  1. the hot window shrunk to 64 tokens, the warm tier grown by as much (the
     tokens leave bf16 for fp8, exactly as a decode append moves them; the cold
     boundary and every cold page stay where they are);
  2+. the selection budget halved, down to 512 tokens, with the offload working
     set shrunk in proportion (the scheduler keeps its most valuable pages).
The hot window never grows back (its bf16 data is gone); the budget does when
the pressure eases. `levels` is pure: the caches apply a level (handle.py, offload/store.py).
"""

from __future__ import annotations

from hisparse_jax.config import FULL_BUDGET, HiSparseConfig

MIN_HOT_TOKENS = 64
MIN_BUDGET_TOKENS = 512


class DeviceBudgetError(RuntimeError):
    """No pressure level fits the device budget; nothing was changed."""


def levels(cfg: HiSparseConfig) -> list[HiSparseConfig]:
    """The configs to fall back to under pressure, least degraded first (cfg itself
    first). The hot window shrinks first: it costs the least quality (its tokens
    stay, in fp8) and saves bf16 bytes; then the budget halves."""
    if not isinstance(cfg, HiSparseConfig):
        raise ValueError(f"cfg must be a HiSparseConfig, got {type(cfg).__name__}")  # noqa: TRY004
    out = [cfg]
    hot = max(MIN_HOT_TOKENS, cfg.page_size)
    if cfg.hot_tokens > hot:
        out.append(cfg.replace(hot_tokens=hot,
                               warm_tokens=cfg.warm_tokens + cfg.hot_tokens - hot))
    if cfg.budget_tokens == FULL_BUDGET:
        return out
    budget = cfg.budget_tokens
    while budget // 2 >= max(MIN_BUDGET_TOKENS, cfg.page_size):
        budget = budget // 2 // cfg.page_size * cfg.page_size
        out.append(out[-1].replace(budget_tokens=budget))
    return out
