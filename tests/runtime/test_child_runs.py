"""Child runs (docs/child-runs.md): a tool call that runs another agent, end to end.

Every test drives a real parent run whose tool call starts a real child run on a real store,
through the five actors of each.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import pytest
import trio

from treadle import agent_tool, child_run_id, finish_cancelled
from treadle._exceptions import ChildRunInterrupted, RunInterrupted, StoreError, UsageError
from treadle.agent import Agent
from treadle.approvals import read_control, request_cancel
from treadle.parsers import NativeToolCallParser
from treadle.stores.memory import MemoryStore
from treadle.stores.sqlite import SqliteStore
from treadle.supervisors import CHILD_CANCEL_GRACE_S, open_fleet, open_run, run
from treadle.testing import InterceptingStore
from treadle.testing.faults import CrashingStore, FailingStore, SimulatedCrash
from treadle.testing.invariants import check_invariants
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.tools import Toolbox, ToolContext, tool
from treadle.types import (
    ActionIntent,
    ActionResult,
    ActionStatus,
    Budgets,
    CancelRequested,
    EventKind,
    Limits,
    Liveness,
    ModelReply,
    ReplayPolicy,
    RunLog,
    RunResult,
    RunStarted,
    RunState,
    StepRecord,
    StopReason,
    Usage,
)


@asynccontextmanager
async def open_store_at(path):
    store = await SqliteStore.open(path)
    try:
        yield store
    finally:
        await store.aclose()


USAGE = Usage(input_tokens=10, output_tokens=5)


def use(name: str, call_id: str, **arguments) -> ModelReply:
    """A one-call reply that reports ``USAGE``."""
    return attrs.evolve(call(name, call_id=call_id, **arguments), usage=USAGE)


def waiting_child(started: trio.Event):
    """A child whose one tool call sets ``started`` and then waits until it is cancelled."""

    @tool
    async def wait_forever(ctx: ToolContext) -> str:
        """Wait (forever)."""
        started.set()
        await trio.sleep_forever()
        return "never"

    return attrs.evolve(
        child_agent(turns=[call("wait_forever", call_id="w1"), say("never")]),
        executor=Toolbox([wait_forever]),
    )


def paying_child(reached: trio.Event, effects: list[str]) -> Agent:
    """A child whose ``pay`` call records its intent id in ``effects`` (its effect); the
    first call then sets ``reached`` and waits until cancelled, a later one returns."""

    @tool
    async def pay(ctx: ToolContext) -> str:
        """Pay, then wait until the drive stops (the first time)."""
        effects.append(ctx.intent_id)
        if len(effects) == 1:
            reached.set()
            await trio.sleep_forever()
        return "paid"

    return attrs.evolve(
        child_agent(turns=[call("pay", call_id="p1"), say("done")]),
        executor=Toolbox([pay]),
    )


async def _stop_the_parent_while_its_child_pays(store, child: Agent, reached: trio.Event) -> None:
    """Drive parent ``p`` until its child's call paid, then stop the drive (neither run is
    cancelled: both are left unfinished)."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            functools.partial(run, parent_agent(store, child), "go", store=store, run_id="p")
        )
        await reached.wait()
        nursery.cancel_scope.cancel()


def child_agent(*, gate: trio.Event | None = None, executed: list[str] | None = None, turns=None):
    """The child: one tool call (``note``, recorded in ``executed``), then its answer."""
    done = executed if executed is not None else []

    @tool
    async def note(text: str, ctx: ToolContext) -> str:
        """Write a note (an effect).

        Args:
            text: the note.
            ctx: the call.
        """
        if gate is not None:
            await gate.wait()
        done.append(ctx.intent_id)
        return f"noted {text}"

    script = turns or [
        use("note", "n1", text="hello"),
        say("the child's answer", usage=USAGE),
    ]
    return Agent(
        model=ScriptedModel(turns=script),
        executor=Toolbox([note]),
        parser=NativeToolCallParser(),
        model_name="child-model",
        system_prompt="You are the child.",
    )


OWNER = "test-owner"


def parent_agent(store, child: Agent, *, budgets=None, limits=None, turns=None, owner=None):
    helper = agent_tool(
        child, store=store, name="helper", description="Ask the helper agent.", owner=owner
    )
    script = turns or [
        use("helper", "h1", task="do the thing"),
        say("the parent's answer", usage=USAGE),
    ]
    return Agent(
        model=ScriptedModel(turns=script),
        executor=Toolbox([helper]),
        parser=NativeToolCallParser(),
        model_name="parent-model",
        system_prompt="You are the parent.",
        budgets=budgets or Budgets(),
        limits=limits or Limits(),
    )


def test_child_run_id_is_derived_from_the_intent_id():
    assert child_run_id("p/s1/a2") == "p/s1/a2/child"
    long = "r" * 195 + "/s1/a1"
    derived = child_run_id(long)
    assert derived.startswith("child-") and len(derived) == 38
    assert derived == child_run_id(long) != child_run_id("r" * 195 + "/s1/a2")


async def test_a_tool_call_runs_a_child_and_returns_its_answer():
    store = MemoryStore()
    executed: list[str] = []
    result = await run(
        parent_agent(store, child_agent(executed=executed)), "go", store=store, run_id="p"
    )
    assert result.state is RunState.SUCCEEDED
    kid = child_run_id("p/s1/a1")
    assert executed == [f"{kid}/s1/a1"]
    child = await store.read_log(kid)
    assert child.finished is not None and child.finished.state is RunState.SUCCEEDED
    started = child.records[0]
    assert isinstance(started, RunStarted)
    assert (started.parent_run_id, started.parent_intent_id) == ("p", "p/s1/a1")
    assert started.input[0].content == "do the thing"
    parent = await store.read_log("p")
    action = next(r for r in parent.records if isinstance(r, ActionResult))
    assert action.outcome.observation == "the child's answer"
    assert action.outcome.child_run_id == kid
    # The child's tokens count in the parent's totals; none of its records are in the parent's log.
    assert result.totals.input_tokens == 2 * 10 + 2 * 10
    assert all(r.run_id == "p" for r in parent.records)


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def store(request, tmp_path):
    if request.param == "memory":
        yield MemoryStore()
        return
    if request.param == "postgres":
        from treadle.stores.postgres import open_postgres_store

        dsn = request.getfixturevalue("postgres_dsn")
        schema = request.getfixturevalue("postgres_schema")
        async with open_postgres_store(dsn, schema=schema) as opened:
            yield opened
        return
    opened = await SqliteStore.open(tmp_path / "runs.db")
    try:
        yield opened
    finally:
        await opened.aclose()


