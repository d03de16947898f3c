"""A parent whose queued child works parks: its lease and slot are freed, its actors stop.

docs/child-runs.md, "In a fleet": after the worker's ``park_after_s`` a parent whose step waits
only on queued children (every call of the step ``safe`` to replay) records
`ChildrenAwaited`, releases its lease and ends its drive; the child's end wakes it (or its
recheck instant comes), a worker claims it, and its step runs its calls again, which find
their children. On SQLite and a real PostgreSQL.
"""

from __future__ import annotations

import datetime as dt

import attrs
import pytest
import trio

from treadle import agent_tool, child_run_id, finish_cancelled
from treadle._cli_common import not_started
from treadle._cli_runs import tail
from treadle._cli_store import driver_text
from treadle.agent import Agent
from treadle.parsers import NativeToolCallParser
from treadle.supervisors import open_fleet
from treadle.testing.invariants import check_invariants
from treadle.testing.scripted import ScriptedModel, call, calls, say
from treadle.tools import Toolbox, ToolContext, tool
from treadle.types import (
    ActionResult,
    ActionStatus,
    BudgetCaps,
    Budgets,
    CancelRequested,
    ChildrenAwaited,
    Liveness,
    Message,
    ReplayPolicy,
    RunStarted,
    RunState,
    StepRecord,
    StopReason,
    ToolCall,
    Usage,
)


def child_agent(executed: list[str], gate: trio.Event, **more) -> Agent:
    """One effect (``note``, after ``gate`` is set), then an answer."""

    @tool
    async def note(text: str, ctx: ToolContext) -> str:
        """Write a note (an effect).

        Args:
            text: the note.
            ctx: the call.
        """
        await gate.wait()
        executed.append(ctx.intent_id)
        return f"noted {text}"

    return Agent(
        model=ScriptedModel(turns=[call("note", call_id="n1", text="hi"), say("child done")]),
        executor=Toolbox([note]),
        parser=NativeToolCallParser(),
        system_prompt="You are the child.",
        **more,
    )


def parent_agent(store, child: Agent, *, turns=None, tools=(), **more) -> Agent:
    helper = agent_tool(
        child,
        store=store,
        name="helper",
        description="Ask the helper agent.",
        fleet_agent="child",
        control_poll_s=0.05,
    )
    return Agent(
        model=ScriptedModel(
            turns=turns or [call("helper", call_id="h1", task="do the thing"), say("parent done")]
        ),
        executor=Toolbox([helper, *tools]),
        parser=NativeToolCallParser(),
        system_prompt="You are the parent.",
        **more,
    )


async def until(check, *, timeout_s: float = 60.0) -> None:
    """Look every 20 ms until ``check()`` holds (the store is written by other tasks)."""
    with trio.fail_after(timeout_s):
        while True:
            if await check():
                return
            await trio.sleep(0.02)


async def parked(store, run_id: str) -> bool:
    summary = await store.read_summary(run_id)
    return (
        summary is not None
        and summary.state is RunState.AWAITING_CHILD
        and summary.liveness is Liveness.PARKED
    )


def fleet(store, agents, **more):
    settings = {"max_running": 1, "claim_poll_s": 0.05, "park_after_s": 0.2, **more}
    return open_fleet(store, agents, **settings)


