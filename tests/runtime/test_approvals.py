from __future__ import annotations

import contextlib
import enum
import functools
import json
from collections.abc import AsyncIterator
from typing import Any, Literal

import attrs
import pytest
import trio
from runtime_fakes import LedgerTools, SimpleParser
from tests.fixtures.approval_waits import wait_for_durable_request, wait_for_state
from tests.fixtures.schema_host import schema_host

from treadle._exceptions import SnapshotMismatch, StoreError, UsageError
from treadle.agent import Agent
from treadle.approvals import (
    AlreadyDecided,
    arguments_digest,
    decide,
    decision_for,
    pending_approval,
    request_cancel,
)
from treadle.stores.memory import MemoryStore
from treadle.supervisors import RunHandle, open_run
from treadle.supervisors import run as treadle_run
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.tools import Toolbox, tool
from treadle.types import (
    ActionIntent,
    ActionResult,
    ActionStatus,
    ApprovalDecided,
    ApprovalRequested,
    Budgets,
    CancelRequested,
    Limits,
    RunState,
    StepRecord,
    StopReason,
)


def only_add(tool_name, arguments):
    return tool_name == "add"


def make(turns, **kwargs):
    tools = LedgerTools()
    model = ScriptedModel(turns=turns)
    return Agent(model=model, executor=tools, parser=SimpleParser(), **kwargs), tools, model


def kinds(log):
    return [type(r).__name__ for r in log.records]


async def test_approved_call_runs_after_the_decision_is_recorded(autojump_clock):
    agent, tools, _ = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r", approval_policy=only_add) as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        request = handle.pending_approval
        assert request.call_id == "c1"
        assert request.arguments_digest == arguments_digest({"a": 1, "b": 2})
        assert tools.executed == []
        handle.approve("c1")
        result = await handle.wait()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert [a.arguments for a in tools.executed] == [{"a": 1, "b": 2}]
    log = await store.read_log("r")
    names = kinds(log)
    assert names.index("ApprovalRequested") < names.index("ApprovalDecided")
    assert names.index("ApprovalDecided") < names.index("ActionIntent")
    (decided,) = [r for r in log.records if isinstance(r, ApprovalDecided)]
    assert decided.decision == "approve"
    assert pending_approval(log) is None


async def test_rejected_call_never_runs_and_the_model_sees_the_message(autojump_clock):
    agent, tools, model = make([call("add", a=1, b=2, call_id="c1"), say("ok")])
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r", approval_policy=only_add) as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        handle.approve(reject="not on a Friday")
        await handle.wait()
    assert tools.executed == []
    log = await store.read_log("r")
    assert not any(isinstance(r, ActionIntent) for r in log.records)
    (result,) = [r for r in log.records if isinstance(r, ActionResult)]
    assert result.outcome.status is ActionStatus.NOT_EXECUTED
    expected = agent.synthetic.rejected.format(tool="add", detail="not on a Friday")
    assert result.outcome.observation == expected
    assert result.outcome.observation_is_synthetic
    tool_messages = [m for m in model.requests[1].messages if m.role == "tool"]
    assert [m.content for m in tool_messages] == [expected]


async def test_edited_arguments_are_what_runs(autojump_clock):
    agent, tools, _ = make([call("add", a=1, b=2, call_id="c1"), say("ok")])
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r", approval_policy=only_add) as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        handle.approve(edit={"a": 10, "b": 20})
        await handle.wait()
    assert [a.arguments for a in tools.executed] == [{"a": 10, "b": 20}]
    log = await store.read_log("r")
    (intent,) = [r for r in log.records if isinstance(r, ActionIntent)]
    assert intent.arguments == {"a": 10, "b": 20}
    (step,) = [r for r in log.records if isinstance(r, StepRecord)][:1]
    assert step.observations == ("30",)


class Tier(enum.Enum):
    BASIC = 1
    GOLD = 2


@tool(requires_approval=True)
async def set_tier(tier: Literal[1, 2], level: Tier) -> str:
    """Set a customer's tier and level."""
    return f"tier {tier!r} level {level!r}"


@pytest.mark.parametrize("edit", [{"tier": 1.0, "level": 2}, {"tier": 1, "level": 2.0}])
async def test_an_edit_the_schema_accepts_is_one_the_tool_runs_with(edit, autojump_clock):
    """JSON Schema takes 1.0 for an ``enum`` of 1, the tool's validation took it for no
    Literal or int enum value: the edit was accepted, then the call refused, never run."""
    agent = Agent(
        model=ScriptedModel(turns=[call("set_tier", tier=2, level=1, call_id="c1"), say("ok")]),
        executor=Toolbox([set_tier]),
        parser=SimpleParser(),
    )
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r") as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        handle.approve(edit=edit)
        await handle.wait()
    (result,) = [r for r in (await store.read_log("r")).records if isinstance(r, ActionResult)]
    assert result.outcome.status is ActionStatus.EXECUTED
    assert result.outcome.observation == "tier 1 level <Tier.GOLD: 2>"


@tool(requires_approval=True)
async def scale(factor: float) -> str:
    """Scale the order by a factor."""
    return f"scaled by {factor!r}"


async def test_an_edit_the_tool_cannot_take_is_refused_and_the_request_stays_pending(
    autojump_clock,
):
    """A float argument's edit past what a float holds is refused before it is recorded.

    ``10**400`` fitted the schema's ``number``, and the tool's validation refused it once the
    call was approved: it was never run, and the approver was not told.
    """
    agent = Agent(
        model=ScriptedModel(turns=[call("scale", factor=1.5, call_id="c1"), say("ok")]),
        executor=Toolbox([scale]),
        parser=SimpleParser(),
    )
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r") as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        with pytest.raises(UsageError, match=r"is not of type 'number'"):
            handle.approve(edit={"factor": 10**400})
        assert handle.pending_approval is not None
        assert handle.pending_approval.call_id == "c1"
        handle.approve(edit={"factor": 2})
        await handle.wait()
    log = await store.read_log("r")
    assert [r.decision for r in log.records if isinstance(r, ApprovalDecided)] == ["edit"]
    (result,) = [r for r in log.records if isinstance(r, ActionResult)]
    assert (result.outcome.status, result.outcome.observation) == (
        ActionStatus.EXECUTED,
        "scaled by 2.0",
    )


async def test_a_decision_for_another_call_is_refused(autojump_clock):
    agent, tools, _ = make([call("add", a=1, b=2, call_id="c1"), say("ok")])
    store = MemoryStore()
    async with open_run(
        agent, "x", store=store, run_id="r", approval_policy=only_add, control_poll_s=0.5
    ) as handle:
        await wait_for_durable_request(handle)
        with pytest.raises(UsageError, match="waits on call 'c1'"):
            handle.approve("c2")
        with pytest.raises(UsageError, match="waits on call 'c1'"):
            await decide(store, "r", call_id="c2")
        # A decision bound to other arguments (written behind the checks' back) is never
        # applied: the run keeps waiting.
        request = handle.pending_approval
        forged = ApprovalDecided(
            run_id="r",
            step=request.step,
            call_id="c1",
            arguments_digest=arguments_digest({"a": 1, "b": 3}),
            decision="approve",
            ts="2026-01-01T00:00:00+00:00",
        )
        await store.append_control(forged)
        # Nor is one whose decision is none the run knows (approve, reject, edit, and the
        # expiry its driver writes there at the deadline).
        unknown = attrs.evolve(
            forged, arguments_digest=request.arguments_digest, decision="postpone"
        )
        await store.append_control(unknown)
        await trio.sleep(5)
        assert handle.state is RunState.AWAITING_APPROVAL
        assert tools.executed == []
        handle.approve()
        await handle.wait()
    assert len(tools.executed) == 1


