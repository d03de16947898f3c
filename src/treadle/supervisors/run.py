"""The run supervisor: one run's nursery, its five actors, and the handle callers hold.

`open_run` starts a new run or resumes an unfinished one (docs/crash-safety.md, "Resume"): it reads
the log, checks
the parameter snapshot, folds the log into the coordinator's view, and starts the event writer,
context hydrator, model gateway and tool executor with `nursery.start` before the coordinator
runs. Cancelling the run's nursery cancels all five. An actor that fails leaves the run
`interrupted` with its error on the handle; the log stays resumable (docs/fleet.md). A run that
waits long for an approval is parked: its actors stop and it resumes from its log once
decided (docs/decisions/0010-parking-waiting-runs.md).

The five actors are built by the factories of an `Actors` record, each defaulting to the real
actor; a caller replaces any one of them (a simulated gateway, a fake environment) without
touching the others (docs/decisions/0009-actor-factories.md). Each role has a `Protocol`
(`WriterActor`, `HydratorActor`, `GatewayActor`, `ExecutorActor`, `CoordinatorActor`), so a
fake is type-checked against what the supervisor and the other actors use.
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

import attrs
import trio

from treadle._budget import DEFAULT_SUMMARY_PROMPT
from treadle._clock import Clock, SystemClock
from treadle._exceptions import LeaseError, RunInterrupted, SnapshotMismatch, StoreError, UsageError
from treadle._ids import check_run_id, new_run_id
from treadle._state import RunView, fold
from treadle._text import repaired, valid_unicode
from treadle._trio_only import require_trio
from treadle.actors import (
    AwaitingChildren,
    CallModel,
    ContextHydrator,
    Drained,
    EventWriter,
    Hydrate,
    MailboxReceiver,
    MailboxSender,
    ModelGateway,
    Parked,
    RunActions,
    RunCoordinator,
    SinkFeed,
    ToolExecutor,
    WriterClient,
    WriterRequest,
    WriterStatistics,
    open_mailbox,
    recorded_history,
    stored_events,
    with_step_started,
)
from treadle.agent import Agent, RunInput, input_messages, snapshot_diff
from treadle.approvals import ApprovalPolicy, check_edit, requires_approval, tool_schema
from treadle.metrics import MetricsRecorder
from treadle.ports import ControlStream, EventSink, RunStore
from treadle.redaction import NO_REDACTION, Redaction
from treadle.stores._codec import check_schema
from treadle.stores._leases import LEASE_TTL_S, lease_owner
from treadle.supervisors._child_links import cancel_awaited_children, wake_parent
from treadle.supervisors._control import ControlInbox, ControlIndex, control_of, shared_index
from treadle.supervisors._leasing import LeaseHold, LeaseKeeper, leases_of, shared_keeper
from treadle.supervisors._parking import Parking
from treadle.supervisors.threads import Lineage, fork_lineage, next_in_thread, run_in_thread
from treadle.types import (
    ApprovalDecided,
    ApprovalRequested,
    BudgetCaps,
    CancelRequested,
    DefinitionAccepted,
    Event,
    EventKind,
    JSONValue,
    RunLog,
    RunResult,
    RunStarted,
    RunState,
    StepRecord,
    StoreOp,
)

WRITER_INBOX = 64
"""Buffered writer requests: non-barrier writes and deltas never wait for the store."""

PARK_AFTER_S = 5.0
"""Seconds a run waits for an approval with its actors running before it is parked."""

CONTROL_POLL_S = 0.5
"""Seconds between two reads of a run's control log by the process driving it: a cancel or
an approval decision written by another process is picked up within about twice this long
(the listing of which control logs exist is shared and may be one interval old)."""


RequestT_contra = TypeVar("RequestT_contra", contravariant=True)


class InboxActor(Protocol[RequestT_contra]):
    """An actor that serves requests of one type from its inbox (every role but the coordinator)."""

    async def run(
        self,
        inbox: MailboxReceiver[RequestT_contra],
        *,
        task_status: trio.TaskStatus[None] = ...,
    ) -> None:
        """Serve ``inbox`` until it ends; call ``task_status.started()`` once ready."""
        ...


class WriterActor(InboxActor[WriterRequest], Protocol):
    """The event writer role: the run's single writer to the store (docs/concepts.md, "Actors").

    It serves `treadle.actors.WriterRequest` messages (appends, barriers, deltas,
    subscriptions) from its inbox until the inbox ends, writing records in the order it
    receives them and answering each barrier once it is durable.
    """

    def statistics(self) -> WriterStatistics:
        """Counters the run's handle reports (`RunHandle.statistics`)."""
        ...


class HydratorActor(InboxActor[Hydrate], Protocol):
    """The context hydrator role: answers each `Hydrate` with the next model request."""


class GatewayActor(InboxActor[CallModel], Protocol):
    """The model gateway role: answers each `CallModel` with a `ModelOutcome`.

    It writes each attempt's intent (a barrier) before the request leaves and its result
    after, and reports every record it wrote in ``ModelOutcome.written``.
    """


class ExecutorActor(InboxActor[RunActions], Protocol):
    """The tool executor role: answers each `RunActions` with an `ActionsOutcome`.

    It writes each action's intent (a barrier) before the action starts and reports the
    intents in ``ActionsOutcome.written``; the results go back to the coordinator, which
    writes them with the step record.
    """


