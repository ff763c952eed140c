"""hisparse_jax.compat under whichever jax runs it: 0.11.2 in the main suite, 0.10.2
in the bridge environment (both run this file)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax import compat


def test_version_switch_matches_jax():
    major_minor = tuple(int(x) for x in jax.__version__.split(".")[:2])
    assert compat.JAX_010 == (major_minor == (0, 10))
    assert major_minor >= (0, 10) and major_minor <= (0, 11)


def test_compute_on_places_a_host_computation():
    """The offload cache's host scatter, through compat.compute_on, on either jax."""
    @compat.compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    def scatter(pool, ids, pages):
        return pool.at[ids].set(pages, mode="drop")

    dev = jax.devices()[0]
    kinds = {m.kind for m in dev.addressable_memories()}
    kind = "pinned_host" if "pinned_host" in kinds else "unpinned_host"
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind=kind)
    pool = jax.device_put(jnp.zeros((8, 4)), host)

    @jax.jit
    def run(pool, ids, pages):
        return scatter(pool, jax.device_put(ids, host), jax.device_put(pages, host))

    out = run(pool, jnp.array([1, 5, 9]), jnp.ones((3, 4)))
    assert out.sharding.memory_kind == kind
    want = np.zeros((8, 4))
    want[[1, 5]] = 1
    np.testing.assert_array_equal(np.asarray(out), want)