async def test_the_deadline_ends_the_wait_with_a_synthetic_observation(autojump_clock):
    agent, tools, _ = make(
        [call("add", a=1, b=2, call_id="c1"), say("ok")],
        budgets=Budgets(time_budget_s=60),
        limits=Limits(approval_timeout_s=900),
    )
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r", approval_policy=only_add) as handle:
        began = trio.current_time()
        result = await handle.wait()
        waited = trio.current_time() - began
    assert waited >= 899
    # Waiting is not active time: the 60 s budget did not end the run.
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert result.totals.active_s < 60
    assert tools.executed == []
    log = await store.read_log("r")
    (decided,) = [r for r in log.records if isinstance(r, ApprovalDecided)]
    assert decided.decision == "expired"
    (action,) = [r for r in log.records if isinstance(r, ActionResult)]
    assert action.outcome.status is ActionStatus.NOT_EXECUTED
    assert "approval deadline" in action.outcome.observation


async def test_restart_during_the_wait_keeps_waiting_and_a_later_decision_continues(
    autojump_clock,
):
    store = MemoryStore()
    turns = [call("add", a=1, b=2, call_id="c1"), say("3")]
    agent, tools, _ = make(turns)
    with trio.CancelScope() as crash:  # the process driving the run goes away
        async with open_run(
            agent, "x", store=store, run_id="r", approval_policy=only_add
        ) as handle:
            await wait_for_state(handle, RunState.AWAITING_APPROVAL)
            crash.cancel()
    assert (await store.read_log("r")).finished is None

    agent, tools, _ = make(turns)
    async with open_run(agent, store=store, run_id="r", approval_policy=only_add) as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        await trio.sleep(30)
        assert handle.state is RunState.AWAITING_APPROVAL
        # Decided from "another process": through the control log.
        await decide(store, "r")
        result = await handle.wait()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert [a.call_id for a in tools.executed] == ["c1"]
    log = await store.read_log("r")
    assert kinds(log).count("ApprovalRequested") == 1
    (decided,) = [r for r in log.records if isinstance(r, ApprovalDecided)]
    assert decided.run_id == "r"


async def test_a_decision_written_while_no_one_drives_the_run_is_used_on_resume(autojump_clock):
    store = MemoryStore()
    turns = [call("add", a=1, b=2, call_id="c1"), say("3")]
    agent, _, _ = make(turns)
    with trio.CancelScope() as crash:
        async with open_run(
            agent, "x", store=store, run_id="r", approval_policy=only_add
        ) as handle:
            await wait_for_durable_request(handle)
            crash.cancel()
    await decide(store, "r", reject="no")
    agent, tools, _ = make(turns)
    async with open_run(
        agent, store=store, run_id="r", approval_policy=only_add, control_poll_s=None
    ) as handle:
        result = await handle.wait()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert tools.executed == []


async def test_cancel_while_awaiting_approval_starts_no_action(autojump_clock):
    agent, tools, _ = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r", approval_policy=only_add) as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        await request_cancel(store, "r", reason="stop", canceller="ops")
        result = await handle.wait()
    assert result.state is RunState.CANCELLED
    assert tools.executed == []
    log = await store.read_log("r")
    assert not any(isinstance(r, ActionIntent) for r in log.records)
    cancel = log.records[-2]
    assert isinstance(cancel, CancelRequested)
    assert (cancel.reason, cancel.canceller) == ("stop", "ops")
    with pytest.raises(UsageError, match="already finished"):
        await decide(store, "r")


async def test_a_tool_declared_with_requires_approval_waits(autojump_clock):
    @tool(requires_approval=True)
    async def transfer(amount: int) -> str:
        """Move money."""
        return f"moved {amount}"

    model = ScriptedModel(turns=[call("transfer", amount=5, call_id="t1"), say("done")])
    agent = Agent(model=model, executor=Toolbox([transfer]), parser=SimpleParser())
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r") as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        assert handle.pending_approval.tool == "transfer"
        handle.approve()
        await handle.wait()
    log = await store.read_log("r")
    (result,) = [r for r in log.records if isinstance(r, ActionResult)]
    assert result.outcome.observation == "moved 5"
    assert isinstance(log.records[3], ApprovalRequested)


# --------------------------------------------------------------- across real processes

DRIVER = """
import json, sys
from pathlib import Path

import trio

import treadle
from treadle.stores.sqlite import open_sqlite_store
from treadle.supervisors import open_run
from treadle.testing.scripted import ScriptedModel, call, say

db, marker, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]


@treadle.tool(requires_approval=True)
async def transfer(amount: int) -> str:
    \"\"\"Move money.\"\"\"
    with marker.open("a") as out:
        out.write(f"{amount}\\n")
    return f"moved {amount}"


async def main():
    agent = treadle.Agent(
        model=ScriptedModel(turns=[call("transfer", amount=5, call_id="t1"), say("done")]),
        executor=treadle.Toolbox([transfer]),
        parser=treadle.NativeToolCallParser(),
    )
    async with open_sqlite_store(db) as store:
        run_input = "pay" if mode == "new" else None
        # The restarted process keeps its owner id: it continues the dead one's lease at
        # once instead of waiting for it to expire.
        async with open_run(
            agent, run_input, store=store, run_id="r", control_poll_s=0.05, owner="driver"
        ) as h:
            # The request is durable once its event is delivered (RunHandle.wait_state).
            async for event in h.events():
                if event.kind.value in ("approval_requested", "run_finished"):
                    break
            print((await h.wait_state(treadle.RunState.AWAITING_APPROVAL)).value, flush=True)
            result = await h.wait()
    print(json.dumps({"state": result.state.value, "answer": result.final_answer}), flush=True)


trio.run(main)
"""


async def read_sqlite(db):
    from treadle.stores.sqlite import open_sqlite_store

    async with open_sqlite_store(db) as store:
        return await store.read_log("r")


async def read_line(process):
    line = await trio.to_thread.run_sync(process.stdout.readline)
    return line.strip()


def cli(*args):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "treadle", *args], capture_output=True, text=True, timeout=60
    )