class CoordinatorActor(Protocol):
    """The run coordinator role: the step loop, stop rules, budgets and cancellation.

    Attributes:
        state: the run state now (read by `RunHandle.state`).
        awaiting: the approval request the run waits on, or ``None``.
    """

    @property
    def state(self) -> RunState:
        """The run state now."""
        ...

    @property
    def awaiting(self) -> ApprovalRequested | None:
        """The approval request the run waits on, or ``None``."""
        ...

    async def run(self, *, resumed_steps: tuple[StepRecord, ...] = ()) -> RunResult:
        """Run to the end, write run-finished (a barrier) and return the result."""
        ...

    def cancel(self, reason: str = "", canceller: str = "") -> None:
        """Cancel the run (a no-op once it is finishing)."""
        ...

    def decide(
        self,
        *,
        call_id: str | None = None,
        reject: str | None = None,
        edit: Mapping[str, Any] | None = None,
    ) -> ApprovalDecided:
        """Answer the pending approval request (see `RunHandle.approve`)."""
        ...

    def offer(self, decided: ApprovalDecided) -> None:
        """Hand over a decision read from the control log."""
        ...

    def close_inboxes(self) -> None:
        """Close the inboxes of the hydrator, gateway and executor (they then return)."""
        ...

    def drain(self) -> None:
        """Stop at the next safe point (see `treadle.actors.RunCoordinator.drain`)."""
        ...


@attrs.frozen(kw_only=True)
class WriterContext:
    """What an event-writer factory gets.

    Attributes:
        run_id: the run.
        store: the run store the writer is the single writer of.
        next_seq: the seq of the next record (1 for a new run, log length + 1 on resume).
        generation: the run's lease generation; every store write carries it (0 for a store
            without leases).
        sinks: event sinks to feed through bounded buffers.
        feed: the run's `SinkFeed` over ``sinks``: it outlives each writer (a parked run
            gets a new writer when resumed), so hand events to it rather than to the sinks.
        redaction: the run's secret tool arguments: every event handed out has them
            redacted (docs/events.md, "Secret arguments").
        metrics: where the writer counts the records it appends (docs/metrics.md);
            ``None``: nowhere.
    """

    run_id: str
    store: RunStore
    next_seq: int
    sinks: Sequence[EventSink]
    generation: int = 0
    feed: SinkFeed | None = None
    redaction: Redaction = NO_REDACTION
    metrics: MetricsRecorder | None = None


@attrs.frozen(kw_only=True)
class ActorContext:
    """What a hydrator, gateway or executor factory gets.

    Attributes:
        run_id: the run.
        agent: the agent definition.
        started: the run-started record (input messages, snapshot).
        writer: the client of the run's event writer (every write goes through it).
        clock: wall clock for record timestamps.
        rng: the run's random source (retry jitter).
        store: the run's store, for reading (never writing): the hydrator reads the history
            of the run ``started.continues`` names from it (docs/threads.md).
    """

    run_id: str
    agent: Agent
    started: RunStarted
    writer: WriterClient
    clock: Clock
    rng: random.Random
    store: RunStore | None = None


@attrs.frozen(kw_only=True)
class CoordinatorContext:
    """What a coordinator factory gets: the `ActorContext` plus the coordinator's own inputs.

    Attributes:
        actor: the shared context.
        view: the run's state folded from its log (fresh or resumed).
        needs_approval: ``needs_approval(tool, arguments)``: whether a call waits for a human.
        hydrator: the hydrator's inbox.
        gateway: the gateway's inbox.
        executor: the executor's inbox.
        park_after_s: seconds of waiting for an approval after which the coordinator may
            raise `treadle.actors.Parked` (``None``: never park).
        carried_active_s: active seconds of a step interrupted by parking, to carry on.
    """

    actor: ActorContext
    view: RunView
    needs_approval: Callable[[str, Mapping[str, Any]], bool]
    hydrator: MailboxSender[Hydrate]
    gateway: MailboxSender[CallModel]
    executor: MailboxSender[RunActions]
    park_after_s: float | None = None
    carried_active_s: float = 0.0


def real_writer(context: WriterContext) -> EventWriter:
    """The real event writer (the default `Actors.writer`)."""
    return EventWriter(
        run_id=context.run_id,
        store=context.store,
        next_seq=context.next_seq,
        generation=context.generation,
        sinks=context.sinks,
        feed=context.feed,
        redaction=context.redaction,
        metrics=context.metrics,
    )


def real_hydrator(context: ActorContext) -> ContextHydrator:
    """The real context hydrator (the default `Actors.hydrator`)."""
    agent = context.agent
    return ContextHydrator(
        started=context.started,
        system_prompt=agent.system_prompt,
        tools=agent.model_tools(),
        model=agent.model_name,
        max_output_tokens=agent.max_output_tokens,
        params=agent.params,
        synthetic=agent.synthetic,
        output=agent.output.request_format() if agent.output is not None else None,
        context_window=agent.context_window,
        margin_tokens=agent.margin_tokens,
        token_counter=agent.token_counter,
        summary_prompt=agent.summary_prompt or DEFAULT_SUMMARY_PROMPT,
        summary_model=agent.summary_model,
        store=context.store,
    )


def real_gateway(context: ActorContext) -> ModelGateway:
    """The real model gateway on the agent's model client (the default `Actors.gateway`).

    The executor's ``image_source`` (`treadle.Agent.tool_policies`), when it has one, resolves
    the ``ref:`` images its tools returned (docs/models.md, "Images returned by tools").
    """
    agent = context.agent
    return ModelGateway(
        run_id=context.run_id,
        client=agent.model,
        writer=context.writer,
        clock=context.clock,
        limits=agent.limits,
        budgets=agent.budgets,
        rng=context.rng,
        summariser=agent.summariser,
        image_source=agent.tool_policies.image_source,
    )


