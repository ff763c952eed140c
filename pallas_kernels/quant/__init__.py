from pallas_kernels.quant.reference import (  # noqa: F401
    FP8_DTYPE,
    decode_cold_keys,
    decode_cold_values,
    decode_fp8,
    encode_cold_keys,
    encode_cold_values,
    encode_fp8,
    pack_int4,
    round_bf16_down,
    round_bf16_up,
    unpack_int4,
)