async def test_an_approval_survives_a_process_restart(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    db, marker = tmp_path / "runs.db", tmp_path / "executed.txt"

    def start(mode):
        return subprocess.Popen(
            [sys.executable, str(script), str(db), str(marker), mode],
            stdout=subprocess.PIPE,
            text=True,
        )

    first = start("new")
    try:
        with trio.fail_after(60):
            assert await read_line(first) == "awaiting_approval"
        first.kill()  # the process dies while the run waits
        first.wait(timeout=60)
    finally:
        first.kill()
        first.wait(timeout=60)
        first.stdout.close()
    log = await read_sqlite(db)
    assert log.finished is None
    assert pending_approval(log).call_id == "t1"

    second = start("resume")
    try:
        with trio.fail_after(60):
            assert await read_line(second) == "awaiting_approval"
        assert not marker.exists()
        # A decision for another call is refused, and nothing is written.
        refused = await trio.to_thread.run_sync(
            lambda: cli("approve", "r", "--store", str(db), "--call", "t2")
        )
        assert refused.returncode != 0
        assert "waits on call 't1'" in refused.stderr
        approved = await trio.to_thread.run_sync(lambda: cli("approve", "r", "--store", str(db)))
        assert approved.returncode == 0, approved.stderr
        with trio.fail_after(60):
            outcome = json.loads(await read_line(second))
        assert second.wait(timeout=60) == 0
    finally:
        second.kill()
        second.wait(timeout=60)
        second.stdout.close()
    assert outcome == {"state": "succeeded", "answer": "done"}
    assert marker.read_text() == "5\n"  # executed once, after the decision
    log = await read_sqlite(db)
    names = kinds(log)
    assert names.count("ApprovalRequested") == 1
    assert names.index("ApprovalDecided") < names.index("ActionIntent")
    # The CLI can follow what happened, and refuses to decide a finished run.
    tailed = await trio.to_thread.run_sync(lambda: cli("tail", "r", "--store", str(db)))
    assert tailed.returncode == 0, tailed.stderr
    assert "approval requested" in tailed.stdout and "approval decided" in tailed.stdout
    assert tailed.stdout.strip().splitlines()[-1].split()[1:3] == ["run", "finished"]
    late = await trio.to_thread.run_sync(lambda: cli("approve", "r", "--store", str(db)))
    assert late.returncode != 0 and "already finished" in late.stderr


async def test_each_call_of_a_batch_is_decided_before_any_intent(autojump_clock):
    from treadle.testing.scripted import calls
    from treadle.types import ToolCall

    batch = calls(
        ToolCall(id="a", name="add", arguments={"a": 1, "b": 1}),
        ToolCall(id="b", name="done", arguments={}),
        ToolCall(id="c", name="add", arguments={"a": 2, "b": 2}),
    )
    agent, tools, _ = make([batch, say("ok")])
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r", approval_policy=only_add) as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        assert handle.pending_approval.call_id == "a"
        handle.approve(reject="no")
        while handle.pending_approval is None or handle.pending_approval.call_id != "c":  # noqa: ASYNC110
            await trio.sleep(0.01)
        assert tools.executed == []
        handle.approve("c")
        await handle.wait()
    assert sorted(a.call_id for a in tools.executed) == ["b", "c"]  # run in parallel
    log = await store.read_log("r")
    names = kinds(log)
    last_decision = max(i for i, n in enumerate(names) if n == "ApprovalDecided")
    first_intent = names.index("ActionIntent")
    assert last_decision < first_intent
    results = [r for r in log.records if isinstance(r, ActionResult)]
    assert [r.call_id for r in results] == ["a", "b", "c"]
    assert results[0].outcome.status is ActionStatus.NOT_EXECUTED


@pytest.mark.parametrize("park_after_s", [None, 0.0], ids=["driven", "parked"])
async def test_a_decision_for_a_call_not_asked_yet_says_the_one_before_is_decided(
    park_after_s, autojump_clock
):
    """Two calls of a step put to a human one at a time: the first decided through the
    store, the second decided at once, before the run applied the first. The refusal said
    the run "waits on call 'a', not on 'c'", sending the decider back to a call just
    decided; it says that call's decision waits to be applied and the next is asked then."""
    from treadle.testing.scripted import calls
    from treadle.types import ToolCall

    batch = calls(
        ToolCall(id="a", name="add", arguments={"a": 1, "b": 1}),
        ToolCall(id="c", name="add", arguments={"a": 2, "b": 2}),
    )
    agent, tools, _ = make([batch, say("ok")])
    store = MemoryStore()
    async with open_run(
        agent,
        "x",
        store=store,
        run_id="r",
        approval_policy=only_add,
        control_poll_s=0.5,
        park_after_s=park_after_s,
    ) as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        await decide(store, "r", call_id="a")
        with pytest.raises(UsageError) as early:
            await decide(store, "r", call_id="c")
        assert not isinstance(early.value, AlreadyDecided)
        assert str(early.value) == (
            "run 'r' has not asked about call 'c' yet: the call it waits on, 'a' (add), has a "
            "decision (approve) waiting to be applied, and a later call that needs a human is "
            "asked once it is; decide that call then"
        )
        with trio.fail_after(60):
            async with contextlib.aclosing(handle.events()) as events:
                async for event in events:
                    if event.kind.value == "approval_requested" and event.record.call_id == "c":
                        break
        await decide(store, "r", call_id="c", reject="no")
        await handle.wait()
    assert [a.call_id for a in tools.executed] == ["a"]


async def test_tail_follows_a_live_run_from_any_seq(autojump_clock):
    from treadle._cli_runs import format_event, tail

    agent, _, _ = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    store = MemoryStore()
    shown = []
    async with (
        open_run(agent, "x", store=store, run_id="r", approval_policy=only_add) as handle,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(tail, store, "r", 2, lambda seq, rec: shown.append((seq, rec)))
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        await trio.sleep(1)
        assert [type(r).__name__ for _, r in shown][-1] == "ApprovalRequested"
        handle.approve()
    log = await store.read_log("r")
    assert [seq for seq, _ in shown] == list(range(2, len(log.records) + 1))
    assert [r for _, r in shown] == list(log.records[1:])
    lines = [format_event(seq, record) for seq, record in shown]
    shown = 'add({"a": 1, "b": 2}) (call c1)'
    assert any("approval requested" in line and shown in line for line in lines)
    assert "run finished" in lines[-1] and "succeeded (final_answer)" in lines[-1]


class TrioTimeClock:
    """A wall clock that follows trio's clock (a mock clock's jumps included)."""

    def now_iso(self):
        import datetime as dt

        start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
        return (start + dt.timedelta(seconds=trio.current_time())).isoformat()


class SettableClock:
    def __init__(self):
        import datetime as dt

        self.now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)

    def now_iso(self):
        return self.now.isoformat()


async def left_waiting(turns, clock: SettableClock, store=None) -> tuple[Any, ApprovalRequested]:
    """A run left waiting on an approval of 600 s: its driving block was cancelled while it
    waited, so nothing was in flight and the run stays unfinished, as when its process stops.
    """
    store = MemoryStore() if store is None else store
    agent, _, _ = make(turns, limits=Limits(approval_timeout_s=600))
    with trio.CancelScope() as stopped:
        async with open_run(
            agent, "x", store=store, run_id="r", approval_policy=only_add, clock=clock
        ) as handle:
            await wait_for_state(handle, RunState.AWAITING_APPROVAL)
            stopped.cancel()
    (request,) = [
        r for r in (await store.read_log("r")).records if isinstance(r, ApprovalRequested)
    ]
    return store, request


async def test_the_deadline_is_durable_across_a_restart(autojump_clock):
    import datetime as dt

    clock = SettableClock()
    turns = [call("add", a=1, b=2, call_id="c1"), say("ok")]
    store, request = await left_waiting(turns, clock)
    assert request.deadline_ts == "2026-01-01T00:10:00+00:00"

    clock.now += dt.timedelta(seconds=400)  # the process was down for 400 s of the 600
    agent, tools, _ = make(turns, limits=Limits(approval_timeout_s=600))
    async with open_run(
        agent, store=store, run_id="r", approval_policy=only_add, clock=clock
    ) as handle:
        began = trio.current_time()
        result = await handle.wait()
        waited = trio.current_time() - began
    assert 199 <= waited <= 201  # only what was left of the stored deadline
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert tools.executed == []
    decided = await _logged_decisions(store)
    assert [d.decision for d in decided] == ["expired"]


@pytest.mark.parametrize("seed", range(8))
async def test_a_subscriber_sees_the_handle_reflect_each_event_it_receives(seed, autojump_clock):
    """Issue 13 item 1: the natural pattern (``approval_requested`` from ``handle.events()``,
    then ``handle.approve()``) raised "not waiting for an approval": the handle changed one
    scheduling step after the event. When a subscriber receives an event, the handle already
    reflects it, for every event that changes what the handle reports."""
    trio._core._run._r.seed(seed)  # trio's own scheduling order (the simulation does the same)
    agent, tools, _ = make(
        [call("add", a=1, b=2, call_id="c1"), call("add", a=3, b=4, call_id="c2"), say("done")]
    )
    store = MemoryStore()
    seen = []
    async with open_run(  # noqa: SIM117 (events() needs the handle)
        agent, "x", store=store, run_id="r", approval_policy=only_add
    ) as handle:
        async with contextlib.aclosing(handle.events()) as events:
            async for event in events:
                seen.append(event.kind.value)
                if event.kind.value == "run_started":
                    assert handle.state is RunState.RUNNING
                elif event.kind.value == "approval_requested":
                    assert handle.state is RunState.AWAITING_APPROVAL
                    assert handle.pending_approval is not None
                    assert handle.pending_approval.call_id == event.record.call_id
                    handle.approve(event.record.call_id)  # raised UsageError before
                elif event.kind.value == "run_finished":
                    assert handle.result is not None and handle.state is RunState.SUCCEEDED
    assert seen.count("approval_requested") == 2
    assert [a.arguments for a in tools.executed] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]


