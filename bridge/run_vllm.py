"""Run prompts through a real vLLM engine (in this process) and write what came out.

    HISPARSE_VLLM_CPU=1 python -m bridge.run_vllm --model DIR --prompts P.json --out R.json

P.json: {"prompts": [str or {"prompt": str, "max_tokens": n}, ...], "max_tokens": N,
"logprobs": k (optional), "ignore_eos": bool (optional)}; or {"groups": [[...], [...]],
...}: each group is one `generate` call, in order (so that two engines batch a group
the same way whatever else runs), and the outputs are concatenated.
R.json: {"outputs": [{"token_ids", "text"}], "kv_cache_tokens" (from vLLM's own
"KV cache size: N tokens" log line), "kv_cache_tokens_config", "backend",
"bridge" (the bridge's counters: slots, conversions, DLPack copies), "seconds"
(start-up and generation), "tokens_per_s"}.

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the
bridge's counters and vLLM's config are read directly. Greedy (temperature 0).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time

CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens")


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def kv_tokens_from_log(lines) -> int | None:
    for line in lines:
        m = CAPACITY.search(line)
        if m:
            return int(m.group(1).replace(",", ""))
    return None


def _margins(completion):
    """Per generated token, the log-probability gap between the best and the
    second-best token (None without `logprobs` >= 2 in the prompts file)."""
    if not completion.logprobs:
        return None
    out = []
    for lp in completion.logprobs:
        vals = sorted((x.logprob for x in lp.values()), reverse=True)
        out.append(vals[0] - vals[1] if len(vals) > 1 else None)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bridge.run_vllm")
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="JSON file (see the module docstring)")
    p.add_argument("--out", required=True)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=None,
                   help="default: 16 with HISPARSE_VLLM_CPU=1, else vLLM's own (128 on a CPU)")
    p.add_argument("--compile", action="store_true", help="torch.compile (default: eager)")
    p.add_argument("--chunked-prefill", action="store_true")
    args = p.parse_args(argv)

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm  # noqa: F401  (configures vLLM's loggers; attach after it)
    cap = _Capture()
    logging.getLogger("vllm").addHandler(cap)
    logging.getLogger("hisparse").addHandler(cap)
    logging.getLogger("hisparse").setLevel(logging.INFO)
    if not logging.getLogger("hisparse").handlers[:-1]:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logging.getLogger("hisparse").addHandler(h)

    from bridge.plugin import cpu_override_requested
    if args.block_size is None and cpu_override_requested():
        args.block_size = 16
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default is much more
    with open(args.prompts) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    llm = LLM(model=args.model, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              enforce_eager=not args.compile,
              enable_prefix_caching=False, enable_chunked_prefill=args.chunked_prefill,
              dtype="bfloat16", seed=0,
              **({"block_size": args.block_size} if args.block_size else {}))
    t1 = time.perf_counter()
    outs = []
    for group in spec.get("groups") or [spec["prompts"]]:
        prompts, params = [], []
        for p_ in group:
            p_ = p_ if isinstance(p_, dict) else {"prompt": p_}
            prompts.append(p_["prompt"])
            params.append(SamplingParams(
                max_tokens=p_.get("max_tokens", spec.get("max_tokens", 32)), temperature=0.0,
                ignore_eos=p_.get("ignore_eos", spec.get("ignore_eos", False)),
                logprobs=p_.get("logprobs", spec.get("logprobs"))))
        outs += llm.generate(prompts, params, use_tqdm=False)
    t2 = time.perf_counter()
    res = {"outputs": [{"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
                        "prompt_tokens": len(o.prompt_token_ids),
                        "margins": _margins(o.outputs[0])} for o in outs]}
    n_gen = sum(len(o["token_ids"]) for o in res["outputs"])
    res["kv_cache_tokens"] = kv_tokens_from_log(cap.lines)  # None if vLLM's handlers
    # were reconfigured after we attached; the tests read vLLM's stdout instead
    try:
        res["kv_cache_tokens_config"] = llm.llm_engine.vllm_config.cache_config.kv_cache_size_tokens
    except Exception:  # noqa: BLE001
        res["kv_cache_tokens_config"] = None
    try:
        from bridge import vllm_backend
        res["bridge"] = vllm_backend.counters()
    except Exception:  # noqa: BLE001
        res["bridge"] = None
    res["backend"] = "hisparse" if res["bridge"] and res["bridge"].get("layers") else "vllm"
    res["hisparse_log"] = [line for line in cap.lines if "HiSparse" in line]
    res["seconds"] = {"startup": t1 - t0, "generate": t2 - t1}
    res["tokens_per_s"] = n_gen / (t2 - t1)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in ("kv_cache_tokens", "backend", "seconds",
                                           "tokens_per_s")}))


if __name__ == "__main__":
    main()
