from pallas_kernels.lookup.reference import page_scores  # noqa: F401