@pytest.mark.parametrize("seed", range(8))
async def test_a_sink_sees_the_handle_reflect_each_event_it_receives(seed, autojump_clock):
    """The same rule for sinks: a sink that approves from ``approval_requested`` can."""
    trio._core._run._r.seed(seed)
    agent, tools, model = make([call("add", a=1, b=2, call_id="c1"), say("done")])
    model.latency_s = 1.0  # the handle is known before the first reply comes back
    problems: list[str] = []
    handles = []
    checked = []

    class Approver:
        async def send(self, event):
            if not handles:  # open_run has not yielded the handle yet
                return
            handle = handles[0]
            kind = event.kind.value
            checked.append(kind)
            if kind == "run_started" and handle.state is not RunState.RUNNING:
                problems.append(f"run_started while {handle.state}")
            elif kind == "approval_requested":
                if handle.pending_approval is None:
                    problems.append("approval_requested with no pending approval")
                else:
                    handle.approve(event.record.call_id)
            elif kind == "run_finished" and handle.result is None:
                problems.append("run_finished with no result")

    async with open_run(
        agent, "x", store=MemoryStore(), run_id="r", approval_policy=only_add, sinks=[Approver()]
    ) as handle:
        handles.append(handle)
        result = await handle.wait()
        statistics = handle.statistics()
    assert problems == []
    assert {"approval_requested", "run_finished"} <= set(checked)
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert statistics is not None and statistics.sink_failures == 0
    assert [a.arguments for a in tools.executed] == [{"a": 1, "b": 2}]


class _RacingDeciders(MemoryStore):
    """Holds the first control reads of the tasks named ``decider-*`` until both have read,
    so both pass the "no decision yet" check before either writes (two processes deciding at
    once: the console and ``treadle approve``)."""

    def __init__(self) -> None:
        super().__init__()
        self.both_read = trio.Event()
        self.readers = 0

    async def read_control(self, run_id, *, after=0):
        entries = await super().read_control(run_id, after=after)
        if trio.lowlevel.current_task().name.startswith("decider-") and not self.both_read.is_set():
            self.readers += 1
            if self.readers == 2:
                self.both_read.set()
            await self.both_read.wait()
        return entries


async def test_two_deciders_at_once_the_one_that_does_not_count_is_told(autojump_clock):
    """Both decisions are written (the control stream is append-only), the first counts, and
    the decider whose decision does not count gets an error saying so, not a success."""
    agent, tools, _ = make([call("add", a=1, b=2, call_id="c1"), say("ok")])
    store = _RacingDeciders()
    outcomes: dict[str, object] = {}

    async def decider(name, **decision):
        try:
            outcomes[name] = await decide(store, "r", call_id="c1", **decision)
        except UsageError as exc:
            outcomes[name] = exc

    async with open_run(agent, "x", store=store, run_id="r", approval_policy=only_add) as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(decider, "approve", name="decider-approve")
            nursery.start_soon(
                functools.partial(decider, "reject", reject="no"), name="decider-reject"
            )
        await handle.wait()
    written = [e.record for e in await store.read_control("r")]
    decisions = [r.decision for r in written if isinstance(r, ApprovalDecided)]
    assert sorted(decisions) == ["approve", "reject"]  # both were written
    first, second = decisions
    assert isinstance(outcomes[first], ApprovalDecided)
    refused = outcomes[second]
    assert isinstance(refused, UsageError)
    assert "does not count" in str(refused) and f"({first})" in str(refused)
    ran = [a.arguments for a in tools.executed]
    assert ran == ([{"a": 1, "b": 2}] if first == "approve" else [])  # the first one counted


async def test_a_decision_sent_again_is_refused_naming_the_one_that_counts(autojump_clock):
    """`AlreadyDecided` says which decision counts and whether the refused one is it again.

    While the first waits to be applied, and once the run applied it and finished (sent again
    with the call id, step and digest the decider was shown), a decision is refused; the same
    one is marked ``same`` (a double submit), another one is not.
    """
    agent, tools, _ = make([call("add", a=1, b=2, call_id="c1"), say("ok")])
    store = MemoryStore()
    refused: list[AlreadyDecided] = []
    async with open_run(agent, "x", store=store, run_id="r", approval_policy=only_add) as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        request = handle.pending_approval
        shown = {
            "call_id": "c1",
            "step": request.step,
            "arguments_digest": request.arguments_digest,
        }
        first = await decide(store, "r", **shown)
        for decision in ({}, {"reject": "no"}):
            with pytest.raises(AlreadyDecided) as waiting:
                await decide(store, "r", **shown, **decision)
            refused.append(waiting.value)
        await handle.wait()
    for decision in ({}, {"reject": "no"}):
        with pytest.raises(AlreadyDecided, match="already finished") as applied:
            await decide(store, "r", **shown, **decision)
        refused.append(applied.value)
    assert [(r.counting, r.request, r.same) for r in refused] == [
        (first, request, True),
        (first, request, False),
        (first, request, True),
        (first, request, False),
    ]
    assert [a.arguments for a in tools.executed] == [{"a": 1, "b": 2}]
    with pytest.raises(UsageError, match="already finished") as unnamed:
        await decide(store, "r")  # no call named: nothing to say it was decided
    assert not isinstance(unnamed.value, AlreadyDecided)


async def test_a_decision_sent_after_a_handles_is_refused_naming_the_handles(autojump_clock):
    """A decision naming the call, sent after a handle's was applied, was refused with a
    plain `UsageError` ("already finished"), not `AlreadyDecided`, so ``treadle approve
    --call`` sent again exited 1 where a decision sent twice exits 0."""
    agent, tools, _ = make([call("add", a=1, b=2, call_id="c1"), say("ok")])
    store = MemoryStore()
    async with open_run(agent, "x", store=store, run_id="r", approval_policy=only_add) as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        request = handle.pending_approval
        handle.approve("c1")
        await handle.wait()
    (applied,) = [r for r in (await store.read_log("r")).records if isinstance(r, ApprovalDecided)]
    refused = []
    for decision in ({}, {"reject": "no"}):
        with pytest.raises(AlreadyDecided, match="already finished") as again:
            await decide(store, "r", call_id="c1", **decision)
        refused.append((again.value.counting, again.value.request, again.value.same))
    assert refused == [(applied, request, True), (applied, request, False)]
    assert [a.arguments for a in tools.executed] == [{"a": 1, "b": 2}]


@pytest.mark.parametrize("offset", [-0.001, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.001])
@pytest.mark.parametrize("via", ["handle", "store"])
async def test_a_decision_sent_as_the_run_parks_is_kept(offset, via, autojump_clock):
    """A decision that reaches the coordinator's inbox as it parks goes to the parked run.

    The run parks ``park_after_s`` after it starts waiting; a decision sent at that very
    moment (each order of the two, over several runs) is applied, never left behind in the
    stopped coordinator's inbox (which made the run wait out its deadline and expire).
    """
    agent, tools, _ = make([call("add", a=1, b=2, call_id="c1"), say("ok")])
    store = MemoryStore()
    async with open_run(
        agent,
        "x",
        store=store,
        run_id="r",
        approval_policy=only_add,
        control_poll_s=0.5 if via == "store" else None,
        park_after_s=5.0,
    ) as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)  # the request is durable
        began = trio.current_time()  # the wait, and so the 5 s to parking, start here
        await trio.sleep_until(began + 5.0 + offset)
        if via == "handle":
            handle.approve()
        else:
            await decide(store, "r")
        with trio.fail_after(60):
            result = await handle.wait()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert [a.call_id for a in tools.executed] == ["c1"]
    log = await store.read_log("r")
    (decided,) = [r for r in log.records if isinstance(r, ApprovalDecided)]
    assert decided.decision == "approve"


