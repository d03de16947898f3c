"""What a child run and its parent tell each other through their store (docs/child-runs.md).

* A parent that stops waiting on a child (it was cancelled, or ran out of time) appends a
  cancel to the child's control stream: whoever drives the child next finishes it.
* A child run that finished wakes its parent when the parent is parked on it
  (`treadle.ports.RunQueue.wake`), so that a fleet worker claims the parent at once.
* A parent that finishes while its log shows its step parked on children cancels each child
  that has not finished: nobody will read their results.
"""

from __future__ import annotations

import logging
from typing import Final

from treadle._clock import SystemClock
from treadle._exceptions import StoreError
from treadle._text import repaired
from treadle.ports import ControlStream, RunIndex, RunQueue, RunStore
from treadle.types import CancelRequested, ChildrenAwaited, Liveness, RunStarted

_LOG = logging.getLogger("treadle.children")

PARENT_STOPPED: Final = "the parent run stopped waiting for it (cancelled, or out of time)"
"""The reason of the cancel a parent appends to its child's control stream."""


async def cancel_child(store: RunStore, run_id: str, canceller: str) -> None:
    """Append a cancel to the child's control stream: whoever drives it next finishes it.

    Raises:
        StoreError: the append failed.
    """
    if isinstance(store, ControlStream):
        await store.append_control(
            repaired(
                CancelRequested(
                    run_id=run_id,
                    ts=SystemClock().now_iso(),
                    reason=PARENT_STOPPED,
                    canceller=canceller,
                )
            )
        )


async def wake_parent(store: RunStore, started: RunStarted) -> None:
    """After a child run's run-finished is durable: make its parent claimable, if parked on it.

    A failure is logged, not raised: the child is finished, and its parent is claimable
    anyway at its recheck instant (`treadle.types.ChildrenAwaited.recheck_ts`).
    """
    parent = started.parent_run_id
    if parent is None or not isinstance(store, RunQueue):
        return
    try:
        await store.wake(parent)
    except StoreError as exc:
        _LOG.warning(
            "child run %r finished but could not wake its parent %r (%s); the parent is "
            "claimable at its recheck instant",
            started.run_id,
            parent,
            exc,
        )


async def cancel_awaited_children(store: RunStore, awaited: ChildrenAwaited) -> None:
    """Cancel each child of ``awaited`` that has not finished (its parent finished without it).

    A failure is logged, not raised: the parent is finished, and each child still ends
    within the budgets its parent's remainder capped (docs/child-runs.md, "Budgets").
    """
    for child in awaited.children:
        try:
            if not await _finished(store, child):
                await cancel_child(store, child, awaited.run_id)
        except StoreError as exc:
            _LOG.warning(
                "run %r finished but could not cancel its child run %r (%s)",
                awaited.run_id,
                child,
                exc,
            )


async def _finished(store: RunStore, run_id: str) -> bool:
    if isinstance(store, RunIndex):
        summary = await store.read_summary(run_id)
        return summary is not None and summary.liveness is Liveness.FINISHED
    return (await store.read_log(run_id)).finished is not None
