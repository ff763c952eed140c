from pallas_kernels.sparse_decode.reference import attend_part, merge_parts, sparse_decode  # noqa: F401