async def test_a_second_decision_or_one_behind_a_cancel_is_refused(autojump_clock):
    """The run applies the first message it gets; a later decision's caller is told."""
    agent, tools, _ = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    async with open_run(
        agent, "x", store=MemoryStore(), run_id="r", approval_policy=only_add, park_after_s=None
    ) as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        handle.approve()
        with pytest.raises(UsageError, match="not waiting for an approval"):
            handle.approve(reject="no, after all")  # in the same turn, before it is applied
        assert (await handle.wait()).stop_reason is StopReason.FINAL_ANSWER
    assert [a.call_id for a in tools.executed] == ["c1"]

    agent, tools, _ = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    async with open_run(
        agent, "x", store=MemoryStore(), run_id="r", approval_policy=only_add, park_after_s=None
    ) as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        handle.cancel("stop")
        with pytest.raises(UsageError, match="being cancelled"):
            handle.approve()
        assert (await handle.wait()).stop_reason is StopReason.CANCELLED
    assert tools.executed == []


@pytest.mark.parametrize("park_after_s", [None, 5.0, 0.0])
async def test_once_approve_returns_the_handle_waits_for_the_next_request(
    park_after_s, autojump_clock
):
    """A loop of wait_state and approve decides each request once, parked or driven.

    A driven run's handle went on reporting the request it had just handed a decision for
    (``awaiting_approval``, the same ``pending_approval``) until the coordinator took it in,
    so the loop's next wait returned at once and its approve was refused.
    """
    turns = [call("add", a=1, b=2, call_id="c1"), call("add", a=3, b=4, call_id="c2"), say("ok")]
    agent, tools, _ = make(turns)
    decided = []
    async with open_run(
        agent,
        "x",
        store=MemoryStore(),
        run_id="r",
        approval_policy=only_add,
        park_after_s=park_after_s,
    ) as handle:
        with trio.fail_after(60):
            while (
                await handle.wait_state(
                    RunState.AWAITING_APPROVAL, RunState.SUCCEEDED, RunState.FAILED
                )
                is RunState.AWAITING_APPROVAL
            ):
                if park_after_s == 0.0:
                    assert await handle.wait_parked()
                decided.append(handle.approve().call_id)
                assert handle.pending_approval is None
                assert handle.state is RunState.RUNNING
            result = await handle.wait()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert decided == ["c1", "c2"]
    assert [a.call_id for a in tools.executed] == ["c1", "c2"]


async def _logged_decisions(store) -> list[ApprovalDecided]:
    """The approval decisions run ``r``'s log holds, in order."""
    return [r for r in (await store.read_log("r")).records if isinstance(r, ApprovalDecided)]


@contextlib.asynccontextmanager
async def _waiting_on_add(store, *, park_after_s):
    """Run ``r`` on ``store``, waiting on the approval of its one ``add`` call: a 60 s
    deadline on a wall clock that follows trio's. Yields ``(handle, tools)``."""
    agent, tools, _ = make(
        [call("add", a=1, b=2, call_id="c1"), say("3")], limits=Limits(approval_timeout_s=60)
    )
    async with open_run(
        agent,
        "x",
        store=store,
        run_id="r",
        approval_policy=only_add,
        park_after_s=park_after_s,
        clock=TrioTimeClock(),
    ) as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        yield handle, tools


@pytest.mark.parametrize("before_s", [0.001, 0.1, 0.45])
async def test_a_decision_written_just_before_the_deadline_counts_for_a_driven_run(
    before_s, autojump_clock
):
    """A run that never parks reads its control stream every ``control_poll_s``; at the
    deadline it parks once, so the stream is read once more before the call expires.

    The deadline is a wall-clock instant: the wall clock here follows trio's (on the system
    clock, real time passing while the loaded machine wrote the request moved the deadline
    before the test's last millisecond)."""
    store = MemoryStore()
    async with _waiting_on_add(store, park_after_s=None) as (handle, tools):
        began = trio.current_time()
        await trio.sleep_until(began + 60 - before_s)
        await decide(store, "r", clock=TrioTimeClock())  # from another process, just in time
        result = await handle.wait()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert [a.call_id for a in tools.executed] == ["c1"]
    decided = await _logged_decisions(store)
    assert [d.decision for d in decided] == ["approve"]


NOT_OBJECTS = [[1], "a=10", 5, ("a", 10)]


@pytest.mark.parametrize("park_after_s", [None, 0.0])
async def test_an_edit_that_is_not_an_object_is_refused(park_after_s, autojump_clock):
    """An edit that is JSON but no object raised AttributeError (``'list' object has no
    attribute 'items'``) from the schema's complaint, through the handle (parked or driven)
    and `decide`. It is refused with UsageError, and the request stays pending."""
    agent, tools, _ = make([call("add", a=1, b=2, call_id="c1"), say("ok")])
    store = MemoryStore()
    async with open_run(
        agent, "x", store=store, run_id="r", approval_policy=only_add, park_after_s=park_after_s
    ) as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        await wait_for_durable_request(handle)
        if park_after_s is not None:
            assert await handle.wait_parked()
        for edit in NOT_OBJECTS:
            with pytest.raises(UsageError, match="must be a JSON object"):
                handle.approve(edit=edit)
            with pytest.raises(UsageError, match="must be a JSON object"):
                await decide(store, "r", edit=edit)
        assert handle.pending_approval.call_id == "c1"
        handle.approve(edit={"a": 10, "b": 20})
        await handle.wait()
    assert [a.arguments for a in tools.executed] == [{"a": 10, "b": 20}]


def test_an_edit_holding_an_integer_too_long_to_read_says_so():
    """It was reported as nesting too deeply."""
    from treadle.approvals import edited_arguments

    with pytest.raises(UsageError) as info:
        edited_arguments('{"amount": ' + "9" * 5000 + "}")
    assert "nest" not in str(info.value)
    assert "4300 digits" in str(info.value)


DRAFT_07_TUPLE = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {"x": {"type": "array", "items": [{"type": "string"}, {"type": "integer"}]}},
}
DRAFT_04_EXCLUSIVE = {
    "$schema": "http://json-schema.org/draft-04/schema#",
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "exclusiveMinimum": True}},
}


def test_an_edit_is_checked_by_the_draft_its_schema_names():
    """A tool's schema (an MCP server's) was read as 2020-12 whatever its ``$schema``: a
    draft-07 tuple ``items`` raised AttributeError out of ``approve(edit=...)``, and a draft-04
    boolean ``exclusiveMinimum`` refused a fitting edit."""
    from treadle.approvals import check_edit

    check_edit({"x": ["b", 2]}, "tuple7", DRAFT_07_TUPLE)
    with pytest.raises(UsageError, match=r"x/1: 'two' is not of type 'integer'"):
        check_edit({"x": ["b", "two"]}, "tuple7", DRAFT_07_TUPLE)
    check_edit({"x": 1}, "excl4", DRAFT_04_EXCLUSIVE)
    with pytest.raises(UsageError, match="x: 0 is less than or equal to the minimum of 0"):
        check_edit({"x": 0}, "excl4", DRAFT_04_EXCLUSIVE)


def test_an_edit_leaves_patterns_to_the_tool_as_an_mcp_call_does(monkeypatch):
    """``^(a+)+$`` against a's and a "!" takes exponential time in Python's re, which holds
    the interpreter: ``approve(edit=...)`` froze the process (docs/mcp.md). Every other keyword
    is still checked."""
    import re

    from treadle.approvals import check_edit

    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "pattern": "^(a+)+$"}, "n": {"type": "integer"}},
        "patternProperties": {"^(x+)+$": {"type": "integer"}},
        "additionalProperties": False,
    }

    def search(pattern: str, *_: object, **__: object) -> None:
        raise AssertionError(f"the pattern {pattern!r} was matched")  # (instead of hanging)

    with monkeypatch.context() as patched:
        patched.setattr(re, "search", search)
        check_edit({"a": "a" * 40 + "!", "x" * 40 + "!": 1}, "evil", schema)
    with pytest.raises(UsageError, match="n: 'one' is not of type 'integer'"):
        check_edit({"n": "one"}, "evil", schema)


