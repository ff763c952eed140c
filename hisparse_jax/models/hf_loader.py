"""HF checkpoint folders: config.json + *.safetensors (+ tokenizer.json,
tokenizer_config.json). `HF_LAYER_NAMES` is the one table of HF tensor names;
`export.py` writes with it too."""

from __future__ import annotations

import glob
import json
import os

import ml_dtypes
import numpy as np

from hisparse_jax.models.llama import LlamaConfig, RopeScaling, check_finite
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
FLOAT_DTYPES = (np.float64, np.float32, np.float16, ml_dtypes.bfloat16)

HF_NAMES = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight",
            "lm_head": "lm_head.weight"}


def _reader(c: dict, where: str):
    """num(key, kind, default): one number of `c`. Missing or null is `default`
    (required when none is given); anything but a number (a string, a bool, a
    list), or an int below 1, is a one-line ValueError naming `where` and the key."""
    def num(key, kind, default=KeyError):
        v = c.get(key)
        if v is None:
            if default is KeyError:
                raise ValueError(f"{where}: lacks {key}")
            return default
        if kind is int and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{where}: {key} must be a positive integer, got {v!r}")
        if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"{where}: {key} must be a number, got {v!r}")
        return kind(v)
    return num


def _rope_scaling(rs, max_position: int, where: str) -> RopeScaling | None:
    if not rs:
        return None
    if not isinstance(rs, dict):
        raise ValueError(f"{where}: rope_scaling must be an object, got {rs!r}")  # noqa: TRY004
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ("linear", "llama3", "yarn"):
        raise ValueError(f"{where}: unsupported rope_scaling type {kind!r}")
    num = _reader(rs, f"{where}: rope_scaling")
    return RopeScaling(
        kind=kind, factor=num("factor", float),
        original_max_position=num("original_max_position_embeddings", int, max_position),
        low_freq_factor=num("low_freq_factor", float, 1.0),
        high_freq_factor=num("high_freq_factor", float, 4.0),
        beta_fast=num("beta_fast", float, 32.0), beta_slow=num("beta_slow", float, 1.0),
        attention_factor=num("attention_factor", float, None))


def _unsupported(c: dict, kind: str, max_position: int, where: str):
    """Settings the model does not implement: loading past them would give wrong
    logits and no error."""
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: unsupported hidden_act {c.get('hidden_act')!r} (silu only)")
    if c.get("mlp_bias"):
        raise ValueError(f"{where}: mlp_bias is not supported")
    if kind == "llama" and c.get("attention_bias"):  # transformers biases o_proj as well
        raise ValueError(f"{where}: attention_bias is not supported for llama (it puts a "
                         "bias on o_proj too)")
    # Mistral slides whenever sliding_window is set; Qwen2 only with use_sliding_window
    if kind == "mistral" or (kind == "qwen2" and c.get("use_sliding_window")):
        window = _reader(c, where)("sliding_window", int, None)
        if window is not None and window < max_position:
            raise ValueError(f"{where}: sliding_window {window} (below the context "
                             f"{max_position}) is not supported")