def real_executor(context: ActorContext) -> ToolExecutor:
    """The real tool executor on the agent's executor (the default `Actors.executor`)."""
    agent = context.agent
    return ToolExecutor(
        run_id=context.run_id,
        executor=agent.executor,
        policies=agent.tool_policies,
        writer=context.writer,
        clock=context.clock,
        limits=agent.limits,
        synthetic=agent.synthetic,
        observation_template=agent.observation_template,
    )


def real_coordinator(context: CoordinatorContext) -> RunCoordinator:
    """The real run coordinator (the default `Actors.coordinator`)."""
    actor, agent = context.actor, context.actor.agent
    return RunCoordinator(
        run_id=actor.run_id,
        view=context.view,
        parser=agent.parser,
        tools=agent.model_tools(),
        budgets=agent.budgets,
        limits=agent.limits,
        clock=actor.clock,
        writer=actor.writer,
        hydrator=context.hydrator,
        gateway=context.gateway,
        executor=context.executor,
        needs_approval=context.needs_approval,
        output=agent.output,
        park_after_s=context.park_after_s,
        carried_active_s=context.carried_active_s,
        compaction=agent.context_window is not None,
        synthetic=agent.synthetic,
    )


@attrs.frozen(kw_only=True)
class Actors:
    """One factory per actor of a run; each defaults to the real actor.

    Replace one role and keep the others real, e.g.
    ``Actors(executor=lambda ctx: LedgerExecutor(ctx))``. Factories are called once per run
    (and once per resume), in this order: writer, hydrator, gateway, executor, coordinator.
    Each returns an actor that serves its inbox like the real one (see the role protocols).

    Attributes:
        writer: ``(WriterContext) -> WriterActor``.
        hydrator: ``(ActorContext) -> HydratorActor``.
        gateway: ``(ActorContext) -> GatewayActor``.
        executor: ``(ActorContext) -> ExecutorActor``.
        coordinator: ``(CoordinatorContext) -> CoordinatorActor``.
    """

    writer: Callable[[WriterContext], WriterActor] = real_writer
    hydrator: Callable[[ActorContext], HydratorActor] = real_hydrator
    gateway: Callable[[ActorContext], GatewayActor] = real_gateway
    executor: Callable[[ActorContext], ExecutorActor] = real_executor
    coordinator: Callable[[CoordinatorContext], CoordinatorActor] = real_coordinator


DEFAULT_ACTORS = Actors()
"""The real five actors."""


