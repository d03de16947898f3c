"""The run coordinator alone: a real `RunCoordinator` whose hydrator, gateway, executor and
event writer are fakes serving its channels.

The coordinator has no inbox of its own: it is the client of the other four, and its run is
steered through `RunCoordinator.cancel` and `RunCoordinator.decide` (docs/design.md, "The five
actors").
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import AsyncIterator, Callable, Sequence

import attrs
import pytest
import trio
import trio.testing
from actor_fakes import TS, FakeWriter, start_fake_writer

from treadle._clock import FixedStepClock
from treadle._exceptions import SeamViolation
from treadle._state import RunView
from treadle.actors import (
    ActionsOutcome,
    CallModel,
    Cancel,
    Compaction,
    Control,
    Hydrate,
    MailboxSender,
    ModelOutcome,
    Offer,
    RunActions,
    RunCoordinator,
    open_mailbox,
    reply,
)
from treadle.approvals import decision_for
from treadle.parsers import NativeToolCallParser
from treadle.testing import call, say
from treadle.types import (
    ActionIntent,
    ActionOutcome,
    ActionResult,
    ActionStatus,
    ApprovalDecided,
    ApprovalRequested,
    Budgets,
    CancelRequested,
    Limits,
    Message,
    ModelErrorInfo,
    ModelIntent,
    ModelReply,
    ModelRequest,
    ModelResult,
    RunFinished,
    RunState,
    StepRecord,
    StopReason,
    StoreOp,
    ToolSpec,
)

TOOLS = (ToolSpec(name="add"), ToolSpec(name="wait"))


@attrs.define(eq=False)
class FakeHydrator:
    """Answers each `Hydrate` with a request of the new steps' count; keeps what it got."""

    seen: list[tuple[StepRecord, ...]] = attrs.Factory(list)

    async def run(self, inbox: trio.MemoryReceiveChannel[Hydrate]) -> None:
        async with inbox:
            async for message in inbox:
                self.seen.append(message.new_steps)
                text = f"{sum(len(s) for s in self.seen)} steps so far"
                reply(
                    message.reply_to, ModelRequest(messages=(Message(role="user", content=text),))
                )


@attrs.define(eq=False)
class FakeGateway:
    """Plays ``replies`` in order (a `ModelErrorInfo` fails the call for good); each call
    reports the intent and result it would have written."""

    replies: Sequence[ModelReply | ModelErrorInfo]
    calls: list[CallModel] = attrs.Factory(list)

    async def run(self, inbox: trio.MemoryReceiveChannel[CallModel]) -> None:
        async with inbox:
            async for message in inbox:
                reply(message.reply_to, self._outcome(message))

    def _outcome(self, message: CallModel) -> ModelOutcome:
        self.calls.append(message)
        scripted = self.replies[len(self.calls) - 1]
        attempt = message.step_attempts + 1
        intent = ModelIntent(
            run_id="r",
            step=message.step,
            intent_id=f"r/s{message.step}/m{attempt}",
            attempt=attempt,
            ts=TS,
        )
        if isinstance(scripted, ModelErrorInfo):
            result = ModelResult(
                run_id="r", step=message.step, intent_id=intent.intent_id, ts=TS, error=scripted
            )
            return ModelOutcome(error=scripted, written=(intent, result))
        result = ModelResult(
            run_id="r", step=message.step, intent_id=intent.intent_id, ts=TS, reply=scripted
        )
        return ModelOutcome(reply=scripted, intent_id=intent.intent_id, written=(intent, result))