def config_from_hf(c: dict, where: str = "config.json") -> LlamaConfig:
    if not isinstance(c, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(c).__name__}")  # noqa: TRY004
    kind = c.get("model_type")
    if kind not in ARCHITECTURES:
        raise ValueError(f"{where}: unsupported model_type {kind!r} (supported: "
                         f"{', '.join(ARCHITECTURES)})")
    num = _reader(c, where)
    hidden, heads = num("hidden_size", int), num("num_attention_heads", int)
    max_position = num("max_position_embeddings", int, 8192)
    _unsupported(c, kind, max_position, where)
    rope = c.get("rope_parameters") or {}  # transformers 5 moves RoPE here
    if not isinstance(rope, dict):
        raise ValueError(f"{where}: rope_parameters must be an object, got {rope!r}")  # noqa: TRY004
    theta = num("rope_theta", float, None)
    eos = c.get("eos_token_id")
    try:  # LlamaConfig's and RopeScaling's own checks, with the file named
        return LlamaConfig(
            vocab_size=num("vocab_size", int), hidden_size=hidden,
            intermediate_size=num("intermediate_size", int),
            num_layers=num("num_hidden_layers", int), num_heads=heads,
            num_kv_heads=num("num_key_value_heads", int, heads),
            head_dim=num("head_dim", int, hidden // heads),
            rope_theta=theta if theta is not None else _reader(
                rope, f"{where}: rope_parameters")("rope_theta", float, 10000.0),
            rope_scaling=_rope_scaling(c.get("rope_scaling") or rope, max_position, where),
            rms_norm_eps=num("rms_norm_eps", float, 1e-6), max_position=max_position,
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=kind == "qwen2" or bool(c.get("attention_bias", False)),
            bos_id=c.get("bos_token_id"),
            eos_id=(eos[0] if eos else None) if isinstance(eos, list) else eos)
    except ValueError as e:
        if str(e).startswith(where):
            raise
        raise ValueError(f"{where}: {e}") from None


def load_hf(path: str, *, tokenizer: bool = True):
    """(LlamaConfig, weights in `llama.weight_shapes` layout (bf16 numpy), Tokenizer
    or None when the folder has no tokenizer.json)."""
    from safetensors.numpy import load_file

    bf16 = ml_dtypes.bfloat16
    where = os.path.join(path, "config.json")
    try:
        with open(where, encoding="utf-8") as f:
            hf_cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: cannot read ({e})") from None
    cfg = config_from_hf(hf_cfg, where)
    tensors, file_of = {}, {}
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path}: no *.safetensors")
    for file in files:
        try:
            part = load_file(file)
        except Exception as e:  # noqa: BLE001 (safetensors' Rust errors: one line each)
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
        tensors.update(part)
        file_of.update(dict.fromkeys(part, file))
    used = set()

    def take(name, transpose=True):
        if name not in tensors:
            raise ValueError(f"{path}: checkpoint lacks tensor {name}")
        t = tensors[name]
        if t.dtype not in FLOAT_DTYPES:  # an int or bool tensor is not a weight to cast
            raise ValueError(f"{file_of[name]}: tensor {name} has dtype {t.dtype} (expected "
                             "F64, F32, F16 or BF16)")
        used.add(name)
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
    _check_unused(tensors, used, file_of, cfg)
    check_finite(weights, path)
    tok = _tokenizer(path, hf_cfg) if tokenizer else None
    # Fewer tokens than embedding rows is common (HF pads the vocabulary); more
    # would index past the embedding.
    if tok is not None and tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"{path}: tokenizer.json has {tok.vocab_size} tokens, the "
                         f"embedding {cfg.vocab_size} rows")
    return cfg, weights, tok


def read_tokenizer(path: str) -> Tokenizer | None:
    """The folder's tokenizer alone: tokenizer.json, the template and config.json's
    eos_token_id (if there is one), whatever the model; no weight read."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            hf_cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        hf_cfg = {}
    return _tokenizer(path, hf_cfg if isinstance(hf_cfg, dict) else {})


def _tokenizer(path: str, hf_cfg: dict) -> Tokenizer | None:
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    eos = hf_cfg.get("eos_token_id")
    return Tokenizer.from_hf_dir(path, eos_ids=tuple(eos if isinstance(eos, list)
                                                     else [eos] if eos is not None else []))


def _check_unused(tensors: dict, used: set, file_of: dict, cfg: LlamaConfig):
    """A model.* or lm_head.* tensor the model did not take is a weight it does
    not implement (a bias, a norm): one line naming the first. Left alone: the
    RoPE inv_freq buffers of old checkpoints (the model computes its own) and a
    tied lm_head that is the embedding itself."""
    embed = HF_NAMES["embed"]
    unused = []
    for name, t in tensors.items():
        if name in used or not name.startswith(("model.", "lm_head.")) \
                or name.endswith(".rotary_emb.inv_freq"):
            continue
        if name == HF_NAMES["lm_head"] and cfg.tie_embeddings:
            if np.array_equal(t, tensors[embed]):
                continue
            raise ValueError(f"{file_of[name]}: tie_word_embeddings is true but {name} "
                             f"differs from {embed}")
        unused.append(name)
    if unused:
        raise ValueError(f"{file_of[unused[0]]}: tensor {unused[0]} is not a weight this "
                         f"loader supports ({len(unused)} unused in all)")
