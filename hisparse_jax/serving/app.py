"""The OpenAI-compatible HTTP server: FastAPI routes over one `Scheduler`.

Routes: POST /v1/completions, POST /v1/chat/completions (SSE with stream=true),
GET /v1/models, /health, /metrics. Errors are OpenAI's shape,
{"error": {"message", "type", "param", "code"}}. Every response carries
`x-hisparse-lineage` (model file sha256, cache config hash, package version,
git commit). Handlers never touch JAX: they hand a `Request` to the scheduler's
thread and read its events from an asyncio queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import hmac
import itertools
import json
import logging
import math
import pathlib
import random
import subprocess
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException

from hisparse_jax.attention.exact import PREFILL_CHUNK
from hisparse_jax.backends import IMPLEMENTATIONS, resolve_implementation
from hisparse_jax.models.engine import ATTENTIONS
from hisparse_jax.models.sampling import SamplingParams
from hisparse_jax.offload.policy import POLICIES
from hisparse_jax.serving.batcher import (
    Finish,
    QueueFull,
    Request,
    Scheduler,
    Token,
    TooLarge,
)
from hisparse_jax.serving.metrics import Metrics
from hisparse_jax.validate import check_int, check_number

log = logging.getLogger("hisparse.serve")
DISCONNECT_CHECK_S = 1.0  # how often a waiting handler asks whether its client is gone
# The default request body limit: room for the longest prompt a served context holds
# (its longest tokens, or ids, JSON-escaped: JSON_GROWTH bytes a byte at most, as
# \ud83c\udf89 for a 4-byte emoji) and MIN_BODY for the rest of the request.
JSON_GROWTH = 3
ID_BYTES = 8  # a token id in a JSON list: up to 7 digits and a comma
MIN_BODY = 4 << 20


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    models: tuple[str, ...] = ("smollm2-135m",)  # each: its own engine, caches, thread
    max_seqs: int = 8
    max_context: int | None = None  # None: the model's trained context
    attention: str = "hisparse"
    budget_tokens: int | None = None  # None: default_budget_tokens(each model's context)
    api_key: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    price_per_hour: float | None = None
    max_waiting: int = 64
    prefill_budget: int = PREFILL_CHUNK  # prompt tokens per engine step
    tpot_slo_ms: float | None = None     # defer prompt blocks that would break it
    shutdown_timeout: float = 30.0       # SIGTERM: seconds to finish running requests
    max_request_bytes: int | None = None  # a longer body gets a 413 (None: from the context)
    record_traffic: str | None = None    # append each accepted request to this .jsonl
    kv_cache_memory: int | None = None   # bytes: slots from the capacity planner
    kv_pool_pages: int | None = None     # cold pool pages per layer (None: every slot's context)
    fault_injection: bool = False        # tests only: honour a request's fault_nan_kv_after
    offload: bool = False                # cold pages in host memory (HiSparse)
    offload_policy: str = "predictive"   # the working sets' scheduler (scheduler.POLICIES)
    implementation: str | None = None    # HiSparse kernels: "pallas", "cpu", "xla" (None: by backend)

    def __post_init__(self):
        if not (isinstance(self.models, tuple) and self.models
                and all(isinstance(m, str) and m for m in self.models)):
            raise ValueError(f"models={self.models!r}: must be a non-empty tuple of names")
        check_int("max_seqs", self.max_seqs, minimum=1)
        if self.max_context is not None:
            check_int("max_context", self.max_context, minimum=2)
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention={self.attention!r}: choose from {ATTENTIONS}")
        check_int("port", self.port, minimum=0, maximum=65535)
        check_int("max_waiting", self.max_waiting, minimum=0)
        check_int("prefill_budget", self.prefill_budget, minimum=1)
        if self.tpot_slo_ms is not None:
            check_number("tpot_slo_ms", self.tpot_slo_ms, 0.0, above=True)
        check_number("shutdown_timeout", self.shutdown_timeout, 0.0)
        if self.shutdown_timeout >= 86400:  # (threading's waits take at most ~9e9 s)
            raise ValueError(f"shutdown_timeout={self.shutdown_timeout:g}: must be under a "
                             "day (86400 s)")
        if self.max_request_bytes is not None:
            check_int("max_request_bytes", self.max_request_bytes, minimum=1024)
        if self.price_per_hour is not None:
            check_number("price_per_hour", self.price_per_hour, 0.0)
        if self.kv_cache_memory is not None:
            check_int("kv_cache_memory", self.kv_cache_memory, minimum=1)
        if self.api_key is not None and not (
                self.api_key.isascii() and self.api_key.isprintable() and self.api_key
                and not any(c.isspace() for c in self.api_key)):
            raise ValueError("api_key must be printable ASCII without spaces (a bearer "
                             "token)")
        if self.offload and self.attention != "hisparse":
            raise ValueError("offload: only attention='hisparse' has cold pages to offload")
        if self.offload_policy not in POLICIES:
            raise ValueError(f"offload_policy={self.offload_policy!r}: choose from {POLICIES}")
        if self.offload_policy != "predictive" and not self.offload:
            raise ValueError("offload_policy: only with offload (the scheduler of the "
                             "offloaded cold pages)")
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation={self.implementation!r}: choose from "
                             f"{', '.join(i for i in IMPLEMENTATIONS if i)}")
        if self.kv_pool_pages is not None:
            check_int("kv_pool_pages", self.kv_pool_pages, minimum=1)
            if self.attention != "hisparse":
                raise ValueError("kv_pool_pages: only attention='hisparse' has a page pool")


# ---------------------------------------------------------------- errors

class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _validation_error(e: ValidationError | RequestValidationError) -> APIError:
    first = e.errors()[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None  # the request's field (not a union member's name)
    got = repr(first.get("input"))[:80]
    return APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid')} (got {got})",
                    param=param)


# ---------------------------------------------------------------- request schemas

class _Schema(BaseModel):
    # Strict: "5" is not a number and 1 is not a bool (OpenAI's server refuses them too).
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, body):
        """OpenAI's schemas take null for every optional field: as if it were left out
        (so completions' `"max_tokens": null` is 16, its default)."""
        if not isinstance(body, dict):
            return body
        return {k: v for k, v in body.items()
                if v is not None or k not in cls.model_fields or cls.model_fields[k].is_required()}


class StreamOptions(_Schema):
    include_usage: bool = False


class _Common(_Schema):
    model: str | None = None
    temperature: float | None = None  # OpenAI's default is 1
    top_p: float | None = None
    top_k: int | None = None          # vLLM's extension
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False          # vLLM's extension (benchmarks: fixed output lengths)
    context_id: str | None = None     # ours: a prewarmed document goes before the prompt
    user: str | None = None
    fault_nan_kv_after: int | None = None  # tests only (--fault-injection): NaN K/V after N tokens
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # {token id (a string, as OpenAI's): bias}
    # Not implemented (NOT_IMPLEMENTED): declared so that a request setting one is refused.
    repetition_penalty: Any = None    # vLLM's extension


MAX_N = 16  # choices per request (each one sequence slot)

# Parameters that would change the answer and that the engine does not implement,
# with the values that change nothing: a request that sets another value gets a 400
# naming the parameter, instead of an answer made as if it had not been set.
NOT_IMPLEMENTED = {"repetition_penalty": (1,), "best_of": (1,), "suffix": ("",),
                   "tools": ([],), "response_format": ({"type": "text"},)}


# Not in --record-traffic's lines: how the answer travels, what is not the client's
# own (the prompt and max_tokens are written as the server took them: a prewarmed
# document's ids before the prompt's), and the NOT_IMPLEMENTED fields, which change
# nothing here and which other servers refuse (llama.cpp: best_of, suffix).
UNRECORDED = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream",
              "stream_options", "context_id", "fault_nan_kv_after", *NOT_IMPLEMENTED}


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: Any = None
    suffix: Any = None


