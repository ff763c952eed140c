"""HiSparse in place of vLLM's `CPU_ATTN` on a CPU-only host (vLLM's CPU platform
ignores --attention-backend and always picks CPU_ATTN). Registered by the plugin
only when HISPARSE_VLLM_CPU=1.

The classes keep the name `CPU_ATTN` (vLLM looks the backend up by it) and
subclass vLLM's CPU classes where vLLM checks for them; the work is
`vllm_backend`'s.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backend import AttentionType, MultipleOf
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    _get_attn_isa,
)

from bridge import dlpack
from bridge.vllm_backend import (
    HiSparseImplMixin,
    HiSparseMetadataBuilder,
    customize_spec,
)

KERNEL_BLOCK = 128  # vLLM's CPU default block size (AMX wants a multiple of 32)


def cpu_kernel_attention(q, kbuf, vbuf, ctx: int, n: int, scale: float) -> torch.Tensor:
    """Exact causal attention of a staged prefill chunk with vLLM's own CPU kernel
    (the one CPU_ATTN runs): q [>= n, Hq, D] at positions ctx.. over kbuf, vbuf
    [cap, Hkv, D] rows [0, ctx + n) -> [n, Hq, D] in the model dtype.

    The staged K/V (JAX arrays, read through DLPack views) are written into a
    scratch paged cache in the kernel's layout (`cpu_attn_reshape_and_cache`: about
    3 MB for a 7.5K-token prompt of SmolLM2), then attended with the same
    scheduler metadata vLLM builds. A prompt prefilled in one chunk gets exactly
    the attention CPU_ATTN would compute, and it runs as fast."""
    kt = dlpack.to_torch(kbuf)
    vt = dlpack.to_torch(vbuf)
    qt = dlpack.to_torch(q)[:n]
    s = ctx + n
    hq, hkv, d = qt.shape[1], kt.shape[1], kt.shape[2]
    dtype = kt.dtype
    isa = _get_attn_isa(dtype, KERNEL_BLOCK, d)
    nb = -(-s // KERNEL_BLOCK)
    cache = torch.zeros(nb, hkv, 2 * KERNEL_BLOCK, d, dtype=dtype)  # padding: no NaN
    kc, vc = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(kt[:s], vt[:s], kc, vc, torch.arange(s, dtype=torch.int64),
                                   isa)
    qsl = torch.tensor([0, n], dtype=torch.int32)
    sl = torch.tensor([s], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=hq, num_kv_heads=hkv, head_dim=d, seq_lens=sl, dtype=dtype,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=False)
    out = torch.empty(n, hq, d, dtype=dtype)
    ops.cpu_attention_with_kv_cache(
        query=qt.to(dtype).contiguous(), key_cache=kc, value_cache=vc, output=out,
        query_start_loc=qsl, seq_lens=sl, scale=scale, causal=True, alibi_slopes=None,
        sliding_window=-1, block_table=torch.arange(nb, dtype=torch.int32)[None],
        softcap=0, scheduler_metadata=meta, s_aux=None)
    return out


class HiSparseCPUImpl(HiSparseImplMixin, CPUAttentionBackendImpl):
    exact_attention = staticmethod(cpu_kernel_attention)

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                 sliding_window, kv_cache_dtype, logits_soft_cap=None,
                 attn_type=AttentionType.DECODER, kv_sharing_target_layer_name=None,
                 sinks=None, **extra):
        self._hisparse_init(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                            sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                            kv_sharing_target_layer_name, sinks)
        self.is_fp8_kv_cache = False
        self.use_zentorch_sdpa = False


class HiSparseCPUBuilder(HiSparseMetadataBuilder):
    pass


class HiSparseCPUBackend(CPUAttentionBackend):
    forward_includes_kv_cache_update: bool = True
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "bfloat16"]
    # not CPU_ATTN's float32: vLLM views the byte pool in the model dtype, and HiSparse's
    # bytes per token are rounded to 2 (`runtime.vllm_content_bytes`), not to 4
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16]

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls():
        return HiSparseCPUImpl

    @staticmethod
    def get_builder_cls():
        return HiSparseCPUBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [MultipleOf(16)]

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def customize_spec(cls, spec):
        return customize_spec(spec)