async def test_a_childs_unknown_usage_stays_unknown_in_its_parent(store):
    # The child's two model attempts reported no usage: the parent's action result said
    # nothing of them, and its totals claimed every token known (0 unknown attempts).
    unreported = child_agent(
        turns=[
            attrs.evolve(call("note", call_id="n1", text="hi"), usage=Usage()),
            say("answer", usage=Usage()),
        ]
    )
    result = await run(parent_agent(store, unreported), "go", store=store, run_id="p")
    child_log = await store.read_log(child_run_id("p/s1/a1"))
    assert child_log.finished is not None
    assert child_log.finished.totals.unknown_usage_attempts == 2
    totals = result.totals
    assert (totals.input_tokens, totals.output_tokens, totals.unknown_usage_attempts) == (20, 10, 2)
    log = await store.read_log("p")
    action = next(r for r in log.records if isinstance(r, ActionResult))
    assert (action.outcome.usage, action.outcome.unknown_usage_attempts) == (None, 2)
    assert check_invariants(log) == []


async def test_the_parents_events_carry_the_childs_live_with_their_own_run_id_and_seq(store):
    parent = parent_agent(store, child_agent())
    events = []
    # The call waits for a human: the child starts only once this subscriber has seen that.
    async with open_run(
        parent, "go", store=store, run_id="p", approval_policy=lambda tool, arguments: True
    ) as handle:
        async for event in handle.events():
            events.append(event)
            if event.kind is EventKind.APPROVAL_REQUESTED:
                handle.approve()
    kid = child_run_id("p/s1/a1")
    by_run: dict[str, list[int]] = {}
    for event in events:
        if event.durable:
            by_run.setdefault(event.run_id, []).append(event.seq)
    child_log = await store.read_log(kid)
    parent_log = await store.read_log("p")
    # One cursor per run id: each run's durable events are its log, gapless, in order.
    assert by_run == {
        "p": list(range(1, len(parent_log.records) + 1)),
        kid: list(range(1, len(child_log.records) + 1)),
    }
    kinds = [e.kind for e in events if e.run_id == kid and e.durable]
    assert kinds[0] is EventKind.RUN_STARTED and kinds[-1] is EventKind.RUN_FINISHED
    # They arrive live, inside the parent's tool call: after its intent, before its result.
    positions = [i for i, e in enumerate(events) if e.run_id == kid]
    intent = next(i for i, e in enumerate(events) if isinstance(e.record, ActionIntent))
    result = next(
        i for i, e in enumerate(events) if isinstance(e.record, ActionResult) and e.run_id == "p"
    )
    assert intent < min(positions) and max(positions) < result
    assert all(r.run_id == "p" for r in parent_log.records)


async def test_cancelling_the_parent_cancels_the_child_durably(store):
    started = trio.Event()
    child = waiting_child(started)
    async with open_run(parent_agent(store, child), "go", store=store, run_id="p") as handle:
        await started.wait()
        handle.cancel("stop", canceller="test")
        result = await handle.wait()
    assert result.state is RunState.CANCELLED
    child_log = await store.read_log(child_run_id("p/s1/a1"))
    assert child_log.finished is not None
    assert child_log.finished.state is RunState.CANCELLED
    cancels = [r for r in child_log.records if isinstance(r, CancelRequested)]
    assert [c.canceller for c in cancels] == ["p"]
    assert "parent" in cancels[0].reason
    assert isinstance(child_log.records[-2], CancelRequested)


async def _cut_while_the_child_waits(store, how: str) -> tuple[RunResult, ActionResult]:
    """Run a parent whose child waits in a call (spending ``USAGE`` first) until the parent
    is cut: cancelled (``how == "cancel"``) or by its time budget; its result and action's."""
    started = trio.Event()
    child = attrs.evolve(
        waiting_child(started),
        model=ScriptedModel(turns=[use("wait_forever", "w1"), say("never")]),
    )
    budgets = Budgets(time_budget_s=1) if how == "time" else None
    parent = parent_agent(store, child, budgets=budgets)
    async with open_run(parent, "go", store=store, run_id="p") as handle:
        await started.wait()
        if how == "cancel":
            handle.cancel("stop", canceller="test")
        with trio.fail_after(30):
            result = await handle.wait()
    log = await store.read_log("p")
    return result, next(r for r in log.records if isinstance(r, ActionResult))


@pytest.mark.parametrize("how", ["cancel", "time"])
async def test_a_parent_cut_while_its_child_works_counts_the_tokens_the_child_spent(
    how: str, store
):
    # The child finished cancelled within its window, but the parent's call was recorded
    # `unknown`, its usage lost: the parent's totals left out the child's tokens.
    result, action = await _cut_while_the_child_waits(store, how)
    child_log = await store.read_log(child_run_id("p/s1/a1"))
    assert child_log.finished is not None
    assert child_log.finished.state is not RunState.SUCCEEDED
    assert child_log.finished.totals.input_tokens == 10
    assert action.late and action.outcome.status is ActionStatus.EXECUTED
    assert action.outcome.child_run_id == child_run_id("p/s1/a1")
    assert action.outcome.usage == Usage(input_tokens=10, output_tokens=5)
    assert action.outcome.observation.startswith("Error: the child run p/s1/a1/child ended ")
    assert (result.totals.input_tokens, result.totals.output_tokens) == (20, 10)


