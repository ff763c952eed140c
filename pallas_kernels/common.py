"""Helpers shared by the Pallas kernels."""

from __future__ import annotations

import jax


def resolve_interpret(interpret):
    """None -> interpret unless running on a GPU."""
    if interpret is None:
        return jax.default_backend() != "gpu"
    return bool(interpret)


def is_pow2(n: int) -> bool:
    """Triton tiles must have a power-of-two element count."""
    return n > 0 and (n & (n - 1)) == 0


def pow2_ceil(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)
