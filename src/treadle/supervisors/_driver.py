"""Driving one run: its nursery, its actors, its lease, and parking (docs/crash-safety.md).

`drive_run` starts a new run or resumes an unfinished one (docs/crash-safety.md, "Resume"):
it reads the log, checks the parameter snapshot, folds the log into the coordinator's view,
and starts the event writer, context hydrator, model gateway, tool executor and the
coordinator's control inbox with `nursery.start` before the coordinator runs. Cancelling the
run's nursery cancels all of them. An actor that fails leaves the run `interrupted` with its
error on the handle; the log stays resumable (docs/fleet.md). A run that waits long for an
approval is parked: its actors stop and it resumes from its log once decided
(docs/decisions/0010-parking-waiting-runs.md); in a fleet, a run parked on child runs leaves
its worker (docs/child-runs.md, "In a fleet").
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import random
import secrets
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final

import attrs
import trio

from treadle._clock import Clock
from treadle._exceptions import (
    LeaseError,
    RunInterrupted,
    RunLeased,
    SnapshotMismatch,
    StoreError,
    UsageError,
    one_error,
)
from treadle._state import RunView, fold
from treadle._text import repaired
from treadle.actors import (
    CANCEL_GRACE_S,
    AwaitingChildren,
    CallModel,
    Cancel,
    Chain,
    Control,
    Drain,
    Drained,
    Hydrate,
    KeepDecision,
    MailboxReceiver,
    MailboxSender,
    Parked,
    RunActions,
    SinkFeed,
    WriterClient,
    WriterRequest,
    open_mailbox,
)
from treadle.agent import (
    Agent,
    RunInput,
    check_input,
    input_messages,
    policy_change,
    snapshot_diff,
    tool_names,
)
from treadle.approvals import (
    append_expiry,
    expire_overdue,
    requires_approval,
)
from treadle.metrics import MetricsRecorder
from treadle.ports import ControlStream, EventSink, RunStore
from treadle.redaction import Redaction
from treadle.stores import check_schema
from treadle.supervisors._child_links import (
    cancel_if_parent_finished,
    check_child_of,
    ended_children,
    wake_if_children_ended,
)
from treadle.supervisors._control import ControlInbox, ControlIndex, control_of, shared_index
from treadle.supervisors._factories import (
    ActorContext,
    Actors,
    CoordinatorActor,
    CoordinatorContext,
    WriterContext,
)
from treadle.supervisors._finishing import ChildrenLeft, close_links
from treadle.supervisors._handle import RunHandle
from treadle.supervisors._leasing import LeaseHold, LeaseKeeper, shared_keeper
from treadle.supervisors._parking import Parking
from treadle.supervisors._threads import Lineage
from treadle.types import (
    ActionOutcome,
    ApprovalRequested,
    BudgetCaps,
    CancelRequested,
    ChildrenAwaited,
    DefinitionAccepted,
    RunLog,
    RunResult,
    RunStarted,
    RunState,
    StepRecord,
    StoreOp,
)

WRITER_INBOX = 64
"""Buffered writer requests: non-barrier writes and deltas never wait for the store."""

CONTROL_INBOX = sys.maxsize
"""The coordinator's inbox holds every control message sent (they are few, and a cancel or a
decision is never dropped)."""


PARK_AFTER_S = 5.0
"""Seconds a run waits for an approval with its actors running before it is parked."""


CONTROL_POLL_S = 0.5
"""Seconds between two readings of the control streams' heads by the process driving the runs
of a store: a cancel or an approval decision written by another process is picked up within
about this long (docs/decisions/0095-one-task-for-a-stores-runs.md)."""


_JITTER: Final = random.Random()
"""Retry jitter of the runs given no random source: one unseeded source for all of them
(a `random.Random` holds 2.5 KB of state; jitter needs no source of its own per run)."""


@attrs.frozen
class RunScope:
    """What a run hands down to the child runs started inside its tool calls.

    Attributes:
        clock: the run's clock: a child run takes it, so a simulation's child runs are as
            deterministic as their parents (docs/simulation.md, "Determinism").
        rng: the run's random source (``None``: unseeded); a child draws its own from it.
        metrics: where the run's records are counted; a child's are counted there too
            (docs/metrics.md, "What is counted").
        cancel_grace_s: seconds the run's cancelled tool calls get to finish; a child run
            gets less (docs/child-runs.md, "Cancellation").
    """

    clock: Clock
    rng: random.Random | None
    metrics: MetricsRecorder | None
    cancel_grace_s: float


run_scope: Final[contextvars.ContextVar[RunScope | None]] = contextvars.ContextVar(
    "treadle_run_scope", default=None
)
"""The `RunScope` of the run the current task serves (``None`` outside one).

