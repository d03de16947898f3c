"""The system clock's instants: ISO-8601 UTC to the microsecond, also across midnight."""

from __future__ import annotations

import datetime as dt
import re

import pytest

from treadle import _clock
from treadle._clock import SystemClock

ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00")


@pytest.mark.parametrize(
    "instant",
    [
        dt.datetime(2026, 12, 1, 23, 59, 59, 999_999, tzinfo=dt.UTC),
        dt.datetime(2026, 12, 2, 0, 0, 0, 0, tzinfo=dt.UTC),
        dt.datetime(2028, 2, 29, 12, 30, 5, 42, tzinfo=dt.UTC),
        dt.datetime(1970, 1, 1, tzinfo=dt.UTC),
    ],
)
def test_now_iso_is_the_instant_in_iso_8601(monkeypatch, instant):
    ns = (instant - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(microseconds=1) * 1000
    monkeypatch.setattr(_clock.time, "time_ns", lambda: ns + 999)  # nanoseconds are cut
    text = SystemClock().now_iso()
    assert ISO.fullmatch(text)
    assert dt.datetime.fromisoformat(text) == instant


def test_one_clock_follows_the_date_across_midnight(monkeypatch):
    clock = SystemClock()
    before = dt.datetime(2026, 12, 1, 23, 59, 59, tzinfo=dt.UTC)
    for offset_s in (0, 2):  # the second reading is on the next day
        ns = int((before.timestamp() + offset_s) * 1e9)
        monkeypatch.setattr(_clock.time, "time_ns", lambda ns=ns: ns)
        assert dt.datetime.fromisoformat(clock.now_iso()) == before + dt.timedelta(seconds=offset_s)
