"""Finishing a run that nobody drives as cancelled, without its agent definition.

``treadle cancel`` on a run that no live driver holds (docs/fleet.md, "Cancelling and
approving"): the canceller takes the run's lease itself and writes what a driver would have
written, so that a run whose agent no worker serves never waits in ``cancelling`` forever:

* a model call whose outcome is unknown is recorded as abandoned (as resume would);
* every action intent without a result gets its ``unknown`` result, with the synthetic
  observation of the run's parameter snapshot, and its step record: no intent is left without
  an outcome;
* the cancel request (from the control stream) and the run-finished record (``cancelled``);
* then, as a driver would (`close_links`, which a run's driver calls too once the run is
  finished): a child run wakes its parent, and a run parked on child runs cancels each child
  that has not finished (docs/child-runs.md, "In a fleet"); a run that died during a child
  run's call cancels that child and, when nobody drives it either, finishes it the same way.

A queued run (never started) gets a run-started record from its queue entry first.
"""

from __future__ import annotations

import logging

import attrs
import cattrs

from treadle._clock import Clock, SystemClock
from treadle._exceptions import RunLeased, StoreError, UsageError
from treadle._state import PendingStep, carried_active_s, closing_records, fold
from treadle._text import repaired
from treadle.approvals import read_control
from treadle.ports import LeaseStore, RunQueue, RunStore
from treadle.stores import LEASE_TTL_S, lease_owner, write_records
from treadle.supervisors._child_links import (
    cancel_awaited_children,
    cancel_started_children,
    ended_children,
    wake_parent,
)
from treadle.types import (
    CancelRequested,
    ChildrenAwaited,
    Record,
    RunFinished,
    RunLog,
    RunResult,
    RunStarted,
    RunState,
    StopReason,
    SyntheticObservations,
)

_PLAIN = cattrs.Converter()
_LOG = logging.getLogger("treadle.children")


async def finish_cancelled(
    store: RunStore,
    run_id: str,
    *,
    owner: str,
    reason: str = "",
    canceller: str = "",
    clock: Clock | None = None,
) -> RunResult:
    """Take the lease of a run nobody drives and finish it as cancelled.

    Args:
        store: the run's store (with leases).
        run_id: the run.
        owner: the canceller's lease owner id.
        reason: the cancel reason, when the control stream holds no request.
        canceller: who cancels, likewise.
        clock: wall clock for record timestamps.

    Returns:
        The run's result (its stored one, if it finished meanwhile).

    Raises:
        RunLeased: a live driver holds the run (it picks the cancel up itself).
        UsageError: the run does not exist.
        StoreError: the store failed.
    """
    if not isinstance(store, LeaseStore):
        raise TypeError(f"{type(store).__name__} keeps no leases")
    clock = clock or SystemClock()
    lease = await store.acquire_lease(run_id, owner=owner, ttl_s=LEASE_TTL_S)
    try:
        log = await store.read_log(run_id)
        if log.finished is not None:
            return RunResult.from_finished(log.finished)
        records = await _closing_records(store, log, reason, canceller, clock)
        await write_records(store, records, seq=len(log.records) + 1, generation=lease.generation)
        finished = records[-1]
        assert isinstance(finished, RunFinished)
        started = log.started or records[0]
        assert isinstance(started, RunStarted)
        await close_links(store, started, ChildrenLeft.of(fold(log.records).pending), clock=clock)
        return RunResult.from_finished(finished)
    finally:
        await store.release_lease(lease)


@attrs.frozen
class ChildrenLeft:
    """The child runs a run may leave behind when it finishes.

    Those of the step its log showed in progress before the finish
    (`treadle._state.PendingStep`).

    Attributes:
        awaited: the record of that step parking on child runs, or ``None``.
        intent_ids: that step's action intents without a result, in call order: each may
            have started a child run (`treadle.child_run_id`).
    """

    awaited: ChildrenAwaited | None = None
    intent_ids: tuple[str, ...] = ()

    @classmethod
    def of(cls, pending: PendingStep) -> ChildrenLeft:
        """What ``pending`` may leave behind (a copy: the view folds on)."""
        return cls(
            awaited=pending.children_awaited,
            intent_ids=tuple(intent.intent_id for intent in pending.action_intents),
        )