Set where a run's actors start, so every task of the run (a tool call's included) inherits
it."""


@attrs.frozen(kw_only=True)
class DriveOptions:
    clock: Clock
    rng: random.Random | None
    control_poll_s: float | None
    actors: Actors
    park_after_s: float | None
    keeper: LeaseKeeper | None = None
    agent_name: str | None = None
    parent: tuple[str, str] | None = None  # (run id, intent id) of a child run's parent
    caps: BudgetCaps | None = None  # a queued child run's caps, recorded in run-started
    leave_parked: bool = False
    accept_definition_change: bool = False
    metrics: MetricsRecorder | None = None
    lineage: Lineage | None = None
    cancel_grace_s: float = CANCEL_GRACE_S  # a child run's is less (docs/child-runs.md)


@asynccontextmanager
@trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
async def drive_run(
    agent: Agent,
    input: RunInput | None,
    *,
    store: RunStore,
    hold: LeaseHold,
    sinks: Sequence[EventSink],
    options: DriveOptions,
    wait: bool = False,
    chain: Chain | None = None,
) -> AsyncIterator[RunHandle]:
    """`open_run` on a `LeaseHold` (a fleet passes the lease its claim took).

    With ``wait``, the run is driven in the calling task, and the block is entered once it
    stopped being driven (finished, failed, or parked and left), instead of the run being
    driven in a task of its own while the block runs.

    ``chain`` is the history the run inherits as the caller read it already (the check
    before a new thread run or fork starts, `treadle.actors.read_chain`): its first drive
    here hands it to the hydrator instead of reading those logs again; ``None``, or any
    later drive (after a park), reads them.

    Raises:
        RunLeased: the lease cannot be taken (it is taken unless ``hold`` holds it already).
    """
    if hold.lease is None:
        await hold.acquire()
    try:
        log = await store.read_log(hold.run_id)
    except Exception as exc:
        await hold.release_failed(exc)
        raise
    except BaseException:
        await hold.release_quietly()
        raise
    try:
        _check_started(log, input, options)
    except UsageError:
        await hold.release()
        raise
    handle = RunHandle(run_id=hold.run_id, store=store, clock=options.clock)
    if await _finished_before(log, agent, hold, handle):
        yield handle
        return
    # This frame lasts as long as the run, parked or not: it keeps no reference to the log
    # (a parked run keeps no records in memory; `_supervise` reads the log again to resume).
    if wait:
        supervising = _supervise(agent, input, log, chain, store, sinks, options, handle, hold)
        del log, chain
        await supervising
        yield handle
        return
    # The run's own errors are on the handle; what reaches here came from the caller's
    # block. A single error goes back unwrapped, as the caller raised it.
    async with one_error(), trio.open_nursery() as nursery:
        await nursery.start(
            _supervise, agent, input, log, chain, store, sinks, options, handle, hold
        )
        del log, chain
        yield handle


def _check_started(log: RunLog, input: RunInput | None, options: DriveOptions) -> None:
    """Refuse to drive or report a stored run that is not the one asked for.

    A child run's id names its parent's call: a run under it that names another parent is
    refused (`check_child_of`), finished or not. A finished run is only reported: its thread
    and input must be those asked for (an unfinished one's are checked as it resumes).

    Raises:
        UsageError: it is another run.
    """
    started = log.started
    if started is None:
        return
    if options.parent is not None:
        found = (started.parent_run_id, started.parent_intent_id)
        check_child_of(log.run_id, found, options.parent)
    if log.finished is not None:
        _check_same_run(started, input, options.lineage)


async def _finished_before(log: RunLog, agent: Agent, hold: LeaseHold, handle: RunHandle) -> bool:
    """Whether ``log`` is finished already; if so, let the lease go and report its result.

    A finished run is never driven again (docs/crash-safety.md, "Resume"): not when it was
    finished before `open_run`, nor when another driver finished it while it was parked
    here.
    """
    if log.finished is None:
        return False
    await hold.release_quietly()  # finished: a lease not released only expires
    handle._finished(RunResult.from_finished(log.finished, output_type=agent.output_type))
    return True


@trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
async def _supervise(
    agent: Agent,
    input: RunInput | None,
    log: RunLog,
    chain: Chain | None,
    store: RunStore,
    sinks: Sequence[EventSink],
    options: DriveOptions,
    handle: RunHandle,
    hold: LeaseHold,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Drive the run while holding its lease; while parked, wait with the lease released.

    ``chain`` (the inherited history read already, or ``None``) serves the first drive only.
    """
    run_id = log.run_id
    first: RunLog | None = log
    del log  # a parked run keeps no records in memory
    parking: Parking | None = None
    try:
        async with _keeping(hold, options, sinks, handle) as (nursery, feed):
            while True:
                current, first = first or await store.read_log(run_id), None
                if await _finished_before(current, agent, hold, handle):
                    return  # finished elsewhere while it was parked here
                with hold.driving():
                    stretch = await _drive(
                        agent,
                        input,
                        current,
                        chain,
                        store,
                        feed,
                        options,
                        handle,
                        parking,
                        hold,
                        task_status,
                    )
                del current
                chain = None  # a parked run keeps no records: a later drive reads the chain again
                if stretch is None:  # finished: a failed release is logged, the lease expires
                    await hold.release_quietly()
                    return
                if isinstance(stretch, _ChildWait):  # claimable when a child wakes it
                    await hold.release(control_seen=stretch.control_seen)
                    await wake_if_children_ended(store, stretch.awaited)  # ended before the park
                    return
                parking = stretch
                task_status = trio.TASK_STATUS_IGNORED  # reported when first driven
                await hold.release(control_seen=parking.control_seen)
                if options.leave_parked or handle._draining_requested:
                    await _keep_decision(parking, store)  # for whoever drives it next
                    handle._stopped_driving(left="parked")
                    return
                await _wait_parked(parking, store, run_id, options, nursery)
                await _keep_decision(parking, store)
                if handle._draining_requested:
                    handle._stopped_driving(left="parked")
                    return
                first = await _take_back(hold, store, run_id)
    except BaseException as exc:
        leaves = _leaves(exc)
        stopping = [e for e in leaves if isinstance(e, KeyboardInterrupt | SystemExit)]
        if stopping or all(not isinstance(e, Exception) for e in leaves):
            # Cancelled from outside, or the process is stopping (Ctrl-C, SystemExit): the
            # run stays unfinished, and the interrupt goes on even when an actor failed of it
            # on the way (a task it ended left a closed inbox behind).
            why = (
                type(stopping[0]).__name__ if stopping else "the task driving the run was cancelled"
            )
            handle._failed(RunInterrupted(run_id, why))
            await hold.release_quietly()
            if stopping and stopping[0] is not exc:
                raise stopping[0] from None  # not the errors it caused in the actors it ended
            raise
        error = _interrupted(run_id, exc)
        handle._failed(error)
        if not isinstance(error, LeaseError):
            await hold.release_failed(exc)
        task_status_started_safely(task_status)
    finally:
        handle._ended()


@asynccontextmanager
async def _keeping(
    hold: LeaseHold, options: DriveOptions, sinks: Sequence[EventSink], handle: RunHandle
) -> AsyncIterator[tuple[trio.Nursery, SinkFeed | None]]:
    """The nursery of the run's drive, for as long as the run stays in this process.

    In it, ``hold`` is kept renewed (by the fleet's keeper, or by the one its store's runs
    share), the run's `SinkFeed` feeds ``sinks`` (``None``, and no task, without sinks; a
    sink receives an event once ``handle`` reflects it, as a subscriber does), and the run
    can host the work the runs of its store share (the shared renewal, and the control
    reading while it is parked: `Relay`). One block and one nursery for all three: a parked
    run keeps them while it waits (docs/performance.md, "Memory").

    When the block ends with the run unfinished here, the sinks are told why (a
    ``run_left`` event: `SinkFeed.close`). On an error (the lease lost, a store or actor
    failure) they get their grace before the error ends the nursery; cancelled from outside
    (Ctrl-C, a fleet's drain deadline), they are cut off with it and told so at once, by a
    ``cut_off`` run-left event (`SinkFeed`; docs/events.md, "Sinks and subscribers never
    stall a run").
    """
    async with trio.open_nursery() as nursery:
        stop = _keep(hold, options, nursery)
        feed: SinkFeed | None = None
        left = "interrupted"  # unless the block ends without an error
        try:
            if sinks:
                feed = SinkFeed(sinks=sinks, reflected=handle._reflected)
                await nursery.start(feed.run)
            yield nursery, feed
            left = handle.left or "finished_elsewhere"  # (none is sent when it finished here)
        except Exception:
            if feed is not None:
                await feed.aclose(left=left)
            raise
        finally:
            stop()
            if feed is not None:
                feed.close(left=left)


async def _take_back(hold: LeaseHold, store: RunStore, run_id: str) -> RunLog | None:
    """Take the lease of a parked run back, or see that the run was finished meanwhile.

    While the run was parked its lease was free, and another process may hold it for a
    moment: ``treadle cancel`` finishes a parked run as cancelled that way. So a lease held
    elsewhere is asked for again for a few seconds, as long as the run is unfinished.

    Returns:
        The finished log when the run was finished elsewhere (the caller reports it), else
        ``None``: the lease is held again.

    Raises:
        RunLeased: another driver still holds the lease after the waits (it drives the run).
    """
    for wait_s in _TAKE_BACK_WAITS_S:
        try:
            await hold.acquire()
        except RunLeased:
            log = await store.read_log(run_id)
            if log.finished is not None:
                return log
        else:
            return None
        await trio.sleep(wait_s)
    await hold.acquire()
    return None


_TAKE_BACK_WAITS_S: Final = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
"""The waits between asking again for a parked run's lease held elsewhere (`_take_back`)."""


def _keep(hold: LeaseHold, options: DriveOptions, nursery: trio.Nursery) -> Callable[[], None]:
    """Start keeping ``hold`` renewed; returns the function that stops."""
    if hold.store is None:
        return _nothing_to_stop
    if options.keeper is not None:
        return options.keeper.add(hold)
    shared = shared_keeper(hold.store, hold.ttl_s)  # one renewal for all such runs
    return shared.share(hold, nursery)


def _nothing_to_stop() -> None:
    """What stops keeping a hold without a store's lease."""


async def _keep_decision(parking: Parking, store: RunStore) -> None:
    """Make a decision or cancel handed to the parked run's handle durable before driving again.

    It goes to the run's control stream, so that whoever drives the run next (this process,
    or another that took it over meanwhile, or after a crash) applies it. A decision the
    parked run took already went there before it was taken (`Parking.wait`); one left
    here is for a run left parked (a drain), whose next driver takes the stream's first.
    """
    controls = control_of(store)
    if controls is None:
        return
    if parking.cancel_request is not None and parking.cancelled_here:
        reason, canceller = parking.cancel_request
        await controls.append_control(
            repaired(
                CancelRequested(
                    run_id=parking.request.run_id,
                    ts=parking.clock.now_iso(),
                    reason=reason,
                    canceller=canceller,
                )
            )
        )
        parking.cancelled_here = False
    decided = parking.decision
    if decided is not None and parking.decided_here:
        await controls.append_control(decided)
        parking.decided_here = False


async def _wait_parked(
    parking: Parking, store: RunStore, run_id: str, options: DriveOptions, nursery: trio.Nursery
) -> None:
    """Wait, with the actors stopped, for what ends the parking (reading the control stream).

    At the deadline the expiry is written to the control stream before its last reading, so
    the stream's order says whether a decision written about then counts (`Parking.wait`).
    ``nursery`` can host the store's shared control reading meanwhile (`ControlIndex`).
    """
    controls = control_of(store)
    if controls is None:
        await parking.wait(_nothing, _nothing, None)
        return
    index = _index(controls, options)
    control = ControlInbox(
        store=controls, run_id=run_id, target=parking.apply, index=index, seen=parking.control_seen
    )

    async def expire() -> None:
        await append_expiry(controls, parking.request, parking.clock)
        await control.poll(fresh=True)

    await parking.wait(
        control.poll,
        expire,
        options.control_poll_s,
        grown=functools.partial(index.wait_grown, control, nursery) if index is not None else None,
        read_control=control.read_new,
        keep=control.keep,
    )


async def _nothing() -> None:
    await trio.lowlevel.checkpoint()


@attrs.frozen
class _ChildWait:
    """The drive ended with the run parked on child runs (`AwaitingChildren`).

    Attributes:
        awaited: the durable record of the park.
        control_seen: the control-stream position handled: a later entry (a cancel) makes
            the run claimable.
    """

    awaited: ChildrenAwaited
    control_seen: int


async def _drive(
    agent: Agent,
    input: RunInput | None,
    log: RunLog,
    chain: Chain | None,
    store: RunStore,
    feed: SinkFeed | None,
    options: DriveOptions,
    handle: RunHandle,
    parking: Parking | None,
    hold: LeaseHold,
    task_status: trio.TaskStatus[None],
) -> Parking | _ChildWait | None:
    """One stretch of driving: start the actors on ``log``, run until finished or parked.

    ``chain`` goes to the hydrator (`ActorContext.chain`).

    Returns:
        The parking state when the coordinator parked the run on an approval, a
        `_ChildWait` when it parked on child runs, ``None`` when it finished.
    """
    clock = options.clock
    # inherited by the run's tasks (a child run's tool)
    run_scope.set(RunScope(clock, options.rng, options.metrics, options.cancel_grace_s))
    async with trio.open_nursery() as nursery:
        started, view, resumed, accepted = _prepare(agent, input, log, clock, options, hold.owner)
        if started.caps is not None:  # a queued child: its parent's remainder bounds it
            agent = attrs.evolve(agent, budgets=agent.budgets.capped(started.caps))
        snapshot = accepted.snapshot if accepted is not None else agent.snapshot()
        redaction = Redaction.of_log(log) | Redaction.of_snapshot(snapshot)
        handle._define(snapshot, redaction)
        actors = options.actors
        writer_send, writer_recv = open_mailbox[WriterRequest](WRITER_INBOX)
        writer = actors.writer(
            WriterContext(
                run_id=log.run_id,
                store=store,
                next_seq=view.next_seq,
                generation=hold.generation,
                sinks=feed.sinks if feed is not None else (),
                feed=feed,
                redaction=redaction,
                metrics=options.metrics,
                tools=tool_names(snapshot) if options.metrics is not None else None,
            )
        )
        client = WriterClient(writer_send)
        await nursery.start(writer.run, writer_recv)
        await _open_log(client, view, started, accepted)
        context = ActorContext(
            run_id=log.run_id,
            agent=agent,
            started=started,
            writer=client,
            clock=clock,
            rng=options.rng or _JITTER,
            store=store,
            chain=chain,
            cancel_grace_s=options.cancel_grace_s,
            redaction=redaction,
            digest_keys=options.rng.randbytes if options.rng is not None else secrets.token_bytes,
            generation=hold.generation,
        )
        needs_approval = functools.partial(
            requires_approval, agent.tool_policies, agent.approval_policy
        )
        # Requests reach the coordinator as messages; those of before it runs (a cancel
        # handed to the parked run, a drain, the control stream's backlog) are applied
        # before its first step.
        control_send, control_recv = open_mailbox[Control](CONTROL_INBOX)
        control = _control_inbox(store, log.run_id, control_send, options)
        coordinator = await _start_actors(
            nursery,
            actors,
            context,
            view,
            needs_approval,
            park_after_s=options.park_after_s,
            park_at_deadline=control_of(store) is not None,
            carried_active_s=parking.active_s if parking is not None else 0.0,
            ended_children=await ended_children(store, view.pending),
            on_status=handle._report,
            read_control=control.read_new if control is not None else None,
            keep_decision=control.keep if control is not None else None,
        )
        if parking is not None:
            await _hand_over(parking, view, client)
            if parking.cancel_request is not None:
                reason, canceller = parking.cancel_request
                control_send.send_nowait(Cancel(reason=reason, canceller=canceller))
        handle._driving(
            control_send,
            writer,
            client,
            cancelling=parking is not None and parking.cancel_request is not None,
        )
        if handle._draining_requested:
            control_send.send_nowait(Drain())
        if control is not None:
            await cancel_if_parent_finished(store, started)  # its parent died finishing
            if parking is None:  # a request overdue now expires through the stream, first
                await expire_overdue(control.store, log, clock)
            await control.poll(fresh=True)  # a cancel or decision written while no one drove it
        await nursery.start(coordinator.serve_control, control_recv)
        task_status.started()
        stop_polling = (
            control.index.subscribe(control, nursery)
            if control is not None and control.index is not None
            else None
        )
        parked: Parking | _ChildWait | None = None
        left = ChildrenLeft.of(view.pending)  # the step this drive resumes, if any
        try:
            handle._finished(await coordinator.run(resumed_steps=resumed))
            await close_links(store, started, left, clock=clock)
        except AwaitingChildren as signal:
            handle._stopped_driving(left="parked")
            parked = _child_wait(signal.record, control, _unapplied(control_recv))
        except Drained:
            handle._stopped_driving(left="drained")
            parked = None
        except Parked as signal:
            parked = _parking(signal, clock, control, _unapplied(control_recv))
            handle._stopped_driving(parking=parked)
        finally:
            control_send.close()
            if stop_polling is not None:
                stop_polling()
            coordinator.close_inboxes()
            writer_send.close()
    return parked


def _unapplied(inbox: MailboxReceiver[Control]) -> list[Control]:
    """The control messages sent to a coordinator that stopped before it applied them.

    The coordinator raised `Parked` or `AwaitingChildren` in this task, so its control task
    has not run since: what is still in its inbox (a decision or cancel from the handle, or
    read from the control stream) goes to what waits in its place instead of being lost.
    """
    messages: list[Control] = []
    with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
        while True:
            messages.append(inbox.receive_nowait())
    return messages


def _parking(
    signal: Parked, clock: Clock, control: ControlInbox | None, unapplied: list[Control]
) -> Parking:
    """The parking state of a run parked on ``signal``, given what its coordinator missed."""
    parking = Parking(
        request=signal.request,
        deadline=signal.deadline,
        active_s=signal.active_s,
        clock=clock,
        control_seen=control.seen if control is not None else 0,
    )
    for message in unapplied:
        parking.apply(message)
    return parking


def _child_wait(
    awaited: ChildrenAwaited, control: ControlInbox | None, unapplied: list[Control]
) -> _ChildWait:
    """The wait of a run parked on ``awaited``, given what its coordinator missed.

    A cancel its coordinator missed leaves the run claimable at once (nothing of the control
    stream counts as handled): the next drive reads the stream from its start and applies it.
    """
    if control is None or any(isinstance(m, Cancel) for m in unapplied):
        return _ChildWait(awaited, 0)
    return _ChildWait(awaited, control.seen)


async def _open_log(
    client: WriterClient,
    view: RunView,
    started: RunStarted,
    accepted: DefinitionAccepted | None,
) -> None:
    """Write what opens this drive: run-started for a new run, then an accepted definition.

    The changed definition (``accepted``) is a barrier: it is on record before any step.
    """
    if view.next_seq == 1:
        await client.write(StoreOp.RUN_STARTED, started)
        view.apply(started)
    if accepted is not None:
        await client.barrier(StoreOp.CONTROL, accepted)
        view.apply(accepted)


def _control_inbox(
    store: RunStore, run_id: str, coordinator: MailboxSender[Control], options: DriveOptions
) -> ControlInbox | None:
    """The reader of the run's control stream, handing what it reads to the coordinator."""
    controls = control_of(store)
    if controls is None:
        return None
    return ControlInbox(
        store=controls,
        run_id=run_id,
        target=coordinator.send_nowait,
        index=_index(controls, options),
    )


async def _hand_over(parking: Parking, view: RunView, client: WriterClient) -> None:
    """Record the decision that arrived while the run was parked (a barrier), if any.

    The coordinator then finds the call decided in its view and goes on; an ``expired``
    decision is recorded here too, as the coordinator would have at the deadline.
    """
    decided = parking.decision
    if decided is None or decided.call_id in view.pending.approvals:
        return
    if view.pending.approval_requests.get(decided.call_id) != parking.request:
        return  # the log moved on (another process drove the run): nothing to hand over
    decided = repaired(decided)
    await client.barrier(StoreOp.CONTROL, decided)
    view.apply(decided)


def _index(store: ControlStream, options: DriveOptions) -> ControlIndex | None:
    """The store's shared reading of control heads (see `treadle.supervisors._control`)."""
    if options.control_poll_s is None:
        return None
    return shared_index(store, options.control_poll_s)


def task_status_started_safely(task_status: trio.TaskStatus[None]) -> None:
    """Report start even when the run failed while starting (so `open_run` can yield)."""
    try:
        task_status.started()
    except RuntimeError:  # already started
        pass


def _interrupted(run_id: str, error: BaseException) -> BaseException:
    """The error a run's handle reports for the actor failure ``error``.

    A `StoreError`, `UsageError` or `LeaseError` is reported as it is; any other cause is
    wrapped in a `RunInterrupted` naming it, with it as ``__cause__``.
    """
    cause = _cause(error)
    if isinstance(cause, StoreError | UsageError | LeaseError):
        return cause
    interrupted = RunInterrupted(run_id, f"{type(cause).__name__}: {cause}")
    interrupted.__cause__ = cause
    return interrupted


_FOLLOW_ON: Final = (trio.BrokenResourceError, trio.EndOfChannel, trio.ClosedResourceError)
"""What an actor raises when another one went away: its inbox or reply slot closed."""


def _cause(error: BaseException) -> Exception:
    """The leaf of ``error`` that stopped the run, whichever leaf came first.

    A failed store write ends the event writer, and the other actors then fail on its
    closed inbox or reply slot (`_FOLLOW_ON`): the store's error is the cause. So a
    `StoreError`, `UsageError` or `LeaseError` comes first, then any other error, and a
    closed-channel error only when there is nothing else (docs/design.md, "The stop rules").
    ``error`` has at least one `Exception` leaf.
    """
    real = [e for e in _leaves(error) if isinstance(e, Exception)]
    return min(real, key=_cause_rank)  # the first of the lowest rank


def _cause_rank(leaf: Exception) -> int:
    """0 for the store's or lease's errors, 2 for a follow-on channel error, 1 otherwise."""
    if isinstance(leaf, StoreError | UsageError | LeaseError):
        return 0
    return 2 if isinstance(leaf, _FOLLOW_ON) else 1


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for sub in error.exceptions for leaf in _leaves(sub)]
    return [error]


