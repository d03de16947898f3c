"""Child runs: a tool call that runs another agent and waits for its result.

`agent_tool` turns an `treadle.Agent` into a `treadle.Tool`. Each call starts a **child run** of
that agent on the call's ``task`` argument and returns the child's final answer as the
observation (docs/child-runs.md):

* the child's run id is derived from the parent's action intent id (`child_run_id`), and the
  tool is ``safe`` to replay, so a parent resumed after a crash re-attaches to its child
  (resumes it from its log, or reads its stored result) instead of starting a second one;
* cancelling the parent cancels the child durably: a cancel request goes to the child's control
  stream and its handle, and its log ends ``cancelled``;
* the child draws from the parent's remaining token and time budgets, and the call is bounded
  by those budgets, not by the per-call tool timeout;
* the parent's live event stream carries the child's events, each with the child's run id and
  its own seq; nothing of the child is copied into the parent's log;
* the child's run-started record names its parent, and the parent's action result names the
  child (`treadle show` prints both links);
* under a fleet worker, given the name the fleet serves the child's agent under
  (``fleet_agent``), the child is submitted to the fleet's queue instead, for any worker
  serving it to claim, and the parent frees its slot while it waits (docs/child-runs.md,
  "In a fleet").
"""

from __future__ import annotations

import logging
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from typing import Final

import attrs
import trio

from treadle._clock import SystemClock, check_seconds
from treadle._exceptions import (
    ChildPending,
    ChildRunInterrupted,
    LeaseError,
    RunInterrupted,
    RunLeased,
    SnapshotMismatch,
    StoreError,
    UsageError,
    innermost,
    raised,
)
from treadle.actors import CANCEL_GRACE_S
from treadle.agent import Agent
from treadle.ports import EventSink, RunIndex, RunQueue, RunStore
from treadle.stores import LEASE_TTL_S, EngineStore, check_ttl, driver_owner
from treadle.supervisors._child_links import (
    PARENT_STOPPED,
    cancel_child,
    check_child_of,
    child_outcome,
    child_run_id,
)
from treadle.supervisors._driver import (
    CONTROL_POLL_S,
    DriveOptions,
    RunScope,
    drive_run,
    run_scope,
)
from treadle.supervisors._factories import DEFAULT_ACTORS
from treadle.supervisors._fleet_drive import FleetDrive, current_drive
from treadle.supervisors._handle import RunHandle
from treadle.supervisors._leasing import LeaseHold, leases_of
from treadle.tools import Tool, ToolContext, tool
from treadle.types import (
    ActionOutcome,
    BudgetCaps,
    Event,
    ReplayPolicy,
    RunResult,
)

__all__ = ["CHILD_CANCEL_GRACE_S", "agent_tool", "child_run_id"]

_LOG = logging.getLogger("treadle.children")

_WINDOW_SHARE: Final = 0.75
_GRACE_SHARE: Final = 0.5

CHILD_CANCEL_GRACE_S: Final = _WINDOW_SHARE * CANCEL_GRACE_S
"""Seconds a cancelled child run of a top-level run gets to record its cancel and finish
before its drive is cut (1.5; it then stays unfinished with the cancel in its control stream,
and finishes ``cancelled`` whenever it is next driven). Three quarters of the parent's grace
period for a cancelled call (`treadle.actors.CANCEL_GRACE_S`), so the parent waits for the
child's ending; the child's own calls get half of it, so the child records its cancel in
time even when a call of its own ignores the cancellation. Each level of nesting halves both
(docs/child-runs.md, "Cancellation")."""

_UNHASHED = re.compile(r"(?P<intent>(?P<run>.+)/s[1-9][0-9]*/a[1-9][0-9]*)/child")


def parent_of(run_id: str) -> tuple[str, str] | None:
    """``(parent run id, parent intent id)`` read back from a child's run id, else ``None``.

    Only an unhashed id (``<run>/s<step>/a<n>/child``) names its parent; a fleet worker uses
    it to link a queued child to its parent (docs/child-runs.md, "In a fleet").
    """
    found = _UNHASHED.fullmatch(run_id)
    return (found["run"], found["intent"]) if found else None


