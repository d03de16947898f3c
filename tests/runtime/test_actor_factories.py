"""The run supervisor builds its five actors from `Actors` factories, swappable one by one."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import trio

from treadle import (
    Agent,
    FixedStepClock,
    MemoryStore,
    NativeToolCallParser,
    RunInterrupted,
    Toolbox,
    UsageError,
    tool,
)
from treadle.actors import ActionsOutcome, RunActions
from treadle.stores import record_to_json
from treadle.supervisors import (
    DEFAULT_ACTORS,
    ActorContext,
    Actors,
    CoordinatorContext,
    ExecutorActor,
    WriterContext,
    open_run,
    real_coordinator,
    real_executor,
    real_gateway,
    real_hydrator,
    real_writer,
    run,
)
from treadle.testing import ScriptedModel, call, say
from treadle.testing.simulation import DelayedActor, check_invariants, with_latency
from treadle.types import (
    ActionIntent,
    ActionOutcome,
    ActionResult,
    ActionStatus,
    Budgets,
    ModelIntent,
    ModelResult,
    RunLog,
    RunState,
    StopReason,
    StoreOp,
    Usage,
)


def _agent(executed: list[int], *, budgets: Budgets | None = None) -> Agent:
    @tool
    async def deposit(amount: int) -> str:
        """Deposit ``amount``."""
        executed.append(amount)
        return f"deposited {amount}"

    @tool(completes_task=True)
    async def finish() -> str:
        """Done."""
        return "done"

    model = ScriptedModel(
        turns=[
            call("deposit", call_id="c1", amount=3),
            call("deposit", call_id="c2", amount=4),
            say("all done", usage=Usage(input_tokens=10, output_tokens=2)),
        ],
        latency_s=0.05,
    )
    return Agent(
        model=model,
        executor=Toolbox([deposit, finish]),
        parser=NativeToolCallParser(),
        budgets=budgets or Budgets(),
    )


async def _run(agent: Agent, actors: Actors = DEFAULT_ACTORS, run_id: str = "r") -> RunLog:
    store = MemoryStore()
    await run(
        agent,
        "go",
        store=store,
        run_id=run_id,
        clock=FixedStepClock(),
        rng=random.Random(0),
        actors=actors,
    )
    return await store.read_log(run_id)


def _encoded(log: RunLog) -> list[str]:
    return [record_to_json(record) for record in log.records]


@attrs.define(eq=False)
class LedgerExecutorActor:
    """A fake tool executor: intents through the real writer, effects into a ledger.

    It never calls the agent's tools; it serves `RunActions` like the real executor: a
    rejected call gets no intent and a synthetic observation; an intent already in the log
    (resume) is not written again, and the ledger (which survives crashes) tells whether
    its effect happened.
    """

    context: ActorContext
    ledger: dict[str, dict[str, Any]]

    async def run(
        self,
        inbox: trio.MemoryReceiveChannel[RunActions],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        async with inbox:
            async for message in inbox:
                outcome = await self._serve(message)
                with message.reply_to:
                    message.reply_to.send_nowait(outcome)

    async def _serve(self, message: RunActions) -> ActionsOutcome:
        ctx = self.context
        logged = {intent.call_id: intent for intent in message.existing}
        written: list[ActionIntent] = []
        results: list[ActionResult] = []
        for index, tool_call in enumerate(message.calls):
            intent_id = f"{ctx.run_id}/s{message.step}/a{index + 1}"
            if tool_call.id in message.rejected:  # refused by a human: no intent, no effect
                text = ctx.agent.synthetic.rejected.format(
                    tool=tool_call.name, detail=message.rejected[tool_call.id]
                )
                outcome = ActionOutcome(
                    status=ActionStatus.NOT_EXECUTED,
                    observation=text,
                    observation_is_synthetic=True,
                )
            else:
                intent = logged.get(tool_call.id)
                if intent is None:
                    intent = ActionIntent(
                        run_id=ctx.run_id,
                        step=message.step,
                        intent_id=intent_id,
                        call_id=tool_call.id,
                        tool=tool_call.name,
                        arguments=tool_call.arguments,
                        ts=ctx.clock.now_iso(),
                    )
                    await ctx.writer.barrier(StoreOp.INTENT, intent)  # intent before effect
                    written.append(intent)
                intent_id = intent.intent_id
                if intent_id not in self.ledger:  # the ledger says whether it happened
                    self.ledger[intent_id] = dict(intent.arguments)
                outcome = ActionOutcome(
                    status=ActionStatus.EXECUTED, observation=f"ledger took {tool_call.name}"
                )
            results.append(
                ActionResult(
                    run_id=ctx.run_id,
                    step=message.step,
                    intent_id=intent_id,
                    call_id=tool_call.id,
                    tool=tool_call.name,
                    outcome=outcome,
                    ts=ctx.clock.now_iso(),
                )
            )
        return ActionsOutcome(
            results=tuple(results),
            observations=tuple(r.outcome.observation for r in results),
            written=tuple(written),
        )


def test_the_default_actors_are_the_real_ones():
    actors = Actors()
    assert actors == DEFAULT_ACTORS
    assert (actors.writer, actors.hydrator, actors.gateway, actors.executor) == (
        real_writer,
        real_hydrator,
        real_gateway,
        real_executor,
    )
    assert actors.coordinator is real_coordinator


async def test_default_path_is_unchanged_byte_for_byte(autojump_clock):
    implicit = await _run(_agent([]))
    explicit = await _run(_agent([]), Actors())
    spelled_out = await _run(
        _agent([]),
        Actors(
            writer=real_writer,
            hydrator=real_hydrator,
            gateway=real_gateway,
            executor=real_executor,
            coordinator=real_coordinator,
        ),
    )
    assert _encoded(implicit) == _encoded(explicit) == _encoded(spelled_out)
    assert implicit.finished is not None
    assert implicit.finished.stop_reason is StopReason.FINAL_ANSWER
    assert [s.observations for s in implicit.steps][:2] == [("deposited 3",), ("deposited 4",)]


async def test_a_fake_executor_alone_is_driven_by_the_real_coordinator_gateway_and_writer():
    executed: list[int] = []
    ledger: dict[str, dict[str, Any]] = {}

    def fake_executor(context: ActorContext) -> ExecutorActor:
        return LedgerExecutorActor(context=context, ledger=ledger)

    log = await _run(_agent(executed), Actors(executor=fake_executor))
    assert executed == []  # the agent's own tools never ran
    assert ledger == {"r/s1/a1": {"amount": 3}, "r/s2/a1": {"amount": 4}}
    assert [s.observations for s in log.steps][:2] == [
        ("ledger took deposit",),
        ("ledger took deposit",),
    ]
    # The real gateway wrote its intents, the real writer kept the log consistent, and
    # the real coordinator wrote the step records with the fake's results.
    assert sum(isinstance(r, ModelIntent) for r in log.records) == 3
    assert check_invariants(log) == []
    kinds = [type(r).__name__ for r in log.records]
    first_effect = kinds.index("ActionIntent")
    assert kinds[first_effect : first_effect + 3] == ["ActionIntent", "ActionResult", "StepRecord"]


async def test_a_fake_executor_is_rebuilt_on_resume_and_its_intents_are_honoured(autojump_clock):
    ledger: dict[str, dict[str, Any]] = {}
    built: list[str] = []

    def fake_executor(context: ActorContext) -> ExecutorActor:
        built.append(context.run_id)
        return LedgerExecutorActor(context=context, ledger=ledger)

    store = MemoryStore()
    agent = _agent([])
    with trio.move_on_after(0.12):  # inside step 3's model call: both deposits are done
        await run(agent, "go", store=store, run_id="r", actors=Actors(executor=fake_executor))
    result = await run(agent, store=store, run_id="r", actors=Actors(executor=fake_executor))
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert built == ["r", "r"]
    assert list(ledger) == ["r/s1/a1", "r/s2/a1"]
    log = await store.read_log("r")
    assert sum(isinstance(r, ActionIntent) for r in log.records) == 2  # nothing re-run
    assert any(isinstance(r, ModelResult) and r.abandoned for r in log.records)
    assert check_invariants(log) == []


async def test_every_factory_gets_its_context_in_order():
    seen: list[tuple[str, Any]] = []

    def recording(name: str, factory: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def build(context: Any) -> Any:
            seen.append((name, context))
            return factory(context)

        return build

    actors = Actors(
        writer=recording("writer", real_writer),
        hydrator=recording("hydrator", real_hydrator),
        gateway=recording("gateway", real_gateway),
        executor=recording("executor", real_executor),
        coordinator=recording("coordinator", real_coordinator),
    )
    log = await _run(_agent([]), actors)
    assert [name for name, _ in seen] == [
        "writer",
        "hydrator",
        "gateway",
        "executor",
        "coordinator",
    ]
    writer_ctx, hydrator_ctx = seen[0][1], seen[1][1]
    coordinator_ctx = seen[4][1]
    assert isinstance(writer_ctx, WriterContext) and writer_ctx.next_seq == 1
    assert isinstance(hydrator_ctx, ActorContext) and hydrator_ctx.started == log.started
    assert isinstance(coordinator_ctx, CoordinatorContext)
    assert coordinator_ctx.actor is hydrator_ctx
    assert coordinator_ctx.needs_approval("deposit", {"amount": 1}) is False


async def test_seeded_latency_in_front_of_the_gateway_is_deterministic_and_counts_as_active_time(
    autojump_clock,
):
    delays: list[float] = []
    actors = Actors(gateway=with_latency(real_gateway, seed=5, max_s=0.5, on_delay=delays.append))
    first = await _run(_agent([]), actors)
    again = await _run(_agent([]), Actors(gateway=with_latency(real_gateway, seed=5, max_s=0.5)))
    plain = await _run(_agent([]))
    assert _encoded(first) == _encoded(again)
    assert len(delays) == 3 and all(0 <= d <= 0.5 for d in delays)
    # What the model saw and did is unchanged; the delay is active time of its step.
    assert [s.observations for s in first.steps] == [s.observations for s in plain.steps]
    for step, delay in zip(first.steps, delays, strict=True):
        assert step.active_s == pytest.approx(0.05 + delay, abs=1e-6)


async def test_latency_waits_inside_the_step_scope_so_the_time_budget_still_holds(autojump_clock):
    actors = Actors(executor=with_latency(real_executor, seed=1, max_s=100.0))
    executed: list[int] = []
    agent = _agent(executed, budgets=Budgets(time_budget_s=1.0))
    store = MemoryStore()
    async with open_run(agent, "go", store=store, run_id="r", actors=actors) as handle:
        result = await handle.wait()
    assert result.stop_reason is StopReason.TIME_BUDGET
    assert result.totals.active_s == pytest.approx(1.0, abs=1e-3)
    assert executed == []  # cut while delayed: the action never reached the executor
    log = await store.read_log("r")
    assert check_invariants(log, budgets=agent.budgets) == []


def test_with_latency_refuses_bad_rates():
    with pytest.raises(ValueError, match="rate"):
        with_latency(real_gateway, seed=1, rate=1.5)
    for rate in (True, False, "0.5", float("nan")):  # True was taken as a rate of 1
        with pytest.raises(UsageError, match=f"rate must be a number within 0..1, not {rate!r}"):
            with_latency(real_gateway, seed=1, rate=rate)  # type: ignore[arg-type]
    built = with_latency(real_hydrator, seed=1, rate=0.0)
    assert callable(built)
    assert DelayedActor.__name__ == "DelayedActor"


@pytest.mark.parametrize("max_s", [float("nan"), float("inf"), -1.0])
def test_with_latency_refuses_a_longest_delay_that_is_no_finite_duration(max_s: float) -> None:
    """Refused at the call, not by the run that draws a delay from it later."""
    with pytest.raises(UsageError, match=r"max_s must be a finite number of seconds"):
        with_latency(real_gateway, seed=1, rate=1.0, max_s=max_s)


class CountingWriter:
    """A swapped writer: the real one inside, whose sink feed counted failures already."""

    def __init__(self, context):
        self.inner = real_writer(context)
        self.inner.feed.sink_failures, self.inner.feed.sink_drops = 7, 3

    async def run(self, inbox, *, task_status=trio.TASK_STATUS_IGNORED):
        await self.inner.run(inbox, task_status=task_status)

    def statistics(self):
        return self.inner.statistics()


async def test_the_writer_stamps_its_own_delivery_counters_into_run_finished():
    """The coordinator does not ask the writer for its counters: the writer that writes the
    run-finished record puts its counters in (a swapped one, its own)."""
    agent = Agent(
        model=ScriptedModel(turns=[say("done")]),
        executor=Toolbox([]),
        parser=NativeToolCallParser(),
    )
    store = MemoryStore()
    await run(agent, "x", store=store, run_id="r", actors=Actors(writer=CountingWriter))
    finished = (await store.read_log("r")).finished
    assert (finished.sink_failures, finished.sink_drops) == (7, 3)


async def test_the_fake_executor_honours_a_rejection_and_an_intent_left_by_a_crash(
    autojump_clock,
):
    from treadle._exceptions import RunInterrupted
    from treadle.testing.faults import CrashingStore, SimulatedCrash

    ledger: dict[str, dict[str, Any]] = {}

    def fake_executor(context: ActorContext) -> ExecutorActor:
        return LedgerExecutorActor(context=context, ledger=ledger)

    actors = Actors(executor=fake_executor)
    store = MemoryStore()
    agent = _agent([])
    # Writes: run started, model intent, model result, action intent; die right after the
    # intent, before the effect.
    with pytest.raises((SimulatedCrash, RunInterrupted)):
        await run(
            agent,
            "go",
            store=CrashingStore(inner=store, crash_at=4, when="after"),
            run_id="r",
            actors=actors,
            approval_policy=lambda tool, arguments: arguments.get("amount") == 4,
        )
    assert ledger == {}
    async with open_run(
        agent,
        store=store,
        run_id="r",
        actors=actors,
        approval_policy=lambda tool, arguments: arguments.get("amount") == 4,
    ) as handle:
        with trio.fail_after(60):
            await handle.wait_state(RunState.AWAITING_APPROVAL)
        handle.approve(reject="not four")
        await handle.wait()
    log = await store.read_log("r")
    assert ledger == {"r/s1/a1": {"amount": 3}}  # applied once, after the resume; c2 refused
    assert [r.call_id for r in log.records if isinstance(r, ActionIntent)] == ["c1"]
    assert check_invariants(log) == []


@attrs.define(eq=False)
class _StopsServing:
    """A fake actor that either returns once started or takes requests and never answers."""

    returns: bool

    async def run(self, inbox: Any, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        if self.returns:
            return
        async for _ in inbox:  # each reply slot is dropped unanswered
            pass


@pytest.mark.parametrize("role", ["hydrator", "gateway", "executor"])
async def test_an_actor_that_returns_while_the_run_needs_it_fails_the_run_naming_it(
    role: str, autojump_clock: Any
) -> None:
    """Its inbox was never read again: the run waited for the reply for good."""
    actors = attrs.evolve(DEFAULT_ACTORS, **{role: lambda ctx: _StopsServing(returns=True)})
    store = MemoryStore()
    with trio.fail_after(3600), pytest.raises(RunInterrupted, match=r"actor returned while"):
        await run(_agent([]), "go", store=store, run_id="r", actors=actors)
    assert (await store.read_log("r")).finished is None  # left resumable


@pytest.mark.parametrize(
    ("role", "actor"), [("hydrator", "context hydrator"), ("gateway", "model gateway")]
)
async def test_a_cancel_ends_a_run_whose_actor_never_answers(
    role: str, actor: str, autojump_clock: Any
) -> None:
    """Neither the time budget (none here) nor a cancel reached a request the actor took
    and never answered: the run hung for good. Now the wait ends 7 s after the cancel."""
    actors = attrs.evolve(DEFAULT_ACTORS, **{role: lambda ctx: _StopsServing(returns=False)})
    async with open_run(_agent([]), "go", store=MemoryStore(), run_id="r", actors=actors) as handle:
        await trio.sleep(60)
        assert handle.state is RunState.RUNNING  # it waits for the actor: no deadline
        cancelled_at = trio.current_time()
        handle.cancel("test")
        with (
            trio.fail_after(3600),
            pytest.raises(RunInterrupted, match=f"the {actor} actor did not answer 7 s after"),
        ):
            await handle.wait()
        assert trio.current_time() - cancelled_at == pytest.approx(7.0)
