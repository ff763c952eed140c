"""GGUF files (llama.cpp's format): config from the metadata, weights dequantized
to bf16, and the tokenizer.

Dequantization is the `gguf` package's own (`gguf.quants.dequantize`, numpy),
for the types in `TENSOR_TYPES`. A GGUF tensor of ggml shape [ne0, ne1] reads as
numpy [ne1, ne0] = [out, in]; the model stores [in, out].

Q/K rows: llama.cpp's converter permutes each head's rows of attn_q/attn_k for
the llama architecture (HF pairs dimension i with i + D/2 in RoPE, llama.cpp
pairs 2i with 2i+1). We undo that permutation at load, so the model has HF's
rows and HF's rotate-half RoPE, and an HF export is a plain copy. (The
alternative, keeping llama.cpp's rows with interleaved RoPE, gives the same
logits up to rounding; undoing it means one RoPE and one weight layout.)

Q4_1 and Q8_0 matrices (and a tied embedding) are also kept in their blocks, laid
out for the decode step's weight-product kernel (weights["quantized"],
cpu_kernels/blocks.py): a decode step then reads 20 or 34 bytes per 32 weights
instead of bf16's 64, and gets the same numbers as from the bf16 weights.
"""

from __future__ import annotations

import os
import sys

import numpy as np
from tqdm import tqdm

from cpu_kernels import blocks
from hisparse_jax.models.llama import LlamaConfig, RopeScaling, check_finite
from hisparse_jax.models.tokenizer import Tokenizer

# architecture -> (Q/K rows permuted by the converter, QKV bias)
ARCHITECTURES = {"llama": (True, False), "qwen2": (False, True)}
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

LAYER_TENSORS = {  # GGUF blk.N.<name> -> model layer weight
    "attn_norm.weight": "attn_norm", "attn_q.weight": "wq", "attn_k.weight": "wk",
    "attn_v.weight": "wv", "attn_output.weight": "wo", "ffn_norm.weight": "mlp_norm",
    "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down",
    "attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv",
}


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's converter `permute`: rows [heads * D, ...] from its
    (pair-interleaved) order back to HF's (halves) order."""
    d = w.shape[0] // heads
    return w.reshape(heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter `permute` (HF order -> GGUF order); for tests and writers."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _File:
    """A GGUF file opened with gguf.GGUFReader; every problem is a one-line
    ValueError naming the file."""

    def __init__(self, path: str):
        import gguf
        self.path = path
        try:
            with open(path, "rb") as fh:
                magic = fh.read(4)
        except OSError as e:
            raise ValueError(f"{path}: cannot read ({e.strerror})") from None
        if magic != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as e:  # noqa: BLE001 (ValueError, IndexError, OSError, ...: any is one line)
            raise ValueError(f"{path}: corrupt or truncated GGUF "
                             f"({type(e).__name__}: {e})") from None
        size = os.path.getsize(path)
        self.tensors = {}
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise ValueError(f"{path}: truncated GGUF: tensor {t.name} needs bytes "
                                 f"{t.data_offset}..{t.data_offset + t.n_bytes} of a "
                                 f"{size}-byte file")
            self.tensors[t.name] = t

    def get(self, key, default=KeyError):
        field = self.reader.fields.get(key)
        if field is None:
            if default is KeyError:
                raise ValueError(f"{self.path}: GGUF metadata lacks {key}")
            return default
        return field.contents()

    def tensor(self, name: str, required: bool = True) -> np.ndarray | None:
        """float32 numpy array in GGUF/numpy order ([out, in] for matrices)."""
        import gguf
        t = self.tensors.get(name)
        if t is None:
            if required:
                raise ValueError(f"{self.path}: GGUF lacks tensor {name}")
            return None
        kind = t.tensor_type.name
        if kind not in TENSOR_TYPES:
            raise ValueError(f"{self.path}: tensor {name} has unsupported type {kind} "
                             f"(supported: {', '.join(TENSOR_TYPES)})")
        shape = tuple(int(n) for n in reversed(t.shape))
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type),
                          np.float32).reshape(shape)

    def tiles(self, name: str, row_order: np.ndarray | None = None) -> tuple | None:
        """Matrix `name`'s blocks in the decode kernel's tiles (codes, scales;
        cpu_kernels/blocks.py), or None where its type has no tiles."""
        t = self.tensors[name]
        shape = tuple(int(n) for n in reversed(t.shape))
        if not blocks.tileable(t.tensor_type.name, shape):
            return None
        return blocks.tile(t.data, t.tensor_type.name, *shape, row_order)


def _f32(x) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-5,
    not 9.999999747e-06): the value the checkpoint's author wrote."""
    return float(str(np.float32(x)))


