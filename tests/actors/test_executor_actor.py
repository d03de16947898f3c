"""The tool executor alone: a real `ToolExecutor` with a recording action executor and a
fake writer.

The test plays the coordinator (`RunActions` requests through the executor's inbox with
`treadle.actors._rpc.request`); a `FakeWriter` plays the event writer (docs/design.md,
"The five actors").
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing
from actor_fakes import TS, FakeWriter, RecordingExecutor, start_fake_writer
from outcome import Value

from treadle._clock import FixedStepClock
from treadle._exceptions import SeamViolation, UsageError
from treadle._toolhost import leave_thread
from treadle.actors import ActionsOutcome, RunActions, StepScope, ToolExecutor, request
from treadle.types import (
    Action,
    ActionIntent,
    ActionOutcome,
    ActionStatus,
    Limits,
    StopReason,
    StoreOp,
    SyntheticObservations,
    ToolCall,
)

SYNTHETIC = SyntheticObservations()


@contextlib.asynccontextmanager
async def _alone(
    executor: RecordingExecutor, fake: FakeWriter | None = None, **limits: float
) -> AsyncIterator[tuple[trio.MemorySendChannel[RunActions], FakeWriter]]:
    """The tool executor actor, started alone behind a fake writer.

    On exit its inbox is closed and the block waits for the actor to return on its own, then
    closes the fake writer's inbox.
    """
    async with trio.open_nursery() as outer:
        writer, fake = await start_fake_writer(outer, fake)
        actor = ToolExecutor(
            run_id="r",
            executor=executor,
            writer=writer,
            clock=FixedStepClock(),
            limits=Limits(**limits),  # type: ignore[arg-type]
            synthetic=SYNTHETIC,
            observation_template="[{tool}] {observation}",
            cancel_grace_s=2.0,
        )
        # 0: the executor's inbox is unbuffered (docs/design.md, "The five actors").
        send, recv = trio.open_memory_channel[RunActions](0)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(actor.run, recv)
                async with send:
                    yield send, fake
        finally:
            writer.inbox.close()


async def _run(
    inbox: trio.MemorySendChannel[RunActions],
    *calls: ToolCall,
    scope: StepScope | None = None,
    **fields: object,
) -> ActionsOutcome:
    """One `RunActions` of step 1 through the executor's inbox, as the coordinator sends it."""
    fields.setdefault("existing", ())
    outcome: ActionsOutcome = await request(
        inbox,
        lambda reply_to: RunActions(
            step=1,
            calls=calls,
            scope=scope or StepScope(),
            reply_to=reply_to,
            **fields,  # type: ignore[arg-type]
        ),
    )
    return outcome


def _add(call_id: str, a: int, b: int) -> ToolCall:
    return ToolCall(id=call_id, name="add", arguments={"a": a, "b": b})


def _intent(index: int, call: ToolCall) -> ActionIntent:
    return ActionIntent(
        run_id="r",
        step=1,
        intent_id=f"r/s1/a{index}",
        call_id=call.id,
        tool=call.name,
        arguments=call.arguments,
        ts=TS,
    )


async def test_each_intent_is_durable_before_its_call_and_results_come_in_call_order():
    tools = RecordingExecutor()
    async with _alone(tools) as (inbox, fake):
        outcome = await _run(inbox, _add("c1", 1, 2), _add("c2", 3, 4))
    assert [r.intent_id for r in fake.records(ActionIntent)] == ["r/s1/a1", "r/s1/a2"]
    assert {op for _, op, _ in fake.appended} == {StoreOp.INTENT}
    assert outcome.written == tuple(fake.records())
    assert [r.call_id for r in outcome.results] == ["c1", "c2"]
    assert [r.outcome.observation for r in outcome.results] == ["3", "7"]
    assert outcome.observations == ("[add] 3", "[add] 7")  # through the template
    assert outcome.stop is None and len(tools.calls) == 2


class ReportingExecutor(RecordingExecutor):
    """An action executor whose ``add`` reports active seconds spent elsewhere.

    It reports ``a`` seconds (as a child run's would be), then a negative number, which is
    refused; ``refused`` keeps what each refusal said.
    """

    refused: list[str]

    def __init__(self) -> None:
        super().__init__()
        self.refused = []

    async def execute(self, action: Action) -> ActionOutcome:
        """Report, then add."""
        if action.tool == "add" and action.report_active_s is not None:
            action.report_active_s(float(action.arguments["a"]))
            try:
                action.report_active_s(-1.0)
            except UsageError as exc:
                self.refused.append(str(exc))
        return await super().execute(action)