async def test_a_parent_resumed_onto_a_waiting_cancel_cancels_the_children_of_its_step(store):
    """The parent's drive stops while its child blocks in a call (its effect made), a cancel
    is written to the parent's control stream while nobody drives it, and the parent is
    resumed: it finished cancelled without running its step again, and left the child
    unfinished with no cancel, so a later resume of the child made new effects."""
    reached = trio.Event()
    effects: list[str] = []
    child = paying_child(reached, effects)
    with trio.fail_after(30):
        await _stop_the_parent_while_its_child_pays(store, child, reached)
        kid = child_run_id("p/s1/a1")
        assert (await store.read_log(kid)).finished is None
        await request_cancel(store, "p", reason="stop", canceller="test")
        result = await run(parent_agent(store, child), store=store, run_id="p")
    assert result.state is RunState.CANCELLED
    assert [r.canceller for r in await read_control(store, kid)] == ["p"]
    child_log = await store.read_log(kid)  # nobody drove it: finished here too
    assert child_log.finished is not None and child_log.finished.state is RunState.CANCELLED
    assert effects == [f"{kid}/s1/a1"]


@pytest.mark.parametrize("finisher", ["canceller", "resume"])
async def test_an_inline_child_whose_dead_drivers_lease_outlives_the_parents_is_finished(
    store, finisher: str
):
    """The child's lease, of a driver that died with the parent's, had not lapsed when the
    parent was finished (cancelled while nobody drove it, or by its resume): the child got
    its cancel but was left unfinished for good, as no fleet worker takes a child driven
    inline over. Now it is finished ``cancelled`` once that lease lapses unrenewed."""
    reached = trio.Event()
    effects: list[str] = []
    child = paying_child(reached, effects)
    kid = child_run_id("p/s1/a1")
    with trio.fail_after(30):
        await _stop_the_parent_while_its_child_pays(store, child, reached)
        dead = await store.acquire_lease(kid, owner="dead-driver", ttl_s=1.0)
        await request_cancel(store, "p", reason="stop", canceller="test")
        if finisher == "canceller":
            result = await finish_cancelled(store, "p", owner="canceller")
        else:
            result = await run(parent_agent(store, child), store=store, run_id="p")
    assert result.state is RunState.CANCELLED
    child_log = await store.read_log(kid)
    assert child_log.finished is not None and child_log.finished.state is RunState.CANCELLED
    assert [r.canceller for r in await read_control(store, kid)] == ["p"]
    assert (await store.read_lease(kid)).generation == dead.generation + 1  # after it lapsed
    assert effects == [f"{kid}/s1/a1"]


async def test_an_inline_child_whose_lease_is_renewed_is_left_to_its_driver(store):
    """A lease renewed while the parent's finisher waits for it to lapse has a live driver:
    the finisher leaves the child its cancel and stops waiting, rather than waiting on."""
    reached = trio.Event()
    child = paying_child(reached, [])
    kid = child_run_id("p/s1/a1")
    with trio.fail_after(30):
        await _stop_the_parent_while_its_child_pays(store, child, reached)
        live = await store.acquire_lease(kid, owner="live-driver", ttl_s=1.0)
        async with trio.open_nursery() as nursery:

            async def heartbeat() -> None:
                while True:
                    await trio.sleep(0.1)
                    await store.renew_leases([live], ttl_s=1.0)

            nursery.start_soon(heartbeat)
            result = await finish_cancelled(store, "p", owner="canceller")
            nursery.cancel_scope.cancel()
    assert result.state is RunState.CANCELLED
    assert (await store.read_log(kid)).finished is None  # its driver applies the cancel
    assert [r.canceller for r in await read_control(store, kid)] == ["p"]
    held = await store.read_lease(kid)
    assert (held.owner, held.generation) == ("live-driver", live.generation)


async def test_a_child_whose_parent_finished_without_cancelling_it_cancels_itself(
    store, monkeypatch
):
    """The parent's process died after its run-finished was durable and before it cancelled
    the child it left (injected: its closing step never runs): the child had no cancel, and
    its next drive ran its step again and finished succeeded, a result nobody reads."""
    import treadle.supervisors._driver as driver

    reached = trio.Event()
    effects: list[str] = []
    child = paying_child(reached, effects)
    kid = child_run_id("p/s1/a1")
    with trio.fail_after(30):
        await _stop_the_parent_while_its_child_pays(store, child, reached)
        await request_cancel(store, "p", reason="stop", canceller="test")

        async def died_before_closing(*args: object, **kwargs: object) -> None:
            pass

        monkeypatch.setattr(driver, "close_links", died_before_closing)
        result = await run(parent_agent(store, child), store=store, run_id="p")
        assert result.state is RunState.CANCELLED
        assert await read_control(store, kid) == ()  # the child got no cancel
        monkeypatch.undo()
        again = await run(child, store=store, run_id=kid)
    assert again.state is RunState.CANCELLED
    cancels = await read_control(store, kid)
    assert [(c.canceller, c.reason) for c in cancels] == [
        ("p", "its parent run finished without its result")
    ]
    assert effects == [f"{kid}/s1/a1"]  # its call was not run again


@pytest.mark.parametrize("finished", [True, False])
async def test_a_call_refuses_an_unrelated_run_that_has_its_childs_id(store, finished):
    """A run started on its own under the id a call's child derives (same input): the call
    took its result (finished) or drove it on (unfinished) as its child's."""
    kid = child_run_id("p/s1/a1")
    executed: list[str] = []
    other = child_agent(executed=executed)
    if finished:
        await run(other, "do the thing", store=store, run_id=kid)
    else:
        async with open_run(other, "do the thing", store=store, run_id=kid) as handle:
            handle.drain()  # stops before its first step: unfinished, resumable
        assert (await store.read_log(kid)).finished is None
    before = (await store.read_log(kid)).records
    result = await run(parent_agent(store, child_agent()), "go", store=store, run_id="p")
    assert result.state is RunState.SUCCEEDED
    action = next(r for r in (await store.read_log("p")).records if isinstance(r, ActionResult))
    assert action.outcome.observation.startswith("Error: UsageError: run 'p/s1/a1/child' is ")
    assert "not the child run of call p/s1/a1 (it names no parent)" in action.outcome.observation
    assert action.outcome.child_run_id is None
    assert (await store.read_log(kid)).records == before  # left as it was


