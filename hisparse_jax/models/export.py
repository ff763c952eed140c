"""`export_hf`: a model as a bf16 HF checkpoint (LlamaForCausalLM) that transformers,
vLLM and our own `hf_loader` read. The model already holds HF's Q/K row order
(gguf_loader undoes llama.cpp's permutation), so the weights are written as they
are, transposed to HF's [out, in]. Everything is written into a temporary folder
beside `out_dir`, which is then renamed into place."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np

from hisparse_jax.models.hf_loader import HF_LAYER_NAMES, HF_NAMES
from hisparse_jax.models.llama import Llama, layer_shapes
from hisparse_jax.models.tokenizer import Tokenizer


def hf_config(model: Llama) -> dict:
    c = model.cfg
    cfg = {
        "architectures": ["Qwen2ForCausalLM" if c.qkv_bias else "LlamaForCausalLM"],
        "model_type": "qwen2" if c.qkv_bias else "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "hidden_act": "silu",
        "max_position_embeddings": c.max_position, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "rope_scaling": None,
        "tie_word_embeddings": c.tie_embeddings, "attention_bias": c.qkv_bias,
        "mlp_bias": False, "torch_dtype": "bfloat16",
        "bos_token_id": c.bos_id, "eos_token_id": c.eos_id,
    }
    s = c.rope_scaling
    if s is not None:
        rs = {"rope_type": s.kind, "factor": s.factor,
              "original_max_position_embeddings": s.original_max_position}
        if s.kind == "llama3":
            rs.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
        if s.kind == "yarn":
            rs.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow)
            if s.attention_factor is not None:
                rs["attention_factor"] = s.attention_factor
        cfg["rope_scaling"] = rs
    return cfg


def hf_tensors(model: Llama) -> dict[str, np.ndarray]:
    """HF name -> bf16 numpy array in HF layout."""
    w = model.weights()

    def np_(x, transpose=True):
        x = np.asarray(x)
        return np.ascontiguousarray(x.T if x.ndim == 2 and transpose else x)

    out = {HF_NAMES["embed"]: np_(w["embed"], transpose=False), HF_NAMES["norm"]: np_(w["norm"])}
    if "lm_head" in w:
        out[HF_NAMES["lm_head"]] = np_(w["lm_head"])
    for name in layer_shapes(model.cfg):
        stacked = np.asarray(w["layers"][name])
        for i in range(model.cfg.num_layers):
            out[f"model.layers.{i}.{HF_LAYER_NAMES[name]}"] = np_(stacked[i])
    return out


def export_hf(model: Llama, out_dir: str, tokenizer: Tokenizer | None = None) -> str:
    """Write config.json, generation_config.json, model.safetensors and (with a
    tokenizer) tokenizer.json + tokenizer_config.json to `out_dir` (which must not
    exist or be empty). Returns out_dir."""
    from safetensors.numpy import save_file

    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ValueError(f"{out_dir}: exists and is not an empty folder")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", dir=parent)
    try:
        c = model.cfg
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config(model), f, indent=2)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": c.bos_id, "eos_token_id": c.eos_id}, f, indent=2)
        save_file(hf_tensors(model), os.path.join(tmp, "model.safetensors"),
                  metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_hf(tmp, model_max_length=c.max_position)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