async def close_links(
    store: RunStore, started: RunStarted, left: ChildrenLeft, *, clock: Clock
) -> None:
    """After a run's run-finished is durable: tell its parent, and end the children it left.

    The one place where a finished run reaches its relatives, whoever finished it (its
    driver, on a fresh drive or a resume, or `finish_cancelled` while nobody drove it):

    * a child run wakes its parent, when the parent is parked on it;
    * a run whose step was parked on child runs cancels each of them that has not finished
      (docs/child-runs.md, "In a fleet");
    * a run that finished before it ran its resumed step again (a cancel found waiting in its
      control stream, a budget) cancels each unfinished child that the step's open intents
      started, and finishes it ``cancelled`` when nobody drives it either; a live driver
      (a fleet worker) applies the cancel itself (docs/child-runs.md, "Cancellation").

    An intent whose child finished (its call was run again and returned) or that started no
    child is passed over, so this costs a finished drive nothing when its step was not left
    open. Failures are logged, not raised: the run is finished, and a child's cancel, once
    in its control stream, is applied by whoever drives it next.

    Args:
        store: the store of the run and its children.
        started: the finished run's run-started record.
        left: what the log showed of the run's step in progress before the finish.
        clock: wall clock for the records of a child finished here.
    """
    await wake_parent(store, started)
    if left.awaited is not None:
        await cancel_awaited_children(store, left.awaited)
        return
    if not left.intent_ids:
        return
    children = await cancel_started_children(store, started.run_id, left.intent_ids)
    for child in children:  # its driver died with the parent's: finish it here too
        await _finish_child(store, child, clock)


async def _finish_child(store: RunStore, run_id: str, clock: Clock) -> None:
    """Finish a child cancelled above when nobody drives it; a live driver applies the cancel.

    Under a fresh lease owner: the finishing process may drive runs of its own (a fleet
    worker), and a child one of them is must be left to that drive.

    A failure is logged, not raised: the cancel is in the child's control stream, so whoever
    drives it next finishes it ``cancelled``.
    """
    if not isinstance(store, LeaseStore):
        return  # no leases to tell who drives it: its cancel stays for its next driver
    try:
        await finish_cancelled(store, run_id, owner=lease_owner(), clock=clock)
    except RunLeased:
        pass  # driven (a fleet worker holds it, or its old lease has not expired yet)
    except (StoreError, UsageError) as exc:
        _LOG.warning("could not finish the cancelled child run %r (%s)", run_id, exc)


async def _closing_records(
    store: RunStore, log: RunLog, reason: str, canceller: str, clock: Clock
) -> list[Record]:
    records: list[Record] = []
    if log.started is None:
        records.append(await _started_from_queue(store, log.run_id, clock))
    view = fold((*log.records, *records))
    now = clock.now_iso()
    closing = closing_records(
        log.run_id,
        view.pending,
        _synthetic(log),
        now,
        "the run was cancelled while nobody drove it",
        active_s=carried_active_s(view.pending, now),
        ended=await ended_children(store, view.pending.children_awaited),
    )
    for record in closing:
        view.apply(record)
    records += closing
    requested = [r for r in await read_control(store, log.run_id) if isinstance(r, CancelRequested)]
    first = requested[0] if requested else None
    cancel = repaired(
        CancelRequested(
            run_id=log.run_id,
            ts=clock.now_iso(),
            reason=first.reason if first else reason,
            canceller=first.canceller if first else canceller,
        )
    )
    if view.cancel is None:
        records.append(cancel)
        view.apply(cancel)
    records.append(
        RunFinished(
            run_id=log.run_id,
            ts=clock.now_iso(),
            state=RunState.CANCELLED,
            stop_reason=StopReason.CANCELLED,
            totals=view.totals(),
        )
    )
    return records


async def _started_from_queue(store: RunStore, run_id: str, clock: Clock) -> RunStarted:
    submission = await store.read_submission(run_id) if isinstance(store, RunQueue) else None
    if submission is None:
        raise UsageError(f"there is no run {run_id!r} in this store")
    return RunStarted(
        run_id=run_id,
        ts=clock.now_iso(),
        input=submission.input,
        snapshot={},
        agent=submission.agent,
    )


def _synthetic(log: RunLog) -> SyntheticObservations:
    stored = log.started.snapshot.get("synthetic") if log.started is not None else None
    try:
        found = _PLAIN.structure(stored, SyntheticObservations) if stored else None
    except Exception:  # a snapshot from another treadle: the default text says the same
        found = None
    return found or SyntheticObservations()
