"""Pallas GPU kernels for HiSparse, each beside a pure-jnp reference of the same signature.

Imports point one way: hisparse_jax -> pallas_kernels -> jax. Nothing here knows
about the cache state; ops take plain arrays.
"""