async def test_a_waiting_parent_parks_and_its_childs_end_wakes_it(fleet_store):
    """One slot: the parent parks (lease released, state awaiting_child, nothing driven but
    the child), the child finishes, wakes it, and the parent's step finds the child's answer:
    the child ran once, and the parent was claimed twice."""
    executed: list[str] = []
    gate = trio.Event()
    agents = {
        "parent": lambda: parent_agent(fleet_store, child_agent(executed, gate)),
        "child": lambda: child_agent(executed, gate),
    }
    kid = child_run_id("p/s1/a1")
    with trio.fail_after(60):
        async with fleet(fleet_store, agents, child_recheck_s=3600) as worker:
            await worker.submit("parent", "go", run_id="p")
            await until(lambda: parked(fleet_store, "p"))
            summary = await fleet_store.read_summary("p")
            lease = summary.lease
            assert lease is not None and lease.owner == ""  # released, not expired
            assert driver_text(summary) == "nobody: parked (waits on child runs)"
            said: list[str] = []  # `treadle tail` said it was parked on an approval
            await tail(fleet_store, "p", 1, lambda seq, record: None, follow=False, say=said.append)
            assert said == [
                "      … nobody drives run p: it is parked (waits on child runs): a child's end, "
                "a cancel or its recheck instant makes a driver take it again"
            ]
            await until(lambda: _driven(fleet_store, kid))  # the child took the one slot
            assert worker.statistics().waiting == 0  # no drive of the parent is left waiting
            gate.set()
            result = await worker.result("p", poll_s=0.05)
    assert result.final_answer == "parent done"
    assert executed == [f"{kid}/s1/a1"]
    log = await fleet_store.read_log("p")
    kinds = [type(r).__name__ for r in log.records]
    awaited = [r for r in log.records if isinstance(r, ChildrenAwaited)]
    assert len(awaited) == 1
    assert (awaited[0].intent_ids, awaited[0].children) == (("p/s1/a1",), (kid,))
    # parked after the intent; the replayed call's result and the step record follow
    assert kinds.index("ChildrenAwaited") == kinds.index("ActionIntent") + 1
    action = next(r for r in log.records if isinstance(r, ActionResult))
    assert (action.outcome.observation, action.outcome.child_run_id) == ("child done", kid)
    assert check_invariants(log) == []
    summary = await fleet_store.read_summary("p")
    assert summary.claims == 2 and summary.state is RunState.SUCCEEDED
    # the invariant: a park names calls still waiting in its step (moved after the result: not)
    records = list(log.records)
    moved = records.pop(kinds.index("ChildrenAwaited"))
    records.insert(kinds.index("StepRecord"), moved)
    late = attrs.evolve(log, records=tuple(records))
    assert any("not a call waiting" in p for p in check_invariants(late))


def _another_object_on(store):
    """A second store object on ``store``'s file or DSN and schema (as a worker's agent
    factory opens its own)."""
    dialect = store._dialect
    if hasattr(dialect, "dsn"):
        from treadle.stores.postgres import open_postgres_store

        return open_postgres_store(dialect.dsn, schema=dialect.schema)
    from treadle.stores.sqlite import open_sqlite_store

    return open_sqlite_store(dialect.path)


async def test_a_tool_on_another_store_object_of_the_fleets_database_queues_the_child(
    fleet_store,
):
    """`treadle worker` opens its store itself, so an agent factory's `agent_tool` holds
    another store object on the same database: the child ran inline in the parent's call,
    never queued, without a word (docs/child-runs.md, "In a fleet")."""
    executed: list[str] = []
    gate = trio.Event()
    gate.set()
    kid = child_run_id("p/s1/a1")
    async with _another_object_on(fleet_store) as own:
        assert fleet_store.same_database(own) and own.same_database(fleet_store)
        agents = {
            "parent": lambda: parent_agent(own, child_agent(executed, gate)),
            "child": lambda: child_agent(executed, gate),
        }
        with trio.fail_after(60):
            async with fleet(fleet_store, agents, max_running=2) as worker:
                await worker.submit("parent", "go", run_id="p")
                result = await worker.result("p", poll_s=0.05)
    assert result.final_answer == "parent done"
    summary = await fleet_store.read_summary(kid)
    assert summary is not None and summary.agent == "child"
    assert summary.submitted_at is not None and summary.claims == 1  # queued, claimed
    assert executed == [f"{kid}/s1/a1"]


async def _exists(store, run_id: str) -> bool:
    return await store.read_summary(run_id) is not None


async def _driven(store, run_id: str) -> bool:
    summary = await store.read_summary(run_id)
    return summary is not None and summary.liveness is Liveness.DRIVEN


