"""C++ kernels for HiSparse's decode on the CPU (XLA FFI custom calls), each beside
the pure-jnp reference of the same signature in pallas_kernels/.

XLA:CPU runs the cold pages' attention as thousands of tiny batched products; these
read each (sequence, KV head)'s pages in one loop (`sparse_decode.cc`). They are
compiled with the machine's C++ compiler on first use (`build.py`) and are the
default on a CPU (`implementation=None` -> "cpu"); without a compiler the default
is the XLA path. Imports point one way: hisparse_jax -> cpu_kernels ->
pallas_kernels (the references) -> jax.
"""
