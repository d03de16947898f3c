"""Child runs queued in a fleet (docs/child-runs.md, "In a fleet"), on SQLite and PostgreSQL.

A parent driven by a fleet worker whose agent tool names an agent the fleet serves submits its
child to the fleet's queue and waits with its slot freed: any worker may claim the child, and
parents waiting on children never hold every slot.
"""

from __future__ import annotations

import contextlib

import attrs
import pytest
import trio

from treadle import agent_tool, child_run_id
from treadle._exceptions import ChildRunInterrupted, StoreError
from treadle.agent import Agent
from treadle.parsers import NativeToolCallParser
from treadle.stores.memory import MemoryStore
from treadle.supervisors import open_fleet
from treadle.supervisors._fleet_drive import FleetDrive, current_drive
from treadle.testing.scripted import ScriptedModel, call, calls, say
from treadle.tools import Toolbox, ToolContext, tool
from treadle.types import (
    ActionResult,
    CancelRequested,
    ModelReply,
    ReplayPolicy,
    RunResult,
    RunStarted,
    RunState,
    StopReason,
    ToolCall,
    Usage,
)


def child_agent(executed: list[str], *, gate: trio.Event | None = None) -> Agent:
    """One effect (``note``, recorded in ``executed``), then an answer."""

    @tool
    async def note(text: str, ctx: ToolContext) -> str:
        """Write a note (an effect).

        Args:
            text: the note.
            ctx: the call.
        """
        if gate is not None:
            await gate.wait()
        executed.append(ctx.intent_id)
        return f"noted {text}"

    return Agent(
        model=ScriptedModel(turns=[call("note", call_id="n1", text="hi"), say("child done")]),
        executor=Toolbox([note]),
        parser=NativeToolCallParser(),
        system_prompt="You are the child.",
    )


def parent_agent(store, child: Agent) -> Agent:
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
            turns=[call("helper", call_id="h1", task="do the thing"), say("parent done")]
        ),
        executor=Toolbox([helper]),
        parser=NativeToolCallParser(),
        system_prompt="You are the parent.",
    )


async def test_one_slot_two_parents_whose_children_are_queued_all_finish(fleet_store):
    """With one slot, a parent that held it while waiting would starve its queued child (and
    the other parent): the waiting parent frees it, the child is claimed, all four finish."""
    executed: list[str] = []
    agents = {
        "parent": lambda: parent_agent(fleet_store, child_agent(executed)),
        "child": lambda: child_agent(executed),
    }
    with trio.fail_after(60):
        async with open_fleet(fleet_store, agents, max_running=1, claim_poll_s=0.05) as worker:
            for run_id in ("p1", "p2"):
                await worker.submit("parent", "go", run_id=run_id)
            results = [await worker.result(run_id, poll_s=0.05) for run_id in ("p1", "p2")]
    stats = worker.statistics()  # once drained: every drive has ended
    assert [r.final_answer for r in results] == ["parent done"] * 2
    kids = [child_run_id(f"{p}/s1/a1") for p in ("p1", "p2")]
    assert sorted(executed) == sorted(f"{k}/s1/a1" for k in kids)
    assert sorted(await fleet_store.list_runs()) == sorted(["p1", "p2", *kids])
    # Each child was claimed from the queue (not driven inside its parent's call) and its
    # first record names its parent; each parent was claimed twice or more.
    assert stats.claimed == 4 and stats.finished == 4 and stats.waiting == 0
    for parent, kid in zip(("p1", "p2"), kids, strict=True):
        summary = await fleet_store.read_summary(kid)
        assert summary is not None and summary.agent == "child" and summary.claims == 1
        first = (await fleet_store.read_log(kid)).records[0]
        assert isinstance(first, RunStarted)
        assert (first.parent_run_id, first.parent_intent_id) == (parent, f"{parent}/s1/a1")
        action = next(
            r for r in (await fleet_store.read_log(parent)).records if isinstance(r, ActionResult)
        )
        assert action.outcome.child_run_id == kid
        assert action.outcome.observation == "child done"


