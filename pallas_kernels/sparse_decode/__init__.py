from pallas_kernels.sparse_decode.reference import (  # noqa: F401
    attend_part, merge_parts, sparse_decode)
