"""One scripted run end to end through the real actors, @tool tools, the native parser and
the SQLite store; then the same run crashed and resumed in a fresh store object."""

from __future__ import annotations

import pytest

import treadle
from treadle.testing.faults import CrashingStore, SimulatedCrash
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import ActionResult, ActionStatus

LEDGER: list[str] = []


@treadle.tool
async def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend.
        b: the second addend.
    """
    LEDGER.append(f"add {a} {b}")
    return a + b


@treadle.tool(completes_task=True)
async def submit(answer: str) -> str:
    """Submit the final answer."""
    LEDGER.append(f"submit {answer}")
    return "submitted"


def make_agent() -> treadle.Agent:
    model = ScriptedModel(
        turns=[
            call("add", a=2, b=3, call_id="c1"),
            call("add", a="two", b=3, call_id="c2"),  # invalid arguments
            call("submit", answer="5", call_id="c3"),
            say("unreachable"),
        ]
    )
    return treadle.Agent(
        model=model,
        executor=treadle.Toolbox([add, submit]),
        parser=treadle.NativeToolCallParser(),
        model_name="scripted",
        system_prompt="You add numbers.",
    )


async def test_scripted_run_on_sqlite(tmp_path):
    LEDGER.clear()
    async with treadle.open_sqlite_store(tmp_path / "runs.db") as store:
        result = await treadle.run(make_agent(), "What is 2 + 3?", store=store, run_id="e2e")
        log = await store.read_log("e2e")
    assert result.state is treadle.RunState.SUCCEEDED
    assert result.stop_reason is treadle.StopReason.TASK_COMPLETED
    assert LEDGER == ["add 2 3", "submit 5"]
    statuses = [r.outcome.status for r in log.records if isinstance(r, ActionResult)]
    assert statuses == [ActionStatus.EXECUTED, ActionStatus.NOT_EXECUTED, ActionStatus.EXECUTED]
    snapshot = log.started.snapshot
    assert [t["name"] for t in snapshot["tools"]] == ["add", "submit"]
    assert snapshot["tools"][0]["parameters"]["required"] == ["a", "b"]


@pytest.mark.parametrize("crash_at", [4, 5, 8, 9, 12])
async def test_crash_and_resume_on_sqlite(tmp_path, crash_at):
    LEDGER.clear()
    path = tmp_path / "runs.db"
    async with treadle.open_sqlite_store(path) as store:
        with pytest.raises((treadle.RunInterrupted, SimulatedCrash)):
            await treadle.run(
                make_agent(),
                "What is 2 + 3?",
                store=CrashingStore(inner=store, crash_at=crash_at, when="after"),
                run_id="e2e",
            )
    async with treadle.open_sqlite_store(path) as store:
        result = await treadle.run(make_agent(), store=store, run_id="e2e")
        log = await store.read_log("e2e")
    unknown = [
        r
        for r in log.records
        if isinstance(r, ActionResult) and r.outcome.status is ActionStatus.UNKNOWN
    ]
    if crash_at == 12:
        # Crashed after submit's intent: its outcome is unknown, it is never run again, and
        # the model (told so by the synthetic observation) answers instead.
        assert [u.tool for u in unknown] == ["submit"]
        assert result.stop_reason is treadle.StopReason.FINAL_ANSWER
    else:
        assert result.stop_reason is treadle.StopReason.TASK_COMPLETED
    # Each side effect happened at most once.
    assert len(LEDGER) == len(set(LEDGER))