def test_an_edit_against_a_schema_that_cannot_be_checked_is_refused():
    from treadle.approvals import check_edit

    nowhere = {"type": "object", "properties": {"a": {"$ref": "#/definitions/nope"}}}
    with pytest.raises(UsageError, match="the schema of nowhere cannot be checked"):
        check_edit({"a": 1}, "nowhere", nowhere)
    with pytest.raises(UsageError, match="the schema of bad cannot be checked"):
        check_edit({"a": 1}, "bad", {"type": "no such type"})


def test_an_edit_is_checked_without_fetching_what_the_schema_refers_to():
    # The check fetched a $ref URL (an internal address the schema's author chose) with
    # urllib, blocking the caller; it now resolves references inside the schema alone.
    from treadle.approvals import check_edit

    with schema_host() as (url, asked):
        remote = {"type": "object", "properties": {"a": {"$ref": url}}}
        with pytest.raises(UsageError, match=f"the schema of remote cannot be checked: .*{url}"):
            check_edit({"a": "b"}, "remote", remote)
    assert asked == []


def test_an_edit_against_a_pattern_python_cannot_compile_is_checked():
    # An ECMA-262 pattern Python's re cannot compile made the schema "invalid": every edit
    # was refused. Patterns are left to the tool, their syntax too.
    from treadle.approvals import check_edit

    schema = {
        "type": "object",
        "properties": {"tag": {"type": "string", "pattern": r"^v(?<major>\d+)$"}},
    }
    check_edit({"tag": "anything"}, "release", schema)
    with pytest.raises(UsageError, match="tag: 1 is not of type 'string'"):
        check_edit({"tag": 1}, "release", schema)


class _CancelLandsFirst(MemoryStore):
    """Appends a cancel request just before the first decision (a console's cancel racing
    its approve: both checked the run before either wrote)."""

    async def append_control(self, record):
        if isinstance(record, ApprovalDecided) and not getattr(self, "raced", False):
            self.raced = True
            await super().append_control(
                CancelRequested(run_id=record.run_id, ts=record.ts, canceller="console")
            )
        return await super().append_control(record)


@pytest.mark.parametrize("race", [False, True])
async def test_a_decision_after_a_cancel_request_is_refused_not_reported_applied(
    race, autojump_clock
):
    """The run ends cancelled without applying a decision behind a cancel: its decider is
    told so (the console's approve and cancel sent at once both answered success)."""
    agent, tools, _ = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    store = _CancelLandsFirst() if race else MemoryStore()
    async with open_run(
        agent, "x", store=store, run_id="r", approval_policy=only_add, control_poll_s=0.5
    ) as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        if not race:
            await request_cancel(store, "r", reason="stop", canceller="ops")
        with pytest.raises(UsageError, match="is being cancelled") as refused:
            await decide(store, "r", call_id="c1")
        assert ("just before this decision" in str(refused.value)) is race
        result = await handle.wait()
    assert result.stop_reason is StopReason.CANCELLED
    assert tools.executed == []


@pytest.mark.parametrize("written", ["before the deadline", "after it", "after it, raw"])
async def test_a_decision_written_after_the_deadline_is_never_applied(written, autojump_clock):
    """The run's driver stopped while it waited; the resume came after the deadline. A decision
    written before the deadline still counts; one written after it is refused by `decide`,
    and, found in the control stream all the same, is not applied: the call expires."""
    import datetime as dt

    clock = SettableClock()
    turns = [call("add", a=1, b=2, call_id="c1"), say("ok")]
    store, request = await left_waiting(turns, clock)
    clock.now += dt.timedelta(seconds=500 if written == "before the deadline" else 700)
    if written == "after it":
        with pytest.raises(UsageError, match="ended at 2026-01-01T00:10:00"):
            await decide(store, "r", clock=clock)
    elif written == "after it, raw":  # as a decider that checked no deadline wrote it
        await store.append_control(decision_for("r", request, clock))
    else:
        await decide(store, "r", clock=clock)
    clock.now = dt.datetime(2026, 1, 1, 0, 12, tzinfo=dt.UTC)  # the resume, past the deadline
    agent, tools, _ = make(turns, limits=Limits(approval_timeout_s=600))
    result = await treadle_run(
        agent, store=store, run_id="r", approval_policy=only_add, clock=clock
    )
    assert result.stop_reason is StopReason.FINAL_ANSWER
    decided = await _logged_decisions(store)
    if written == "before the deadline":
        assert [d.decision for d in decided] == ["approve"]
        assert [a.call_id for a in tools.executed] == ["c1"]
    else:
        assert [d.decision for d in decided] == ["expired"]
        assert tools.executed == []


async def _decide_told(store, run_id, **kwargs) -> str:
    """What `decide` told its caller: ``"counts"``, or the refusal's message."""
    try:
        await decide(store, run_id, **kwargs)
    except UsageError as exc:
        return str(exc)
    return "counts"


class _OffsetClock:
    """`TrioTimeClock` moved by ``offset_s``."""

    def __init__(self, offset_s):
        self.offset_s = offset_s

    def now_iso(self):
        import datetime as dt

        start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
        return (start + dt.timedelta(seconds=trio.current_time() + self.offset_s)).isoformat()


async def test_a_parked_run_never_applies_a_decision_stamped_after_its_deadline(autojump_clock):
    """Read by the parked run before its deadline, a decision whose own timestamp is after it
    (a decider's clock ahead, a write that checked no deadline) does not count: the call
    expires, as it does for a driven run."""
    store = MemoryStore()
    async with _waiting_on_add(store, park_after_s=1.0) as (handle, tools):
        request = handle.pending_approval
        await trio.sleep(30)  # parked
        await store.append_control(decision_for("r", request, _OffsetClock(30.001)))
        await handle.wait()
    decided = await _logged_decisions(store)
    assert [d.decision for d in decided] == ["expired"]
    assert tools.executed == []


class _TickingClock(SettableClock):
    """A wall clock that moves 2 ms at every reading (a loaded machine between two reads)."""

    def now_iso(self):
        import datetime as dt

        self.now += dt.timedelta(milliseconds=2)
        return super().now_iso()


async def test_decide_never_reports_a_decision_stamped_after_the_deadline(autojump_clock):
    """`decide` checks the deadline against the timestamp its record carries, which the run
    checks: it was checked against an earlier reading of the clock, and a decision stamped
    after the deadline was written, reported as counting, and never applied."""
    import datetime as dt

    clock = SettableClock()
    turns = [call("add", a=1, b=2, call_id="c1"), say("ok")]
    store, _ = await left_waiting(turns, clock)
    ticking = _TickingClock()
    ticking.now += dt.timedelta(seconds=600, milliseconds=-3)  # the first reading: 1 ms before
    told = await _decide_told(store, "r", clock=ticking)
    clock.now += dt.timedelta(seconds=700)
    agent, tools, _ = make(turns, limits=Limits(approval_timeout_s=600))
    await treadle_run(agent, store=store, run_id="r", approval_policy=only_add, clock=clock)
    decided = await _logged_decisions(store)
    if told == "counts":
        assert [d.decision for d in decided] == ["approve"]
        assert [a.call_id for a in tools.executed] == ["c1"]
    else:
        assert "ended at" in told
        assert [d.decision for d in decided] == ["expired"]