async def test_children_with_calls_that_ignore_the_cancel_still_finish_cancelled(store):
    # The grandchild's call shields itself from the cancel: each level's calls get half its
    # parent's grace, so each level records its cancel before its parent stops waiting.
    started = trio.Event()
    never = trio.Event()

    @tool
    async def stuck(ctx: ToolContext) -> str:
        """Wait, ignoring cancellation."""
        started.set()
        with trio.CancelScope(shield=True):
            await never.wait()
        return "never"

    grandchild = attrs.evolve(
        child_agent(turns=[call("stuck", call_id="w1"), say("never")]),
        executor=Toolbox([stuck]),
    )
    child = attrs.evolve(
        child_agent(turns=[call("helper", call_id="g1", task="deeper"), say("never")]),
        executor=Toolbox([agent_tool(grandchild, store=store, name="helper", description="Ask.")]),
    )
    async with open_run(parent_agent(store, child), "go", store=store, run_id="p") as handle:
        await started.wait()
        handle.cancel("stop", canceller="test")
        with trio.fail_after(30):
            result = await handle.wait()
        never.set()  # the abandoned call ends, so the tool host can close
    assert result.state is RunState.CANCELLED
    kid = child_run_id("p/s1/a1")
    for run_id in (kid, child_run_id(f"{kid}/s1/a1")):
        log = await store.read_log(run_id)
        assert log.finished is not None, run_id
        assert log.finished.state is RunState.CANCELLED, run_id


@attrs.define(eq=False)
class SlowCancels(MemoryStore):
    """A store whose control-stream appends take longer than a child's cancel window."""

    appended: trio.Event = attrs.Factory(trio.Event)

    async def append_control(self, record):  # type: ignore[no-untyped-def]
        await trio.sleep(2 * CHILD_CANCEL_GRACE_S)
        entry = await super().append_control(record)
        self.appended.set()
        return entry


async def test_a_childs_cancel_is_written_even_when_the_write_outlasts_its_window(
    autojump_clock,
):
    """The durable cancel was appended under the child's window (1.5 s here; 3 ms ten levels
    down): a write slower than that was cut, and the child was left with no cancel in its
    control stream, so its next driver ran it on."""
    store = SlowCancels()
    started = trio.Event()
    child = waiting_child(started)
    async with open_run(parent_agent(store, child), "go", store=store, run_id="p") as handle:
        await started.wait()
        handle.cancel("stop", canceller="test")
        result = await handle.wait()
    assert result.state is RunState.CANCELLED
    kid = child_run_id("p/s1/a1")
    with trio.fail_after(60):  # the parent's grace ended first: the write goes on, shielded
        await store.appended.wait()
    assert [r.canceller for r in await read_control(store, kid)] == ["p"]
    resumed = await run(child, store=store, run_id=kid)  # its next driver finishes it
    assert resumed.state is RunState.CANCELLED


@attrs.define(eq=False)
class SlowChildStart(MemoryStore):
    """A store whose first read of a child's control stream (as its drive starts, after its
    run-started record) takes longer than the child's cancel window."""

    starting: trio.Event = attrs.Factory(trio.Event)

    async def read_control(self, run_id, *, after=0):  # type: ignore[no-untyped-def]
        if run_id != "p" and not self.starting.is_set():
            self.starting.set()
            await trio.sleep(2 * CHILD_CANCEL_GRACE_S)
        return await super().read_control(run_id, after=after)


async def test_a_child_cut_while_its_drive_starts_still_gets_its_cancel(autojump_clock):
    """The cancel came before the child's handle existed, and its window ended while its
    drive started: the drive was cut before the handle could pass the cancel on, and the
    started child was left with no cancel in its control stream."""
    store = SlowChildStart()
    child = child_agent()
    async with open_run(parent_agent(store, child), "go", store=store, run_id="p") as handle:
        await store.starting.wait()
        handle.cancel("stop", canceller="test")
        result = await handle.wait()
    assert result.state is RunState.CANCELLED
    kid = child_run_id("p/s1/a1")
    assert (await store.read_log(kid)).started is not None
    assert [r.canceller for r in await read_control(store, kid)] == ["p"]


async def test_a_childs_records_are_counted_in_the_parents_metrics(store):
    from treadle.metrics import MetricsRecorder
    from treadle.sinks.prometheus import PrometheusOutput

    output = PrometheusOutput()
    recorder = MetricsRecorder(outputs=[output])
    result = await run(
        parent_agent(store, child_agent()), "go", store=store, run_id="p", metrics=recorder
    )
    assert result.state is RunState.SUCCEEDED
    value = output.registry.get_sample_value
    steps = value("treadle_steps_total")
    runs = value("treadle_runs_started_total")
    calls = {
        tuple(sample.labels.values()): sample.value
        for family in output.registry.collect()
        for sample in family.samples
        if sample.name == "treadle_tool_calls_total"
    }
    assert runs == 2  # the parent and its child
    assert steps == 4  # two each
    assert calls == {("helper", "executed"): 1, ("note", "executed"): 1}


def _slow_child() -> Agent:
    """A child agent whose one call works 60 s (active time) before it answers."""

    @tool
    async def slow(ctx: ToolContext) -> str:
        """Work for a minute."""
        await trio.sleep(60)
        return "worked"

    return attrs.evolve(
        child_agent(turns=[call("slow", call_id="s1"), say("slow answer")]),
        executor=Toolbox([slow], default_timeout_s=120),
        limits=Limits(tool_timeout_s=120),
    )


