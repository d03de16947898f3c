"""What a fleet worker tells the runs it drives: enough for a child-run tool to queue its child.

A fleet worker sets `current_drive` (a context variable, inherited by every task the run's
actors start) while it drives a run; `treadle.agent_tool` reads it to submit the child to the
fleet's queue and to free the parent's slot while the parent waits (docs/child-runs.md,
"In a fleet"; docs/decisions/0061-fleet-children-free-their-parents-slots.md).
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import attrs

from treadle.ports import RunStore
from treadle.types import RunResult


@attrs.frozen(kw_only=True)
class FleetDrive:
    """One run driven by a fleet worker, as its tools see it.

    Attributes:
        run_id: the run the worker drives.
        store: the fleet's store.
        submit: ``await submit(agent, task, run_id)`` queues a run idempotently.
        result: ``await result(run_id, poll_s, output_type)`` waits until the run finished,
            whichever worker drives it, and returns its result.
        waiting: ``async with waiting():`` frees the run's slot for the block's duration and
            takes one again (before new claims) when it ends.
    """

    run_id: str
    store: RunStore
    submit: Callable[[str, str, str], Awaitable[object]]
    result: Callable[[str, float, Any], Awaitable[RunResult]]
    waiting: Callable[[], AbstractAsyncContextManager[None]]


current_drive: contextvars.ContextVar[FleetDrive | None] = contextvars.ContextVar(
    "treadle_fleet_drive", default=None
)
"""The fleet drive of the current task's run, or ``None`` outside a fleet (or in a child run
driven inside its parent's call)."""