@attrs.define(eq=False)
class FakeExecutor:
    """Executes ``add`` at once; ``wait`` waits until the step is cancelled, then answers as
    the real executor does (a late result). Keeps every request."""

    requests: list[RunActions] = attrs.Factory(list)

    async def run(self, inbox: trio.MemoryReceiveChannel[RunActions]) -> None:
        async with inbox:
            async for message in inbox:
                self.requests.append(message)
                reply(message.reply_to, await self._outcome(message))

    async def _outcome(self, message: RunActions) -> ActionsOutcome:
        intents = tuple(
            ActionIntent(
                run_id="r",
                step=message.step,
                intent_id=f"r/s{message.step}/a{i + 1}",
                call_id=c.id,
                tool=c.name,
                arguments=c.arguments,
                ts=TS,
            )
            for i, c in enumerate(message.calls)
        )
        if any(c.name == "wait" for c in message.calls):
            with message.scope.open():
                await trio.sleep_forever()
            results = tuple(
                ActionResult.unknown(i, observation="?", detail="", ts=TS, late=True)
                for i in intents
            )
            return ActionsOutcome(results=results, stop=StopReason.CANCELLED, written=intents)
        results = tuple(self._result(i, message) for i in intents)
        return ActionsOutcome(
            results=results,
            observations=tuple(r.outcome.observation for r in results),
            written=intents,
        )

    @staticmethod
    def _result(intent: ActionIntent, message: RunActions) -> ActionResult:
        detail = message.rejected.get(intent.call_id)
        if detail is not None:
            outcome = ActionOutcome(status=ActionStatus.NOT_EXECUTED, observation=detail)
        else:
            total = sum(int(v) for v in intent.arguments.values())
            outcome = ActionOutcome(status=ActionStatus.EXECUTED, observation=str(total))
        return ActionResult(
            run_id="r",
            step=intent.step,
            intent_id=intent.intent_id,
            call_id=intent.call_id,
            tool=intent.tool,
            outcome=outcome,
            ts=TS,
        )


@attrs.frozen
class Fakes:
    """The coordinator under test and the fakes on the other side of its channels."""

    coordinator: RunCoordinator
    writer: FakeWriter
    hydrator: FakeHydrator
    gateway: FakeGateway
    executor: FakeExecutor
    control: MailboxSender[Control]
    statuses: list[tuple[RunState, ApprovalRequested | None]]


@contextlib.asynccontextmanager
async def _alone(
    replies: Sequence[ModelReply | ModelErrorInfo],
    *,
    budgets: Budgets | None = None,
    needs_approval: Callable[[str, object], bool] = lambda tool, arguments: False,
    parser: object = None,
    hydrator: FakeHydrator | None = None,
) -> AsyncIterator[Fakes]:
    """A coordinator wired to fakes (unbuffered inboxes, as the real ones); the fakes end
    when the coordinator closes its inboxes, the fake writer on exit."""
    hydrator = hydrator or FakeHydrator()
    gateway, executor = FakeGateway(replies), FakeExecutor()
    async with trio.open_nursery() as nursery:
        writer, fake_writer = await start_fake_writer(nursery)
        channels = {}
        for name, fake in (("hydrator", hydrator), ("gateway", gateway), ("executor", executor)):
            send, recv = trio.open_memory_channel[object](0)
            nursery.start_soon(fake.run, recv)
            channels[name] = send
        statuses: list[tuple[RunState, ApprovalRequested | None]] = []
        coordinator = RunCoordinator(
            run_id="r",
            view=RunView(),
            parser=parser or NativeToolCallParser(),  # type: ignore[arg-type]
            tools=TOOLS,
            budgets=budgets or Budgets(),
            limits=Limits(approval_timeout_s=60.0),
            clock=FixedStepClock(),
            writer=writer,
            needs_approval=needs_approval,  # type: ignore[arg-type]
            on_status=lambda state, awaiting: statuses.append((state, awaiting)),
            **channels,  # type: ignore[arg-type]
        )
        control, control_inbox = open_mailbox[Control](16)
        await nursery.start(coordinator.serve_control, control_inbox)
        try:
            yield Fakes(coordinator, fake_writer, hydrator, gateway, executor, control, statuses)
        finally:
            coordinator.close_inboxes()
            control.close()
            writer.inbox.close()


def _add(call_id: str, a: int, b: int) -> ModelReply:
    return call("add", call_id=call_id, a=a, b=b)