def _prepare(
    agent: Agent,
    input: RunInput | None,
    log: RunLog,
    clock: Clock,
    options: DriveOptions,
    owner: str,
) -> tuple[RunStarted, RunView, tuple[StepRecord, ...], DefinitionAccepted | None]:
    """Build the run-started record (new run) or check the stored one (resume).

    Returns:
        The run-started record, the folded view, the step records, and the record accepting
        a changed definition to write first (``accept_definition_change``), or ``None``.
    """
    snapshot = agent.snapshot()
    agent_name = options.agent_name
    if log.started is None:
        if log.records:
            raise StoreError(f"run {log.run_id!r}: log does not start with run-started")
        lineage = options.lineage
        if input is None and (lineage is None or lineage.fork_step is None):
            raise UsageError(f"run {log.run_id!r} does not exist; a new run needs an input")
        started = repaired(
            RunStarted(
                run_id=log.run_id,
                ts=clock.now_iso(),
                input=input_messages(input) if input is not None else (),
                snapshot=snapshot,
                agent=agent_name,
                agent_version=agent.version_label,
                parent_run_id=options.parent[0] if options.parent else None,
                parent_intent_id=options.parent[1] if options.parent else None,
                thread=lineage.thread if lineage is not None else None,
                continues=lineage.continues if lineage is not None else None,
                fork_step=lineage.fork_step if lineage is not None else None,
                caps=options.caps,
            )
        )
        return started, RunView(), (), None
    started = log.started
    check_schema(started)
    _check_same_run(started, input, options.lineage)
    accepted = _accepted_change(agent, log, started, clock, options, owner)
    return started, fold(log.records), log.steps, accepted