async def test_the_step_is_handed_the_most_active_time_its_calls_reported():
    """The coordinator is handed the most active seconds the step's calls reported.

    Calls that run at once report the active seconds another log records (a child run's);
    a report that is no duration is refused in the call that makes it.
    """
    tools = ReportingExecutor()
    async with _alone(tools) as (inbox, _):
        outcome = await _run(inbox, _add("c1", 2, 0), _add("c2", 7, 0), _add("c3", 5, 0))
        alone = await _run(inbox, ToolCall(id="c4", name="write", arguments={}))
    assert outcome.reported_active_s == 7.0
    assert alone.reported_active_s == 0.0  # a call that reports nothing
    assert len(tools.refused) == 3
    assert all("finite number of seconds >= 0, not -1.0" in text for text in tools.refused)


async def test_a_rejected_call_gets_no_intent_and_never_runs():
    tools = RecordingExecutor()
    async with _alone(tools) as (inbox, fake):
        outcome = await _run(inbox, _add("c1", 1, 2), _add("c2", 5, 5), rejected={"c2": "too much"})
    assert [r.call_id for r in fake.records(ActionIntent)] == ["c1"]
    assert [a.call_id for a in tools.calls] == ["c1"]
    rejected = outcome.results[1].outcome
    assert rejected.status is ActionStatus.NOT_EXECUTED
    assert outcome.observations[1] == SYNTHETIC.rejected.format(tool="add", detail="too much")


async def test_on_resume_a_never_call_is_reconciled_and_a_safe_call_replayed():
    tools = RecordingExecutor(safe=frozenset({"add"}))
    write = ToolCall(id="c1", name="write")
    add = _add("c2", 2, 2)
    async with _alone(tools) as (inbox, fake):
        outcome = await _run(inbox, write, add, existing=(_intent(1, write), _intent(2, add)))
    assert fake.appended == []  # both intents were already in the log
    assert [a.tool for a in tools.reconciled] == ["write"]
    assert [(a.tool, a.replay) for a in tools.calls] == [("add", True)]
    unknown = outcome.results[0]
    assert unknown.outcome.status is ActionStatus.UNKNOWN and not unknown.late
    assert outcome.results[1].outcome.observation == "4"


async def test_a_call_past_its_timeout_is_cancelled_and_says_so(autojump_clock):
    tools = RecordingExecutor()
    async with _alone(tools, tool_timeout_s=3.0) as (inbox, _):
        before = trio.current_time()
        outcome = await _run(inbox, ToolCall(id="c1", name="wait"))
        took = trio.current_time() - before
    (result,) = outcome.results
    assert result.outcome.observation == "Error: the call to wait timed out after 3 s"
    assert 3.0 <= took < 3.0 + 1.0


async def test_cancelling_the_step_ends_the_call_in_flight_with_a_late_result(autojump_clock):
    tools = RecordingExecutor()
    scope = StepScope()

    async def cancel_once_running() -> None:
        await trio.testing.wait_all_tasks_blocked()  # the call is in flight
        assert [a.tool for a in tools.calls] == ["wait"]
        scope.cancel("user cancel")

    async with trio.open_nursery() as nursery, _alone(tools) as (inbox, fake):
        nursery.start_soon(cancel_once_running)
        outcome = await _run(inbox, ToolCall(id="c1", name="wait"), scope=scope)
    assert outcome.stop is StopReason.CANCELLED
    (result,) = outcome.results
    assert result.late and result.intent_id == fake.records(ActionIntent)[0].intent_id


async def test_a_step_cancelled_before_it_starts_runs_nothing(autojump_clock):
    tools = RecordingExecutor()
    scope = StepScope()
    scope.cancel("cancelled already")
    async with _alone(tools) as (inbox, _):
        outcome = await _run(inbox, _add("c1", 1, 1), scope=scope)
    assert outcome.stop is StopReason.CANCELLED and tools.calls == []


async def test_an_executor_answering_something_else_fails_the_actor():
    tools = RecordingExecutor()
    with pytest.RaisesGroup(SeamViolation, flatten_subgroups=True):
        async with _alone(tools) as (inbox, _):
            await _run(inbox, ToolCall(id="c1", name="odd"))


async def test_an_executor_that_raises_fails_the_actor():
    """A raw action executor's exception is a seam bug: the run stops (a `Toolbox` turns a
    tool's exception into an outcome before it gets here)."""
    tools = RecordingExecutor()
    with pytest.RaisesGroup(RuntimeError, flatten_subgroups=True):
        async with _alone(tools) as (inbox, _):
            await _run(inbox, ToolCall(id="c1", name="boom"))


async def test_no_call_runs_when_its_intent_cannot_be_written():
    tools = RecordingExecutor()
    with pytest.RaisesGroup(trio.EndOfChannel, flatten_subgroups=True):
        async with _alone(tools, FakeWriter(fail_at=1)) as (inbox, _):
            await _run(inbox, _add("c1", 1, 1))
    assert tools.calls == []


