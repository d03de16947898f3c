"""The argument types of the benchmark commands: counts, seconds, names from a list, lists.

Each function returns an argparse ``type``. A value it refuses raises
`argparse.ArgumentTypeError`, which argparse prints after the command's usage line, exiting 2
before anything is measured: a count of 0 or less used to hang a command (a
``threading.Barrier(0)``), kill it with a division by zero or a median of nothing, or print a
table of negative figures, and a store kind the command does not know died in a traceback or
was measured as another store and labelled with the name given.

The standard library only: _dbos_peer.py imports this module in a virtualenv without treadle,
and bench_stores_before_after.py's passes run it beside an older treadle.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def at_least(least: int) -> Callable[[str], int]:
    """The type of a count: a whole number >= ``least``.

    The returned function raises `argparse.ArgumentTypeError` for any other text.
    """

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, not {value}")
        return value

    return count


def seconds(least: float = 0.0, most: float = math.inf) -> Callable[[str], float]:
    """The type of a duration: a finite number of seconds from ``least`` to ``most``.

    NaN and the infinities are refused, as the worker's own time options refuse them
    (``treadle._clock.seconds_out_of_range``). The returned function raises
    `argparse.ArgumentTypeError` for any other text.
    """
    bound = f">= {least:g}" if most == math.inf else f"from {least:g} to {most:g}"

    def duration(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and least <= value <= most):
            raise argparse.ArgumentTypeError(
                f"must be a finite number of seconds {bound}, not {text!r}"
            )
        return value

    return duration


def one_of(*choices: str, what: str) -> Callable[[str], str]:
    """The type of a name among ``choices`` (``what`` names the kind of thing, in errors).

    The returned function raises `argparse.ArgumentTypeError` for any other text.
    """

    def name(text: str) -> str:
        if text not in choices:
            known = ", ".join(choices)
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r} (known: {known})")
        return text

    return name


def listed(item: Callable[[str], T]) -> Callable[[str], tuple[T, ...]]:
    """The type of a comma-separated list of ``item``s: a tuple of them, in the order given.

    Spaces around an item are ignored; an empty item is given to ``item`` as ``""`` (which
    each type above refuses). The returned function raises what ``item`` raises.
    """

    def items(text: str) -> tuple[T, ...]:
        return tuple(item(part.strip()) for part in text.split(","))

    return items
