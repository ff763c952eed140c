"""Argument types and the error path shared by every `hisparse` command.

A user error is one line on stderr, `hisparse <command>: error: <what>` naming the
flag and the value, and exit code 2: argparse's own errors (through `Parser`) and
the commands' (`CLIError`, or a ValueError from the library, which names the
field) alike. `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import math


class CLIError(Exception):
    """A bad flag or input file: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): `prog: error: message`."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")


def int_at_least(minimum: int):
    """An argparse type: an int >= minimum."""
    def parse(text: str) -> int:
        n = _int(text)
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {n}")
        return n
    parse.__name__ = f"int >= {minimum}"
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def number(minimum: float | None = None, *, above: bool = False, below: float | None = None):
    """An argparse type: a finite float, >= minimum (> with above), < below."""
    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if minimum is not None and (x <= minimum if above else x < minimum):
            raise argparse.ArgumentTypeError(f"must be {'>' if above else '>='} {minimum}, "
                                             f"got {text}")
        if below is not None and x >= below:
            raise argparse.ArgumentTypeError(f"must be < {below}, got {text}")
        return x
    parse.__name__ = "number"
    return parse


def int_list(minimum: int):
    """An argparse type: comma-separated ints, each >= minimum."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
        if any(x < minimum for x in values):
            raise argparse.ArgumentTypeError(f"every value must be >= {minimum}, got {text!r}")
        return values
    parse.__name__ = "int list"
    return parse


def number_list(minimum: float, *, above: bool = False):
    """An argparse type: comma-separated finite numbers (ints stay ints)."""
    one = number(minimum, above=above)

    def parse(text: str) -> list:
        try:
            values = [one(x) for x in text.split(",")]
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}")
        return [int(x) if x == int(x) and "." not in t else x
                for x, t in zip(values, text.split(","))]
    parse.__name__ = "number list"
    return parse


def choice_list(choices):
    """An argparse type: comma-separated names from `choices`, no repeats."""
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(x.strip() for x in text.split(","))
        bad = [x for x in names if x not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad[0]!r}; choose from "
                                             f"{', '.join(choices)}")
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"a name is repeated in {text!r}")
        return names
    parse.__name__ = "name list"
    return parse


def budget_tokens(text: str) -> int:
    """Cold tokens attended per KV head, or 'all' (config.FULL_BUDGET)."""
    from hisparse_jax.config import FULL_BUDGET
    if text == "all":
        return FULL_BUDGET
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int or 'all', got {text!r}")
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def refuse_interpreted_pallas(implementations) -> None:
    """Off a GPU the Pallas kernels run in interpret mode: for correctness tests,
    far too slow to evaluate or time anything (`bench kernels` refuses it too)."""
    import jax
    if "pallas" in (implementations or ()) and jax.default_backend() != "gpu":
        raise CLIError("--implementation pallas: off a GPU the Pallas kernels run in "
                       "interpret mode (correctness only); use xla or cpu")
