"""bridge.dlpack: zero-copy both ways, proven by data pointers; the copies JAX makes
(unaligned views) or refuses (non-compact views) are counted, never silent."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bridge import dlpack


@pytest.fixture(autouse=True)
def fresh_stats():
    dlpack.reset_stats()
    yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8,
                                   torch.int32, torch.float8_e4m3fn])
def test_torch_to_jax_shares_memory(dtype):
    t = dlpack.aligned_empty((64, 3, 64), dtype)
    t.view(torch.uint8).copy_(torch.randint(0, 100, t.view(torch.uint8).shape,
                                            dtype=torch.uint8))
    a = dlpack.to_jax(t, require_zero_copy=True)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert a.shape == tuple(t.shape)
    if dtype != torch.float8_e4m3fn:
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), t.float().numpy())
    # the same memory: a later write to the tensor shows in the array
    t.view(torch.uint8)[0, 0, 0] = 7
    assert int(np.asarray(a).view(np.uint8)[0, 0, 0]) == 7
    assert dlpack.stats()["to_jax_copies"] == 0


def test_transposed_view_is_zero_copy():
    t = torch.randn(48, 64)
    a = dlpack.to_jax(t.t(), require_zero_copy=True)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), t.t().numpy())


def test_jax_to_torch_shares_memory():
    for a in (jnp.arange(12.0).reshape(3, 4), jnp.ones((5, 9, 64), jnp.bfloat16)):
        t = dlpack.to_torch(a, require_zero_copy=True)
        assert t.data_ptr() == a.unsafe_buffer_pointer()
        np.testing.assert_array_equal(t.float().numpy(), np.asarray(a.astype(jnp.float32)))
    assert dlpack.stats() == {**dlpack.stats(), "to_torch": 2, "to_torch_copies": 0}


@pytest.mark.parametrize("offset_bytes", [4, 8, 16, 32])
def test_unaligned_view_is_copied_and_counted(offset_bytes):
    base = dlpack.aligned_empty((1024,), torch.float32).copy_(torch.arange(1024.0))
    view = base[offset_bytes // 4:offset_bytes // 4 + 256]
    assert view.data_ptr() % 64 == offset_bytes
    a = dlpack.to_jax(view)  # JAX copies it: counted, the values are right
    assert a.unsafe_buffer_pointer() != view.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), view.numpy())
    s = dlpack.stats()
    assert (s["to_jax_copies"], s["unaligned"]) == (1, 1)
    with pytest.raises(dlpack.CopyError, match="byte boundary"):
        dlpack.to_jax(view, require_zero_copy=True)


@pytest.mark.parametrize("offset_bytes", [64, 128])
def test_aligned_offsets_are_zero_copy(offset_bytes):
    base = dlpack.aligned_empty((1024,), torch.float32)
    view = base[offset_bytes // 4:]
    a = dlpack.to_jax(view, require_zero_copy=True)
    assert a.unsafe_buffer_pointer() == view.data_ptr()


def test_fused_qkv_column_slice_is_counted():
    """vLLM's key is a column slice of the fused qkv output: JAX cannot view it."""
    qkv = torch.randn(7, 576 + 192 + 192, dtype=torch.bfloat16)
    _, k, _ = qkv.split([576, 192, 192], dim=-1)
    k = k.view(-1, 3, 64)
    assert not dlpack.is_compact(k)
    a = dlpack.to_jax(k)
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), k.float().numpy())
    assert dlpack.stats()["strided"] == 1
    with pytest.raises(dlpack.CopyError, match="compact"):
        dlpack.to_jax(k, require_zero_copy=True)


def test_round_trip_keeps_the_pointer():
    t = dlpack.aligned_empty((16, 64), torch.bfloat16).fill_(1.5)
    back = dlpack.to_torch(dlpack.to_jax(t, require_zero_copy=True), require_zero_copy=True)
    assert back.data_ptr() == t.data_ptr()
