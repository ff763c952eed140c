"""One Flax NNX decoder for the Llama family (Llama 1-3, SmolLM, Qwen2 with QKV bias).

The math is HF's `LlamaForCausalLM`: RMSNorm, rotate-half RoPE (dimension i pairs
with i + head_dim/2), grouped-query attention (query head i reads KV head
i // group), SwiGLU, tied or untied output. Weights are bf16; the weight tree
(`weight_shapes`, what loaders produce) holds matrices [in, out], and the model
stores them [out, in], as the embedding is: a decode step's few rows then stream
each weight row along its inputs (`matmul`). Every layer's weights are stacked on
a leading layer axis, and `Llama.layers` runs them with one `lax.scan` over the
layer index, so a 30-layer model compiles one layer's program, not 30. Attention is a callback
(`Attend`): the same model runs over a HiSparse cache or a dense one
(`engine.py`). Activations are float32; matmuls take bf16 inputs and accumulate
in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cpu_kernels import ops as cpu_ops
from hisparse_jax import backends
from hisparse_jax.validate import is_int, is_number

ROPE_KINDS = ("linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling for positions past the trained length (HF's
    `rope_scaling`): "linear" divides every frequency by `factor`; "llama3"
    divides only the low frequencies (wavelength above original/low_freq_factor)
    and blends the middle band; "yarn" blends interpolation and extrapolation per
    dimension between beta_fast and beta_slow rotations and scales the logits by
    `attention_factor` (default 0.1 ln(factor) + 1)."""

    kind: str
    factor: float
    original_max_position: int = 8192
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"RopeScaling.kind={self.kind!r}: must be one of {ROPE_KINDS}")
        if not (is_number(self.factor) and self.factor >= 1):
            raise ValueError(f"RopeScaling.factor={self.factor!r}: must be a number >= 1")
        if not (is_int(self.original_max_position) and self.original_max_position >= 1):
            raise ValueError(f"RopeScaling.original_max_position={self.original_max_position!r}: "
                             "must be a positive int")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError("RopeScaling: llama3 needs high_freq_factor > low_freq_factor > 0")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position: int = 8192  # trained context length
    tie_embeddings: bool = True
    qkv_bias: bool = False  # Qwen2: biases on the q, k, v projections
    bos_id: int | None = None
    eos_id: int | None = None

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position"):
            v = getattr(self, f)
            if not (is_int(v) and v >= 1):
                raise ValueError(f"LlamaConfig.{f}={v!r}: must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig: num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim={self.head_dim}: must be even (RoPE pairs)")
        if not (is_number(self.rope_theta) and self.rope_theta > 1):
            raise ValueError(f"LlamaConfig.rope_theta={self.rope_theta!r}: must be a number > 1")
        if not (isinstance(self.rms_norm_eps, float) and self.rms_norm_eps > 0):
            raise ValueError(f"LlamaConfig.rms_norm_eps={self.rms_norm_eps!r}: must be a float > 0")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError("LlamaConfig.rope_scaling: must be a RopeScaling or None")

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> LlamaConfig:
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------- RoPE