def _caps(ctx: ToolContext, now: float) -> BudgetCaps:
    """What the parent has left of its token and time budgets (``now``: trio time).

    A child's budgets are its own, each cut to these (docs/child-runs.md, "Budgets").
    """
    seconds = max(0.0, ctx.deadline - now) if math.isfinite(ctx.deadline) else None
    return BudgetCaps(token_budget=ctx.tokens_left, time_budget_s=seconds)


@attrs.frozen(kw_only=True)
class _Settings:
    agent: Agent
    store: RunStore
    sinks: Sequence[EventSink]
    lease_ttl_s: float
    owner: str | None
    control_poll_s: float | None
    fleet_agent: str | None


def agent_tool(
    agent: Agent,
    *,
    store: RunStore,
    name: str,
    description: str,
    sinks: Sequence[EventSink] = (),
    lease_ttl_s: float = LEASE_TTL_S,
    owner: str | None = None,
    control_poll_s: float | None = CONTROL_POLL_S,
    fleet_agent: str | None = None,
) -> Tool:
    """A tool whose every call runs ``agent`` as a child run and returns its answer.

    The model calls it with one argument, ``task`` (the child run's input text). The call's
    observation is the child's structured output as JSON when its agent has an output type,
    else its final answer (or a line naming how it ended, for a completed task); a child that
    did not succeed gives an ``Error:`` line naming its run id, state and stop reason. Its
    outcome names the child
    (``ActionOutcome.child_run_id``) and carries the child's tokens (``usage``), which count
    in the parent's token budget, and its attempts of unknown usage
    (``unknown_usage_attempts``), added to the parent's. See docs/child-runs.md.

    Args:
        agent: the child's agent definition; its budgets are cut to what the parent has left.
        store: the store the child run is written to (usually the parent's).
        name: the tool name the model sees.
        description: what the model is told the tool does.
        sinks: event sinks of the child runs.
        lease_ttl_s: the child runs' lease TTL (seconds). A parent resumed in a new process
            waits until the lease of the child's dead driver expires, then re-attaches.
        owner: the lease owner id for the child runs (default: a fresh one per call; one of
            a cancel's form is refused: `treadle.stores.driver_owner`).
        control_poll_s: seconds between reads of a child's control stream (and, for a
            child queued in a fleet, between looks at whether it finished).
        fleet_agent: the agent name under which fleet workers serve ``agent``. When the
            parent is driven by a fleet worker on ``store``, the child is submitted to the
            fleet's queue under this name (any worker serving it may claim it) and the
            parent's slot is freed while it waits (docs/child-runs.md, "In a fleet");
            otherwise, and without it, the child is driven inside the call.

    Returns:
        The tool: replay policy ``safe`` (a replay re-attaches to the same child), no per-call
        timeout (bounded by the parent's budgets and cancellation).

    Raises:
        UsageError: ``name`` is not a valid tool name, ``description`` is empty, or
            ``lease_ttl_s`` or ``control_poll_s`` is out of range (``control_poll_s`` is a
            finite number of seconds above 0, or ``None``, as `treadle.run` takes it).
    """
    if not description.strip():
        raise UsageError(f"agent tool {name!r}: the description cannot be empty")
    check_ttl(lease_ttl_s)
    check_seconds(above_zero=True, control_poll_s=control_poll_s)
    driver_owner(owner)  # refused now, not at the first call
    settings = _Settings(
        agent=agent,
        store=store,
        sinks=tuple(sinks),
        lease_ttl_s=lease_ttl_s,
        owner=owner,
        control_poll_s=control_poll_s,
        fleet_agent=fleet_agent,
    )

    async def call(task: str, ctx: ToolContext) -> ActionOutcome:
        """Run the child agent.

        Args:
            task: the task for the agent, in words.
            ctx: the call.
        """
        return await _call(settings, task, ctx)

    declared = tool(name=name, description=description, replay=ReplayPolicy.SAFE)(call)
    return attrs.evolve(declared, timeout_s=math.inf)


