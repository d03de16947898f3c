"""Leases across real processes, on SQLite and on a real PostgreSQL.

* chaos: four ``treadle worker`` processes drain a queue while a supervisor SIGKILLs a random
  one every fraction of a second and starts another: every run finishes, no ``never``-policy
  tool ran twice, no write of an older driver follows a takeover (`treadle.testing.chaos`;
  ``python -m treadle.testing.chaos`` runs the full 200-run size);
* fencing: a driver stopped with SIGSTOP past its lease's TTL is taken over; woken with
  SIGCONT, its next write is refused, it stops cleanly (no traceback), and the log holds no
  write of its generation after the takeover;
* two processes started on one run: one drives, the other gets the clear error at once;
* a takeover after SIGKILL comes with generation + 1, and never before the lease expired.

Assertions are about order and cause, never about how long something took.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

import treadle
from treadle._cli_common import open_store
from treadle.testing.chaos import run_chaos

KINDS = ["sqlite", "postgres"]
TTL_S = 1.0

AGENT_MODULE = '''
import os
from pathlib import Path

import trio
import treadle
from treadle.testing.scripted import ScriptedModel, call, say

MARKS = Path(os.environ["MARKS"])


@treadle.tool
async def slow(label: str, ctx: treadle.ToolContext) -> str:
    """Record the start, take a while, record the end."""
    with MARKS.open("a") as out:
        out.write(f"start {ctx.intent_id} {os.getpid()}\\n")
    await trio.sleep(float(os.environ.get("SLOW_S", "3")))
    gate = os.environ.get("GATE")  # a file the test makes when the call may end
    while gate is not None and not Path(gate).exists():
        await trio.sleep(0.05)
    with MARKS.open("a") as out:
        out.write(f"done {ctx.intent_id} {os.getpid()}\\n")
    return f"did {label}"


def factory() -> treadle.Agent:
    return treadle.Agent(
        model=ScriptedModel(turns=[call("slow", label="x", call_id="c1"), say("finished")]),
        executor=treadle.Toolbox([slow]),
        parser=treadle.NativeToolCallParser(),
    )
'''

DRIVER = """
import sys
import trio
import treadle
from slowagent import factory
from treadle._cli_common import open_store

store, run_id, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])


async def main() -> None:
    async with open_store(store, create=True) as opened:
        result = await treadle.run(factory(), "go", store=opened, run_id=run_id, lease_ttl_s=ttl)
    print(f"finished {result.state.value}", flush=True)


try:
    trio.run(main)
except treadle.TreadleError as exc:
    print(f"error: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(3)
"""


@pytest.fixture
def store_spec(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "runs.db")
    return str(request.getfixturevalue("postgres_database"))


def _driver(tmp_path: Path, store: str, run_id: str, **env: str) -> subprocess.Popen[str]:
    (tmp_path / "slowagent.py").write_text(AGENT_MODULE)
    (tmp_path / "driver.py").write_text(DRIVER)
    return subprocess.Popen(
        [sys.executable, "driver.py", store, run_id, str(TTL_S)],
        cwd=tmp_path,
        env={**os.environ, "MARKS": str(tmp_path / "marks.txt"), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def _wait_for_mark(tmp_path: Path, word: str, count: int = 1) -> list[str]:
    marks = tmp_path / "marks.txt"
    with trio.fail_after(60):
        while True:
            lines = marks.read_text().splitlines() if marks.exists() else []
            found = [line for line in lines if line.startswith(word)]
            if len(found) >= count:
                return found
            await trio.sleep(0.02)


async def _lease(store: str, run_id: str) -> treadle.Lease:
    async with open_store(store) as opened:
        lease = await opened.read_lease(run_id)  # type: ignore[attr-defined]
    assert lease is not None
    return lease


async def _generations(store: str, run_id: str) -> tuple[tuple[int, ...], treadle.RunLog]:
    async with open_store(store) as opened:
        generations = await opened.read_generations(run_id)  # type: ignore[attr-defined]
        log = await opened.read_log(run_id)
    return generations, log


async def _wait_expired(store: str, run_id: str) -> treadle.Lease:
    """Wait until the run's lease is past its expiry (the store's clock is this machine's)."""
    with trio.fail_after(60):
        while True:
            lease = await _lease(store, run_id)
            if time.time() > lease.expires_at + 0.2:
                return lease
            await trio.sleep(0.05)


def _finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=60)
    return process.returncode, out, err


# --------------------------------------------------------------------------- chaos


@pytest.mark.parametrize("store_spec", KINDS, indirect=True)
async def test_four_workers_killed_at_random_lose_nothing_and_repeat_nothing(
    store_spec: str, tmp_path: Path
) -> None:
    report = await run_chaos(
        store_spec,
        workdir=tmp_path,
        workers=4,
        runs=40,
        max_running=4,
        lease_ttl_s=TTL_S,
        kill_every_s=(0.2, 0.6),
        latency_s=0.05,
        seed=7,
        timeout_s=300,
    )
    assert report.problems == (), report.problems[:10]
    assert report.finished == report.runs == 40
    assert report.kills >= 2, report  # the chaos happened while runs were in flight
    assert report.takeovers >= 1, report
    assert report.worker_exits == (0, 0, 0, 0)  # SIGTERM drains and exits 0