async def test_a_child_run_call_is_bounded_by_the_budgets_not_the_tool_timeout(autojump_clock):
    store = MemoryStore()  # the trio clock jumps: no store thread may wait on it

    child = _slow_child()
    parent = parent_agent(store, child, limits=Limits(tool_timeout_s=1))
    result = await run(parent, "go", store=store, run_id="p")
    assert result.state is RunState.SUCCEEDED
    log = await store.read_log("p")
    action = next(r for r in log.records if isinstance(r, ActionResult))
    assert action.outcome.observation == "slow answer"
    assert action.duration_s is not None and action.duration_s >= 60


async def test_the_child_draws_from_the_parents_token_budget(store):
    # The parent spends 15 tokens before the call; 10 are left for the child, which spends 15
    # on its first call and stops. Its 15 count in the parent's budget, which stops it too.
    result = await run(
        parent_agent(store, child_agent(), budgets=Budgets(token_budget=25)),
        "go",
        store=store,
        run_id="p",
    )
    child_log = await store.read_log(child_run_id("p/s1/a1"))
    assert child_log.finished is not None
    assert child_log.finished.stop_reason is StopReason.TOKEN_BUDGET
    assert child_log.finished.totals.input_tokens == 10
    assert result.stop_reason is StopReason.TOKEN_BUDGET
    assert result.totals.input_tokens == 20 and result.totals.output_tokens == 10
    log = await store.read_log("p")
    action = next(r for r in log.records if isinstance(r, ActionResult))
    assert action.outcome.observation.startswith(f"Error: the child run {child_run_id('p/s1/a1')}")
    assert "token_budget" in action.outcome.observation


async def test_calls_running_at_once_share_what_the_token_budget_has_left():
    # Each of two child runs started by one step was given the whole remainder, so the two
    # together could spend twice what the parent had left.
    shares: list[int | None] = []

    @tool
    async def spend(ctx: ToolContext) -> str:
        """Draw on the budget.

        Args:
            ctx: the call.
        """
        shares.append(ctx.tokens_left)
        return "ok"

    two = ModelReply(
        tool_calls=(
            call("spend", call_id="a").tool_calls[0],
            call("spend", call_id="b").tool_calls[0],
        ),
        finish_reason="tool_calls",
        usage=Usage(input_tokens=20, output_tokens=9),
    )
    definition = Agent(
        model=ScriptedModel(turns=[two, use("spend", "c"), say("done")]),
        executor=Toolbox([spend]),
        parser=NativeToolCallParser(),
        budgets=Budgets(token_budget=100),
    )
    await run(definition, "go", store=MemoryStore(), run_id="p")
    assert shares == [35, 35, 56]  # (100 - 29) // 2 each, then all of 100 - 29 - 15 alone


async def test_the_child_draws_from_the_parents_time_budget(autojump_clock):
    store = MemoryStore()  # the trio clock jumps: no store thread may wait on it

    child = _slow_child()
    parent = parent_agent(store, child, budgets=Budgets(time_budget_s=5))
    began = trio.current_time()
    result = await run(parent, "go", store=store, run_id="p")
    assert result.stop_reason is StopReason.TIME_BUDGET
    assert trio.current_time() - began < 10
    child_log = await store.read_log(child_run_id("p/s1/a1"))
    # Its time budget was what the parent had left: it stopped at the parent's deadline.
    assert child_log.finished is not None and child_log.finished.state is not RunState.SUCCEEDED
    assert child_log.finished.totals.active_s <= 5


class StepWrites(InterceptingStore):
    """Forwards to ``inner``, numbering its writes.

    ``step_writes`` maps ``(run id, step)`` to the write (1-based, over all runs) that holds
    that step's record.
    """

    writes: int = 0

    def __init__(self, inner: MemoryStore) -> None:
        super().__init__(inner)
        self.step_writes: dict[tuple[str, int], int] = {}

    async def before_write(self, op, records, seq) -> bool:
        self.writes += 1
        for record in records:
            if isinstance(record, StepRecord):
                self.step_writes[(record.run_id, record.step)] = self.writes
        return False


def _two_slow_children(store, budget_s: float) -> Agent:
    """A parent whose two steps each hand a child a call that works 60 s (active time)."""

    child = _slow_child()
    turns = [
        use("helper", "h1", task="first"),
        use("helper", "h2", task="second"),
        say("the parent's answer", usage=USAGE),
    ]
    return parent_agent(
        store, child, budgets=Budgets(time_budget_s=budget_s), turns=turns, owner=OWNER
    )


async def test_a_parent_resumed_onto_its_finished_child_counts_the_childs_time(autojump_clock):
    """A resumed step counts the active time its finished child's log records.

    A parent that died after its child finished, before its own step was durable,
    re-attached to the finished child at once, and its resumed step counted none of the
    child's 60 active seconds (it counted the child's tokens): the second step's child was
    then given the whole budget and answered, where the uninterrupted run's was cut by it.
    """
    counted = StepWrites(MemoryStore())
    live = await run(_two_slow_children(counted, 100), "go", store=counted, run_id="p", owner=OWNER)
    assert live.stop_reason is StopReason.TIME_BUDGET
    twin = await counted.inner.read_log("p")
    assert "ended cancelled (cancelled)" in twin.steps[1].observations[0]  # cut by the parent
    inner = MemoryStore()
    crashing = CrashingStore(inner, crash_at=counted.step_writes[("p", 1)], when="before")
    with pytest.raises((RunInterrupted, StoreError, SimulatedCrash)):
        await run(_two_slow_children(crashing, 100), "go", store=crashing, run_id="p", owner=OWNER)
    assert crashing.crashed
    assert (await inner.read_log(child_run_id("p/s1/a1"))).finished is not None
    assert not (await inner.read_log("p")).steps  # the child finished, the parent's step not
    resumed = await run(_two_slow_children(inner, 100), "go", store=inner, run_id="p", owner=OWNER)
    log = await inner.read_log("p")
    assert log.steps[0].active_s >= 60
    assert [s.observations for s in log.steps] == [s.observations for s in twin.steps]
    assert resumed.stop_reason is StopReason.TIME_BUDGET
    assert resumed.totals.active_s <= 100 + 1