async def test_a_parent_whose_child_finished_takes_its_slot_back_before_a_new_claim(fleet_store):
    """One slot: a parent waits on its queued child while another run is queued. When the child
    finishes, the slot it frees is the parent's: the worker claimed the other run into it
    before the parent saw its child's end, and the parent waited for that run to finish."""
    entered, gate = trio.Event(), trio.Event()
    order: list[str] = []

    @tool
    async def note(text: str, ctx: ToolContext) -> str:
        """Write a note.

        Args:
            text: who writes it.
            ctx: the call.
        """
        if text == "child":
            entered.set()
            await gate.wait()
        order.append(text)
        return "noted"

    def noting(*turns: ModelReply) -> Agent:
        return Agent(
            model=ScriptedModel(turns=list(turns)),
            executor=Toolbox([note]),
            parser=NativeToolCallParser(),
        )

    def parent() -> Agent:
        # The parent looks at its child's row every 0.5 s: long after the child's drive ended.
        helper = agent_tool(
            noting(call("note", text="child"), say("child done")),
            store=fleet_store,
            name="helper",
            description="Ask.",
            fleet_agent="child",
            control_poll_s=0.5,
        )
        return attrs.evolve(
            noting(call("helper", task="t"), call("note", text="parent"), say("parent done")),
            executor=Toolbox([helper, note]),
        )

    agents = {
        "parent": parent,
        "child": lambda: noting(call("note", text="child"), say("child done")),
        "other": lambda: noting(call("note", text="other"), say("other done")),
    }
    with trio.fail_after(60):
        async with open_fleet(
            fleet_store, agents, max_running=1, claim_poll_s=0.05, park_after_s=None
        ) as worker:
            await worker.submit("parent", "go", run_id="p")
            await entered.wait()  # the parent waits, its slot freed; the child holds it
            await worker.submit("other", "go", run_id="o")
            gate.set()
            for run_id in ("p", "o"):
                await worker.result(run_id, poll_s=0.05)
    assert order == ["child", "parent", "other"]


async def test_a_call_refuses_an_unrelated_queued_run_that_has_its_childs_id(fleet_store):
    """A run submitted on its own, with the child's agent and input, under the id a call's
    child derives: the idempotent submit took it for the child and the call its result."""
    executed: list[str] = []
    kid = child_run_id("p/s1/a1")
    agents = {
        "parent": lambda: parent_agent(fleet_store, child_agent(executed)),
        "child": lambda: child_agent(executed),
    }
    with trio.fail_after(60):
        async with open_fleet(fleet_store, agents, claim_poll_s=0.05) as worker:
            await worker.submit("child", "do the thing", run_id=kid)
            await worker.submit("parent", "go", run_id="p")
            result = await worker.result("p", poll_s=0.05)
            other = await worker.result(kid, poll_s=0.05)  # driven as the run it is
    assert result.state is RunState.SUCCEEDED
    action = next(
        r for r in (await fleet_store.read_log("p")).records if isinstance(r, ActionResult)
    )
    assert "not the child run of call p/s1/a1 (it names no parent)" in action.outcome.observation
    assert action.outcome.child_run_id is None
    assert other.final_answer == "child done" and executed == [f"{kid}/s1/a1"]


async def test_the_child_is_claimed_by_the_worker_that_serves_it(fleet_store):
    """Worker ``a`` serves only parents, worker ``b`` only children: b drives the child."""
    executed: list[str] = []
    with trio.fail_after(60):
        async with (
            open_fleet(
                fleet_store,
                {"parent": lambda: parent_agent(fleet_store, child_agent(executed))},
                max_running=1,
                claim_poll_s=0.05,
                owner="a",
            ) as a,
            open_fleet(
                fleet_store, {"child": lambda: child_agent(executed)}, claim_poll_s=0.05, owner="b"
            ) as b,
        ):
            await a.submit("parent", "go", run_id="p")
            result = await a.result("p", poll_s=0.05)
    claims = (a.statistics(), b.statistics())  # once drained: every drive has ended
    assert result.final_answer == "parent done"
    kid = child_run_id("p/s1/a1")
    assert executed == [f"{kid}/s1/a1"]
    assert (claims[0].claimed, claims[0].finished) == (1, 1)
    assert (claims[1].claimed, claims[1].finished) == (1, 1)
    summary = await fleet_store.read_summary(kid)
    assert summary is not None and summary.lease is not None
    assert summary.lease.owner in ("", "b")  # released by b when it finished


