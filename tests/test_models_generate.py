"""generate(), batched slots, the CLI and the HF export round trip, on the real
SmolLM2-135M-Instruct (through `registry.load`, i.e. fetch)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from models_fixtures import smollm2

from hisparse_jax.cli import main
from hisparse_jax.models import registry
from hisparse_jax.models.engine import Engine
from hisparse_jax.models.generate import TextStream, generate, prompt_ids
from hisparse_jax.models.prompts import passkey
from hisparse_jax.models.sampling import SamplingParams
from tests.helpers import cli_error, interrupted_cli

FRANCE = "What is the capital of France?"


@pytest.fixture(scope="module")
def model():
    return smollm2()


@pytest.fixture(scope="module")
def hisparse(model):
    """One engine for the short-prompt tests (one compile)."""
    return Engine(model[0], max_context=256, attention="hisparse")


def test_chat_answer_streams_and_stops_at_eos(model, hisparse):
    m, tok = model
    gen = generate(m, tok, FRANCE, chat=True, max_tokens=40, engine=hisparse)
    pieces = list(gen)
    assert "Paris" in gen.text
    assert gen.text == "".join(p.text for p in pieces) and "<|im_end|>" not in gen.text
    s = gen.summary
    assert s.finish == "eos" and gen.ids[-1] == 2 and s.tokens == len(gen.ids) < 40
    assert s.prompt_tokens == len(tok.chat_ids([{"role": "user", "content": FRANCE}]))
    line = s.line()
    assert "hisparse attention" in line and "tok/s" in line
    assert "HiSparse KV cache:" in line and "x capacity vs bf16" in line and "30 layers" in line


def test_max_tokens_stop_strings_and_ignore_eos(model, hisparse):
    m, tok = model
    gen = generate(m, tok, "The capital of France is", max_tokens=5, engine=hisparse).run()
    assert gen.summary.finish == "length" and len(gen.ids) == 5
    assert gen.text.startswith(" Paris")
    # a stop string inside a token: the text before it is emitted, nothing after
    gen = generate(m, tok, "The capital of France is", max_tokens=20, stop=["aris"],
                   engine=hisparse).run()
    assert gen.text == " P" and gen.summary.finish == "stop"
    gen = generate(m, tok, FRANCE, chat=True, max_tokens=24, ignore_eos=True,
                   engine=hisparse).run()
    assert len(gen.ids) == 24 and 2 in gen.ids  # ran past <|im_end|>


@pytest.mark.parametrize("text, stops, want, finish", [
    ("Paris.\n", ("\n\n",), "Paris.\n", "eos"),  # held back for a stop, then EOS: emitted
    ("Paris.\n\nMore", ("\n\n",), "Paris.", "stop"),
    ("Paris.\n", (), "Paris.\n", "eos"),
    ("The end: ar", ("aris",), "The end: ar", "eos"),
    ("The end: ar", ("aris", "d: a"), "The en", "stop"),
])
def test_text_stream_emits_held_back_text_at_eos(model, text, stops, want, finish):
    """Text held back because it might begin a stop string is the answer's end when
    EOS comes instead (it was lost before), and nothing past a stop string is."""
    tok = model[1]
    stream = TextStream(tok, stops, eos=(2,))
    out, done = "", None
    for t in tok.encode(text) + [2]:
        piece, done = stream.push(t)
        out += piece
        if done:
            break
    assert (out, done) == (want, finish)


@pytest.mark.parametrize("prompt, error", [
    ([0.5, 3.9], "integer token ids"),
    (["12", 3], "integer token ids"),
    (np.array([1.7, 2.2]), "integer token ids"),
    ([3, -1], ">= 0"),
    ([[1, 2]], "1-D"),
])
def test_prompt_ids_refuse_what_is_no_token_id(prompt, error):
    with pytest.raises(ValueError, match=error):
        prompt_ids(None, prompt)


def test_prompt_ids_take_integer_ids():
    assert prompt_ids(None, np.array([1, 2], np.int32)) == [1, 2] == prompt_ids(None, (1, 2))


def test_stop_is_one_string_or_a_list_of_non_empty_ones(model, hisparse):
    m, tok = model
    one = generate(m, tok, FRANCE, chat=True, max_tokens=24, ignore_eos=True, stop="\n\n",
                   engine=hisparse).run()
    listed = generate(m, tok, FRANCE, chat=True, max_tokens=24, ignore_eos=True,
                      stop=["\n\n"], engine=hisparse).run()
    assert one.text == listed.text and one.summary.finish == listed.summary.finish
    for bad in ([""], ["ok", ""], [3]):
        with pytest.raises(ValueError, match="stop strings must be non-empty strings"):
            generate(m, tok, FRANCE, stop=bad, engine=hisparse)


def test_sampling_is_seeded(model, hisparse):
    m, tok = model
    run = lambda seed: generate(m, tok, "Once upon a time", max_tokens=6,
                                temperature=1.0, top_p=0.9, seed=seed, engine=hisparse).run().ids
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_prompt_too_long(model):
    m, tok = model
    with pytest.raises(ValueError, match="prompt of 9000 tokens does not fit the max context of "
                                         "8192 tokens"):
        generate(m, tok, [5] * 9000)
    with pytest.raises(ValueError, match="prompt of 300 tokens does not fit max_context=256"):
        generate(m, tok, [5] * 300, engine=Engine(m, max_context=256, attention="dense"))
    with pytest.raises(ValueError, match="max_context=8208: past the model's 8192 trained"):
        generate(m, tok, [5] * 10, max_context=8208)


def test_passkey_through_sparse_selection(model):
    """A ~1K-token passkey prompt with the needle in the cold tier (int4, pages
    chosen by selection) and a budget of 4 of its ~27 cold pages: HiSparse still
    retrieves it."""
    from hisparse_jax.cache.state import num_cold_pages
    m, tok = model
    text = passkey(36, 0.3, 68294)
    ids = tok.encode(text)
    needle = len(tok.encode(text[:text.index("The pass key is")]))
    e = Engine(m, max_context=1024, attention="hisparse", budget_tokens=64)
    cfg = e.cache_cfg
    assert 900 < len(ids) < 1010 and cfg.budget_pages == 4
    assert int(num_cold_pages(cfg, len(ids))) > 25
    assert cfg.sink_tokens < needle < len(ids) - cfg.hot_tokens - cfg.warm_tokens - 16  # cold
    gen = generate(m, tok, ids, max_tokens=6, engine=e).run()
    assert "68294" in gen.text, gen.text


def test_cli_generate_fetch_and_export(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(registry, "load", lambda name, **kw: model)  # no second dequantize
    main(["generate", "--prompt", FRANCE, "--chat", "--max-tokens", "16",
              "--attention", "dense"])
    out, err = capsys.readouterr()
    assert "Paris" in out
    assert "dense attention" in err.splitlines()[-1] and "tok/s" in err
    # the penalties reach the sampler: a story told greedily, then penalized
    story = ["generate", "--prompt", "Once upon a time", "--max-tokens", "32", "--attention",
             "dense"]
    main(story)
    plain = capsys.readouterr().out
    main([*story, "--frequency-penalty", "1.5", "--presence-penalty", "0.5"])
    assert capsys.readouterr().out != plain
    # --prompt-file -: the prompt from standard input
    import io
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Once upon a time")))
    main([*story[:1], "--prompt-file", "-", *story[3:]])
    assert capsys.readouterr().out == plain
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9")))
    assert "--prompt-file -: not UTF-8 text (byte 0xe9 at offset 3)" in cli_error(
        capsys, ["generate", "--prompt-file", "-"])
    main(["fetch", "smollm2-135m"])
    assert capsys.readouterr().out.strip() == str(registry.model_path("smollm2-135m"))
    long_file = tmp_path / "long.txt"
    long_file.write_text("The grass is green. " * 300)
    for argv, msg in [(["generate", "--prompt", "a", "--prompt-file", "f"], "give exactly one of"),
                      (["generate", "--prompt-file", str(tmp_path / "none.txt")],
                       "--prompt-file .*none.txt: No such file"),
                      (["generate", "--prompt", "a", "--budget-tokens", "100"],
                       "--budget-tokens 100: must be a multiple of 16"),
                      # checked once the model is there, before any compile
                      (["generate", "--prompt", "a", "--max-context", "16384"],
                       "--max-context 16384: past the model's 8192 tokens; extend them"),
                      (["generate", "--prompt", ""], "--prompt: the prompt is empty"),
                      (["generate", "--prompt-file", str(long_file), "--max-context", "1024"],
                       "--prompt-file .*long.txt: [0-9]+ tokens do not fit the max context"),
                      (["demo", "--tokens", "8200"],  # 8,191 prompt tokens: the answer's 8
                       "--tokens 8200: the 81[0-9]{2}-token prompt and its 8-token answer pass")]:
        assert re.search(f"^hisparse {argv[0]}: error: {msg}", cli_error(capsys, argv))
    main(["export", "--model", "smollm2-135m", "--format", "hf", str(tmp_path / "hf")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "hf")
    umask = os.umask(0)
    os.umask(umask)
    for path, mode in [(tmp_path / "hf", 0o777), (tmp_path / "hf" / "model.safetensors", 0o666)]:
        assert path.stat().st_mode & 0o777 == mode & ~umask  # not mkdtemp's private 0o700
    assert re.search("^hisparse export: error: .*not an empty folder",
                     cli_error(capsys, ["export", "--model", "smollm2-135m",
                                        str(tmp_path / "hf")]))


def test_bench_generate_rows(model, monkeypatch, capsys):
    """`hisparse bench generate --json`: a HiSparse row per --rerank-multiple value
    and a dense row, each with its command; two prefill blocks (600 > 512 tokens)."""
    monkeypatch.setattr(registry, "load", lambda name, **kw: model)
    argv = ["bench", "generate", "--context", "600", "--batch", "2", "--engines",
            "hisparse,dense", "--rerank-multiple", "1,2", "--decode", "2", "--json",
            "--implementation", "xla"]
    t0 = time.perf_counter()
    main(argv)
    elapsed = time.perf_counter() - t0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["engine"], r["rerank_multiple"]) for r in rows] == [
        ("hisparse", 1), ("hisparse", 2), ("dense", None)]
    # seconds (it was seconds minus a token count past one prefill block: 21842 s)
    assert all(0 < r["compile_s"] < elapsed for r in rows)
    assert "8192 positions" in cli_error(capsys, ["bench", "generate", "--context", "8190",
                                                  "--decode", "8", "--engines", "dense"])
    for r in rows:
        assert (r["context"], r["batch"], r["model"]) == (600, 2, "smollm2-135m")
        assert r["budget_tokens"] == (64 if r["engine"] == "hisparse" else None)
        assert r["implementation"] == ("xla" if r["engine"] == "hisparse" else None)
        assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0
        assert r["command"].endswith(" ".join(argv[1:]))


def test_export_round_trip_is_bit_identical(model, tmp_path):
    """export_hf -> our HF loader: the same config, tokenizer and logits, bit for bit."""
    from hisparse_jax.models.export import export_hf
    from hisparse_jax.models.hf_loader import load_hf
    from hisparse_jax.models.llama import Llama
    m, tok = model
    cfg, w, tok2 = load_hf(export_hf(m, str(tmp_path / "hf"), tok))
    assert cfg == m.cfg
    again = Llama(cfg, w)
    ids = tok.chat_ids([{"role": "user", "content": FRANCE}])
    e1 = Engine(m, max_context=256, attention="dense")  # the CLI test's programs
    e2 = Engine(again, max_context=256, attention="dense")
    t1, t2 = e1.prefill(0, ids), e2.prefill(0, ids)
    np.testing.assert_array_equal(np.asarray(e1.logits), np.asarray(e2.logits))
    for _ in range(3):
        np.testing.assert_array_equal(e1.decode_step(), e2.decode_step())
        np.testing.assert_array_equal(np.asarray(e1.logits), np.asarray(e2.logits))
    assert t1 == t2
    assert tok2.chat_ids([{"role": "user", "content": FRANCE}]) == ids
    assert tok2.eos_ids == tok.eos_ids
    # the tokenizer alone (`bench serve`'s), from the GGUF, the export, and a folder
    # of the export's tokenizer files only (another server's model needs no weights)
    only = tmp_path / "tokenizer-only"
    only.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (only / name).write_bytes((tmp_path / "hf" / name).read_bytes())
    for alone in (registry.load_tokenizer("smollm2-135m"),
                  registry.load_tokenizer(str(tmp_path / "hf")),
                  registry.load_tokenizer(str(only))):
        assert alone.chat_ids([{"role": "user", "content": FRANCE}]) == ids
        assert alone.eos_ids == tok.eos_ids and alone.vocab_size == tok.vocab_size
    assert registry.load_tokenizer("llama3-8b-shapes") is None
    (only / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer-only: no tokenizer.json"):
        registry.load_tokenizer(str(only))


def test_sampling_params_through_engine(model, hisparse):
    _, tok = model
    ids = tok.encode("Once upon a time")
    greedy = hisparse.prefill(0, ids)
    assert hisparse.prefill(0, ids, SamplingParams(temperature=0.8, top_k=1, seed=5)) == greedy
    hisparse.release(0)


def test_prefill_kv_and_teacher_forcing_equal_prefill(model):
    """One dense prefill seeds a HiSparse cache and another dense one (`kv` ->
    `prefill_kv`): the decode logits are bit-equal to each engine's own prefill,
    and forced inputs are used."""
    m, _ = model
    ids = np.random.default_rng(3).integers(0, 2000, 333)  # not a page multiple
    dense = Engine(m, max_context=512, attention="dense")
    own = Engine(m, max_context=512, attention="hisparse", budget_tokens=64)
    seeded = Engine(m, max_context=512, attention="hisparse", budget_tokens=64)
    dense_seeded = Engine(m, max_context=512, attention="dense")
    first = dense.prefill(0, ids)
    assert own.prefill(0, ids) == first
    seeded.prefill_kv(0, *dense.kv(0), first)
    dense_seeded.prefill_kv(0, *dense.kv(0), first)
    forced = np.random.default_rng(4).integers(0, 2000, 4)
    for i in range(6):
        step = {} if i < 2 else {"tokens": forced[i - 2:i - 1]}
        assert np.array_equal(own.decode_step(**step), seeded.decode_step(**step))
        assert np.array_equal(np.asarray(own.logits), np.asarray(seeded.logits))
        assert np.array_equal(dense.decode_step(**step), dense_seeded.decode_step(**step))
        assert np.array_equal(np.asarray(dense.logits), np.asarray(dense_seeded.logits))
    assert own.lens[0] == seeded.lens[0] == 339
    with pytest.raises(ValueError, match="dense engine"):
        own.kv(0)
    with pytest.raises(ValueError, match="expected"):
        seeded.prefill_kv(0, *(x[:, :, :2] for x in dense.kv(0)), first)
    with pytest.raises(ValueError, match="tokens"):
        own.decode_step(tokens=np.array([1.5]))


def test_demo_answers_side_by_side(model, capsys):
    """`hisparse demo` on a short prompt: the table has the three caches, dense and
    HiSparse find the key, and HiSparse's bytes are below dense's."""
    from hisparse_jax.harness.passkey_demo import run_demo
    out = run_demo(tokens=640, depth=0.3, key=31337, budget_tokens=64, log=lambda m: None)
    rows = out["rows"]
    assert list(rows) == ["dense", "hisparse", "sink+window"]
    assert rows["dense"]["hit"] and rows["hisparse"]["hit"]
    assert rows["hisparse"]["cache_bytes"] < rows["dense"]["cache_bytes"]
    text = capsys.readouterr().out
    assert "the pass key is 31337" in text and "fewer bytes than dense" in text


def test_bench_generate_survives_a_llamacpp_that_crashes(model, monkeypatch, capsys):
    """llama.cpp runs in a child process: one that dies of a signal (as a default
    -march=native build does on AMX CPUs) costs its own row, with a line that names
    the signal, and the other engines' rows still come."""
    from hisparse_jax.harness import generate_bench as bench
    monkeypatch.setattr(registry, "load", lambda name, **kw: model)
    monkeypatch.setattr(bench, "llamacpp_available", lambda: True)
    crash = "import os, signal, sys; sys.stdin.read(); os.kill(os.getpid(), signal.SIGSEGV)"
    monkeypatch.setattr(bench, "measure_llamacpp", lambda gguf, ids, decode, threads: (
        bench.child_row([sys.executable, "-c", crash], json.dumps({"ids": ids.tolist()}), 60)))
    main(["bench", "generate", "--context", "128", "--batch", "1", "--engines",
          "llamacpp,dense", "--decode", "2", "--json"])
    out, err = capsys.readouterr()
    assert [json.loads(line)["engine"] for line in out.splitlines()] == ["dense"]
    assert "llama.cpp failed at context 128: its process died of SIGSEGV" in err


