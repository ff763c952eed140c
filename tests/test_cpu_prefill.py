"""The prefill's causal-attention kernel (cpu_kernels/causal_attention.cc: AMX
tiles, or float32 multiply-adds on AVX-512) against its float32 reference
(cpu_kernels/reference.py), each path where the CPU has it.

Adversarial shapes: odd query counts and starts (tiles of 16 queries and blocks of
64 keys cut anywhere), fewer keys than the last query's position, GQA 1 to 8, head
dims 64 to 256, near one-hot attention (scores in the hundreds, where the queries'
three bf16 terms matter), NaN in every key and value no query may see. Tolerance:
1e-5 of the output's scale, float32's precision (the products are exact, the sums
in another order); dropping any one of 1,000 keys moves the output 1e-3.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import AMX, AVX512, PRODUCT_PATHS

from cpu_kernels import build, ops, reference
from hisparse_jax import backends


@dataclasses.dataclass(frozen=True)
class Case:
    queries: int
    keys: int
    start: int
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    sharpness: float = 1.0  # query scale: 30 makes attention near one-hot

    def __str__(self):
        return "-".join(f"{f.name[:2]}{getattr(self, f.name)}" for f in dataclasses.fields(self))


CASES = [
    Case(512, 1024, 512),                                  # SmolLM2's second prompt block
    Case(600, 600, 0),                                     # a whole prompt, 600 = 37.5 tiles
    Case(1, 100, 99, heads=4, kv_heads=4),                 # one query (multi-head)
    Case(37, 200, 51, heads=8, kv_heads=1, head_dim=128),  # GQA 8, odd start and count
    Case(100, 90, 0, heads=4, kv_heads=2),                 # the last 10 queries see 90 keys
    Case(33, 300, 200, heads=6, kv_heads=2, head_dim=256),
    Case(70, 130, 45, heads=2, kv_heads=2, sharpness=30.0),
    Case(45, 120, 60, heads=10, kv_heads=2),               # GQA 5: heads 4 + 1 in lockstep
]


def make(c: Case, seed=0, garbage=np.nan):
    """q [T, Hq, D] float32, k, v [S, Hkv, D] bf16, `garbage` in every key and value
    past the last query's position (a staging buffer's unwritten part)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((c.queries, c.heads, c.head_dim)) * c.sharpness
    k, v = (rng.standard_normal((c.keys, c.kv_heads, c.head_dim)) for _ in range(2))
    seen = min(c.keys, c.start + c.queries)
    k[seen:], v[seen:] = garbage, garbage
    return (jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.bfloat16),
            jnp.asarray(v, jnp.bfloat16))


def close(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert np.isfinite(got).all()
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("amx", PRODUCT_PATHS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_the_reference(case, amx):
    q, k, v = make(case)
    clean = make(case, garbage=0.0)[1:]  # the reference multiplies 0 by NaN
    close(ops.causal_attention(q, k, v, case.start, amx=amx),
          reference.causal_attention(q, *clean, case.start))


@pytest.mark.parametrize("amx", PRODUCT_PATHS)
@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=str)
def test_a_query_gets_the_same_output_in_any_block(case, amx):
    """Bitwise: the serving engine prefills a prompt block by block, `generate` in
    one program, and the two must agree."""
    q, k, v = make(case)
    whole = np.asarray(ops.causal_attention(q, k, v, case.start, amx=amx))
    cut = sorted({0, 7, 23, 24, case.queries // 2 + 1, case.queries})
    parts = [np.asarray(ops.causal_attention(q[a:b], k, v, case.start + a, amx=amx))
             for a, b in itertools.pairwise(cut)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


@pytest.mark.parametrize("amx", PRODUCT_PATHS)
def test_in_a_jitted_program_with_a_traced_start(amx):
    case = CASES[0]
    q, k, v = make(case)
    f = jax.jit(lambda q, k, v, s: ops.causal_attention(q, k, v, s, amx=amx))
    np.testing.assert_array_equal(np.asarray(f(q, k, v, jnp.int32(case.start))),
                                  np.asarray(ops.causal_attention(q, k, v, case.start, amx=amx)))


@pytest.mark.parametrize("amx", PRODUCT_PATHS)
@pytest.mark.parametrize("layer", [0, 2])
def test_a_layer_of_a_stack_read_in_place(layer, amx):
    """k[layer], v[layer] of stacked [L, S, Hkv, D] (the chunked prefill's staged
    K/V) give the layer's own output bitwise; the other layers hold NaN, so a read
    of the wrong one shows."""
    case = CASES[3]
    q, k, v = make(case)
    stack = lambda x: jnp.full((3, *x.shape), jnp.nan, x.dtype).at[layer].set(x)
    f = jax.jit(lambda q, k, v, s, l: ops.causal_attention(q, k, v, s, layer=l, amx=amx))
    np.testing.assert_array_equal(
        np.asarray(f(q, stack(k), stack(v), jnp.int32(case.start), jnp.int32(layer))),
        np.asarray(ops.causal_attention(q, k, v, case.start, amx=amx)))
    clean = make(case, garbage=0.0)[1:]  # the reference multiplies 0 by NaN
    np.testing.assert_array_equal(
        np.asarray(reference.causal_attention(q, *map(stack, clean), case.start, layer=layer)),
        np.asarray(reference.causal_attention(q, *clean, case.start)))


@pytest.mark.parametrize("amx", PRODUCT_PATHS)
def test_a_layer_out_of_range_is_refused(amx):
    case = CASES[3]
    q, k, v = make(case)
    with pytest.raises(Exception, match="layer out of range"):
        jax.block_until_ready(ops.causal_attention(q, k[None], v[None], case.start, layer=1,
                                                   amx=amx))


KERNEL = AMX or AVX512  # where the kernel runs, on one path or the other


@pytest.mark.parametrize("implementation,head_dim,want", [
    ("xla", 64, "xla"), ("pallas", 64, "xla"), (None, 96, "xla"), (None, 320, "xla"),
    (None, 64, "cpu" if KERNEL else "xla"), ("cpu", 128, "cpu" if KERNEL else "xla")])
def test_which_prefill_runs(implementation, head_dim, want):
    """The kernel where it can run (the default, and with the decode kernels), XLA's
    blocks everywhere else; a CPU with neither AMX nor AVX-512 says why."""
    assert backends.resolve("causal_attention", implementation, head_dim=head_dim) == want
    why = build.causal_unavailable()
    assert (why is None) == KERNEL
    if not KERNEL:
        with pytest.raises(RuntimeError, match="AVX-512|compiler"):
            ops.causal_attention(*make(CASES[2]), 99)