async def _call(settings: _Settings, task: str, ctx: ToolContext) -> ActionOutcome:
    run_id = child_run_id(ctx.intent_id)
    drive = current_drive.get()
    if (
        drive is not None
        and settings.fleet_agent is not None
        and _same_database(drive.store, settings.store)
        and drive.run_id == ctx.run_id
    ):
        queued = await _queued(settings, settings.fleet_agent, drive, task, ctx)
        if queued is not None:
            return _answer(run_id, queued, ctx)
    budgets = settings.agent.budgets.capped(_caps(ctx, trio.current_time()))
    child = attrs.evolve(settings.agent, budgets=budgets)
    while True:
        try:
            result = await _attached(settings, child, task, run_id, ctx)
            break
        except Exception as exc:
            leased = raised(exc, RunLeased)
            if leased is None:
                error = innermost(exc)
                if isinstance(error, RunInterrupted | StoreError | LeaseError | SnapshotMismatch):
                    # The child is resumable and the call's outcome unknown: the parent's
                    # drive stops too, and its resume replays the call, which re-attaches.
                    # A child whose definition changed since it started is such a child:
                    # as an error observation, the parent went on and left it unfinished.
                    raise ChildRunInterrupted(run_id, str(error)) from error
                raise error from None
            # The driver of an earlier attempt (a parent process that died) still holds the
            # child's lease: wait until it lapses, then take the child over from its log.
            await trio.sleep(max(0.05, leased.holder.expires_at - time.time()))
    return _answer(run_id, result, ctx)


def _answer(run_id: str, result: RunResult, ctx: ToolContext) -> ActionOutcome:
    """The call's outcome, the child's active seconds reported to the parent's step.

    The child's log records them whoever drove it: a parent resumed after its process died
    during the call (a finished child answers at once) still counts the child's time, as it
    counts its tokens (docs/child-runs.md, "Budgets").
    """
    if ctx.report_active_s is not None:
        ctx.report_active_s(result.totals.active_s)
    return child_outcome(run_id, result)


def _same_database(fleet: RunStore, tool: RunStore) -> bool:
    """Whether the tool's store is the fleet's: the same object, or one on its tables.

    A worker's agent factory cannot be handed the worker's store object (`treadle worker`
    opens it), so it opens its own on the same file or DSN: that one queues children too.
    """
    return fleet is tool or (isinstance(fleet, EngineStore) and fleet.same_database(tool))


async def _attached(
    settings: _Settings, agent: Agent, task: str, run_id: str, ctx: ToolContext
) -> RunResult:
    """Drive (or re-attach to) the child; a cancel of this call cancels it durably."""
    hold = LeaseHold(
        run_id=run_id,
        owner=driver_owner(settings.owner),
        ttl_s=settings.lease_ttl_s,
        store=leases_of(settings.store),
    )
    parent = run_scope.get() or RunScope(SystemClock(), None, None, CANCEL_GRACE_S)
    rng = parent.rng
    options = DriveOptions(
        clock=parent.clock,
        rng=None if rng is None else random.Random(f"{run_id}:{rng.getrandbits(64)}"),
        control_poll_s=settings.control_poll_s,
        actors=DEFAULT_ACTORS,
        park_after_s=None,
        parent=(ctx.run_id, ctx.intent_id),
        metrics=parent.metrics,
        cancel_grace_s=parent.cancel_grace_s * _GRACE_SHARE,
    )
    link = _Link(
        store=settings.store,
        run_id=run_id,
        canceller=ctx.run_id,
        ctx=ctx,
        window_s=parent.cancel_grace_s * _WINDOW_SHARE,
    )
    inline = current_drive.set(None)  # the child's own child-run tools drive theirs inline
    try:
        return await _linked(settings, agent, task, hold, options, link, ctx)
    finally:
        current_drive.reset(inline)


