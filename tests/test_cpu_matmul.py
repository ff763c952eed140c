"""The model's weight-product kernel (cpu_kernels/matmul.cc: AMX tiles, or AVX-512
for up to 16 rows) against its reference (cpu_kernels/reference.py) and XLA's
product.

Adversarial shapes: 1 to 16 rows (a decode step's path) and 17 to 515 (the
prefill's: a partial last group of 16, an odd number of groups, a partial block
of four), outputs that fill 1 to 4 of a unit's 16-row tiles (48, 80, 1040; one of
the many-row path's two), SmolLM2's seven matrices and its 49,152-row output
projection, a layer read from a stack of several (the others hold other values,
so reading the wrong one fails), NaN in one row, a traced layer index. Tolerance
against the float32 reference: 1e-5 of the output's scale (the products of bf16
are exact, the sums in another order); on AMX, bitwise against the model's XLA
product. The AVX-512 path runs wherever the CPU has it (`amx=False`, on AMX CPUs
too), each test on both paths where it applies. The same kernel reading GGUF Q4_1 /
Q8_0 blocks (cpu_kernels/blocks.py): bitwise against the bf16 kernel on the
loader's dequantized weights, on either path.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import AMX, AVX512, PRODUCT_PATHS, needs_amx

from cpu_kernels import blocks, build, ops, reference
from hisparse_jax import backends
from hisparse_jax.models.llama import matmul


@dataclasses.dataclass(frozen=True)
class Case:
    rows: int
    outputs: int
    inputs: int
    layers: int = 1
    layer: int = 0
    scale: float = 1.0

    def __str__(self):
        return "-".join(f"{f.name[:2]}{getattr(self, f.name)}" for f in dataclasses.fields(self))


CASES = [
    Case(1, 576, 576),                       # wq, one sequence
    Case(2, 192, 576, layers=30, layer=29),  # wk of the last layer
    Case(3, 1536, 576, layers=3, layer=1),   # w_gate
    Case(8, 576, 1536, layers=2, layer=0),   # w_down, eight sequences
    Case(7, 48, 64),                         # three tiles: a unit's tail
    Case(16, 80, 96, layers=2, layer=1),     # 64 + 16: a unit of one tile
    Case(5, 1040, 32, scale=1e3),            # one input chunk, large values
    Case(4, 49152, 576),                     # the tied output projection
    Case(17, 576, 576),                      # many rows: one past a group
    Case(64, 1536, 576, layers=3, layer=2),  # a short prompt's w_gate
    Case(100, 576, 1536, layers=2, layer=1), # w_down, a partial last group
    Case(33, 48, 64),                        # three groups (one unpaired), one tile and a half
    Case(515, 80, 96, scale=1e3),            # nine blocks of 64 rows, the last of 3
    Case(128, 192, 576, layers=30, layer=7), # wk, a 128-row block
]


def make(c: Case, seed=0):
    """x [rows, in] float32, w [layers, out, in] bf16 (each layer different)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((c.rows, c.inputs)) * c.scale
    w = rng.standard_normal((c.layers, c.outputs, c.inputs)) * 0.05
    return jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.bfloat16)


def close(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


FEW_ROWS = [c for c in CASES if c.rows <= ops.AVX512_MAX_ROWS]  # both paths' cases


@pytest.mark.parametrize("case", FEW_ROWS, ids=str)
@pytest.mark.parametrize("amx", PRODUCT_PATHS)
def test_few_rows_match_the_reference_on_either_path(case, amx):
    x, w = make(case)
    got = ops.matmul(x, w, case.layer, amx=amx)
    close(got, reference.matmul(x.astype(jnp.bfloat16).astype(jnp.float32), w, case.layer))
    if case.layers == 1:  # unstacked weights [out, in]
        np.testing.assert_array_equal(np.asarray(ops.matmul(x, w[0], amx=amx)), np.asarray(got))


@needs_amx
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_the_reference_and_xla(case):
    x, w = make(case)
    got = ops.matmul(x, w, case.layer)
    close(got, reference.matmul(x.astype(jnp.bfloat16).astype(jnp.float32), w, case.layer))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(matmul(x, w, case.layer)))
    if case.layers == 1:  # unstacked weights [out, in]
        np.testing.assert_array_equal(np.asarray(ops.matmul(x, w[0])), np.asarray(got))


@pytest.mark.parametrize(("case", "splits", "amx"), [
    (CASES[2], range(1, 3), True), (CASES[5], range(1, 16), True),
    (Case(70, 80, 96, layers=2, layer=1), [1, 15, 16, 17, 31, 33, 64, 69], True),
    (CASES[2], range(1, 3), False), (CASES[5], range(1, 16), False)], ids=str)
