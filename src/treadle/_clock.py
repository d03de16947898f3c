"""Injectable wall clock.

Actors read trio time only for deadlines; every persisted instant comes from a `Clock`, so a
simulation can make a log byte-identical for the same seed.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from typing import Protocol

import attrs

from treadle._exceptions import UsageError


class Clock(Protocol):
    """A source of UTC wall-clock instants for records."""

    def now_iso(self) -> str:
        """The current UTC instant as ISO-8601 text (``2026-11-30T12:00:00.000000+00:00``)."""
        ...


_DAY_NS = 86_400_000_000_000


@attrs.define(eq=False)
class SystemClock:
    """The real UTC wall clock."""

    _day: int = attrs.field(init=False, default=-1)
    _prefix: str = attrs.field(init=False, default="")

    def now_iso(self) -> str:
        """The current UTC instant, ISO-8601, to the microsecond (``...T12:00:00.000000+00:00``).

        A step writes several records, each stamped: the date is formatted once a day, the
        rest from integers (a third of `datetime.isoformat`'s cost).
        """
        day, rest = divmod(time.time_ns(), _DAY_NS)
        if day != self._day:
            self._day = day
            self._prefix = dt.datetime.fromtimestamp(day * 86_400, dt.UTC).strftime("%Y-%m-%dT")
        seconds, micros = divmod(rest // 1000, 1_000_000)
        hours, seconds = divmod(seconds, 3600)
        minutes, seconds = divmod(seconds, 60)
        return f"{self._prefix}{hours:02d}:{minutes:02d}:{seconds:02d}.{micros:06d}+00:00"


@attrs.define(eq=False)
class FixedStepClock:
    """A deterministic clock for simulations.

    It starts at ``start`` and advances ``step_s`` seconds on every reading.

    Attributes:
        start: the first instant returned (UTC).
        step_s: seconds added after each reading.
    """

    start: dt.datetime = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    step_s: float = 0.001
    _readings: int = attrs.field(init=False, default=0)

    def now_iso(self) -> str:
        """The next instant, ISO-8601."""
        instant = self.start + dt.timedelta(seconds=self._readings * self.step_s)
        self._readings += 1
        return instant.isoformat()


def seconds_out_of_range(value: object, *, above_zero: bool = False) -> str | None:
    """Why ``value`` is not a duration in seconds, or ``None`` when it is one (or ``None``).

    A duration is a finite number >= 0 (> 0 with ``above_zero``). The worker's settings
    (`open_fleet`) and the command line's time options (``treadle worker``, ``treadle
    wait``) share this rule.
    """
    if value is None:
        return None
    bound = "> 0" if above_zero else ">= 0"
    why = f"must be a finite number of seconds {bound}, not {value!r}"
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return why
    return None if (value > 0 if above_zero else value >= 0) else why


def check_seconds(*, above_zero: bool = False, **seconds: float | None) -> None:
    """Refuse a duration setting that is not a finite number >= 0 (> 0 with ``above_zero``).

    ``None`` passes (the settings that take it mean "never"). A NaN or an infinity would
    reach a sleep or a timestamp and fail there, long after the run or worker started; a
    poll interval of 0 or less would poll without pause. `seconds_out_of_range`'s rule.

    Raises:
        UsageError: names the first setting out of range, with its value.
    """
    for name, value in seconds.items():
        why = seconds_out_of_range(value, above_zero=above_zero)
        if why is not None:
            raise UsageError(f"{name} {why}")