async def _queued(
    settings: _Settings, fleet_agent: str, drive: FleetDrive, task: str, ctx: ToolContext
) -> RunResult | None:
    """Queue the child in the fleet (idempotently) and wait for it with the slot freed.

    ``None`` when the child was started without the queue (an earlier drive of the parent,
    outside a fleet, drove it inside the call): the call then re-attaches to it inline.

    The child is queued with the parent's remaining budgets as its caps and the parent's
    ids. When it has not finished after the worker's ``park_after_s`` and the call may park
    (`treadle.ToolContext.can_park`), the call parks its run instead of waiting on.

    A cancel of the parent run (or its time budget running out) cancels the child durably,
    and the child's ending within the cancel's window is the call's result (`_cancelled`); a
    stop of the parent's drive leaves the child to run on, and the resumed parent's replay
    of the call finds it (docs/child-runs.md, "In a fleet").

    Raises:
        ChildPending: the call parks its run (the child goes on).
    """
    run_id = child_run_id(ctx.intent_id)
    store = settings.store
    poll_s = settings.control_poll_s if settings.control_poll_s is not None else CONTROL_POLL_S
    caps = _caps(ctx, trio.current_time())
    park_after_s = drive.park_after_s if ctx.can_park else None
    try:
        if isinstance(store, RunIndex):
            summary = await store.read_summary(run_id)
            if summary is not None and summary.submitted_at is None:
                return None
        await drive.submit(fleet_agent, task, run_id, caps, (ctx.run_id, ctx.intent_id))
        await _check_queued(store, run_id, ctx)
        patience_s = math.inf if park_after_s is None else park_after_s
        async with drive.waiting(run_id):
            found = await drive.result(run_id, poll_s, settings.agent.output_type, patience_s)
            if found is None:
                raise ChildPending(run_id, drive.recheck_s)
            return found
    except StoreError as exc:
        # The call's outcome is unknown, not an error to show the model: the parent's drive
        # stops (resumable), and its resume replays the call, which finds the child.
        raise ChildRunInterrupted(run_id, str(exc)) from exc
    except trio.Cancelled:
        if not _parent_ended(ctx):
            raise
        ended = await _cancelled(settings, drive, run_id, ctx.run_id, poll_s)
        if ended is None:
            raise
        return ended  # the call's cancel became the child's, which ended in time


async def _cancelled(
    settings: _Settings, drive: FleetDrive, run_id: str, canceller: str, poll_s: float
) -> RunResult | None:
    """Cancel a queued child durably and wait for its ending, within the cancel's window.

    Whichever worker drives the child applies the cancel; the child's result, when it ended
    within `CHILD_CANCEL_GRACE_S`, is the cut call's, so that its tokens count in the
    parent's (docs/child-runs.md, "Budgets"). ``None`` when it did not end in time, or the
    store failed (logged): the call's outcome is then unknown.
    """
    window = trio.current_time() + CHILD_CANCEL_GRACE_S
    with trio.CancelScope(shield=True, deadline=window):
        try:
            await cancel_child(settings.store, run_id, canceller)
            left = window - trio.current_time()
            return await drive.result(run_id, poll_s, settings.agent.output_type, left)
        except (StoreError, UsageError) as exc:
            _LOG.warning("could not read how the cancelled child run %r ended (%s)", run_id, exc)
    return None


async def _check_queued(store: RunStore, run_id: str, ctx: ToolContext) -> None:
    """Refuse a queue entry under the child's id that another parent (or nobody) queued.

    Submitting is idempotent for the same agent and input, so an unrelated run submitted
    under the derived id would otherwise be taken for the child (`check_child_of`).

    Raises:
        UsageError: the entry names another parent, or none.
        StoreError: the read failed.
    """
    entry = await store.read_submission(run_id) if isinstance(store, RunQueue) else None
    if entry is not None:
        found = (entry.parent_run_id, entry.parent_intent_id)
        check_child_of(run_id, found, (ctx.run_id, ctx.intent_id))


def _parent_ended(ctx: ToolContext) -> bool:
    """Whether the parent run itself was cancelled or ran out of time (not just its drive)."""
    asked = ctx.run_cancelled
    return (asked is None or asked()) or trio.current_time() >= ctx.deadline