@attrs.define(eq=False)
class RunHandle:
    """A caller's handle on one run (new, resumed or already finished).

    Attributes:
        run_id: the run.
    """

    run_id: str
    _store: RunStore
    _coordinator: CoordinatorActor | None = None
    _writer: WriterActor | None = None
    _writer_client: WriterClient | None = None
    _parking: Parking | None = None
    _result: RunResult | None = None
    _error: BaseException | None = None
    _done: trio.Event = attrs.Factory(trio.Event)
    _changed: trio.Event = attrs.Factory(trio.Event)
    _draining: bool = False
    _left: str | None = None
    _snapshot: Mapping[str, JSONValue] | None = None
    _redaction: Redaction = NO_REDACTION

    def drain(self) -> None:
        """Stop driving the run at its next safe point and let go of its lease.

        The run is not cancelled: it stops between two steps (or at once while it waits on a
        human), stays unfinished and resumable, and its lease is released so that another
        driver takes it over from its log (docs/fleet.md, "Shutting a worker down").
        `wait` then raises `RunInterrupted`; `left` says why.
        """
        self._draining = True
        if self._coordinator is not None:
            self._coordinator.drain()
        elif self._parking is not None:
            self._parking.drain()

    @property
    def left(self) -> str | None:
        """Why this process stopped driving the unfinished run (``drained``, ``parked``)."""
        return self._left

    def _transition(self) -> None:
        """Wake whoever waits for the run to be driven again (or to end)."""
        self._changed.set()
        self._changed = trio.Event()

    @property
    def state(self) -> RunState:
        """The run state now (``interrupted`` when an actor failed)."""
        if self._result is not None:
            return self._result.state
        if self._error is not None:
            return RunState.INTERRUPTED
        if self._parking is not None:
            return self._parking.state
        if self._coordinator is None:
            return RunState.QUEUED
        return self._coordinator.state

    @property
    def result(self) -> RunResult | None:
        """The result once the run finished, else ``None``."""
        return self._result

    def cancel(self, reason: str = "", *, canceller: str = "") -> None:
        """Cancel the run (docs/concepts.md, "Stop reasons" rule A).

        The model call or action in flight is cancelled at once, a cancel record is written,
        and the run finishes ``cancelled``. A no-op once the run finished.
        """
        if self._parking is not None:
            self._parking.cancel(reason, canceller, here=True)
        elif self._coordinator is not None:
            self._coordinator.cancel(reason, canceller)

    @property
    def pending_approval(self) -> ApprovalRequested | None:
        """The approval request the run waits on now (state ``awaiting_approval``), or ``None``.

        Its ``arguments`` are those the call would run with, secret ones redacted
        (docs/events.md, "Secret arguments").
        """
        request = self._awaited()
        return None if request is None else self._redaction.request(request)

    def _awaited(self) -> ApprovalRequested | None:
        if self._parking is not None:
            parking = self._parking
            return None if parking.decision or parking.cancel_request else parking.request
        return self._coordinator.awaiting if self._coordinator is not None else None

    def approve(
        self,
        call_id: str | None = None,
        *,
        reject: str | None = None,
        edit: Mapping[str, Any] | None = None,
    ) -> ApprovalDecided:
        """Decide the pending approval: approve, reject with a message, or edit the arguments.

        The decision is recorded (a barrier) before the action's intent; the run continues.

        Args:
            call_id: the call meant; refused when it is not the pending one (``None``: the
                pending call, whichever it is).
            reject: reject with this message; the model sees it in a synthetic observation.
            edit: run the call with these arguments instead: they replace the model's whole
                argument object (no merge; a secret argument must be given again) and must
                fit the tool's argument schema in the run's parameter snapshot.

        Returns:
            The decision handed to the run.

        Raises:
            UsageError: the run is not waiting for an approval, waits on another call, both
                ``reject`` and ``edit`` were given, or the edit is not JSON data or does not
                fit the tool's schema (nothing is handed over then).
        """
        request = self._awaited()
        if edit is not None and request is not None and self._snapshot is not None:
            secrets = self._redaction.secrets.get(request.tool, ())
            schema = tool_schema(self._snapshot, request.tool)
            check_edit(edit, request.tool, schema, secrets=secrets)
        if self._parking is not None:
            return self._parking.decide(call_id=call_id, reject=reject, edit=edit)
        if self._coordinator is None:
            raise UsageError(f"run {self.run_id!r} is not being driven here")
        return self._coordinator.decide(call_id=call_id, reject=reject, edit=edit)

    async def wait(self) -> RunResult:
        """Wait for the run to finish and return its result.

        Raises:
            RunInterrupted: an actor failed; the log is left resumable (``__cause__`` holds
                the error).
            StoreError: the store failed; the run stopped without continuing.
        """
        await self._done.wait()
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise RunInterrupted(
                self.run_id,
                f"this process stopped driving it ({self._left}); it resumes from its log",
            )
        return self._result

    def statistics(self) -> WriterStatistics | None:
        """Delivery counters of the run in this process (parked stretches included).

        ``None`` before the run was first driven here.
        """
        return self._writer.statistics() if self._writer is not None else None

    async def events(self, *, from_seq: int = 1) -> AsyncIterator[Event]:
        """Yield the run's events from ``from_seq``.

        Stored events come first, then live ones, with no gap and no duplicate where they
        meet (docs/concepts.md, "Actors").

        Durable events come with their seq; ephemeral deltas carry the seq of the durable
        event they follow and an ordinal. While a tool call of the run drives a child run
        in this process, the child's events come too, live, each with the child's run id
        and its own seq (keep one cursor per run id; they are never in this run's log,
        docs/child-runs.md, "Events"). Ends after the run-finished event, or when the run
        stops being driven here. The stream carries on, from the store, across a parked
        approval wait, and after the subscriber was cut off for falling behind (only
        deltas are then missing).

        Raises:
            UsageError: ``from_seq`` is below 1.
            StoreError: the stored prefix could not be read completely.
        """
        if from_seq < 1:
            raise UsageError(f"events are numbered from 1; from_seq={from_seq} was asked")
        # The (seq, ordinal) of the last event yielded: a reconnect reads from its seq again
        # and skips what was yielded, so a derived step-started event (which shares the seq
        # of the durable event before it) is not lost at the seam.
        last: tuple[int, int] = (from_seq - 1, 0)
        while True:
            changed = self._changed
            client = self._writer_client
            start = max(from_seq, last[0])
            subscription = None
            if client is not None and not self._done.is_set():
                with contextlib.suppress(
                    trio.BrokenResourceError, trio.ClosedResourceError, trio.EndOfChannel
                ):
                    subscription = await client.subscribe()
            if subscription is None:
                log = await self._store.read_log(self.run_id)
                for event in stored_events(log, start, len(log.records)):
                    if (event.seq, event.ordinal) > last:
                        last = (event.seq, event.ordinal)
                        yield event
                if self._done.is_set() or (self._parking is None and client is None):
                    return
                await changed.wait()  # parked (or between two drivers): wait for the next
                continue
            async with subscription.events as live:
                caught_up = await self._catch_up(start, subscription.last_seq, subscription.tail)
                for event in caught_up:
                    if (event.seq, event.ordinal) > last:
                        last = (event.seq, event.ordinal)
                        yield event
                async for event in live:
                    if event.run_id != self.run_id:  # a child run's, live: its own cursor
                        yield event
                    elif event.seq >= from_seq:
                        last = max(last, (event.seq, event.ordinal))
                        await self._reflected(event)
                        yield event

    async def _reflected(self, event: Event) -> None:
        """Wait until what the handle reports reflects ``event`` (docs/events.md, "Reading events").

        The writer hands an event to its subscribers as soon as its record is durable; the
        driver learns of it a scheduling step later. ``run_started`` waits until the run is
        driven here (``state`` is ``running``), ``run_finished`` until ``result`` is set.
        The approval request needs no wait: the handle reports it before its record is
        written.
        """
        if event.kind is EventKind.RUN_STARTED:
            while self._coordinator is None and self._parking is None and not self._done.is_set():
                await self._changed.wait()
        elif event.kind is EventKind.RUN_FINISHED:
            await self._done.wait()

    async def _catch_up(self, from_seq: int, last_seq: int, tail: tuple[Event, ...]) -> list[Event]:
        if from_seq > last_seq:
            return []
        tail_start = tail[0].seq if tail else last_seq + 1
        events: list[Event] = []
        if from_seq < tail_start:
            log = await self._store.read_log(self.run_id)
            events.extend(stored_events(log, from_seq, tail_start - 1))
        events.extend(e for e in with_step_started(tail) if e.seq >= from_seq)
        return events