def test_a_row_gets_the_same_result_with_any_rows(case, splits, amx):
    """Bitwise: a sequence's decode step must not depend on how many slots it
    computes, nor a prompt's row on the prompt's length (so the few-row and the
    many-row paths agree too)."""
    if not (AMX if amx else AVX512):
        pytest.skip("that path does not run on this CPU")
    x, w = make(case)
    whole = np.asarray(ops.matmul(x, w, case.layer, amx=amx))
    for rows in splits:
        np.testing.assert_array_equal(np.asarray(ops.matmul(x[:rows], w, case.layer, amx=amx)),
                                      whole[:rows])
        np.testing.assert_array_equal(np.asarray(ops.matmul(x[rows:], w, case.layer, amx=amx)),
                                      whole[rows:])


@pytest.mark.parametrize(("case", "amx"), [(CASES[3], True), (CASES[10], True),
                                           (CASES[3], False)], ids=str)
def test_nan_in_one_row_stays_in_that_row(case, amx):
    if not (AMX if amx else AVX512):
        pytest.skip("that path does not run on this CPU")
    x, w = make(case)
    clean = np.asarray(ops.matmul(x, w, case.layer, amx=amx))
    got = np.asarray(ops.matmul(x.at[5, 17].set(jnp.nan), w, case.layer, amx=amx))
    assert np.isnan(got[5]).all()
    np.testing.assert_array_equal(np.delete(got, 5, 0), np.delete(clean, 5, 0))


@pytest.mark.parametrize("amx", PRODUCT_PATHS)
def test_in_a_jitted_scan_with_a_traced_layer(amx):
    """As the model's layer loop calls it: the stack closed over, the layer traced."""
    case = Case(4, 576, 576, layers=5)
    x, w = make(case)
    f = jax.jit(lambda x, w: jax.lax.scan(lambda c, i: (c, ops.matmul(x, w, i, amx=amx)), 0,
                                          jnp.arange(5))[1])
    got = np.asarray(f(x, w))
    for layer in range(5):
        np.testing.assert_array_equal(got[layer], np.asarray(ops.matmul(x, w, layer, amx=amx)))
    assert "hisparse_matmul" in f.lower(x, w).as_text()


@pytest.mark.parametrize(("rows", "inputs", "outputs", "amx", "match"), [
    (0, 576, 576, True, "at least 1 row"),
    (2, 48, 576, True, "multiple of 32"), (2, 576, 40, True, "multiple of 32 and outputs of 16"),
    (17, 576, 576, False, "more than 16 rows need AMX")])
def test_shapes_it_cannot_take_are_refused(rows, inputs, outputs, amx, match):
    """ops.matmul says why; the model's `matmul` runs those in XLA instead."""
    if build.products_unavailable():
        pytest.skip(build.products_unavailable())
    x = jnp.ones((rows, inputs), jnp.float32)
    w = jnp.ones((outputs, inputs), jnp.bfloat16)
    with pytest.raises(RuntimeError, match=match):
        ops.matmul(x, w, amx=amx)
    if rows and amx:
        np.testing.assert_array_equal(np.asarray(matmul(x, w, products="cpu")),
                                      np.asarray(matmul(x, w)))


@pytest.mark.parametrize("amx", PRODUCT_PATHS)
def test_a_layer_out_of_range_is_an_error(amx):
    x, w = make(Case(2, 64, 64, layers=3))
    with pytest.raises(Exception, match="layer out of range"):
        np.asarray(ops.matmul(x, w, 3, amx=amx))


@pytest.mark.parametrize(("implementation", "want"), [
    ("xla", "xla"), ("pallas", "xla"), (None, "cpu" if AMX or AVX512 else "xla"),
    ("cpu", "cpu" if AMX or AVX512 else "xla")])
def test_which_products_run(implementation, want):
    """The kernel where it can run (the default, and with the decode kernels), XLA's
    products everywhere else; a CPU without AMX runs only its few-row path, one
    without AVX-512 neither, and says why."""
    assert backends.resolve("weight_products", implementation) == want
    assert (build.amx_unavailable() is None) == AMX
    assert (build.products_unavailable() is None) == (AMX or AVX512)
    if not AMX:  # the model's matmul runs more rows in XLA instead
        assert ops.matmul_unsupported(17, 576, 576) is not None
        assert ops.matmul_unsupported(16, 576, 576) is None
    if not (AMX or AVX512):
        with pytest.raises(RuntimeError, match="AVX-512|compiler"):
            ops.matmul(*make(CASES[0]))