async def test_a_child_waiting_on_a_human_is_cancelled_when_the_parents_time_ends(tmp_path):
    """A child waiting for an approval spends no active time, so its own time budget (the
    parent's share) never ran out: the parent's time budget cut the call without a grace
    period, and the child was left waiting, its drive abandoned in the tool host (where it
    failed on the store closed under it)."""
    refunds: list[int] = []

    @tool(requires_approval=True)
    async def refund(invoice: int) -> str:
        """Refund an invoice."""
        refunds.append(invoice)
        return "refunded"

    child = attrs.evolve(
        child_agent(turns=[call("refund", call_id="r1", invoice=9), say("ok")]),
        executor=Toolbox([refund]),
    )
    async with open_store_at(tmp_path / "runs.db") as store:
        parent = parent_agent(store, child, budgets=Budgets(time_budget_s=1))
        result = await run(parent, "go", store=store, run_id="p")
        child_log = await store.read_log(child_run_id("p/s1/a1"))
    assert result.stop_reason is StopReason.TIME_BUDGET
    assert child_log.finished is not None, type(child_log.records[-1]).__name__
    assert child_log.finished.state is RunState.CANCELLED and refunds == []


def crash_points() -> list[tuple[int, str]]:
    return [(n, when) for n in range(1, 40) for when in ("before", "after")]


async def _writes_of_a_whole_run() -> int:
    counter = CrashingStore(MemoryStore(), crash_at=10**6)
    await run(
        parent_agent(counter, child_agent(), owner=OWNER),
        "go",
        store=counter,
        run_id="p",
        owner=OWNER,
    )
    return counter.writes


@pytest.mark.parametrize("when", ["before", "after"])
async def test_a_crash_at_every_write_of_parent_and_child_resumes_to_one_child(when):
    """The crash kit's `CrashingStore` kills the process at every store write of either run
    (the child's run-started naming its parent, the parent's result naming the child, the
    child's records between); a fresh process resumes the parent, which re-attaches."""
    total = await _writes_of_a_whole_run()
    assert total >= 16  # both runs' writes are counted
    while_the_child_ran = unknown = 0
    for crash_at in range(1, total + 1):
        inner = MemoryStore()
        executed: list[str] = []
        crashing = CrashingStore(inner, crash_at=crash_at, when=when)
        dying = parent_agent(crashing, child_agent(executed=executed), owner=OWNER)
        with pytest.raises((RunInterrupted, StoreError, SimulatedCrash)):
            await run(dying, "go", store=crashing, run_id="p", owner=OWNER)
        assert crashing.crashed
        kid = child_run_id("p/s1/a1")
        before = await inner.read_log(kid)
        while_the_child_ran += before.started is not None and before.finished is None
        resumed = parent_agent(inner, child_agent(executed=executed), owner=OWNER)
        result = await run(resumed, "go", store=inner, run_id="p", owner=OWNER)
        kid = child_run_id("p/s1/a1")
        assert result.state is RunState.SUCCEEDED, crash_at
        assert await inner.list_runs() == ("p", kid), crash_at  # exactly one child run
        # The child's effect ('never' policy) happened at most once; once unless its outcome
        # became unknown (the crash fell between its intent and its result).
        assert executed in ([f"{kid}/s1/a1"], []), crash_at
        child_log = await inner.read_log(kid)
        assert child_log.finished is not None and child_log.finished.state is RunState.SUCCEEDED
        notes = [r for r in child_log.records if isinstance(r, ActionResult)]
        assert len(notes) == 1, crash_at
        if not executed:
            assert notes[0].outcome.status is ActionStatus.UNKNOWN, crash_at
            unknown += 1
        parent_log = await inner.read_log("p")
        calls = [r for r in parent_log.records if isinstance(r, ActionResult)]
        assert [c.outcome.child_run_id for c in calls] == [kid], crash_at
        assert calls[0].outcome.observation == "the child's answer", crash_at
    assert while_the_child_ran >= 6  # the crashes hit the child's writes too
    assert unknown <= 2  # only a crash between the note's intent and its result loses it


def read_logs(db: Path, *run_ids: str) -> tuple[tuple[str, ...], list[RunLog]]:
    async def read() -> tuple[tuple[str, ...], list[RunLog]]:
        async with open_store_at(db) as store:
            return await store.list_runs(), [await store.read_log(r) for r in run_ids]

    return trio.run(read)


