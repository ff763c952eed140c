"""Bad input to the loaders: each problem is one line that names the file and
the problem (a wrong dtype, a config setting or weight the model does not
implement, a malformed config), and the GGUF tokenizer's pre-tokenizers."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from models_fixtures import SPECIALS, hf_weights, tiny_config, tiny_vocab, write_gguf, write_hf

from hisparse_jax.models import registry
from hisparse_jax.models.gguf_loader import load_gguf
from hisparse_jax.models.hf_loader import config_from_hf, load_hf
from hisparse_jax.models.llama import Llama, check_weights, weight_shapes
from hisparse_jax.models.tokenizer import Tokenizer, _pre_tokenizer


def _one_line(e):
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


# ---------------------------------------------------------------- dtypes

@pytest.mark.parametrize(("dtype", "ok"), [
    (np.float32, True), (np.float16, True), (np.float64, True), (ml_dtypes.bfloat16, True),
    (np.int64, False), (np.int8, False), (np.uint8, False), (np.bool_, False)])
def test_hf_tensor_dtype(tmp_path, dtype, ok):
    cfg = tiny_config()
    path = write_hf(tmp_path / "hf", cfg, hf_weights(cfg), dtype=dtype)
    if ok:
        got, w, _ = load_hf(str(path))
        assert got == cfg and w["embed"].dtype == ml_dtypes.bfloat16
        return
    with pytest.raises(ValueError) as e:
        load_hf(str(path))
    name = np.dtype(dtype).name
    assert _one_line(e) == (f"{path}/model.safetensors: tensor model.layers.0.input_layernorm"
                            f".weight has dtype {name} (expected F64, F32, F16 or BF16)")


@pytest.mark.parametrize(("where", "dtype", "message"), [
    ("embed", np.int32, "weight embed: dtype int32, expected a float"),
    ("norm", np.bool_, "weight norm: dtype bool, expected a float"),
    ("wq", np.int8, "layer weight wq: dtype int8, expected a float"),
    ("w_down", np.uint16, "layer weight w_down: dtype uint16, expected a float"),
    ("wq", ml_dtypes.bfloat16, None), ("embed", np.float16, None)])
def test_check_weights_dtype(where, dtype, message):
    cfg = tiny_config()
    w = {k: ({n: np.zeros(s, np.float32) for n, s in v.items()} if k == "layers"
             else np.zeros(v, np.float32)) for k, v in weight_shapes(cfg).items()}
    tree = w["layers"] if where in w["layers"] else w
    tree[where] = tree[where].astype(dtype)
    if message is None:
        check_weights(cfg, w)
        return
    with pytest.raises(ValueError, match=f"^{message}$"):
        check_weights(cfg, w)
    with pytest.raises(ValueError, match=f"^{message}$"):
        Llama(cfg, w)


# ---------------------------------------------------------------- HF config.json

def _config(**kw):
    c = {"model_type": "llama", "vocab_size": 300, "hidden_size": 256,
         "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 2048}
    c.update(kw)
    return {k: v for k, v in c.items() if v is not ...}


W = "m/config.json"


@pytest.mark.parametrize(("config", "message"), [
    ([1, 2], f"{W}: expected a JSON object, got list"),
    ("text", f"{W}: expected a JSON object, got str"),
    (_config(num_attention_heads=...), f"{W}: lacks num_attention_heads"),
    (_config(num_attention_heads=None), f"{W}: lacks num_attention_heads"),
    (_config(num_attention_heads=0), (f"{W}: num_attention_heads must be a positive integer, "
                                     "got 0")),
    (_config(hidden_size="256"), f"{W}: hidden_size must be a positive integer, got '256'"),
    (_config(num_hidden_layers=2.5), (f"{W}: num_hidden_layers must be a positive integer, "
                                     "got 2.5")),
    (_config(vocab_size=True), f"{W}: vocab_size must be a positive integer, got True"),
    (_config(rope_theta="big"), f"{W}: rope_theta must be a number, got 'big'"),
    (_config(rms_norm_eps=[1e-5]), f"{W}: rms_norm_eps must be a number, got [1e-05]"),
    (_config(rope_scaling="linear"), f"{W}: rope_scaling must be an object, got 'linear'"),
    (_config(rope_scaling={"rope_type": "llama3", "factor": None}),
     f"{W}: rope_scaling: lacks factor"),
    (_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     f"{W}: unsupported rope_scaling type 'dynamic'"),
    (_config(num_key_value_heads=3),
     f"{W}: LlamaConfig: num_heads=4 must be a multiple of num_kv_heads=3"),
    # settings the model does not implement
    (_config(hidden_act="gelu"), f"{W}: unsupported hidden_act 'gelu' (silu only)"),
    (_config(mlp_bias=True), f"{W}: mlp_bias is not supported"),
    (_config(attention_bias=True),
     f"{W}: attention_bias is not supported for llama (it puts a bias on o_proj too)"),
    (_config(model_type="mistral", sliding_window=1024),
     f"{W}: sliding_window 1024 (below the context 2048) is not supported"),
    (_config(model_type="qwen2", sliding_window=1024, use_sliding_window=True),
     f"{W}: sliding_window 1024 (below the context 2048) is not supported"),
    (_config(model_type="mistral", sliding_window="4k"),
     f"{W}: sliding_window must be a positive integer, got '4k'"),
])
def test_hf_config_errors(config, message):
    with pytest.raises(ValueError) as e:
        config_from_hf(config, W)
    assert _one_line(e) == message


@pytest.mark.parametrize("config", [
    _config(),
    _config(hidden_act="silu", mlp_bias=False, attention_bias=False),
    _config(model_type="mistral", sliding_window=None),
    _config(model_type="mistral", sliding_window=4096),  # never slides within the context
    _config(model_type="qwen2", sliding_window=1024, use_sliding_window=False),
    _config(model_type="qwen2", attention_bias=True),  # Qwen2's biases: q, k, v only
    _config(rms_norm_eps=None, rope_theta=None, head_dim=None, num_key_value_heads=None),
    _config(eos_token_id=[]),
])
def test_hf_config_accepted(config):
    cfg = config_from_hf(config, W)
    assert (cfg.num_heads, cfg.hidden_size) == (4, 256)


def test_hf_config_json_is_a_list(tmp_path):
    cfg = tiny_config()
    path = write_hf(tmp_path / "hf", cfg, hf_weights(cfg))
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError) as e:
        load_hf(str(path))
    assert _one_line(e) == f"{path}/config.json: expected a JSON object, got list"


# ---------------------------------------------------------------- tensors nobody reads

def _extra(cfg, hf, name):
    if name == "lm_head.weight (equal)":
        return {"lm_head.weight": hf["embed"].astype(np.float32)}
    if name == "lm_head.weight":
        return {name: hf["embed"] + 1}
    if name.endswith("inv_freq"):
        return {name: np.ones(cfg.head_dim // 2, np.float32)}
    return {name: np.ones(cfg.hidden_size, np.float32)}


@pytest.mark.parametrize(("extra", "message"), [
    ("model.layers.0.self_attn.o_proj.bias",
     ("tensor model.layers.0.self_attn.o_proj.bias is not a weight this loader supports "
     "(1 unused in all)")),
    ("model.layers.1.mlp.down_proj.bias",
     ("tensor model.layers.1.mlp.down_proj.bias is not a weight this loader supports "
     "(1 unused in all)")),
    ("model.layers.2.input_layernorm.weight",  # a layer past num_hidden_layers
     ("tensor model.layers.2.input_layernorm.weight is not a weight this loader supports "
     "(1 unused in all)")),
    ("lm_head.weight",
     "tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight"),
    # left alone: RoPE buffers, a tied head that is the embedding, other prefixes
    ("model.layers.0.self_attn.rotary_emb.inv_freq", None),
    ("lm_head.weight (equal)", None),
    ("value_head.weight", None),
])
def test_hf_unused_tensors(tmp_path, extra, message):
    cfg = tiny_config()
    hf = hf_weights(cfg)
    path = write_hf(tmp_path / "hf", cfg, hf, extra=_extra(cfg, hf, extra))
    if message is None:
        assert load_hf(str(path))[0] == cfg
        return
    with pytest.raises(ValueError) as e:
        load_hf(str(path))
    assert _one_line(e) == f"{path}/model.safetensors: {message}"


@pytest.mark.parametrize(("arch", "extra"), [
    ("llama", "blk.0.attn_q.bias"),      # a bias llama.cpp's llama graph would add
    ("llama", "blk.1.attn_output.bias"),
    ("qwen2", "blk.0.attn_output.bias"),
    ("llama", "token_embd_norm.weight"),
])
def test_gguf_unused_tensors(tmp_path, arch, extra):
    cfg = tiny_config(qkv_bias=arch == "qwen2")
    size = cfg.num_heads * cfg.head_dim if "attn_q" in extra else cfg.hidden_size
    p = write_gguf(tmp_path / "m.gguf", cfg, hf_weights(cfg), "F32", arch=arch,
                   extra={extra: np.ones(size, np.float32)})
    with pytest.raises(ValueError) as e:
        load_gguf(str(p))
    assert _one_line(e) == (f"{p}: tensor {extra} is not a weight this loader supports for "
                            f"architecture {arch!r} (1 unused in all)")


def test_gguf_llama_file_with_qkv_biases(tmp_path):
    """Biases written the way write_gguf writes a Qwen2 model, on a llama-arch file."""
    cfg = tiny_config(qkv_bias=True)
    p = write_gguf(tmp_path / "m.gguf", cfg, hf_weights(cfg), "F32", arch="llama")
    with pytest.raises(ValueError) as e:
        load_gguf(str(p))
    assert _one_line(e) == (f"{p}: tensor blk.0.attn_q.bias is not a weight this loader "
                            "supports for architecture 'llama' (6 unused in all)")


# ---------------------------------------------------------------- tokenizers

def _fields(pre="smollm", **kw):
    tokens, types, merges = tiny_vocab(300)
    f = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
         "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
         "tokenizer.ggml.pre": pre, "tokenizer.ggml.bos_token_id": 1,
         "tokenizer.ggml.eos_token_id": 2}
    f.update(kw)
    return {k: v for k, v in f.items() if v is not None}


def _from_fields(fields, where="m.gguf"):
    return Tokenizer.from_gguf_fields(lambda key, default=None: fields.get(key, default), where)


@pytest.mark.parametrize(("fields", "message"), [
    (_fields(pre=None), ("m.gguf: GGUF lacks tokenizer.ggml.pre (llama.cpp's 'default' split "
                        "is not supported; supported: smollm, gpt-2, qwen2, llama3, llama-v3, "
                        "llama-bpe)")),
    (_fields(pre="default"), ("m.gguf: GGUF pre-tokenizer 'default' (llama.cpp's fallback "
                             "split) is not supported (supported: smollm, gpt-2, qwen2, llama3, "
                             "llama-v3, llama-bpe)")),
    (_fields(pre="deepseek-llm"), ("m.gguf: unsupported GGUF pre-tokenizer 'deepseek-llm' "
                                  "(supported: smollm, gpt-2, qwen2, llama3, llama-v3, "
                                  "llama-bpe)")),
    (_fields(**{"tokenizer.ggml.model": "llama"}),
     "m.gguf: unsupported GGUF tokenizer model 'llama' (byte-level BPE 'gpt2' only)"),
    (_fields(**{"tokenizer.ggml.merges": None}),
     "m.gguf: GGUF tokenizer lacks tokenizer.ggml.tokens or .merges"),
])
def test_gguf_tokenizer_errors(fields, message):
    with pytest.raises(ValueError) as e:
        _from_fields(fields)
    assert _one_line(e) == message


# Expected splits: the matches of llama.cpp's QWEN2 / LLAMA3 regex, as Python's
# `regex` module finds them (regex.findall(pattern, text), run outside this venv,
# which lacks the module). Their (?i:'s|...) form finds the same here.
QWEN2_SPLITS = [
    ("Year 2024: 12345 items",
     ["Year", " ", "2", "0", "2", "4", ":", " ", "1", "2", "3", "4", "5", " items"]),
    ("I'm sure they'LL say it's fine",
     ["I", "'m", " sure", " they", "'LL", " say", " it", "'s", " fine"]),
    ("DON'T", ["DON", "'T"]),
    ("你好，世界！ 東京2020", ["你好", "，世界", "！", " 東京", "2", "0", "2", "0"]),
    ("a  b\n\nc \n  d   ", ["a", " ", " b", "\n\n", "c", " \n", " ", " d", "   "]),
    ("  leading\ttab\r\nCRLF", [" ", " leading", "\ttab", "\r\n", "CRLF"]),
    ("x+=1;\n\n\n", ["x", "+=", "1", ";\n\n\n"]),
    ("Café naïve 😀 ok", ["Café", " naïve", " 😀", " ok"]),
    ("$100.50 (approx.)", ["$", "1", "0", "0", ".", "5", "0", " (", "approx", ".)"]),
]
LLAMA3_DIGITS = [  # the same regex but \p{N}{1,3}: only the digit runs split differently
    ("Year 2024: 12345 items", ["Year", " ", "202", "4", ":", " ", "123", "45", " items"]),
    ("你好，世界！ 東京2020", ["你好", "，世界", "！", " 東京", "202", "0"]),
    ("$100.50 (approx.)", ["$", "100", ".", "50", " (", "approx", ".)"]),
]


def _split(pre, text):
    """Pieces of `text` as the pre-tokenizer cuts it (offsets into the text: the
    byte-level pieces themselves are in GPT-2's byte alphabet)."""
    return [text[a:b] for _, (a, b) in _pre_tokenizer(pre, "x").pre_tokenize_str(text)]


@pytest.mark.parametrize(("text", "want"), QWEN2_SPLITS)
def test_qwen2_pre_tokenizer(text, want):
    assert _split("qwen2", text) == want


@pytest.mark.parametrize(("text", "want"), LLAMA3_DIGITS + [
    (t, w) for t, w in QWEN2_SPLITS if not any(c.isdigit() for c in t)])
@pytest.mark.parametrize("pre", ["llama-bpe", "llama3"])
def test_llama3_pre_tokenizer(pre, text, want):
    assert _split(pre, text) == want


def test_llama3_ignore_merges_and_bos():
    """llama.cpp's LLAMA3: a word that is a token is taken whole (no merge builds
    "Ġwater" here), and BOS is added unless the file says otherwise."""
    fields = _fields(pre="llama-bpe")
    fields["tokenizer.ggml.tokens"] = [*fields["tokenizer.ggml.tokens"][:-1], "Ġwater"]
    tok = _from_fields(fields)
    assert tok.encode(" water") == [1, 299] and tok.add_bos
    smollm = _from_fields({**fields, "tokenizer.ggml.pre": "smollm"})
    assert len(smollm.encode(" water")) > 1 and not smollm.add_bos
    tok = _from_fields({**fields, "tokenizer.ggml.add_bos_token": False})
    assert tok.encode(" water") == [299]


def test_qwen2_gguf_with_its_pre_tokenizer(tmp_path):
    """A Qwen2 GGUF as llama.cpp's converter writes it (pre = qwen2)."""
    cfg = tiny_config(qkv_bias=True)
    p = write_gguf(tmp_path / "q.gguf", cfg, hf_weights(cfg), "F32", arch="qwen2", pre="qwen2")
    got, _, tok = load_gguf(str(p))
    assert got == cfg
    text = "<|im_start|>the hat 12<|im_end|>"
    ids = tok.encode(text)
    digits = [tok.hf.token_to_id(c) for c in "12"]
    assert ids[-3:-1] == digits and ids[0] == SPECIALS.index("<|im_start|>")
    assert tok.decode(ids, skip_special=False) == text
    assert tok.render_chat([{"role": "user", "content": "hi"}]).startswith("<|im_start|>user")


def test_gguf_without_tokenizer_loads_without_one(tmp_path):
    """As an HF folder without tokenizer.json: the model, and no tokenizer."""
    cfg = tiny_config()
    p = write_gguf(tmp_path / "m.gguf", cfg, hf_weights(cfg), "F32", tokenizer=False)
    cfg = cfg.replace(bos_id=None, eos_id=None)  # these are tokenizer metadata
    got, _, tok = load_gguf(str(p))
    assert got == cfg and tok is None
    model, tok = registry.load(str(p))
    assert model.cfg == cfg and tok is None


def test_gguf_tokenizer_errors_name_the_file(tmp_path):
    cfg = tiny_config()
    p = write_gguf(tmp_path / "m.gguf", cfg, hf_weights(cfg), "F32", pre=None)
    with pytest.raises(ValueError) as e:
        load_gguf(str(p))
    assert _one_line(e).startswith(f"{p}: GGUF lacks tokenizer.ggml.pre")
    p = write_gguf(tmp_path / "s.gguf", cfg, hf_weights(cfg), "F32", tokenizer_model="llama")
    with pytest.raises(ValueError, match=f"^{p}: unsupported GGUF tokenizer model 'llama'"):
        load_gguf(str(p))


# ---------------------------------------------------------------- HF tokenizer files

def _hf_with_tokenizer(tmp_path, cfg=None):
    cfg = cfg or tiny_config()
    path = write_hf(tmp_path / "hf", cfg, hf_weights(cfg))
    _from_fields(_fields()).save_hf(str(path))
    return path


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", ("cannot read (Expecting property name enclosed in double quotes: "
                  "line 1 column 2 (char 1))")),
    ("[1, 2]", "expected a JSON object, got list"),
    (b"\xff\xfe{}", "cannot read ("),
])
def test_hf_tokenizer_config_errors(tmp_path, text, message):
    path = _hf_with_tokenizer(tmp_path)
    tc = path / "tokenizer_config.json"
    tc.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError) as e:
        load_hf(str(path))
    assert _one_line(e).startswith(f"{tc}: {message}")


