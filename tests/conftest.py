"""Shared fixtures.

`implementation`: library tests that build caches and run attention or the
encoders take it and pass it to HiSparseCache / evaluate, so they run under every
implementation: "xla" (the references), "pallas" (the Pallas kernels, in
interpret mode on a CPU; compiled Triton on a GPU) and "cpu" (the C++ decode
kernels). Test ids start with [xla, [pallas or [cpu. Tests of large cases (1M arithmetic, byte accounting without compute,
quality at 32K/128K) do not take it and stay on the default implementation.
"""

from __future__ import annotations

import os
import pathlib
import shutil

# Compiling takes about 70% of the suite's time on 2 cores (XLA:CPU; measured
# with jax_log_compiles). Programs compiled again after `_drop_compiled_programs`,
# by the other xdist worker, by the CLI subprocesses, the bridge's vLLM engines or a
# later run (in any clone: the cache sits beside the fetched model, under
# $HISPARSE_HOME, registry.home()'s rule) are read back from disk. A cold run of
# the main suite took 35 min here, one over a warm cache 11 min. The cache is keyed
# by the program, the compile options and the jax version, so a stale entry can
# never be used. Set before jax is imported so that subprocesses inherit it.
HOME = pathlib.Path(os.environ.get("HISPARSE_HOME")
                    or pathlib.Path.home() / ".cache" / "hisparse")
SUITE_CACHE = HOME / "jax-cache" / "tests"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(SUITE_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax
import pytest

PALLAS_WARNING = "ignore:The Pallas Triton backend is deprecated"
CACHE_LIMIT_BYTES = 2 << 30  # a cold run of the main suite writes ~120 MB


def pytest_configure(config):
    """Start the suite's compile cache afresh when it has grown past
    CACHE_LIMIT_BYTES (a cache of your own, set by JAX_COMPILATION_CACHE_DIR, is
    left alone). Not JAX's own size limit: with it every write rescans the whole
    directory, and a cold run took 1384 s instead of 681 s. Once per run, by the
    xdist controller."""
    cache = pathlib.Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    if hasattr(config, "workerinput") or cache != SUITE_CACHE or not cache.is_dir():
        return
    try:  # the bridge suite (`make test` runs it beside this one) may be pruning too
        if sum(f.stat().st_size for f in cache.iterdir()) > CACHE_LIMIT_BYTES:
            shutil.rmtree(cache, ignore_errors=True)
    except FileNotFoundError:
        pass


@pytest.fixture(params=[
    pytest.param("xla", id="xla"),
    pytest.param("pallas", id="pallas", marks=pytest.mark.filterwarnings(PALLAS_WARNING)),
    pytest.param("cpu", id="cpu"),
])
def implementation(request) -> str:
    """The attention/encoder implementation a cache is built with."""
    return request.param


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    """Every compiled XLA:CPU program keeps its own code mappings until it is
    dropped. Kept for the whole run, the suite's programs pass Linux's
    vm.max_map_count (65530 mappings) and a later compile segfaults; the suite
    reached ~54K before the Pallas cases were added. Drop them after each module."""
    yield
    jax.clear_caches()