async def test_a_lost_wake_up_is_made_up_at_the_recheck_instant(fleet_store, monkeypatch):
    """A child's driver that dies between the child's end and the wake-up: the parent is
    claimed at its recheck instant anyway."""
    woken: list[str] = []

    async def lost(self, run_id: str) -> bool:
        woken.append(run_id)
        return False  # as if the waking process died first

    monkeypatch.setattr(type(fleet_store), "wake", lost)
    executed: list[str] = []
    gate = trio.Event()
    gate.set()
    agents = {
        "parent": lambda: parent_agent(fleet_store, child_agent(executed, gate)),
        "child": lambda: child_agent(executed, gate),
    }
    with trio.fail_after(60):
        async with fleet(fleet_store, agents, park_after_s=0.0, child_recheck_s=1.0) as worker:
            await worker.submit("parent", "go", run_id="p")
            result = await worker.result("p", poll_s=0.05)
    assert result.final_answer == "parent done"
    # the child's wake-up, and the parent's own look when the child ended before its park
    # was durable (`wake_if_children_ended`): each was lost
    assert woken and set(woken) == {"p"} and len(woken) <= 2
    awaited = next(
        r for r in (await fleet_store.read_log("p")).records if isinstance(r, ChildrenAwaited)
    )
    finished = (await fleet_store.read_log("p")).finished
    assert finished is not None
    # claimed again only at the recheck instant, not before
    assert treadle_seconds(awaited.ts, finished.ts) >= 1.0


async def test_a_child_that_ends_before_its_parents_park_is_durable_wakes_it(
    fleet_store, monkeypatch
):
    """The call gave up waiting (its last look found the child working), then the child
    finished and its wake-up found the parent still driven (its step not parked yet), then
    the park became durable: the parent slept until its recheck instant (an hour here). Its
    driver now looks at the children once the park is durable and wakes it itself."""
    from treadle.supervisors import _fleet

    woken: list[tuple[str, bool]] = []
    child_woke = trio.Event()
    wake = type(fleet_store).wake

    async def recorded(self, run_id: str) -> bool:
        changed = await wake(self, run_id)
        woken.append((run_id, changed))
        child_woke.set()
        return changed

    monkeypatch.setattr(type(fleet_store), "wake", recorded)
    executed: list[str] = []
    gate = trio.Event()
    kid = child_run_id("p/s1/a1")
    result_within = _fleet.result_within

    async def child_ends_after_the_last_look(store, run_id, *args):
        found = await result_within(store, run_id, *args)
        if found is None and run_id == kid and not gate.is_set():
            gate.set()  # the child finishes now, between the call's last look and the park
            await child_woke.wait()
        return found

    monkeypatch.setattr(_fleet, "result_within", child_ends_after_the_last_look)
    agents = {
        "parent": lambda: parent_agent(fleet_store, child_agent(executed, gate)),
        "child": lambda: child_agent(executed, gate),
    }
    with trio.fail_after(30):
        async with fleet(fleet_store, agents, child_recheck_s=3600) as worker:
            await worker.submit("parent", "go", run_id="p")
            result = await worker.result("p", poll_s=0.05)
    assert result.final_answer == "parent done"
    assert woken == [("p", False), ("p", True)]  # the child's found it driven; its own woke it
    log = await fleet_store.read_log("p")
    awaited = next(r for r in log.records if isinstance(r, ChildrenAwaited))
    ended = (await fleet_store.read_log(kid)).finished
    assert ended is not None and treadle_seconds(ended.ts, awaited.ts) >= 0
    assert executed == [f"{kid}/s1/a1"]
    assert check_invariants(log) == []