@asynccontextmanager
async def open_run(
    agent: Agent,
    input: RunInput | None = None,
    *,
    store: RunStore,
    run_id: str | None = None,
    sinks: Sequence[EventSink] = (),
    clock: Clock | None = None,
    rng: random.Random | None = None,
    approval_policy: ApprovalPolicy | None = None,
    control_poll_s: float | None = CONTROL_POLL_S,
    actors: Actors = DEFAULT_ACTORS,
    park_after_s: float | None = PARK_AFTER_S,
    lease_ttl_s: float = LEASE_TTL_S,
    owner: str | None = None,
    accept_definition_change: bool = False,
    metrics: MetricsRecorder | None = None,
    thread_id: str | None = None,
    fork_of: str | None = None,
    at_step: int | None = None,
) -> AsyncIterator[RunHandle]:
    """Start (or resume) a run in the background and yield its handle.

    A new ``run_id`` starts a run on ``input``. An existing unfinished ``run_id`` is resumed
    (``input`` may be omitted; when given it must equal the stored input). A finished one
    yields a handle whose result is already set: nothing is re-run.

    In a store with leases (`treadle.ports.LeaseStore`), the run is driven only while this
    call holds the run's lease (docs/fleet.md, "Leases"): it is taken before the log is read,
    renewed every ``lease_ttl_s / 3`` seconds, and released when the run finishes, parks or
    the block ends. If another driver takes the run over (after the lease expired), this one
    stops without writing more and its handle reports `LeaseLost`.

    Leaving the block waits for the run to finish; an exception in the block cancels the
    run's actors and leaves the run unfinished (resumable), not ``cancelled``.

    Args:
        agent: the agent definition.
        input: the run input (text or messages); required for a new run.
        store: the run store.
        run_id: the run's id (docs/concepts.md, "Run ids"); a fresh random one when omitted.
        sinks: event sinks fed through bounded buffers.
        clock: wall clock for record timestamps (default: the system clock).
        rng: random source for retry jitter (default: a fresh unseeded one).
        approval_policy: ``policy(tool, arguments) -> bool``: calls it selects wait for a
            human decision, as do tools declared with ``requires_approval=True``.
        control_poll_s: seconds between reads of the run's control stream (cancel and
            approval decisions from other processes, see `treadle.approvals`); ``None``
            reads it only once, when the run starts.
        actors: the factories of the run's five actors (default: the real ones); replace
            one to swap that actor alone (see `Actors`).
        park_after_s: seconds a run waits for an approval decision with its actors running;
            after that it is parked: its actors stop, its lease is released, and only the
            handle stays in memory until a decision, a cancel or the deadline resumes it from
            its log (docs/decisions/0010). ``None`` never parks.
        lease_ttl_s: the lease duration in seconds (default 15).
        owner: the lease owner id (default: a fresh ``host:pid:random``). A process restarted
            under the owner id of one that died continues its leases at once.
        accept_definition_change: resume even though the agent definition's snapshot
            differs from the run's: the difference is written to the log first (a
            `treadle.types.DefinitionAccepted` record, docs/fleet.md "Deploys"); without it,
            `SnapshotMismatch` is raised.
        metrics: counts the run's records (docs/metrics.md, "What is counted"); ``None``
            (the default) counts nothing. The store's commits are counted only once
            `treadle.metrics.MetricsRecorder.watch` watches the store.
        thread_id: continue the thread of this id (the id of its first run) with ``input``
            as the new user message: the new run ``<thread_id>.<n>`` starts from the history
            the thread's latest run ended with, read from the store (docs/threads.md,
            "Threads"). When the latest run is unfinished and was started with the same
            input, that run is resumed instead. ``run_id``, when given, names the run: an
            existing run of the thread is resumed (or its result returned), which makes a
            retry after a crash start nothing twice; a new one must be the thread's next.
        fork_of: fork this run: the new run starts from its history before step
            ``at_step`` and tries that step again (docs/threads.md, "Forks"); nothing
            before it is executed again. ``input``, when given, is added after that history.
        at_step: the step of ``fork_of`` to try again (1 to its step count).

    Raises:
        RunLeased: another live driver holds the run's lease (the error names it and the
            expiry); nothing was read or written.
        InvalidRunId: ``run_id`` is not an allowed run id.
        UsageError: no input for a new run, or an input that differs from the stored one;
            a thread that does not exist or whose latest run is not finished (started with
            another input), a fork of a missing run or at a step it does not have, both
            ``thread_id`` and ``fork_of``, or a ``run_id`` that exists with another lineage
            (docs/threads.md, "When a thread cannot go on"). Nothing is written then.
        SnapshotMismatch: resuming with a definition whose snapshot differs (names the keys).
        SchemaTooNew: the log was written by a newer treadle.
    """
    require_trio("treadle.open_run")
    lineage: Lineage | None = None
    if thread_id is not None or fork_of is not None:
        run_id, lineage = await _lineage(store, input, run_id, thread_id, fork_of, at_step)
    elif at_step is not None:
        raise UsageError("at_step is the step of the run named by fork_of, which is missing")
    run_id = check_run_id(run_id) if run_id is not None else new_run_id()
    hold = LeaseHold(
        run_id=run_id, owner=owner or lease_owner(), ttl_s=lease_ttl_s, store=leases_of(store)
    )
    options = _Options(
        clock=clock or SystemClock(),
        rng=rng,
        approval_policy=approval_policy,
        control_poll_s=control_poll_s,
        actors=actors,
        park_after_s=park_after_s,
        accept_definition_change=accept_definition_change,
        metrics=metrics,
        lineage=lineage,
    )
    async with drive_run(
        agent, input, store=store, hold=hold, sinks=sinks, options=options
    ) as handle:
        yield handle