def _check_same_run(started: RunStarted, input: RunInput | None, lineage: Lineage | None) -> None:
    """Refuse a stored run that is not the one asked for: its lineage, then its input.

    A caller continuing a thread (``lineage.thread``) named the thread's next run itself;
    another input there means another caller continued the thread first, and the message
    says so (`check_input`).

    Raises:
        UsageError: the lineage or the input differs.
    """
    _check_lineage(started, lineage)
    check_input(started, input, thread=lineage.thread if lineage is not None else None)


def _check_lineage(started: RunStarted, lineage: Lineage | None) -> None:
    """Refuse a stored run that is not the fork or thread run a caller asked for.

    Finished or not: a finished run of another lineage is not the result of this fork. The
    caller checked the run's id before (`treadle.supervisors._run`: a run it names that exists
    with another lineage is refused there), so a run found here was started since, by another
    caller, and the message says so.

    Raises:
        UsageError: ``lineage`` is given and the stored run has another one (or none).
    """
    if lineage is not None and Lineage.of(started) != lineage:
        stored = Lineage.of(started)
        raise UsageError(
            f"run {started.run_id!r} exists as "
            f"{stored.describe() if stored else 'a run of its own'}, not as the "
            f"{lineage.describe()} asked for (another caller started it)"
        )