async def test_a_reconcile_that_answers_something_else_fails_the_actor():
    """The error named ``execute`` as what returned the text."""
    tools = RecordingExecutor(reconcile_with="found it")  # type: ignore[arg-type]
    write = ToolCall(id="c1", name="write")
    with pytest.RaisesGroup(
        pytest.RaisesExc(SeamViolation, match="reconcile returned str, not an ActionOutcome"),
        flatten_subgroups=True,
    ):
        async with _alone(tools) as (inbox, _):
            await _run(inbox, write, existing=(_intent(1, write),))


async def test_a_reconcile_that_cannot_tell_gets_the_synthetic_unknown_text():
    """Its own text entered history, unlike every other unknown outcome after a resume."""
    dunno = ActionOutcome(status=ActionStatus.UNKNOWN, observation="dunno")
    tools = RecordingExecutor(reconcile_with=dunno)
    write = ToolCall(id="c1", name="write")
    async with _alone(tools) as (inbox, _):
        outcome = await _run(inbox, write, existing=(_intent(1, write),))
    (result,) = outcome.results
    assert result.outcome.status is ActionStatus.UNKNOWN
    assert outcome.observations[0] == SYNTHETIC.unknown.format(tool="write", detail="")
    assert result.outcome.observation_is_synthetic and result.outcome.detail == "dunno"


class UnknownAnswers(RecordingExecutor):
    """An action executor whose ``write`` answers UNKNOWN itself; with ``leave_thread`` it
    first gives up on a worker thread that runs on, as `treadle.Toolbox` does at a thread
    tool's timeout."""

    def __init__(self, *, leave_thread: bool) -> None:
        super().__init__()
        self.leave_thread = leave_thread

    async def execute(self, action: Action) -> ActionOutcome:
        """Answer UNKNOWN for ``write``, else as the recording executor does."""
        if action.tool != "write":
            return await super().execute(action)
        await trio.lowlevel.checkpoint()
        if self.leave_thread:
            stray = leave_thread("a call of write")
            stray.ended(Value("written later"))  # its thread ends: counted no more
        return ActionOutcome(status=ActionStatus.UNKNOWN, observation="job state unknown")


@pytest.mark.parametrize("leave", [False, True])
async def test_a_call_is_late_only_when_the_run_stopped_waiting_while_it_ran(leave):
    """An executor's own UNKNOWN answer (a remote job's state unknown, a process that died)
    was recorded late, as if the run had stopped waiting for the call: `treadle show` said
    "not applied" of an observation the model was given."""
    tools = UnknownAnswers(leave_thread=leave)
    async with _alone(tools) as (inbox, _):
        answered = await _run(inbox, ToolCall(id="c1", name="write"))
    (result,) = answered.results
    assert result.outcome.status is ActionStatus.UNKNOWN and result.late is leave
    assert answered.stop is None and answered.observations == ("[write] job state unknown",)


class StubbornReconcile(RecordingExecutor):
    """A reconcile hook that shields itself until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = trio.Event()
        self.ended = False

    async def reconcile(self, action: Action) -> ActionOutcome | None:
        with trio.CancelScope(shield=True):
            await self.release.wait()
        self.ended = True
        return None


@pytest.mark.parametrize("cut", ["timeout", "cancel"])
async def test_a_reconcile_ignoring_cancellation_cannot_hold_the_step(cut, autojump_clock):
    """It was awaited in the step itself: a shielded hook held the run past its timeout, the
    time budget and a cancel."""
    tools = StubbornReconcile()
    scope = StepScope()
    write = ToolCall(id="c1", name="write")

    async def cancel_once_waiting() -> None:
        await trio.testing.wait_all_tasks_blocked()
        scope.cancel("user cancel")

    async with trio.open_nursery() as nursery, _alone(tools, tool_timeout_s=3.0) as (inbox, _):
        if cut == "cancel":
            nursery.start_soon(cancel_once_waiting)
        try:
            with trio.fail_after(60):
                outcome = await _run(inbox, write, existing=(_intent(1, write),), scope=scope)
            assert not tools.ended  # the step answered while the hook still runs
        finally:
            tools.release.set()
    (result,) = outcome.results
    assert result.outcome.status is ActionStatus.UNKNOWN
    assert outcome.stop is (StopReason.CANCELLED if cut == "cancel" else None)


async def test_a_reconciled_call_keeps_what_reconcile_found():
    found = ActionOutcome(status=ActionStatus.EXECUTED, observation="it was written")
    tools = RecordingExecutor(reconcile_with=found)
    write = ToolCall(id="c1", name="write")
    async with _alone(tools) as (inbox, _):
        outcome = await _run(inbox, write, existing=(_intent(1, write),))
    (result,) = outcome.results
    assert result.reconciled and result.outcome.observation == "it was written"
    assert tools.calls == []