async def test_a_wake_up_the_store_fails_is_tried_again(fleet_store, monkeypatch):
    """The child's wake-up of its parked parent failed once (a lost connection): it was
    logged, and the parent slept until its recheck instant (an hour here)."""
    from treadle._exceptions import StoreError

    tries: list[str] = []
    wake = type(fleet_store).wake

    async def lost_once(self, run_id: str) -> bool:
        tries.append(run_id)
        if len(tries) == 1:
            raise StoreError("the connection to the database was lost")
        return await wake(self, run_id)

    monkeypatch.setattr(type(fleet_store), "wake", lost_once)
    executed: list[str] = []
    gate = trio.Event()
    agents = {
        "parent": lambda: parent_agent(fleet_store, child_agent(executed, gate)),
        "child": lambda: child_agent(executed, gate),
    }
    with trio.fail_after(30):
        async with fleet(fleet_store, agents, child_recheck_s=3600) as worker:
            await worker.submit("parent", "go", run_id="p")
            await until(lambda: parked(fleet_store, "p"))
            gate.set()
            result = await worker.result("p", poll_s=0.05)
    assert result.final_answer == "parent done"
    assert tries[:2] == ["p", "p"]  # failed, then tried again
    assert executed == [f"{child_run_id('p/s1/a1')}/s1/a1"]


def treadle_seconds(start: str, end: str) -> float:
    from treadle.actors import seconds_between

    return seconds_between(start, end)


async def test_cancelling_a_parked_parent_finishes_it_and_cancels_its_child(fleet_store):
    """The cancel wakes the parked parent (its control stream grew); its resumed drive
    finishes it ``cancelled`` without running the call again (the intent gets its unknown
    result) and cancels the child it waited on."""
    executed: list[str] = []
    gate = trio.Event()
    agents = {
        "parent": lambda: parent_agent(fleet_store, child_agent(executed, gate)),
        "child": lambda: child_agent(executed, gate),
    }
    kid = child_run_id("p/s1/a1")
    with trio.fail_after(60):
        async with fleet(fleet_store, agents, max_running=2, child_recheck_s=3600) as worker:
            await worker.submit("parent", "go", run_id="p")
            await until(lambda: parked(fleet_store, "p"))
            await until(lambda: _driven(fleet_store, kid))
            await fleet_store.append_control(
                CancelRequested(run_id="p", ts="2026-12-01T00:00:00+00:00", reason="enough")
            )
            parent = await worker.result("p", poll_s=0.05)
            child = await worker.result(kid, poll_s=0.05)
    assert (parent.state, child.state) == (RunState.CANCELLED, RunState.CANCELLED)
    assert executed == []  # the child's gated effect never happened
    log = await fleet_store.read_log("p")
    assert check_invariants(log) == []
    action = next(r for r in log.records if isinstance(r, ActionResult))
    assert action.outcome.status is ActionStatus.UNKNOWN
    kid_log = await fleet_store.read_log(kid)
    cancel = next(r for r in kid_log.records if isinstance(r, CancelRequested))
    assert cancel.canceller == "p"
    # Its time parked is active time (before, the closing step record counted none of it,
    # nor what the step took before parking: the totals said 0.0 s).
    awaited = next(r for r in log.records if isinstance(r, ChildrenAwaited))
    step = next(r for r in log.records if isinstance(r, StepRecord))
    parked_s = treadle_seconds(awaited.ts, step.ts)
    assert parked_s > 0 and abs(step.active_s - (awaited.active_s + parked_s)) < 1e-5
    assert parent.totals.active_s >= step.active_s


async def test_a_parked_parent_stops_when_its_time_budget_is_spent(fleet_store):
    """Its recheck instant was the child's recheck (an hour here) whatever its time budget:
    a parent with 1 s left parked for the hour, and then counted none of it."""
    gate = trio.Event()
    agents = {  # nobody serves the child: it stays queued
        "parent": lambda: parent_agent(
            fleet_store, child_agent([], gate), budgets=Budgets(time_budget_s=1.0)
        ),
    }
    with trio.fail_after(60):
        async with fleet(fleet_store, agents, child_recheck_s=3600) as worker:
            await worker.submit("parent", "go", run_id="p")
            await until(lambda: parked(fleet_store, "p"))
            parent = await worker.result("p", poll_s=0.05)
    assert parent.stop_reason is StopReason.TIME_BUDGET
    log = await fleet_store.read_log("p")
    awaited = next(r for r in log.records if isinstance(r, ChildrenAwaited))
    assert treadle_seconds(awaited.ts, awaited.recheck_ts) <= 1.0 - awaited.active_s + 1e-3
    assert parent.totals.active_s >= 1.0
    assert check_invariants(log) == []


