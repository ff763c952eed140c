"""The served model's KV memory against dense bf16 (issue 15's goal: at least 3x the
concurrent sequences per GiB at 7.5K-token prompts), from the config the engine
runs and the server's own planner."""

from __future__ import annotations

import types

import pytest

from hisparse_jax.cache import layout, state
from hisparse_jax.cli.serve import plan_slots
from hisparse_jax.models.engine import model_cache_config
from hisparse_jax.models.llama import LlamaConfig

# SmolLM2-135M's shapes (models.md): 30 layers, 9 query heads on 3 KV heads of 64
SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64)
SERVED = 7568  # a 7,500-token prompt and 64 answer tokens, in whole pages of 16


def _slots(attention: str, context: int, memory: int) -> int:
    cfg = types.SimpleNamespace(attention=attention, kv_cache_memory=memory, offload=False,
                                max_seqs=1)
    return plan_slots(SMOLLM2, context, cfg, context // 16 // 16 * 16)[0]


def test_a_served_sequence_is_a_third_of_bf16s_bytes():
    cfg = model_cache_config(SMOLLM2, 8192, 1, 512)
    rep = layout.capacity_report(cfg, SERVED)
    assert rep["capacity_vs_bf16"] >= 3.0, rep
    # the layout's figures are the bytes a real state of this config holds
    one = cfg.replace(max_context=SERVED,
                      num_pool_pages=int(state.num_cold_pages(cfg, SERVED)))
    assert layout.nbytes(state.init_state(one)) == layout.state_bytes(one).device


@pytest.mark.parametrize("gib", [1, 2, 4])
def test_the_planner_fits_3x_the_bf16_sequences_per_gib(gib):
    hisparse, dense = (_slots(a, SERVED, gib << 30) for a in ("hisparse", "dense"))
    assert hisparse >= 3 * dense, (hisparse, dense)


@pytest.mark.parametrize("head_dim,group", [(6, 6), (32, 32), (64, 64), (96, 48), (128, 64)])
def test_the_value_group_is_the_longest_the_row_allows(head_dim, group):
    """Up to the preset's 64: the whole row, or a divisor of its half (codes pack
    channel j with j + head_dim/2)."""
    cfg = model_cache_config(SMOLLM2.replace(head_dim=head_dim), 512, 1, 64)
    assert cfg.value_group == group
