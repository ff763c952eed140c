"""A model's weights, exactly as it computes with them (bf16), in two formats:

- `export_hf`: a bf16 HF checkpoint (LlamaForCausalLM) that transformers, vLLM
  and our own `hf_loader` read. The model already holds HF's Q/K row order
  (gguf_loader undoes llama.cpp's permutation), so the weights are written as
  they are, transposed to HF's [out, in]. Everything is written into a temporary
  folder beside `out_dir`, which is then renamed into place.
- `export_gguf`: a BF16 GGUF that llama.cpp runs, for a model loaded from a GGUF
  (the source): every tensor of the source, in its order, layout ([out, in]) and
  Q/K row order (llama.cpp's, permuted again), holds the model's bf16 weights:
  matrices and the embedding as BF16, 1-D tensors (norms, biases) as F32 holding
  the same bf16 values (llama.cpp's converter keeps 1-D tensors F32). All the
  source's metadata (hyperparameters, tokenizer, chat template) is copied, with
  `general.file_type` set to MOSTLY_BF16. Reading the file back with
  `gguf_loader` gives the model's weights bit for bit, so llama.cpp on this file
  and our model multiply the same numbers; on a quantized source this removes
  the difference in arithmetic (llama.cpp multiplies quantized weights with
  8-bit activations) from a comparison of the two.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np

from hisparse_jax.models.gguf_loader import (
    ARCHITECTURES,
    LAYER_TENSORS,
    permute_rows,
    read_config,
)
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


def check_target(out: str, fmt: str):
    """ValueError where `out` cannot take an export of format `fmt` ("hf": a folder that
    does not exist or is empty; "gguf": a file that does not exist), in a folder
    that can be written: checked before the model loads."""
    out = os.path.abspath(out)
    if fmt == "hf":
        if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
            raise ValueError(f"{out}: exists and is not an empty folder")
    elif os.path.exists(out):
        raise ValueError(f"{out}: exists")
    parent = os.path.dirname(out)
    while not os.path.exists(parent):  # the nearest folder that exists must take the new one
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{out}: cannot write in {parent}")


def _public(path: str, mode: int):
    """`path` (made private by mkdtemp / mkstemp) as a plain file or folder would be:
    `mode` less the umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)


def export_hf(model: Llama, out_dir: str, tokenizer: Tokenizer | None = None) -> str:
    """Write config.json, generation_config.json, model.safetensors and (with a
    tokenizer) tokenizer.json + tokenizer_config.json to `out_dir` (which must not
    exist or be empty). Returns out_dir."""
    from safetensors.numpy import save_file

    out_dir = os.path.abspath(out_dir)
    check_target(out_dir, "hf")
    parent = os.path.dirname(out_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", dir=parent)
    except OSError as e:  # named by the target, not by our temporary folder
        raise ValueError(f"{out_dir}: cannot write in {parent} ({e.strerror})") from None
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
        for name in os.listdir(tmp):
            _public(os.path.join(tmp, name), 0o666)
        _public(tmp, 0o777)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def gguf_tensors(model: Llama, permuted: bool) -> dict[str, np.ndarray]:
    """GGUF name -> the model's weight in GGUF numpy layout ([out, in] matrices,
    [vocab, hidden] embedding), bf16; Q/K rows in llama.cpp's order if `permuted`."""
    w, cfg = model.weights(), model.cfg
    heads = {"wq": cfg.num_heads, "wk": cfg.num_kv_heads, "bq": cfg.num_heads,
             "bk": cfg.num_kv_heads}
    out = {"token_embd.weight": np.asarray(w["embed"]),
           "output_norm.weight": np.asarray(w["norm"])}
    if "lm_head" in w:
        out["output.weight"] = np.asarray(w["lm_head"]).T
    for gguf_name, name in LAYER_TENSORS.items():
        if name not in w["layers"]:
            continue
        stacked = np.asarray(w["layers"][name])
        for i in range(cfg.num_layers):
            x = stacked[i].T if stacked[i].ndim == 2 else stacked[i]
            if permuted and name in heads:
                x = permute_rows(x, heads[name])
            out[f"blk.{i}.{gguf_name}"] = np.ascontiguousarray(x)
    return out


def export_gguf(model: Llama, path: str, source: str) -> str:
    """Write the model as a BF16 GGUF to `path` (which must not exist), with the
    metadata and tensor names of `source`, the GGUF it was loaded from (see the
    module docstring). Returns path."""
    import gguf
    import ml_dtypes

    from hisparse_jax.models.gguf_loader import _File

    path = os.path.abspath(path)
    check_target(path, "gguf")
    src = _File(source)
    cfg = read_config(src)
    if cfg != model.cfg:
        raise ValueError(f"{source}: the model's config differs from its source GGUF's "
                         "(overridden or truncated?); export it as loaded")
    arch = src.get("general.architecture")
    tensors = gguf_tensors(model, ARCHITECTURES[arch][0])
    names = list(src.tensors)
    if sorted(names) != sorted(tensors):
        missing = sorted(set(names) ^ set(tensors))
        raise ValueError(f"{source}: tensors do not match the model's: {', '.join(missing[:4])}")
    parent = os.path.dirname(path)
    try:
        os.makedirs(parent, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=parent)
    except OSError as e:
        raise ValueError(f"{path}: cannot write in {parent} ({e.strerror})") from None
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, arch)
        for field in src.reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue  # the writer's own
            kind = field.types[0]
            if field.name == gguf.Keys.General.FILE_TYPE:
                w.add_key_value(field.name, int(gguf.LlamaFileType.MOSTLY_BF16), kind)
                continue
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(field.name, field.contents(), kind, sub_type=sub)
        if gguf.Keys.General.FILE_TYPE not in src.reader.fields:
            w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
        for name in names:
            x = np.ascontiguousarray(tensors[name])
            assert x.dtype == ml_dtypes.bfloat16, (name, x.dtype)
            if x.ndim == 1:
                w.add_tensor(name, x.astype(np.float32))  # exact: bf16 values in F32
            else:
                w.add_tensor(name, x.view(np.uint16), raw_dtype=gguf.GGMLQuantizationType.BF16)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        _public(tmp, 0o666)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path