USAGE = Usage(input_tokens=30, output_tokens=10)


@pytest.mark.parametrize("how", ["time", "cancel"])
async def test_a_parked_parent_that_ends_after_its_child_counts_the_childs_tokens(
    fleet_store, how: str
):
    """The parent parked; its child finished (nobody served the parent meanwhile); then the
    parent ended before it ran its step again: its time spent when a worker claimed it, or
    cancelled while nobody drove it. Its call was recorded ``unknown``, the child's 40 tokens
    missing from its totals."""
    parent_usage = Usage(input_tokens=10, output_tokens=5)
    child = attrs.evolve(
        child_agent([], trio.Event()),
        model=ScriptedModel(turns=[say("child done", usage=USAGE)]),
    )
    turns = [attrs.evolve(call("helper", call_id="h1", task="t"), usage=parent_usage), say("x")]
    parent = parent_agent(fleet_store, child, turns=turns, budgets=Budgets(time_budget_s=0.5))
    kid = child_run_id("p/s1/a1")
    with trio.fail_after(60):
        async with fleet(fleet_store, {"parent": lambda: parent}, child_recheck_s=3600) as one:
            await one.submit("parent", "go", run_id="p")
            await until(lambda: parked(fleet_store, "p"))
        async with fleet(fleet_store, {"child": lambda: child}) as two:
            ended = await two.result(kid, poll_s=0.05)
        assert ended.state is RunState.SUCCEEDED
        if how == "cancel":
            result = await finish_cancelled(fleet_store, "p", owner="test")
        else:
            await until(lambda: _time_spent(fleet_store, "p", 0.5))
            async with fleet(fleet_store, {"parent": lambda: parent}) as three:
                result = await three.result("p", poll_s=0.05)
    assert result.stop_reason is (
        StopReason.CANCELLED if how == "cancel" else StopReason.TIME_BUDGET
    )
    log = await fleet_store.read_log("p")
    assert check_invariants(log) == []
    action = next(r for r in log.records if isinstance(r, ActionResult))
    assert action.outcome.status is ActionStatus.EXECUTED and action.late
    assert (action.outcome.child_run_id, action.outcome.usage) == (kid, USAGE)
    assert action.outcome.observation == "child done"
    assert (result.totals.input_tokens, result.totals.output_tokens) == (40, 15)


def _sibling_children(gates: dict[str, trio.Event]) -> Agent:
    """A child whose ``note`` call waits for the gate of its parent's call, then answers."""

    @tool(replay=ReplayPolicy.SAFE)
    async def note(text: str, ctx: ToolContext) -> str:
        """Note (waits for its parent call's gate).

        Args:
            text: the note.
            ctx: the call.
        """
        await gates[ctx.run_id.removesuffix("/child")].wait()
        return f"noted {text}"

    return Agent(
        model=ScriptedModel(
            turns=[
                attrs.evolve(call("note", call_id="n1", text="hi"), usage=USAGE),
                say("child done", usage=USAGE),
            ]
        ),
        executor=Toolbox([note]),
        parser=NativeToolCallParser(),
    )


async def _parked_on_only(store, run_id: str, child: str) -> bool:
    """Whether ``run_id`` is parked and its latest park names ``child`` alone."""
    log = await store.read_log(run_id)
    awaited = [r for r in log.records if isinstance(r, ChildrenAwaited)]
    return bool(awaited) and awaited[-1].children == (child,) and await parked(store, run_id)


