"""C++ kernels for HiSparse on the CPU (XLA FFI custom calls), each beside a
pure-jnp reference of the same signature.

- `sparse_decode.cc`: the decode attention over the cache's tiers and cold pages.
  XLA:CPU runs it as thousands of tiny batched products; these read each
  (sequence, KV head)'s pages in one loop. References in pallas_kernels/.
- `selection.cc`: the decode step's page selection and re-rank (the page scores,
  the candidate lists, the tail sample, the re-rank with its Quest floor), the
  same pages as the XLA path's (hisparse_jax/attention/selection.py).
- `causal_attention.cc`: the exact causal attention of the prefill on AMX tiles
  (Intel Xeon since Sapphire Rapids), float32-exact by splitting its bf16
  operands. XLA:CPU writes out every score of its float32 blocks. Reference in
  `reference.py`.
- `matmul.cc`: the model's weight products (any rows; the model sends it a
  decode step's and a short prompt's) on AMX tiles, reading a layer of the
  model's stacked weights in place, bit-equal to XLA's product. XLA:CPU copies
  the layer out of the stack first. Reference in `reference.py`.

They are compiled with the machine's C++ compiler on first use (`build.py`) and are
the default on a CPU (`hisparse_jax.backends`, where each
registers); without a compiler (or AMX, for the prefill and the
products) the default is the XLA path. Imports point one way: hisparse_jax ->
cpu_kernels -> jax; nothing here imports the library.
"""
