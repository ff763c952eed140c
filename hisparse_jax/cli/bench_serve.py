"""`hisparse bench serve`: load any OpenAI-compatible server (ours, llama.cpp's,
vLLM's) through its streaming completions or chat endpoint and report vLLM's
serving figures: TTFT, TPOT, ITL and E2EL (mean, median, P90, P99), request and
token throughput, and goodput under an SLO.

Datasets: `random` (fixed or ranged lengths), `lognormal-bimodal` (lognormal
prompt lengths; most answers short, some long), `prefix` (one shared document,
many questions), `replay FILE.jsonl` (lines {"prompt" or "messages",
"max_tokens", optional "timestamp" in seconds, and any other request field, sent
as recorded}: sent in the order and at the times of their timestamps; `hisparse
serve --record-traffic FILE` writes them). Arrivals are Poisson at
--request-rate (inf: all at once), at most --max-concurrency in flight; the
--warmup requests before them are excluded from the figures (replay: copies of
its first lines, which are then measured as well).

TPOT is vLLM's: (E2EL - TTFT) / (output tokens - 1), the stream's end included.
Token counts are the server's `usage` (asked for with stream_options); a server
that sends none is counted in streamed chunks for its output and by the
tokenizer for its prompts, and the row says so (`token_counts`). A run in which
no request completes exits 1; Ctrl-C reports the requests finished so far and
exits 130.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import math
import sys
import time

import numpy as np

from hisparse_jax.cli.args import CLIError, nonnegative_int, number, positive_int

DATASETS = ("random", "lognormal-bimodal", "prefix", "replay")
EXACT_TRIES = 8  # re-encodings for an exact prompt length (1-3 suffice for SmolLM2's BPE)
# A replay line's fields that the client sets itself; the others (temperature,
# top_p, seed, stop, n, context_id, ...) are sent as recorded.
REPLAY_OWN = ("timestamp", "model", "prompt", "messages", "max_tokens", "stream",
              "stream_options")
SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")
ERRORS_SHOWN = 5  # distinct failure reasons in the report, the commonest first


@dataclasses.dataclass(frozen=True)
class Job:
    prompt: str | list[int] | list[dict]  # text, token ids, or chat messages (replay)
    max_tokens: int
    at: float | None = None  # replay: seconds after the start
    body: dict = dataclasses.field(default_factory=dict)  # replay: the request's other fields
    prompt_tokens: int | None = None  # known here (None: only the server's usage says)


@dataclasses.dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    usage: bool = False  # the counts are the server's (not chunks and the tokenizer's)

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 \
            else None


# ---------------------------------------------------------------- datasets

def _lengths(spec: str, n: int, rng) -> np.ndarray:
    """"N" or "A:B" (uniform, inclusive)."""
    try:
        lo, _, hi = spec.partition(":")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise CLIError(f"length {spec!r}: expected N or A:B") from None
    if not 1 <= lo <= hi:
        raise CLIError(f"length {spec!r}: needs 1 <= A <= B")
    return rng.integers(lo, hi + 1, n)


class Prompts:
    """Prompts of an exact token length: random token ids of the tokenizer's
    ordinary vocabulary, decoded to text that the tokenizer encodes to n ids
    (ids when there is no tokenizer)."""

    def __init__(self, tokenizer, rng):
        self.tok, self.rng = tokenizer, rng
        self.vocab = tokenizer.vocab_size if tokenizer is not None else 32000
        # the BOS that encode adds (the server counts it): one encode per try, not two
        self.bos = int(tokenizer is not None and tokenizer.add_bos and tokenizer.bos_id is not None)

    def _random(self, n: int) -> list[int]:
        return self.rng.integers(300, self.vocab - 300, int(n)).tolist()

    def make(self, n: int) -> str | list[int]:
        ids = self._random(n)
        if self.tok is None:
            return ids
        # decoded random ids re-encode ~5% longer (merges across their boundaries):
        # cut or extend the re-encoded ids until the text encodes to n
        text = self.tok.decode(ids)
        for _ in range(EXACT_TRIES):
            ids = self.tok.encode(text, add_bos=False)
            extra = len(ids) + self.bos - n
            if extra == 0:
                return text
            ids = ids[:len(ids) - extra] if extra > 0 else ids + self._random(-extra)
            text = self.tok.decode(ids)
        raise CLIError(f"no text of exactly {n} tokens after {EXACT_TRIES} re-encodings "
                       "(--tokenizer none sends token ids)")


def build_jobs(args, tokenizer) -> list[Job]:
    rng = np.random.default_rng(args.seed)
    n = args.num_prompts + args.warmup
    mk = Prompts(tokenizer, rng)
    if args.dataset == "random":
        ins, outs = _lengths(args.input_len, n, rng), _lengths(args.output_len, n, rng)
        return [Job(mk.make(i), int(o), prompt_tokens=int(i)) for i, o in zip(ins, outs)]
    if args.dataset == "lognormal-bimodal":
        median = int(_lengths(args.input_len, 1, rng)[0])
        ins = np.clip(rng.lognormal(math.log(median), 0.8, n), 16, args.max_input_len)
        short = _lengths(args.output_len, n, rng)
        long = _lengths(args.long_output_len, n, rng)
        outs = np.where(rng.random(n) < args.long_fraction, long, short)
        return [Job(mk.make(int(i)), int(o), prompt_tokens=int(i)) for i, o in zip(ins, outs)]
    if args.dataset == "prefix":
        doc = mk.make(args.prefix_len)
        ins, outs = _lengths(args.input_len, n, rng), _lengths(args.output_len, n, rng)
        if isinstance(doc, list):
            return [Job(doc + mk.make(i), int(o), prompt_tokens=args.prefix_len + int(i))
                    for i, o in zip(ins, outs)]
        return [Job(doc + "\n\nQuestion: " + mk.make(i), int(o)) for i, o in zip(ins, outs)]
    if not args.dataset_path:
        raise CLIError("--dataset replay needs --dataset-path FILE.jsonl")
    return _replay(args, tokenizer)


def _replay(args, tokenizer) -> list[Job]:
    jobs = []
    try:
        with open(args.dataset_path, encoding="utf-8") as f:
            for k, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    prompt = row["messages"] if "messages" in row else row["prompt"]
                    if not isinstance(prompt, (str, list)) or not prompt:
                        raise ValueError("an empty or missing prompt or messages")
                    at = float(row["timestamp"]) if "timestamp" in row else None
                    if at is not None and not math.isfinite(at):
                        raise ValueError(f"timestamp {row['timestamp']!r}")
                    body = {k: v for k, v in row.items() if k not in REPLAY_OWN}
                    count = (len(tokenizer.encode(prompt)) if isinstance(prompt, str) and tokenizer
                             else len(prompt) if isinstance(prompt[0], int) else None)
                    jobs.append(Job(prompt, int(row.get("max_tokens", 128)), at, body, count))
                except (ValueError, KeyError, TypeError, IndexError) as e:
                    raise CLIError(f"{args.dataset_path}:{k}: not a request line ({e})") \
                        from None
    except UnicodeDecodeError as e:
        raise CLIError(f"--dataset-path {args.dataset_path}: not UTF-8 text ({e.reason})") \
            from None
    except OSError as e:
        raise CLIError(f"--dataset-path {args.dataset_path}: {e.strerror or e}") from None
    if not jobs:
        raise CLIError(f"{args.dataset_path}: no requests")
    timed = sum(j.at is not None for j in jobs)
    if 0 < timed < len(jobs):
        raise CLIError(f"{args.dataset_path}: {timed} of {len(jobs)} lines have a timestamp "
                       "(all or none)")
    if timed:  # sent in time order (a merged file may not be), from the first one's
        jobs.sort(key=lambda j: j.at)
        t0 = jobs[0].at
        jobs = [dataclasses.replace(j, at=j.at - t0) for j in jobs]
    return jobs[:args.num_prompts] if args.num_prompts_given else jobs


# ---------------------------------------------------------------- the client

async def one(client, args, model: str, job: Job) -> Result:
    messages = isinstance(job.prompt, list) and job.prompt and isinstance(job.prompt[0], dict)
    chat = args.endpoint == "chat" or messages
    body = {"temperature": args.temperature, **job.body, "model": model,
            "max_tokens": job.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if messages:
        body["messages"] = job.prompt
    elif chat:
        body["messages"] = [{"role": "user", "content": job.prompt}]
    else:
        body["prompt"] = job.prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    res, t0 = Result(), time.perf_counter()
    try:
        async with asyncio.timeout(args.timeout):  # the whole request, not each read
            await _stream(client, path, body, chat, res, t0)
    except TimeoutError:
        res.ok, res.error = False, f"no end within --timeout {args.timeout:g} s"
    except Exception as e:  # noqa: BLE001 (a failed request is a figure, not a crash)
        res.ok, res.error = False, f"{type(e).__name__}: {e}"
    if not res.usage:  # the server sent no counts: the chunks', the prompt's as known
        res.prompt_tokens = job.prompt_tokens or 0
    return res


async def _stream(client, path: str, body: dict, chat: bool, res: Result, t0: float):
    """One streamed request into `res` (raises on a transport error)."""
    last, chunks, ended, failed = None, 0, None, ""
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode("utf-8", "replace")
            res.error = f"HTTP {r.status_code}: {text[:200]}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            ev = json.loads(data)
            err = ev.get("error")
            if err:  # a stream that failed after its 200
                failed = str(err.get("message", err) if isinstance(err, dict) else err)[:200]
            if ev.get("usage"):
                res.prompt_tokens = ev["usage"].get("prompt_tokens", 0)
                res.output_tokens = ev["usage"].get("completion_tokens", 0)
                res.usage = True
            for c in ev.get("choices") or ():
                ended = c.get("finish_reason") or ended
                piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                if piece:
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
    res.e2el = time.perf_counter() - t0
    if not res.usage:
        res.output_tokens = chunks
    # a stream counts if it ended as the server meant it to: any finish reason but
    # an abort or an error (ours: "stop" or "length"; others name EOS their own way)
    res.ok = last is not None and not failed and ended not in (None, "abort", "error")
    if not res.ok:
        res.error = failed or ("no tokens" if last is None else f"finish_reason {ended!r}")


async def run_jobs(args, model: str, jobs: list[Job], progress=None,
                   done: list | None = None) -> tuple[list, float]:
    """Send `jobs` (their results, the seconds from the first send to the last end).
    `done` gets each result as it ends (what an interrupted run still has)."""
    import httpx
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    rng = np.random.default_rng(args.seed + 1)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout)) as client:
        async def go(job):
            if sem is None:
                r = await one(client, args, model, job)
            else:
                async with sem:
                    r = await one(client, args, model, job)
            if done is not None:
                done.append(r)
            if progress is not None:
                progress.update(1)
            return r

        t0 = time.perf_counter()
        tasks = []
        try:
            for job in jobs:
                if job.at is not None:  # replay: its own time
                    await asyncio.sleep(max(0.0, t0 + job.at / args.replay_speed
                                            - time.perf_counter()))
                elif math.isfinite(args.request_rate):  # Poisson arrivals
                    await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
                tasks.append(asyncio.create_task(go(job)))
            results = await asyncio.gather(*tasks)
        except asyncio.CancelledError:  # Ctrl-C: end the requests while the client is
            for t in tasks:             # open (closing it first fails them: not figures)
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return results, time.perf_counter() - t0


# ---------------------------------------------------------------- the report

def _stats(xs) -> dict:
    if not xs:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    a = np.asarray(xs) * 1000
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def parse_slo(text: str | None) -> dict[str, float]:
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        k, _, v = part.partition("=")
        k = k.strip()
        if k not in SLO_KEYS:
            raise CLIError(f"--slo {text!r}: keys are {', '.join(SLO_KEYS)}")
        if k in out:
            raise CLIError(f"--slo {text!r}: {k} is given twice")
        try:
            out[k] = float(v)
        except ValueError:
            raise CLIError(f"--slo {text!r}: {k} needs a number of ms") from None
        if not 0 < out[k] < math.inf:
            raise CLIError(f"--slo {text!r}: {k} must be > 0 and finite")
    return out


def report(results: list[Result], wall: float, slo: dict) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    row = {"requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
           "duration_s": wall, "prompt_tokens": sum(r.prompt_tokens for r in ok),
           "output_tokens": out_tokens, "request_throughput": len(ok) / wall,
           "output_throughput": out_tokens / wall,
           "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / wall}
    for name, xs in (("ttft_ms", [r.ttft for r in ok]),
                     ("tpot_ms", [r.tpot for r in ok if r.tpot is not None]),
                     ("itl_ms", [x for r in ok for x in r.itl]),
                     ("e2el_ms", [r.e2el for r in ok])):
        row[name] = _stats(xs)
    if slo:
        def good(r):
            v = {"ttft_ms": r.ttft * 1000, "e2el_ms": r.e2el * 1000,
                 "tpot_ms": (r.tpot or 0) * 1000}
            return all(v[k] <= lim for k, lim in slo.items())
        row["slo"] = slo
        row["goodput"] = sum(good(r) for r in ok) / wall
    usage = sum(r.usage for r in ok)
    row["token_counts"] = ("usage" if usage == len(ok) else
                           f"chunks and the tokenizer for {len(ok) - usage} of {len(ok)} "
                           "requests (no usage from the server)")
    errors = collections.Counter(r.error for r in results if not r.ok)
    if errors:  # the commonest first, each with its count
        row["errors"] = {e: n for e, n in errors.most_common(ERRORS_SHOWN)}
    return row


def table(row: dict) -> str:
    lines = [f"{'requests completed':<28}{row['completed']}/{row['requests']}",
             f"{'duration (s)':<28}{row['duration_s']:.2f}",
             f"{'output tokens':<28}{row['output_tokens']}",
             f"{'request throughput (req/s)':<28}{row['request_throughput']:.3f}",
             f"{'output throughput (tok/s)':<28}{row['output_throughput']:.2f}",
             f"{'total throughput (tok/s)':<28}{row['total_token_throughput']:.2f}"]
    if "goodput" in row:
        lines.append(f"{'goodput (req/s)':<28}{row['goodput']:.3f}")
    lines.append(f"{'(ms)':<10}{'mean':>10}{'median':>10}{'P90':>10}{'P99':>10}")
    for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = row[k]
        cells = "".join(f"{'-' if s[q] is None else f'{s[q]:.1f}':>10}"
                        for q in ("mean", "median", "p90", "p99"))
        lines.append(f"{k[:-3].upper():<10}{cells}")
    if row["token_counts"] != "usage":
        lines.append(f"token counts: {row['token_counts']}")
    for e, n in row.get("errors", {}).items():
        lines.append(f"error ({n}x): {e}")
    if row.get("interrupted"):
        lines.append("interrupted: the requests that had ended by then")
    return "\n".join(lines)


def _check(args, tokenizer):
    """The flag combinations that cannot run, before any request."""
    if args.dataset_path and args.dataset != "replay":
        raise CLIError(f"--dataset-path is for --dataset replay, not {args.dataset}")
    if args.long_fraction > 1:
        raise CLIError(f"--long-fraction {args.long_fraction:g}: a share, at most 1")
    if args.endpoint == "chat" and tokenizer is None and args.dataset != "replay":
        raise CLIError("--endpoint chat sends text: it needs a --tokenizer (not none)")


def main_bench_serve(args):
    import httpx
    from tqdm import tqdm

    slo = parse_slo(args.slo)
    args.num_prompts_given = args.num_prompts is not None
    if args.num_prompts is None:
        args.num_prompts = 100
    # a server's root: vLLM's form, and ours; a trailing "/" or "/v1" is the same server
    args.base_url = args.base_url.rstrip("/").removesuffix("/v1")
    tokenizer = None
    if args.tokenizer != "none":
        from hisparse_jax.models.registry import load_tokenizer
        tokenizer = load_tokenizer(args.tokenizer)  # the weights are the server's
    _check(args, tokenizer)
    if args.json and args.json != "-":  # a row that cannot be written fails now, not after
        try:
            with open(args.json, "a", encoding="utf-8"):
                pass
        except OSError as e:
            raise CLIError(f"--json {args.json}: {e.strerror or e}") from None
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model
    if model is None:
        try:
            r = httpx.get(args.base_url + "/v1/models", headers=headers, timeout=30)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise CLIError(f"--base-url {args.base_url}: no model list ({e}); pass --model")
    jobs = build_jobs(args, tokenizer)
    if args.dataset == "replay":  # the warm-up repeats its first lines; all are measured
        warm = jobs[:args.warmup]
        if args.endpoint == "chat" and any(not isinstance(j.prompt[0], (str, dict))
                                           for j in jobs if isinstance(j.prompt, list)):
            raise CLIError("--endpoint chat sends text: the replay has token-id prompts")
    else:
        warm, jobs = jobs[:args.warmup], jobs[args.warmup:]
    if warm:
        asyncio.run(run_jobs(args, model, [dataclasses.replace(j, at=None) for j in warm]))
    done: list[Result] = []
    interrupted = False
    t0 = time.perf_counter()
    with tqdm(total=len(jobs), desc="bench serve", file=sys.stderr,
              disable=args.no_progress) as bar:
        try:
            results, wall = asyncio.run(run_jobs(args, model, jobs, bar, done))
        except KeyboardInterrupt:
            results, wall, interrupted = done, time.perf_counter() - t0, True
    request_rate = args.request_rate if math.isfinite(args.request_rate) else "inf"  # JSON has no inf
    row = {"command": args.command_line, "base_url": args.base_url, "model": model,
           "endpoint": args.endpoint, "dataset": args.dataset,
           "request_rate": request_rate, "max_concurrency": args.max_concurrency,
           "warmup": args.warmup, **report(results, wall, slo)}
    if interrupted:
        row.update(interrupted=True, requests=len(jobs), not_ended=len(jobs) - len(results))
    if args.json == "-":
        print(json.dumps(row))
    else:
        print(table(row))
    if args.json and args.json != "-":
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
    if interrupted:
        print(f"hisparse bench serve: interrupted, {len(results)} of {len(jobs)} requests "
              "had ended", file=sys.stderr)
        sys.exit(130)
    if not row["completed"]:
        first = next(iter(row.get("errors", {})), "")
        print(f"hisparse bench serve: no request completed ({first})", file=sys.stderr)
        sys.exit(1)


def rate(text: str) -> float:
    """--request-rate: a number > 0, or inf (all at once)."""
    if text.strip().lower() in ("inf", "infinity"):
        return math.inf
    return number(0.0, above=True)(text)


def add_arguments(p):
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server's root (a trailing /v1 is dropped)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=None, metavar="K")
    p.add_argument("--tokenizer", default="smollm2-135m",
                   help="builds prompts of exact token lengths (a model name or path; "
                        "'none': send token ids)")
    p.add_argument("--dataset", choices=DATASETS, default="random")
    p.add_argument("--dataset-path", default=None, metavar="FILE.jsonl",
                   help="replay: one request per line")
    p.add_argument("--num-prompts", type=positive_int, default=None, metavar="N",
                   help="measured requests (default 100; replay: the whole file)")
    p.add_argument("--input-len", default="1024", metavar="N|A:B",
                   help="prompt tokens (lognormal-bimodal: the median; prefix: the question)")
    p.add_argument("--output-len", default="128", metavar="N|A:B",
                   help="max tokens (lognormal-bimodal: the short answers)")
    p.add_argument("--long-output-len", default="1024", metavar="N|A:B",
                   help="lognormal-bimodal: the long answers")
    p.add_argument("--long-fraction", type=number(0.0), default=0.1, metavar="F",
                   help="lognormal-bimodal: share of long answers")
    p.add_argument("--max-input-len", type=positive_int, default=7168, metavar="N",
                   help="lognormal-bimodal: the longest prompt")
    p.add_argument("--prefix-len", type=positive_int, default=4096, metavar="N",
                   help="prefix: the shared document's tokens")
    p.add_argument("--request-rate", type=rate, default=math.inf,
                   metavar="R", help="Poisson arrivals per second (default inf: all at once)")
    p.add_argument("--replay-speed", type=number(0.0, above=True), default=1.0, metavar="X",
                   help="replay: time runs X times faster")
    p.add_argument("--max-concurrency", type=positive_int, default=None, metavar="N")
    p.add_argument("--warmup", type=nonnegative_int, default=1, metavar="N",
                   help="requests sent first and excluded from the figures (replay: "
                        "its first N lines again)")
    p.add_argument("--temperature", type=number(0.0), default=0.0)
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask for exactly max_tokens (vLLM's and our extension)")
    p.add_argument("--slo", default=None, metavar="ttft_ms=X,tpot_ms=Y",
                   help="goodput: completed requests per second meeting every limit "
                        "(keys ttft_ms, tpot_ms, e2el_ms)")
    p.add_argument("--timeout", type=number(0.0, above=True), default=600.0, metavar="S",
                   help="seconds a request may take, from its send to its stream's end")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--json", default=None, metavar="FILE",
                   help="append one JSON row with the exact command ('-': stdout only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p