@pytest.mark.parametrize("how", ["time", "cancel"])
async def test_a_parked_parent_that_ends_counts_the_children_that_finished_before_it_parked(
    fleet_store, how: str
):
    """Two child calls in one step: the second's child finished, the first's works on; the
    step parks on the first alone (it keeps no result of the second), and the parent ends
    before it runs the step again. The second call was recorded ``unknown`` with no usage
    (the park did not name it), its child's tokens missing from the parent's totals."""
    gates = {"p/s1/a1": trio.Event(), "p/s1/a2": trio.Event()}
    gates["p/s1/a2"].set()
    both = attrs.evolve(
        calls(
            ToolCall(id="h1", name="helper", arguments={"task": "one"}),
            ToolCall(id="h2", name="helper", arguments={"task": "two"}),
        ),
        usage=Usage(input_tokens=10, output_tokens=5),
    )
    budgets = Budgets(time_budget_s=3.0) if how == "time" else Budgets()
    agents = {
        "parent": lambda: parent_agent(
            fleet_store, _sibling_children(gates), turns=[both, say("x")], budgets=budgets
        ),
        "child": lambda: _sibling_children(gates),
    }
    working, done = (child_run_id(f"p/s1/a{n}") for n in (1, 2))
    with trio.fail_after(60):
        async with fleet(fleet_store, agents, max_running=2, child_recheck_s=3600) as worker:
            await worker.submit("parent", "go", run_id="p")
            await until(lambda: _parked_on_only(fleet_store, "p", working))
            if how == "cancel":  # while nobody drives it, as `treadle cancel` does
                result = await finish_cancelled(fleet_store, "p", owner="test")
            else:  # claimed at its recheck instant, its time spent
                result = await worker.result("p", poll_s=0.05)
            ended = await worker.result(working, poll_s=0.05)
    assert result.stop_reason is (
        StopReason.CANCELLED if how == "cancel" else StopReason.TIME_BUDGET
    )
    log = await fleet_store.read_log("p")
    assert check_invariants(log) == []
    first, second = (r for r in log.records if isinstance(r, ActionResult))
    if how == "cancel":  # the child still working was cancelled after the parent's finish
        assert ended.state is RunState.CANCELLED
        assert first.outcome.status is ActionStatus.UNKNOWN and first.outcome.usage is None
    else:  # its time, capped by the parent's, ran out with the parent's: either ends first
        assert ended.stop_reason in (StopReason.CANCELLED, StopReason.TIME_BUDGET)
        assert first.outcome.child_run_id in (None, working)
    assert second.outcome.status is ActionStatus.EXECUTED and second.late
    assert (second.outcome.child_run_id, second.outcome.observation) == (done, "child done")
    assert second.outcome.usage == Usage(input_tokens=60, output_tokens=20)
    kept = first.outcome.usage or Usage(input_tokens=0, output_tokens=0)
    assert (result.totals.input_tokens, result.totals.output_tokens) == (
        70 + (kept.input_tokens or 0),
        25 + (kept.output_tokens or 0),
    )


async def test_queued_children_of_a_cancelled_parked_parent_are_finished_cancelled(
    fleet_store,
):
    """Nobody serves the children: they stay queued while the parent parks on them. The
    parent is cancelled while nobody drives it: each child got a cancel in its control stream
    and stayed ``queued`` for good, `treadle show` saying a worker would start it."""
    gates = {"p/s1/a1": trio.Event(), "p/s1/a2": trio.Event()}
    both = calls(
        ToolCall(id="h1", name="helper", arguments={"task": "one"}),
        ToolCall(id="h2", name="helper", arguments={"task": "two"}),
    )
    agents = {
        "parent": lambda: parent_agent(
            fleet_store, _sibling_children(gates), turns=[both, say("x")]
        ),
    }
    kids = [child_run_id(f"p/s1/a{n}") for n in (1, 2)]
    with trio.fail_after(60):
        async with fleet(fleet_store, agents, child_recheck_s=3600) as worker:
            await worker.submit("parent", "go", run_id="p")
            await until(lambda: parked(fleet_store, "p"))
            result = await finish_cancelled(fleet_store, "p", owner="test")
    assert result.state is RunState.CANCELLED
    for n, kid in enumerate(kids, start=1):
        log = await fleet_store.read_log(kid)
        assert log.finished is not None and log.finished.state is RunState.CANCELLED
        assert log.started is not None
        assert (log.started.parent_run_id, log.started.parent_intent_id) == ("p", f"p/s1/a{n}")
        assert [r.canceller for r in log.records if isinstance(r, CancelRequested)] == ["p"]
        assert (await fleet_store.read_summary(kid)).liveness is Liveness.FINISHED