async def _lineage(
    store: RunStore,
    input: RunInput | None,
    run_id: str | None,
    thread_id: str | None,
    fork_of: str | None,
    at_step: int | None,
) -> tuple[str, Lineage]:
    """The run id and lineage of a run continuing ``thread_id`` or forking ``fork_of``."""
    if thread_id is not None and fork_of is not None:
        raise UsageError("give thread_id (continue a thread) or fork_of (fork a run), not both")
    if thread_id is not None:
        if at_step is not None:
            raise UsageError("at_step goes with fork_of; a thread continues its whole history")
        if run_id is not None:
            known = await run_in_thread(store, thread_id, check_run_id(run_id), input)
            if known is not None:  # a retry naming its run: resume it or return its result
                return run_id, known
        next_id, lineage = await next_in_thread(store, thread_id, input)
        if run_id is not None and run_id != next_id:
            raise UsageError(
                f"thread {thread_id!r} goes on as run {next_id!r}, not {run_id!r} (a thread "
                'names its runs, docs/threads.md, "Threads")'
            )
        await _check_chain(store, next_id, lineage)
        return next_id, lineage
    assert fork_of is not None
    lineage = await fork_lineage(store, fork_of, at_step)
    fork_id = check_run_id(run_id) if run_id is not None else new_run_id()
    await _check_chain(store, fork_id, lineage)
    return fork_id, lineage


async def _check_chain(store: RunStore, run_id: str, lineage: Lineage) -> None:
    """Refuse to start ``run_id`` when the history it would inherit cannot be read.

    Only for a run that does not exist yet: its run-started must not be written over a
    chain whose runs are missing, damaged or unfinished (docs/threads.md, "When a thread
    cannot go on"; docs/decisions/0080-check-the-chain-before-a-new-run.md). A run that
    exists reads its chain when its hydrator starts, as every resume does.

    Raises:
        StoreError: as `treadle.actors.recorded_history` (nothing is written).
    """
    if (await store.read_log(run_id)).started is not None:
        return
    await recorded_history(
        store, lineage.continues, before_step=lineage.fork_step, successor=run_id
    )


@attrs.frozen(kw_only=True)
class _Options:
    clock: Clock
    rng: random.Random | None
    approval_policy: ApprovalPolicy | None
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


@asynccontextmanager
async def drive_run(
    agent: Agent,
    input: RunInput | None,
    *,
    store: RunStore,
    hold: LeaseHold,
    sinks: Sequence[EventSink],
    options: _Options,
) -> AsyncIterator[RunHandle]:
    """`open_run` on a `LeaseHold` (a fleet passes the lease its claim took).

    Raises:
        RunLeased: the lease cannot be taken (it is taken unless ``hold`` holds it already).
    """
    if hold.lease is None:
        await hold.acquire()
    try:
        log = await store.read_log(hold.run_id)
    except Exception:
        await hold.release_failed()
        raise
    except BaseException:
        await hold.release_quietly()
        raise
    handle = RunHandle(run_id=hold.run_id, store=store)
    if log.finished is not None:
        await hold.release()
        handle._result = RunResult.from_finished(log.finished, output_type=agent.output_type)
        handle._done.set()
        yield handle
        return
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(_supervise, agent, input, log, store, sinks, options, handle, hold)
            yield handle
    except BaseExceptionGroup as group:
        # The run's own errors are on the handle; what reaches here came from the caller's
        # block. Hand a single error back unwrapped, as the caller raised it.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


async def _supervise(
    agent: Agent,
    input: RunInput | None,
    log: RunLog,
    store: RunStore,
    sinks: Sequence[EventSink],
    options: _Options,
    handle: RunHandle,
    hold: LeaseHold,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Drive the run while holding its lease; while parked, wait with the lease released."""
    run_id = log.run_id
    first: RunLog | None = log
    del log  # a parked run keeps no records in memory
    parking: Parking | None = None
    try:
        async with _sink_feed(sinks, handle) as feed, _keeping(hold, options):
            while True:
                current, first = first or await store.read_log(run_id), None
                with hold.driving():
                    stretch = await _drive(
                        agent,
                        input,
                        current,
                        store,
                        feed,
                        options,
                        handle,
                        parking,
                        hold,
                        task_status,
                    )
                del current
                if stretch is None:
                    await hold.release()
                    return
                if isinstance(stretch, _ChildWait):  # claimable when a child wakes it
                    await hold.release(control_seen=stretch.control_seen)
                    return
                parking = stretch
                task_status = trio.TASK_STATUS_IGNORED  # reported when first driven
                await hold.release(control_seen=parking.control_seen)
                if options.leave_parked or handle._draining:
                    handle._left = "parked"
                    return
                await _wait_parked(parking, store, run_id, options)
                await _keep_decision(parking, store)
                if handle._draining:
                    handle._left = "parked"
                    return
                await hold.acquire()
    except BaseException as exc:
        leaves = _leaves(exc)
        if all(not isinstance(e, Exception) for e in leaves):
            # Cancelled from outside (or KeyboardInterrupt): the run stays unfinished.
            handle._error = RunInterrupted(run_id, "the task driving the run was cancelled")
            await hold.release_quietly()
            raise
        handle._error = _interrupted(run_id, exc)
        if not isinstance(handle._error, LeaseError):
            await hold.release_failed()
        task_status_started_safely(task_status)
    finally:
        handle._parking = None
        handle._done.set()
        handle._transition()


@asynccontextmanager
async def _keeping(hold: LeaseHold, options: _Options) -> AsyncIterator[None]:
    """Keep ``hold`` renewed: by the fleet's keeper, or by the one its store's runs share."""
    if hold.store is None:
        yield
        return
    keeper = options.keeper
    if keeper is not None:
        stop = keeper.add(hold)
        try:
            yield
        finally:
            stop()
        return
    shared = shared_keeper(hold.store, hold.ttl_s)  # one renewal for all such runs
    stop = shared.add(hold)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(shared.serve)
        try:
            yield
        finally:
            stop()
            nursery.cancel_scope.cancel()


async def _keep_decision(parking: Parking, store: RunStore) -> None:
    """Make a decision or cancel handed to the parked run's handle durable before driving again.

    It goes to the run's control stream, so that whoever drives the run next (this process,
    or another that took it over meanwhile, or after a crash) applies it.
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


