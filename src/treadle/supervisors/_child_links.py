"""What a child run and its parent tell each other through their store (docs/child-runs.md).

* A parent that stops waiting on a child (it was cancelled, or ran out of time) appends a
  cancel to the child's control stream: whoever drives the child next finishes it.
* A child run that finished wakes its parent when the parent is parked on it
  (`treadle.ports.RunQueue.wake`), so that a fleet worker claims the parent at once; a parent
  whose park became durable after a child's end (that wake-up found it still driven) wakes
  itself (`wake_if_children_ended`).
* A parent that finishes before it ran again a step its log shows open (parked on children,
  or whose child-run calls were cut) records the outcome of each of those calls whose child
  has finished (`ended_children`) and cancels each child that has not: nobody will read
  their results (`treadle.supervisors._finishing.close_links`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Final

import attrs
import trio

from treadle._clock import SystemClock
from treadle._exceptions import StoreError, UsageError
from treadle._ids import MAX_RUN_ID_CHARS
from treadle._state import PendingStep
from treadle._text import repaired
from treadle.ports import ControlStream, RunIndex, RunQueue, RunStore
from treadle.tools import observation_of
from treadle.types import (
    ActionOutcome,
    ActionStatus,
    CancelRequested,
    ChildrenAwaited,
    Liveness,
    RunResult,
    RunStarted,
    RunState,
    Submission,
    Usage,
)

_LOG = logging.getLogger("treadle.children")

_SUFFIX: Final = "/child"


def child_run_id(intent_id: str) -> str:
    """The run id of the child run that the action intent ``intent_id`` starts.

    ``<intent_id>/child`` (e.g. ``r1/s2/a1/child``); when that is longer than the longest
    allowed run id, ``child-`` and 32 hex digits of its SHA-256 instead. The same intent always
    gives the same id, so a resumed parent finds its child (docs/child-runs.md, "Run ids").
    """
    derived = intent_id + _SUFFIX
    if len(derived) <= MAX_RUN_ID_CHARS:
        return derived
    return "child-" + hashlib.sha256(derived.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def check_child_of(
    run_id: str, found: tuple[str | None, str | None], call: tuple[str, str]
) -> None:
    """Refuse a run found under a child run's derived id that is not that call's child.

    A child-run call re-attaches to the run its derived id names (docs/child-runs.md, "Run
    ids"); a run that exists under that id but names another parent, or none (started on its
    own, or submitted to a fleet, under that id), is an unrelated run: its result is not the
    call's, and driving it on would make its effects in the call's name.

    Args:
        run_id: the run found.
        found: ``(parent run id, parent intent id)`` its run-started record or queue entry
            names (``None`` each when it names none).
        call: ``(run id, intent id)`` of the calling parent.

    Raises:
        UsageError: ``found`` is not ``call``.
    """
    if found == call:
        return
    parent_run, parent_intent = found
    whose = (
        f"it was started by call {parent_intent} of run {parent_run}"
        if parent_intent is not None
        else "it names no parent"
    )
    raise UsageError(
        f"run {run_id!r} is not the child run of call {call[1]} ({whose}): an unrelated run "
        "already has the id this call's child run derives from its intent id; it was left as "
        "it is"
    )


PARENT_STOPPED: Final = "the parent run stopped waiting for it (cancelled, or out of time)"
"""The reason of the cancel a parent appends to its child's control stream."""


PARENT_FINISHED: Final = "its parent run finished without its result"
"""The reason of the cancel a child run finds it needs when its parent finished first."""


async def cancel_child(
    store: RunStore, run_id: str, canceller: str, *, reason: str = PARENT_STOPPED
) -> None:
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
                    reason=reason,
                    canceller=canceller,
                )
            )
        )


async def cancel_if_parent_finished(store: RunStore, started: RunStarted) -> None:
    """Before a child run's drive runs a step: cancel it if its parent has finished.

    A parent that finishes cancels the children it leaves (`cancel_started_children`) after
    its run-finished is durable; a process that dies between the two leaves a child with no
    cancel, whose result nobody will read. Its next driver finds the parent finished here and
    appends the cancel the parent would have (docs/child-runs.md, "Cancellation"), which the
    drive applies before its first step. A run that names no parent, or a store with no
    control stream, is left as it is.

    Raises:
        StoreError: the parent's state could not be read, or the append failed.
    """
    parent = started.parent_run_id
    if parent is None or not isinstance(store, ControlStream):
        return
    if await run_finished(store, parent):
        await cancel_child(store, started.run_id, parent, reason=PARENT_FINISHED)


