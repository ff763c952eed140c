"""Shared pieces of the model tests: a tiny Llama config, GGUF files written with
gguf.GGUFWriter (the way llama.cpp's converter writes them: Q/K rows permuted),
an independent numpy reference of the decoder, and the real SmolLM2 model
(through `registry.load`, i.e. the same `fetch` path users take)."""

from __future__ import annotations

import functools

import numpy as np

from hisparse_jax.models.gguf_loader import LAYER_TENSORS, permute_rows
from hisparse_jax.models.llama import LlamaConfig, layer_shapes

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_config(**kw) -> LlamaConfig:
    """Every matrix's input dim is a multiple of 256 (the K-quant block)."""
    base = {"vocab_size": 300, "hidden_size": 256, "intermediate_size": 512, "num_layers": 2,
            "num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "rope_theta": 10000.0,
            "max_position": 2048, "tie_embeddings": True, "bos_id": 1, "eos_id": 2}
    base.update(kw)
    return LlamaConfig(**base)


def hf_weights(cfg: LlamaConfig, seed: int = 0) -> dict:
    """Random float32 weights in HF layout ([out, in] matrices), per layer."""
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(cfg.num_layers):
        w = {}
        for name, shape in layer_shapes(cfg).items():
            if "norm" in name:
                w[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            elif len(shape) == 2:
                w[name] = (rng.standard_normal(shape[::-1]) / np.sqrt(shape[0])).astype(np.float32)
            else:
                w[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        layers.append(w)
    out = {"embed": rng.standard_normal((cfg.vocab_size, cfg.hidden_size)).astype(np.float32),
           "norm": (1 + 0.1 * rng.standard_normal(cfg.hidden_size)).astype(np.float32),
           "layers": layers}
    if not cfg.tie_embeddings:
        out["lm_head"] = (rng.standard_normal((cfg.vocab_size, cfg.hidden_size))
                          / 16).astype(np.float32)
    return out


def model_weights(cfg: LlamaConfig, hf: dict) -> dict:
    """HF-layout weights -> the model's layout (`llama.weight_shapes`)."""
    out = {"embed": hf["embed"], "norm": hf["norm"],
           "layers": {k: np.stack([(l[k].T if l[k].ndim == 2 else l[k]) for l in hf["layers"]])
                      for k in layer_shapes(cfg)}}
    if "lm_head" in hf:
        out["lm_head"] = hf["lm_head"].T
    return out


@functools.cache
def _byte_chars() -> list[str]:
    """GPT-2's bytes_to_unicode, in byte order."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def tiny_vocab(size: int = 300):
    """(tokens, token types, merges): the 3 ChatML specials, 256 byte tokens, then
    merges of common pairs up to `size` tokens."""
    chars = _byte_chars()
    tokens = SPECIALS + chars
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġ", "a"), ("i", "n"), ("Ġt", "he"), ("e", "r"),
                 ("o", "n"), ("Ġ", "s"), ("r", "e"), ("a", "t"), ("Ġ", "w"), ("o", "r")]:
        if len(tokens) < size:
            merges.append(f"{a} {b}")
            tokens.append(a + b)
    while len(tokens) < size:  # filler tokens nothing merges into
        tokens.append(f"<unused{len(tokens)}>")
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, merges


def write_gguf(path, cfg: LlamaConfig, hf: dict | None, qtype: str = "F32", *,
               arch: str = "llama", raw_matrices: dict | None = None, tokenizer: bool = True,
               pre: str | None = "smollm", tokenizer_model: str = "gpt2",
               extra: dict | None = None):
    """A GGUF as llama.cpp's converter writes one: llama.* metadata, Q/K rows
    permuted (llama arch), matrices (and the embedding) as `qtype`, norms F32.
    raw_matrices: {gguf tensor name: (uint8 blocks, shape)} written as is (K-quants,
    which gguf-py cannot quantize). pre: tokenizer.ggml.pre (None: left out);
    extra: {tensor name: array} added as F32."""
    import gguf
    from gguf import GGMLQuantizationType as T

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if tokenizer:
        tokens, types, merges = tiny_vocab(cfg.vocab_size)
        w.add_tokenizer_model(tokenizer_model)
        if pre is not None:
            w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML)
    qt = getattr(T, qtype)
    raw_matrices = raw_matrices or {}

    def put(name, x, quantize=True):
        if name in raw_matrices:
            blocks, _ = raw_matrices[name]
            w.add_tensor(name, blocks, raw_dtype=qt)
        elif not quantize or qt == T.F32:
            w.add_tensor(name, np.ascontiguousarray(x, np.float32))
        elif qt == T.F16:
            w.add_tensor(name, np.ascontiguousarray(x, np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(x, np.float32), qt),
                         raw_dtype=qt)

    if hf is not None:
        put("token_embd.weight", hf["embed"])
        put("output_norm.weight", hf["norm"], quantize=False)
        if "lm_head" in hf:
            put("output.weight", hf["lm_head"])
        heads = {"wq": cfg.num_heads, "wk": cfg.num_kv_heads, "bq": cfg.num_heads,
                 "bk": cfg.num_kv_heads}
        for i, layer in enumerate(hf["layers"]):
            for gguf_name, name in LAYER_TENSORS.items():
                if name not in layer:
                    continue
                x = layer[name]
                if arch == "llama" and name in heads:
                    x = permute_rows(x, heads[name])
                put(f"blk.{i}.{gguf_name}", x, quantize=x.ndim == 2)
    else:
        for name, (blocks, _) in raw_matrices.items():
            w.add_tensor(name, blocks, raw_dtype=qt)
    for name, x in (extra or {}).items():
        w.add_tensor(name, np.ascontiguousarray(x, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_hf(path, cfg: LlamaConfig, hf: dict, *, config: dict | None = None,
             extra: dict | None = None, dtype=np.float32):
    """An HF checkpoint folder (config.json + model.safetensors) of HF-layout
    weights `hf` as `dtype`; config: keys added to (None: removed from) config.json;
    extra: {tensor name: array} added as is."""
    import json
    import os

    from safetensors.numpy import save_file

    from hisparse_jax.models.hf_loader import HF_LAYER_NAMES, HF_NAMES
    os.makedirs(path, exist_ok=True)
    c = {"model_type": "qwen2" if cfg.qkv_bias else "llama", "vocab_size": cfg.vocab_size,
         "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
         "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
         "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
         "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
         "max_position_embeddings": cfg.max_position,
         "tie_word_embeddings": cfg.tie_embeddings, "bos_token_id": cfg.bos_id,
         "eos_token_id": cfg.eos_id, "hidden_act": "silu"}
    for k, v in (config or {}).items():
        if v is None:
            c.pop(k, None)
        else:
            c[k] = v
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f)
    t = {HF_NAMES["embed"]: hf["embed"], HF_NAMES["norm"]: hf["norm"]}
    if "lm_head" in hf:
        t[HF_NAMES["lm_head"]] = hf["lm_head"]
    for i, layer in enumerate(hf["layers"]):
        for name, x in layer.items():
            t[f"model.layers.{i}.{HF_LAYER_NAMES[name]}"] = x
    t = {k: np.ascontiguousarray(v).astype(dtype) for k, v in t.items()}
    t.update(extra or {})
    save_file(t, os.path.join(path, "model.safetensors"))
    return path


# ---------------------------------------------------------------- numpy reference

def reference_logits(cfg: LlamaConfig, hf: dict, ids) -> np.ndarray:
    """Causal forward of the whole sequence in float64 numpy, HF semantics
    (rotate_half RoPE, repeat_kv GQA, SwiGLU) -> logits [T, V]."""
    x = hf["embed"][np.asarray(ids)].astype(np.float64)
    t, d = len(ids), cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2) / d)
    ang = np.arange(t)[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(v):  # [T, H, D]
        half = np.concatenate([-v[..., d // 2:], v[..., :d // 2]], -1)
        return v * cos[:, None] + half * sin[:, None]

    def norm(v, w):
        return v / np.sqrt(np.mean(v * v, -1, keepdims=True) + cfg.rms_norm_eps) * w

    for layer in hf["layers"]:
        h = norm(x, layer["attn_norm"])

        def proj(h, layer, w, b, heads):
            y = h @ layer[w].T.astype(np.float64)
            if b in layer:
                y = y + layer[b]
            return y.reshape(t, heads, d)

        q = rope(proj(h, layer, "wq", "bq", cfg.num_heads))
        k = np.repeat(rope(proj(h, layer, "wk", "bk", cfg.num_kv_heads)), cfg.group, axis=1)
        v = np.repeat(proj(h, layer, "wv", "bv", cfg.num_kv_heads), cfg.group, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
        s = np.where(np.tril(np.ones((t, t), bool))[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", p, v).reshape(t, -1)
        x = x + o @ layer["wo"].T
        h = norm(x, layer["mlp_norm"])
        g = h @ layer["w_gate"].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ layer["w_up"].T)) @ layer["w_down"].T
    h = norm(x, hf["norm"])
    return h @ (hf["lm_head"] if "lm_head" in hf else hf["embed"]).T


def bf16(x):
    """x rounded to bf16, back in float32 (what the model stores)."""
    import ml_dtypes
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


@functools.cache
def smollm2():
    """(Llama, Tokenizer) of SmolLM2-135M-Instruct, loaded once per process through
    `registry.load` (fetched into $HISPARSE_HOME on first use)."""
    from hisparse_jax.models.registry import load
    return load("smollm2-135m")
