"""Zero-copy views between torch tensors and JAX arrays (DLPack), both directions.

    from bridge.dlpack import to_jax, to_torch, stats
    a = to_jax(t)          # a jax.Array on t's memory (same data pointer)
    t2 = to_torch(a)       # a torch.Tensor on a's memory (same data pointer)
    stats()                # {"to_jax": n, "to_jax_copies": ..., ...}

What crosses without a copy, and what does not (measured on this machine, jax
0.10.2 and torch 2.13 CPU; tests/bridge/test_bridge_dlpack.py holds each case):

- A contiguous tensor, or a permutation of one (a transpose), whose data pointer
  is 64-byte aligned: JAX wraps the same memory. Later writes to the tensor show
  in the array, so the array is only valid while the tensor's memory is.
- A tensor whose data pointer is not 64-byte aligned (a slice that starts 4-32 B
  into a buffer): JAX copies it silently. `to_jax` detects this by comparing the
  pointers, counts it (`to_jax_copies`, `unaligned`), and logs the first one.
- A tensor whose strides are not a permutation of a compact layout (a column
  slice, such as vLLM's key and value, which are views of one fused qkv
  projection): JAX refuses it. `to_jax` makes it contiguous in torch first and
  counts that copy too (`strided`).
- JAX -> torch: `torch.from_dlpack` on a JAX array is zero-copy (XLA's CPU buffers
  are aligned). JAX arrays are immutable: never write through such a tensor.

The counters are per process; `reset_stats()` zeroes them. `require_zero_copy=True`
turns any copy into a `CopyError` (the tests use it).
"""

from __future__ import annotations

import logging
import threading

import jax
import torch

ALIGNMENT = 64  # bytes: XLA's CPU client copies buffers that are less aligned

log = logging.getLogger("hisparse.bridge")

_lock = threading.Lock()
_STATS = {"to_jax": 0, "to_jax_copies": 0, "unaligned": 0, "strided": 0,
          "to_torch": 0, "to_torch_copies": 0}
_warned: set[str] = set()


class CopyError(RuntimeError):
    """A view was asked for without copies and the data had to be copied."""


def stats() -> dict:
    """A snapshot of the per-process counters."""
    with _lock:
        return dict(_STATS)


def reset_stats() -> None:
    with _lock:
        for k in _STATS:
            _STATS[k] = 0


def _count(*keys: str) -> None:
    with _lock:
        for k in keys:
            _STATS[k] += 1


def _warn_once(kind: str, msg: str, *args) -> None:
    if kind not in _warned:
        _warned.add(kind)
        log.warning(msg, *args)


def is_compact(t: torch.Tensor) -> bool:
    """Whether t's strides are a permutation of a contiguous layout of its shape
    (what JAX's DLPack import takes; size-1 dimensions have any stride)."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def is_aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % ALIGNMENT == 0


def to_jax(t: torch.Tensor, *, require_zero_copy: bool = False) -> jax.Array:
    """A jax.Array on t's memory, or a counted copy where JAX cannot take it.

    t: a CPU torch tensor of a dtype both know (float32/16, bfloat16, int8/16/32/64,
    uint8, bool, float8_e4m3fn). A zero-size tensor is copied (it has no memory
    to share) and not counted.
    """
    if t.numel() == 0:
        return jax.numpy.asarray(t.numpy() if t.dtype != torch.bfloat16 else
                                 t.float().numpy()).astype(_jax_dtype(t.dtype))
    _count("to_jax")
    if not is_compact(t):
        _count("to_jax_copies", "strided")
        if require_zero_copy:
            raise CopyError(f"tensor of shape {tuple(t.shape)} with strides {t.stride()} is "
                            "not a permutation of a compact layout; JAX cannot view it")
        _warn_once("strided", "bridge.dlpack: copying a strided torch view of shape %s "
                   "(strides %s) before handing it to JAX", tuple(t.shape), t.stride())
        t = t.contiguous()
    ptr = t.data_ptr()
    a = jax.dlpack.from_dlpack(t)
    if a.unsafe_buffer_pointer() != ptr:
        _count("to_jax_copies", "unaligned")
        if require_zero_copy:
            raise CopyError(f"JAX copied a tensor at address {ptr:#x} ({ptr % ALIGNMENT} B "
                            f"past a {ALIGNMENT}-byte boundary)")
        _warn_once("unaligned", "bridge.dlpack: JAX copied a torch tensor whose data "
                   "pointer is %d B past a %d-byte boundary (counted in stats())",
                   ptr % ALIGNMENT, ALIGNMENT)
    return a


def to_torch(a: jax.Array, *, require_zero_copy: bool = False) -> torch.Tensor:
    """A torch tensor on a's memory (read it; do not write to it)."""
    _count("to_torch")
    a.block_until_ready()  # JAX dispatches asynchronously; torch reads at once
    t = torch.from_dlpack(a)
    if t.numel() and t.data_ptr() != a.unsafe_buffer_pointer():
        _count("to_torch_copies")
        if require_zero_copy:
            raise CopyError("torch copied a JAX array")
    return t


def aligned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor whose data pointer is 64-byte aligned (torch's
    CPU allocator aligns to 64 B already; this makes the guarantee explicit)."""
    n = 1
    for s in shape:
        n *= int(s)
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(n * item + ALIGNMENT, dtype=torch.uint8)
    off = (-raw.data_ptr()) % ALIGNMENT
    return raw[off:off + n * item].view(dtype).view(*shape)


_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
           torch.int8: "int8", torch.int16: "int16", torch.int32: "int32",
           torch.int64: "int64", torch.uint8: "uint8", torch.bool: "bool"}


def _jax_dtype(dt: torch.dtype):
    return jax.numpy.dtype(_DTYPES[dt])