WAKE_ATTEMPTS: Final = 3
"""How many times in all a wake-up the store failed (a lost connection) is tried."""

WAKE_RETRY_S: Final = 0.5
"""Seconds before a failed wake-up is tried again, doubled at each further try (the store's
connection pool replaces a broken connection meanwhile)."""


async def wake_parent(store: RunStore, started: RunStarted) -> None:
    """After a child run's run-finished is durable: make its parent claimable, if parked on it.

    A parent still driven is left as it is: its driver looks at its children once its park is
    durable (`wake_if_children_ended`). A store failure is tried again (`WAKE_ATTEMPTS`); the
    last one is logged, not raised: the child is finished, and its parent is claimable anyway
    at its recheck instant (`treadle.types.ChildrenAwaited.recheck_ts`).
    """
    parent = started.parent_run_id
    if parent is None or not isinstance(store, RunQueue):
        return
    queue = store
    await _waking(
        lambda: queue.wake(parent),
        f"child run {started.run_id!r} finished but could not wake its parent {parent!r}",
    )


async def wake_if_children_ended(store: RunStore, awaited: ChildrenAwaited) -> None:
    """After the park ``awaited`` is durable: wake its run now if one of its children finished.

    A child that finished while the parent's step still ran (its call had given up waiting,
    the step's other calls had not ended) woke a run that was not parked yet, which changed
    nothing. Its end is durable before its wake-up, and this look comes after the park is
    durable, so each child's end is seen by one of the two: by the child's wake-up, which
    then finds the run parked, or by this look (docs/child-runs.md, "Parking while the child
    works"). Store failures are handled as in `wake_parent`.
    """
    if not isinstance(store, RunQueue):
        return
    queue = store

    async def look() -> None:
        for child in awaited.children:
            if await run_finished(store, child):
                await queue.wake(awaited.run_id)
                return

    await _waking(
        look,
        f"run {awaited.run_id!r} parked on child runs but could not look whether one finished",
    )


async def _waking(wake: Callable[[], Awaitable[object]], failed: str) -> None:
    """``await wake()``; a `StoreError` tries it again, `WAKE_ATTEMPTS` times in all.

    The last failure is logged with ``failed`` (what could not be done), not raised: the
    parked run is claimable at its recheck instant anyway.
    """
    for attempt in range(1, WAKE_ATTEMPTS + 1):
        try:
            await wake()
        except StoreError as exc:
            if attempt == WAKE_ATTEMPTS:
                _LOG.warning("%s (%s); it is claimable at its recheck instant", failed, exc)
                return
        else:
            return
        await trio.sleep(WAKE_RETRY_S * 2 ** (attempt - 1))


async def cancel_started_children(
    store: RunStore, parent: str, intent_ids: Iterable[str]
) -> list[str]:
    """Cancel the unfinished child runs that the action intents ``intent_ids`` started.

    For a parent finished without the results of those intents: its step parked on their
    children, or its process died during the calls, and the parent was finished before it ran
    them again (by `treadle.finish_cancelled` while nobody drove it, or by its next driver). A
    child run id is derived from its intent (`child_run_id`), so each intent's child, if one
    was started (its run-started names the intent) or queued (its queue entry does), gets a
    cancel in its control stream. An intent of an ordinary tool has no such run, and one whose
    child finished has nothing to cancel: both are passed over. Returns the child run ids
    cancelled.

    A failure is logged, not raised: the parent is finished, and each child still ends
    within the budgets its parent's remainder capped (docs/child-runs.md, "Budgets").
    """
    cancelled = []
    for intent_id in intent_ids:
        child = child_run_id(intent_id)
        try:
            if await _started_by(store, child, (parent, intent_id)):
                await cancel_child(store, child, parent)
                cancelled.append(child)
        except StoreError as exc:
            _LOG.warning(
                "run %r finished but could not cancel its child run %r (%s)", parent, child, exc
            )
    return cancelled


async def _started_by(store: RunStore, run_id: str, call: tuple[str, str]) -> bool:
    """Whether ``run_id`` is an unfinished child run of ``call`` (parent run, intent ids)."""
    if isinstance(store, RunIndex):
        summary = await store.read_summary(run_id)
        if summary is None or summary.liveness is Liveness.FINISHED:
            return False
    log = await store.read_log(run_id)
    if log.finished is not None:
        return False
    if log.started is None:  # queued by a fleet worker, not yet claimed
        entry = await queue_entry(store, run_id)
        return entry is not None and (entry.parent_run_id, entry.parent_intent_id) == call
    return (log.started.parent_run_id, log.started.parent_intent_id) == call