async def test_show_says_a_queued_run_with_a_cancel_waiting_is_finished_not_started(
    fleet_store,
):
    """`treadle show` of a queued run whose control stream holds a cancel said that a worker
    serving it starts it."""
    await fleet_store.submit("r", agent="child", input=(Message(role="user", content="go"),))
    assert await not_started(fleet_store, "r") == (
        "queued (agent child): a worker serving it starts it"
    )
    await fleet_store.append_control(
        CancelRequested(run_id="r", ts="2026-12-01T00:00:00+00:00", reason="enough")
    )
    assert await not_started(fleet_store, "r") == (
        "queued (agent child) with a cancel waiting: a worker serving it finishes it "
        "cancelled without starting it (`treadle cancel r` does now)"
    )


async def _time_spent(store, run_id: str, budget_s: float) -> bool:
    """Whether the parked run's active time (its time parked included) reached ``budget_s``."""
    awaited = next(
        r for r in (await store.read_log(run_id)).records if isinstance(r, ChildrenAwaited)
    )
    now = dt.datetime.now(dt.UTC).isoformat()
    return awaited.active_s + treadle_seconds(awaited.ts, now) >= budget_s


async def test_a_queued_child_is_capped_by_what_its_parent_has_left(fleet_store):
    """The parent spent 70 of its 100 tokens: its queued child is capped at 30 (recorded in
    its run-started, applied by the worker that drives it) and stops at its token budget."""
    executed: list[str] = []
    gate = trio.Event()
    gate.set()
    spend = Usage(input_tokens=10, output_tokens=10)

    def child() -> Agent:
        agent = child_agent(executed, gate)
        model = ScriptedModel(
            turns=[
                attrs.evolve(call("note", call_id="n1", text="hi"), usage=spend),
                attrs.evolve(call("note", call_id="n2", text="again"), usage=spend),
                say("child done"),
            ]
        )
        return attrs.evolve(agent, model=model)

    def parent() -> Agent:
        return parent_agent(
            fleet_store,
            child(),
            turns=[
                attrs.evolve(
                    call("helper", call_id="h1", task="do it"),
                    usage=Usage(input_tokens=70, output_tokens=0),
                ),
                say("parent done"),
            ],
            budgets=Budgets(token_budget=100, time_budget_s=600.0),
        )

    kid = child_run_id("p/s1/a1")
    with trio.fail_after(60):
        async with fleet(fleet_store, {"parent": parent, "child": child}, max_running=2) as worker:
            await worker.submit("parent", "go", run_id="p")
            await until(lambda: _exists(fleet_store, kid))
            child_result = await worker.result(kid, poll_s=0.05)
            await worker.result("p", poll_s=0.05)
    started = (await fleet_store.read_log(kid)).started
    assert isinstance(started, RunStarted)
    assert started.caps is not None and started.caps.token_budget == 30
    assert started.caps.time_budget_s is not None and 0 < started.caps.time_budget_s <= 600
    assert (started.parent_run_id, started.parent_intent_id) == ("p", "p/s1/a1")
    assert child_result.stop_reason is StopReason.TOKEN_BUDGET
    assert len(executed) == 1  # its second call took it to 40 tokens: stopped there