def rope_frequencies(cfg: LlamaConfig) -> tuple[np.ndarray, float]:
    """(inverse frequencies [head_dim/2] float32, logit scale of cos/sin), as HF's
    `ROPE_INIT_FUNCTIONS` compute them (float64 here, then float32)."""
    d, base, s = cfg.head_dim, float(cfg.rope_theta), cfg.rope_scaling
    inv = 1.0 / base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    scale = 1.0
    if s is None:
        pass
    elif s.kind == "linear":
        inv = inv / s.factor
    elif s.kind == "llama3":
        low_wavelen = s.original_max_position / s.low_freq_factor
        high_wavelen = s.original_max_position / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, blended, scaled)
    else:  # yarn
        def correction_dim(rotations):
            return d * math.log(s.original_max_position / (rotations * 2 * math.pi)) / (
                2 * math.log(base))
        low = max(math.floor(correction_dim(s.beta_fast)), 0)
        high = min(math.ceil(correction_dim(s.beta_slow)), d - 1)
        ramp = np.clip((np.arange(d // 2) - low) / max(high - low, 1e-3), 0, 1)
        extrapolate = 1 - ramp  # share of the original frequency, per dimension
        inv = inv / s.factor * (1 - extrapolate) + inv * extrapolate
        scale = (s.attention_factor if s.attention_factor is not None
                 else 0.1 * math.log(s.factor) + 1.0)
    return inv.astype(np.float32), scale


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float):
    """Rotate-half RoPE: x [..., H, D] at positions [...] (float32 math)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., D/2]
    cos = (jnp.cos(angles) * scale)[..., None, :]
    sin = (jnp.sin(angles) * scale)[..., None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# ---------------------------------------------------------------- layers

def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """The mean square is taken over rows padded to a multiple of 8: XLA:CPU sums
    fewer than 8 rows in another order than 8 or more (it vectorizes along a row
    instead of across rows), which made a sequence's decode step depend on how many
    slots the step computed (SmolLM2's logits up to 0.19 apart on the GPL's text)."""
    x = x.astype(jnp.float32)
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    rows = jnp.pad(rows, ((0, -n % 8), (0, 0)))
    ms = jnp.mean(rows * rows, axis=-1)[:n].reshape(*x.shape[:-1], 1)
    return x * jax.lax.rsqrt(ms + eps) * w.astype(jnp.float32)


MATMUL_MIN_ROWS = 4
# Products of at most this many rows run on the AMX kernel (products="cpu"): a
# decode step's, and a short prompt's or a prompt's last block's: past 64 rows
# XLA's packed products win back the layer's copy (docs/log/code-timings.md,
# "kernel rows"). Both sum in the same order (bit-equal), so the switch never
# shows in the numbers.
KERNEL_MAX_ROWS = 64
# Products of at most this many rows read a GGUF file's blocks where the model has
# them (`Quantized`): a decode step's. The kernel dequantizes each tile once for
# all its rows, which pays while the bytes read are the cost (a few rows).
BLOCKS_MAX_ROWS = 16


def matmul(x: jax.Array, w: jax.Array, layer=None, *, products: str = "xla",
           blocks: tuple | None = None) -> jax.Array:
    """x [..., in] times w [out, in] (layer None) or w[layer] of stacked weights [L,
    out, in], transposed: in bf16, accumulated in float32.

    products="cpu" (`backends.resolve("weight_products", ...)`): a product of at most
    KERNEL_MAX_ROWS rows (a decode step's, a short prompt's) runs on the kernel,
    which reads a stacked layer where it lies (cpu_kernels/matmul.cc; on AMX tiles,
    or without them on AVX-512 for up to 16 rows); XLA copies the layer out of the
    stack first, and its few-row products stream the weights slowly. Larger
    products are XLA's. `blocks`: the same weights as the GGUF file's blocks
    (codes, scales; cpu_kernels/blocks.py), which the kernel reads instead for at
    most BLOCKS_MAX_ROWS rows: a third of the bytes, the same numbers.

    In XLA, fewer than MATMUL_MIN_ROWS rows are padded with zeros: XLA:CPU's bf16
    matrix-vector path is much slower than its matrix-matrix one, and 4 rows cost
    what 2 do (docs/log/code-timings.md, "few rows"); and it sums 1 or 2 rows in
    another order than 3 or more, which made a sequence's decode step depend on
    how many slots the step computed. The kernel sums each row alone, in the order
    of XLA's products of 4 or more rows."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.bfloat16)
    return backends.kernel("weight_products", products)(x2, w, layer, blocks).reshape(*lead, -1)


@backends.register("weight_products", "cpu", strict=False,
                   why_not=backends.cpu_kernel_why_not("products_unavailable"))
def _products_cpu(x2, w, layer, blocks):
    """`matmul` on the kernel for the row counts it takes, XLA's otherwise."""
    n = x2.shape[0]
    if blocks is not None and n <= BLOCKS_MAX_ROWS:
        return cpu_ops.matmul_blocks(x2, *blocks, layer)
    if n <= KERNEL_MAX_ROWS and cpu_ops.matmul_unsupported(n, x2.shape[1], w.shape[-2]) is None:
        return cpu_ops.matmul(x2, w, layer)
    return _products_reference(x2, w, layer, blocks)


@backends.register("weight_products", "xla")
def _products_reference(x2, w, layer, blocks):
    n = x2.shape[0]
    if layer is not None:
        w = w[layer]
    if n < MATMUL_MIN_ROWS:
        x2 = jnp.pad(x2, ((0, MATMUL_MIN_ROWS - n), (0, 0)))
    y = jax.lax.dot_general(x2, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y[:n]


# attend(caches, layer, q [..., Hq, D], k [..., Hkv, D], v [..., Hkv, D]) -> (out [..., Hq, D],
# caches): what layer `layer` (a traced int) does with its cache (engine.py). `caches`
# is every layer's cache, stacked on a leading layer axis and carried through the
# layer loop, so that a layer updates its part in place (`caches.at[layer, ...]`):
# a per-layer slice passed in and out of the loop would be copied whole each step.
Attend = Callable[[Any, jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]

LAYER_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # stored [L, out, in]
BIAS_WEIGHTS = ("bq", "bk", "bv")


def layer_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """One layer's weight shapes (the model stacks them on a leading layer axis)."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes = {"attn_norm": (d,), "wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d),
              "mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
    if cfg.qkv_bias:
        shapes.update(bq=(q,), bk=(kv,), bv=(kv,))
    return shapes


def weight_shapes(cfg: LlamaConfig) -> dict[str, Any]:
    """The whole model's weight tree (shapes): what loaders produce."""
    shapes = {"embed": (cfg.vocab_size, cfg.hidden_size), "norm": (cfg.hidden_size,),
              "layers": {k: (cfg.num_layers, *s) for k, s in layer_shapes(cfg).items()}}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    return shapes


class Quantized(nnx.Variable):
    """A matrix's GGUF blocks in the kernel's tiles (cpu_kernels/blocks.py), kept
    beside its bf16 Param (which the prefill's products read): the weight tree's
    optional `quantized` entry (`check_weights`)."""


def _blocks(owner, name: str) -> tuple | None:
    """(codes, scales) of `owner`'s matrix `name`, where it has them."""
    codes = getattr(owner, name + "_codes", None)
    return None if codes is None else (codes[...], getattr(owner, name + "_scales")[...])


class Block(nnx.Module):
    """The decoder layers: each Param has a leading layer axis, and each method
    takes the layer's index (a traced int inside `Llama.layers`' scan), so that the
    weight products can read a layer where it lies (`matmul`). `products` is
    `matmul`'s."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, Any], quantized: dict | None = None):
        self.cfg = cfg
        for name in layer_shapes(cfg):
            w = jnp.asarray(weights[name], jnp.bfloat16)
            setattr(self, name, nnx.Param(w.swapaxes(-1, -2) if name in MATRICES else w))
        for name, (codes, scales) in (quantized or {}).items():
            setattr(self, name + "_codes", Quantized(jnp.asarray(codes, jnp.uint8)))
            setattr(self, name + "_scales", Quantized(jnp.asarray(scales, jnp.float16)))

    def __call__(self, x, positions, rope, caches, layer, attend: Attend, products="xla"):
        q, k, v = self.attention_inputs(x, positions, rope, layer, products)
        out, caches = attend(caches, layer, q, k, v)
        return self.finish(x, out, layer, products), caches

    def attention_inputs(self, x, positions, rope, layer, products="xla"):
        """x [..., d] at positions [...] -> q [..., Hq, D], k, v [..., Hkv, D]
        (RoPE applied to q and k)."""
        cfg = self.cfg
        inv_freq, scale = rope
        h = rms_norm(x, self.attn_norm[...][layer], cfg.rms_norm_eps)

        def proj(w, b, heads):
            y = self.product(h, w, layer, products)
            if b is not None:
                y = y + b[...][layer].astype(jnp.float32)
            return y.reshape(*x.shape[:-1], heads, cfg.head_dim)

        bias = (self.bq, self.bk, self.bv) if cfg.qkv_bias else (None,) * 3
        q = apply_rope(proj("wq", bias[0], cfg.num_heads), positions, inv_freq, scale)
        k = apply_rope(proj("wk", bias[1], cfg.num_kv_heads), positions, inv_freq, scale)
        v = proj("wv", bias[2], cfg.num_kv_heads)
        return q, k, v

    def finish(self, x, out, layer, products="xla"):
        """The rest of the layer after attention (out [..., Hq, D]): output
        projection, residual, MLP."""
        cfg = self.cfg
        mm = lambda a, name: self.product(a, name, layer, products)
        x = x + mm(out.reshape(*x.shape[:-1], -1), "wo")
        h = rms_norm(x, self.mlp_norm[...][layer], cfg.rms_norm_eps)
        gate = jax.nn.silu(mm(h, "w_gate"))
        return x + mm(gate * mm(h, "w_up"), "w_down")

    def product(self, x, name: str, layer, products="xla") -> jax.Array:
        """x @ layer `layer`'s weight matrix `name`: every product of the layers
        goes through here (`benchmarks/weight_quant.py` swaps in quantized ones)."""
        return matmul(x, getattr(self, name)[...], layer, products=products,
                      blocks=_blocks(self, name))


class Llama(nnx.Module):
    """The decoder. `weights` is the tree of `weight_shapes(cfg)` (numpy or jax
    arrays, any float dtype; stored bf16, matrices [out, in])."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, Any]):
        check_weights(cfg, weights)
        self.cfg = cfg
        self.embed = nnx.Param(jnp.asarray(weights["embed"], jnp.bfloat16))
        self.norm = nnx.Param(jnp.asarray(weights["norm"], jnp.bfloat16))
        self.lm_head = (None if cfg.tie_embeddings
                        else nnx.Param(jnp.asarray(weights["lm_head"], jnp.bfloat16).T))
        quantized = weights.get("quantized", {})
        if cfg.tie_embeddings and "embed" in quantized:
            self.embed_codes = Quantized(jnp.asarray(quantized["embed"][0], jnp.uint8))
            self.embed_scales = Quantized(jnp.asarray(quantized["embed"][1], jnp.float16))
        self.blocks = Block(cfg, weights["layers"], quantized.get("layers"))

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        return self.embed[...][tokens].astype(jnp.float32)

    def layers(self, x, positions, caches, attend: Attend, *, products: str = "xla"):
        """All layers: x [..., d] at positions [...]; caches: any pytree, carried
        through the layers and updated by `attend` -> (x, caches). products:
        `matmul`'s."""
        rope = self.rope()

        def body(carry, layer):
            x, caches = carry
            return self.blocks(x, positions, rope, caches, layer, attend, products), None

        layers = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
        (x, caches), _ = jax.lax.scan(body, (x, caches), layers)
        return x, caches

    def rope(self):
        inv_freq, scale = rope_frequencies(self.cfg)  # constants of the program
        return jnp.asarray(inv_freq), scale

    def logits(self, x: jax.Array, *, products: str = "xla") -> jax.Array:
        """Final norm and output projection: x [..., d] -> [..., V] float32."""
        h = rms_norm(x, self.norm[...], self.cfg.rms_norm_eps)
        if self.lm_head is None:
            return matmul(h, self.embed[...], products=products, blocks=_blocks(self, "embed"))
        return matmul(h, self.lm_head[...], products=products)

    def weights(self) -> dict[str, Any]:
        """The weight tree (jax arrays, bf16) in `weight_shapes` layout."""
        layers = {k: getattr(self.blocks, k)[...] for k in layer_shapes(self.cfg)}
        out = {"embed": self.embed[...], "norm": self.norm[...],
               "layers": {k: w.swapaxes(-1, -2) if k in MATRICES else w
                          for k, w in layers.items()}}
        if self.lm_head is not None:
            out["lm_head"] = self.lm_head[...].T
        return out


def check_finite(weights: dict[str, Any], where: str):
    """ValueError naming the first of a loaded checkpoint's tensors (numpy) that
    holds NaN or inf: a damaged file whose format still reads (bytes overwritten in
    place) would otherwise give NaN logits, and argmax picks token 0."""
    named = [(k, v) for k, v in weights.items() if k not in ("layers", "quantized")]
    named += [(f"layers.{k}", v) for k, v in weights.get("layers", {}).items()]
    for name, x in named:
        # layer by layer: a stacked 8B matrix's mask alone would take 2 GB
        if not all(np.isfinite(part).all() for part in (x if x.ndim == 3 else [x])):
            raise ValueError(f"{where}: weight {name} holds NaN or inf (a damaged file?)")


def check_weights(cfg: LlamaConfig, weights: dict[str, Any]):
    """Every tensor of `weight_shapes(cfg)` present with its shape and a float
    dtype (ValueError names the first that is not: an int or bool tensor would
    be cast to bf16 without a word)."""
    want = weight_shapes(cfg)
    for name, shape in want.items():
        if name == "layers":
            for k, s in shape.items():
                got = weights.get("layers", {}).get(k)
                if got is None or tuple(got.shape) != s:
                    raise ValueError(f"layer weight {k}: expected {s}, got "
                                     f"{None if got is None else tuple(got.shape)}")
                if not jnp.issubdtype(got.dtype, jnp.floating):
                    raise ValueError(f"layer weight {k}: dtype {got.dtype}, expected a float")
        elif name not in weights or tuple(weights[name].shape) != shape:
            got = weights.get(name)
            raise ValueError(f"weight {name}: expected {shape}, got "
                             f"{None if got is None else tuple(got.shape)}")
        elif not jnp.issubdtype(weights[name].dtype, jnp.floating):
            raise ValueError(f"weight {name}: dtype {weights[name].dtype}, expected a float")
    # optional: {"embed": (codes, scales), "layers": {matrix: (codes, scales)}}, the
    # GGUF blocks of those weights in cpu_kernels/blocks.py's tiles
    quantized = weights.get("quantized", {})
    tiles = [("embed", quantized["embed"], (cfg.hidden_size, cfg.vocab_size))] \
        if "embed" in quantized else []
    tiles += [(k, t, want["layers"][k][1:]) for k, t in quantized.get("layers", {}).items()]
    for name, (codes, scales), (inputs, outputs) in tiles:
        lead = (cfg.num_layers,) if name != "embed" else ()
        grid = (*lead, outputs // 16, inputs // 32)
        if (name != "embed" and name not in MATRICES or tuple(codes.shape[:-2]) != grid
                or tuple(codes.shape[-2:]) not in ((8, 32), (16, 32))
                or tuple(scales.shape) != (*grid, 2 if codes.shape[-2] == 8 else 1, 16)):
            raise ValueError(f"quantized weight {name}: codes {tuple(codes.shape)} and scales "
                             f"{tuple(scales.shape)} are not the tiles of a [{outputs}, {inputs}] "
                             "matrix (cpu_kernels/blocks.py)")


def random_weights(cfg: LlamaConfig, seed: int = 0, std: float = 0.02) -> dict[str, Any]:
    """Seeded random bf16 weights (norms 1, the rest ~normal(0, std)), made on the
    device tensor by tensor (`_random_fill`): no float32 or host copy of the model
    exists, and Llama-3-8B's shapes (16 GB in bf16) take seconds, not minutes."""
    leaf = lambda s: isinstance(s, tuple)
    paths, tree = jax.tree_util.tree_flatten_with_path(weight_shapes(cfg), is_leaf=leaf)
    out = []
    for i, (path, shape) in enumerate(paths):
        if "norm" in jax.tree_util.keystr(path):
            out.append(jnp.ones(shape, jnp.bfloat16))
        else:
            out.append(_random_fill(jax.random.fold_in(jax.random.key(seed), i), shape, std))
    return jax.tree.unflatten(tree, out)


_TABLE = 1 << 20


@functools.partial(jax.jit, static_argnums=(1, 2))
def _random_fill(key, shape, std):
    """A seeded normal(0, std) table of 2^20 bf16 values, read at a hash of each
    element's index: one gather per element instead of a random number (much
    faster for an 8B model's weights; docs/log/code-timings.md, "random weights")."""
    if math.prod(shape) >= 2**32:
        raise ValueError(f"random weights of shape {shape}: over 2^32 elements")
    table = (jax.random.normal(key, (_TABLE,), jnp.float32) * std).astype(jnp.bfloat16)
    flat, stride = jnp.zeros(shape, jnp.uint32), 1
    for axis in reversed(range(len(shape))):
        flat = flat + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
        stride *= shape[axis]
    h = flat * jnp.uint32(0x9E3779B1)  # murmur-style mixing
    h = (h ^ (h >> 15)) * jnp.uint32(0x85EBCA77)
    return table[(h ^ (h >> 13)) & (_TABLE - 1)]