@asynccontextmanager
async def _sink_feed(
    sinks: Sequence[EventSink], handle: RunHandle
) -> AsyncIterator[SinkFeed | None]:
    """The run's `SinkFeed`, running for the whole run; ``None`` (and no task) without sinks.

    A sink receives an event once ``handle`` reflects it, as a subscriber does.
    """
    if not sinks:
        yield None
        return
    feed = SinkFeed(sinks=sinks, reflected=handle._reflected)
    async with trio.open_nursery() as nursery:
        await nursery.start(feed.run)
        try:
            yield feed
        finally:
            feed.close()


async def _wait_parked(parking: Parking, store: RunStore, run_id: str, options: _Options) -> None:
    """Wait, with the actors stopped, for what ends the parking (reading the control stream)."""
    controls = control_of(store)
    if controls is None:
        await parking.wait(_nothing, _nothing, None)
        return
    index = _index(controls, options)
    control = ControlInbox(
        store=controls, run_id=run_id, target=parking, index=index, seen=parking.control_seen
    )
    await parking.wait(
        control.poll,
        functools.partial(control.poll, fresh=True),
        options.control_poll_s,
        grown=(lambda wake: index.wait_grown(run_id, control.seen, wake)) if index else None,
    )


async def _nothing() -> None:
    await trio.lowlevel.checkpoint()


@attrs.frozen
class _ChildWait:
    """The drive ended with the run parked on child runs (`AwaitingChildren`).

    Attributes:
        control_seen: the control-stream position handled: a later entry (a cancel) makes
            the run claimable.
    """

    control_seen: int


async def _drive(
    agent: Agent,
    input: RunInput | None,
    log: RunLog,
    store: RunStore,
    feed: SinkFeed | None,
    options: _Options,
    handle: RunHandle,
    parking: Parking | None,
    hold: LeaseHold,
    task_status: trio.TaskStatus[None],
) -> Parking | _ChildWait | None:
    """One stretch of driving: start the actors on ``log``, run until finished or parked.

    Returns:
        The parking state when the coordinator parked the run on an approval, a
        `_ChildWait` when it parked on child runs, ``None`` when it finished.
    """
    clock = options.clock
    async with trio.open_nursery() as nursery:
        started, view, resumed, accepted = _prepare(agent, input, log, clock, options, hold.owner)
        if started.caps is not None:  # a queued child: its parent's remainder bounds it
            agent = attrs.evolve(agent, budgets=agent.budgets.capped(started.caps))
        snapshot = accepted.snapshot if accepted is not None else agent.snapshot()
        handle._snapshot = snapshot
        handle._redaction = Redaction.of_log(log) | Redaction.of_snapshot(snapshot)
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
                redaction=handle._redaction,
                metrics=options.metrics,
            )
        )
        client = WriterClient(writer_send)
        handle._writer, handle._writer_client = writer, client
        await nursery.start(writer.run, writer_recv)
        if view.next_seq == 1:
            await client.write(StoreOp.RUN_STARTED, started)
            view.apply(started)
        if accepted is not None:  # the changed definition, accepted, is on record first
            await client.barrier(StoreOp.CONTROL, accepted)
            view.apply(accepted)
        context = ActorContext(
            run_id=log.run_id,
            agent=agent,
            started=started,
            writer=client,
            clock=clock,
            rng=options.rng or random.Random(),
            store=store,
        )
        needs_approval = functools.partial(
            requires_approval, agent.tool_policies, options.approval_policy
        )
        coordinator = await _start_actors(
            nursery,
            actors,
            context,
            view,
            needs_approval,
            park_after_s=options.park_after_s,
            carried_active_s=parking.active_s if parking is not None else 0.0,
        )
        if parking is not None:
            await _hand_over(parking, view, client)
            if parking.cancel_request is not None:
                coordinator.cancel(*parking.cancel_request)
        handle._coordinator, handle._parking = coordinator, None
        handle._transition()
        control = _control_inbox(store, log.run_id, coordinator, options)
        stop_register = control.index.register(log.run_id) if control and control.index else None
        if control is not None:
            await control.poll(fresh=True)  # a cancel or decision written while no one drove it
        task_status.started()
        polling = trio.CancelScope()
        if control is not None and options.control_poll_s is not None:
            nursery.start_soon(control.poll_every, options.control_poll_s, polling)
        parked: Parking | _ChildWait | None = None
        if handle._draining:
            coordinator.drain()
        awaited = view.pending.children_awaited  # the step parked on children last time
        try:
            handle._result = await coordinator.run(resumed_steps=resumed)
            handle._done.set()  # answered: sinks may still drain in the background
            await wake_parent(store, started)
            if awaited is not None:
                await cancel_awaited_children(store, awaited)
        except AwaitingChildren:
            handle._left = "parked"
            handle._coordinator, handle._writer_client = None, None
            handle._transition()
            parked = _ChildWait(control.seen if control is not None else 0)
        except Drained:
            handle._left = "drained"
            handle._coordinator, handle._writer_client = None, None
            handle._transition()
            parked = None
        except Parked as signal:
            parked = Parking(
                request=signal.request,
                deadline=signal.deadline,
                active_s=signal.active_s,
                clock=clock,
                control_seen=control.seen if control is not None else 0,
            )
            handle._parking, handle._coordinator, handle._writer_client = parked, None, None
            handle._transition()
        finally:
            polling.cancel()
            if stop_register is not None:
                stop_register()
            coordinator.close_inboxes()
            writer_send.close()
    return parked