async def test_steps_run_in_order_until_a_final_answer_and_run_finished_is_written():
    async with _alone([_add("c1", 1, 2), say("it is 3")]) as fakes:
        result = await fakes.coordinator.run()
    assert result.stop_reason is StopReason.FINAL_ANSWER and result.final_answer == "it is 3"
    assert fakes.coordinator.state is RunState.SUCCEEDED
    ops = [op for _, op, _ in fakes.writer.appended]
    assert ops == [StoreOp.STEP, StoreOp.STEP, StoreOp.RUN_FINISHED]
    (request,) = fakes.executor.requests
    assert [c.id for c in request.calls] == ["c1"]
    # the hydrator gets each step record once, in the request after it was written
    assert [[s.step for s in steps] for steps in fakes.hydrator.seen] == [[], [1]]
    first, second = fakes.writer.records(StepRecord)
    assert first.observations == ("3",) and second.model_output_text == "it is 3"  # type: ignore[attr-defined]
    # the counters are folded from what the other actors reported writing
    assert [c.run_attempts for c in fakes.gateway.calls] == [0, 1]


async def test_the_step_budget_ends_the_run_after_that_many_steps():
    replies = [_add(f"c{i}", i, i) for i in range(5)]
    async with _alone(replies, budgets=Budgets(max_steps=2)) as fakes:
        result = await fakes.coordinator.run()
    assert result.stop_reason is StopReason.MAX_STEPS
    assert len(fakes.gateway.calls) == 2 and len(fakes.executor.requests) == 2


async def test_a_model_call_that_failed_for_good_ends_the_run_with_its_error():
    failed = ModelErrorInfo(kind="bad_request", status=400)
    async with _alone([failed]) as fakes:
        result = await fakes.coordinator.run()
    assert result.stop_reason is StopReason.MODEL_ERROR
    (step,) = fakes.writer.records(StepRecord)
    assert step.decision is None  # type: ignore[attr-defined]
    (finished,) = fakes.writer.records(RunFinished)
    assert finished.model_error == failed  # type: ignore[attr-defined]
    assert fakes.executor.requests == []


async def test_cancel_reaches_the_action_in_flight_and_the_cancel_is_recorded(autojump_clock):
    async with _alone([call("wait", call_id="c1")]) as fakes, trio.open_nursery() as nursery:

        async def cancel_once_acting() -> None:
            await trio.testing.wait_all_tasks_blocked()
            assert len(fakes.executor.requests) == 1  # the action is in flight
            fakes.control.send_nowait(Cancel(reason="stop it", canceller="tester"))

        nursery.start_soon(cancel_once_acting)
        result = await fakes.coordinator.run()
    assert result.stop_reason is StopReason.CANCELLED
    assert fakes.coordinator.state is RunState.CANCELLED
    (cancel,) = fakes.writer.records(CancelRequested)
    assert (cancel.reason, cancel.canceller) == ("stop it", "tester")  # type: ignore[attr-defined]
    (late_step,) = fakes.writer.records(StepRecord)
    assert late_step.action_result_ids == ("r/s1/a1",)  # type: ignore[attr-defined]
    assert all(r.late for r in fakes.writer.records(ActionResult))  # type: ignore[attr-defined]


async def test_a_call_that_needs_approval_waits_for_the_decision_and_a_rejection_is_passed_on(
    autojump_clock,
):
    replies = [_add("c1", 5, 5), say("fine")]
    needs = {"needs_approval": lambda tool, arguments: tool == "add"}
    async with _alone(replies, **needs) as fakes, trio.open_nursery() as nursery:  # type: ignore[arg-type]

        async def decide_once_asked() -> None:
            await trio.testing.wait_all_tasks_blocked()
            state, awaiting = fakes.statuses[-1]  # as the coordinator reported it
            assert state is RunState.AWAITING_APPROVAL
            assert awaiting is not None and awaiting.call_id == "c1"
            decided = decision_for("r", awaiting, FixedStepClock(), reject="not today")
            fakes.control.send_nowait(Offer(decided=decided))

        nursery.start_soon(decide_once_asked)
        result = await fakes.coordinator.run()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert [type(r) for r in fakes.writer.records()][:2] == [ApprovalRequested, ApprovalDecided]
    (request,) = fakes.executor.requests
    assert request.rejected == {"c1": "not today"}