def test_bench_generate_table_takes_llamacpp_rows_and_budget_0(model, monkeypatch, capsys):
    """Without --json the table prints llama.cpp's rows too (they have no HiSparse
    fields: `implementation` was a KeyError after every engine had run), and
    --budget-tokens 0 (sink + window) is 0, not the default a 16th of the context."""
    from hisparse_jax.harness import generate_bench as bench
    monkeypatch.setattr(registry, "load", lambda name, **kw: model)
    monkeypatch.setattr(bench, "llamacpp_available", lambda: True)
    row = {"engine": "llamacpp", "context": 128, "batch": 1, "budget_tokens": None,
           "rerank_multiple": None, "prefill_tok_s": 1.0, "decode_tok_s": 2.0,
           "decode_ms_per_step": 500.0, "compile_s": 0.0, "capacity": "llama.cpp"}
    monkeypatch.setattr(bench, "measure_llamacpp", lambda *a: dict(row))
    main(["bench", "generate", "--context", "128", "--batch", "1", "--engines",
          "llamacpp,hisparse", "--budget-tokens", "0", "--decode", "2"])
    lines = capsys.readouterr().out.splitlines()
    cells = {line.split()[0]: line.split() for line in lines[1:]}
    assert cells["llamacpp"][1] == "-" and cells["llamacpp"][-3] == "2.0"
    assert cells["hisparse"][4] == "0"  # budget_tokens