@pytest.mark.parametrize("in_config", [True, False])
def test_hf_chat_template_jinja(tmp_path, in_config):
    """transformers' chat_template.jinja: read when tokenizer_config.json has no
    template, and first when both have one (as transformers does)."""
    path = _hf_with_tokenizer(tmp_path)
    tc = path / "tokenizer_config.json"
    conf = json.loads(tc.read_text())
    conf.pop("chat_template", None)
    if in_config:
        conf["chat_template"] = "config: {{ messages[0]['content'] }}"
    tc.write_text(json.dumps(conf))
    assert load_hf(str(path))[2].chat_template == conf.get("chat_template")
    (path / "chat_template.jinja").write_text("file: {{ messages[0]['content'] }}")
    tok = load_hf(str(path))[2]
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "file: hi"


def test_hf_tokenizer_larger_than_embedding(tmp_path):
    path = _hf_with_tokenizer(tmp_path, tiny_config(vocab_size=280))
    with pytest.raises(ValueError) as e:
        load_hf(str(path))
    assert _one_line(e) == f"{path}: tokenizer.json has 300 tokens, the embedding 280 rows"
    # fewer tokens than rows (HF pads its embeddings): loads
    path = _hf_with_tokenizer(tmp_path / "b", tiny_config(vocab_size=320))
    cfg, _, tok = load_hf(str(path))
    assert (cfg.vocab_size, tok.vocab_size) == (320, 300)
