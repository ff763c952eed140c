"""The kernel registry: one place that knows which implementations exist.

Each op with more than one implementation registers each of them once, beside
its code, under a backend name, with what it supports:

    @backends.register("page_scores", "cpu", why_not=backends.cpu_decode_why_not)
    def _page_scores_cpu(qg, view, src): ...

and callers ask for the op:

    name = backends.resolve("page_scores", implementation, cfg=cfg)   # "cpu"
    backends.kernel("page_scores", name)(qg, view, src)

Backends: "xla" is the pure-jnp reference, every op has it, and it runs
everywhere; "pallas" the GPU kernels (pallas_kernels/; interpret mode elsewhere);
"cpu" the C++ kernels behind XLA's FFI (cpu_kernels/). `implementation=None`
picks, per op, the platform's own backend where it takes the shapes ("pallas"
on a GPU, "cpu" on the CPU), the reference otherwise. A named backend that has
no implementation of an op runs the reference for it (Pallas has no ranking
kernel); one that has, but not for these shapes, is refused for `strict` ops
(the decode ops: a caller who asked for the C++ kernels gets them or an error)
and replaced by the reference for the others (the prefill and weight products
use a kernel where it runs).

Nothing outside this module compares backend names: a backend's limits (e.g. the
C++ kernels read a layer of a stacked array in place, since an FFI operand
cannot be a slice) stay inside its own implementations, or are declared here
(`reads_in_place`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

BACKENDS = ("xla", "pallas", "cpu")
IMPLEMENTATIONS = (None, *BACKENDS)  # what callers may pass as `implementation`
REFERENCE = "xla"


@dataclasses.dataclass(frozen=True)
class Implementation:
    op: str
    backend: str
    fn: Callable
    # (**shape) -> None where it runs with these shapes here, else why not
    why_not: Callable[..., str | None]
    # a named backend that cannot run these shapes is an error (else the reference runs)
    strict: bool = True
    # fields of a layer-stacked cache state it reads in place (so a caller that
    # copies a batch's slots out of the stack must leave them there)
    reads_in_place: tuple[str, ...] = ()
    # how a log line names it (or a function that says, e.g. which CPU path runs)
    label: str | Callable[[], str] = ""


_REGISTRY: dict[str, dict[str, Implementation]] = {}


def _runs(**_) -> None:
    return None


def register(op: str, backend: str, *, why_not: Callable[..., str | None] = _runs,
             strict: bool = True, reads_in_place: tuple[str, ...] = (),
             label: str | Callable[[], str] = ""):
    """Decorator: `fn` implements `op` on `backend`. Registering twice is an error."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    def add(fn):
        impls = _REGISTRY.setdefault(op, {})
        if backend in impls:
            raise ValueError(f"{op!r} already has a {backend!r} implementation")
        impls[backend] = Implementation(op, backend, fn, why_not, strict, reads_in_place,
                                        label or backend)
        return fn
    return add


def _check(implementation):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, "
                         f"got {implementation!r}")


def _platform_backend() -> str | None:
    import jax
    return {"gpu": "pallas", "cpu": "cpu"}.get(jax.default_backend())


def lookup(op: str, implementation=None, **shape) -> Implementation:
    """The implementation of `op` that runs for `implementation` (None, or a
    backend name) with these shapes (the op's `why_not` keywords, e.g. cfg=)."""
    _check(implementation)
    impls = _REGISTRY.get(op)
    if not impls or REFERENCE not in impls:
        raise KeyError(f"no op {op!r} with a reference implementation is registered")
    name = implementation or _platform_backend()
    impl = impls.get(name)
    if impl is not None:
        why = impl.why_not(**shape)
        if why is None:
            return impl
        if implementation is not None and impl.strict:
            raise ValueError(f"implementation={name!r} cannot run {op}: {why}; "
                             f"use implementation={REFERENCE!r}")
    return impls[REFERENCE]


def resolve(op: str, implementation=None, **shape) -> str:
    """The backend name `lookup(op, ...)` picks: a static key for `kernel`."""
    return lookup(op, implementation, **shape).backend


def kernel(op: str, backend: str) -> Callable:
    """`op`'s function on `backend` (a name from `resolve`); the reference where
    that backend has none."""
    impls = _REGISTRY[op]
    return impls.get(backend, impls[REFERENCE]).fn


def describe(op: str, backend: str) -> str:
    """How a log line names `op` on `backend`."""
    impls = _REGISTRY[op]
    label = impls.get(backend, impls[REFERENCE]).label
    return label() if callable(label) else label


def reads_in_place(op: str, backend: str) -> tuple[str, ...]:
    impls = _REGISTRY[op]
    return impls.get(backend, impls[REFERENCE]).reads_in_place


def registered() -> dict[str, tuple[str, ...]]:
    """{op: its backends}, for docs and tests."""
    return {op: tuple(impls) for op, impls in sorted(_REGISTRY.items())}


# ---------------------------------------------------------------- what each backend takes

def pallas_why_not(cfg=None, **_) -> str | None:
    """The Pallas decode kernels take every config but head dims they cannot tile."""
    if cfg is None:
        return None
    from pallas_kernels.common import unsupported
    return unsupported(cfg.head_dim)


def cpu_decode_why_not(cfg=None, **_) -> str | None:
    """The C++ decode kernels: the CPU backend, a C++ compiler, and cfg's shapes."""
    import jax

    from cpu_kernels import build
    backend = jax.default_backend()
    if backend != "cpu":
        return f"the CPU kernels run on the CPU backend, not {backend!r}"
    return build.unavailable() or (None if cfg is None else
                                   build.unsupported(cfg.head_dim, cfg.gqa_group))


def cpu_kernel_why_not(build_check: str) -> Callable[..., str | None]:
    """A CPU kernel's check: the CPU backend and `cpu_kernels.build.<build_check>()`
    None (e.g. "causal_unavailable": a CPU with AMX-BF16 tiles or AVX-512)."""
    def why_not(**_) -> str | None:
        import jax

        from cpu_kernels import build
        if jax.default_backend() != "cpu":
            return f"the CPU kernels run on the CPU backend, not {jax.default_backend()!r}"
        return getattr(build, build_check)()
    return why_not


# ---------------------------------------------------------------- the decode ops' backend

DECODE_OPS = ("page_scores", "rank_pages", "sample_tail", "attend_cold", "tier_encoders")


def resolve_implementation(implementation=None, cfg=None) -> str:
    """The backend a cache's decode ops run on, the name the cache, the engine and
    the server report: None -> "pallas" on a GPU where the kernels take cfg's
    shapes (head_dim 96 does not), "cpu" on the CPU where the C++ kernels build
    here and take them, "xla" otherwise. A named backend runs the decode ops it
    implements (the reference the others), so it is the answer if it implements
    any; one that cannot run cfg's shapes raises."""
    _load_decode_ops()
    names = [resolve(op, implementation, cfg=cfg) for op in DECODE_OPS]
    return next((n for n in names if n != REFERENCE), REFERENCE)


def _load_decode_ops():
    # the decode ops register themselves where they are defined
    import hisparse_jax.attention
    import hisparse_jax.cache.state  # noqa: F401