def _control_inbox(
    store: RunStore, run_id: str, target: CoordinatorActor, options: _Options
) -> ControlInbox | None:
    controls = control_of(store)
    if controls is None:
        return None
    return ControlInbox(
        store=controls, run_id=run_id, target=target, index=_index(controls, options)
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


def _index(store: ControlStream, options: _Options) -> ControlIndex | None:
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
    real = [e for e in _leaves(error) if isinstance(e, Exception)]
    # A failed store write ends the event writer, and the other actors then fail on its
    # closed inbox: the store's error is the cause, whichever leaf came first.
    first = next((e for e in real if isinstance(e, StoreError | UsageError | LeaseError)), real[0])
    if isinstance(first, StoreError | UsageError | LeaseError):
        return first
    interrupted = RunInterrupted(run_id, f"{type(first).__name__}: {first}")
    interrupted.__cause__ = first
    return interrupted


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for sub in error.exceptions for leaf in _leaves(sub)]
    return [error]


def _prepare(
    agent: Agent, input: RunInput | None, log: RunLog, clock: Clock, options: _Options, owner: str
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
    if options.lineage is not None and Lineage.of(started) != options.lineage:
        stored = Lineage.of(started)
        raise UsageError(
            f"run {log.run_id!r} exists as {stored.describe() if stored else 'a run of its own'},"
            f" not as the {options.lineage.describe()} asked for (another caller started it)"
        )
    if input is not None and valid_unicode(input_messages(input))[0] != started.input:
        raise UsageError(f"run {log.run_id!r}: the input differs from the stored input")
    accepted = _accepted_change(agent, log, started, clock, options, owner)
    return started, fold(log.records), log.steps, accepted


def _accepted_change(
    agent: Agent,
    log: RunLog,
    started: RunStarted,
    clock: Clock,
    options: _Options,
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
        raise SnapshotMismatch(log.run_id, changed)
    return DefinitionAccepted(
        run_id=log.run_id,
        ts=clock.now_iso(),
        changed=tuple(changed),
        snapshot=snapshot,
        agent_version=agent.version_label,
        accepted_by=owner,
    )


async def _start_actors(
    nursery: trio.Nursery,
    actors: Actors,
    context: ActorContext,
    view: RunView,
    needs_approval: Callable[[str, Mapping[str, Any]], bool],
    *,
    park_after_s: float | None,
    carried_active_s: float,
) -> CoordinatorActor:
    """Build the hydrator, gateway and executor, start them, and build the coordinator."""
    # 1: every request waits for its reply anyway; the coordinator has one step in flight.
    hydrator_send, hydrator_recv = open_mailbox[Hydrate](1)
    gateway_send, gateway_recv = open_mailbox[CallModel](1)
    executor_send, executor_recv = open_mailbox[RunActions](1)
    hydrator = actors.hydrator(context)
    gateway = actors.gateway(context)
    executor = actors.executor(context)
    await nursery.start(hydrator.run, hydrator_recv)
    await nursery.start(gateway.run, gateway_recv)
    await nursery.start(executor.run, executor_recv)
    return actors.coordinator(
        CoordinatorContext(
            actor=context,
            view=view,
            needs_approval=needs_approval,
            hydrator=hydrator_send,
            gateway=gateway_send,
            executor=executor_send,
            park_after_s=park_after_s,
            carried_active_s=carried_active_s,
        )
    )


async def run(
    agent: Agent,
    input: RunInput | None = None,
    *,
    store: RunStore,
    run_id: str | None = None,
    sinks: Sequence[EventSink] = (),
    clock: Clock | None = None,
    rng: random.Random | None = None,
    approval_policy: ApprovalPolicy | None = None,
    control_poll_s: float | None = CONTROL_POLL_S,
    actors: Actors = DEFAULT_ACTORS,
    park_after_s: float | None = PARK_AFTER_S,
    lease_ttl_s: float = LEASE_TTL_S,
    owner: str | None = None,
    accept_definition_change: bool = False,
    metrics: MetricsRecorder | None = None,
    thread_id: str | None = None,
    fork_of: str | None = None,
    at_step: int | None = None,
) -> RunResult:
    """Run ``agent`` on ``input`` to the end and return the result.

    The same call resumes an unfinished ``run_id`` (without repeating any finished model call
    or action) and returns the stored result of a finished one. With ``thread_id`` it
    continues a thread, with ``fork_of`` and ``at_step`` it forks a run (docs/threads.md).
    Arguments as in `open_run`.

    Raises:
        RunInterrupted: an actor failed; the run is left resumable.
        StoreError: the store failed; the run stopped.
        RunLeased: another live driver holds the run's lease.
        LeaseLost: another driver took the run over while this call drove it.
        UsageError, SnapshotMismatch, SchemaTooNew: as in `open_run`.
    """
    async with open_run(
        agent,
        input,
        store=store,
        run_id=run_id,
        sinks=sinks,
        clock=clock,
        rng=rng,
        approval_policy=approval_policy,
        control_poll_s=control_poll_s,
        actors=actors,
        park_after_s=park_after_s,
        lease_ttl_s=lease_ttl_s,
        owner=owner,
        accept_definition_change=accept_definition_change,
        metrics=metrics,
        thread_id=thread_id,
        fork_of=fork_of,
        at_step=at_step,
    ) as handle:
        pass  # leaving the block waits for the run
    return await handle.wait()
