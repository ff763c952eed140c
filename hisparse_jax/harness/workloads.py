"""Seeded attention workloads with the structure of real long-context models (DESIGN §4).

Keys are built from mechanisms seen in trained models, then RoPE-rotated
(Llama-3 base 500000, rotate-half pairs (i, i + D/2)):
- a per-head mean with a few massive outlier channels (low-frequency pairs, so
  they survive RoPE nearly unrotated, as in Llama's "massive" key channels);
- a document/topic component that persists over spans of 200-3000 tokens;
- a smooth random process over positions (nearby tokens have similar keys);
- token 0 as the attention sink (a distinctive key every head can lock on to);
- needles: short token spans at random depths whose low-frequency content
  matches what a retrieval query asks for.
Queries at position S (after all S tokens) come in four kinds, per query head:
sink (mass on token 0, the rest mostly on recent tokens), local (recent tokens), retrieval (one
needle per query head; heads of one GQA group may ask for different needles)
and diffuse (weak, topic-level preferences spread over the whole context). Every
kind also carries a per-head sink bias and topic-level background, so mass is
never perfectly concentrated. Values are per-head mean + topic + token noise,
with needles carrying a distinct value (the "answer").
"""

from __future__ import annotations

import dataclasses

import numpy as np

HEAD_KINDS = ("sink", "local", "retrieval", "diffuse")
CONCENTRATED = ("sink", "local", "retrieval")
ROPE_BASE = 500000.0


@dataclasses.dataclass(frozen=True)
class Workload:
    q: np.ndarray            # [N, Hq, D] float32, decode queries at position S
    k: np.ndarray            # [S, Hkv, D] float32 (post-RoPE)
    v: np.ndarray            # [S, Hkv, D] float32
    head_kinds: tuple        # [Hq] kind of each query head
    needle_targets: np.ndarray  # [N, Hq, 2] (start, end) token span asked for; -1 if none
    seed: int

    @property
    def context(self) -> int:
        return self.k.shape[0]


def rope(x: np.ndarray, pos: np.ndarray, base: float = ROPE_BASE) -> np.ndarray:
    """Rotate-half RoPE. x [..., T, H, D] or [T, H, D]; pos [T]."""
    d = x.shape[-1]
    half = d // 2
    inv = base ** (-np.arange(half) * 2.0 / d)
    ang = pos[:, None].astype(np.float64) * inv[None, :]  # [T, half]
    cos = np.cos(ang)[:, None, :].astype(np.float32)
    sin = np.sin(ang)[:, None, :].astype(np.float32)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def _unit(rng, d, mask=None):
    x = rng.normal(size=d).astype(np.float32)
    if mask is not None:
        x = x * mask
    return x / np.linalg.norm(x)


def _smooth_noise(rng, s: int, d: int, width: float) -> np.ndarray:
    """[s, d] unit-variance noise, Gaussian-smoothed over positions (FFT convolution)."""
    x = rng.normal(size=(s, d)).astype(np.float32)
    n = 1 << int(np.ceil(np.log2(s + 8 * width)))
    t = np.arange(n)
    t = np.minimum(t, n - t)
    kern = np.exp(-0.5 * (t / width) ** 2)
    y = np.fft.irfft(np.fft.rfft(x, n=n, axis=0) * np.fft.rfft(kern)[:, None], n=n, axis=0)[:s]
    return (y / y.std(axis=0, keepdims=True)).astype(np.float32)


def _solve(k: np.ndarray, base: np.ndarray, direction: np.ndarray, region: np.ndarray,
           share: float) -> np.ndarray:
    """base + a * direction with a >= 0 chosen (bisection) so the softmax of
    k @ q / sqrt(D) puts `share` of its mass on `region` (as close as reachable)."""
    d = k.shape[1]
    base_l = k @ base / np.sqrt(d)
    dir_l = k @ direction / np.sqrt(d)

    def mass(a):
        lg = base_l + a * dir_l
        p = np.exp(lg - lg.max())
        return p[region].sum() / p.sum()

    lo, hi = 0.0, 1.0
    while mass(hi) < share and hi < 1e4:
        lo, hi = hi, hi * 2
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mass(mid) < share else (lo, mid)
    return (base + hi * direction).astype(np.float32)


def _aim(key_dir: np.ndarray, logit: float, d: int) -> np.ndarray:
    """Query term that adds `logit` (after the 1/sqrt(D) scale) to keys holding key_dir."""
    return key_dir * (logit * np.sqrt(d) / float(key_dir @ key_dir))