async def queue_entry(store: RunStore, run_id: str) -> Submission | None:
    """The queue entry of ``run_id``, or ``None``: never queued (a child driven inline).

    A queued run (a child with the tool's ``fleet_agent``) is claimed, or taken over once its
    driver's lease lapses, by any fleet worker serving its agent; a run never queued only by
    whoever drives it on (docs/child-runs.md, "In a fleet").

    Raises:
        StoreError: the queue could not be read.
    """
    return await store.read_submission(run_id) if isinstance(store, RunQueue) else None


async def run_finished(store: RunStore, run_id: str) -> bool:
    """Whether ``run_id`` has its run-finished record (its index row says so, when it has one).

    ``False`` for a run the store does not hold. Raises `StoreError` when it cannot be read.
    """
    if isinstance(store, RunIndex):
        summary = await store.read_summary(run_id)
        return summary is not None and summary.liveness is Liveness.FINISHED
    return (await store.read_log(run_id)).finished is not None


async def ended_children(store: RunStore, pending: PendingStep) -> dict[str, ActionOutcome]:
    """The outcomes of a pending step's open calls whose child runs have finished, by intent id.

    For a parent that finishes before it runs its resumed step again (a cancel, a budget): a
    call whose child ended is given the child's outcome, its tokens with it, instead of an
    ``unknown`` one (docs/child-runs.md, "Budgets"). Every open action intent of the step is
    looked up by the child run id it derives (`child_run_id`), not only the calls the step
    parked on (`treadle.types.ChildrenAwaited`): a step that parks keeps no result of its
    calls that had returned by then (their children finished), and its resume would find them
    by that id too. An intent of an ordinary tool has no such run; a run under the derived id
    that is not the call's child (`check_child_of`) is not taken for it. A child still
    working is left out: the parent cancels it after its own finish, and what it spends is
    not the parent's.

    One look at each open intent's child (its index row first, when the store keeps one):
    the driver resuming a run and `treadle.finish_cancelled` share it.

    Args:
        store: the store of the run and its children.
        pending: the step the run's log shows in progress (`treadle._state.RunView.pending`).

    Raises:
        StoreError: a child's log or index row could not be read.
    """
    ended = {}
    for intent in pending.action_intents:
        child = child_run_id(intent.intent_id)
        result = await _child_result(store, child, (intent.run_id, intent.intent_id))
        if result is not None:
            ended[intent.intent_id] = child_outcome(child, result)
    return ended


async def _child_result(store: RunStore, run_id: str, call: tuple[str, str]) -> RunResult | None:
    """The result of ``run_id`` when it is the finished child run of ``call``, else ``None``.

    ``call`` is ``(parent run id, parent intent id)``.
    """
    if isinstance(store, RunIndex):
        summary = await store.read_summary(run_id)
        if summary is None or summary.liveness is not Liveness.FINISHED:
            return None
    log = await store.read_log(run_id)
    if log.finished is None or log.started is None:
        return None
    if (log.started.parent_run_id, log.started.parent_intent_id) != call:
        return None
    return RunResult.from_finished(log.finished)


def child_outcome(run_id: str, result: RunResult) -> ActionOutcome:
    """The outcome of a child-run call whose child ``run_id`` ended with ``result``.

    Its observation is the child's answer (its structured output as JSON), or an ``Error:``
    line naming how it ended; its usage is the child's totals (its known token counts, and
    its attempts whose usage was not reported), counted in the parent's (docs/child-runs.md,
    "Budgets").
    """
    totals = result.totals
    usage = None
    if totals.input_tokens is not None or totals.output_tokens is not None:
        usage = Usage(input_tokens=totals.input_tokens, output_tokens=totals.output_tokens)
    if totals.other_tokens is not None:  # a total beyond the parts: counted in full
        parts = (totals.input_tokens or 0) + (totals.output_tokens or 0)
        usage = attrs.evolve(usage or Usage(), total_tokens=parts + totals.other_tokens)
    if result.state is RunState.SUCCEEDED:
        if result.output is not None:  # a structured output: as JSON
            observation = observation_of(result.output)
        elif result.final_answer is not None:
            observation = result.final_answer
        else:
            observation = f"the child run {run_id} ended: {result.stop_reason.value}"
    else:
        error = f": {result.error}" if result.error else ""
        observation = (
            f"Error: the child run {run_id} ended {result.state.value} "
            f"({result.stop_reason.value}){error}"
        )
    return ActionOutcome(
        status=ActionStatus.EXECUTED,
        observation=observation,
        child_run_id=run_id,
        usage=usage,
        unknown_usage_attempts=totals.unknown_usage_attempts,
    )
