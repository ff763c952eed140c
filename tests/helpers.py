"""Shared test helpers: an independent dequantized-cache reference, servers, and
where the AMX kernels run."""

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.cache.state import slot_positions
from pallas_kernels.quant import (
    decode_cold_keys,
    decode_cold_values,
    decode_fp8,
    encode_cold_keys,
    encode_cold_values,
    encode_fp8,
)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((line for line in f if line.startswith("flags")), "").split())


# The AMX kernels (cpu_kernels/causal_attention.cc, matmul.cc) run here
AMX = jax.default_backend() == "cpu" and "amx_bf16" in _cpu_flags()
needs_amx = pytest.mark.skipif(not AMX, reason="the kernel runs on AMX-BF16 CPUs only")
# The weight products' AVX-512 path (matmul.cc, up to 16 rows) runs here
AVX512 = jax.default_backend() == "cpu" and {"avx512f", "avx512bw"} <= _cpu_flags()
needs_avx512 = pytest.mark.skipif(not AVX512, reason="the path runs on AVX-512 CPUs only")
# The weight products' kernel's two paths, as `ops.matmul(..., amx=)` picks them
PRODUCT_PATHS = [pytest.param(True, id="amx", marks=needs_amx),
                 pytest.param(False, id="avx512", marks=needs_avx512)]