async def test_decisions_for_a_step_the_run_has_left_are_not_kept(autojump_clock):
    # A decision written for a step the run has already left can never match a request: the
    # coordinator kept every one of them for as long as the run lasted (days, in a service).
    replies = [_add("c1", 1, 1), _add("c2", 2, 2), say("fine")]
    needs = {"needs_approval": lambda tool, arguments: tool == "add"}
    async with _alone(replies, **needs) as fakes, trio.open_nursery() as nursery:  # type: ignore[arg-type]

        async def decide_each_request() -> None:
            for call_id in ("c1", "c2"):
                await trio.testing.wait_all_tasks_blocked()
                awaiting = fakes.statuses[-1][1]  # as the coordinator reported it
                assert awaiting is not None and awaiting.call_id == call_id
                if call_id == "c2":  # stale: for step 1, which the run has left
                    for index in range(50):
                        stale = attrs.evolve(
                            decision_for("r", awaiting, FixedStepClock()),
                            step=1,
                            call_id=f"stale-{index}",
                        )
                        await fakes.control.send(Offer(decided=stale))
                await fakes.control.send(
                    Offer(decided=decision_for("r", awaiting, FixedStepClock()))
                )
                await trio.sleep(1)  # the step goes on to its next request

        nursery.start_soon(decide_each_request)
        result = await fakes.coordinator.run()
    gc.collect()  # the coordinator is still alive (``fakes``); what it keeps is too
    kept = [
        o
        for o in gc.get_objects()
        if isinstance(o, ApprovalDecided) and o.call_id.startswith("stale-")
    ]
    assert kept == []
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert [d.call_id for d in fakes.writer.records(ApprovalDecided)] == ["c1", "c2"]  # type: ignore[attr-defined]


async def test_an_unanswered_approval_expires_at_its_deadline(autojump_clock):
    replies = [_add("c1", 5, 5), say("fine")]
    async with _alone(replies, needs_approval=lambda tool, arguments: True) as fakes:
        result = await fakes.coordinator.run()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    (decided,) = fakes.writer.records(ApprovalDecided)
    assert decided.decision == "expired"  # type: ignore[attr-defined]
    assert "c1" in fakes.executor.requests[0].rejected


@attrs.define
class _BrokenParser:
    def parse(self, reply: ModelReply, tools: Sequence[ToolSpec]) -> object:
        return "not a parsed reply"


async def test_a_parser_bug_interrupts_the_run_instead_of_ending_it():
    bug = pytest.RaisesExc(SeamViolation, match="decision parser")
    with pytest.RaisesGroup(bug, flatten_subgroups=True):
        async with _alone([say("hi")], parser=_BrokenParser()) as fakes:
            await fakes.coordinator.run()
    assert fakes.writer.records(RunFinished) == []


async def test_a_writer_that_fails_before_run_finished_is_durable_fails_the_run():
    with pytest.RaisesGroup(trio.EndOfChannel, flatten_subgroups=True):
        async with _alone([say("hi")]) as fakes:
            fakes.writer.fail_at = 2  # the step is written, run-finished is refused
            await fakes.coordinator.run()
    assert fakes.writer.records(RunFinished) == []
    assert len(fakes.writer.records(StepRecord)) == 1


async def test_a_compaction_answer_is_made_into_a_summary_call_before_the_step_call():
    """A `Compaction` from the hydrator is passed to the gateway as a summary request."""
    summary = ModelRequest(messages=(Message(role="user", content="summarise"),))

    @attrs.define(eq=False)
    class CompactingHydrator(FakeHydrator):
        asked: int = 0

        async def run(self, inbox: trio.MemoryReceiveChannel[Hydrate]) -> None:
            async with inbox:
                async for message in inbox:
                    self.asked += 1
                    answer: ModelRequest | Compaction = (
                        Compaction(request=summary, through=0)
                        if self.asked == 1
                        else ModelRequest(messages=(Message(role="user", content="go"),))
                    )
                    reply(message.reply_to, answer)

    replies = [say("the summary"), say("done")]
    async with _alone(replies, hydrator=CompactingHydrator()) as fakes:
        result = await fakes.coordinator.run()
    assert result.stop_reason is StopReason.FINAL_ANSWER and result.final_answer == "done"
    first, second = fakes.gateway.calls
    assert (first.request, first.summary_through) == (summary, 0)
    assert second.summary_through is None