async def _linked(
    settings: _Settings,
    agent: Agent,
    task: str,
    hold: LeaseHold,
    options: DriveOptions,
    link: _Link,
    ctx: ToolContext,
) -> RunResult:
    """Drive the child under the call's `_Link`; return its result.

    A cancel of the parent run (or its time budget running out) becomes the child's cancel
    (`_Link.watch`); the child's ending within the window is then the call's result, even
    though the call is cancelled, so the parent records what the child did and spent
    (docs/child-runs.md, "Budgets" and "Cancellation").

    Raises:
        trio.Cancelled: the call's cancellation, when the child did not end within the
            window, or when the parent's drive stopped without the run being cancelled.
    """
    result: RunResult | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(link.watch)
        # Shielded: a cancel of this call reaches the child as a cancel (`_Link.watch`), not
        # as a cut of its actors, so the child writes its cancel and finishes.
        try:
            with link.shield:
                async with drive_run(
                    agent,
                    task,
                    store=settings.store,
                    hold=hold,
                    sinks=settings.sinks,
                    options=options,
                ) as handle:
                    await link.attach(handle)
                    async with trio.open_nursery() as inner:
                        if ctx.forward_event is not None:
                            inner.start_soon(_forward, handle, ctx.forward_event)
                        result = await handle.wait()
        finally:
            link.done = True  # the watcher's cancellation from here on is ours, not a cancel
            if link.cancelled and link.handle is None:  # cut while it started
                await link.cancel_unattached()
        nursery.cancel_scope.cancel()
    if result is None:  # the window ended before the child did: the call's cancel goes on
        await trio.lowlevel.checkpoint()
        raise ChildRunInterrupted(link.run_id, "its drive was cut before it ended")
    return result


@attrs.define(eq=False)
class _Link:
    """The parent's side of one child drive: passes a cancel of the call on to the child."""

    store: RunStore
    run_id: str
    canceller: str
    ctx: ToolContext
    window_s: float  # how long the cancelled child gets to finish (`CHILD_CANCEL_GRACE_S`)
    shield: trio.CancelScope = attrs.Factory(lambda: trio.CancelScope(shield=True))
    handle: RunHandle | None = None
    cancelled: bool = False
    done: bool = False

    @trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
    async def watch(self) -> None:
        """Sleep until the call is cancelled (or the child ended); then stop the child.

        A cancel of the parent run, or its time budget running out, cancels the child
        durably, and the call's cancellation is taken as handed on: the call waits (up to
        ``window_s``) for the child's ending, which is its result (`_linked`). The parent's
        drive stopping here (a drain, a lost lease) only cuts the child's drive: both stay
        resumable, and the parent's resume re-attaches.
        """
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            if self.done:
                raise
            if not self._ends_child():
                self.shield.cancel()
                raise
            self.cancelled = True
            self.shield.deadline = trio.current_time() + self.window_s
            await self._cancel()

    def _ends_child(self) -> bool:
        """Whether the parent run itself was cancelled or ran out of time (not just its drive)."""
        return _parent_ended(self.ctx)

    async def attach(self, handle: RunHandle) -> None:
        """The child is driven now; a cancel that came first is passed on at once."""
        self.handle = handle
        if self.cancelled:
            await self._cancel()

    async def cancel_unattached(self) -> None:
        """Append the cancel of a child whose drive was cut while it started.

        The cancel came before the child's handle existed (`attach` passes it on then), and
        the window ended before it did. A run that was started (it has a log) gets its
        cancel all the same, so that its next driver finishes it ``cancelled``. Shielded, as
        in `_cancel`; a failure is logged, not raised (the call is being cancelled already).
        """
        with trio.CancelScope(shield=True):
            try:
                log = await self.store.read_log(self.run_id)
                if log.started is not None and log.finished is None:
                    await cancel_child(self.store, self.run_id, self.canceller)
            except StoreError as exc:
                _LOG.warning("could not cancel the child run %r (%s)", self.run_id, exc)

    async def _cancel(self) -> None:
        """Append the child's cancel to its control stream, then cancel its handle.

        The append is shielded with no deadline: the window (``window_s``) bounds how long
        the child's drive may go on, not the write, which a window shorter than a durable
        write (many levels down) would cut, leaving the child with no cancel for its next
        driver (docs/child-runs.md, "Cancellation").
        """
        handle = self.handle
        if handle is None or handle.result is not None:
            return  # not started yet (`attach` passes it on), or finished already
        with trio.CancelScope(shield=True):
            await cancel_child(self.store, self.run_id, self.canceller)  # durable first
        handle.cancel(PARENT_STOPPED, canceller=self.canceller)


@trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
async def _forward(handle: RunHandle, forward: Callable[[Event], None]) -> None:
    """Hand each of the child's events to the parent's live subscribers."""
    async for event in handle.events():
        forward(event)
