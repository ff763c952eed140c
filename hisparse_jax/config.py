"""Frozen, self-validating configuration of one layer's HiSparse KV cache."""

from __future__ import annotations

import dataclasses
import math

from hisparse_jax.validate import is_int, is_number

FULL_BUDGET = -1  # budget_tokens value meaning "attend every cold page"
RERANK_WEIGHTS = ("share", "mass")


def default_budget_tokens(context: int, page_size: int = 16) -> int:
    """The decode budget servers use when none is given (`hisparse serve`, the vLLM
    bridge): a 16th of the context in whole pages, at least 512 and at most 2,048
    tokens. A fixed 2,048 is a quarter of an 8K context: SmolLM2 served 7.5K
    prompts slower than dense attention with it and faster at 512
    (docs/log/serving.md, "Measured"), and 1/16 is the budget its quality was
    measured at."""
    return min(2048, max(512, context // 16 // page_size * page_size))


@dataclasses.dataclass(frozen=True)
class HiSparseConfig:
    """Shapes and tier sizes of one layer's cache. All sizes are in tokens.

    Tiers by distance from the newest token (DESIGN.md §2.2), at page granularity:
    sink = the first `sink_tokens` (rounded up to whole pages), hot = the newest
    `hot_tokens` (bf16), warm = the next `warm_tokens` (fp8), cold = the rest (int4,
    only `budget_tokens` worth of selected pages attended per KV head).
    """

    num_kv_heads: int = 8
    gqa_group: int = 4  # query heads per KV head
    head_dim: int = 128
    page_size: int = 16
    sink_tokens: int = 16
    hot_tokens: int = 128
    warm_tokens: int = 384  # warm covers 128..512 tokens back by default
    budget_tokens: int = 2048  # cold tokens attended per KV head; FULL_BUDGET = all
    value_group: int = 32  # channels sharing one int4 value scale/zero
    # Share of the candidates picked by Quest's upper bound (catches pages with a
    # few spiking keys: needles); the rest goes to the best page-centre scores
    # (ranks the spread mass of diffuse heads better). docs/log/results.md measures it:
    # 0.75 was best before the re-rank, 0.5 with it.
    bound_share: float = 0.5
    # Peaked bounds (issue 14): when a query head's bound sets pages more than
    # peak_z lower semi-deviations above its mean, the group's candidates start
    # with plain Quest's top pages (the group's maximum bound), peak_pages of them
    # per such page, up to all candidates; the re-rank then chooses. Sharp heads
    # whose page Quest ranks high but the split and the centre miss keep it. 0 =
    # off. docs/log/results.md ("Sharp heads") measures it.
    peak_pages: int = 3
    peak_z: float = 5.0
    # Plain Quest's own top pages lead every group's candidates, quest_lead x the
    # budget's pages of them (at most the re-rank's extra candidates), whatever
    # the peak test says. At rerank_multiple 2 that is Quest's whole set beside
    # the split's picks, so the re-rank's floor (quest_floor_mass) can always hold
    # a sharp head to Quest's mass, in groups without a far page too. 0 = off
    # (the "model" preset turns it on). docs/log/results.md ("Sharp heads") measures it.
    quest_lead: float = 0.0
    # Unselected cold pages sampled per (sequence, KV head) to estimate the
    # attention they would get (importance sampling, weighted by 1/inclusion
    # probability): the mass a 2K-token selection leaves out is estimated instead of
    # dropped. 0 = off. docs/log/results.md measures it.
    tail_sample_pages: int = 32
    # Re-rank: selection names rerank_multiple x the budget's pages as candidates;
    # the decode attention scores their int4 keys and attends the budget's worth
    # with the most group mass (the digest's page-centre estimate ranks pages
    # only roughly). rerank_sample_pages of the rejected candidates are sampled,
    # weighted like the tail sample, so their mass is estimated, not dropped.
    # 1 = off. docs/log/results.md measures it.
    rerank_multiple: float = 1.25
    rerank_sample_pages: int = 8
    # What the re-rank sums over the group: "share" = each query head's share of
    # its candidates' mass (every head votes alike); "mass" = each head's share of
    # its mass on the window and the candidates (a head whose attention sits in
    # the window votes little; the oracle's objective: the mass attended).
    # docs/log/results.md ("Next-token agreement") measures it on real text.
    rerank_weight: str = "share"
    # Sharp heads (issue 14): a query head one of whose candidates holds more than
    # quest_floor_mass of its mass on the window and the candidates keeps, in the
    # re-rank, at least the int4 mass plain Quest's pages among the candidates
    # give it, so heads whose mass sits in the window cannot outvote it for its
    # residual mass. 1 = off. docs/log/results.md ("Sharp heads") measures it.
    quest_floor_mass: float = 0.5
    # A page the previous decode step selected keeps its place unless a new page
    # scores this much higher (nats, added to its log scores): near-ties at the
    # budget's edge stop flickering from step to step, so offload fetches fewer
    # pages, at a recall cost below 0.001. 0 = off. docs/log/scheduler.md measures it.
    sticky_nats: float = 0.5
    max_context: int = 131072  # tokens per sequence
    max_seqs: int = 1
    num_pool_pages: int | None = None  # cold page pool; None = max_seqs full contexts

    def __post_init__(self):
        def need(ok: bool, field: str, why: str):
            if not ok:
                raise ValueError(f"HiSparseConfig.{field}={getattr(self, field)!r}: {why}")

        # numpy numbers become Python ones: the config is a static jit argument and
        # its repr names the cache in messages. Bools are not numbers here.
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if is_int(v):
                object.__setattr__(self, f.name, int(v))
            elif is_number(v):
                object.__setattr__(self, f.name, float(v))
        for f in ("num_kv_heads", "gqa_group", "head_dim", "page_size", "max_context", "max_seqs"):
            v = getattr(self, f)
            need(is_int(v) and v >= 1, f, "must be a positive int")
        for f in ("sink_tokens", "hot_tokens", "warm_tokens"):
            v = getattr(self, f)
            need(is_int(v) and v >= 0, f, "must be a non-negative int")
        p = self.page_size
        need(p & (p - 1) == 0, "page_size", "must be a power of two")
        need(self.head_dim % 2 == 0, "head_dim", "must be even (two int4 codes per byte)")
        need(is_int(self.value_group) and self.value_group >= 1
             and value_group_fits(self.head_dim, self.value_group),
             "value_group", f"must divide head_dim/2={self.head_dim // 2} or be head_dim")
        need(self.hot_tokens >= p and self.hot_tokens % p == 0, "hot_tokens",
             f"must be a positive multiple of page_size={p}")
        need(self.warm_tokens % p == 0, "warm_tokens", f"must be a multiple of page_size={p}")
        need(is_int(self.budget_tokens) and
             (self.budget_tokens == FULL_BUDGET or
              (self.budget_tokens >= 0 and self.budget_tokens % p == 0)),
             "budget_tokens", f"must be a multiple of page_size={p} or FULL_BUDGET (-1)")
        need(self.max_context % p == 0, "max_context", f"must be a multiple of page_size={p}")
        need(is_number(self.bound_share) and 0.0 <= self.bound_share <= 1.0,
             "bound_share", "must be a number in [0, 1]")
        need(is_int(self.peak_pages) and self.peak_pages >= 0,
             "peak_pages", "must be a non-negative int")
        need(is_number(self.peak_z) and math.isfinite(self.peak_z) and self.peak_z > 0,
             "peak_z", "must be a finite number > 0")
        need(is_number(self.quest_lead) and math.isfinite(self.quest_lead)
             and self.quest_lead >= 0, "quest_lead", "must be a finite number >= 0")
        need(is_int(self.tail_sample_pages) and self.tail_sample_pages >= 0,
             "tail_sample_pages", "must be a non-negative int")
        need(is_number(self.rerank_multiple) and math.isfinite(self.rerank_multiple)
             and self.rerank_multiple >= 1, "rerank_multiple", "must be a finite number >= 1")
        need(is_number(self.quest_floor_mass) and 0.0 < self.quest_floor_mass <= 1.0,
             "quest_floor_mass", "must be a number in (0, 1]")
        need(self.rerank_weight in RERANK_WEIGHTS, "rerank_weight",
             f"must be one of {RERANK_WEIGHTS}")
        need(is_int(self.rerank_sample_pages) and self.rerank_sample_pages >= 0,
             "rerank_sample_pages", "must be a non-negative int")
        need(is_number(self.sticky_nats) and math.isfinite(self.sticky_nats)
             and self.sticky_nats >= 0, "sticky_nats", "must be a finite number >= 0")
        if self.num_pool_pages is not None:
            need(is_int(self.num_pool_pages) and self.num_pool_pages >= 1,
                 "num_pool_pages", "must be a positive int or None")

    # Derived sizes (pages). Sink pages are whole pages so tiers never share a page.
    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.gqa_group

    @property
    def sink_pages(self) -> int:
        return math.ceil(self.sink_tokens / self.page_size)

    @property
    def hot_pages(self) -> int:
        return self.hot_tokens // self.page_size

    @property
    def warm_pages(self) -> int:
        return self.warm_tokens // self.page_size

    @property
    def max_pages(self) -> int:
        """Logical pages per sequence (page-table width)."""
        return self.max_context // self.page_size

    @property
    def pool_pages(self) -> int:
        if self.num_pool_pages is not None:
            return self.num_pool_pages
        return self.max_seqs * self._cold_pages

    @property
    def _cold_pages(self) -> int:
        return max(1, self.max_pages - self.sink_pages - self.hot_pages - self.warm_pages)

    @property
    def budget_pages(self) -> int:
        """Cold pages attended per KV head (top-k size)."""
        if self.budget_tokens == FULL_BUDGET:
            return self._cold_pages
        return min(self.budget_tokens // self.page_size, self._cold_pages)

    @property
    def candidate_pages(self) -> int:
        """Cold pages selection names per KV head, re-ranked down to budget_pages by
        their int4 keys inside the decode attention (= budget_pages: no re-rank)."""
        return min(max(self.budget_pages, round(self.budget_pages * self.rerank_multiple)),
                   self._cold_pages)

    @property
    def quest_lead_pages(self) -> int:
        """Plain Quest's top pages that lead every group's candidates: at most the
        re-rank's extra slots, so that the split keeps the budget's worth of its
        own picks (none without a re-rank). On SmolLM2's heads, Quest's 31 pages
        in 39 candidates (1.25x) cost 0.005 of mean recall over all heads."""
        extra = self.candidate_pages - self.budget_pages
        return min(round(self.quest_lead * self.budget_pages), extra)

    @property
    def rerank_samples(self) -> int:
        """Rejected candidates sampled per KV head (none without a re-rank)."""
        return self.rerank_sample_pages if self.candidate_pages > self.budget_pages else 0

    @property
    def sample_pages(self) -> int:
        """Unselected cold pages sampled per KV head (none when every page is
        selected, or when the context is too short to leave any unselected)."""
        if self.budget_tokens == FULL_BUDGET or self._cold_pages <= self.candidate_pages:
            return 0
        return self.tail_sample_pages

    @property
    def sticky(self) -> bool:
        """Whether selection favours the last step's pages (not when all are selected)."""
        return self.sticky_nats > 0 and self.budget_tokens != FULL_BUDGET

    def replace(self, **changes) -> HiSparseConfig:
        return dataclasses.replace(self, **changes)


def value_group_fits(head_dim: int, group: int) -> bool:
    """int4 codes pack channel j with j + head_dim/2, so a value group lies within
    one half of a row, or is the whole row."""
    return group == head_dim or (head_dim // 2) % group == 0


PRESETS: dict[str, HiSparseConfig] = {
    # DESIGN defaults: Llama-3-8B KV shapes, page 16, ~2K-token cold budget.
    "default": HiSparseConfig(),
    "llama3-8b-1m": HiSparseConfig(max_context=1 << 20),
    "page32": HiSparseConfig(page_size=32),
    "page64": HiSparseConfig(page_size=64, sink_tokens=64),
    # Smaller hot window and budget for memory pressure (the scheduler's target).
    "tight": HiSparseConfig(hot_tokens=64, budget_tokens=1024),
    # A real model's decode (`model_preset`: models.Engine, `hisparse serve`, the vLLM
    # bridge; shapes and budget are the model's):
    # real keys make the digest's first stage weak, so 2x candidates, plain
    # Quest's set among them and the sharp-head floor at 0.4. SmolLM2 at 1/16:
    # next-token KL 0.028 -> under 0.02, no captured sharp head more than 0.0053
    # below plain Quest (docs/log/results.md); decode steps about 1.2x longer, which
    # is why the attention-only default stays 1.25x (5x dense at 128K).
    # Its bytes: one value scale/zero per 64 channels and a 64-token bf16 window put
    # a served 7.5K sequence at 3.01x bf16's bytes (2.84x with 32 and 128); next-token
    # KL at 1/16 0.0165 -> 0.0182, top-1 0.938 -> 0.936 (docs/log/serving.md, "KV memory at 7.5K: 3x").
    "model": HiSparseConfig(rerank_multiple=2.0, quest_lead=1.0, quest_floor_mass=0.4,
                            value_group=64, hot_tokens=64),
}


def model_preset(*, num_kv_heads: int, gqa_group: int, head_dim: int, max_context: int,
                 **fields) -> HiSparseConfig:
    """The "model" preset for a model's shapes: what models.Engine, `hisparse serve`
    and the vLLM bridge run. The value group is the longest the head's row allows
    (the row, or a divisor of its half) up to the preset's; the windows and the
    context are whole pages of the page size in `fields` (vLLM's block size, say).
    `fields` win."""
    base = PRESETS["model"]
    page = fields.get("page_size", base.page_size)
    page = page if isinstance(page, int) and page > 0 else 1  # the config says why not
    pages = lambda n: -(-n // page) * page
    shaped = {"num_kv_heads": num_kv_heads, "gqa_group": gqa_group, "head_dim": head_dim,
              "max_context": pages(max_context), "sink_tokens": pages(base.sink_tokens),
              "hot_tokens": pages(base.hot_tokens), "warm_tokens": pages(base.warm_tokens)}
    if isinstance(head_dim, int) and head_dim > 0:
        shaped["value_group"] = max(g for g in range(1, min(base.value_group, head_dim) + 1)
                                    if value_group_fits(head_dim, g))
    return base.replace(**{**shaped, **fields})


def preset(name: str, **overrides) -> HiSparseConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
