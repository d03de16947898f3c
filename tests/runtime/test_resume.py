from __future__ import annotations

import pytest
from runtime_fakes import LedgerTools, SimpleParser

from treadle._exceptions import RunInterrupted, SnapshotMismatch
from treadle.agent import Agent
from treadle.stores.memory import MemoryStore
from treadle.supervisors.run import run
from treadle.testing.faults import CrashingStore, SimulatedCrash
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import ActionResult, ActionStatus, ModelResult, StepRecord

TURNS = [call("add", a=1, b=2, call_id="c1"), call("add", a=3, b=4, call_id="c2"), say("done")]


def agent_with(tools, *, safe=frozenset()):
    tools.safe = safe
    return Agent(model=ScriptedModel(turns=TURNS), executor=tools, parser=SimpleParser())


async def baseline():
    store = MemoryStore()
    tools = LedgerTools()
    result = await run(agent_with(tools), "go", store=store, run_id="r")
    return result, await store.read_log("r")


async def test_baseline_writes_fifteen_records():
    _, log = await baseline()
    assert len(log.records) == 15


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("crash_at", range(1, 14))  # 13 store writes
async def test_crash_at_every_write_then_resume(crash_at, when):
    expected, expected_log = await baseline()
    memory = MemoryStore()
    tools = LedgerTools()
    with pytest.raises((RunInterrupted, SimulatedCrash)):
        await run(
            agent_with(tools),
            "go",
            store=CrashingStore(inner=memory, crash_at=crash_at, when=when),
            run_id="r",
        )
    result = await run(agent_with(tools), "go", store=memory, run_id="r")
    log = await memory.read_log("r")
    # No `never` action ran twice: each call id executed at most once.
    call_ids = [a.call_id for a in tools.executed]
    assert len(call_ids) == len(set(call_ids))
    assert result.stop_reason == expected.stop_reason
    assert result.final_answer == expected.final_answer
    steps = [r for r in log.records if isinstance(r, StepRecord)]
    assert [s.step for s in steps] == [1, 2, 3]
    # Every action result has its step record right after the batch.
    for i, record in enumerate(log.records):
        if isinstance(record, ActionResult):
            assert isinstance(log.records[i + 1], StepRecord | ActionResult)
    unknown = [
        r
        for r in log.records
        if isinstance(r, ActionResult) and r.outcome.status is ActionStatus.UNKNOWN
    ]
    # A crash between an action intent and its result: the action may or may not have run
    # before the crash; resume never runs it again and records UNKNOWN.
    assert 2 - len(unknown) <= len(tools.executed) <= 2
    abandoned = [r for r in log.records if isinstance(r, ModelResult) and r.abandoned]
    # An abandoned model attempt adds its abandoned result and the fresh attempt's intent.
    assert len(log.records) == len(expected_log.records) + 2 * len(abandoned)


async def test_safe_tool_is_reexecuted_under_same_intent_id():
    memory = MemoryStore()
    tools = LedgerTools()
    # write 4 is the first action intent; crash after it: the action never ran.
    with pytest.raises((RunInterrupted, SimulatedCrash)):
        await run(
            agent_with(tools, safe=frozenset({"add"})),
            "go",
            store=CrashingStore(inner=memory, crash_at=4, when="after"),
            run_id="r",
        )
    assert tools.executed == []
    await run(agent_with(tools, safe=frozenset({"add"})), "go", store=memory, run_id="r")
    assert tools.executed[0].intent_id == "r/s1/a1"
    log = await memory.read_log("r")
    first = next(r for r in log.records if isinstance(r, ActionResult))
    assert first.outcome.status is ActionStatus.EXECUTED


async def test_snapshot_mismatch_names_keys():
    memory = MemoryStore()
    with pytest.raises((RunInterrupted, SimulatedCrash)):
        await run(
            agent_with(LedgerTools()),
            "go",
            store=CrashingStore(inner=memory, crash_at=3),
            run_id="r",
        )
    other = Agent(
        model=ScriptedModel(turns=TURNS),
        executor=LedgerTools(),
        parser=SimpleParser(),
        system_prompt="be different",
        model_name="other",
    )
    with pytest.raises(SnapshotMismatch) as info:
        await run(other, store=memory, run_id="r")
    assert info.value.keys == ["model", "system_prompt"]