def dequantized_kv(cfg, k, v):
    """What a prefilled cache holds for k, v [S, Hkv, D], token by token (f32)."""
    s = k.shape[0]
    bf16_pos, fp8_pos = (np.asarray(x[0]) for x in slot_positions(cfg, jnp.array([s])))
    kh, vh = np.array(k, np.float32), np.array(v, np.float32)
    live_bf16 = bf16_pos[bf16_pos >= 0]
    live_fp8 = fp8_pos[fp8_pos >= 0]
    kh[live_bf16] = np.asarray(jnp.asarray(k[live_bf16]).astype(jnp.bfloat16), np.float32)
    vh[live_bf16] = np.asarray(jnp.asarray(v[live_bf16]).astype(jnp.bfloat16), np.float32)
    kh[live_fp8] = np.asarray(decode_fp8(*encode_fp8(jnp.asarray(k[live_fp8]))))
    vh[live_fp8] = np.asarray(decode_fp8(*encode_fp8(jnp.asarray(v[live_fp8]))))
    cold = np.ones(s, bool)
    cold[live_bf16] = False
    cold[live_fp8] = False
    pg = cfg.page_size
    for p in np.unique(np.flatnonzero(cold) // pg):
        sl = slice(p * pg, (p + 1) * pg)
        kp = jnp.asarray(k[sl]).transpose(1, 0, 2)  # [Hkv, pg, D]
        kh[sl] = np.asarray(decode_cold_keys(*encode_cold_keys(kp))).transpose(1, 0, 2)
        vh[sl] = np.asarray(decode_cold_values(*encode_cold_values(jnp.asarray(v[sl]),
                                                                   cfg.value_group)))
    return kh, vh, cold


def dense(q, k, v):
    """Exact attention, numpy: q [Hq, D], k/v [S, Hkv, D] -> [Hq, D]."""
    hq, d = q.shape
    g = hq // k.shape[1]
    out = np.empty((hq, d))
    for h in range(hq):
        lg = k[:, h // g] @ q[h] / np.sqrt(d)
        p = np.exp(lg - lg.max())
        out[h] = (p / p.sum()) @ v[:, h // g]
    return out


def cli_error(capsys, argv, code=2) -> str:
    """Run `hisparse argv`, expect a user error: exit code 2 and one line on
    stderr, `hisparse <command>: error: ...`, no traceback. Returns that line."""
    import pytest

    from hisparse_jax.cli import main
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == code, err
    lines = [x for x in err.splitlines() if ": error: " in x]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("hisparse") and lines == err.splitlines()[-1:], err
    return lines[0]


def cache_snapshot(cache) -> dict:
    """Everything a HiSparseCache (or OffloadedCache) holds, as host copies: the
    device state, the host mirrors, the prefix index, and in offload mode the host
    pool, the working set and the scheduler state. Equal snapshots = same cache."""
    import jax

    inner = getattr(cache, "cache", cache)
    snap = {"state": [np.asarray(x) for x in jax.tree_util.tree_leaves(inner.state)],
            "seq_lens": inner.seq_lens.copy(), "num_free": inner.num_free,
            "seq_hashes": {k: list(v) for k, v in inner.seq_hashes.items()},
            "cfg": inner.cfg}
    ix = inner.prefix
    if ix is not None:
        snap["prefix"] = ({h: (e.pages, e.tokens, e.parent, e.refcount, e.pinned)
                           for h, e in ix.entries.items()},
                          {k: list(v) for k, v in ix.contexts.items()}, dict(ix.owner))
    if inner.cold_store is not None:
        off = inner.cold_store
        snap["offload"] = ([np.asarray(x) for x in jax.tree_util.tree_leaves(
            (off.host, off.ws, off.sample_ws, off.sample_held, off.sched))],
            off.working_set, off.cfg)
    return snap


def assert_same_snapshot(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key, x in a.items():
        y = b[key]
        if key == "state":
            assert len(x) == len(y)
            for u, w in zip(x, y):
                np.testing.assert_array_equal(u, w)
        elif key == "offload":
            for u, w in zip(x[0], y[0]):
                np.testing.assert_array_equal(u, w)
            assert x[1:] == y[1:]
        elif isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
        else:
            assert x == y, key


def check_page_accounting(cache):
    """No leaked or aliased pool page: every page's refcount is the page-table
    entries naming it plus one if the prefix index holds it; the free stack holds
    exactly the pages nobody references, once each; the host mirror of num_free
    matches the device."""
    inner = getattr(cache, "cache", cache)
    st = inner.state
    p = inner.cfg.pool_pages
    table = np.asarray(st.page_table)
    refs = np.bincount(table[table >= 0], minlength=p)
    if inner.prefix is not None:
        for page in inner.prefix.live_pages():
            refs[page] += 1
    np.testing.assert_array_equal(np.asarray(st.refcount), refs)
    n_free = int(st.num_free)
    assert n_free == inner.num_free
    free = np.asarray(st.free_pages)[:n_free]
    assert len(set(free.tolist())) == n_free
    assert set(free.tolist()) == set(np.flatnonzero(refs == 0).tolist())
    # Each sequence's page-table row: a page appears once per row.
    for row in table:
        live = row[row >= 0]
        assert len(set(live.tolist())) == len(live)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (servers in tests bind loopback only)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def interrupted_cli(argv, ready, timeout: float = 120) -> tuple[int, str, str]:
    """`python -m hisparse_jax.cli ARGV`, sent SIGINT once `ready(proc)` returns (it
    may read the process's stdout, or poll something else, within its own bound);
    returns its exit code and the rest of its output. Killed by its PID if it still
    runs at the end, whatever happened.

    The child sets SIGINT's handler itself before the CLI starts: a process started
    from a background job of a non-interactive shell (`make test &`, nohup) inherits
    SIGINT ignored, and Python then installs no handler, so the signal would never
    arrive."""
    import signal
    import subprocess
    import sys
    start = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "runpy.run_module('hisparse_jax.cli', run_name='__main__', alter_sys=True)")
    proc = subprocess.Popen([sys.executable, "-c", start, *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready(proc)
        os.kill(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stdout, stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running_server(args, log, start_s: float, python: str | None = None,
                   module: str = "hisparse_jax.serving"):
    """`python -m MODULE ARGS --port P` (our server unless given) on a free loopback
    port, output in `log` (`python`: this interpreter unless given); yields (url,
    proc) once /health answers. Stopped by its PID at the end, whatever happened (SIGKILL if it still
    runs: a test that stops it gracefully does so itself and checks the exit code)."""
    import signal
    import subprocess
    import sys
    import time

    import httpx
    import pytest
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([python or sys.executable, "-m", module, *args,
                                 "--port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_s
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited {proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not up after {start_s} s:\n{log.read_text()}")
            time.sleep(0.5)
        yield url, proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