def make_workload(*, context: int, num_kv_heads: int = 4, gqa_group: int = 4, head_dim: int = 128,
                  kinds=None, num_queries: int = 8, needles_per_head: int = 6,
                  seed: int = 0) -> Workload:
    """Generate q, k, v. `kinds` lists one kind per KV head (its query heads share
    it), or one per query head; default cycles through HEAD_KINDS per KV head.

    Query strengths are set in logit units relative to log(S), the log-mass of a
    flat background, so a head's kind means the same thing at 32K and at 1M.
    """
    rng = np.random.default_rng(seed)
    S, H, G, D = context, num_kv_heads, gqa_group, head_dim
    half = D // 2
    if kinds is None:
        kinds = [HEAD_KINDS[h % len(HEAD_KINDS)] for h in range(H)]
    kinds = list(kinds)
    if len(kinds) == H:
        kinds = [kd for kd in kinds for _ in range(G)]
    if len(kinds) != H * G or any(kd not in HEAD_KINDS for kd in kinds):
        raise ValueError(f"kinds must list {H} or {H * G} entries from {HEAD_KINDS}")
    log_s = float(np.log(S))

    # Channel masks in rotate-half layout: pair i = (i, i + D/2), frequency falls with i.
    pair = np.arange(D) % half
    outlier_pool = np.flatnonzero((pair >= half // 2) & (pair < half * 3 // 4))
    content = np.ones(D, np.float32)
    content[outlier_pool] = 0.0                            # topics, needles, sinks

    # Topic segments shared by all heads (they are properties of the text).
    bounds = [0]
    while bounds[-1] < S:
        bounds.append(bounds[-1] + int(rng.integers(200, 3000)))
    starts = np.array(bounds[:-1])
    seg = np.searchsorted(np.array(bounds[1:]), np.arange(S), side="right")
    n_topics = max(4, len(starts) // 3)
    topic = rng.integers(0, n_topics, size=len(starts))[seg]  # [S]

    k_raw = np.empty((S, H, D), np.float32)
    v = np.empty((S, H, D), np.float32)
    q = np.zeros((num_queries, H * G, D), np.float32)
    targets = np.full((num_queries, H * G, 2), -1, np.int64)
    pos = np.arange(S)
    key_noise, topic_amp, local_amp = 0.9, 0.6, 1.2
    key_std = float(np.sqrt(key_noise ** 2 + topic_amp ** 2 + local_amp ** 2))
    needle_lo = min(S - 1, 32)
    for h in range(H):
        mean = rng.normal(scale=0.3, size=D).astype(np.float32)
        outl = rng.choice(outlier_pool, size=4, replace=False)
        mean[outl] = rng.choice([-1, 1], size=4) * rng.uniform(6, 12, size=4)
        topic_dirs = rng.normal(size=(n_topics, D)).astype(np.float32) * content * topic_amp
        # Local context: a smooth random process over positions (nearby tokens have
        # similar keys), correlation length 16..64 tokens.
        width = float(rng.uniform(16, 64))
        local = _smooth_noise(rng, S, D, width) * local_amp
        sink_dir = _unit(rng, D, content) * 40.0  # sinks have huge, distinct keys
        k_raw[:, h] = (mean + topic_dirs[topic] + local
                       + rng.normal(size=(S, D)).astype(np.float32) * key_noise)
        k_raw[0, h] += sink_dir
        v_mean = rng.normal(scale=0.5, size=D).astype(np.float32)
        v_topic = rng.normal(scale=0.7, size=(n_topics, D)).astype(np.float32)
        v[:, h] = v_mean + v_topic[topic] + rng.normal(size=(S, D)).astype(np.float32)
        v[0, h] = rng.normal(scale=0.2, size=D)  # sinks carry little value

        # Needles: spans of 4..24 tokens at random depths, not page aligned.
        spans = []
        for _ in range(needles_per_head):
            ln = int(rng.integers(4, 25))
            start = int(rng.integers(needle_lo, max(needle_lo + 1, S - ln)))
            needle = _unit(rng, D, content) * 15.0
            k_raw[start:start + ln, h] += needle
            v[start:start + ln, h] += rng.normal(scale=2.0, size=D)
            spans.append((start, start + ln, needle))

        # Query terms aim at post-RoPE key directions (what a trained head matches).
        # The main term's strength is solved per query so that the head's kind puts
        # a sampled share of the exact softmax mass on its structure.
        k_post = rope(k_raw[:, h:h + 1], pos)[:, 0]  # [S, D]
        sink_key = k_post[0] - k_post[1:].mean(0)
        # Trained queries barely read the massive key channels. The local term must
        # not either: through them it picked up the slowly rotating per-head mean, a
        # trend over the whole context, and on some seeds the solve then needed
        # max logits of 118-157,000 (or never reached its share) where real heads
        # stay below ~50 (Gemma 2 soft-caps its attention logits at 50).
        read = np.ones(D, np.float32)
        read[outl] = 0.05
        local_key = rope(local[None, S - 1:S], np.full(1, S - 1))[0, 0] * read
        recent = pos >= S - int(4 * width)
        for g in range(G):
            hq = h * G + g
            kind = kinds[hq]
            for n in range(num_queries):
                qv = _unit(rng, D) * read * (np.sqrt(D) / key_std)  # logit std ~1
                if kind != "sink":  # every head leaks some mass to the sink
                    qv += _aim(sink_key, log_s + rng.uniform(-5.0, -1.0), D)
                if kind == "sink":  # sink + recent window (the StreamingLLM pattern)
                    qv += _aim(local_key, log_s - np.log(width) + rng.uniform(2.0, 4.0), D)
                elif kind != "local":
                    qv += _aim(local_key, rng.uniform(0.0, 2.0), D)
                if kind == "sink":
                    qv = _solve(k_post, qv, sink_key, pos == 0, rng.uniform(0.75, 0.99))
                elif kind == "local":
                    qv = _solve(k_post, qv, local_key, recent, rng.uniform(0.75, 0.99))
                elif kind == "retrieval":
                    start, end, needle = spans[rng.integers(len(spans))]
                    nkey = rope(needle[None, None], np.full(1, (start + end) // 2))[0, 0]
                    qv = _solve(k_post, qv, nkey, (pos >= start) & (pos < end),
                                rng.uniform(0.8, 0.99))
                    targets[n, hq] = (start, end)
                else:  # diffuse: weak preferences for a few topic segments
                    for sg in rng.choice(len(starts), size=min(3, len(starts)), replace=False):
                        tkey = rope(topic_dirs[topic[starts[sg]]][None, None],
                                    np.full(1, starts[sg]))[0, 0]
                        qv += _aim(tkey, rng.uniform(0.5, 2.5), D)
                q[n, hq] = qv
    k = rope(k_raw, pos)
    # Query terms were built in rotated space already (they aim at rotated keys).
    return Workload(q=q.astype(np.float32), k=k.astype(np.float32), v=v.astype(np.float32),
                    head_kinds=tuple(kinds), needle_targets=targets, seed=seed)


SHARP_KINDS = ("sharp", "local", "diffuse")


@dataclasses.dataclass(frozen=True)
class SharpWorkload:
    q: np.ndarray            # [N, Hq, D] float32, decode queries at position S
    k: np.ndarray            # [S, Hkv, D] float32 (post-RoPE)
    v: np.ndarray            # [S, Hkv, D] float32
    head_kinds: tuple        # [Hq] "sharp", "local" or "diffuse"
    target_pages: np.ndarray  # [N, Hq] the page a sharp head's query is aimed at; -1 if none
    distractor_pages: tuple  # per query head: the pages planted to outrank its target's bound
    seed: int

    @property
    def context(self) -> int:
        return self.k.shape[0]


def make_sharp_workload(*, context: int = 8192, num_kv_heads: int = 1, gqa_group: int = 3,
                        head_dim: int = 64, num_queries: int = 4, kinds=None,
                        page_size: int = 16, rope_base: float = 100000.0,
                        far_pages: int | None = 450, distractors=(8, 16),
                        distractor_scale=(1.05, 1.5), fast_pairs: int = 6,
                        share=(0.85, 0.98), seed: int = 0) -> SharpWorkload:
    """Near-one-hot long-range heads whose target page Quest's upper bound ranks
    high but not first, and whose page centre does not show it (issue 14).

    Keys: a per-head mean with massive channels, topics, a smooth local process
    and noise (as `make_workload`), a sink at token 0, RoPE with `rope_base`
    (SmolLM2's 100000 by default). Per "sharp" query head:
    - a target: a span of 8-14 tokens inside one page whose pre-RoPE key content
      lives in `fast_pairs` of the highest-frequency rotary pairs (4 of them per
      head, chosen per head). The content repeats (a repeated word, a number), so
      after RoPE it turns through most of a circle across the span: the page's
      per-channel range is wide and its centre (what `q.c` reads) is near zero,
      while the bound, which sees the range, is right. The query is aimed at one
      token of the span, rotated (a positional match: a head that attends the
      k-th copy of a repeated token) and solved so that `share` of its exact
      mass lands on that page. With `far_pages`, the first sharp head of each
      group aims at a page that many pages before the last one.
    - distractors: `distractors` (a range) whole pages whose tokens are each
      large in one of the same pairs, in turn and at random angles,
      `distractor_scale` x the target's radius (loose pages: delimiters,
      numbers, code, whose keys spike in a few channels each). Every channel's
      range is then wider than the target's, so the head's bound ranks them
      above its target, but no key is aligned with the query: their exact
      logits are at most a quarter of the aimed-at token's.
    "local" and "diffuse" heads are as in `make_workload` (diffuse: weak topic
    preferences; local: the recent window).
    """
    rng = np.random.default_rng(seed)
    S, H, G, D, pg = context, num_kv_heads, gqa_group, head_dim, page_size
    half = D // 2
    if kinds is None:
        kinds = ["sharp"] * (H * G)
    kinds = list(kinds)
    if len(kinds) == G and H > 1:
        kinds = kinds * H
    if len(kinds) != H * G or any(kd not in SHARP_KINDS for kd in kinds):
        raise ValueError(f"kinds must list {G} or {H * G} entries from {SHARP_KINDS}")
    n_pages = -(-S // pg)
    # Cold pages at the default tiers (sink 1 page, hot 128 + warm 384 tokens):
    # pages 1 .. last - 32. Targets and distractors go there.
    cold_hi = n_pages - 1 - 32
    if cold_hi < 40:
        raise ValueError(f"context {S} is too short for cold targets and distractors")
    log_s = float(np.log(S))
    pos = np.arange(S)
    pair = np.arange(D) % half
    outlier_pool = np.flatnonzero((pair >= half // 2) & (pair < half * 3 // 4))
    bounds = [0]
    while bounds[-1] < S:
        bounds.append(bounds[-1] + int(rng.integers(200, 3000)))
    starts = np.array(bounds[:-1])
    seg = np.searchsorted(np.array(bounds[1:]), pos, side="right")
    n_topics = max(4, len(starts) // 3)
    topic = rng.integers(0, n_topics, size=len(starts))[seg]

    k_raw = np.empty((S, H, D), np.float32)
    v = np.empty((S, H, D), np.float32)
    q = np.zeros((num_queries, H * G, D), np.float32)
    target_pages = np.full((num_queries, H * G), -1, np.int64)
    distractor_pages = [() for _ in range(H * G)]
    key_noise, topic_amp, local_amp = 0.9, 0.6, 1.2
    key_std = float(np.sqrt(key_noise ** 2 + topic_amp ** 2 + local_amp ** 2))
    for h in range(H):
        mean = rng.normal(scale=0.3, size=D).astype(np.float32)
        outl = rng.choice(outlier_pool, size=4, replace=False)
        mean[outl] = rng.choice([-1, 1], size=4) * rng.uniform(6, 12, size=4)
        content = np.ones(D, np.float32)
        content[outlier_pool] = 0.0
        topic_dirs = rng.normal(size=(n_topics, D)).astype(np.float32) * content * topic_amp
        width = float(rng.uniform(16, 64))
        local = _smooth_noise(rng, S, D, width) * local_amp
        k_raw[:, h] = (mean + topic_dirs[topic] + local
                       + rng.normal(size=(S, D)).astype(np.float32) * key_noise)
        k_raw[0, h] += _unit(rng, D, content) * 40.0
        v_mean = rng.normal(scale=0.5, size=D).astype(np.float32)
        v_topic = rng.normal(scale=0.7, size=(n_topics, D)).astype(np.float32)
        v[:, h] = v_mean + v_topic[topic] + rng.normal(size=(S, D)).astype(np.float32)
        v[0, h] = rng.normal(scale=0.2, size=D)

        used = set()

        def free_page(lo, hi, used=used):
            for _ in range(1000):
                p = int(rng.integers(lo, hi + 1))
                if not used & {p - 1, p, p + 1}:
                    used.add(p)
                    return p
            raise ValueError("no free page left for a target or distractor")

        # Per sharp head: its rotary pairs, its targets (one per query, two distinct
        # pages per head) and its distractor pages.
        plans = {}
        for g in range(G):
            hq = h * G + g
            if kinds[hq] != "sharp":
                continue
            pairs = rng.choice(fast_pairs, size=min(4, fast_pairs), replace=False)
            chans = np.concatenate([pairs, pairs + half])
            rho = float(rng.uniform(5.0, 7.0))  # content radius per pair
            tgts = []
            first_far = far_pages is not None and not any(kinds[h * G + x] == "sharp"
                                                          for x in range(g))
            for j in range(2):
                if j == 0 and first_far:
                    p = n_pages - 1 - far_pages
                    if p < 1 or p in used:
                        raise ValueError(f"far_pages={far_pages} does not fit context {S}")
                    used.add(p)
                else:
                    p = free_page(1, cold_hi)
                ln = int(rng.integers(8, 15))
                off = int(rng.integers(0, pg - ln + 1))
                start = p * pg + off
                c = np.zeros(D, np.float32)
                ang = rng.uniform(0, 2 * np.pi, size=len(pairs))
                c[pairs], c[pairs + half] = rho * np.cos(ang), rho * np.sin(ang)
                k_raw[start:start + ln, h] = k_raw[start:start + ln, h] * 0.3 + c
                t0 = start + int(rng.integers(ln // 4, ln - ln // 4))
                tgts.append((p, t0, c))
            dpages = []
            for _ in range(int(rng.integers(distractors[0], distractors[1] + 1))):
                p = free_page(1, cold_hi)
                rows = slice(p * pg, (p + 1) * pg)
                scale = rho * float(rng.uniform(*distractor_scale))
                # Each token is large in one of the pairs (in turn, at a random
                # angle): every channel's range is wide, no key is aligned.
                ang = rng.uniform(0, 2 * np.pi, size=pg)
                which = pairs[(np.arange(pg) + int(rng.integers(len(pairs)))) % len(pairs)]
                blk = k_raw[rows, h]
                blk[:, pairs] *= 0.3
                blk[:, pairs + half] *= 0.3
                blk[np.arange(pg), which] = scale * np.cos(ang)
                blk[np.arange(pg), which + half] = scale * np.sin(ang)
                k_raw[rows, h] = blk
                dpages.append(p)
            distractor_pages[hq] = tuple(sorted(dpages))
            plans[g] = (chans, tgts)

        k_post = rope(k_raw[:, h:h + 1], pos, rope_base)[:, 0]
        sink_key = k_post[0] - k_post[1:].mean(0)
        read = np.ones(D, np.float32)
        read[outl] = 0.05
        local_key = rope(local[None, S - 1:S], np.full(1, S - 1), rope_base)[0, 0] * read
        recent = pos >= S - int(4 * width)
        for g in range(G):
            hq = h * G + g
            kind = kinds[hq]
            for n in range(num_queries):
                qv = _unit(rng, D) * read * (np.sqrt(D) / key_std)
                qv += _aim(sink_key, log_s + rng.uniform(-5.0, -1.0), D)
                if kind == "local":
                    qv = _solve(k_post, qv, local_key, recent, rng.uniform(0.75, 0.99))
                elif kind == "sharp":
                    qv += _aim(local_key, rng.uniform(0.0, 2.0), D)
                    chans, tgts = plans[g]
                    p, t0, c = tgts[n % len(tgts)]
                    aim = np.zeros(D, np.float32)
                    aim[chans] = rope(c[None, None], np.full(1, t0), rope_base)[0, 0][chans]
                    qv = _solve(k_post, qv, aim, (pos >= p * pg) & (pos < (p + 1) * pg),
                                rng.uniform(*share))
                    target_pages[n, hq] = p
                else:  # diffuse
                    qv += _aim(local_key, rng.uniform(0.0, 2.0), D)
                    for sg in rng.choice(len(starts), size=min(3, len(starts)), replace=False):
                        tkey = rope(topic_dirs[topic[starts[sg]]][None, None],
                                    np.full(1, starts[sg]), rope_base)[0, 0]
                        qv += _aim(tkey, rng.uniform(0.5, 2.5), D)
                q[n, hq] = qv
    k = rope(k_raw, pos, rope_base)
    return SharpWorkload(q=q, k=k.astype(np.float32), v=v.astype(np.float32),
                         head_kinds=tuple(kinds), target_pages=target_pages,
                         distractor_pages=tuple(distractor_pages), seed=seed)
