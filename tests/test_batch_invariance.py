"""A sequence's decode attention does not depend on how many sequences the step
computes beside it (`state.decode_widths`: a request served alone equals it
served in a batch). XLA:CPU sums a row in an order that depends on the number of
rows, so every float reduction over a sequence's own axis in the selection, the
tail sample, the re-rank and the attention goes through a batch-invariant form
(`sparse_decode.reference.row_sum`, `attention.head_sum`).
The model's own (matmul, RMSNorm) are in test_models_llama.py, the lookup's and
the attention kernel reference's in test_kernels.py, the whole engine's in
test_serving_engine.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax import attention as att
from hisparse_jax.cache import state as st
from hisparse_jax.config import preset

MAX_SEQS = 16


@pytest.fixture(scope="module")
def filled():
    """16 sequences of 1,500 and 200-400 tokens in a pool more than 8x a
    sequence's page table (the lookup's gathered-digest path, as a 32-slot
    server's), the `model` preset (re-rank with its floor, tail sample)."""
    cfg = preset("model").replace(num_kv_heads=3, gqa_group=3, head_dim=64, max_context=4096,
                                  max_seqs=MAX_SEQS, budget_tokens=256)
    assert cfg.pool_pages > 8 * cfg.max_pages
    rng = np.random.default_rng(0)
    base = rng.standard_normal((cfg.max_context, 3, 64)).astype(np.float32)
    s = st.init_state(cfg)
    for i in range(MAX_SEQS):
        k = base + 0.3 * rng.standard_normal(base.shape).astype(np.float32) * (i > 0)
        k[:, :, :4] += 3.0  # a shared direction: uneven pages
        v = rng.standard_normal(base.shape).astype(np.float32)
        s = st.prefill(cfg, s, jnp.int32(i), jnp.asarray(k, jnp.bfloat16),
                       jnp.asarray(v, jnp.bfloat16), jnp.int32(1500 if i == 0 else 200 + 13 * i))
    return cfg, s


# Both cases fail with the tail sample's and the re-rank's sums as jnp.sum.
@pytest.mark.parametrize("q_scale", [1.5, 8.0])  # 8: sharp heads (6 of 144 at step 1): the floor runs
def test_decode_steps_of_a_sequence_do_not_depend_on_the_width(filled, q_scale):
    cfg, s = filled
    rng = np.random.default_rng(int(q_scale))
    widths = (1, 2, 4, MAX_SEQS)
    states = {w: jax.tree.map(jnp.copy, s) for w in widths}
    for _ in range(4):
        q = jnp.asarray(rng.standard_normal((MAX_SEQS, 9, 64)) * q_scale, jnp.float32)
        kv = jnp.asarray(rng.standard_normal((MAX_SEQS, 3, 64)), jnp.bfloat16)
        got = {}
        for w in widths:
            c, part = st.first_slots(cfg, states[w], w)
            part = st.append_token(c, part, kv[:w], kv[:w], jnp.ones(w, bool))
            out, pages, part = att.decode_step(c, part, q[:w])
            states[w] = st.put_first_slots(states[w], part)
            got[w] = np.asarray(out)[0], np.asarray(pages)[0]
        for w in widths[1:]:
            np.testing.assert_array_equal(got[w][1], got[1][1])
            np.testing.assert_array_equal(got[w][0], got[1][0])