class _HeldUntilTheDeadlineReading(MemoryStore):
    """A busy store: a human's decision written just before the deadline is committed only
    after the driver's reading of the control stream at (or past) the deadline.

    ``reading_from``: the trio time from which a reading of the stream lets it through.
    """

    reading_from = float("inf")

    def __init__(self):
        super().__init__()
        self.read_then = trio.Event()

    async def read_control(self, run_id, *, after=0):
        entries = await super().read_control(run_id, after=after)
        if trio.current_time() >= self.reading_from:
            self.read_then.set()
        return entries

    async def append_control(self, record):
        if isinstance(record, ApprovalDecided) and record.decision != "expired":
            await self.read_then.wait()
        return await super().append_control(record)


def _agreed(told: str, decided: list[ApprovalDecided], executed: list) -> None:
    """The decider was told what the run did: success when its approval ran the call, a
    refusal saying the call expired when the run expired it."""
    if told == "counts":
        assert [d.decision for d in decided] == ["approve"]
        assert len(executed) == 1
    else:
        assert "expired at its deadline" in told
        assert [d.decision for d in decided] == ["expired"]
        assert executed == []


@pytest.mark.parametrize("park_after_s", [None, 1.0])
async def test_a_decision_committed_after_the_deadline_reading_is_refused_as_expired(
    park_after_s, autojump_clock
):
    """Stamped 50 ms before the deadline, committed after the driver's last reading: the
    expiry the driver wrote to the control stream before that reading comes first, so the
    call expires and the decider is told so (it was told the payment was approved)."""
    store = _HeldUntilTheDeadlineReading()
    async with _waiting_on_add(store, park_after_s=park_after_s) as (handle, tools):
        store.reading_from = trio.current_time() + 60
        await trio.sleep_until(store.reading_from - 0.05)
        told = await _decide_told(store, "r", clock=TrioTimeClock())
        await handle.wait()
    decided = await _logged_decisions(store)
    _agreed(told, decided, tools.executed)
    assert told != "counts"  # the expiry was written before the reading that let it through


async def test_a_decision_committed_after_a_resume_past_the_deadline_read_the_stream(
    autojump_clock,
):
    """A run claimed past its deadline (a fleet's worker, a restarted process) reads the
    control stream as its drive begins. A decision stamped before the deadline but
    committed after that reading is told the call expired, as the run expires it."""
    import datetime as dt

    clock = SettableClock()
    turns = [call("add", a=1, b=2, call_id="c1"), say("ok")]
    store, _ = await left_waiting(turns, clock, _HeldUntilTheDeadlineReading())
    early = SettableClock()
    early.now += dt.timedelta(seconds=599)  # a second before the deadline
    clock.now += dt.timedelta(seconds=700)  # the resume, past it
    agent, tools, _ = make(turns, limits=Limits(approval_timeout_s=600))
    told = ""

    async def decider() -> None:
        nonlocal told
        told = await _decide_told(store, "r", clock=early)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(decider)
        await trio.testing.wait_all_tasks_blocked()  # its append waits for the run's reading
        store.reading_from = trio.current_time()
        await treadle_run(agent, store=store, run_id="r", approval_policy=only_add, clock=clock)
    decided = await _logged_decisions(store)
    _agreed(told, decided, tools.executed)
    assert told != "counts"


@contextlib.asynccontextmanager
async def _store_of(kind, tmp_path):
    if kind == "memory":
        yield MemoryStore()
    elif kind == "sqlite":
        from treadle.stores.sqlite import open_sqlite_store

        async with open_sqlite_store(tmp_path / "runs.db") as store:
            yield store
    else:
        from treadle.stores.jsonl import open_jsonl_store

        async with open_jsonl_store(tmp_path / "runs") as store:
            yield store


@pytest.mark.parametrize("kind", ["memory", "sqlite", "jsonl"])
async def test_an_expiry_in_the_control_stream_is_applied_on_resume(kind, tmp_path):
    """The driver wrote the expiry to the control stream and died before its log said so; a
    decision stamped before the deadline came after it. The resumed run expires the call
    (the stream's first decision), and `decide` refuses to add another."""
    import datetime as dt

    from treadle.approvals import expired_decision

    clock = SettableClock()
    turns = [call("add", a=1, b=2, call_id="c1"), say("ok")]
    async with _store_of(kind, tmp_path) as store:
        store, request = await left_waiting(turns, clock, store)
        early = SettableClock()
        early.now += dt.timedelta(seconds=599)
        clock.now += dt.timedelta(seconds=600)
        await store.append_control(expired_decision(request, clock))
        await store.append_control(decision_for("r", request, early))  # raced, came second
        with pytest.raises(UsageError, match="expired at its deadline"):
            await decide(store, "r", clock=early)
        agent, tools, _ = make(turns, limits=Limits(approval_timeout_s=600))
        result = await treadle_run(
            agent, store=store, run_id="r", approval_policy=only_add, clock=clock
        )
        log = await store.read_log("r")
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert [d.decision for d in log.records if isinstance(d, ApprovalDecided)] == ["expired"]
    assert tools.executed == []


@contextlib.asynccontextmanager
async def _handed_over_on_add(
    agent: Agent, store: MemoryStore, *, parked: bool
) -> AsyncIterator[RunHandle]:
    """Run ``r`` of ``agent`` on ``store``, handed over once it waits for approval of
    ``add`` (parked first when ``parked``; control read every 0.5 s). `_waiting_on_add`
    is its sibling for runs of its own agent on a wall clock that follows trio's."""
    async with open_run(
        agent,
        "x",
        store=store,
        run_id="r",
        approval_policy=only_add,
        control_poll_s=0.5,
        park_after_s=5.0 if parked else None,
    ) as handle:
        await wait_for_state(handle, RunState.AWAITING_APPROVAL)
        if parked:
            with trio.fail_after(60):
                assert await handle.wait_parked()
        yield handle


@pytest.mark.parametrize("parked", [False, True], ids=["driven", "parked"])
async def test_a_cancel_stored_before_a_handle_decision_is_taken_wins(parked, autojump_clock):
    """`request_cancel` returned (the cancel durable), then `handle.approve()`: the run reads
    its control stream before it takes the handle's decision, so the cancel wins, parked or
    driven: the decision is never recorded, the call never runs, the run ends cancelled."""
    agent, tools, _ = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    store = MemoryStore()
    async with _handed_over_on_add(agent, store, parked=parked) as handle:
        await request_cancel(store, "r", reason="stop", canceller="ops")
        handle.approve()
        with trio.fail_after(60):
            result = await handle.wait()
    assert (result.state, result.stop_reason) == (RunState.CANCELLED, StopReason.CANCELLED)
    assert tools.executed == []
    log = await store.read_log("r")
    assert not any(isinstance(r, ApprovalDecided | ActionIntent) for r in log.records)
    (cancel,) = [r for r in log.records if isinstance(r, CancelRequested)]
    assert (cancel.reason, cancel.canceller) == ("stop", "ops")


@pytest.mark.parametrize("parked", [False, True], ids=["driven", "parked"])
async def test_a_cancel_stored_after_a_handle_decision_was_taken_does_not_undo_it(
    parked, autojump_clock
):
    """The decision is on record before the cancel is written: the call ran, the decision
    stays in the log, and the cancel ends the run at its next step (the model's reply takes
    a while, so the next reading of the control stream comes first)."""
    tools = LedgerTools()
    model = ScriptedModel(turns=[call("add", a=1, b=2, call_id="c1"), say("3")], latency_s=2.0)
    agent = Agent(model=model, executor=tools, parser=SimpleParser())
    store = MemoryStore()
    async with _handed_over_on_add(agent, store, parked=parked) as handle:
        handle.approve()
        with trio.fail_after(60):
            async with contextlib.aclosing(handle.events()) as events:
                async for event in events:
                    if event.kind.value == "action_finished":
                        break
        await request_cancel(store, "r", reason="late", canceller="ops")
        with trio.fail_after(60):
            result = await handle.wait()
    assert result.state is RunState.CANCELLED
    assert len(tools.executed) == 1
    log = await store.read_log("r")
    kinds = [type(r).__name__ for r in log.records if not isinstance(r, ApprovalRequested)]
    decided = kinds.index("ApprovalDecided")
    assert decided < kinds.index("ActionResult") < kinds.index("CancelRequested")


