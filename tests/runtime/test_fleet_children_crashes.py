"""A parent that parks on its queued child, crashed at every store write of the fleet.

The crash kit's `CrashingStore` kills the worker process (every later store operation raises
`SimulatedCrash`) before or after each write of an uninterrupted run of the scenario: a parent
queues a child, parks on it (`ChildrenAwaited`), is woken by the child's end and answers. A new
worker (another owner) then takes over on the same database. Each time: both runs succeed, one
child run exists, the child's ``never`` effect happened at most once, and both logs keep every
invariant (docs/child-runs.md, "In a fleet"; docs/crash-safety.md).
"""

from __future__ import annotations

from typing import Literal

import pytest
import trio

from treadle import agent_tool, child_run_id
from treadle.agent import Agent
from treadle.parsers import NativeToolCallParser
from treadle.ports import RunStore
from treadle.stores.sqlite import open_sqlite_store
from treadle.supervisors import open_fleet
from treadle.testing.faults import CrashingStore, SimulatedCrash
from treadle.testing.invariants import check_invariants
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.tools import Toolbox, ToolContext, tool
from treadle.types import ChildrenAwaited, Liveness, RunState

KID = child_run_id("p/s1/a1")


def agents(store: RunStore, executed: list[str]) -> dict[str, object]:
    @tool
    async def note(text: str, ctx: ToolContext) -> str:
        """Write a note (an effect that must not happen twice).

        Args:
            text: the note.
            ctx: the call.
        """
        executed.append(ctx.intent_id)
        return f"noted {text}"

    def child() -> Agent:
        return Agent(
            model=ScriptedModel(turns=[call("note", call_id="n1", text="hi"), say("child done")]),
            executor=Toolbox([note]),
            parser=NativeToolCallParser(),
        )

    def parent() -> Agent:
        helper = agent_tool(
            child(),
            store=store,
            name="helper",
            description="Ask the helper agent.",
            fleet_agent="child",
            control_poll_s=0.02,
        )
        return Agent(
            model=ScriptedModel(
                turns=[call("helper", call_id="h1", task="go"), say("parent done")]
            ),
            executor=Toolbox([helper]),
            parser=NativeToolCallParser(),
        )

    return {"parent": parent, "child": child}


def worker(store: RunStore, executed: list[str], owner: str):  # type: ignore[no-untyped-def]
    return open_fleet(
        store,
        agents(store, executed),  # type: ignore[arg-type]
        max_running=1,
        park_after_s=0.0,
        lease_ttl_s=0.3,
        claim_poll_s=0.02,
        backoff_s=0.01,
        drain_s=0.2,
        child_recheck_s=0.5,
        owner=owner,
    )


async def finished(store: RunStore, *run_ids: str) -> bool:
    for run_id in run_ids:
        summary = await store.read_summary(run_id)  # type: ignore[attr-defined]
        if summary is None or summary.liveness is not Liveness.FINISHED:
            return False
    return True


async def until(check) -> None:  # type: ignore[no-untyped-def]
    """Look every 10 ms until ``check()`` holds (other tasks write what it looks for)."""
    with trio.fail_after(60):
        while True:
            if await check():
                return
            await trio.sleep(0.01)


async def run_until(store: RunStore, executed: list[str], stop) -> None:  # type: ignore[no-untyped-def]
    """Drive the scenario in a worker on ``store`` until ``stop()`` holds."""
    try:
        async with worker(store, executed, owner="crashing") as fleet:
            await fleet.submit("parent", "go", run_id="p")
            await until(stop)
    except* SimulatedCrash:
        pass  # the dead worker's own tasks found the store dead too


async def baseline_writes(tmp_path) -> int:  # type: ignore[no-untyped-def]
    async with open_sqlite_store(tmp_path / "baseline.db") as inner:
        counting = CrashingStore(inner=inner, crash_at=10**9)
        await run_until(counting, [], lambda: finished(inner, "p", KID))
        assert await finished(inner, "p", KID)
        log = await inner.read_log("p")
        assert any(isinstance(r, ChildrenAwaited) for r in log.records), "it never parked"
    return counting.writes


@pytest.mark.slow
async def test_a_parked_parent_and_its_child_crashed_at_every_write_lose_and_repeat_nothing(
    tmp_path,
):
    writes = await baseline_writes(tmp_path)
    assert writes >= 15  # both runs' records, the park included
    whens: tuple[Literal["before", "after"], ...] = ("before", "after")
    for at in range(1, writes + 1):
        for when in whens:
            await crash_and_take_over(tmp_path / f"crash-{when}-{at}.db", at, when)


async def crash_and_take_over(path, at: int, when: Literal["before", "after"]) -> None:  # type: ignore[no-untyped-def]
    name = f"crash {when} write {at}"
    executed: list[str] = []
    async with open_sqlite_store(path) as inner:
        crashing = CrashingStore(inner=inner, crash_at=at, when=when)

        async def crashed() -> bool:
            return crashing.crashed

        await run_until(crashing, executed, crashed)
        assert crashing.crashed, name
        async with worker(inner, executed, owner="successor") as fleet:
            await until(lambda: finished(inner, "p"))
            result = await fleet.result("p", poll_s=0.02)
            child = await fleet.result(KID, poll_s=0.02)
        assert (result.state, child.state) == (RunState.SUCCEEDED, RunState.SUCCEEDED), name
        assert result.final_answer == "parent done", name
        assert sorted(await inner.list_runs()) == sorted(["p", KID]), name
        for run_id in ("p", KID):
            problems = check_invariants(await inner.read_log(run_id))
            assert problems == [], f"{name}: {problems}"
    assert len(executed) == len(set(executed)), f"{name}: the child's effect ran twice"