@pytest.mark.parametrize("code, want", [
    ("import sys; print('noise'); print('{\"a\": 1}')", {"a": 1}),
    ("import sys; sys.exit('llama_cpp: model file is truncated')",
     "llama_cpp: model file is truncated"),
    ("pass", "exit status 0, no row"),
    ("print('loading... done')", "its last line is not a row: 'loading... done'"),
    ("import time; time.sleep(30)", "no result within 1 s"),
])
def test_child_row(code, want):
    from hisparse_jax.harness.generate_bench import child_row
    if isinstance(want, dict):
        assert child_row([sys.executable, "-c", code], "", 60) == want
    else:
        with pytest.raises(RuntimeError, match=want):
            child_row([sys.executable, "-c", code], "", 60 if "sleep" not in code else 1)


def test_cli_keeps_compiled_programs_beside_the_models(model, tmp_path):
    """`hisparse` (without JAX_COMPILATION_CACHE_DIR) writes its compiled programs to
    $HISPARSE_HOME/jax-cache/cli, and a second run of the same command reads them
    back: no program written again (a miss rewrites its entry) and none added."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(registry.home() / "models")  # the fetched model, shared
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["HISPARSE_HOME"] = str(home)
    argv = [sys.executable, "-m", "hisparse_jax.cli", "generate", "--prompt", FRANCE, "--chat",
            "--max-tokens", "8", "--attention", "dense"]
    cache = home / "jax-cache" / "cli"
    runs = []
    for _ in range(2):
        r = subprocess.run(argv, check=False, env=env, capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        runs.append((r.stdout, {p.name: p.stat().st_mtime_ns for p in cache.glob("*-cache")}))
    assert runs[0][0] == runs[1][0] and runs[0][0].strip()
    assert runs[0][1] and runs[1][1] == runs[0][1]  # the second run compiled nothing


def test_ctrl_c_ends_generate_with_one_line():
    """SIGINT while tokens stream: what came is kept, then one line on stderr and
    exit 130 (it was a traceback and exit -2)."""
    def first_token(proc):
        assert proc.stdout.read(1)
    code, _, stderr = interrupted_cli(["generate", "--prompt", "Once upon a time",
                                       "--max-tokens", "2000", "--max-context", "2048"],
                                      first_token)
    assert code == 130, stderr
    assert "Traceback" not in stderr
    assert stderr.rstrip().splitlines()[-1] == "hisparse generate: interrupted"
