"""Input checks shared by every public entry point (configs, caches, the prefix
index, the scheduler, the planner, the CLI): one definition of "an integer", "a
count", "token ids" and "a working set", so no two entry points disagree.

Integers are Python or numpy integers, never bools (`isinstance(True, int)` is
true in Python, and a bool index silently means something else in numpy).
"""

from __future__ import annotations

import math

import numpy as np


def is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_number(x) -> bool:
    return (isinstance(x, (int, float, np.integer, np.floating))
            and not isinstance(x, (bool, np.bool_)))


def check_int(name: str, x, minimum: int | None = None, maximum: int | None = None) -> int:
    """x as a Python int; ValueError naming `name` unless it is an integer in
    [minimum, maximum]."""
    lo = "" if minimum is None else f" >= {minimum}"
    hi = "" if maximum is None else f" <= {maximum}"
    want = f"an int{lo}{' and' if lo and hi else ''}{hi}"
    if not is_int(x):
        raise ValueError(f"{name} must be {want}, got {x!r} ({type(x).__name__})")
    x = int(x)
    if (minimum is not None and x < minimum) or (maximum is not None and x > maximum):
        raise ValueError(f"{name} must be {want}, got {x}")
    return x


def check_number(name: str, x, minimum: float | None = None, *, above: bool = False) -> float:
    """x as a finite float (>= minimum, or > minimum with above=True)."""
    if not is_number(x) or not math.isfinite(float(x)):
        raise ValueError(f"{name} must be a finite number, got {x!r}")
    x = float(x)
    if minimum is not None and (x <= minimum if above else x < minimum):
        raise ValueError(f"{name} must be {'>' if above else '>='} {minimum}, got {x}")
    return x


def check_token_ids(name: str, tokens, length: int | None = None) -> np.ndarray:
    """Token ids as a 1-D int64 array: an integer array or sequence of ints, each
    >= 0 (floats are refused, not truncated: 0.5 is no token id)."""
    if tokens is None:
        raise ValueError(f"{name} must be token ids (a 1-D integer array), got None")
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a 1-D integer array of token ids: {e}")
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got {int(arr.min())}")
    if length is not None and arr.shape[0] != length:
        raise ValueError(f"{name} has {arr.shape[0]} ids for {length} positions")
    return arr.astype(np.int64)


def check_bool_mask(name: str, mask, length: int) -> np.ndarray:
    """A [length] bool array; ints 0/1 are accepted, anything else is refused
    (np.asarray(['no', 'no'], bool) would be all true)."""
    arr = np.asarray(mask)
    if arr.dtype != np.bool_:
        if not np.issubdtype(arr.dtype, np.integer) or not np.all((arr == 0) | (arr == 1)):
            raise ValueError(f"{name} must be a bool array, got dtype {arr.dtype}")
        arr = arr.astype(bool)
    if arr.shape != (length,):
        raise ValueError(f"{name} must have shape ({length},), got {arr.shape}")
    return arr


def check_working_set(candidate_pages: int, working_set) -> int:
    """Resident cold pages per (sequence, KV head) in offload mode: an int that
    holds one step's candidates. The offload cache and the capacity planner both
    call this, so the planner never sizes a layout the cache refuses."""
    if not is_int(working_set) or working_set < candidate_pages:
        raise ValueError(f"working_set must be an int >= {candidate_pages} (one step's "
                         f"candidate pages per sequence and KV head), got {working_set!r}")
    return int(working_set)
