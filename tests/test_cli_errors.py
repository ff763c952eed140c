"""Every `hisparse` command's bad flags and inputs: one line on stderr naming the
flag and the value (`hisparse <command>: error: ...`), no traceback, exit code 2,
and nothing run before the refusal (each case here fails in well under a second)."""

import subprocess
import sys

import numpy as np
import pytest

from hisparse_jax.cli import main
from hisparse_jax.cli.args import CLIError
from tests.helpers import cli_error


def _npz(tmp_path, name="qkv.npz", q=(2, 4, 32), k=(600, 2, 32), dtype=np.float32, scale=1.0,
         extra_q=None):
    rng = np.random.default_rng(0)
    arrays = {"q": (rng.normal(size=q) * scale).astype(dtype) if extra_q is None else extra_q,
              "k": (rng.normal(size=k) * scale).astype(dtype),
              "v": rng.normal(size=k).astype(dtype)}
    path = tmp_path / name
    np.savez(path, **arrays)
    return str(path)


CASES = [
    # (argv, what the line must name); "{npz}" is a valid capture
    ([], "the following arguments are required: command"),
    (["launch"], "invalid choice: 'launch'"),
    (["demo", "--context", "0"], "argument --context: must be >= 1, got 0"),
    (["demo", "--context", "big"], "argument --context: expected an integer, got 'big'"),
    (["demo", "--turbo"], "hisparse demo: error: unrecognized arguments: --turbo"),
    (["demo", "--context", "8192"], "--context is for --synthetic"),
    (["demo", "--depth", "1.5"], "argument --depth: must be < 1.0, got 1.5"),
    (["demo", "--tokens", "10"], "argument --tokens: must be >= 256, got 10"),
    (["demo", "--key", "123456"], "--key 123456: a 5-digit number"),
    (["demo", "--budget-tokens", "100"], "--budget-tokens 100: a multiple of 16"),
    (["bench", "generate", "--engines", "vllm"], "--engines vllm: choose from"),
    (["bench", "generate", "--context", "8"], "--context 8: at least 64 tokens"),
    (["bench", "generate", "--budget-tokens", "17"], "--budget-tokens 17: must be a multiple"),
    (["bench", "generate", "--batch", "0"], "argument --batch: every value must be >= 1"),
    (["bench", "generate", "--implementation", "cuda"],
     "argument --implementation: unknown 'cuda'; choose from xla, pallas, cpu"),
    (["serve", "--implementation", "cuda"], "argument --implementation: invalid choice: 'cuda'"),
    # --rope-scaling is checked before the model loads
    (["generate", "--prompt", "hi", "--rope-scaling", "foo:2"],
     "argument --rope-scaling: expected KIND:FACTOR, KIND one of linear, llama3, yarn"),
    (["generate", "--prompt", "hi", "--rope-scaling", "llama3"],
     "argument --rope-scaling: expected KIND:FACTOR"),
    (["generate", "--prompt", "hi", "--rope-scaling", "llama3:0.5"],
     "FACTOR >= 1, e.g. llama3:4; got 'llama3:0.5'"),
    (["generate", "--model", "llama3-8b-shapes", "--prompt", "hi"],  # before 16 GB of weights
     "--model llama3-8b-shapes: random weights and no tokenizer"),
    (["demo", "--model", "llama3-8b-shapes"], "random weights and no tokenizer; the demo"),
    (["demo", "--synthetic", "--tokens", "3000"],  # it was ignored
     "--tokens is the real-model demo's; --synthetic takes --context N"),
    (["capacity", "--reserve", "16GB"], "--reserve 16GB: needs --device-memory"),
    # interpret mode off a GPU: correctness only, hours on a real capture
    (["eval", "--qkv", "{npz}", "--implementation", "pallas"],
     "--implementation pallas: off a GPU the Pallas kernels run in interpret mode"),
    (["bench", "generate", "--implementation", "pallas"],
     "--implementation pallas: off a GPU the Pallas kernels run in interpret mode"),
    (["capacity", "--working-set", "4"], "--working-set 4: offload mode's (add --offload)"),
    (["generate", "--prompt-file", "{latin1}"], "latin1.txt: not UTF-8 text (byte 0xe9 at offset 4)"),
    (["generate", "--prompt", "hi", "--rope-theta", "1"], "argument --rope-theta: must be > 1"),
    (["generate", "--prompt", "hi", "--presence-penalty", "-3"],
     "argument --presence-penalty: must be >= -2.0, got -3"),
    (["generate", "--prompt", "hi", "--frequency-penalty", "2.5"],
     "--frequency-penalty 2.5: must be in [-2, 2]"),
    (["eval"], "the following arguments are required: --qkv"),
    (["eval", "--qkv", "{npz}", "--budget-tokens", "100"],
     "--budget-tokens 100: must be a multiple of page_size=16 or 'all'"),
    (["eval", "--qkv", "{npz}", "--budget-tokens", "-3"], "argument --budget-tokens: must be >= 0"),
    (["eval", "--qkv", "{npz}", "--budget-tokens", "lots"], "--budget-tokens: must be an int or 'all'"),
    (["eval", "--qkv", "{npz}", "--tail-sample-pages", "-1"], "--tail-sample-pages: must be >= 0"),
    (["eval", "--qkv", "{npz}", "--rerank-multiple", "0.5"], "--rerank-multiple: must be >= 1.0"),
    (["eval", "--qkv", "{npz}", "--rerank-multiple", "nan"], "--rerank-multiple: must be a finite"),
    (["eval", "--qkv", "{npz}", "--heads", "a,b"], "--heads: expected comma-separated integers"),
    (["eval", "--qkv", "{npz}", "--heads", "9"], "--heads 9 is not a query head (q has 4)"),
    (["eval", "--qkv", "{npz}", "--oracle-budgets", "100"],
     "--oracle-budgets 100: must be a multiple of the page size 16"),
    (["eval", "--qkv", "{npz}", "--oracle-budgets", "0"], "--oracle-budgets: every value must be >= 1"),
    (["eval", "--qkv", "{npz}", "--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    (["eval", "--qkv", "{npz}", "--implementation", "cuda"], "--implementation: invalid choice"),
    (["eval", "--qkv", "{missing}"], "cannot read: no such file"),
    (["eval", "--qkv", "{text}"], "not an .npz file"),
    (["eval", "--qkv", "{pickled}"], "object (pickled) arrays"),
    (["eval", "--qkv", "{no_heads}"], "has an empty dimension"),
    (["eval", "--qkv", "{no_queries}"], "has an empty dimension"),
    (["eval", "--qkv", "{ints}"], "q must be float16 or float32, got int32"),
    (["bench", "attention", "--batch", "0"], "argument --batch: must be >= 1, got 0"),
    (["bench", "attention", "--context", "-5"], "argument --context: must be >= 1"),
    (["bench", "attention", "--repeats", "0"], "argument --repeats: must be >= 1"),
    (["bench", "attention", "--rerank-multiple", "0"], "--rerank-multiple: must be >= 1.0"),
    (["bench", "kernels", "--case", "decode_2k_b1"], "--case: unknown 'decode_2k_b1'"),
    (["bench", "kernels", "--impl", "triton"], "--impl: unknown 'triton'"),
    (["bench", "kernels", "--ops", "prefill"], "--ops: unknown 'prefill'"),
    (["bench", "kernels", "--iters", "0"], "argument --iters: must be >= 1"),
    (["bench", "kernels", "--warmup", "-1"], "argument --warmup: must be >= 0"),
    (["bench", "kernels", "--json", "/proc/nope/rows.jsonl"], "--json /proc/nope/rows.jsonl: cannot write"),
    (["bench", "scheduler", "--multiples", "0"], "--multiples: '0': must be >= 1.0"),
    (["bench", "scheduler", "--multiples", "0.5"], "--multiples: '0.5': must be >= 1.0"),
    (["bench", "scheduler", "--multiples", "two"], "--multiples: 'two': expected a number"),
    (["bench", "scheduler", "--max-prefetch", "x"], "--max-prefetch: expected comma-separated"),
    (["bench", "scheduler", "--max-prefetch", "-1"], "--max-prefetch: every value must be >= 0"),
    (["bench", "scheduler", "--steps", "0"], "argument --steps: must be >= 2, got 0"),
    (["bench", "scheduler", "--traces", "random"], "--traces: unknown 'random'; choose from drift"),
    (["bench", "scheduler", "--traces", "drift,drift"], "--traces: a name is repeated"),
    (["bench", "scheduler", "--step-overlap", "1.5"], "--step-overlap: must be < 1.0, got 1.5"),
    (["bench", "scheduler", "--step-overlap", "0"], "--step-overlap: must be > 0.0"),
    (["bench", "scheduler", "--step-noise", "-1"], "--step-noise: must be >= 0.0"),
    (["bench", "scheduler", "--layer-noise", "nan"], "--layer-noise: must be a finite number"),
    (["bench", "scheduler", "--sticky-nats", "inf"], "--sticky-nats: must be a finite number"),
    (["bench", "scheduler", "--context", "100"], "argument --context: must be >= 4096"),
    (["bench", "scheduler", "--seed", "-1"], "argument --seed: must be >= 0"),
    (["bench"], "the following arguments are required: bench"),
    (["capacity", "--device-memory", "lots"], "--device-memory lots: cannot parse size"),
    (["capacity", "--device-memory", "0"], "--device-memory 0: size must be positive"),
    (["capacity", "--device-memory", "80GB", "--reserve", "lots"],
     "--reserve lots: cannot parse size"),
    (["capacity", "--device-memory", "80GB", "--reserve", "90GB"], "--reserve 90GB: leaves no"),
    (["capacity", "--model", "gpt-5"], "argument --model: invalid choice: 'gpt-5'"),
    (["capacity", "--context", "lots"], "argument --context: cannot parse token count"),
    (["capacity", "--context", "0"], "argument --context: token count must be >= 1"),
    (["capacity", "--offload", "--working-set", "0"], "argument --working-set: must be >= 1.0"),
    (["capacity", "--offload", "--working-set", "0.5"], "argument --working-set: must be >= 1.0"),
    (["capacity", "--preset", "huge"], "argument --preset: invalid choice"),
    (["generate", "--prompt", "hi", "--attention", "dense", "--budget-tokens", "512"],
     "--budget-tokens: only --attention hisparse selects pages"),  # it was ignored
    (["generate", "--prompt", "hi", "--stop", ""], "--stop: an empty text would stop at once"),
    (["generate", "--prompt", "hi", "--model", "{missing_gguf}"], "nope.gguf: no such file"),
    (["export", "--model", "llama3-8b-shapes", "{out}"],  # it ran out of memory
     "--model llama3-8b-shapes: random weights; nothing to export"),
    (["export", "--model", "smollm2-135m", "{text}"], "notes.txt: exists and is not an empty"),
    (["export", "--model", "smollm2-135m", "--format", "gguf", "{text}"], "notes.txt: exists"),
    (["fetch", "llama3-8b-shapes"], "argument name: invalid choice: 'llama3-8b-shapes'"),
]


@pytest.fixture
def files(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("q k v\n1 2 3\n")
    (tmp_path / "latin1.txt").write_bytes("cafe\u00e9".encode("latin-1"))  # not UTF-8
    return {"npz": _npz(tmp_path), "missing": str(tmp_path / "nope.npz"), "text": str(text),
            "missing_gguf": str(tmp_path / "nope.gguf"), "out": str(tmp_path / "out"),
            "latin1": str(tmp_path / "latin1.txt"),
            "pickled": _npz(tmp_path, "pickled.npz", extra_q=np.array([{"a": 1}], dtype=object)),
            "no_heads": _npz(tmp_path, "no_heads.npz", k=(600, 0, 32)),
            "no_queries": _npz(tmp_path, "no_queries.npz", q=(0, 4, 32)),
            "ints": _npz(tmp_path, "ints.npz", dtype=np.int32)}


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(a) or "none" for a, _ in CASES])
def test_bad_flag_is_one_line_exit_2(capsys, files, argv, message):
    argv = [a.format(**files) for a in argv]
    line = cli_error(capsys, argv)
    assert message in line, line


def test_pickled_npz_is_never_loaded(tmp_path):
    # An object array is stored pickled by np.savez; the "pickled" case above relies on it.
    path = _npz(tmp_path, extra_q=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match="allow_pickle"):
        np.load(path)["q"]


def test_huge_finite_keys_are_an_error_not_nan_json(tmp_path, capsys):
    path = _npz(tmp_path, scale=1e20)  # finite, but q.k overflows float32
    line = cli_error(capsys, ["eval", "--qkv", path, "--json"])
    assert "not finite" in line and "overflow" in line
    assert capsys.readouterr().out == ""  # no JSON with NaN in it


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(CLIError, match="cannot read"):
        main(["--debug", "eval", "--qkv", str(tmp_path / "nope.npz")])
    with pytest.raises(CLIError, match="cannot read"):
        main(["eval", "--qkv", str(tmp_path / "nope.npz"), "--debug"])


def test_a_real_process_prints_one_line_and_exits_2():
    proc = subprocess.run([sys.executable, "-c", "from hisparse_jax.cli import main; main()",
                           "capacity", "--offload", "--working-set", "0.5"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "hisparse capacity: error: argument --working-set: must be >= 1.0, got 0.5"]


def test_python_dash_m_runs_the_cli():
    """`python -m hisparse_jax.cli` is `hisparse` where the script is not installed
    (the H200 runs benchmarks/gpu_check.py's steps this way)."""
    p = subprocess.run([sys.executable, "-m", "hisparse_jax.cli", "bench", "generate",
                        "--context", "8"], capture_output=True, text=True, check=False)
    assert p.returncode == 2
    assert "hisparse bench generate: error: --context 8: at least 64 tokens" in p.stderr
