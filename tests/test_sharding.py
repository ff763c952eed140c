"""Sharded over KV heads (4 forced host devices) == single device. Runs in a
subprocess: the device count is fixed when jax starts."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import numpy as np, jax, jax.numpy as jnp
    from hisparse_jax.cache.handle import HiSparseCache
    from hisparse_jax.config import HiSparseConfig
    from hisparse_jax.attention import decode_attention
    from hisparse_jax.cache.sharding import kv_mesh, shard_state, query_sharding
    from hisparse_jax.cache import state as st
    assert jax.device_count() == 4
    cfg = HiSparseConfig(num_kv_heads=4, gqa_group=2, head_dim=64, max_context=4096,
                         max_seqs=2, budget_tokens=256)
    rng = np.random.default_rng(0)
    k = rng.normal(size=(3000, 4, 64)).astype(np.float32)
    v = rng.normal(size=(3000, 4, 64)).astype(np.float32)
    cache = HiSparseCache(cfg)
    cache.prefill(0, k[:2500], v[:2500])
    cache.prefill(1, k[:1700], v[:1700])
    q = jnp.asarray(rng.normal(size=(2, 8, 64)).astype(np.float32))
    mesh = kv_mesh(cfg)
    sharded = shard_state(cache.state, mesh)
    assert len(sharded.int4_k.sharding.device_set) == 4
    # Appends on the sharded state, then decode, against the same on one device.
    one = cache.state
    for t in range(40):
        kt = jnp.asarray(np.stack([k[2500 + t], k[1700 + t]]))
        vt = jnp.asarray(np.stack([v[2500 + t], v[1700 + t]]))
        active = jnp.array([True, True])
        one = st.append_token(cfg, one, kt, vt, active)
        sharded = st.append_token(cfg, sharded, kt, vt, active)
    out1, sel1 = decode_attention(cfg, one, q, implementation="xla", return_selection=True)
    out4, sel4 = decode_attention(cfg, sharded, jax.device_put(q, query_sharding(mesh)),
                                  implementation="xla", return_selection=True)
    assert len(sharded.int4_k.sharding.device_set) == 4
    np.testing.assert_array_equal(np.asarray(sel1), np.asarray(sel4))
    np.testing.assert_allclose(np.asarray(out1), np.asarray(out4), rtol=1e-5, atol=1e-6)
    print("OK")
""")


def test_sharded_equals_single_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", SCRIPT], check=False, env=env, capture_output=True, text=True,
                       timeout=600, cwd=root)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
