"""A resumed run that stops before it runs its interrupted step again leaves no intent open.

The run crashes inside its step (after the model intent, or after the action intent); while
nobody drives it, a cancel arrives in its control stream. The resumed drive applies the cancel
at the top of its loop, before the step runs again: the open model intent is recorded
abandoned, each open action intent gets its ``unknown`` result with the step's record, then
the cancel and run-finished (docs/crash-safety.md, "Resume"; `treadle._state.closing_records`).
"""

from __future__ import annotations

import pytest

import treadle
from treadle.stores.sqlite import open_sqlite_store
from treadle.testing import crashes
from treadle.testing.faults import CrashingExecutor, CrashingStore, SimulatedCrash
from treadle.testing.invariants import check_invariants
from treadle.testing.scripted import ScriptedModel, calls, say
from treadle.types import (
    ActionIntent,
    ActionResult,
    ActionStatus,
    CancelRequested,
    ModelIntent,
    ModelResult,
    RunState,
    StepRecord,
    StopReason,
    ToolCall,
)


async def crash(path, ledger, *, in_action: bool) -> None:
    async with open_sqlite_store(path) as store:
        if in_action:
            crashing = CrashingStore(inner=store, crash_at=10**9)

            def wrap(executor):
                return CrashingExecutor(inner=executor, crash_at=1, when="before", store=crashing)

        else:  # dies writing the first model result: its intent is durable, the result not
            crashing = CrashingStore(inner=store, crash_at=3, when="before")
            wrap = None
        agent = crashes.make_agent(ledger, wrap=wrap)
        with pytest.raises((treadle.RunInterrupted, SimulatedCrash)):
            await treadle.run(agent, crashes.RUN_INPUT, store=crashing, run_id="r", owner="o")


@pytest.mark.parametrize("in_action", [True, False], ids=["action", "model"])
async def test_a_cancel_applied_before_the_step_runs_again_closes_its_intents(tmp_path, in_action):
    path, ledger = tmp_path / "runs.db", tmp_path / "ledger"
    await crash(path, ledger, in_action=in_action)
    async with open_sqlite_store(path) as store:
        before = (await store.read_log("r")).records
        opened = ActionIntent if in_action else ModelIntent
        assert isinstance(before[-1], opened)
        await store.append_control(
            CancelRequested(run_id="r", ts="2026-12-01T00:00:00+00:00", reason="stop")
        )
        result = await treadle.run(
            crashes.make_agent(ledger), crashes.RUN_INPUT, store=store, run_id="r", owner="o"
        )
        log = await store.read_log("r")
    assert (result.state, result.stop_reason) == (RunState.CANCELLED, StopReason.CANCELLED)
    assert check_invariants(log) == []
    added = log.records[len(before) :]
    if in_action:
        kinds = [type(r) for r in added]
        assert kinds[:2] == [ActionResult, StepRecord]
        assert added[0].outcome.status is ActionStatus.UNKNOWN
    else:
        assert isinstance(added[0], ModelResult) and added[0].abandoned
    assert crashes.read_ledger(ledger) == []  # nothing ran again (nor before: crashed first)


@treadle.tool
async def note(text: str) -> str:
    """Take a note."""
    return f"noted {text}"


def _twice_dup_agent() -> treadle.Agent:
    """Two calls under one id (the parser gives the second an id of its own), then an answer."""
    turns = [
        calls(
            ToolCall(id="dup", name="note", arguments={"text": "a"}),
            ToolCall(id="dup", name="note", arguments={"text": "b"}),
        ),
        say("done"),
    ]
    return treadle.Agent(
        model=ScriptedModel(turns=turns),
        executor=treadle.Toolbox([note]),
        parser=treadle.NativeToolCallParser(),
    )


async def test_the_closed_step_keeps_the_calls_its_intents_were_written_from(tmp_path):
    """The closed step's history held the reply's two calls under the one id, not the
    parser's: the second intent's call was in no history (check_invariants said so), and a
    thread's next request would repeat a call id."""
    async with open_sqlite_store(tmp_path / "runs.db") as store:
        # run-started, model intent, model result, both action intents: dies after the last
        crashing = CrashingStore(inner=store, crash_at=5, when="after")
        with pytest.raises((treadle.RunInterrupted, SimulatedCrash)):
            await treadle.run(_twice_dup_agent(), "go", store=crashing, run_id="r", owner="o")
        await store.append_control(
            CancelRequested(run_id="r", ts="2026-12-01T00:00:00+00:00", reason="stop")
        )
        result = await treadle.run(_twice_dup_agent(), "go", store=store, run_id="r", owner="o")
        log = await store.read_log("r")
    assert result.stop_reason is StopReason.CANCELLED
    intents = [r for r in log.records if isinstance(r, ActionIntent)]
    (step,) = log.steps
    assert step.history_message is not None
    shown = [(c.id, c.name, dict(c.arguments)) for c in step.history_message.tool_calls]
    assert shown == [(i.call_id, i.tool, dict(i.arguments)) for i in intents]
    assert len({i.call_id for i in intents}) == 2
    assert check_invariants(log) == []