@contextlib.asynccontextmanager
async def _one_slot_fleet(fleet_store, make_child):
    """A fleet of one slot serving the parent (whose tool queues ``make_child()``'s runs)
    and the child, polling every 50 ms."""
    async with open_fleet(
        fleet_store,
        {"parent": lambda: parent_agent(fleet_store, make_child()), "child": make_child},
        max_running=1,
        claim_poll_s=0.05,
        control_poll_s=0.05,
    ) as worker:
        yield worker


async def _cancel_parent(fleet_store) -> None:
    """Append a cancel of run ``p`` to its control stream, as `treadle cancel` does."""
    await fleet_store.append_control(
        CancelRequested(run_id="p", ts="2026-12-01T00:00:00Z", reason="stop", canceller="t")
    )


async def test_cancelling_a_waiting_parent_cancels_its_queued_child_durably(fleet_store):
    """The parent waits (slot freed) on a child blocked in its tool; a cancel of the parent
    reaches the child through its control stream, whoever drives it: both end cancelled."""
    executed: list[str] = []
    gate = trio.Event()  # never opened: the child's tool honours the cancel
    entered = trio.Event()

    @tool(replay=ReplayPolicy.SAFE)
    async def block(ctx: ToolContext) -> str:
        """Wait for the gate (read-only)."""
        entered.set()
        await gate.wait()
        return "open"

    def make_child() -> Agent:
        return attrs.evolve(
            child_agent(executed),
            model=ScriptedModel(turns=[call("block", call_id="b1"), say("never")]),
            executor=Toolbox([block]),
        )

    kid = child_run_id("p/s1/a1")
    with trio.fail_after(60):
        async with _one_slot_fleet(fleet_store, make_child) as worker:
            await worker.submit("parent", "go", run_id="p")
            await entered.wait()
            assert worker.statistics().waiting == 1
            await _cancel_parent(fleet_store)
            parent = await worker.result("p", poll_s=0.05)
            child = await worker.result(kid, poll_s=0.05)
    assert parent.state is RunState.CANCELLED and parent.stop_reason is StopReason.CANCELLED
    assert child.state is RunState.CANCELLED
    cancels = [entry.record for entry in await fleet_store.read_control(kid)]
    assert [(c.run_id, c.canceller) for c in cancels] == [(kid, "p")]
    assert executed == []


async def test_a_waiting_parent_cancelled_records_how_its_queued_child_ended(fleet_store):
    """The cancel reaches the child, which finishes cancelled within the call's window: the
    parent's call records that, with the tokens the child spent (before, it was ``unknown``
    and the parent's totals left the child's tokens out)."""
    entered = trio.Event()
    spent = Usage(input_tokens=30, output_tokens=10)

    @tool(replay=ReplayPolicy.SAFE)
    async def block(ctx: ToolContext) -> str:
        """Wait for ever (read-only)."""
        entered.set()
        await trio.sleep_forever()
        return "never"

    def make_child() -> Agent:
        return attrs.evolve(
            child_agent([]),
            model=ScriptedModel(
                turns=[attrs.evolve(call("block", call_id="b1"), usage=spent), say("never")]
            ),
            executor=Toolbox([block]),
        )

    kid = child_run_id("p/s1/a1")
    with trio.fail_after(60):
        async with _one_slot_fleet(fleet_store, make_child) as worker:
            await worker.submit("parent", "go", run_id="p")
            await entered.wait()
            await _cancel_parent(fleet_store)
            parent = await worker.result("p", poll_s=0.05)
    assert parent.state is RunState.CANCELLED
    log = await fleet_store.read_log("p")
    action = next(r for r in log.records if isinstance(r, ActionResult))
    assert action.outcome.child_run_id == kid and action.outcome.usage == spent
    assert action.outcome.observation == f"Error: the child run {kid} ended cancelled (cancelled)"
    # the child's 30 + 10 and the parent's one reply, scripted at 10 + 5
    assert (parent.totals.input_tokens, parent.totals.output_tokens) == (40, 15)