def _accepted_change(
    agent: Agent,
    log: RunLog,
    started: RunStarted,
    clock: Clock,
    options: DriveOptions,
    owner: str,
) -> DefinitionAccepted | None:
    """``None`` when the definition matches the run's; the acceptance record when allowed.

    Raises:
        SnapshotMismatch: it differs and ``accept_definition_change`` was not given.
    """
    stored = started.snapshot
    for record in reversed(log.records):
        if isinstance(record, DefinitionAccepted):
            stored = record.snapshot
            break
    snapshot = agent.snapshot()
    changed = snapshot_diff(stored, snapshot)
    if not changed:
        return None
    if not options.accept_definition_change:
        raise SnapshotMismatch(log.run_id, changed, note=policy_change(stored, snapshot))
    return DefinitionAccepted(
        run_id=log.run_id,
        ts=clock.now_iso(),
        changed=tuple(changed),
        snapshot=snapshot,
        agent_version=agent.version_label,
        accepted_by=owner,
    )


@trio.lowlevel.enable_ki_protection  # Ctrl-C reaches the main task: decision 0097
async def _serving(
    role: str,
    serve: Callable[..., Awaitable[None]],
    inbox: MailboxReceiver[Any],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run an actor over ``inbox``; one that returns while the run still sends to it fails.

    An actor serves until its inbox is closed for sending (the coordinator closes it at the
    run's end). One that returns sooner (a fake that stops serving) would leave the request
    it never took waiting for good: it fails the run instead, naming the actor, and the run
    is left resumable (docs/simulation.md, "Swapping actors"). It counts as started at once:
    requests wait in its inbox until it takes them, so an actor that never reports itself
    ready cannot hold the run's start.

    Raises:
        trio.BrokenResourceError: the actor returned before its inbox was closed.
    """
    with inbox:
        task_status.started()
        await serve(inbox)
        if not inbox.sender_closed:
            raise trio.BrokenResourceError(
                f"the {role} actor returned while the run still needed it (an actor serves "
                "its inbox until the run closes it)"
            )


async def _start_actors(
    nursery: trio.Nursery,
    actors: Actors,
    context: ActorContext,
    view: RunView,
    needs_approval: Callable[[str, Mapping[str, Any]], bool],
    *,
    park_after_s: float | None,
    park_at_deadline: bool,
    carried_active_s: float,
    ended_children: Mapping[str, ActionOutcome],
    on_status: Callable[[RunState, ApprovalRequested | None], None],
    read_control: Callable[[], Awaitable[Sequence[Control]]] | None,
    keep_decision: KeepDecision | None,
) -> CoordinatorActor:
    """Build the hydrator, gateway and executor, start them, and build the coordinator."""
    # 1: every request waits for its reply anyway; the coordinator has one step in flight.
    hydrator_send, hydrator_recv = open_mailbox[Hydrate](1)
    gateway_send, gateway_recv = open_mailbox[CallModel](1)
    executor_send, executor_recv = open_mailbox[RunActions](1)
    hydrator = actors.hydrator(context)
    gateway = actors.gateway(context)
    executor = actors.executor(context)
    await nursery.start(_serving, "context hydrator", hydrator.run, hydrator_recv)
    await nursery.start(_serving, "model gateway", gateway.run, gateway_recv)
    await nursery.start(_serving, "tool executor", executor.run, executor_recv)
    return actors.coordinator(
        CoordinatorContext(
            actor=context,
            view=view,
            needs_approval=needs_approval,
            hydrator=hydrator_send,
            gateway=gateway_send,
            executor=executor_send,
            park_after_s=park_after_s,
            park_at_deadline=park_at_deadline,
            carried_active_s=carried_active_s,
            ended_children=ended_children,
            on_status=on_status,
            read_control=read_control,
            keep_decision=keep_decision,
        )
    )
