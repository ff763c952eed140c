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


def unsupported(head_dim: int) -> str | None:
    """Why the Pallas kernels cannot take caches of this head_dim (None if they
    can): Triton tiles need powers of two, and the decode kernel's dots need at
    least 32. (Pages are powers of two already, and so is any value group that
    divides a power-of-two head_dim / 2.)"""
    if not (is_pow2(head_dim) and head_dim >= 32):
        return f"head_dim must be a power of two >= 32, got {head_dim}"
    return None


def pow2_ceil(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def pow2_floor(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)
