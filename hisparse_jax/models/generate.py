"""Text generation: `generate` streams one request's tokens; `generate_batch` runs
several prompts in the engine's slots at once. Both build on `Engine`.

    gen = generate(model, tok, "Write a haiku about the sea.", chat=True, max_tokens=64)
    for piece in gen:
        print(piece.text, end="", flush=True)
    print(gen.summary.line())
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from hisparse_jax.models.engine import Engine
from hisparse_jax.models.llama import Llama
from hisparse_jax.models.sampling import GREEDY, SamplingParams
from hisparse_jax.models.tokenizer import Tokenizer
from hisparse_jax.validate import check_token_ids, is_int


@dataclasses.dataclass(frozen=True)
class Piece:
    id: int | None  # None: text held back until the end (an unfinished character)
    text: str


@dataclasses.dataclass(frozen=True)
class Summary:
    prompt_tokens: int
    tokens: int          # generated, including a final EOS
    finish: str          # "eos", "stop", "length" (max_tokens) or "context" (cache full)
    prefill_s: float     # prompt to first token (includes compiling on a first call)
    decode_s: float
    attention: str
    capacity: str        # the cache's capacity line (layout.summary_line)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return (self.tokens - 1) / self.decode_s if self.decode_s and self.tokens > 1 else 0.0

    def line(self) -> str:
        return (f"{self.tokens} tokens ({self.finish}), {self.attention} attention: prefill "
                f"{self.prompt_tokens} tokens at {self.prefill_tok_s:.1f} tok/s, decode "
                f"{self.decode_tok_s:.1f} tok/s; {self.capacity}")


class Generation:
    """One request's tokens: iterate for the pieces as they are generated (once);
    `summary`, `ids` and `text` are complete when the iteration ends (`run()` does
    it in one call)."""

    def __init__(self, engine: Engine, tokenizer, ids, max_tokens, sampling, stops, eos):
        self._args = (engine, tokenizer, ids, max_tokens, sampling, stops, eos)
        self.pieces: list[Piece] = []
        self.summary: Summary | None = None

    def run(self) -> Generation:
        for _ in self:
            pass
        return self

    @property
    def ids(self) -> list[int]:
        return [p.id for p in self.pieces if p.id is not None]

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)

    def __iter__(self):
        for piece in self._steps(*self._args):
            self.pieces.append(piece)
            yield piece

    def _steps(self, engine, tokenizer, ids, max_tokens, sampling, stops, eos):
        text = TextStream(tokenizer, stops, eos)
        t0 = time.perf_counter()
        token = engine.prefill(0, ids, sampling)
        t1 = time.perf_counter()
        n, finish = 0, "length"
        while True:
            n += 1
            piece, done = text.push(token)
            yield Piece(token, piece)
            if done:
                finish = done
                break
            if n >= max_tokens:
                break
            if engine.room(0) <= 0:
                finish = "context"
                break
            token = int(engine.decode_step(np.arange(engine.max_seqs) == 0)[0])
        if finish in ("length", "context"):
            rest = text.flush()
            if rest:
                yield Piece(None, rest)
        t2 = time.perf_counter()
        engine.release(0)
        self.summary = Summary(prompt_tokens=len(ids), tokens=n, finish=finish,
                               prefill_s=t1 - t0, decode_s=t2 - t1, attention=engine.attention,
                               capacity=engine.capacity_line())


class TextStream:
    """One request's output text, token by token: incremental detokenization,
    stop strings (their text is not emitted; text that might begin one is held
    back until it cannot) and EOS ids. `generate` and the server both use it."""

    def __init__(self, tokenizer: Tokenizer | None, stops: Sequence[str] = (),
                 eos: Sequence[int] = ()):
        self.stream = tokenizer.stream() if tokenizer is not None else None
        self.stops, self.eos = tuple(stops), tuple(eos)
        self.pending = ""  # decoded, not yet emitted

    def push(self, token: int) -> tuple[str, str | None]:
        """-> (text to emit now, "eos" / "stop" when the request ends here, else None)."""
        if token in self.eos:  # what was held back for a stop string is text after all
            return self.flush(), "eos"
        if self.stream is not None:
            self.pending += self.stream.push(token)
        pending, stops = self.pending, self.stops
        hit = min(((pending.find(s), s) for s in stops if s in pending), default=None)
        if hit is not None:
            self.pending = ""
            return pending[:hit[0]], "stop"
        keep = _held(pending, stops) if stops else 0  # might begin a stop string
        self.pending = pending[len(pending) - keep:]
        return pending[:len(pending) - keep], None

    def flush(self) -> str:
        """What is held back, at the end of a request that did not stop on its own."""
        rest = self.pending + (self.stream.flush() if self.stream is not None else "")
        self.pending = ""
        return rest


def prompt_ids(tokenizer: Tokenizer | None, prompt, chat: bool = False) -> list[int]:
    """Text (a user message with chat=True), a list of chat messages, or ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: give the prompt as token ids")
        if chat:
            return tokenizer.chat_ids([{"role": "user", "content": prompt}])
        return tokenizer.encode(prompt)
    prompt = list(prompt)
    if prompt and isinstance(prompt[0], dict):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: give the prompt as token ids")
        return tokenizer.chat_ids(prompt)
    return check_token_ids("prompt", prompt).tolist()  # 0.5 or "12" is no token id


