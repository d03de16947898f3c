"""The factories of a run's five actors and the roles they fill (docs/design.md, "The five actors").

The five actors are built by the factories of an `Actors` record, each defaulting to the real
actor; a caller replaces any one of them (a simulated gateway, a fake environment) without
touching the others (docs/decisions/0009-actor-factories.md). Each role has a `Protocol`
(`WriterActor`, `HydratorActor`, `GatewayActor`, `ExecutorActor`, `CoordinatorActor`), so a
fake is type-checked against what the supervisor and the other actors use.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import attrs
import trio

from treadle._budget import DEFAULT_SUMMARY_PROMPT
from treadle._clock import Clock
from treadle._state import RunView
from treadle.actors import (
    CANCEL_GRACE_S,
    CallModel,
    Chain,
    ContextHydrator,
    Control,
    EventWriter,
    Hydrate,
    KeepDecision,
    MailboxReceiver,
    MailboxSender,
    ModelGateway,
    RunActions,
    RunCoordinator,
    SinkFeed,
    ToolExecutor,
    WriterClient,
    WriterRequest,
    WriterStatistics,
)
from treadle.agent import Agent
from treadle.metrics import MetricsRecorder
from treadle.ports import EventSink, RunStore
from treadle.redaction import NO_REDACTION, Redaction
from treadle.types import (
    ActionOutcome,
    ApprovalRequested,
    RunResult,
    RunStarted,
    RunState,
    StepRecord,
)

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

    It reports each change of the run state (and of the approval it waits on) to the
    ``on_status`` of its `CoordinatorContext`, and takes cancels, decisions and drains only
    as `treadle.actors.Control` messages in its inbox (`serve_control`).
    """

    async def run(self, *, resumed_steps: tuple[StepRecord, ...] = ()) -> RunResult:
        """Run to the end, write run-finished (a barrier) and return the result."""
        ...

    async def serve_control(
        self,
        inbox: MailboxReceiver[Control],
        *,
        task_status: trio.TaskStatus[None] = ...,
    ) -> None:
        """Apply the control messages of ``inbox`` until it ends (started before `run`)."""
        ...

    def close_inboxes(self) -> None:
        """Close the inboxes of the hydrator, gateway and executor (they then return)."""
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
        tools: the names of the run's tools (from its parameter snapshot), for the
            metrics' ``tool`` label.
    """

    run_id: str
    store: RunStore
    next_seq: int
    sinks: Sequence[EventSink]
    generation: int = 0
    feed: SinkFeed | None = None
    redaction: Redaction = NO_REDACTION
    metrics: MetricsRecorder | None = None
    tools: frozenset[str] | None = None


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
        chain: that history as the check before the run's start read it
            (`treadle.actors.read_chain`), for its hydrator to take instead of reading it
            again: set for the first drive of a new thread run or fork in the call that
            started it; ``None`` otherwise (the hydrator reads it from ``store``).
        cancel_grace_s: seconds a cancelled tool call gets to finish before the executor
            abandons it (`treadle.actors.CANCEL_GRACE_S`; less in a child run,
            docs/child-runs.md "Cancellation").
        redaction: the run's secret tool arguments (the union over its snapshots; the
            coordinator binds an approval of a call shown with something hidden to a keyed
            digest, and has it learn each reply: `treadle.redaction.Redaction.learn`).
        digest_keys: the source of those digests' keys: ``n`` bytes a call; the OS's secure
            source, or a seeded run's random source (its log the same for a seed).
        generation: the run's lease generation under this drive (0 without a lease), which
            the executor hands each call as its fencing token (`treadle.ToolContext.generation`).
    """

    run_id: str
    agent: Agent
    started: RunStarted
    writer: WriterClient
    clock: Clock
    rng: random.Random
    store: RunStore | None = None
    chain: Chain | None = None
    cancel_grace_s: float = CANCEL_GRACE_S
    redaction: Redaction = NO_REDACTION
    digest_keys: Callable[[int], bytes] = secrets.token_bytes
    generation: int = 0


def _no_status(state: RunState, awaiting: ApprovalRequested | None) -> None:
    """Nobody is told."""


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
        park_at_deadline: park at an approval deadline instead of expiring the call at once
            (`treadle.actors.RunCoordinator`; set when the run has a control stream).
        carried_active_s: active seconds of a step interrupted by parking, to carry on.
        ended_children: for a run resumed onto a step with open calls, the outcomes of
            those whose child runs had finished, by intent id (`RunCoordinator`).
        on_status: ``on_status(state, awaiting)``: where the coordinator reports each change
            of the run state and of the approval request it waits on (the run's handle).
        read_control: reads the run's control stream once, now, before the coordinator takes
            a decision handed over by the run's handle (``None``: the store has no control
            streams; `RunCoordinator`).
        keep_decision: makes a decision handed over by the run's handle durable in the
            control stream and says which decision there counts (``None``: the store has no
            control streams; `treadle.actors.KeepDecision`).
    """

    actor: ActorContext
    view: RunView
    needs_approval: Callable[[str, Mapping[str, Any]], bool]
    hydrator: MailboxSender[Hydrate]
    gateway: MailboxSender[CallModel]
    executor: MailboxSender[RunActions]
    park_after_s: float | None = None
    park_at_deadline: bool = False
    carried_active_s: float = 0.0
    ended_children: Mapping[str, ActionOutcome] = attrs.Factory(dict)
    on_status: Callable[[RunState, ApprovalRequested | None], None] = _no_status
    read_control: Callable[[], Awaitable[Sequence[Control]]] | None = None
    keep_decision: KeepDecision | None = None


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
        tools=context.tools,
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
        chain=context.chain,
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
        cancel_grace_s=context.cancel_grace_s,
        generation=context.generation,
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
        park_at_deadline=context.park_at_deadline,
        carried_active_s=context.carried_active_s,
        ended_children=context.ended_children,
        compaction=agent.context_window is not None,
        synthetic=agent.synthetic,
        redaction=actor.redaction,
        digest_keys=actor.digest_keys,
        on_status=context.on_status,
        read_control=context.read_control,
        keep_decision=context.keep_decision,
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