def read_config(f: _File) -> LlamaConfig:
    arch = f.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{f.path}: unsupported architecture {arch!r} (supported: "
                         f"{', '.join(ARCHITECTURES)})")

    def key(name, default=KeyError):
        return f.get(f"{arch}.{name}", default)

    heads, kv = key("attention.head_count"), key("attention.head_count_kv", None)
    if isinstance(heads, list) or isinstance(kv, list):
        raise ValueError(f"{f.path}: per-layer head counts are not supported")  # noqa: TRY004
    kv = heads if kv is None else kv
    hidden = key("embedding_length")
    head_dim = key("attention.key_length", hidden // heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{f.path}: partial RoPE (rope.dimension_count "
                         f"{key('rope.dimension_count')} != head_dim {head_dim}) is not supported")
    if "rope_freqs.weight" in f.tensors:
        raise ValueError(f"{f.path}: RoPE frequency factors (rope_freqs.weight, Llama 3.1 "
                         "scaling) are not supported; load the HF checkpoint instead")
    scaling = None
    kind = key("rope.scaling.type", "none")
    if kind in ("linear", "yarn"):
        ctx = key("context_length", 8192)
        scaling = RopeScaling(kind=kind, factor=_f32(key("rope.scaling.factor")),
                              original_max_position=int(key(
                                  "rope.scaling.original_context_length", ctx)))
    elif kind != "none":
        raise ValueError(f"{f.path}: unsupported rope.scaling.type {kind!r}")
    embd = f.tensors.get("token_embd.weight")
    if embd is None:
        raise ValueError(f"{f.path}: GGUF lacks tensor token_embd.weight")
    return LlamaConfig(
        vocab_size=int(embd.shape[1]), hidden_size=int(hidden),
        intermediate_size=int(key("feed_forward_length")), num_layers=int(key("block_count")),
        num_heads=int(heads), num_kv_heads=int(kv), head_dim=int(head_dim),
        rope_theta=_f32(key("rope.freq_base", 10000.0)), rope_scaling=scaling,
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(key("context_length", 8192)),
        tie_embeddings="output.weight" not in f.tensors,
        qkv_bias=ARCHITECTURES[arch][1],
        bos_id=f.get("tokenizer.ggml.bos_token_id", None),
        eos_id=f.get("tokenizer.ggml.eos_token_id", None))


def _tokenizer(f: _File, path: str) -> Tokenizer | None:
    # No tokenizer in the file: the model loads without one, as an HF folder
    # without tokenizer.json does (prompts are then token ids).
    if f.get("tokenizer.ggml.model", None) in (None, "none", "no_vocab"):
        return None
    return Tokenizer.from_gguf_fields(f.get, where=path)


def read_tokenizer(path: str) -> Tokenizer | None:
    """The file's tokenizer alone, no weight dequantized."""
    return _tokenizer(_File(path), path)


def load_gguf(path: str, *, tokenizer: bool = True):
    """(LlamaConfig, weights in `llama.weight_shapes` layout (bf16 numpy) plus their
    blocks where the file has them (`quantized`, `llama.check_weights`), Tokenizer
    or None)."""
    import ml_dtypes
    bf16 = ml_dtypes.bfloat16
    f = _File(path)
    cfg = read_config(f)
    permuted = ARCHITECTURES[f.get("general.architecture")][0]
    heads = {"wq": cfg.num_heads, "wk": cfg.num_kv_heads, "bq": cfg.num_heads,
             "bk": cfg.num_kv_heads}
    layer_tensors = {g: name for g, name in LAYER_TENSORS.items()
                     if cfg.qkv_bias or not name.startswith("b")}
    # What the file must not hold, and its tokenizer, before minutes of dequantizing
    wanted = {f"blk.{i}.{g}" for g in layer_tensors for i in range(cfg.num_layers)}
    wanted |= {"token_embd.weight", "output_norm.weight"}
    wanted |= set() if cfg.tie_embeddings else {"output.weight"}
    unused = [name for name in f.tensors if name not in wanted]
    if unused:  # e.g. attn_q.bias on a llama file: loading without it gives wrong logits
        raise ValueError(f"{path}: tensor {unused[0]} is not a weight this loader supports "
                         f"for architecture {f.get('general.architecture')!r} ({len(unused)} "
                         "unused in all)")
    tok = _tokenizer(f, path) if tokenizer else None
    if tok is not None and tok.vocab_size != cfg.vocab_size:
        raise ValueError(f"{path}: tokenizer has {tok.vocab_size} tokens, the embedding "
                         f"{cfg.vocab_size} rows")
    layers, quantized = {}, {}
    progress = tqdm(layer_tensors.items(), desc=f"dequantizing {os.path.basename(path)}",
                    disable=not sys.stderr.isatty(), leave=False)
    for gguf_name, name in progress:
        rows, tiles = [], []
        for i in range(cfg.num_layers):
            w = f.tensor(f"blk.{i}.{gguf_name}")
            order = None
            if permuted and name in heads:
                w = unpermute_rows(w, heads[name])
                order = unpermute_rows(np.arange(w.shape[0]), heads[name])
            rows.append((w.T if w.ndim == 2 else w).astype(bf16))
            tiles.append(f.tiles(f"blk.{i}.{gguf_name}", order))
        layers[name] = np.stack(rows)
        if all(t is not None for t in tiles):
            quantized[name] = tuple(np.stack(part) for part in zip(*tiles))
    weights = {"embed": f.tensor("token_embd.weight").astype(bf16),
               "norm": f.tensor("output_norm.weight").astype(bf16), "layers": layers,
               "quantized": {"layers": quantized}}
    if not cfg.tie_embeddings:
        weights["lm_head"] = f.tensor("output.weight").T.astype(bf16)
    elif (embed := f.tiles("token_embd.weight")) is not None:
        weights["quantized"]["embed"] = embed
    check_finite(weights, path)
    return cfg, weights, tok