async def test_a_step_with_a_call_that_may_not_run_twice_frees_the_slot_without_parking(
    fleet_store,
):
    """Beside the child call, a ``never`` call: parking would drop its outcome (the step's
    results are written together), so the parent waits with its slot freed, never parks."""
    executed: list[str] = []
    gate = trio.Event()
    effects: list[str] = []

    @tool
    async def stamp(ctx: ToolContext) -> str:
        """Stamp the record (an effect that must not happen twice).

        Args:
            ctx: the call.
        """
        effects.append(ctx.intent_id)
        return "stamped"

    def parent() -> Agent:
        both = calls(
            ToolCall(id="h1", name="helper", arguments={"task": "do it"}),
            ToolCall(id="s1", name="stamp", arguments={}),
        )
        return parent_agent(
            fleet_store,
            child_agent(executed, gate),
            turns=[both, say("parent done")],
            tools=[stamp],
        )

    agents = {"parent": parent, "child": lambda: child_agent(executed, gate)}
    with trio.fail_after(60):
        async with fleet(fleet_store, agents, park_after_s=0.0) as worker:
            await worker.submit("parent", "go", run_id="p")
            await until(lambda: _driven(fleet_store, child_run_id("p/s1/a1")))
            summary = await fleet_store.read_summary("p")
            assert summary.state is RunState.RUNNING and summary.liveness is Liveness.DRIVEN
            assert worker.statistics().waiting == 1
            gate.set()
            result = await worker.result("p", poll_s=0.05)
    assert result.final_answer == "parent done"
    assert effects == ["p/s1/a2"]
    log = await fleet_store.read_log("p")
    assert not any(isinstance(r, ChildrenAwaited) for r in log.records)


async def test_two_parallel_children_park_the_parent_until_both_answered(fleet_store):
    """Two child calls in one step, both safe: the parent parks on both; the first child's
    end wakes it, its step finds the other still working and parks again; the second's end
    wakes it for good. Each child ran once."""
    executed: list[str] = []
    gates = {"p/s1/a1": trio.Event(), "p/s1/a2": trio.Event()}

    @tool(replay=ReplayPolicy.SAFE)
    async def note(text: str, ctx: ToolContext) -> str:
        """Note (waits for its parent call's gate).

        Args:
            text: the note.
            ctx: the call.
        """
        parent_call = ctx.run_id.removesuffix("/child")
        await gates[parent_call].wait()
        executed.append(ctx.intent_id)
        return f"noted {text}"

    def child() -> Agent:
        return Agent(
            model=ScriptedModel(turns=[call("note", call_id="n1", text="hi"), say("child done")]),
            executor=Toolbox([note]),
            parser=NativeToolCallParser(),
        )

    def parent() -> Agent:
        both = calls(
            ToolCall(id="h1", name="helper", arguments={"task": "one"}),
            ToolCall(id="h2", name="helper", arguments={"task": "two"}),
        )
        return parent_agent(fleet_store, child(), turns=[both, say("parent done")])

    kids = [child_run_id(f"p/s1/a{n}") for n in (1, 2)]
    with trio.fail_after(60):
        async with fleet(
            fleet_store, {"parent": parent, "child": child}, max_running=2, child_recheck_s=3600
        ) as worker:
            await worker.submit("parent", "go", run_id="p")
            await until(lambda: parked(fleet_store, "p"))
            gates["p/s1/a1"].set()
            await worker.result(kids[0], poll_s=0.05)
            await until(lambda: _parked_twice(fleet_store))
            gates["p/s1/a2"].set()
            result = await worker.result("p", poll_s=0.05)
    assert result.final_answer == "parent done"
    assert sorted(executed) == sorted(f"{k}/s1/a1" for k in kids)
    log = await fleet_store.read_log("p")
    awaited = [r for r in log.records if isinstance(r, ChildrenAwaited)]
    assert [a.children for a in awaited] == [tuple(kids), (kids[1],)]
    step = next(r for r in log.records if isinstance(r, StepRecord))
    assert step.observations == ("child done", "child done")
    assert check_invariants(log) == []


async def _parked_twice(store) -> bool:
    log = await store.read_log("p")
    twice = sum(isinstance(r, ChildrenAwaited) for r in log.records) == 2
    return twice and await parked(store, "p")


def test_budget_caps_cut_only_what_they_bound():
    own = Budgets(max_steps=9, token_budget=500, time_budget_s=None)
    assert own.capped(None) is own
    assert own.capped(BudgetCaps()) is own
    capped = own.capped(BudgetCaps(token_budget=30, time_budget_s=12.5))
    assert (capped.max_steps, capped.token_budget, capped.time_budget_s) == (9, 30, 12.5)
    assert own.capped(BudgetCaps(token_budget=900)).token_budget == 500
