"""HF checkpoint folders: config.json + *.safetensors (+ tokenizer.json,
tokenizer_config.json). `HF_LAYER_NAMES` is the one table of HF tensor names;
`export.py` writes with it too."""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from hisparse_jax.models.llama import LlamaConfig, RopeScaling
from hisparse_jax.models.tokenizer import Tokenizer

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mistral": "MistralForCausalLM"}

# model layer weight -> HF name inside model.layers.N. (HF stores matrices [out, in])
HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight", "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight", "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias", "bv": "self_attn.v_proj.bias",
}
HF_NAMES = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight",
            "lm_head": "lm_head.weight"}


def _rope_scaling(rs: dict | None, max_position: int) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ("linear", "llama3", "yarn"):
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return RopeScaling(
        kind=kind, factor=float(rs["factor"]),
        original_max_position=int(rs.get("original_max_position_embeddings", max_position)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        beta_fast=float(rs.get("beta_fast", 32.0)), beta_slow=float(rs.get("beta_slow", 1.0)),
        attention_factor=rs.get("attention_factor"))


def config_from_hf(c: dict, where: str = "config.json") -> LlamaConfig:
    kind = c.get("model_type")
    if kind not in ARCHITECTURES:
        raise ValueError(f"{where}: unsupported model_type {kind!r} (supported: "
                         f"{', '.join(ARCHITECTURES)})")
    try:
        heads = c["num_attention_heads"]
        rope = c.get("rope_parameters") or {}  # transformers 5 moves RoPE here
        max_position = c.get("max_position_embeddings", 8192)
        eos = c.get("eos_token_id")
        return LlamaConfig(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"],
            num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            rope_theta=float(c.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(c.get("rope_scaling") or rope, max_position),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)), max_position=max_position,
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or bool(c.get("attention_bias", False)),
            bos_id=c.get("bos_token_id"), eos_id=eos[0] if isinstance(eos, list) else eos)
    except KeyError as e:
        raise ValueError(f"{where}: lacks {e.args[0]}") from None


def load_hf(path: str, *, tokenizer: bool = True):
    """(LlamaConfig, weights in `llama.weight_shapes` layout (bf16 numpy), Tokenizer
    or None when the folder has no tokenizer.json)."""
    import ml_dtypes
    from safetensors.numpy import load_file

    bf16 = ml_dtypes.bfloat16
    where = os.path.join(path, "config.json")
    try:
        with open(where, encoding="utf-8") as f:
            hf_cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: cannot read ({e})") from None
    cfg = config_from_hf(hf_cfg, where)
    tensors = {}
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path}: no *.safetensors")
    for file in files:
        try:
            tensors.update(load_file(file))
        except Exception as e:  # noqa: BLE001 (safetensors' Rust errors: one line each)
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from None

    def take(name, transpose=True):
        if name not in tensors:
            raise ValueError(f"{path}: checkpoint lacks tensor {name}")
        t = tensors[name]
        return (t.T if t.ndim == 2 and transpose else t).astype(bf16)  # [out, in] -> [in, out]

    layers = {}
    for name, hf_name in HF_LAYER_NAMES.items():
        if name.startswith("b") and not cfg.qkv_bias:
            continue
        layers[name] = np.stack([take(f"model.layers.{i}.{hf_name}")
                                 for i in range(cfg.num_layers)])
    weights = {"embed": take(HF_NAMES["embed"], transpose=False),  # [V, d] in both
               "norm": take(HF_NAMES["norm"]), "layers": layers}
    if not cfg.tie_embeddings:
        weights["lm_head"] = take(HF_NAMES["lm_head"])
    tok = None
    if tokenizer and os.path.isfile(os.path.join(path, "tokenizer.json")):
        eos = hf_cfg.get("eos_token_id")
        tok = Tokenizer.from_hf_dir(path, eos_ids=tuple(eos if isinstance(eos, list)
                                                        else [eos] if eos is not None else []))
    return cfg, weights, tok