class PrewarmRequest(_Schema):
    model: str | None = None
    context_id: str
    prompt: str | list[int]


class ContentPart(_Schema):
    type: Literal["text"]
    text: str


class Message(_Schema):
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(_Common):
    messages: list[Message]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Any = None
    response_format: Any = None


@dataclasses.dataclass(frozen=True)
class Generation:
    """What each of a request's generations runs with (its i-th: seed + i)."""
    sampling: SamplingParams
    stops: tuple[str, ...]
    fault: int | None  # fault_nan_kv_after (tests only)


# ---------------------------------------------------------------- lineage

def lineage(engine, model_path: pathlib.Path | None) -> dict:
    """What produced an answer: the model file's sha256, a hash of the cache
    configuration, the package version and its git commit."""
    from importlib.metadata import PackageNotFoundError, version

    from hisparse_jax.models.registry import sha256
    if model_path is None:
        model_sha = "random-weights"
    elif model_path.is_file():
        model_sha = sha256(model_path)
    else:  # an HF folder: the hash of its weight files' hashes
        h = hashlib.sha256()
        for f in sorted(model_path.glob("*.safetensors")):
            h.update(sha256(f).encode())
        model_sha = h.hexdigest()
    kernels = (None if engine.cache_cfg is None else  # as run: None resolves per host
               resolve_implementation(engine.implementation, engine.cache_cfg))
    cache = (engine.attention, engine.max_seqs, engine.max_context, engine.cache_cfg, kernels,
             engine.prefill_implementation, engine.product_implementation)
    if engine.offload:  # the same answers, but another set-up: say which
        cache += ("offload", engine.working_set, engine.cold.sched.policy)
    cache = repr(cache)
    try:
        pkg = version("hisparse")
    except PackageNotFoundError:
        pkg = "unknown"
    here = pathlib.Path(__file__).resolve().parent

    def git(*argv) -> str:
        try:
            return subprocess.run(["git", "-C", str(here), *argv], check=False,
                                  capture_output=True, text=True, timeout=10).stdout.strip()
        except OSError:
            return ""

    commit = git("rev-parse", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"  # local changes (git describe's mark): the commit alone is not the code
    return {"model_sha256": model_sha,
            "cache_config_sha256": hashlib.sha256(cache.encode()).hexdigest()[:16],
            "package_version": pkg, "git_commit": commit or "unknown"}


def lineage_header(lin: dict) -> str:
    return ";".join(f"{k}={v}" for k, v in lin.items())


# ---------------------------------------------------------------- the app

@dataclasses.dataclass
class Served:
    """One served model: its engine (caches and pools of its own), its scheduler
    thread, its metrics series."""
    name: str  # the id requests name in "model"
    source: str
    engine: object
    tokenizer: object
    eos: tuple[int, ...]
    scheduler: Scheduler
    metrics: object  # Metrics.bind(name)
    lineage: dict

    @property
    def header(self) -> str:
        return lineage_header({"model": self.name, **self.lineage})

    def token_bytes(self, i: int) -> list[int] | None:
        """Logprobs' `bytes` of token i (None without a tokenizer)."""
        return None if self.tokenizer is None else list(self.tokenizer.token_bytes(i))

    def token_name(self, i: int) -> str:
        """Token i in logprobs: its text, or "bytes:\\xNN..." (OpenAI's form) for a
        part of a character, whose text would be U+FFFD for every such token."""
        if self.tokenizer is None:
            return str(i)
        b = self.tokenizer.token_bytes(i)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


@dataclasses.dataclass
class State:
    cfg: ServeConfig
    models: dict[str, Served]  # the first is the default
    metrics: Metrics
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def admitting(self) -> bool:
        return all(m.scheduler.admitting for m in self.models.values())

    def stop_admitting(self):
        for m in self.models.values():
            m.scheduler.admitting = False

    def drain(self):
        """Let each model's running requests finish until the shutdown deadline, then
        end the rest (finish_reason "abort"), and stop the engine threads."""
        deadline = time.monotonic() + self.cfg.shutdown_timeout
        for m in self.models.values():
            m.scheduler.stop(max(0.0, deadline - time.monotonic()))

    def record(self, row: dict):
        """--record-traffic: one line per accepted request, in `bench serve --dataset
        replay`'s format ({"timestamp", "model", "prompt" or "messages", "max_tokens",
        and what else the client set: `traffic`})."""
        if self.cfg.record_traffic:
            with open(self.cfg.record_traffic, "a", encoding="utf-8") as f:
                f.write(json.dumps({"timestamp": time.time(), **row}) + "\n")


class LineageHeader:
    """Adds `x-hisparse-lineage` to every response that has none. Plain ASGI, not
    `@app.middleware("http")`: under Starlette's BaseHTTPMiddleware a handler's
    `request.is_disconnected()` never saw a client go away, so an unstreamed
    answer was computed to its end for nobody."""

    def __init__(self, app, header: str):
        self.app, self.header = app, header

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).setdefault("x-hisparse-lineage", self.header)
            await send(message)

        await self.app(scope, receive, send_with_header)


