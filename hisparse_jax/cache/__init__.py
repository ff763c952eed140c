"""The paged, tiered KV cache: its state (`state`), byte layout (`layout`),
prefix sharing (`prefix`), memory pressure (`pressure`), sharding over KV heads
(`sharding`) and the checked handle a caller holds (`handle.HiSparseCache`)."""