async def test_a_child_started_inline_before_the_parent_came_to_a_fleet_is_re_attached_inline(
    fleet_store,
):
    """The parent's call ran outside a fleet first and drove its child inline (here: the child
    run exists, finished, under the derived id, not queued). Under a fleet the replayed call
    does not queue it (a queue entry cannot name a run started without the queue): it reads
    the child's stored result, and the child's effect is not repeated."""
    executed: list[str] = []
    kid = child_run_id("p/s1/a1")
    helper = agent_tool(child_agent(executed), store=fleet_store, name="helper", description="A.")
    ctx = ToolContext(run_id="p", step=1, intent_id="p/s1/a1", call_id="h1", tool="helper")
    earlier = await helper.fn(task="do the thing", ctx=ctx)  # outside a fleet: inline
    assert earlier.observation == "child done" and len(executed) == 1
    agents = {
        "parent": lambda: parent_agent(fleet_store, child_agent(executed)),
        "child": lambda: child_agent(executed),
    }
    with trio.fail_after(60):
        async with open_fleet(fleet_store, agents, max_running=1, claim_poll_s=0.05) as worker:
            await worker.submit("parent", "go", run_id="p")
            result = await worker.result("p", poll_s=0.05)
    stats = worker.statistics()  # once drained: every drive has ended
    assert result.final_answer == "parent done"
    assert executed == [f"{kid}/s1/a1"]
    assert stats.claimed == 1
    action = next(
        r for r in (await fleet_store.read_log("p")).records if isinstance(r, ActionResult)
    )
    assert (action.outcome.observation, action.outcome.child_run_id) == ("child done", kid)
    summary = await fleet_store.read_summary(kid)
    assert summary is not None and summary.submitted_at is None


async def test_a_parent_waiting_on_two_parallel_children_holds_no_slot_until_both_end(
    fleet_store,
):
    """Two child-run calls in one step, one slot: the parent's slot stays free until its last
    waiting call ends, so the second child is claimed after the first (were the slot taken
    again when the first call returned, the second child would never run)."""
    executed: list[str] = []

    def make_parent() -> Agent:
        base = parent_agent(fleet_store, child_agent(executed))
        both = calls(
            ToolCall(id="h1", name="helper", arguments={"task": "one"}),
            ToolCall(id="h2", name="helper", arguments={"task": "two"}),
        )
        return attrs.evolve(base, model=ScriptedModel(turns=[both, say("parent done")]))

    agents = {"parent": make_parent, "child": lambda: child_agent(executed)}
    with trio.fail_after(60):
        async with open_fleet(fleet_store, agents, max_running=1, claim_poll_s=0.05) as worker:
            await worker.submit("parent", "go", run_id="p")
            result = await worker.result("p", poll_s=0.05)
    stats = worker.statistics()  # once drained: every drive has ended
    assert result.final_answer == "parent done"
    kids = [child_run_id(f"p/s1/a{n}") for n in (1, 2)]
    assert sorted(executed) == sorted(f"{k}/s1/a1" for k in kids)
    assert (stats.claimed, stats.finished, stats.waiting) == (3, 3, 0)


async def test_a_store_error_while_queueing_the_child_interrupts_the_call_instead_of_answering():
    """A failed submission (or reading) leaves the call's outcome unknown: the tool raises
    `ChildRunInterrupted` (the parent's drive stops resumable, docs/child-runs.md, "Run ids"),
    it never hands the model an error observation that would stand for the child's result."""
    store = MemoryStore()
    helper = agent_tool(
        child_agent([]), store=store, name="helper", description="Ask.", fleet_agent="child"
    )

    async def submit(agent: str, task: str, run_id: str, caps: object, parent: object) -> object:
        raise StoreError("the store is unreachable")

    async def result(
        run_id: str, poll_s: float, output_type: object, patience_s: float
    ) -> RunResult:
        raise AssertionError("not reached")

    drive = FleetDrive(
        run_id="p", store=store, submit=submit, result=result, waiting=contextlib.nullcontext
    )
    ctx = ToolContext(run_id="p", step=1, intent_id="p/s1/a1", call_id="h1", tool="helper")
    token = current_drive.set(drive)
    try:
        with pytest.raises(ChildRunInterrupted, match="unreachable"):
            await helper.fn(task="do it", ctx=ctx)
    finally:
        current_drive.reset(token)
