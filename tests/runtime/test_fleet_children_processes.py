"""Child runs queued in a fleet, across real worker processes killed with SIGKILL.

A worker process serves the parent agent (and maybe the child's); the child's tool writes its
effect to a ledger outside treadle. A worker is killed (SIGKILL, a real crash) while the parent
waits on its queued child, or while the child's tool runs; another worker takes over. Each time:
exactly one child run, its effect once, both runs finished. A child that finishes while nobody
drives its parent is found by the parent's resume. On SQLite and a real PostgreSQL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

import treadle
from treadle._cli_common import open_store
from treadle.types import ChildrenAwaited, Liveness, Message, RunStarted, RunState

KINDS = ["sqlite", "postgres"]

WORKER = '''
import os
import sys
from pathlib import Path

import trio
import treadle
from treadle._cli_common import open_store
from treadle.testing.scripted import ScriptedModel, call, say

LEDGER = Path(os.environ["LEDGER"])
store_spec, served = sys.argv[1], sys.argv[2].split(",")


@treadle.tool
async def note(text: str, ctx: treadle.ToolContext) -> str:
    """Write a note to the ledger (an effect; replay policy never), then take a while."""
    with LEDGER.open("a") as out:
        out.write(f"effect {ctx.intent_id} {os.getpid()}\\n")
    await trio.sleep(float(os.environ.get("SLOW_S", "0")))
    return f"noted {text}"


def child() -> treadle.Agent:
    return treadle.Agent(
        model=ScriptedModel(turns=[call("note", call_id="n1", text="hi"), say("child done")]),
        executor=treadle.Toolbox([note]),
        parser=treadle.NativeToolCallParser(),
    )


async def main() -> None:
    async with open_store(store_spec, create=True) as store:
        helper = treadle.agent_tool(
            child(), store=store, name="helper", description="Ask the helper.",
            fleet_agent="child", control_poll_s=0.05,
        )

        def parent() -> treadle.Agent:
            return treadle.Agent(
                model=ScriptedModel(
                    turns=[call("helper", call_id="h1", task="do it"), say("parent done")]
                ),
                executor=treadle.Toolbox([helper]),
                parser=treadle.NativeToolCallParser(),
            )

        agents = {"parent": parent, "child": child}
        async with treadle.open_fleet(
            store, {name: agents[name] for name in served}, max_running=1,
            lease_ttl_s=1.0, claim_poll_s=0.05, backoff_s=0.05,
            park_after_s=float(os.environ.get("PARK_AFTER_S", "5")),
        ):
            print("ready", flush=True)
            await trio.sleep_forever()


trio.run(main)
'''


@pytest.fixture
def store_spec(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "runs.db")
    return str(request.getfixturevalue("postgres_database"))


def _worker(tmp_path: Path, store: str, served: str, **env: str) -> subprocess.Popen[str]:
    (tmp_path / "worker.py").write_text(WORKER)
    return subprocess.Popen(
        [sys.executable, "worker.py", store, served],
        cwd=tmp_path,
        env={**os.environ, "LEDGER": str(tmp_path / "ledger.txt"), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _kill(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)


def _stop(process: subprocess.Popen[str]) -> str:
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    return err


def _effects(tmp_path: Path) -> list[str]:
    ledger = tmp_path / "ledger.txt"
    return ledger.read_text().splitlines() if ledger.exists() else []


async def _submit(store: str, run_id: str) -> None:
    async with open_store(store, create=True) as opened:
        await opened.submit(  # type: ignore[attr-defined]
            run_id, agent="parent", input=(Message(role="user", content="go"),)
        )


async def _until(check) -> None:  # type: ignore[no-untyped-def]
    """Look every 50 ms (another process writes what is looked for), for at most 60 s."""
    with trio.fail_after(60):
        while True:
            if await check():
                return
            await trio.sleep(0.05)


async def _child_exists(store: str, kid: str) -> bool:
    async with open_store(store) as opened:
        return await opened.read_summary(kid) is not None  # type: ignore[attr-defined]


async def _results(store: str, *run_ids: str):  # type: ignore[no-untyped-def]
    async with open_store(store) as opened:
        with trio.fail_after(60):
            results = [await treadle.wait_result(opened, r, poll_s=0.05) for r in run_ids]
        logs = [await opened.read_log(r) for r in run_ids]
        return results, logs, await opened.list_runs()


def _check_one_child(results, logs, runs, effects: list[str]) -> None:  # type: ignore[no-untyped-def]
    kid = treadle.child_run_id("p/s1/a1")
    assert sorted(runs) == sorted(["p", kid])
    assert [r.state for r in results] == [RunState.SUCCEEDED] * 2
    assert results[0].final_answer == "parent done"
    assert [line.split()[1] for line in effects] == [f"{kid}/s1/a1"]  # the effect once
    started = [r for r in logs[1].records if isinstance(r, RunStarted)]
    assert len(started) == 1 and started[0].parent_run_id == "p"


@pytest.mark.parametrize("store_spec", KINDS, indirect=True)
async def test_a_worker_killed_while_its_parent_waits_on_the_queued_child(
    store_spec: str, tmp_path: Path
) -> None:
    """Worker a serves only the parent: the child waits in the queue. a is killed while its
    parent waits; worker b (both agents) takes the parent over, whose replay finds the queued
    child (one submission), and claims the child too."""
    kid = treadle.child_run_id("p/s1/a1")
    a = _worker(tmp_path, store_spec, "parent")
    try:
        await _submit(store_spec, "p")
        await _until(lambda: _child_exists(store_spec, kid))
        _kill(a)
        assert _effects(tmp_path) == []  # nobody served the child yet
        b = _worker(tmp_path, store_spec, "parent,child")
        try:
            results, logs, runs = await _results(store_spec, "p", kid)
        finally:
            err = _stop(b)
    finally:
        a.kill()
    assert "Traceback" not in err, err
    _check_one_child(results, logs, runs, _effects(tmp_path))


@pytest.mark.parametrize("store_spec", KINDS, indirect=True)
async def test_a_worker_killed_while_the_child_runs_leaves_one_child_to_the_next(
    store_spec: str, tmp_path: Path
) -> None:
    """Worker a drives the parent (waiting, its slot freed) and the child, whose tool is
    inside its effect when a is killed. Worker b takes both over: the child's interrupted
    call is not run again (replay policy never), the parent re-attaches to the same child."""
    a = _worker(tmp_path, store_spec, "parent,child", SLOW_S="60")
    try:
        await _submit(store_spec, "p")

        async def effect_written() -> bool:
            return len(_effects(tmp_path)) == 1

        await _until(effect_written)
        _kill(a)
        b = _worker(tmp_path, store_spec, "parent,child")
        try:
            results, logs, runs = await _results(store_spec, "p", treadle.child_run_id("p/s1/a1"))
        finally:
            err = _stop(b)
    finally:
        a.kill()
    assert "Traceback" not in err, err
    _check_one_child(results, logs, runs, _effects(tmp_path))
    assert results[1].final_answer == "child done"


@pytest.mark.parametrize("store_spec", KINDS, indirect=True)
async def test_a_child_that_finishes_while_nobody_drives_its_parent_is_found_by_its_resume(
    store_spec: str, tmp_path: Path
) -> None:
    """Nothing notifies a parent that its child finished, so there is nothing to lose between
    the two: worker a (parents) is killed while its parent waits, worker b (children) drives
    the child to its end with no parent driven anywhere, then worker c (parents) takes the
    parent over; its replayed call reads the finished child and runs nothing of it again."""
    kid = treadle.child_run_id("p/s1/a1")
    a = _worker(tmp_path, store_spec, "parent")
    try:
        await _submit(store_spec, "p")
        await _until(lambda: _child_exists(store_spec, kid))
        _kill(a)
        b = _worker(tmp_path, store_spec, "child")
        try:
            with trio.fail_after(60):
                async with open_store(store_spec) as opened:
                    child = await treadle.wait_result(opened, kid, poll_s=0.05)
                    parent_log = await opened.read_log("p")
        finally:
            err_b = _stop(b)
        assert child.final_answer == "child done" and parent_log.finished is None
        c = _worker(tmp_path, store_spec, "parent")
        try:
            results, logs, runs = await _results(store_spec, "p", kid)
        finally:
            err_c = _stop(c)
    finally:
        a.kill()
    assert "Traceback" not in err_b + err_c, (err_b, err_c)
    _check_one_child(results, logs, runs, _effects(tmp_path))


@pytest.mark.parametrize("store_spec", KINDS, indirect=True)
async def test_a_parked_parent_outlives_its_worker_and_the_childs_end_in_another_process_wakes_it(
    store_spec: str, tmp_path: Path
) -> None:
    """Worker a (parents) parks the parent (its lease released, state awaiting_child) and is
    killed: it held nothing. Worker b (children) drives the child to its end, which wakes the
    parent at once; worker c (parents) claims it, its replayed call reads the finished child.
    Nothing was taken over: the park was a clean release."""
    kid = treadle.child_run_id("p/s1/a1")
    a = _worker(tmp_path, store_spec, "parent", PARK_AFTER_S="0.1")
    try:
        await _submit(store_spec, "p")
        await _until(lambda: _parked_on_child(store_spec, "p"))
        _kill(a)
        c = _worker(tmp_path, store_spec, "parent", PARK_AFTER_S="0.1")
        b = _worker(tmp_path, store_spec, "child")
        try:
            results, logs, runs = await _results(store_spec, "p", kid)
            async with open_store(store_spec) as opened:
                summary = await opened.read_summary("p")  # type: ignore[attr-defined]
        finally:
            err = _stop(b) + _stop(c)
    finally:
        a.kill()
    assert "Traceback" not in err, err
    _check_one_child(results, logs, runs, _effects(tmp_path))
    awaited = [r for r in logs[0].records if isinstance(r, ChildrenAwaited)]
    assert [a.children for a in awaited] == [(kid,)]
    assert (summary.claims, summary.takeovers) == (2, 0)


async def _parked_on_child(store: str, run_id: str) -> bool:
    async with open_store(store) as opened:
        summary = await opened.read_summary(run_id)  # type: ignore[attr-defined]
    return (
        summary is not None
        and summary.state is RunState.AWAITING_CHILD
        and summary.liveness is Liveness.PARKED
    )