def _held(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that could begin a stop string."""
    return max((n for s in stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                if s.startswith(text[-n:])), default=0)


def stop_ids(model: Llama, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    ids = tokenizer.eos_ids if tokenizer is not None else ()
    return ids or ((model.cfg.eos_id,) if model.cfg.eos_id is not None else ())


def generate(model: Llama, tokenizer: Tokenizer | None, prompt, *, max_tokens: int = 256,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
             stop: str | Sequence[str] = (), chat: bool = False, ignore_eos: bool = False,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
             logit_bias: dict[int, float] | None = None,
             attention: str = "hisparse", budget_tokens: int = 2048,
             max_context: int | None = None, engine: Engine | None = None) -> Generation:
    """Generate up to `max_tokens` tokens after `prompt` (see `prompt_ids`); stops
    at EOS (and the chat turn's end) unless ignore_eos, or at a stop string (its
    text is not emitted). Pass `engine` to reuse one (slot 0; its attention and
    context apply); otherwise one is built for this request, its context
    `max_context` (default: room for prompt + max_tokens, at most the model's)."""
    if not (is_int(max_tokens) and max_tokens >= 1):
        raise ValueError(f"max_tokens={max_tokens!r}: must be a positive int")
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              presence_penalty=presence_penalty,
                              frequency_penalty=frequency_penalty, logit_bias=logit_bias or ())
    ids = prompt_ids(tokenizer, prompt, chat)
    stop = (stop,) if isinstance(stop, str) else tuple(stop)  # "\n\n" is one stop string
    if not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop={stop!r}: stop strings must be non-empty strings")
    if stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")
    if engine is None:
        trained = model.cfg.max_position
        if max_context is not None and max_context > trained:
            # as the CLI and `serve` refuse it: trained weights answer garbage past it
            raise ValueError(f"max_context={max_context}: past the model's {trained} trained "
                             "positions; extend them with rope scaling (registry.load("
                             "..., rope_scaling=...)) or pass an Engine built for it")
        limit = trained if max_context is None else max_context
        if len(ids) >= limit:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the max context of "
                             f"{limit} tokens")
        if max_context is None:
            max_context = min(limit, -(-(len(ids) + max_tokens) // 256) * 256)
        engine = Engine(model, max_seqs=1, max_context=max_context, attention=attention,
                        budget_tokens=budget_tokens)
    elif len(ids) >= engine.max_context:  # checked now, not when iterated
        raise ValueError(f"prompt of {len(ids)} tokens does not fit max_context="
                         f"{engine.max_context} (it needs room for one generated token)")
    return Generation(engine, tokenizer, ids, max_tokens, sampling, stop,
                      () if ignore_eos else stop_ids(model, tokenizer))


def generate_batch(engine: Engine, prompts: Sequence[Sequence[int]], *, max_tokens: int,
                   sampling: SamplingParams = GREEDY, eos: Sequence[int] = ()):
    """Up to engine.max_seqs prompts (ids) at once, one slot each; each stops at
    an `eos` id or after max_tokens. Returns (generated ids per prompt, timings
    {prefill_s, decode_s, decode_steps})."""
    if len(prompts) > engine.max_seqs:
        raise ValueError(f"{len(prompts)} prompts for {engine.max_seqs} slots")
    t0 = time.perf_counter()
    out = [[engine.prefill(i, p, sampling)] for i, p in enumerate(prompts)]
    t1 = time.perf_counter()
    live = np.arange(engine.max_seqs) < len(prompts)
    steps = 0
    while True:
        for i in np.flatnonzero(live):
            if out[i][-1] in eos or len(out[i]) >= max_tokens or engine.room(i) <= 0:
                live[i] = False
        if not live.any():
            break
        nxt = engine.decode_step(live)
        steps += 1
        for i in np.flatnonzero(live):
            out[i].append(int(nxt[i]))
    t2 = time.perf_counter()
    for i in range(len(prompts)):
        engine.release(i)
    return out, {"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_steps": steps}