@needs_amx
@pytest.mark.parametrize("attention", ["hisparse", "dense"])
def test_the_engine_decodes_on_the_kernel_with_xlas_numbers(attention):
    """The engine runs its products on the kernel by default (a decode step's, a
    64-row prefill's), and its logits are bit-equal to the same engine's with XLA's
    products."""
    from models_fixtures import hf_weights, model_weights, tiny_config

    from hisparse_jax.models import engine as eng
    from hisparse_jax.models import kv
    from hisparse_jax.models.llama import Llama
    cfg = tiny_config()
    model = Llama(cfg, model_weights(cfg, hf_weights(cfg)))
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 300)
    logits = {}
    for products in ("cpu", "xla"):
        e = eng.Engine(model, max_seqs=3, max_context=512, attention=attention, budget_tokens=64)
        assert e.product_implementation == "cpu"
        e.product_implementation = products
        for slot, n in enumerate([40, 270, 290]):  # 64 rows (the kernel's), 512 (XLA's)
            e.prefill(slot, prompt[:n])
            logits.setdefault(products + "-prefill", []).append(np.asarray(e.logits))
        hlo = kv.decode.lower(e.params, e.caches, jnp.asarray(e.tokens), jnp.asarray(e.lens),
                               jnp.ones(3, bool), e._samp(), **e._static(), n=3).as_text()
        assert ("hisparse_matmul" in hlo) == (products == "cpu")
        steps = [np.asarray(e.decode_step()) for _ in range(4)]
        logits[products] = (steps, np.asarray(e.logits))
    for a, b in zip(logits["cpu-prefill"], logits["xla-prefill"]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(logits["cpu"][1], logits["xla"][1])
    for a, b in zip(logits["cpu"][0], logits["xla"][0]):
        np.testing.assert_array_equal(a, b)


# Weights in GGUF blocks (cpu_kernels/blocks.py): the decode step's products read
# Q4_1 / Q8_0 tiles and dequantize them in the kernel, bit-equal to the bf16 kernel
# on the loader's bf16 weights (on the same path).
BLOCK_CASES = CASES[:7]  # the few-row ones: 1 to 16 rows


def make_blocks(kind: str, c: Case, seed=0, row_order=None):
    """Random GGUF blocks of `kind` for c's weights (every code; scales of both
    signs, some zero, some tiny), tiled -> (codes, scales, the loader's bf16 weights
    [layers, out, in])."""
    import gguf
    import ml_dtypes
    rng = np.random.default_rng(seed)
    nbytes, nscales = blocks.FORMATS[kind]
    nb = c.inputs // 32
    raw = rng.integers(0, 256, (c.layers, c.outputs, nb, 2 * nscales + nbytes), dtype=np.uint8)
    sc = (rng.standard_normal((c.layers, c.outputs, nb, nscales)) * 0.01).astype(np.float16)
    sc.reshape(-1)[::7] = 0
    sc.reshape(-1)[3::11] = np.float16(6e-8)  # the smallest f16 subnormal
    raw[..., :2 * nscales] = sc.view(np.uint8).reshape(*sc.shape[:-1], 2 * nscales)
    raw = raw.reshape(c.layers, c.outputs, -1)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    tiles = [blocks.tile(r, kind, c.outputs, c.inputs, row_order) for r in raw]
    want = np.stack([gguf.quants.dequantize(r, qtype).reshape(c.outputs, c.inputs) for r in raw])
    if row_order is not None:
        want = want[:, row_order]
    codes, scales = (np.stack(part) for part in zip(*tiles))
    return codes, scales, want.astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("kind", sorted(blocks.FORMATS))
@pytest.mark.parametrize("case", BLOCK_CASES[:4], ids=str)
def test_tiles_dequantize_to_the_loaders_weights(kind, case):
    """The reference's dequantization of the tiles, rows reordered or not, equals
    gguf.quants' float32 values rounded to bf16, bit for bit."""
    order = np.random.default_rng(1).permutation(case.outputs)
    for row_order in (None, order):
        codes, scales, want = make_blocks(kind, case, row_order=row_order)
        got = np.asarray(blocks.dequantize(codes, scales))
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("amx", PRODUCT_PATHS)
@pytest.mark.parametrize("kind", sorted(blocks.FORMATS))
@pytest.mark.parametrize("case", BLOCK_CASES, ids=str)
def test_products_of_blocks_equal_the_bf16_kernels(kind, case, amx):
    codes, scales, w = make_blocks(kind, case)
    x, _ = make(case)
    got = np.asarray(ops.matmul_blocks(x, codes, scales, case.layer, amx=amx))
    np.testing.assert_array_equal(
        got, np.asarray(ops.matmul(x, jnp.asarray(w), case.layer, amx=amx)))
    close(got, reference.matmul(x.astype(jnp.bfloat16).astype(jnp.float32), w, case.layer))
    if case.layers == 1:  # unstacked tiles
        np.testing.assert_array_equal(
            np.asarray(ops.matmul_blocks(x, codes[0], scales[0], amx=amx)), got)
    if amx == AMX:  # the model's matmul (the CPU's own path) takes them up to
        # BLOCKS_MAX_ROWS rows, and its products agree
        np.testing.assert_array_equal(
            np.asarray(matmul(x, jnp.asarray(w), case.layer, products="cpu",
                              blocks=(codes, scales))), got)


@pytest.mark.parametrize("amx", PRODUCT_PATHS)
def test_products_of_blocks_keep_nan_in_its_row_and_refuse_what_they_cannot_take(amx):
    case = BLOCK_CASES[3]
    codes, scales, w = make_blocks("Q4_1", case)
    x, _ = make(case)
    clean = np.asarray(ops.matmul_blocks(x, codes, scales, case.layer, amx=amx))
    got = np.asarray(ops.matmul_blocks(x.at[5, 17].set(jnp.nan), codes, scales, case.layer,
                                       amx=amx))
    assert np.isnan(got[5]).all()
    np.testing.assert_array_equal(np.delete(got, 5, 0), np.delete(clean, 5, 0))
    x17 = jnp.ones((17, case.inputs), jnp.float32)
    with pytest.raises(RuntimeError, match="at most 16 rows"):
        ops.matmul_blocks(x17, codes, scales, 0, amx=amx)
    # 17 rows: the model's matmul reads the bf16 weights instead (AMX's kernel, or
    # XLA without it), the same numbers as without the blocks
    np.testing.assert_array_equal(
        np.asarray(matmul(x17, jnp.asarray(w), 0, products="cpu", blocks=(codes, scales))),
        np.asarray(matmul(x17, jnp.asarray(w), 0, products="cpu")))
    with pytest.raises(Exception, match="shapes"):
        np.asarray(ops.matmul_blocks(jnp.ones((2, 64)), codes, scales, 0, amx=amx))
    with pytest.raises(Exception, match="layer out of range"):
        np.asarray(ops.matmul_blocks(x, codes, scales, case.layers, amx=amx))


@pytest.mark.skipif(not (AMX or AVX512), reason="the kernel runs on AMX or AVX-512 CPUs")
@pytest.mark.parametrize("attention", ["hisparse", "dense"])
def test_the_engine_decodes_from_gguf_blocks_with_the_bf16_numbers(tmp_path, attention):
    """A Q4_1 GGUF (Q8_0 embedding) keeps its blocks, and the engine's decode steps
    read them (the blocks kernel in the program, on this CPU's path), with logits
    bit-equal to the same model's without them."""
    from models_fixtures import hf_weights, tiny_config, write_gguf

    from hisparse_jax.models import engine as eng
    from hisparse_jax.models import kv
    from hisparse_jax.models.gguf_loader import load_gguf
    from hisparse_jax.models.llama import Llama
    cfg = tiny_config(vocab_size=320)  # a tileable embedding
    path = write_gguf(tmp_path / "m.gguf", cfg, hf_weights(cfg), "Q4_1")
    _, w, _ = load_gguf(str(path))
    import gguf
    q8 = gguf.quants.quantize(np.asarray(w["embed"], np.float32), gguf.GGMLQuantizationType.Q8_0)
    w["quantized"]["embed"] = blocks.tile(q8, "Q8_0", *w["embed"].shape)
    w["embed"] = np.asarray(blocks.dequantize(*w["quantized"]["embed"]))
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 300)
    runs = {}
    for name, weights in (("blocks", w), ("bf16", {k: v for k, v in w.items() if k != "quantized"})):
        e = eng.Engine(Llama(cfg, weights), max_seqs=3, max_context=512, attention=attention,
                       budget_tokens=64)
        for slot, n in enumerate([40, 270, 290]):
            e.prefill(slot, prompt[:n])
        hlo = kv.decode.lower(e.params, e.caches, jnp.asarray(e.tokens), jnp.asarray(e.lens),
                               jnp.ones(3, bool), e._samp(), **e._static(), n=3).as_text()
        assert ("hisparse_matmul_blocks" in hlo) == (name == "blocks")
        runs[name] = [(np.asarray(e.decode_step()), np.asarray(e.logits)) for _ in range(4)]
    for (ta, la), (tb, lb) in zip(runs["blocks"], runs["bf16"]):
        np.testing.assert_array_equal(ta, tb)
        np.testing.assert_array_equal(la, lb)