def _killed_while_the_child_runs(db: Path, ledger: Path):  # type: ignore[no-untyped-def]
    """Run `child_run_driver.py` until its child blocks in a call (its effect recorded), then
    SIGKILL it. Returns the driver's command, its environment and the killed process's pid."""
    driver = [sys.executable, str(Path(__file__).with_name("child_run_driver.py")), str(db)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    first = subprocess.Popen([*driver, str(ledger), "block"], stdout=subprocess.PIPE, env=env)
    assert first.stdout is not None
    assert first.stdout.readline() == b"child running\n"  # blocks until the child is there
    first.send_signal(signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    first.stdout.close()
    return driver, env, first.pid


async def _orphaned(db: Path, *run_ids: str) -> None:
    """Wait until the dead driver's leases of ``run_ids`` lapsed (2 s)."""
    async with open_store_at(db) as store:
        with trio.fail_after(60):
            while True:
                found = [await store.read_summary(r) for r in run_ids]
                if all(s is not None and s.liveness is Liveness.ORPHANED for s in found):
                    return
                await trio.sleep(0.05)


def test_a_parent_killed_while_its_child_runs_re_attaches_after_resume(tmp_path):
    """A real crash: SIGKILL the process while the child run blocks in a tool call (its
    effect already recorded), start a new process that resumes the parent: it waits for the
    dead driver's child lease to lapse, re-attaches, and the child's effect stays single."""
    db, ledger = tmp_path / "runs.db", tmp_path / "ledger"
    driver, env, killed = _killed_while_the_child_runs(db, ledger)
    kid = child_run_id("p/s1/a1")
    _, [before] = read_logs(db, kid)
    assert before.finished is None and before.started is not None
    assert before.started.parent_run_id == "p"
    second = subprocess.run(
        [*driver, str(ledger), "resume"], capture_output=True, env=env, check=True, timeout=120
    )
    assert second.stdout == b"succeeded thanks\n"
    listed, [child_log, parent_log] = read_logs(db, kid, "p")
    assert listed == ("p", kid)  # one child run, re-attached
    assert child_log.finished is not None and child_log.finished.state is RunState.SUCCEEDED
    effects = ledger.read_text().splitlines()
    assert len(effects) == 1 and effects[0].endswith(f" {kid}/s1/a1")
    assert int(effects[0].split()[0]) == killed
    calls = [r for r in parent_log.records if isinstance(r, ActionResult)]
    assert [(c.outcome.child_run_id, c.outcome.observation) for c in calls] == [(kid, "done")]


def test_cancelling_a_parent_killed_while_its_child_runs_cancels_the_child(tmp_path):
    """A real crash, then `treadle cancel` of the parent nobody drives: it finished the parent
    and left the child running (orphaned), so a later resume of the child made new effects."""
    from click.testing import CliRunner

    from treadle.cli import main

    db, ledger = tmp_path / "runs.db", tmp_path / "ledger"
    driver, env, _ = _killed_while_the_child_runs(db, ledger)
    kid = child_run_id("p/s1/a1")
    # Until the dead driver's leases lapse (2 s), the cancel is only requested (and a child
    # still leased is left its cancel): wait for both, then the command finishes both here.
    trio.run(_orphaned, db, "p", kid)
    said = CliRunner().invoke(main, ["cancel", "p", "--store", str(db)])
    assert said.exit_code == 0, said.output
    assert "finished here, cancelled" in said.output
    _, [child_log, parent_log] = read_logs(db, kid, "p")
    assert parent_log.finished is not None and parent_log.finished.state is RunState.CANCELLED
    assert child_log.finished is not None and child_log.finished.state is RunState.CANCELLED
    again = subprocess.run(
        [*driver, str(ledger), "resume"], capture_output=True, env=env, check=True, timeout=120
    )
    assert again.stdout == b"cancelled None\n"  # finished: never driven again
    effects = ledger.read_text().splitlines()
    assert len(effects) == 1 and effects[0].endswith(f" {kid}/s1/a1")  # nothing new


def test_resuming_every_run_leaves_a_child_to_its_parents_resume(tmp_path):
    """A real crash, then `resume_unfinished` (`treadle resume --all`) with the parent's
    definition: it also resumed the child with it, which failed on the child's snapshot
    (the command exited 1) or raced the parent's re-attaching to it."""
    from child_run_driver import parent

    from treadle.supervisors import resume_unfinished

    db, ledger = tmp_path / "runs.db", tmp_path / "ledger"
    _killed_while_the_child_runs(db, ledger)
    kid = child_run_id("p/s1/a1")

    async def resume_all() -> list[str]:
        await _orphaned(db, "p", kid)
        async with open_store_at(db) as store:
            results = await resume_unfinished(parent(store, str(ledger), False), store=store)
            return [r.run_id for r in results]

    assert trio.run(resume_all) == ["p"]  # the child was finished by the parent's resume
    _, [child_log, parent_log] = read_logs(db, kid, "p")
    assert parent_log.finished is not None and parent_log.finished.state is RunState.SUCCEEDED
    assert child_log.finished is not None and child_log.finished.state is RunState.SUCCEEDED
    assert len(ledger.read_text().splitlines()) == 1  # its `never` effect stayed single


def test_treadle_show_links_the_parent_and_the_child(tmp_path):
    from click.testing import CliRunner

    from treadle.cli import main

    db = tmp_path / "runs.db"

    async def write() -> None:
        async with open_store_at(db) as store:
            await run(parent_agent(store, child_agent()), "go", store=store, run_id="p")

    trio.run(write)
    kid = child_run_id("p/s1/a1")
    env = {"COLUMNS": "250"}
    parent = CliRunner().invoke(main, ["show", "p", "--store", str(db)], env=env)
    assert parent.exit_code == 0, parent.output
    assert f"(child run {kid})" in parent.output
    child = CliRunner().invoke(main, ["show", kid, "--store", str(db)], env=env)
    assert child.exit_code == 0, child.output
    assert "child of p (call p/s1/a1)" in child.output


async def test_a_child_whose_store_write_fails_interrupts_the_parent_which_re_attaches():
    """The child's drive fails (a store write of the child, the process alive): the call's
    outcome is unknown, so it is no observation; the parent's drive stops, resumable, and
    its resume re-attaches to the child instead of recording the failure as a result."""
    inner = MemoryStore()
    # Write 4 is the parent's action intent; 5 the child's run-started, 6 its model intent.
    failing = FailingStore(inner, fail_at=6)
    executed: list[str] = []
    with pytest.raises(RunInterrupted) as caught:
        await run(
            parent_agent(failing, child_agent(executed=executed)), "go", store=failing, run_id="p"
        )
    assert isinstance(caught.value.__cause__, ChildRunInterrupted)
    kid = child_run_id("p/s1/a1")
    assert failing.failed_runs == {kid}
    parent_log = await inner.read_log("p")
    assert not any(isinstance(r, ActionResult) for r in parent_log.records)  # no outcome
    result = await run(
        parent_agent(inner, child_agent(executed=executed)), "go", store=inner, run_id="p"
    )
    assert result.state is RunState.SUCCEEDED
    assert await inner.list_runs() == ("p", kid)
    assert executed == [f"{kid}/s1/a1"]
    parent_log = await inner.read_log("p")
    calls = [r for r in parent_log.records if isinstance(r, ActionResult)]
    assert [c.outcome.observation for c in calls] == ["the child's answer"]


async def test_a_child_whose_definition_changed_interrupts_the_parent_not_its_call():
    """Re-attached under a changed definition, the child is refused (SnapshotMismatch). As an
    error observation, the parent went on and finished while the child stayed unfinished
    for good; the parent now stops resumable, and goes on once the child was resumed with
    the change accepted."""
    inner = MemoryStore()
    failing = FailingStore(inner, fail_at=6)  # the child's model intent: both interrupted
    with pytest.raises(RunInterrupted):
        await run(parent_agent(failing, child_agent()), "go", store=failing, run_id="p")
    changed = attrs.evolve(child_agent(), system_prompt="You are the child, briefly.")
    with pytest.raises(RunInterrupted) as caught:
        await run(parent_agent(inner, changed), "go", store=inner, run_id="p")
    assert isinstance(caught.value.__cause__, ChildRunInterrupted)
    assert "differs from the stored parameter snapshot" in str(caught.value)
    kid = child_run_id("p/s1/a1")
    for run_id in ("p", kid):
        assert (await inner.read_log(run_id)).finished is None  # both resumable
    assert not any(isinstance(r, ActionResult) for r in (await inner.read_log("p")).records)
    accepted = await run(changed, store=inner, run_id=kid, accept_definition_change=True)
    assert accepted.state is RunState.SUCCEEDED
    result = await run(parent_agent(inner, changed), "go", store=inner, run_id="p")
    assert result.state is RunState.SUCCEEDED


# --------------------------------------------------------------------------- fleets (real time)


async def test_a_fleet_with_fewer_slots_than_parents_and_children_finishes_them_all(
    fleet_store,
):
    """One slot, three parents, three children: a child is driven inside its parent's call,
    under the parent's slot, so waiting parents never hold the slots their children need."""
    executed: list[str] = []

    def make() -> Agent:
        return parent_agent(fleet_store, child_agent(executed=executed))

    with trio.fail_after(60):
        async with open_fleet(
            fleet_store, {"parent": make}, max_running=1, claim_poll_s=0.1
        ) as worker:
            for run_id in ("p1", "p2", "p3"):
                await worker.submit("parent", "go", run_id=run_id)
            results = [await worker.result(r, poll_s=0.1) for r in ("p1", "p2", "p3")]
    # once the block is left: a run's result is durable before its drive is counted finished
    stats = worker.statistics()
    assert [r.final_answer for r in results] == ["the parent's answer"] * 3
    kids = [child_run_id(f"{r}/s1/a1") for r in ("p1", "p2", "p3")]
    assert sorted(executed) == sorted(f"{k}/s1/a1" for k in kids)
    assert sorted(await fleet_store.list_runs()) == sorted(["p1", "p2", "p3", *kids])
    assert stats.finished == 3 and stats.claimed == 3


async def test_a_worker_drained_while_a_child_runs_leaves_both_to_another_worker(fleet_store):
    """Worker A stops (drains) while the child blocks: the parent's drive is cut, the child's
    too, and neither is cancelled. Worker B claims the parent, which re-attaches to the
    child: one child run, its effect once, driven to its end by B."""
    executed: list[str] = []
    gate, started = trio.Event(), trio.Event()

    @tool(replay=ReplayPolicy.SAFE)
    async def wait(ctx: ToolContext) -> str:
        """Wait for the gate (read-only)."""
        started.set()
        await gate.wait()
        return "open"

    def make() -> Agent:
        child = child_agent(
            executed=executed,
            turns=[use("note", "n1", text="hi"), call("wait", call_id="w1"), say("child done")],
        )
        base = child.executor
        assert isinstance(base, Toolbox)
        note = base.get("note")
        assert note is not None
        return parent_agent(
            fleet_store, attrs.evolve(child, executor=Toolbox([note, wait])), owner=None
        )

    kid = child_run_id("p/s1/a1")
    with trio.fail_after(60):
        async with open_fleet(
            fleet_store, {"parent": make}, max_running=1, claim_poll_s=0.1, drain_s=0.2, owner="a"
        ) as first:
            await first.submit("parent", "go", run_id="p")
            await started.wait()
        interrupted = await fleet_store.read_log(kid)
        assert interrupted.finished is None
        assert not any(isinstance(r, CancelRequested) for r in interrupted.records)
        assert await fleet_store.read_control(kid) == ()
        gate.set()
        async with open_fleet(
            fleet_store, {"parent": make}, max_running=1, claim_poll_s=0.1, owner="b"
        ) as second:
            result = await second.result("p", poll_s=0.1)
    assert result.final_answer == "the parent's answer"
    assert await fleet_store.list_runs() == ("p", kid)
    assert executed == [f"{kid}/s1/a1"]
    child_log = await fleet_store.read_log(kid)
    assert child_log.finished is not None and child_log.finished.state is RunState.SUCCEEDED


@attrs.frozen
class Forecast:
    city: str
    high_c: int


async def test_a_child_with_an_output_type_answers_with_its_output_as_json():
    store = MemoryStore()
    child = Agent(
        model=ScriptedModel(turns=[say('{"city": "Oslo", "high_c": 21}')]),
        executor=Toolbox([]),
        parser=NativeToolCallParser(),
        output_type=Forecast,
        output_mode="native",
    )
    result = await run(parent_agent(store, child), "go", store=store, run_id="p")
    assert result.state is RunState.SUCCEEDED
    log = await store.read_log("p")
    action = next(r for r in log.records if isinstance(r, ActionResult))
    assert action.outcome.observation == '{"city":"Oslo","high_c":21}'


@pytest.mark.parametrize("poll_s", [-1.0, 0.0, float("nan"), float("inf"), True])
def test_an_agent_tool_with_a_control_poll_out_of_range_is_refused_when_made(poll_s):
    """``agent_tool(control_poll_s=...)`` took any value: a negative one ended the parent's
    call with a raw ``ValueError`` while its queued child ran on unwatched, 0 polled the store
    without pause, NaN interrupted the parent at every resume."""
    child = Agent(
        model=ScriptedModel(turns=[say("done")]),
        executor=Toolbox([]),
        parser=NativeToolCallParser(),
    )
    with pytest.raises(UsageError, match="control_poll_s must be a finite number of seconds"):
        agent_tool(
            child, store=MemoryStore(), name="ask", description="Asks.", control_poll_s=poll_s
        )