def build_app(st: State) -> FastAPI:
    header = ", ".join(m.header for m in st.models.values())  # routes not about one model
    body_limit = st.cfg.max_request_bytes or MIN_BODY + max(
        m.engine.max_context * max(ID_BYTES, JSON_GROWTH * (m.tokenizer.max_token_bytes
                                                            if m.tokenizer else 0))
        for m in st.models.values())

    async def lifespan(app):
        for m in st.models.values():
            m.scheduler.start()
        yield
        # uvicorn has closed the socket and waited for the open requests (after a
        # signal the drain has run already, and this returns at once)
        await asyncio.to_thread(st.drain)

    app = FastAPI(title="hisparse", lifespan=lifespan)

    app.add_middleware(LineageHeader, header=header)

    @app.exception_handler(APIError)
    async def on_api_error(request, e: APIError):
        if e.status in (400, 404, 413, 503):
            st.metrics.rejected.labels(status=str(e.status)).inc()
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def on_validation(request, e):
        return _validation_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, e: StarletteHTTPException):
        """Starlette's own errors (an unknown route, a wrong method) in OpenAI's shape."""
        return APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                        headers=getattr(e, "headers", None)).response()

    @app.exception_handler(Exception)
    async def on_bug(request, e: Exception):
        # Starlette's outermost middleware answers with this, then re-raises for
        # uvicorn to log the traceback; LineageHeader is inside it, so add the header
        return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error",
                        headers={"x-hisparse-lineage": header}).response()

    def auth(request: HTTPRequest):
        key = st.cfg.api_key
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # the scheme is case-insensitive (RFC 7235); headers arrive as latin-1 text
        if not (scheme.lower() == "bearer"
                and hmac.compare_digest(given.strip().encode("latin-1"), key.encode())):
            raise APIError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                           type="authentication_error", code="invalid_api_key")

    async def read_body(request: HTTPRequest) -> bytes:
        """The body, refused with a 413 once it passes the limit (before it is all read)."""
        too_long = APIError(413, f"the request body is over this server's limit of "
                            f"{body_limit:,} bytes (--max-request-bytes)",
                            code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > body_limit:
            raise too_long
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > body_limit:
                raise too_long
            chunks.append(chunk)
        return b"".join(chunks)

    def validate(raw: bytes, schema):
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        try:
            return schema.model_validate(body)
        except ValidationError as e:
            raise _validation_error(e) from None

    async def parse(request: HTTPRequest, schema):
        auth(request)
        # A big body's parsing (and below, its tokenizing) runs off the event loop, so
        # that it never holds up the other requests' streams.
        req = await asyncio.to_thread(validate, await read_body(request), schema)
        return req, served(req.model)

    def served(name: str | None) -> Served:
        ms = st.models.get(name or next(iter(st.models)))
        if ms is None:
            raise APIError(404, f"The model `{name}` does not exist (this server "
                           f"serves {', '.join(f'`{m}`' for m in st.models)})", param="model",
                           code="model_not_found")
        return ms

    @app.get("/health")
    async def health():
        if not st.admitting:
            raise APIError(503, "shutting down", type="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        for m in st.models.values():
            st.metrics.update_cost(m.metrics, m.scheduler.generated, m.scheduler.busy_s)
        return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card(m: Served) -> dict:
        return {"id": m.name, "object": "model", "created": st.created, "owned_by": "hisparse",
                "root": m.source, "max_model_len": m.engine.max_context,
                "attention": m.engine.attention, "lineage": m.lineage}

    @app.get("/v1/models")
    async def models(request: HTTPRequest):
        auth(request)
        return {"object": "list", "data": [model_card(m) for m in st.models.values()]}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str, request: HTTPRequest):
        auth(request)
        return model_card(served(model_id))

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        r, ms = await parse(request, CompletionRequest)
        prompt = r.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request (a list of prompts is not "
                               "supported yet)", param="prompt")
            prompt = prompt[0]
        if r.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if r.logprobs is not None and not 0 <= r.logprobs <= 20:
            raise APIError(400, "logprobs must be in [0, 20]", param="logprobs")
        gen = generation(ms, r)
        ids = await asyncio.to_thread(prompt_ids, ms, prompt)
        reqs = make_requests(ms, r, gen, ids, r.max_tokens, r.logprobs)
        return await respond(request, ms, r, reqs, "text_completion",
                             traffic(ms, r, reqs, prompt=prompt))

    @app.post("/v1/prewarm")
    async def prewarm(request: HTTPRequest):
        """Prefill a document once and pin its K/V: later prompts that start with it,
        or that name its context_id, skip its prefill (whole 512-token blocks)."""
        r, ms = await parse(request, PrewarmRequest)
        if not r.context_id:
            raise APIError(400, "context_id must not be empty", param="context_id")
        ids = await asyncio.to_thread(prompt_ids, ms, r.prompt)
        if not PREFILL_CHUNK < len(ids) < ms.engine.max_context:
            raise APIError(400, f"a prewarmed context needs {PREFILL_CHUNK + 1} to "
                           f"{ms.engine.max_context - 1} tokens, got {len(ids)}",
                           param="prompt")
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def sink(ev):  # a prewarm request sends no tokens, only its Finish
            if isinstance(ev, Finish):
                loop.call_soon_threadsafe(done.set_result, ev)

        req = Request(ids=ids, max_tokens=1, sampling=SamplingParams(), prewarm=r.context_id,
                      sink=sink)
        submit(ms, req)
        while True:
            try:
                ev = await asyncio.wait_for(asyncio.shield(done), DISCONNECT_CHECK_S)
                break
            except TimeoutError:
                if await request.is_disconnected():  # nobody waits for it: stop its prefill
                    ms.scheduler.cancel(req)
                    return Response(status_code=499)
        if ev.reason != "stop":
            raise APIError(400 if ev.reason == "error" else 503,
                           ev.message or f"prewarm {ev.reason}", param="context_id")
        return JSONResponse({"object": "prewarm", "context_id": r.context_id,
                             "model": ms.name, "prompt_tokens": len(ids),
                             "cached_tokens": ms.scheduler.prefixes[r.context_id].n},
                            headers={"x-hisparse-lineage": ms.header})

    @app.delete("/v1/prewarm/{context_id}")
    async def unpin(context_id: str, request: HTTPRequest, model: str | None = None):
        auth(request)
        if not served(model).scheduler.unpin(context_id):
            raise APIError(404, f"no prewarmed context `{context_id}`", param="context_id",
                           code="context_not_found")
        return {"object": "prewarm", "context_id": context_id, "deleted": True}

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        r, ms = await parse(request, ChatRequest)
        if ms.tokenizer is None or not ms.tokenizer.chat_template:
            raise APIError(400, "this model has no chat template", param="messages")
        if not r.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        for k, m in enumerate(r.messages):
            if m.content is None and m.role != "assistant":  # (an assistant's may be empty)
                raise APIError(400, f"messages[{k}]: a {m.role!r} message needs content",
                               param="messages")
        messages = [{"role": m.role, "content": m.content if isinstance(m.content, str) else
                     "".join(p.text for p in m.content or ())} for m in r.messages]
        if r.top_logprobs is not None and not r.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        top = None
        if r.logprobs:
            top = r.top_logprobs or 0
            if not 0 <= top <= 20:
                raise APIError(400, "top_logprobs must be in [0, 20]", param="top_logprobs")
        gen = generation(ms, r)
        ids = await asyncio.to_thread(chat_ids, ms, messages)
        max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None \
            else r.max_tokens
        reqs = make_requests(ms, r, gen, ids, max_tokens, top)
        return await respond(request, ms, r, reqs, "chat.completion",
                             traffic(ms, r, reqs, messages=messages))

    def traffic(ms: Served, r: _Common, reqs: list[Request], **prompt) -> dict:
        """--record-traffic's line for a request: what the client set (sampling,
        stop, n, context_id, ...), the prompt, and the max_tokens it got."""
        if r.context_id is not None:  # the document's ids too: a replay has no prewarm
            prompt = {"prompt": reqs[0].ids}
        return {**r.model_dump(exclude_none=True, exclude_defaults=True, exclude=UNRECORDED),
                "model": ms.name, **prompt, "max_tokens": reqs[0].max_tokens}

    def too_long(ms: Served, n: int, param: str, at_least: bool = False) -> APIError:
        limit = ms.engine.max_context
        return APIError(400, f"This model's maximum context length is {limit} tokens. "
                        f"However, your prompt has {'at least ' if at_least else ''}{n} "
                        f"tokens, which leaves no room for a completion.", param=param,
                        code="context_length_exceeded")

    def text_ids(ms: Served, text: str, param: str, add_bos: bool | None = None) -> list[int]:
        """`text` through the model's tokenizer. A text too long for the context by
        its bytes alone is refused without tokenizing it (`Tokenizer.min_tokens`)."""
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise APIError(400, f"{param}: not valid Unicode ({e.reason} at character "
                           f"{e.start})", param=param) from None
        least = ms.tokenizer.min_tokens(size)
        if least >= ms.engine.max_context:
            raise too_long(ms, least, param, at_least=True)
        try:
            return ms.tokenizer.encode(text, add_bos=add_bos)
        except Exception as e:  # noqa: BLE001 (the tokenizer's own error, as a 400)
            raise APIError(400, f"{param} cannot be tokenized: {e}", param=param) from None

    def prompt_ids(ms: Served, prompt: str | list[int]) -> list[int]:
        """Text through the model's tokenizer, or token ids checked against its vocabulary."""
        if isinstance(prompt, str):
            if ms.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send token ids",
                               param="prompt")
            return text_ids(ms, prompt, "prompt")
        if len(prompt) >= ms.engine.max_context:
            raise too_long(ms, len(prompt), "prompt")
        vocab = ms.engine.model.cfg.vocab_size
        if any(not 0 <= i < vocab for i in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(prompt)

    def chat_ids(ms: Served, messages: list[dict]) -> list[int]:
        """The chat template's prompt ids (the template writes any BOS itself)."""
        try:
            text = ms.tokenizer.render_chat(messages)
        except ValueError as e:  # the template's own error ("the chat template failed: ...")
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:  # noqa: BLE001 (a template that fails otherwise: still a 400)
            raise APIError(400, f"the chat template failed: {e}", param="messages") from None
        return text_ids(ms, text, "messages", add_bos=False)

    def generation(ms: Served, r: _Common) -> Generation:
        """What each of the request's generations runs with, checked before its
        prompt is tokenized (a request refused for these costs no tokenizing)."""
        if not 1 <= r.n <= MAX_N:
            raise APIError(400, f"n={r.n}: must be in [1, {MAX_N}]", param="n")
        for name, fine in NOT_IMPLEMENTED.items():
            value = getattr(r, name, None)
            if value is not None and value not in fine:
                raise APIError(400, f"{name}={value!r}: not supported by this server "
                               f"(only {' or '.join(map(repr, fine))})", param=name)
        if r.stream_options is not None and not r.stream:
            raise APIError(400, "stream_options: only with stream: true",
                           param="stream_options")
        temperature = 1.0 if r.temperature is None else r.temperature
        seed = r.seed if r.seed is not None else random.getrandbits(32)
        if not (-2**63 <= seed < 2**64):  # OpenAI's: a 64-bit int; the engine's: 32 bits
            raise APIError(400, f"seed={seed}: must be a 64-bit integer", param="seed")
        seed %= 2**32
        # vLLM's top_k -1 is "no top-k" (as 0); OpenAI's top_p 0 keeps the likeliest token
        top_k = 0 if r.top_k == -1 else r.top_k or 0
        top_p = 1.0 if r.top_p is None else float(r.top_p)
        if r.top_p == 0:
            top_k, top_p = 1, 1.0
        bias = {}
        for key, value in (r.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and int(key) < ms.engine.model.cfg.vocab_size):
                raise APIError(400, f"logit_bias: key {key!r} is not a token id in [0, "
                               f"{ms.engine.model.cfg.vocab_size})", param="logit_bias")
            bias[int(key)] = value
        try:
            sampling = SamplingParams(
                temperature=float(temperature), top_k=top_k, top_p=top_p, seed=seed,
                presence_penalty=float(r.presence_penalty or 0),
                frequency_penalty=float(r.frequency_penalty or 0), logit_bias=bias)
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split("=")[0]) from None
        if not math.isfinite(temperature) or temperature > 2:
            raise APIError(400, "temperature must be in [0, 2]", param="temperature")
        stops = [r.stop] if isinstance(r.stop, str) else list(r.stop or ())
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop: up to 4 non-empty strings", param="stop")
        if stops and ms.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer", param="stop")
        fault = r.fault_nan_kv_after
        if fault is not None:
            if not st.cfg.fault_injection:
                raise APIError(400, "fault_nan_kv_after: fault injection is off (a test "
                               "server's --fault-injection turns it on)",
                               param="fault_nan_kv_after")
            if ms.engine.cache_cfg is None or fault < 1:
                raise APIError(400, "fault_nan_kv_after: a token count >= 1, on a HiSparse "
                               "engine", param="fault_nan_kv_after")
        return Generation(sampling, tuple(stops), fault)

    def make_requests(ms: Served, r: _Common, gen: Generation, ids: list[int],
                      max_tokens: int | None, logprobs) -> list[Request]:
        """The request's `n` generations: one Request each, the i-th seeded seed + i
        (so that sampled choices differ, and each reproduces)."""
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if r.context_id is not None:
            pinned = ms.scheduler.prefixes.get(r.context_id)
            if pinned is None:
                raise APIError(404, f"no prewarmed context `{r.context_id}`",
                               param="context_id", code="context_not_found")
            ids = list(pinned.ids) + ids
        limit = ms.engine.max_context
        if len(ids) >= limit:  # no room for one generated token, whatever max_tokens says
            raise too_long(ms, len(ids), "prompt")
        if max_tokens is None:
            max_tokens = limit - len(ids)
        if max_tokens < 1:
            raise APIError(400, f"max_tokens={max_tokens}: must be at least 1",
                           param="max_tokens")
        if len(ids) + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. "
                           f"However, you requested {len(ids) + max_tokens} tokens "
                           f"({len(ids)} in the prompt, {max_tokens} for the completion).",
                           param="max_tokens", code="context_length_exceeded")
        seed = gen.sampling.seed
        return [Request(ids=ids, max_tokens=max_tokens, sink=None, stops=gen.stops,
                        sampling=dataclasses.replace(gen.sampling, seed=(seed + i) % 2**32),
                        eos=() if r.ignore_eos else ms.eos, logprobs=logprobs,
                        fault_nan_kv_after=gen.fault) for i in range(r.n)]

    def submit(ms: Served, req: Request):
        try:
            ms.scheduler.submit(req)
        except QueueFull as e:
            raise APIError(503, f"overloaded: {e}", type="server_error", code="overloaded",
                           headers={"Retry-After": "1"}) from None
        except TooLarge as e:
            raise APIError(400, str(e), param="max_tokens", code="kv_pool_too_small") from None

    async def respond(http: HTTPRequest, ms: Served, r: _Common, reqs: list[Request],
                      kind: str, record: dict):
        """Submit the request's generations (all or none: a full queue refuses the
        rest and cancels those it took), record the request once accepted, and
        answer with its choices."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()  # (choice index, Token | Finish)
        for i, req in enumerate(reqs):
            req.sink = functools.partial(_put_event, loop, events, i)
        for k, req in enumerate(reqs):
            try:
                submit(ms, req)
            except APIError:
                for taken in reqs[:k]:
                    ms.scheduler.cancel(taken)
                raise
        try:
            st.record(record)
        except OSError as e:  # the answer matters more than its record
            log.warning("--record-traffic %s: %s", st.cfg.record_traffic, e)
        rid = ("cmpl-" if kind == "text_completion" else "chatcmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        chat = kind == "chat.completion"
        if r.stream:
            usage = r.stream_options is not None and r.stream_options.include_usage
            return StreamingResponse(stream(ms, reqs, events, rid, created, chat, usage),
                                     media_type="text/event-stream",
                                     headers={"x-hisparse-lineage": ms.header})
        tokens: list[list[Token]] = [[] for _ in reqs]
        finish: list[Finish | None] = [None] * len(reqs)
        try:
            check = loop.time() + DISCONNECT_CHECK_S
            while None in finish:
                try:
                    i, ev = await asyncio.wait_for(events.get(), DISCONNECT_CHECK_S)
                except TimeoutError:
                    ev = None
                if loop.time() >= check:  # on a clock: tokens may never pause
                    if await http.is_disconnected():  # the client went away
                        return Response(status_code=499)
                    check = loop.time() + DISCONNECT_CHECK_S
                if isinstance(ev, Finish):
                    finish[i] = ev
                elif isinstance(ev, Token):
                    tokens[i].append(ev)
        finally:
            for req, f in zip(reqs, finish):
                if f is None:  # gone, or the server is stopping
                    ms.scheduler.cancel(req)
        failed = [f for f in finish if f.reason == "error"]
        if failed and failed[0].code == "kv_pool_too_small":
            raise APIError(400, failed[0].message, param="max_tokens", code=failed[0].code)
        if failed:
            raise APIError(500, f"the engine failed: {failed[0].message}", type="server_error")
        choices = []
        for i, (toks, f) in enumerate(zip(tokens, finish)):
            text = "".join(t.text for t in toks)
            choice = {"index": i, "finish_reason": _reason(f)}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
                choice["logprobs"] = (_chat_logprobs(ms, toks) if reqs[i].logprobs is not None
                                      else None)
            else:
                choice["text"] = text
                choice["logprobs"] = (_logprobs(ms, toks) if reqs[i].logprobs is not None
                                      else None)
            choices.append(choice)
        body = {"id": rid, "object": kind, "created": created, "model": ms.name,
                "choices": choices, "usage": _usage(finish)}
        return JSONResponse(body, headers={"x-hisparse-lineage": ms.header})

    async def stream(ms: Served, reqs: list[Request], events, rid, created, chat,
                     include_usage):
        kind = "chat.completion.chunk" if chat else "text_completion"
        done = False
        finish: list[Finish | None] = [None] * len(reqs)

        def chunk(choices, usage=None):
            body = {"id": rid, "object": kind, "created": created, "model": ms.name,
                    "choices": choices}
            if include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        # The role rides on a choice's first delta that carries a token (or on its
        # last), not on a chunk of its own sent before the prefill: clients that time
        # the first chunk (vLLM 0.32's `bench serve`) would take it for the first token.
        role = [{"role": "assistant"} if chat else {} for _ in reqs]
        offset = [0] * len(reqs)  # each choice's text so far: logprobs' text_offset
        try:
            while None in finish:
                i, ev = await events.get()
                if isinstance(ev, Finish):  # this choice is done; the others go on
                    finish[i] = ev
                    last = {"index": i, "finish_reason": _reason(ev), "logprobs": None}
                    last.update({"delta": role[i]} if chat else {"text": ""})
                    if ev.reason == "error":
                        err = {"message": ev.message, "type": "server_error", "param": None,
                               "code": ev.code}
                        yield f"data: {json.dumps({'error': err})}\n\n"
                    yield chunk([last])
                    continue
                if not ev.text and ev.id is not None and reqs[i].logprobs is None:
                    continue  # nothing to show yet (an EOS, text held back)
                if chat:
                    c = {"index": i, "delta": {**role[i], "content": ev.text},
                         "finish_reason": None,
                         "logprobs": _chat_logprobs(ms, [ev]) if reqs[i].logprobs is not None
                         else None}
                else:
                    c = {"index": i, "text": ev.text, "finish_reason": None,
                         "logprobs": _logprobs(ms, [ev], offset[i])
                         if reqs[i].logprobs is not None else None}
                offset[i] += len(ev.text)
                yield chunk([c])
                role[i] = {}
            done = True
            if include_usage:
                yield chunk([], _usage(finish))
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away (or the server is stopping)
                for req, f in zip(reqs, finish):
                    if f is None:
                        ms.scheduler.cancel(req)

    def _logprobs(ms: Served, tokens: list[Token], offset: int = 0) -> dict:
        """Completions' logprobs of `tokens`, whose text starts at `offset` of the
        choice's. Each position's top_logprobs holds the sampled token too (so up to
        logprobs + 1 entries, as OpenAI's and vLLM's)."""
        toks = [t for t in tokens if t.id is not None]
        name = ms.token_name

        def top(t: Token) -> dict:
            d: dict[str, float] = {}
            for i, lp in (*t.top, (t.id, t.logprob)):  # likeliest first
                d.setdefault(name(i), lp)
            return d
        return {"tokens": [name(t.id) for t in toks],
                "token_logprobs": [t.logprob for t in toks],
                "top_logprobs": [top(t) for t in toks],
                "text_offset": list(itertools.accumulate((len(t.text) for t in toks[:-1]),
                                                         initial=offset))[:len(toks)]}

    def _chat_logprobs(ms: Served, tokens: list[Token]) -> dict:
        def entry(i: int, lp: float) -> dict:
            return {"token": ms.token_name(i), "logprob": lp, "bytes": ms.token_bytes(i)}
        return {"content": [{**entry(t.id, t.logprob),
                             "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                            for t in tokens if t.id is not None]}

    return app


def _reason(ev: Finish) -> str:
    return {"stop": "stop", "length": "length"}.get(ev.reason, "abort")


def _usage(finish: list[Finish]) -> dict:
    """OpenAI's usage of n choices: the prompt counted once, the completions summed."""
    prompt, completion = finish[0].prompt_tokens, sum(f.completion_tokens for f in finish)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _put_event(loop, events: asyncio.Queue, index: int, ev):
    """A Request's sink: hand the scheduler thread's event to the request's loop."""
    loop.call_soon_threadsafe(events.put_nowait, (index, ev))
