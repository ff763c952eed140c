import dataclasses

import pytest

from hisparse_jax.backends import resolve_implementation
from hisparse_jax.config import FULL_BUDGET, PRESETS, HiSparseConfig, preset


@pytest.mark.parametrize("field,value", [
    ("page_size", 24), ("page_size", 0), ("head_dim", 63), ("hot_tokens", 8),
    ("hot_tokens", 100), ("warm_tokens", 17), ("budget_tokens", 100), ("budget_tokens", -2),
    ("value_group", 48), ("value_group", 96), ("value_group", 256), ("max_context", 1000), ("num_kv_heads", 0), ("bound_share", 1.5),
    ("max_seqs", -1), ("num_pool_pages", 0), ("rerank_multiple", 0.5),
    ("rerank_multiple", float("nan")), ("rerank_sample_pages", -1), ("rerank_sample_pages", 1.5),
    ("rerank_weight", "mas"), ("rerank_weight", None),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        HiSparseConfig(**{field: value})


@pytest.mark.parametrize("group", [1, 8, 64, 128])
def test_a_value_group_lies_in_one_half_of_a_row_or_is_the_row(group):
    assert HiSparseConfig(head_dim=128, value_group=group).value_group == group


def test_frozen_and_presets():
    cfg = HiSparseConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_size = 32
    for name, p in PRESETS.items():
        assert preset(name) == p
    with pytest.raises(ValueError, match="unknown preset"):
        preset("nope")


def test_derived_sizes():
    cfg = HiSparseConfig(page_size=64, sink_tokens=16, max_context=8192)
    assert cfg.sink_pages == 1 and cfg.hot_pages == 2 and cfg.warm_pages == 6
    assert cfg.budget_pages == 32
    assert cfg.replace(budget_tokens=FULL_BUDGET).budget_pages == 128 - 1 - 2 - 6
    # Candidates: 1.25x the budget, never more than the cold pages; no re-rank when
    # every page is attended or the multiple is 1.
    assert cfg.candidate_pages == 40 and cfg.rerank_samples == 8
    assert cfg.replace(budget_tokens=100 * 64).candidate_pages == 128 - 1 - 2 - 6
    for c in (cfg.replace(budget_tokens=FULL_BUDGET), cfg.replace(rerank_multiple=1)):
        assert c.candidate_pages == c.budget_pages and c.rerank_samples == 0


@pytest.mark.parametrize("backend,d,implementation,want", [
    ("cpu", 128, None, "cpu"),  # the C++ kernels, where they build (cpu_kernels/)
    ("cpu", 128, "xla", "xla"), ("tpu", 128, None, "xla"),
    ("gpu", 128, None, "pallas"), ("gpu", 64, None, "pallas"),
    ("gpu", 96, None, "xla"),  # the kernels need a power of two: XLA instead
    ("gpu", 16, None, "xla"),  # ... and at least 32
    ("gpu", 96, "xla", "xla"), ("cpu", 128, "pallas", "pallas"),
])
def test_resolve_implementation(monkeypatch, backend, d, implementation, want):
    monkeypatch.setattr("jax.default_backend", lambda: backend)
    cfg = HiSparseConfig(head_dim=d, value_group=min(16, d // 2))
    assert resolve_implementation(implementation, cfg) == want


@pytest.mark.parametrize("d", [96, 80, 16])
def test_pallas_refuses_shapes_it_cannot_tile(d):
    from hisparse_jax.cache.handle import HiSparseCache
    msg = "head_dim must be a power of two >= 32"
    cfg = HiSparseConfig(head_dim=d, value_group=8, max_context=1024)
    with pytest.raises(ValueError, match=msg):
        resolve_implementation("pallas", cfg)
    with pytest.raises(ValueError, match=msg):
        HiSparseCache(cfg, "pallas")
    with pytest.raises(ValueError, match="implementation must be one of"):
        resolve_implementation("triton", cfg)
