"""Where the bridge's time goes in a real vLLM engine: `bridge.run_vllm` with each
layer's phases timed (synchronously, so a phase's JAX work is counted in it).

    HISPARSE_VLLM_CPU=1 VLLM_CPU_KVCACHE_SPACE=2 .venv-vllm/bin/python -m \\
        bridge.profile_phases --model DIR --prompts P.json --out R.json \\
        --chunked-prefill --max-num-batched-tokens 2048

Takes run_vllm's arguments. Prints one JSON line: per phase (`stage`: a prefill
chunk staged and attended exactly, `kernel`: the exact attention inside it,
`convert`: a staged prompt turned into HiSparse's tiers, `decode`: a sparse
decode step of one layer) the call count and the seconds of the first and the
second half of the calls. With two groups of the same shape in P.json (see
run_vllm) the second half is the warm one: the first half holds JAX's compiles.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import jax

from bridge import runtime as rt

TIMES: dict[str, list[float]] = {}


def _timed(name, f, sync):
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter()
        out = f(*a, **k)
        sync(a, out)
        TIMES.setdefault(name, []).append(time.perf_counter() - t)
        return out
    return g


def _layer_sync(args, out):
    layer = args[0]
    jax.block_until_ready((layer.stacked, layer.staged, out))


def main(argv=None):
    for phase in ("stage", "convert", "decode"):
        f = getattr(rt.LayerCache, "_" + phase)
        setattr(rt.LayerCache, "_" + phase, _timed(phase, f, _layer_sync))
    if os.environ.get("HISPARSE_VLLM_CPU"):
        from bridge import vllm_cpu  # the kernel returns a torch tensor: synchronous
        impl = vllm_cpu.HiSparseCPUImpl
        impl.exact_attention = staticmethod(
            _timed("kernel", vllm_cpu.cpu_kernel_attention, lambda a, o: None))
    from bridge.run_vllm import main as run
    run(argv)
    print(json.dumps({"phases": {k: {"calls": len(v), "first_half_s": round(sum(v[:len(v) // 2]), 2),
                                     "second_half_s": round(sum(v[len(v) // 2:]), 2)}
                                 for k, v in TIMES.items()}}))


if __name__ == "__main__":
    main(sys.argv[1:])
