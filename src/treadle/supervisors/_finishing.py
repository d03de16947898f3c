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
  finished): a child run wakes its parent, and a run parked on child runs, or that died
  during a child run's call, cancels each child that has not finished and, when nobody
  drives it either, finishes it the same way (docs/child-runs.md, "Cancellation").

A call whose child run has finished gets the child's outcome and tokens rather than
``unknown`` (`ended_children`; docs/child-runs.md, "Budgets").

A queued run (never started) gets a run-started record from its queue entry first.
"""

from __future__ import annotations

import logging
from typing import Final

import attrs
import cattrs
import trio

from treadle._clock import Clock, SystemClock
from treadle._exceptions import RunLeased, StoreError, UsageError
from treadle._state import PendingStep, carried_active_s, closing_records, fold
from treadle._text import repaired
from treadle.approvals import read_control
from treadle.ports import LeaseStore, RunQueue, RunStore
from treadle.stores import LEASE_TTL_S, lease_owner, write_records
from treadle.supervisors._child_links import (
    cancel_started_children,
    ended_children,
    queue_entry,
    wake_parent,
)
from treadle.types import (
    CancelRequested,
    Lease,
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

    As `finish_cancelled_here` (its arguments, and what it raises), without telling whether
    this call finished the run.

    Returns:
        The run's result (its stored one, if it finished meanwhile).
    """
    result, _ = await finish_cancelled_here(
        store, run_id, owner=owner, reason=reason, canceller=canceller, clock=clock
    )
    return result


