"""`hisparse capacity`: the capacity planner's table or JSON (`hisparse_jax.capacity`)."""

from __future__ import annotations

import argparse
import json

from hisparse_jax.capacity import (
    MODELS,
    fmt_bytes,
    layer_config,
    log_line,
    parse_size,
    parse_tokens,
    plan,
    working_set_pages_for,
)
from hisparse_jax.cli.args import CLIError, number
from hisparse_jax.config import PRESETS


def _table(p: dict) -> str:
    lines = [(f"{p['model']}  context {p['context']}  preset {p['preset']} (page "
             f"{p['page_size']}, budget {p['budget_pages']} pages)  "
             f"{'offload' if p['offload'] else 'all on device'}")]
    w = max(len(k) for k in p["tiers_device_bytes"]) + 2
    for k, v in p["tiers_device_bytes"].items():
        lines.append(f"  device {k.ljust(w)}{fmt_bytes(v):>12}")
    lines.append(f"  {'device total'.ljust(w + 7)}{fmt_bytes(p['device_bytes']):>12}")
    lines.append(f"  {'host total'.ljust(w + 7)}{fmt_bytes(p['host_bytes']):>12}")
    lines.append(f"  {'bf16 paged cache'.ljust(w + 7)}{fmt_bytes(p['bf16_paged_bytes']):>12}")
    lines.append(f"  device bytes/token/KV head {p['device_bytes_per_token_per_kv_head']:.2f} "
                 f"(bf16 {p['bf16_bytes_per_token_per_kv_head']:.2f})")
    if "max_sequences" in p:
        lines.append(f"  max concurrent sequences in {fmt_bytes(p['device_memory_bytes'])}"
                     f"{' - reserve ' + fmt_bytes(p['reserve_bytes']) if p['reserve_bytes'] else ''}"
                     f": {p['max_sequences']} (bf16: {p['max_sequences_bf16']})")
    lines.append(log_line(p))
    return "\n".join(lines)


WORKING_SET_DEFAULT = 2.0


def main_capacity(args) -> dict:
    """`hisparse capacity ...`: prints a table (or JSON with --json); returns the plan."""
    def flag(name, fn, value):
        try:
            return fn(value)
        except ValueError as e:
            raise CLIError(f"{name} {value}: {e}")
    dev = (flag("--device-memory", parse_size, args.device_memory)
           if args.device_memory is not None else None)
    if args.reserve and dev is None:  # it is taken from the budget, which has to be given
        raise CLIError(f"--reserve {args.reserve}: needs --device-memory (the budget it is "
                       "taken from)")
    if args.working_set != WORKING_SET_DEFAULT and not args.offload:
        raise CLIError(f"--working-set {args.working_set:g}: offload mode's (add --offload)")
    reserve = flag("--reserve", parse_size, args.reserve) if args.reserve else 0
    context = parse_tokens(args.context)  # already an int from the parser
    if args.offload:
        flag("--working-set", lambda m: working_set_pages_for(
            layer_config(args.model, context, args.preset), m), args.working_set)
    if dev is not None and reserve >= dev:
        raise CLIError(f"--reserve {args.reserve}: leaves no device memory of "
                       f"--device-memory {args.device_memory}")
    p = plan(args.model, context, dev, offload=args.offload, preset=args.preset,
             working_set_multiple=args.working_set, reserve_bytes=reserve)
    print(json.dumps(p) if args.json else _table(p))
    return p


def _tokens_arg(text):
    try:
        return parse_tokens(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


_tokens_arg.__name__ = "token count"


def add_capacity_parser(subparsers):
    """Adds `capacity` to an argparse subparsers object (sets func=main_capacity)."""
    c = subparsers.add_parser("capacity", help="KV cache bytes per tier, device/host, "
                                               "sequences that fit")
    c.add_argument("--model", default="llama3-8b", choices=sorted(MODELS))
    c.add_argument("--context", type=_tokens_arg, default=1 << 20,
                   help="tokens per sequence (e.g. 1048576, 128K, 1M)")
    c.add_argument("--device-memory", default=None,
                   help="device budget for KV caches, e.g. 141GB, 80GiB, or bytes")
    c.add_argument("--reserve", default=None, help="device bytes reserved (e.g. weights: 16GB)")
    c.add_argument("--preset", default="default", choices=sorted(PRESETS))
    c.add_argument("--offload", action="store_true",
                   help="cold int4 pages in host memory; device keeps digests + working set")
    c.add_argument("--working-set", type=number(1.0), default=WORKING_SET_DEFAULT,
                   help="resident cold pages per (sequence, KV head), in multiples of a "
                        "step's candidate pages, >= 1 (offload mode)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=main_capacity)
    return c