class _DiesRecordingADecision(MemoryStore):
    """Fails the log write of the first approval decision, as a process dies there: the
    decision may be in the control stream already, not yet in the log."""

    dying = True

    async def _append(self, run_id, seq, records, *, op, generation):
        if self.dying and any(isinstance(r, ApprovalDecided) for r in records):
            self.dying = False
            raise StoreError("the process died recording the decision (injected)")
        return await super()._append(run_id, seq, records, op=op, generation=generation)


def _stream_decisions(entries) -> list[str]:
    return [e.record.decision for e in entries if isinstance(e.record, ApprovalDecided)]


@pytest.mark.parametrize("crash", [False, True], ids=["live", "crashed"])
@pytest.mark.parametrize("parked", [False, True], ids=["driven", "parked"])
async def test_a_decision_stored_before_a_handles_counts_live_and_after_a_crash(
    parked, crash, autojump_clock
):
    """`decide` approved (durable in the control stream, told it counts), then the handle
    rejected. The run applies the approval, the first decision made durable, driven or
    parked, and so does a run resumed after its driver died recording the decision: a
    parked run applied the handle's reject live and the approval once resumed, from the same
    stream, and a driven one the reject while `decide` had said the approval counts."""
    agent, tools, _ = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    store = _DiesRecordingADecision() if crash else MemoryStore()
    async with _handed_over_on_add(agent, store, parked=parked) as handle:
        first = await decide(store, "r", call_id="c1")
        handle.approve(reject="no")
        with trio.fail_after(60):
            if crash:
                with pytest.raises(StoreError, match="injected"):
                    await handle.wait()
            else:
                await handle.wait()
    executed = list(tools.executed)
    if crash:
        assert executed == []
        agent, tools, _ = make([call("add", a=1, b=2, call_id="c1"), say("3")])
        await treadle_run(agent, store=store, run_id="r", approval_policy=only_add)
        executed = list(tools.executed)
    log = await store.read_log("r")
    assert [(r.decision, r.ts) for r in log.records if isinstance(r, ApprovalDecided)] == [
        (first.decision, first.ts)
    ]
    assert [a.arguments for a in executed] == [{"a": 1, "b": 2}]
    assert _stream_decisions(await store.read_control("r")) == ["approve", "reject"]
    with pytest.raises(AlreadyDecided) as again:
        await decide(store, "r", call_id="c1", reject="no")
    assert (again.value.counting.decision, again.value.counting.ts) == (first.decision, first.ts)


@pytest.mark.parametrize("parked", [False, True], ids=["driven", "parked"])
async def test_decide_after_a_handles_decision_names_the_one_the_run_applies(
    parked, autojump_clock
):
    """The handle rejected, then `decide` approved before the run recorded anything. The
    decider is told what the run does: the approval counts only if the run applies it, and
    a refusal names the decision it applies (a driven run's handle decision reached no
    control stream, so `decide` was told its approval counts while the run rejected)."""
    agent, tools, _ = make([call("add", a=1, b=2, call_id="c1"), say("3")])
    store = MemoryStore()
    async with _handed_over_on_add(agent, store, parked=parked) as handle:
        handle.approve(reject="no")
        try:
            told: ApprovalDecided = await decide(store, "r", call_id="c1")
        except AlreadyDecided as refused:
            told = refused.counting
        with trio.fail_after(60):
            await handle.wait()
    log = await store.read_log("r")
    (applied,) = [r for r in log.records if isinstance(r, ApprovalDecided)]
    assert (applied.decision, applied.ts) == (told.decision, told.ts)
    assert len(tools.executed) == (1 if applied.decision == "approve" else 0)
    stream = _stream_decisions(await store.read_control("r"))
    assert stream[0] == applied.decision


async def test_a_run_goes_on_only_under_the_approval_policy_it_was_started_with(autojump_clock):
    """A run started with ``approval_policy=`` and left waiting, its first call approved
    meanwhile: a resume whose definition lacks the policy (the agent factory `treadle
    resume` and a fleet's worker call) is refused naming it, and runs nothing; one whose
    definition carries it (`Agent.approval_policy`) puts the next call to a human too. The
    resume ran the next call, a payment the policy selects, without asking anyone."""
    turns = [call("add", a=1, b=2, call_id="c1"), call("add", a=3, b=4, call_id="c2"), say("ok")]
    agent, tools, _ = make(turns)
    store = MemoryStore()
    with trio.CancelScope() as crash:
        async with open_run(
            agent, "x", store=store, run_id="r", approval_policy=only_add
        ) as handle:
            await wait_for_state(handle, RunState.AWAITING_APPROVAL)
            crash.cancel()
    await decide(store, "r", call_id="c1")
    with pytest.raises(SnapshotMismatch) as refused:
        await treadle_run(agent, store=store, run_id="r")
    assert refused.value.keys == ["approval_policy"]
    assert f"approval policy '{__name__}:only_add'" in str(refused.value)
    assert "without a human" in str(refused.value)
    assert tools.executed == []
    with pytest.raises(UsageError, match="one policy"):
        await treadle_run(
            attrs.evolve(agent, approval_policy=only_add),
            store=store,
            run_id="r",
            approval_policy=lambda tool, arguments: False,
        )
    async with open_run(
        attrs.evolve(agent, approval_policy=only_add), store=store, run_id="r"
    ) as handle:
        with trio.fail_after(60):
            async with contextlib.aclosing(handle.events()) as events:
                async for event in events:
                    if event.kind.value == "approval_requested" and event.record.call_id == "c2":
                        break
        handle.approve("c2", reject="not this one")
        result = await handle.wait()
    assert result.stop_reason is StopReason.FINAL_ANSWER
    assert [a.arguments for a in tools.executed] == [{"a": 1, "b": 2}]


def test_an_agents_approval_policy_is_in_its_snapshot_by_name():
    """Only when set, so the snapshot of an agent without one is what it always was."""
    agent, _, _ = make([say("hi")])
    assert "approval_policy" not in agent.snapshot()
    gated = attrs.evolve(agent, approval_policy=only_add)
    assert gated.snapshot()["approval_policy"] == f"{__name__}:only_add"
    assert gated.version_label != agent.version_label
    with pytest.raises(UsageError, match=r"Agent\.approval_policy must be None or a function"):
        attrs.evolve(agent, approval_policy="only_add")


_SCRIPT_POLICY = """
import sys
from treadle.approvals import policy_name

def big_payments(tool, arguments):
    return True

print(policy_name(big_payments))
"""


@pytest.mark.parametrize("how", ["script", "module"])
def test_a_policy_of_the_main_script_is_named_by_the_module_that_imports_it(tmp_path, how):
    """A policy defined in the script a run starts from was recorded as ``__main__:NAME``: the
    documented resume (``treadle resume --agent app:make_agent``), which imports the script as
    ``app``, found ``app:NAME`` and refused the run as another policy. It is named by the
    module name the script has when imported, the name of its file (or of ``-m``'s module).
    """
    import subprocess
    import sys

    (tmp_path / "app.py").write_text(_SCRIPT_POLICY)
    command = ["app.py"] if how == "script" else ["-m", "app"]
    shown = subprocess.run(
        [sys.executable, *command], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert shown.stdout.strip() == "app:big_payments"
    imported = subprocess.run(
        [
            sys.executable,
            "-c",
            "import app; from treadle.approvals import policy_name as n;"
            " print(n(app.big_payments))",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert imported.stdout.splitlines()[-1] == "app:big_payments"