# --------------------------------------------------------------------------- fencing


@pytest.mark.parametrize("store_spec", KINDS, indirect=True)
async def test_a_paused_driver_is_fenced_after_a_takeover(store_spec: str, tmp_path: Path) -> None:
    gate = tmp_path / "gate"  # the first driver's call ends only after the takeover
    first = _driver(tmp_path, store_spec, "fenced", SLOW_S="0", GATE=str(gate))
    try:
        await _wait_for_mark(tmp_path, "start")
        before = await _lease(store_spec, "fenced")
        first.send_signal(signal.SIGSTOP)  # frozen inside its tool call, lease held
        await _wait_expired(store_spec, "fenced")
        second = _driver(tmp_path, store_spec, "fenced", SLOW_S="0")
        code, out, err = _finish(second)
        assert (code, out.strip()) == (0, "finished succeeded"), err
        gate.touch()
        first.send_signal(signal.SIGCONT)
        code, out, err = _finish(first)
    finally:
        first.kill()
        first.communicate(timeout=60)
    assert code == 3, (out, err)
    assert out.startswith("error: LeaseLost:") and "Traceback" not in err, (out, err)
    generations, log = await _generations(store_spec, "fenced")
    takeover = generations.index(before.generation + 1)
    assert all(g == before.generation + 1 for g in generations[takeover:]), generations
    assert log.finished is not None and log.finished.state is treadle.RunState.SUCCEEDED
    # Whatever the woken driver's tool did (its renewal or its write found the lease lost
    # first), its result never reached the log: the new driver recorded the outcome unknown.
    results = [r for r in log.records if isinstance(r, treadle.types.ActionResult)]
    assert [r.outcome.status for r in results] == [treadle.ActionStatus.UNKNOWN]


@pytest.mark.parametrize("store_spec", KINDS, indirect=True)
async def test_a_second_process_on_a_driven_run_gets_a_clear_error(
    store_spec: str, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"  # the first driver's call ends only once the second has tried
    first = _driver(tmp_path, store_spec, "shared", SLOW_S="0", GATE=str(gate))
    try:
        await _wait_for_mark(tmp_path, "start")
        second = _driver(tmp_path, store_spec, "shared", SLOW_S="0")
        code, out, err = _finish(second)
        gate.touch()
        assert code == 3 and out.startswith("error: RunLeased:"), (out, err)
        assert "is driven by" in out and "expires" in out and "Traceback" not in err
        code, out, err = _finish(first)
        assert (code, out.strip()) == (0, "finished succeeded"), err
    finally:
        first.kill()
        first.communicate(timeout=60)
    assert (tmp_path / "marks.txt").read_text().count("start") == 1  # driven once


@pytest.mark.parametrize("store_spec", KINDS, indirect=True)
async def test_a_run_is_taken_over_after_sigkill_with_the_next_generation(
    store_spec: str, tmp_path: Path
) -> None:
    first = _driver(tmp_path, store_spec, "orphan", SLOW_S="30")
    try:
        await _wait_for_mark(tmp_path, "start")
        first.send_signal(signal.SIGKILL)
    finally:
        first.kill()
        first.communicate(timeout=60)
    held = await _lease(store_spec, "orphan")
    with trio.fail_after(60):
        while True:  # the dead driver's lease holds until it expires
            second = _driver(tmp_path, store_spec, "orphan", SLOW_S="0")
            code, out, err = _finish(second)
            if code == 0:
                break
            assert out.startswith("error: RunLeased:") and "Traceback" not in err, (out, err)
            await trio.sleep(0.1)
    generations, log = await _generations(store_spec, "orphan")
    assert log.finished is not None and log.finished.state is treadle.RunState.SUCCEEDED
    assert sorted(set(generations)) == [held.generation, held.generation + 1]
    taken = [r for r, g in zip(log.records, generations, strict=True) if g > held.generation]
    first_new = dt.datetime.fromisoformat(getattr(taken[0], "ts", "")).timestamp()
    assert first_new >= held.expires_at, "a write of the new driver before the lease expired"
    results = [r for r in log.records if isinstance(r, treadle.types.ActionResult)]
    assert [r.outcome.status for r in results] == [treadle.ActionStatus.UNKNOWN]  # never re-run


async def test_chaos_with_a_relative_sqlite_path_gives_the_workers_the_same_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers run in the workdir: a relative store path named another file there."""
    monkeypatch.chdir(tmp_path)
    report = await run_chaos(
        "chaos.db",
        workdir="work",
        workers=2,
        runs=4,
        max_running=4,
        lease_ttl_s=TTL_S,
        seed=1,
        timeout_s=60,
    )
    assert report.problems == (), report.problems[:10]
    assert not (tmp_path / "work" / "chaos.db").exists()
