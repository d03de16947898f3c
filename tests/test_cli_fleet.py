"""The fleet commands and the truthful run commands: ``treadle submit``, ``worker``, ``wait``,
``cancel``, ``approve``, ``tail``, ``runs`` and ``unquarantine`` on a SQLite (or JSONL) store.

``treadle worker`` runs as a real subprocess (it serves until SIGTERM); the other commands run
in-process through click's runner, on stores prepared in-process with ``trio.run``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio
from click.testing import CliRunner

import treadle
from treadle.cli import main
from treadle.stores.jsonl import open_jsonl_store
from treadle.stores.sqlite import SqliteStore, open_sqlite_store
from treadle.testing import CrashingExecutor, CrashingStore, SimulatedCrash
from treadle.testing.invariants import check_invariants
from treadle.testing.scripted import ScriptedModel, call, say
from treadle.types import (
    ActionIntent,
    ActionResult,
    ActionStatus,
    ApprovalDecided,
    CancelRequested,
    Liveness,
    Message,
    RunState,
)

AGENTS_MODULE = textwrap.dedent(
    '''
    """Agents the worker subprocess serves (written into the test's directory)."""

    import trio

    import treadle
    from treadle.testing.scripted import ScriptedModel, call, say


    @treadle.tool
    async def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b


    @treadle.tool(timeout_s=600)
    async def slow(seconds: float) -> str:
        """Take a while."""
        await trio.sleep(seconds)
        return "slept"


    def calc() -> treadle.Agent:
        return treadle.Agent(
            model=ScriptedModel(turns=[call("add", a=2, b=3), say("2 + 3 = 5")]),
            executor=treadle.Toolbox([add]),
            parser=treadle.NativeToolCallParser(),
            version="v1",
        )


    @treadle.tool
    async def collector() -> str:
        """The worker process's garbage collector settings."""
        import gc
        return f"threshold {gc.get_threshold()[0]}, frozen {gc.get_freeze_count() > 0}"


    def gc_probe() -> treadle.Agent:
        return treadle.Agent(
            model=ScriptedModel(turns=[call("collector"), say("seen")]),
            executor=treadle.Toolbox([collector]),
            parser=treadle.NativeToolCallParser(),
        )


    @treadle.tool(timeout_s=600)
    async def gate(path: str) -> str:
        """Say it started (a file PATH.started), then wait until a file PATH exists."""
        await trio.Path(path + ".started").touch()
        while not await trio.Path(path).exists():
            await trio.sleep(0.05)
        return "through"


    def gated() -> treadle.Agent:
        return treadle.Agent(
            model=ScriptedModel(turns=[call("gate", path="gate"), say("through")]),
            executor=treadle.Toolbox([gate]),
            parser=treadle.NativeToolCallParser(),
            version="v1",
        )


    def sleeper() -> treadle.Agent:
        return treadle.Agent(
            model=ScriptedModel(turns=[call("slow", seconds=300), say("woke up")]),
            executor=treadle.Toolbox([slow]),
            parser=treadle.NativeToolCallParser(),
            limits=treadle.Limits(tool_timeout_s=600),
            version="v1",
        )
    '''
)


@treadle.tool
async def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@treadle.tool(requires_approval=True)
async def wire(amount: int) -> str:
    """Send money."""
    return f"sent {amount}"


def calc_agent(executor=None) -> treadle.Agent:
    return treadle.Agent(
        model=ScriptedModel(turns=[call("add", a=2, b=3), say("2 + 3 = 5")]),
        executor=executor or treadle.Toolbox([add]),
        parser=treadle.NativeToolCallParser(),
    )


def wire_agent() -> treadle.Agent:
    return treadle.Agent(
        model=ScriptedModel(turns=[call("wire", amount=5, call_id="p1"), say("paid")]),
        executor=treadle.Toolbox([wire]),
        parser=treadle.NativeToolCallParser(),
    )


def invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(main, list(args), env=env)


def rows(db: Path) -> dict[str, dict]:
    listed = invoke("runs", "--store", str(db), "--json")
    assert listed.exit_code == 0, listed.output
    found = [json.loads(line) for line in listed.stdout.splitlines()]
    return {row["run_id"]: row for row in found}


def read_log(db: Path, run_id: str):
    async def go():
        async with open_sqlite_store(db) as store:
            return await store.read_log(run_id)

    return trio.run(go)


def leave_orphaned(db: Path, run_id: str) -> None:
    """Start a run that stops unfinished: its driver's block failed, its lease released."""

    async def go():
        async with open_sqlite_store(db) as store:
            with pytest.raises(RuntimeError):
                async with treadle.open_run(calc_agent(), "2+3?", store=store, run_id=run_id):
                    raise RuntimeError("the driving program failed")

    trio.run(go)


def leave_parked(db: Path, run_id: str, agent: treadle.Agent | None = None) -> None:
    """Start a run of ``agent`` (`wire_agent`) that waits on an approval and is parked; its
    process then goes away."""

    async def go():
        async with open_sqlite_store(db) as store:
            with trio.CancelScope() as gone:
                async with treadle.open_run(
                    agent or wire_agent(), "pay", store=store, run_id=run_id, park_after_s=0.1
                ):
                    with trio.fail_after(30):  # parked once the lease release is durable
                        while not await _parked(store, run_id):  # noqa: ASYNC110 (the store)
                            await trio.sleep(0.05)
                    gone.cancel()

    trio.run(go)


async def _parked(store, run_id: str) -> bool:
    summary = await store.read_summary(run_id)  # None until the run-started record is in
    return summary is not None and summary.liveness is Liveness.PARKED


# --------------------------------------------------------------------------- a worker subprocess


@contextmanager
def worker(
    tmp_path: Path, db: Path | str, *agents: str, options: tuple[str, ...] = ()
) -> Iterator[tuple[subprocess.Popen, str]]:
    """``treadle worker`` serving ``agents`` (NAME=FACTORY of the agents module); yields the
    process and the owner id it announced. ``options`` replace the defaults they name."""
    (tmp_path / "fleet_agents.py").write_text(AGENTS_MODULE, encoding="utf-8")
    command = [sys.executable, "-m", "treadle", "worker", "--store", str(db)]
    for spec in agents:
        command += ["--agent", f"{spec.split('=')[0]}=fleet_agents:{spec.split('=')[1]}"]
    command += ["--claim-poll", "0.1", "--lease-ttl", "3", "--drain", "1", *options]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the worker said nothing within 60 s"
        first = proc.stdout.readline()
        assert first.startswith("worker "), first + proc.stderr.read()
        yield proc, first.split()[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def stop(proc: subprocess.Popen, signum: int = signal.SIGTERM) -> tuple[int, str, str]:
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def cli(tmp_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "treadle", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_a_worker_drives_submitted_runs_and_exits_0_on_sigterm(tmp_path: Path):
    db = tmp_path / "runs.db"
    with worker(tmp_path, db, "calc=calc") as (proc, owner):
        assert owner.split(":")[1] == str(proc.pid)  # host:pid:random
        submitted = cli(tmp_path, "submit", "--store", str(db), "--agent", "calc", "2+3?")
        assert submitted.returncode == 0, submitted.stderr
        run_id = submitted.stdout.strip()
        assert run_id.startswith("run-")
        waited = cli(tmp_path, "wait", run_id, "--store", str(db), "--poll", "0.1")
        assert waited.returncode == 0, waited.stdout + waited.stderr
        assert "2 + 3 = 5" in waited.stdout and "succeeded" in waited.stdout
        as_json = cli(tmp_path, "wait", run_id, "--store", str(db), "--json")
        assert json.loads(as_json.stdout)["final_answer"] == "2 + 3 = 5"
        assert proc.poll() is None  # it serves on until told to stop
        code, out, err = stop(proc)
    assert code == 0, err
    assert "SIGTERM" in out and "leases released" in out
    assert "1 run finished here, 0 drives ended" in out
    row = rows(db)[run_id]
    assert row["state"] == "succeeded" and row["liveness"] == "finished"
    assert row["agent"] == "calc" and row["agent_version"] == "v1" and row["claims"] == 1
    assert check_invariants(read_log(db, run_id)) == []


def drain_a_worker_mid_run(
    tmp_path: Path, db: Path, signum: int = signal.SIGTERM
) -> tuple[int, str, str, str]:
    """A worker drives a run with a long tool call; ``signum``; the drain cuts it."""
    with worker(tmp_path, db, "slow=sleeper") as (proc, owner):
        submitted = invoke("submit", "--store", str(db), "--agent", "slow", "--run-id", "s", "go")
        assert submitted.exit_code == 0, submitted.output
        with _deadline(60) as expired:
            while rows(db)["s"]["liveness"] != "driven":
                expired()
        assert rows(db)["s"]["driver"] == owner
        code, out, err = stop(proc, signum)
    return code, out, err, owner


def test_sigterm_drains_a_worker_and_leaves_its_runs_to_others(tmp_path: Path):
    db = tmp_path / "runs.db"
    code, out, err, _ = drain_a_worker_mid_run(tmp_path, db)
    assert code == 0, err
    assert "draining" in out and "leases released" in out
    row = rows(db)["s"]
    assert row["state"] == "running" and row["liveness"] == "orphaned"
    assert row["driver"] is None and row["takeovers"] == 0
    log = read_log(db, "s")
    assert log.finished is None and isinstance(log.records[-1], ActionIntent)


def test_sighup_of_a_closed_terminal_drains_a_worker_as_sigterm_does(tmp_path: Path):
    db = tmp_path / "runs.db"
    code, out, err, _ = drain_a_worker_mid_run(tmp_path, db, signal.SIGHUP)
    assert code == 0, err
    assert "SIGHUP: draining" in out and "leases released" in out
    row = rows(db)["s"]
    assert row["state"] == "running" and row["liveness"] == "orphaned"
    assert row["driver"] is None


HELD_AT_THE_WORKERS_MODULE = textwrap.dedent(
    """
    import runpy
    import sys

    class HoldAtTheWorkersModule:
        \"\"\"Holds the import of the worker's module until a line comes on standard input.\"\"\"

        def find_spec(self, name, path=None, target=None):
            if name == "treadle._cli_fleet":
                sys.meta_path.remove(self)
                print("loading", flush=True)
                sys.stdin.readline()
            return None

    sys.meta_path.insert(0, HoldAtTheWorkersModule())
    sys.argv[0] = "treadle"
    runpy.run_module("treadle", run_name="__main__", alter_sys=True)  # python -m treadle
    """
)
"""``python -m treadle ARGS`` held where the group imports ``treadle._cli_fleet``."""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_while_the_worker_loads_its_module_stops_it_before_it_claims(
    tmp_path: Path, signum: int
):
    """The signal comes while the process imports the worker's module (the stores, trio, the
    database drivers: most of a start-up); before, SIGTERM and SIGHUP killed it and SIGINT
    ended it with status 130."""
    (tmp_path / "fleet_agents.py").write_text(AGENTS_MODULE, encoding="utf-8")
    db = tmp_path / "runs.db"
    command = [sys.executable, "-c", HELD_AT_THE_WORKERS_MODULE, "worker", "--store", str(db)]
    proc = subprocess.Popen(
        [*command, "--agent", "calc=fleet_agents:calc"],
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "loading\n", proc.stderr.read()
        proc.send_signal(signum)
        out, err = proc.communicate("go on\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, err
    assert out == "stopped before it started: nothing claimed\n"
    assert not db.exists()  # it did not even open its store


def test_a_drained_worker_counts_the_runs_it_left_to_resume(tmp_path: Path):
    db = tmp_path / "runs.db"
    code, out, err, _ = drain_a_worker_mid_run(tmp_path, db)
    assert code == 0, err
    assert "0 runs finished here, 1 drive ended with the run unfinished" in out


def test_a_drained_worker_whose_last_write_failed_behind_a_locked_row_says_so_and_stops(
    tmp_path: Path, postgres_database: str
):
    """SIGTERM while another transaction kept the runs' rows locked: the drained run's step
    write failed (the row stayed locked past the commit's wait) after the drive had stopped
    waiting for it, and closing the store raised that failure. It escaped the worker before
    its stopped line: no line, the error alone. The line is now printed, ending with the
    failure, and the worker exits 1."""
    import psycopg

    options = ("--lease-ttl", "15", "--drain", "60")
    with worker(tmp_path, postgres_database, "gated=gated", options=options) as (proc, _):
        submitted = invoke(
            "submit", "--store", postgres_database, "--agent", "gated", "--run-id", "g", "go"
        )
        assert submitted.exit_code == 0, submitted.output
        with _deadline(60) as expired:  # its action intent is durable: the tool runs
            while not (tmp_path / "gate.started").exists():
                expired()
        with psycopg.connect(postgres_database) as other:
            other.execute("SELECT 1 FROM runs FOR UPDATE")  # held until the worker is gone
            proc.send_signal(signal.SIGTERM)
            (tmp_path / "gate").touch()  # the step ends: the drain stops the run after it
            out, err = proc.communicate(timeout=120)
            other.rollback()
    assert proc.returncode == 1, out + err
    (line,) = [x for x in out.splitlines() if x.startswith("worker stopped: ")]
    assert "0 runs finished here, 1 drive ended with the run unfinished" in line
    assert "then closing the store failed" in line and "writes of runs ['g'] failed" in line
    assert "stayed locked by another transaction" in line  # the cause
    assert "Error:" not in err  # said once, in the line

    async def log_of_g() -> treadle.types.RunLog:
        async with treadle.open_postgres_store(postgres_database) as store:
            return await store.read_log("g")

    log = trio.run(log_of_g)
    assert isinstance(log.records[-1], ActionIntent)  # nothing of the failed write is stored


@contextmanager
def _deadline(seconds: float):
    import time

    end = time.monotonic() + seconds

    def expired() -> None:
        assert time.monotonic() < end, f"not within {seconds} s"
        time.sleep(0.05)

    yield expired


def test_cancel_of_a_driven_run_names_its_driver_and_the_driver_stops_it(tmp_path: Path):
    db = tmp_path / "runs.db"
    with worker(tmp_path, db, "slow=sleeper") as (proc, owner):
        submitted = invoke("submit", "--store", str(db), "--agent", "slow", "--run-id", "s", "go")
        assert submitted.exit_code == 0, submitted.output
        with _deadline(60) as expired:
            while rows(db)["s"]["liveness"] != "driven":
                expired()
        cancelled = invoke("cancel", "s", "--store", str(db), "--reason", "enough")
        assert cancelled.exit_code == 0, cancelled.output
        assert f"{owner} drives the run" in cancelled.output
        waited = cli(tmp_path, "wait", "s", "--store", str(db), "--poll", "0.1")
        assert waited.returncode == 1
        assert "cancelled" in waited.stdout
        code, _, err = stop(proc)
    assert code == 0, err
    log = read_log(db, "s")
    assert log.finished.state is RunState.CANCELLED
    assert check_invariants(log) == []


# --------------------------------------------------------------------------- submit and runs


def test_submit_prints_the_run_id_and_runs_lists_it_queued_with_its_full_id(tmp_path: Path):
    db = tmp_path / "runs.db"
    long_id = "tenant-42/" + "x" * 150 + "/job=7"
    submitted = invoke("submit", "--store", str(db), "--agent", "calc", "--run-id", long_id, "2+3")
    assert submitted.exit_code == 0, submitted.output
    assert submitted.stdout.strip() == long_id
    fresh = invoke("submit", "--store", str(db), "--agent", "calc", "3+4")
    assert fresh.exit_code == 0, fresh.output
    fresh_id = fresh.stdout.strip()
    found = rows(db)
    assert list(found) == [long_id, fresh_id]
    row = found[long_id]
    assert (row["state"], row["liveness"], row["agent"]) == ("queued", "queued", "calc")
    assert row["driver"] is None and row["submitted_at"] is not None and row["claims"] == 0
    # Submitting the same again is idempotent; another input for the id is refused.
    again = invoke("submit", "--store", str(db), "--agent", "calc", "--run-id", long_id, "2+3")
    assert again.exit_code == 0 and again.stdout.strip() == long_id
    other = invoke("submit", "--store", str(db), "--agent", "calc", "--run-id", long_id, "9+9")
    assert other.exit_code != 0 and long_id in other.output
    assert len(rows(db)) == 2
    table = invoke("runs", "--store", str(db), env={"COLUMNS": "400"})
    assert table.exit_code == 0, table.output
    assert long_id in table.stdout and "nobody: queued" in table.stdout


def test_submit_refuses_an_invalid_run_id_with_a_clear_error(tmp_path: Path):
    db = tmp_path / "runs.db"
    refused = invoke("submit", "--store", str(db), "--agent", "calc", "--run-id", "a b", "x")
    assert refused.exit_code != 0
    assert "invalid run id" in refused.output
    assert isinstance(refused.exception, SystemExit)  # a clean error, not a traceback


def test_show_and_approve_of_a_queued_run_say_it_is_queued(tmp_path: Path):
    """Both said there was no such run, while `runs` and `tail` listed it as queued."""
    db = tmp_path / "runs.db"
    submitted = invoke("submit", "--store", str(db), "--agent", "calc", "--run-id", "q", "x")
    assert submitted.exit_code == 0, submitted.output
    shown = invoke("show", "q", "--store", str(db))
    assert shown.exit_code == 0, shown.output
    assert "run q is queued (agent calc)" in shown.output
    as_json = invoke("show", "q", "--store", str(db), "--json")
    assert as_json.exit_code == 0 and as_json.stdout == ""  # no event yet; the note on stderr
    assert "run q is queued" in as_json.stderr
    approved = invoke("approve", "q", "--store", str(db))
    assert approved.exit_code != 0
    assert "run 'q' is queued, not started: nothing waits for a decision" in approved.output


def test_wait_on_an_unknown_run_is_a_clear_error(tmp_path: Path):
    db = tmp_path / "runs.db"
    submitted = invoke("submit", "--store", str(db), "--agent", "calc", "--run-id", "known", "x")
    assert submitted.exit_code == 0
    waited = invoke("wait", "unknown", "--store", str(db))
    assert waited.exit_code != 0 and "no run 'unknown'" in waited.output


def test_wait_with_a_timeout_of_0_answers_a_finished_run_and_an_unknown_one(tmp_path: Path):
    """The deadline cut the first look at the run short: ``--timeout 0`` said of a run that
    had finished "has not finished after 0 s" (exit 2), and of an unknown run the same
    instead of that there is no such run."""
    db = tmp_path / "runs.db"

    async def finish() -> None:
        async with open_sqlite_store(db) as store:
            await treadle.run(calc_agent(), "2+3?", store=store, run_id="done")

    trio.run(finish)
    waited = invoke("wait", "done", "--store", str(db), "--timeout", "0")
    assert waited.exit_code == 0, waited.output
    assert waited.stdout == "done: succeeded (final_answer): 2 + 3 = 5\n"
    unknown = invoke("wait", "nope", "--store", str(db), "--timeout", "0")
    assert unknown.exit_code == 1, unknown.output
    assert "no run 'nope'" in unknown.output and "has not finished" not in unknown.output


async def test_wait_answers_a_finished_run_whose_read_outlasts_the_timeout(autojump_clock):
    """A store read longer than ``--timeout`` (a PostgreSQL round trip against 0.01 s) was
    cancelled by the deadline, so a finished run was said not to have finished."""
    from treadle._cli_fleet import _wait
    from treadle.stores.memory import MemoryStore

    class SlowToRead(MemoryStore):
        """A store each of whose summary reads takes 10 s."""

        async def read_summary(self, run_id: str):
            await trio.sleep(10)
            return await super().read_summary(run_id)

    store = SlowToRead()
    await treadle.run(calc_agent(), "2+3?", store=store, run_id="done")
    result = await _wait(store, "done", poll_s=1.0, timeout_s=1.0)
    assert result is not None and result.state is RunState.SUCCEEDED
    with pytest.raises(treadle.UsageError, match="no run 'nope'"):
        await _wait(store, "nope", poll_s=1.0, timeout_s=1.0)


async def test_wait_ends_at_its_timeout_when_a_later_look_never_returns(autojump_clock):
    """A server that stopped answering after the first look: the next look never returned,
    and the deadline, checked only between looks, never came (``--timeout 4`` ran for good).
    The first look still runs to its end; a later one is cut at the deadline."""
    from treadle._cli_fleet import _wait
    from treadle.stores.memory import MemoryStore

    class StopsAnswering(MemoryStore):
        """A store whose summary reads after the first never end."""

        looks = 0

        async def read_summary(self, run_id: str):
            self.looks += 1
            if self.looks > 1:
                await trio.sleep_forever()
            return await super().read_summary(run_id)

    store = StopsAnswering()
    await store.submit("r", agent="calc", input=(Message(role="user", content="2+3?"),))
    began = trio.current_time()
    with trio.fail_after(3600):  # the test's virtual clock: before, the second look went on
        assert await _wait(store, "r", poll_s=1.0, timeout_s=4.0) is None
    assert store.looks == 2 and trio.current_time() - began == pytest.approx(4.0)


def damage_a_jsonl_run(directory: Path, line: int) -> Path:
    """Three finished runs; one byte in the middle of line ``line`` of run ``bad`` changed."""

    async def go():
        async with open_jsonl_store(directory) as store:
            for run_id in ("good-1", "bad", "good-2"):
                await treadle.run(calc_agent(), "2+3?", store=store, run_id=run_id)
            return store.run_file("bad")

    bad_file = Path(trio.run(go))
    lines = bad_file.read_bytes().split(b"\n")
    assert len(lines) > 6  # header, eight record frames, the final newline
    damaged = bytearray(lines[line])
    middle = len(damaged) // 2
    damaged[middle] = ord("#") if damaged[middle] != ord("#") else ord("%")
    lines[line] = bytes(damaged)
    bad_file.write_bytes(b"\n".join(lines))
    return bad_file


def check_damaged_run_listed(directory: Path, bad_file: Path) -> None:
    listed = invoke("runs", "--store", str(directory), env={"COLUMNS": "400"})
    assert listed.exit_code == 1, listed.output
    assert "good-1" in listed.stdout and "good-2" in listed.stdout
    assert "unreadable run bad" in listed.stderr and str(bad_file) in listed.stderr
    as_json = invoke("runs", "--store", str(directory), "--json")
    assert as_json.exit_code == 1
    found = {r["run_id"]: r for r in map(json.loads, as_json.stdout.splitlines())}
    assert set(found) == {"good-1", "bad", "good-2"}
    assert found["good-1"]["state"] == "succeeded" and found["good-1"]["error"] is None
    assert found["bad"]["error"] and found["bad"]["where"] == str(bad_file)
    shown = invoke("show", "bad", "--store", str(directory))
    assert shown.exit_code != 0 and "damaged" in shown.output


def test_runs_names_a_run_whose_first_record_is_damaged(tmp_path: Path):
    directory = tmp_path / "runs"
    bad_file = damage_a_jsonl_run(directory, line=1)
    check_damaged_run_listed(directory, bad_file)


def test_runs_names_a_run_damaged_in_the_middle_of_its_log(tmp_path: Path):
    directory = tmp_path / "runs"
    bad_file = damage_a_jsonl_run(directory, line=5)
    check_damaged_run_listed(directory, bad_file)


def test_runs_names_a_run_whose_file_is_a_symbolic_link_to_nothing(tmp_path: Path):
    # The run vanished from `treadle runs` (exit 0), read as a missing file.
    directory = tmp_path / "runs"
    bad_file = damage_a_jsonl_run(directory, line=1)
    bad_file.unlink()
    bad_file.symlink_to(tmp_path / "moved" / bad_file.name)
    listed = invoke("runs", "--store", str(directory), env={"COLUMNS": "400"})
    assert listed.exit_code == 1, listed.output
    assert "good-1" in listed.stdout and "good-2" in listed.stdout
    assert f"unreadable run bad ({bad_file}): cannot read {bad_file}: it is a symbolic link" in (
        listed.stderr
    )
    shown = invoke("show", "bad", "--store", str(directory))
    assert shown.exit_code == 1 and "which does not exist" in shown.output


def test_repair_cuts_a_damaged_log_and_runs_reads_clean_again(tmp_path: Path):
    directory = tmp_path / "runs"
    bad_file = damage_a_jsonl_run(directory, line=5)
    damaged = invoke("show", "bad", "--store", str(directory))
    assert damaged.exit_code != 0 and "damaged" in damaged.output
    healthy = invoke("repair", "good-1", "--store", str(directory))
    assert healthy.exit_code == 0, healthy.output
    assert "read without damage; nothing removed" in healthy.output
    before = bad_file.read_bytes()
    refused = invoke("repair", "bad", "--store", str(directory))
    assert refused.exit_code == 1 and "Traceback" not in refused.output
    assert "readable record(s)" in refused.output and "the run-finished record" in refused.output
    assert "--force" in refused.output and bad_file.read_bytes() == before
    repaired = invoke("repair", "bad", "--store", str(directory), "--force")
    assert repaired.exit_code == 0, repaired.output
    assert "removed" in repaired.output and str(bad_file) in repaired.output
    assert "readable records among them" in repaired.output
    assert ".repairs" in repaired.output
    missing = invoke("repair", "nosuch", "--store", str(directory))
    assert missing.exit_code == 1 and "no run 'nosuch'" in missing.output
    shown = invoke("show", "bad", "--store", str(directory), "--json")
    assert shown.exit_code == 0, shown.output
    durable = [r for r in map(json.loads, shown.stdout.splitlines()) if r["kind"] != "step_started"]
    assert len(durable) == 4  # the frames before the damaged line
    listed = invoke("runs", "--store", str(directory), "--json")
    assert listed.exit_code == 0, listed.output
    found = {r["run_id"]: r for r in map(json.loads, listed.stdout.splitlines())}
    assert found["bad"]["error"] is None and found["bad"]["state"] == "running"
    assert found["good-2"]["state"] == "succeeded"
    db = tmp_path / "runs.db"
    leave_orphaned(db, "o")
    refused = invoke("repair", "o", "--store", str(db))
    assert refused.exit_code != 0 and "JSONL" in refused.output


def test_repair_cuts_a_damaged_control_stream_and_runs_reads_clean_again(tmp_path: Path):
    # The damage said "`treadle repair` removes it knowingly", yet repair looked at the log
    # only ("its log reads without damage; nothing removed"), and `treadle runs` exited 0.
    directory = tmp_path / "runs"

    async def go() -> Path:
        async with open_jsonl_store(directory) as store:
            await treadle.run(calc_agent(), "2+3?", store=store, run_id="r")
            await store.append_control(
                CancelRequested(run_id="r", ts="2025-01-01T00:00:00+00:00", reason="late")
            )
            return directory / ".control" / Path(store.run_file("r")).name

    control = trio.run(go)
    kept = control.read_bytes()
    control.write_bytes(kept + b"x\n")
    listed = invoke("runs", "--store", str(directory), "--json")
    assert listed.exit_code == 1, listed.output
    (row,) = map(json.loads, listed.stdout.splitlines())
    assert row["state"] == "succeeded" and str(control) in row["error"]
    repaired = invoke("repair", "r", "--store", str(directory))
    assert repaired.exit_code == 0, repaired.output
    assert f"removed 2 bytes from offset {len(kept)} of {control}" in repaired.output
    assert control.read_bytes() == kept
    assert rows(directory)["r"]["error"] is None
    again = invoke("repair", "r", "--store", str(directory))
    assert "read without damage; nothing removed" in again.output


def test_repair_takes_a_damaged_version_1_control_log_by_the_name_runs_lists(tmp_path: Path):
    # One damaged control pseudo-run of a version-1 store made every command fail, and
    # `treadle repair 'old#control'` was refused: "'#' is not allowed".
    from treadle.stores._codec import record_to_json
    from treadle.stores._lines import frame

    directory = tmp_path / "runs"

    async def go() -> None:
        async with open_jsonl_store(directory) as store:
            await treadle.run(calc_agent(), "2+3?", store=store, run_id="r")

    trio.run(go)
    header = {"format": "treadle.jsonl", "version": 1, "run_id": "old#control", "created_ns": 1}
    stop = CancelRequested(run_id="old#control", ts="2025-01-01T00:00:00+00:00", reason="x")
    entry = bytearray(frame(1, "records", f"[{record_to_json(stop)}]"))
    entry[-3] = ord("#")  # its records' closing bracket: no longer JSON
    pseudo = directory / "old%23control.jsonl"
    pseudo.write_bytes(frame(0, "header", json.dumps(header)) + bytes(entry))
    listed = invoke("runs", "--store", str(directory), "--json")
    assert listed.exit_code == 1, listed.output
    found = {r["run_id"]: r for r in map(json.loads, listed.stdout.splitlines())}
    assert found["r"]["error"] is None and str(pseudo) in found["old#control"]["error"]
    assert invoke("show", "r", "--store", str(directory)).exit_code == 0
    repaired = invoke("repair", "old#control", "--store", str(directory))
    assert repaired.exit_code == 0, repaired.output
    assert f"removed {len(entry)} bytes" in repaired.output and not pseudo.exists()
    assert sorted(rows(directory)) == ["r"]


# --------------------------------------------------------------------------- cancel, approve, tail


def test_cancel_of_a_run_its_driver_finishes_meanwhile_says_nothing_was_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Between the cancel request and the look at the run, its driver finished it succeeded:
    the command said "it is finished here, succeeded" and exited 0."""
    from treadle import _cli_runs
    from treadle.types import RunResult, RunState, StopReason, Totals

    db = tmp_path / "runs.db"
    leave_orphaned(db, "o")

    async def finished_by_its_driver(*args, **kwargs) -> tuple[RunResult, bool]:
        await trio.lowlevel.checkpoint()
        result = RunResult(
            run_id="o",
            state=RunState.SUCCEEDED,
            stop_reason=StopReason.FINAL_ANSWER,
            totals=Totals(),
        )
        return result, False

    monkeypatch.setattr(_cli_runs, "finish_cancelled_here", finished_by_its_driver)
    cancelled = invoke("cancel", "o", "--store", str(db))
    assert cancelled.exit_code == 1, cancelled.output
    assert "finished succeeded (final_answer) before the cancel reached it" in cancelled.output
    assert "nothing was cancelled" in cancelled.output


async def test_a_cancel_its_live_driver_applies_first_is_not_said_to_be_finished_here():
    """The run's driver picked the cancel up and finished the run before the command looked
    at the run (a loaded machine): the command (and the console) said "nobody drove the run:
    it is finished here, cancelled"."""
    from treadle._cli_runs import cancel
    from treadle.stores.memory import MemoryStore

    called, released = trio.Event(), trio.Event()

    class LookingLate(MemoryStore):
        """A store whose look at a run's summary comes after its driver let the run go."""

        async def read_summary(self, run_id: str):
            if called.is_set():
                await released.wait()
            return await super().read_summary(run_id)

    @treadle.tool
    async def wait_long() -> str:
        """Waits until the run is cancelled."""
        called.set()
        await trio.sleep_forever()
        return "never"

    agent = treadle.Agent(
        model=ScriptedModel(turns=[call("wait_long"), say("done")]),
        executor=treadle.Toolbox([wait_long]),
        parser=treadle.NativeToolCallParser(),
    )
    store = LookingLate()
    said: list[str] = []

    async def cancelling() -> None:
        said.append(await cancel(store, "r", reason="stop", canceller="ops"))

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            async with treadle.open_run(
                agent, "x", store=store, run_id="r", control_poll_s=0.05
            ) as handle:
                await called.wait()
                nursery.start_soon(cancelling)
                result = await handle.wait()
            released.set()  # the driver finished the run and released its lease
    assert result.state is RunState.CANCELLED
    assert "finished here" not in said[0], said
    assert "its driver" in said[0] and "cancelled" in said[0], said


def test_a_lease_held_to_finish_a_cancel_is_named_as_such_not_as_a_driver(tmp_path: Path):
    """Another process's cancel held an undriven run's lease to finish it: a second
    ``treadle cancel`` said that process "drives the run and stops it within about 1 s", and
    ``treadle runs`` and the console named it as the run's driver; a cancel owns no run to
    drive."""
    from treadle.stores import lease_owner

    db = tmp_path / "runs.db"
    leave_orphaned(db, "o")
    finishing = lease_owner(cancelling=True)

    async def hold() -> None:
        async with open_sqlite_store(db) as store:
            await store.acquire_lease("o", owner=finishing, ttl_s=60.0)

    trio.run(hold)
    cancelled = invoke("cancel", "o", "--store", str(db), "--reason", "again")
    assert cancelled.exit_code == 0, cancelled.output
    assert f"another cancel ({finishing}) is finishing the run as cancelled now" in (
        cancelled.output
    )
    assert "stops it within" not in cancelled.output
    from treadle._cli_store import driver_text  # the "driven by" of `treadle runs`, the console

    async def summary():
        async with open_sqlite_store(db) as store:
            return await store.read_summary("o")

    said = driver_text(trio.run(summary))
    assert said.startswith(f"{finishing} (finishing it as cancelled, gen. 2"), said


def test_cancel_whose_finish_fails_here_says_the_cancel_is_recorded_for_the_next_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Finishing an undriven run here failed (a privilege revoked, a lock held) after the
    cancel request was stored: the command printed only "Error: cannot write ..." as if
    nothing had happened, though the run's next driver cancels it."""
    from treadle import _cli_runs

    db = tmp_path / "runs.db"
    leave_orphaned(db, "o")

    async def refused(*args, **kwargs):
        await trio.lowlevel.checkpoint()
        raise treadle.StoreError("cannot write to the store: permission denied for table records")

    monkeypatch.setattr(_cli_runs, "finish_cancelled_here", refused)
    cancelled = invoke("cancel", "o", "--store", str(db), "--reason", "stop")
    assert cancelled.exit_code == 1, cancelled.output
    said = " ".join(cancelled.output.split())
    assert "the cancel of run 'o' is recorded, and the run's next driver applies it" in said
    assert "finishing the run here failed: cannot write to the store: permission denied" in said

    async def control() -> tuple:
        async with open_sqlite_store(db) as store:
            return await store.read_control("o")

    (entry,) = trio.run(control)
    assert isinstance(entry.record, CancelRequested) and entry.record.reason == "stop"
    monkeypatch.undo()  # the cause gone: the next cancel finishes it
    again = invoke("cancel", "o", "--store", str(db))
    assert again.exit_code == 0 and "finished here, cancelled" in again.output, again.output


def test_cancel_of_an_undriven_run_finishes_it_here(tmp_path: Path):
    db = tmp_path / "runs.db"
    leave_orphaned(db, "o")
    assert rows(db)["o"]["liveness"] == "orphaned"
    cancelled = invoke("cancel", "o", "--store", str(db), "--reason", "abandoned")
    assert cancelled.exit_code == 0, cancelled.output
    assert "nobody drove the run: it is finished here, cancelled" in cancelled.output
    row = rows(db)["o"]
    assert (row["state"], row["liveness"], row["stop_reason"]) == (
        "cancelled",
        "finished",
        "cancelled",
    )
    log = read_log(db, "o")
    assert check_invariants(log) == []
    again = invoke("cancel", "o", "--store", str(db))
    assert again.exit_code != 0 and "already finished" in again.output


def test_cancel_of_a_run_that_crashed_in_an_action_leaves_no_intent_without_outcome(
    tmp_path: Path,
):
    db = tmp_path / "runs.db"

    async def go():
        async with open_sqlite_store(db) as store:
            crashing = CrashingStore(inner=store, crash_at=10**6)
            executor = CrashingExecutor(
                inner=treadle.Toolbox([add]), crash_at=1, when="after", store=crashing
            )
            with pytest.raises((SimulatedCrash, treadle.RunInterrupted)):
                await treadle.run(calc_agent(executor), "2+3?", store=crashing, run_id="c")

    trio.run(go)
    cancelled = invoke("cancel", "c", "--store", str(db))
    assert cancelled.exit_code == 0, cancelled.output
    assert "finished here, cancelled" in cancelled.output
    log = read_log(db, "c")
    (intent,) = [r for r in log.records if isinstance(r, ActionIntent)]
    (result,) = [r for r in log.records if isinstance(r, ActionResult)]
    assert result.intent_id == intent.intent_id
    assert result.outcome.status is ActionStatus.UNKNOWN
    assert check_invariants(log) == []


def test_cancel_of_a_queued_run_finishes_it_here(tmp_path: Path):
    db = tmp_path / "runs.db"
    submitted = invoke("submit", "--store", str(db), "--agent", "nobody", "--run-id", "q", "x")
    assert submitted.exit_code == 0
    cancelled = invoke("cancel", "q", "--store", str(db))
    assert cancelled.exit_code == 0, cancelled.output
    assert "finished here, cancelled" in cancelled.output
    assert rows(db)["q"]["state"] == "cancelled"


def test_cancel_of_a_run_another_driver_holds_says_who_drives_it(tmp_path: Path):
    db = tmp_path / "runs.db"
    leave_orphaned(db, "h")

    async def hold():
        async with open_sqlite_store(db) as store:
            await store.acquire_lease("h", owner="host-b:4242:beef", ttl_s=3600)

    trio.run(hold)
    cancelled = invoke("cancel", "h", "--store", str(db))
    assert cancelled.exit_code == 0, cancelled.output
    assert "host-b:4242:beef drives the run" in cancelled.output
    # the holder may be a process that died: then it is the next driver that cancels
    output = " ".join(cancelled.output.split())
    assert re.search(r"If that process is gone, its lease expires in about 3[56]\d\d s", output)
    assert rows(db)["h"]["state"] == "running"  # left to its driver

    async def controls():
        async with open_sqlite_store(db) as store:
            return [e.record for e in await store.read_control("h")]

    (request,) = trio.run(controls)
    assert request.canceller == "treadle cancel"


def test_cancel_of_a_parked_run_finishes_it_here_without_running_the_call(tmp_path: Path):
    db = tmp_path / "runs.db"
    leave_parked(db, "p")
    cancelled = invoke("cancel", "p", "--store", str(db))
    assert cancelled.exit_code == 0, cancelled.output
    assert "nobody drove the run: it is finished here, cancelled" in cancelled.output
    log = read_log(db, "p")
    assert log.finished.state is RunState.CANCELLED
    assert not any(isinstance(r, ActionIntent) for r in log.records)
    assert check_invariants(log) == []
    refused = invoke("approve", "p", "--store", str(db))
    assert refused.exit_code != 0 and "already finished" in refused.output


def test_approve_of_an_undriven_run_says_the_decision_waits(tmp_path: Path):
    db = tmp_path / "runs.db"
    leave_parked(db, "p")
    assert rows(db)["p"]["liveness"] == "parked"
    before = read_log(db, "p").records
    approved = invoke("approve", "p", "--store", str(db))
    assert approved.exit_code == 0, approved.output
    assert 'approve: wire({"amount": 5}) (call p1) of step 1 of run p' in approved.output
    assert "the run is parked on this approval: the process that parked it" in approved.output
    assert "treadle resume" in approved.output  # for when that process is gone, as here
    assert read_log(db, "p").records == before  # only the driver writes the log

    async def resume():
        async with open_sqlite_store(db) as store:
            entries = await store.read_control("p")
            result = await treadle.run(wire_agent(), store=store, run_id="p")
            return entries, result, await store.read_log("p")

    entries, result, log = trio.run(resume)
    assert [e.record.decision for e in entries] == ["approve"]
    assert result.final_answer == "paid"
    (decided,) = [r for r in log.records if isinstance(r, ApprovalDecided)]
    assert decided.decision == "approve"
    assert check_invariants(log) == []


def test_the_approval_hint_is_a_command_to_copy_when_the_store_path_has_spaces(tmp_path: Path):
    """The command `tail` (and `resume`) print to decide an approval held the store path
    unquoted: a path with a space became three words when the command was copied."""
    import shlex

    from treadle._cli_runs import _hint_approval

    db = tmp_path / "my runs" / "q q.db"
    db.parent.mkdir()
    leave_parked(db, "p")
    said: list[str] = []
    _hint_approval(read_log(db, "p"), None, str(db), said.append)
    (hint,) = said
    command = hint[hint.index("treadle approve") : hint.index(" [--reject")]
    words = shlex.split(command)
    assert words == ["treadle", "approve", "p", "--store", str(db)]
    approved = invoke(*words[1:])
    assert approved.exit_code == 0, approved.output
    assert 'approve: wire({"amount": 5}) (call p1) of step 1 of run p' in approved.output


def words_a_shell_reads(command: str) -> list[str]:
    """The words bash makes of ``command`` (a line copied from the terminal)."""
    done = subprocess.run(
        ["bash", "-c", f"printf '%s\\0' {command}"], capture_output=True, check=True
    )
    return [os.fsdecode(word) for word in done.stdout.split(b"\0")[:-1]]


def test_the_approval_hint_names_a_store_path_holding_control_characters(tmp_path: Path):
    """The hint's command was quoted, then made printable as a whole: a tab in the store path
    became the four characters ``\\x09`` inside the quotes, naming another path."""
    from treadle._cli_runs import _hint_approval

    db = tmp_path / "tab\there \x1b[31m\u202e.db"
    leave_parked(db, "p")
    said: list[str] = []
    _hint_approval(read_log(db, "p"), None, str(db), said.append)
    (hint,) = said
    assert "\t" not in hint and "\x1b" not in hint and "\u202e" not in hint
    command = hint[hint.index("treadle approve") : hint.index(" [--reject")]
    words = words_a_shell_reads(command)
    assert words == ["treadle", "approve", "p", "--store", str(db)]
    approved = invoke(*words[1:])
    assert approved.exit_code == 0, approved.output
    assert 'approve: wire({"amount": 5}) (call p1) of step 1 of run p' in approved.output


def test_approve_of_a_run_another_driver_holds_names_it(tmp_path: Path):
    db = tmp_path / "runs.db"
    leave_parked(db, "p")

    async def hold():
        async with open_sqlite_store(db) as store:
            await store.acquire_lease("p", owner="host-c:7:cafe", ttl_s=3600)

    trio.run(hold)
    approved = invoke("approve", "p", "--store", str(db), "--reject", "too much")
    assert approved.exit_code == 0, approved.output
    assert "(call p1) of step 1" in approved.output and "reject: " in approved.output
    assert "host-c:7:cafe drives the run" in approved.output
    # The holder may be dead: when its lease runs out, and who applies the decision then.
    assert "If that process is gone, its lease expires in about" in approved.output
    assert "for its next driver" in approved.output


def test_tail_without_follow_says_nobody_drives_an_orphaned_run(tmp_path: Path):
    db = tmp_path / "runs.db"
    leave_orphaned(db, "o")
    tailed = invoke("tail", "o", "--store", str(db), "--no-follow")
    assert tailed.exit_code == 0, tailed.output
    assert "run started" in tailed.output
    assert "nobody drives run o: it is orphaned" in tailed.output
    parked = tmp_path / "parked.db"
    leave_parked(parked, "p")
    tailed = invoke("tail", "p", "--store", str(parked), "--no-follow")
    assert tailed.exit_code == 0, tailed.output
    assert "nobody drives run p: it is parked (waits for a decision): a decision" in tailed.output


def test_tail_of_a_queued_run_says_it_is_queued(tmp_path: Path):
    db = tmp_path / "runs.db"
    assert invoke("submit", "--store", str(db), "--agent", "a", "--run-id", "q", "x").exit_code == 0
    tailed = invoke("tail", "q", "--store", str(db), "--no-follow")
    assert tailed.exit_code == 0, tailed.output
    assert "nobody drives run q: it is queued" in tailed.output


def quarantine_unstarted(db: Path, run_id: str, owner: str = "dead") -> None:
    """Submit ``run_id`` and let its drivers (``owner-N``) die before it starts until it is
    quarantined."""

    async def go():
        now = [1e9]
        store = await SqliteStore.open(db, clock=lambda: now[0])
        try:
            await store.submit(run_id, agent="calc", input=(Message(role="user", content="x"),))
            for n in range(5):
                await store.claim(
                    owner=f"{owner}-{n}",
                    agents={"calc": ("v1",)},
                    limit=1,
                    ttl_s=3,
                    max_takeovers=1,
                    backoff_s=0,
                )
                now[0] += 10
            summary = await store.read_summary(run_id)
            assert summary.liveness is Liveness.QUARANTINED and summary.started_at is None
        finally:
            await store.aclose()

    trio.run(go)


def test_show_tail_wait_and_resume_of_a_quarantined_unstarted_run_say_it_is_quarantined(
    tmp_path: Path,
):
    """`show` said "run r is queued (agent calc): a worker serving it starts it" (exit 0) of a
    run no worker takes until it is released, while `runs` said quarantined. show, tail,
    wait and resume now share one wording for a run in the queue."""
    db = tmp_path / "runs.db"
    quarantine_unstarted(db, "r")
    said = "run r is quarantined: no worker takes it until `treadle unquarantine r` ("
    shown = invoke("show", "r", "--store", str(db))
    assert shown.exit_code == 0, shown.output
    assert said in shown.output and "it has no records yet" in shown.output
    assert "queued" not in shown.output and "starts it" not in shown.output
    as_json = invoke("show", "r", "--store", str(db), "--json")
    assert as_json.exit_code == 0 and as_json.stdout == ""
    assert said in as_json.stderr
    tailed = invoke("tail", "r", "--store", str(db), "--no-follow")
    assert tailed.exit_code == 0, tailed.output
    assert "nobody drives run r: it is quarantined: no worker takes it until" in tailed.output
    waited = invoke("wait", "r", "--store", str(db), "--timeout", "0.3", "--poll", "0.05")
    assert waited.exit_code == 2, waited.output
    assert said in waited.stderr
    resumed = invoke("resume", "r", "--store", str(db), "--agent", "test_cli_fleet:calc_agent")
    assert resumed.exit_code == 1
    assert "run 'r' has no records to resume: it is quarantined: no worker" in resumed.output


def quarantine_damaged_row(db: Path, run_id: str) -> None:
    """Submit ``run_id``, change its row's state by hand to one no run has, and claim once:
    the claim quarantines it, naming the damage."""

    async def go():
        store = await SqliteStore.open(db)
        try:
            await store.submit(run_id, agent="calc", input=(Message(role="user", content="x"),))
            with contextlib.closing(sqlite3.connect(db)) as conn:
                conn.execute("UPDATE runs SET state = 'bogus' WHERE run_id = ?", (run_id,))
                conn.commit()
            claims = await store.claim(
                owner="w", agents={"calc": ("v1",)}, limit=1, ttl_s=3, max_takeovers=1, backoff_s=0
            )
            assert claims == ()
        finally:
            await store.aclose()

    trio.run(go)


def test_show_tail_wait_and_runs_name_the_reason_a_damaged_row_was_quarantined(tmp_path: Path):
    """A run quarantined because its run-index row was changed by hand was shown by `show`
    and `wait` with an empty reason "()", listed by `runs --json` with ``quarantined``
    null, and `tail` said there was no such run. Each now names the reason."""
    db = tmp_path / "runs.db"
    quarantine_damaged_row(db, "bad")
    reason = "its row in the run index is damaged: 'bogus' is not a valid RunState"
    said = f"run bad is quarantined: no worker takes it until `treadle unquarantine bad` ({reason}"
    shown = invoke("show", "bad", "--store", str(db))
    assert shown.exit_code == 0, shown.output
    assert said in shown.output and "it has no records yet" in shown.output
    tailed = invoke("tail", "bad", "--store", str(db), "--no-follow")
    assert tailed.exit_code == 0, tailed.output
    assert "nobody drives run bad: it is quarantined: no worker takes it until" in tailed.output
    assert reason in tailed.output
    waited = invoke("wait", "bad", "--store", str(db), "--timeout", "0")
    assert waited.exit_code == 2, waited.output
    assert said in waited.stderr
    listed = invoke("runs", "--store", str(db), "--json")
    (row,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert row["liveness"] == "quarantined" and row["quarantined"].startswith(reason)


# --------------------------------------------------------------------------- unquarantine


def test_unquarantine_makes_a_quarantined_run_claimable_again(tmp_path: Path):
    db = tmp_path / "runs.db"
    now = [1e9]

    async def quarantine():
        store = await SqliteStore.open(db, clock=lambda: now[0])
        try:
            await store.submit("r", agent="calc", input=(Message(role="user", content="x"),))
            for n in range(5):
                claims = await store.claim(
                    owner=f"dead-{n}",
                    agents={"calc": ("v1",)},
                    limit=1,
                    ttl_s=3,
                    max_takeovers=2,
                    backoff_s=0,
                )
                if claims and n == 0:
                    # The first driver starts the run, then every driver dies.
                    await store.write_run_started(
                        treadle.types.RunStarted(
                            run_id="r",
                            ts="2001-09-09T01:46:40+00:00",
                            input=claims[0].submission.input,
                            snapshot={},
                            agent="calc",
                            agent_version="v1",
                        ),
                        seq=1,
                        generation=claims[0].lease.generation,
                    )
                    assert (await store.read_log("r")).started is not None  # committed
                now[0] += 10
            return await store.read_summary("r")
        finally:
            await store.aclose()

    summary = trio.run(quarantine)
    assert summary.quarantined
    row = rows(db)["r"]
    assert row["liveness"] == "quarantined" and row["quarantined"]
    # `wait` on it said nothing and waited for good: it says why, and --timeout ends it
    waited = invoke("wait", "r", "--store", str(db), "--timeout", "0.3", "--poll", "0.05")
    assert waited.exit_code == 2, waited.output
    assert (
        "run r is quarantined: no worker takes it until `treadle unquarantine r`" in waited.stderr
    )
    assert "run r has not finished after 0.3 s" in waited.stderr
    table = invoke("runs", "--store", str(db), env={"COLUMNS": "400"})
    assert "nobody: quarantined" in table.stdout
    released = invoke("unquarantine", "r", "--store", str(db))
    assert released.exit_code == 0, released.output
    assert "run r is claimable again" in released.output
    row = rows(db)["r"]
    assert row["liveness"] == "orphaned" and row["quarantined"] is None
    again = invoke("unquarantine", "r", "--store", str(db))
    assert again.exit_code != 0 and "not quarantined" in again.output

    async def claim():
        async with open_sqlite_store(db, clock=lambda: now[0]) as store:
            return await store.claim(
                owner="alive",
                agents={"calc": ("v1",)},
                limit=1,
                ttl_s=3,
                max_takeovers=2,
                backoff_s=0,
            )

    (claimed,) = trio.run(claim)
    assert claimed.lease.run_id == "r" and claimed.lease.owner == "alive"


# --------------------------------------------------------------------------- worker arguments


def test_submit_refuses_a_folder_and_leaves_it_as_it_was(tmp_path: Path):
    # `treadle submit --store DIR` said "has no queue" after making DIR a JSONL store
    # (.control/ and .leases/ in it), which the reading commands then listed as one.
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "notes.txt").write_text("notes\n", encoding="utf-8")
    refused = invoke("submit", "--store", str(folder), "--agent", "calc", "hi")
    assert refused.exit_code == 1 and "has no queue (use SQLite or PostgreSQL)" in refused.output
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]
    listed = invoke("runs", "--store", str(folder))
    assert listed.exit_code == 1 and "holds no JSONL store" in listed.output


def test_worker_refuses_a_nan_lease_ttl_before_a_store_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # A NaN passed `--lease-ttl`'s range; the worker refused it only after making the store.
    (tmp_path / "fleet_agents.py").write_text(AGENTS_MODULE, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    store = str(tmp_path / "q.db")
    out = invoke(
        "worker", "--store", store, "--agent", "calc=fleet_agents:calc", "--lease-ttl", "nan"
    )
    assert out.exit_code == 2 and "Invalid value for '--lease-ttl': 'nan'" in out.output
    assert not (tmp_path / "q.db").exists()


def test_submit_and_worker_refuse_an_agent_name_no_worker_can_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # `treadle submit --agent ''` (or 'a=b') exited 0 and queued a run that no worker's
    # `--agent NAME=MODULE:FACTORY` can name, so `treadle wait` on it never returned.
    (tmp_path / "fleet_agents.py").write_text(AGENTS_MODULE, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    store = str(tmp_path / "q.db")
    for name, message in [("", "the agent name is empty"), ("a=b", "holds '='")]:
        refused = invoke("submit", "--store", store, "--agent", name, "--run-id", "r1", "x")
        assert refused.exit_code == 2 and message in refused.output, (name, refused.output)
    worker = invoke("worker", "--store", store, "--agent", "=fleet_agents:calc")
    assert worker.exit_code == 2 and "the agent name is empty" in worker.output, worker.output
    assert not (tmp_path / "q.db").exists()  # refused before any store was made
    served = invoke("submit", "--store", store, "--agent", "calc", "--run-id", "r1", "x")
    assert served.exit_code == 0 and served.output.strip() == "r1", served.output


def test_worker_refuses_a_store_without_a_queue_and_a_bad_agent_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    (tmp_path / "fleet_agents.py").write_text(AGENTS_MODULE, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    directory = tmp_path / "runs"
    directory.mkdir()
    no_queue = invoke("worker", "--store", str(directory), "--agent", "calc=fleet_agents:calc")
    assert no_queue.exit_code != 0 and "has no queue" in no_queue.output
    assert list(directory.iterdir()) == []  # not made a JSONL store before the refusal
    for spec, message in [
        ("calc", "NAME=MODULE:FACTORY"),
        ("calc=fleet_agents:nothing_here", "cannot load"),
        ("calc=fleet_agents", "MODULE:FACTORY"),
    ]:
        bad = invoke("worker", "--store", str(tmp_path / "runs.db"), "--agent", spec)
        assert bad.exit_code == 2 and message in bad.output, (spec, bad.output)
    assert not (tmp_path / "runs.db").exists()  # refused before any store was made


def test_worker_refuses_an_agent_name_given_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # `--agent calc=A --agent calc=B` was taken, and the worker served B alone under the
    # name, silently: runs meant for A were driven by B.
    (tmp_path / "fleet_agents.py").write_text(AGENTS_MODULE, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    directory = tmp_path / "runs"  # no queue: before, the worker failed on it, not on the names
    directory.mkdir()
    twice = invoke(
        "worker",
        "--store",
        str(directory),
        "--agent",
        "calc=fleet_agents:calc",
        "--agent",
        "probe=fleet_agents:gc_probe",
        "--agent",
        "calc=fleet_agents:gc_probe",
    )
    assert twice.exit_code == 2, twice.output
    assert "the agent name 'calc' is given twice" in twice.output, twice.output
    assert list(directory.iterdir()) == []


ENTERED: list[str] = []


@contextlib.asynccontextmanager
async def calc_in_a_block():
    """The calculator agent, yielded by a block the worker keeps open while it serves."""
    ENTERED.append("entered")
    try:
        yield calc_agent()
    finally:
        ENTERED.append("left")


async def test_a_worker_enters_an_agent_block_once_and_leaves_it_when_it_stops():
    # `treadle worker --agent NAME=MODULE:FACTORY` took only factories returning an agent;
    # one returning a block (the agent's model client, opened once) was refused.
    from treadle._cli_fleet import _agent_factory, _served

    ENTERED.clear()
    name, source = _agent_factory("calc=test_cli_fleet:calc_in_a_block")
    assert name == "calc" and ENTERED == []  # made, not yet entered
    async with _served({name: source}) as served:
        assert ENTERED == ["entered"]
        first, second = served["calc"](), served["calc"]()
        assert isinstance(first, treadle.Agent) and first is second
    assert ENTERED == ["entered", "left"]
    plain_name, plain = _agent_factory("calc=test_cli_fleet:calc_agent")
    async with _served({plain_name: plain}) as served:
        assert isinstance(served["calc"](), treadle.Agent)


@pytest.mark.parametrize("command", [["runs"], ["show", "r1"], ["wait", "r1"], ["cancel", "r1"]])
def test_reading_commands_leave_no_tables_in_a_database_without_a_store(
    postgres_database: str, command: list[str]
):
    """`treadle runs --store DSN` created treadle's tables in whatever database it was given."""
    import psycopg

    def tables() -> int:
        with psycopg.connect(postgres_database) as conn:
            row = conn.execute(
                "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'"
            ).fetchone()
            assert row is not None
            return int(row[0])

    out = invoke(*command, "--store", postgres_database)
    assert out.exit_code == 1, out.output
    assert "no treadle store in PostgreSQL" in out.output
    assert "schema 'public' has no treadle tables" in out.output
    assert tables() == 0

    async def create() -> None:  # a worker, `treadle submit` or the API creates them
        async with treadle.open_postgres_store(postgres_database):
            pass

    trio.run(create)
    assert tables() > 0
    listed = invoke("runs", "--store", postgres_database)
    assert listed.exit_code == 0, listed.output


def test_a_worker_tunes_its_collector_for_many_runs(tmp_path: Path):
    """A worker owns its process: its runs see a young-generation threshold of 10,000 and the
    import-time objects frozen (docs/performance.md, "Garbage collection")."""
    db = tmp_path / "runs.db"
    with worker(tmp_path, db, "probe=gc_probe") as (proc, _):
        submitted = cli(tmp_path, "submit", "--store", str(db), "--agent", "probe", "gc?")
        run_id = submitted.stdout.strip()
        waited = cli(tmp_path, "wait", run_id, "--store", str(db), "--poll", "0.1")
        assert waited.returncode == 0, waited.stdout + waited.stderr
        code, _, err = stop(proc)
    assert code == 0, err
    (result,) = [r for r in read_log(db, run_id).records if isinstance(r, ActionResult)]
    assert result.outcome.observation == "threshold 10000, frozen True"


def test_cancel_of_a_jsonl_run_another_process_holds_says_its_lease_goes_with_it(tmp_path: Path):
    directory = tmp_path / "runs"

    async def orphan():
        async with open_jsonl_store(directory) as store:
            with pytest.raises(RuntimeError):
                async with treadle.open_run(calc_agent(), "2+3?", store=store, run_id="h"):
                    raise RuntimeError("the driving program failed")

    trio.run(orphan)
    holder = textwrap.dedent(
        f"""
        import sys, trio
        from treadle.stores.jsonl import open_jsonl_store
        async def main():
            async with open_jsonl_store({str(directory)!r}) as store:
                await store.acquire_lease("h", owner="host-j:77:feed", ttl_s=3600)
                print("held", flush=True)
                await trio.to_thread.run_sync(sys.stdin.read)
        trio.run(main)
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as process:
        try:
            assert process.stdout is not None and process.stdout.readline() == "held\n"
            cancelled = invoke("cancel", "h", "--store", str(directory))
        finally:
            assert process.stdin is not None
            process.stdin.close()
            process.wait(timeout=30)
    assert cancelled.exit_code == 0, cancelled.output
    output = " ".join(cancelled.output.split())
    assert "host-j:77:feed drives the run" in output
    # an OS lock: no TTL to wait when its process is gone
    assert "If that process is gone, its lease went with it" in output
    assert "expires" not in output


def _failing_at_once(*errors: BaseException):
    """A trio program whose tasks raise ``errors`` together (a nursery groups them)."""

    async def go() -> None:
        async def fail(error: BaseException) -> None:
            raise error

        async with trio.open_nursery() as nursery:
            for error in errors:
                nursery.start_soon(fail, error)

    return go


def test_runs_refused_together_print_one_error_with_their_count():
    """Two or more runs refused at once (a table dropped under a worker) printed a raw
    ExceptionGroup traceback of some 110 lines instead of the refusal."""
    import click

    from treadle._cli_common import run_async
    from treadle._exceptions import StoreError, StoreRefused

    refused = 'relation "records" does not exist'
    with pytest.raises(click.ClickException) as alike:
        run_async(_failing_at_once(*[StoreRefused(refused) for _ in range(4)]))
    assert alike.value.message == f"{refused} (4 times)"
    with pytest.raises(click.ClickException) as mixed:
        run_async(_failing_at_once(StoreRefused("a"), StoreError("b"), StoreRefused("a")))
    head, *lines = mixed.value.message.splitlines()
    assert head == "3 errors at once:" and sorted(lines) == ["  a (2 times)", "  b"]
    with pytest.raises(ExceptionGroup):  # a bug among them keeps its traceback
        run_async(_failing_at_once(StoreRefused("a"), ZeroDivisionError("bug")))


@pytest.mark.parametrize(
    ("option", "value", "bound"),
    [
        ("--timeout", "nan", ">= 0"),
        ("--timeout", "-1", ">= 0"),
        ("--poll", "nan", "> 0"),
        ("--poll", "-1", "> 0"),
        ("--poll", "0", "> 0"),  # polled in a busy loop
        ("--poll", "inf", "> 0"),
    ],
)
def test_wait_refuses_a_time_option_out_of_range_as_the_worker_does(
    tmp_path: Path, option: str, value: str, bound: str
):
    """``treadle wait --timeout nan`` (or ``--poll nan``, ``--poll -1``) ended in a trio
    traceback; ``--poll 0`` read the store in a busy loop."""
    db = tmp_path / "runs.db"
    assert (
        invoke("submit", "--store", str(db), "--agent", "nobody", "x", "--run-id", "r").exit_code
        == 0
    )
    waited = invoke("wait", "r", "--store", str(db), option, value)
    assert waited.exit_code == 2, waited.output
    assert f"Invalid value for '{option}': must be a finite number of seconds {bound}" in (
        waited.output
    )
    assert not isinstance(waited.exception, ValueError | TypeError)  # no traceback


@pytest.mark.parametrize("option", ["--claim-poll", "--backoff", "--drain"])
def test_the_workers_time_options_refuse_nan_before_it_starts(tmp_path: Path, option: str):
    db = tmp_path / "runs.db"
    started = invoke("worker", "--store", str(db), "--agent", "calc=calc", option, "nan")
    assert started.exit_code == 2, started.output
    assert f"Invalid value for '{option}': must be a finite number of seconds" in started.output
    assert not db.exists()


def test_unquarantine_of_an_unknown_run_says_there_is_no_such_run(tmp_path: Path):
    db = tmp_path / "runs.db"
    assert invoke("submit", "--store", str(db), "--agent", "calc", "x").exit_code == 0
    missing = invoke("unquarantine", "nosuch", "--store", str(db))
    assert missing.exit_code == 1 and "no run 'nosuch'" in missing.output, missing.output
    assert "not quarantined" not in missing.output


# --------------------------------------------------------------------------- terminal controls

HOSTILE = "ag\x1b]0;PWNED\x07\x1b[2J\x1b[31mRED\u202eevil\x85\x9b2J"
"""Stored text holding an escape sequence, a bidi override and C1 controls."""


def raw_controls(output: str) -> list[str]:
    """The terminal controls ``output`` holds raw: C0 (but newline), DEL, C1, bidi controls."""
    bidi = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
    return [c for c in output if (ord(c) < 32 and c != "\n") or 0x7F <= ord(c) < 0xA0 or c in bidi]


def test_commands_print_a_queued_or_quarantined_runs_stored_text_as_escapes(tmp_path: Path):
    """A queued run's agent name (its only rule: no "=") and a quarantine's reason (naming the
    last driver) reached the terminal raw from show, tail, wait and resume: the escape
    sequence set the window's title and cleared the screen."""
    db = tmp_path / "runs.db"
    submitted = invoke("submit", "--store", str(db), "--agent", HOSTILE, "--run-id", "q", "x")
    assert submitted.exit_code == 0, submitted.output
    quarantine_unstarted(db, "z", owner=HOSTILE)
    for run_id in ("q", "z"):
        said = [
            invoke("show", run_id, "--store", str(db)),
            invoke("show", run_id, "--store", str(db), "--json"),
            invoke("tail", run_id, "--store", str(db), "--no-follow"),
            invoke("wait", run_id, "--store", str(db), "--timeout", "0.3", "--poll", "0.05"),
            invoke("resume", run_id, "--store", str(db), "--agent", "test_cli_fleet:calc_agent"),
        ]
        for n, done in enumerate(said):
            # shown (wait speaks of a quarantined run only)...
            assert "PWNED" in done.output or (run_id, n) == ("q", 3), (run_id, done.output)
            assert raw_controls(done.output) == [], (run_id, done.output)  # ...as escapes
        assert "\\x1b]0;PWNED\\x07" in said[0].output


@treadle.tool(requires_approval=True)
async def note(text: str) -> str:
    """Write a note."""
    return text


def test_approve_echoes_the_call_and_its_edit_as_escapes(tmp_path: Path):
    """`treadle approve` echoed the request's arguments and the edit through JSON, which
    leaves a bidi override and C1 controls (U+0085, U+009B) raw."""
    db = tmp_path / "runs.db"
    agent = treadle.Agent(
        model=ScriptedModel(turns=[call("note", text=HOSTILE, call_id="n1"), say("noted")]),
        executor=treadle.Toolbox([note]),
        parser=treadle.NativeToolCallParser(),
    )
    leave_parked(db, "p", agent)
    edit = json.dumps({"text": f"edited {HOSTILE}"})
    approved = invoke("approve", "p", "--store", str(db), "--edit", edit)
    assert approved.exit_code == 0, approved.output
    assert "edited ag" in approved.output and "note(" in approved.output
    assert raw_controls(approved.output) == [], approved.output
