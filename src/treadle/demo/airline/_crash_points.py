"""Where a replay's driver process SIGKILLs itself: seeded crash points and the demo's.

Part of `treadle.demo.airline.replay`, which re-exports the public names (docs/demo.md).
"""

from __future__ import annotations

import random
from typing import Literal

import attrs

from treadle.demo.airline._discovery import expected_writes
from treadle.demo.airline.data import (
    Recording,
)
from treadle.demo.airline.tools import WRITE_TOOLS

CrashMode = Literal["none", "random"]


@attrs.frozen(kw_only=True)
class CrashPoint:
    """Where a driver process SIGKILLs itself.

    Attributes:
        write: the store write of that process (1-based) the crash is tied to.
        when: ``after`` that write was acknowledged, or ``before`` it was handed over.
    """

    write: int
    when: Literal["after", "before"] = "after"

    def driver_args(self) -> list[str]:
        """The driver's command-line option for this crash point."""
        flag = "--crash-after-writes" if self.when == "after" else "--crash-before-write"
        return [flag, str(self.write)]

    def describe(self) -> str:
        """E.g. ``right after store write 17``."""
        return f"right {self.when} store write {self.write}"


def crash_point(seed: int, recording: Recording) -> CrashPoint:
    """The crash point of a recording's first driver process, chosen from ``seed``.

    Uniform over the points between the first write and the last one of an uninterrupted
    replay (so the run is always unfinished when killed): after write ``1 .. W-1`` or before
    write ``2 .. W``, ``W`` being `expected_writes`. The random source is
    ``random.Random(f"{seed}-{task_id}-{trial}")``: the same seed gives the same points.
    """
    rng = random.Random(f"{seed}-{recording.task_id}-{recording.trial}")
    total = expected_writes(recording)
    write = rng.randint(1, total - 1)
    if rng.random() < 0.5:
        return CrashPoint(write=write, when="after")
    return CrashPoint(write=write + 1, when="before")


def first_change_step(recording: Recording) -> int | None:
    """The step (1-based) of the recording's first database-changing tool call, if any."""
    for step, message in enumerate(
        (m for m in recording.messages if m.get("role") == "assistant"), start=1
    ):
        names = {(c.get("function") or {}).get("name") for c in message.get("tool_calls") or ()}
        if names & WRITE_TOOLS:
            return step
    return None


def demo_crash_point(recording: Recording) -> CrashPoint:
    """The demo's crash point: after the first database change ran, before its result is logged.

    That is before the step write of the step making the change (write ``4 * step + 1``):
    the airline database has committed the change, the run's log has its intent but not its
    result. Without such a step, the middle of the run.
    """
    step = first_change_step(recording)
    if step is None:
        return CrashPoint(write=expected_writes(recording) // 2, when="after")
    return CrashPoint(write=4 * step + 1, when="before")