async def finish_cancelled_here(
    store: RunStore,
    run_id: str,
    *,
    owner: str,
    reason: str = "",
    canceller: str = "",
    clock: Clock | None = None,
) -> tuple[RunResult, bool]:
    """Take the lease of a run nobody drives and finish it as cancelled, unless it finished.

    Under the lease, the run's log tells whether it had finished: then nothing is written,
    and whoever finished it (its driver, which may have applied this very cancel, or another
    canceller) did so before this call took the lease (docs/fleet.md, "Cancelling and
    approving").

    Args:
        store: the run's store (with leases).
        run_id: the run.
        owner: the canceller's lease owner id.
        reason: the cancel reason, when the control stream holds no request.
        canceller: who cancels, likewise.
        clock: wall clock for record timestamps.

    Returns:
        The run's result, and whether this call finished it (``False``: the run had
        finished before, and the result is its stored one).

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
            return RunResult.from_finished(log.finished), False
        records = await _closing_records(store, log, reason, canceller, clock)
        await write_records(store, records, seq=len(log.records) + 1, generation=lease.generation)
        finished = records[-1]
        assert isinstance(finished, RunFinished)
        started = log.started or records[0]
        assert isinstance(started, RunStarted)
        await close_links(store, started, ChildrenLeft.of(fold(log.records).pending), clock=clock)
        return RunResult.from_finished(finished), True
    finally:
        await store.release_lease(lease)


@attrs.frozen
class ChildrenLeft:
    """The child runs a run may leave behind when it finishes.

    Those of the step its log showed in progress before the finish
    (`treadle._state.PendingStep`): parked on child runs, or cut by a crash.

    Attributes:
        intent_ids: that step's action intents without a result, in call order: each may
            have started a child run (`treadle.child_run_id`).
    """

    intent_ids: tuple[str, ...] = ()

    @classmethod
    def of(cls, pending: PendingStep) -> ChildrenLeft:
        """What ``pending`` may leave behind (a copy: the view folds on)."""
        return cls(intent_ids=tuple(intent.intent_id for intent in pending.action_intents))


async def close_links(
    store: RunStore, started: RunStarted, left: ChildrenLeft, *, clock: Clock
) -> None:
    """After a run's run-finished is durable: tell its parent, and end the children it left.

    The one place where a finished run reaches its relatives, whoever finished it (its
    driver, on a fresh drive or a resume, or `finish_cancelled` while nobody drove it):

    * a child run wakes its parent, when the parent is parked on it;
    * a run that finished before it ran its resumed step again (its step parked on child
      runs, or cut by a crash; a cancel found waiting in its control stream, a budget)
      cancels each unfinished child that the step's open intents started or queued, and
      finishes it ``cancelled`` when nobody drives it either (`_finish_child`); a live
      driver (a fleet worker) applies the cancel itself (docs/child-runs.md,
      "Cancellation").

    An intent whose child finished (its call was run again and returned) or that started no
    child is passed over, so this costs a finished drive nothing when its step was not left
    open. Failures are logged, not raised: the run is finished, and a child's cancel, once
    in its control stream, is applied by whoever drives it next.

    Cancellation: a checkpoint; it may wait up to a dead driver's lease TTL for each child
    driven inline (`_finish_child`).

    Args:
        store: the store of the run and its children.
        started: the finished run's run-started record.
        left: what the log showed of the run's step in progress before the finish.
        clock: wall clock for the records of a child finished here.
    """
    await wake_parent(store, started)
    if not left.intent_ids:
        return
    children = await cancel_started_children(store, started.run_id, left.intent_ids)
    for child in children:  # nobody may drive it, or its driver died with the parent's
        await _finish_child(store, child, clock)


async def _finish_child(store: RunStore, run_id: str, clock: Clock) -> None:
    """Finish a child cancelled above when nobody drives it; a live driver applies the cancel.

    Under a fresh lease owner: the finishing process may drive runs of its own (a fleet
    worker), and a child one of them is must be left to that drive. A child whose lease is
    held is driven, or its driver died and the lease has not lapsed yet:

    * a queued child (a fleet's, `queue_entry`) is left to its driver, or to the fleet worker
      that takes it over once the lease lapses, and claims it with the cancel waiting;
    * a child driven inline has nobody to take it over: it is waited for, for as long as the
      lease it was found under could still run (its TTL), and finished here once that lapsed
      unrenewed (docs/child-runs.md, "Cancellation"). A lease renewed or taken over
      meanwhile has a live driver, which applies the cancel.

    A failure is logged, not raised: the cancel is in the child's control stream, so whoever
    drives it next finishes it ``cancelled``.
    """
    if not isinstance(store, LeaseStore):
        return  # no leases to tell who drives it: its cancel stays for its next driver
    try:
        await _finish_unless_driven(store, run_id, clock)
    except (StoreError, UsageError) as exc:
        _LOG.warning("could not finish the cancelled child run %r (%s)", run_id, exc)


async def _finish_unless_driven(store: RunStore, run_id: str, clock: Clock) -> None:
    """`finish_cancelled` on ``run_id``, once the lease found on it lapses (see `_finish_child`).

    Raises:
        StoreError: the store failed.
        UsageError: the run does not exist.
    """
    found = await _finish_or_holder(store, run_id, clock)
    if found is None or await queue_entry(store, run_id) is not None:
        return  # finished; or a fleet worker drives it, or takes it over once the lease lapses
    deadline = trio.current_time() + _ttl_s(found) + _LAPSE_LOOK_S
    while trio.current_time() < deadline:
        await trio.sleep(_LAPSE_LOOK_S)
        holder = await _finish_or_holder(store, run_id, clock)
        if holder != found:
            return  # finished here; or renewed or taken over: a live driver holds it


async def _finish_or_holder(store: RunStore, run_id: str, clock: Clock) -> Lease | None:
    """Finish ``run_id`` cancelled: ``None`` once done, else the lease another owner holds.

    ``None`` also when the run had finished meanwhile (`finish_cancelled` returns its result).

    Raises:
        StoreError: the store failed.
        UsageError: the run does not exist.
    """
    try:
        await finish_cancelled(store, run_id, owner=lease_owner(cancelling=True), clock=clock)
    except RunLeased as exc:
        return exc.holder
    return None


_LAPSE_LOOK_S: Final = 0.25
"""Seconds between looks at the lease of an inline child whose parent finished, until it lapses."""


def _ttl_s(lease: Lease) -> float:
    """The lease's duration in seconds, as its holder last took it (store clock differences)."""
    return max(0.0, lease.expires_at - lease.heartbeat_at)


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
        ended=await ended_children(store, view.pending),
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
        parent_run_id=submission.parent_run_id,
        parent_intent_id=submission.parent_intent_id,
        caps=submission.caps,
    )


def _synthetic(log: RunLog) -> SyntheticObservations:
    stored = log.started.snapshot.get("synthetic") if log.started is not None else None
    try:
        found = _PLAIN.structure(stored, SyntheticObservations) if stored else None
    except Exception:  # a snapshot from another treadle: the default text says the same
        found = None
    return found or SyntheticObservations()
