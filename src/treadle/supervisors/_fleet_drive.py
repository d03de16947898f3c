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
from treadle.types import BudgetCaps, RunResult


@attrs.frozen(kw_only=True)
class FleetDrive:
    """One run driven by a fleet worker, as its tools see it.

    Attributes:
        run_id: the run the worker drives.
        store: the fleet's store.
        submit: ``await submit(agent, task, run_id, caps, parent)`` queues a child run
            idempotently, with its budget caps and ``(parent run id, parent intent id)``.
        result: ``await result(run_id, poll_s, output_type, patience_s)`` waits until the
            run finished, whichever worker drives it, and returns its result; ``None`` when
            it did not finish within ``patience_s`` seconds (it looks once at least).
        waiting: ``async with waiting(child_id):`` frees the run's slot while it waits on
            the child run ``child_id`` and takes one again (before new claims) when the
            block ends; a drive of the same worker that finishes the child reserves that
            slot at once.
        park_after_s: seconds a call waits on its queued child before it parks its run
            (``None``: it never parks).
        recheck_s: seconds after which a run parked on children is claimable again even
            if no child woke it.
    """

    run_id: str
    store: RunStore
    submit: Callable[[str, str, str, BudgetCaps, tuple[str, str]], Awaitable[object]]
    result: Callable[[str, float, Any, float], Awaitable[RunResult | None]]
    waiting: Callable[[str], AbstractAsyncContextManager[None]]
    park_after_s: float | None = None
    recheck_s: float = 300.0


current_drive: contextvars.ContextVar[FleetDrive | None] = contextvars.ContextVar(
    "treadle_fleet_drive", default=None
)
"""The fleet drive of the current task's run, or ``None`` outside a fleet (or in a child run
driven inside its parent's call)."""
