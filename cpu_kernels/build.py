"""Compile the kernels (`sparse_decode.cc`, `selection.cc`, `causal_attention.cc`,
`matmul.cc`)
into one library once per machine, on first use, and register its handlers with XLA.

The library goes to `$HISPARSE_HOME/cpu_kernels/<key>/` (default
`~/.cache/hisparse`), keyed by the source, the compiler and its flags, jaxlib's
version (its FFI headers) and the CPU's features (`-march=native`): a cache shared
by other machines or another jaxlib never loads a library built for them. It is
written under a temporary name and renamed, so that two processes building at once
never load a half-written file. $CXX picks the compiler (default g++).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading

import jax
import jaxlib

HERE = pathlib.Path(__file__).parent
SOURCES = (HERE / "sparse_decode.cc", HERE / "selection.cc", HERE / "causal_attention.cc",
           HERE / "matmul.cc")
HEADERS = (HERE / "common.h",)
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
# FFI target name -> the handler's symbol in the library
TARGETS = {"hisparse_cold_logits": "HisparseColdLogits",
           "hisparse_attend_listed": "HisparseAttendListed",
           "hisparse_window": "HisparseWindow",
           "hisparse_page_scores": "HisparsePageScores",
           "hisparse_rank_pages": "HisparseRankPages",
           "hisparse_sample_tail": "HisparseSampleTail",
           "hisparse_rerank": "HisparseRerank",
           "hisparse_causal_attention": "HisparseCausalAttention",
           "hisparse_matmul": "HisparseMatmul",
           "hisparse_matmul_blocks": "HisparseMatmulBlocks"}

_lock = threading.Lock()
_why_not: list[str | None] = []  # [] = not tried yet; [None] = loaded; [reason]
_amx: list[bool] = []  # the AMX kernels run here (set by _load)
_products: list[bool] = []  # the weight products' kernels run here: AMX or AVX-512
_causal: list[bool] = []  # the prefill's causal attention runs here: AMX or AVX-512


def _home() -> pathlib.Path:
    return pathlib.Path(os.environ.get("HISPARSE_HOME") or
                        pathlib.Path.home() / ".cache" / "hisparse")


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def library_path(cxx: str) -> pathlib.Path:
    """Where the library for this source, compiler, jaxlib and CPU lives."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             check=True).stdout
    key = hashlib.sha256("\0".join([*(f.read_text() for f in SOURCES + HEADERS),
                                    " ".join(FLAGS), version,
                                    jaxlib.__version__, _cpu_features()]).encode())
    return _home() / "cpu_kernels" / key.hexdigest()[:16] / "libhisparse_cpu.so"


def _compile(cxx: str, out: pathlib.Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", tmp]
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> None:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} is not on PATH; set $CXX)")
    path = library_path(cxx)
    if not path.exists():
        _compile(cxx, path)
    lib = ctypes.cdll.LoadLibrary(str(path))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    _amx.append(bool(lib.HisparseAmxReady()))
    _products.append(bool(lib.HisparseProductsReady()))
    _causal.append(bool(lib.HisparseCausalReady()))


def unavailable() -> str | None:
    """None once the kernels are compiled and registered (building them on the first
    call), else why they cannot be (the first attempt's reason, kept)."""
    with _lock:
        if not _why_not:
            try:
                _load()
                _why_not.append(None)
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _why_not.append(f"the CPU kernels could not be built: {e}")
        return _why_not[0]


def amx_unavailable() -> str | None:
    """None where the AMX kernels (the tiles' paths of the prefill's causal
    attention and of the weight products) run: they need AMX-BF16, Intel Xeon
    since Sapphire Rapids. Else why not."""
    why = unavailable()
    if why:
        return why
    return None if _amx[0] else "this CPU (or its kernel) gives no AMX-BF16 tiles"


def products_unavailable() -> str | None:
    """None where the weight products' kernel runs (cpu_kernels/matmul.cc): on AMX
    tiles, or on AVX-512 for up to 16 rows (`ops.matmul_unsupported`). Else why not."""
    why = unavailable()
    if why:
        return why
    return None if _products[0] else "this CPU has neither AMX-BF16 tiles nor AVX-512"


def causal_unavailable() -> str | None:
    """None where the prefill's causal-attention kernel runs
    (cpu_kernels/causal_attention.cc): on AMX tiles, or on AVX-512. Else why not."""
    why = unavailable()
    if why:
        return why
    return None if _causal[0] else "this CPU has neither AMX-BF16 tiles nor AVX-512"


def causal_path() -> str:
    """Where the causal-attention kernel runs here (`causal_unavailable` None): "AMX
    tiles" or "AVX-512"."""
    return "AMX tiles" if amx_unavailable() is None else "AVX-512"


def unsupported(head_dim: int, group: int) -> str | None:
    """Why the kernels cannot take these shapes (None if they can); the limits of
    their fixed-size buffers (`kMaxDim`, `kMaxGroup`)."""
    if head_dim % 2 or not 0 < head_dim <= 256:
        return f"head_dim must be even and at most 256, got {head_dim}"
    if not 0 < group <= 16:
        return f"at most 16 query heads per KV head, got {group}"
    return None
