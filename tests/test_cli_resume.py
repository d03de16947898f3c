"""``treadle resume``: one run or all unfinished runs of a SQLite or JSONL store."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from click.testing import CliRunner

import treadle
from treadle.cli import main
from treadle.ports import ModelClient
from treadle.stores._lines import frame
from treadle.supervisors import run
from treadle.testing.crashdriver import open_store
from treadle.testing.crashes import (
    LEDGER_ENV,
    RUN_INPUT,
    agent_from_environment,
    check_recovered_run,
    make_agent,
    read_ledger,
)
from treadle.testing.faults import CrashingStore, SimulatedCrash
from treadle.types import ModelReply, ModelRequest, RunLog

AGENT = "treadle.testing.crashes:agent_from_environment"


def other_agent() -> treadle.Agent:
    """The scenario with a different system prompt (a different snapshot)."""
    agent = make_agent("unused.ledger")
    return treadle.Agent(
        model=agent.model,
        executor=agent.executor,
        parser=agent.parser,
        model_name=agent.model_name,
        system_prompt="Something else.",
        limits=agent.limits,
    )


def not_an_agent() -> str:
    return "nope"


OPENED: list[str] = []
"""What `agent_in_a_block` did, in order (the CLI runs in this process under CliRunner)."""


class _OpenedClient:
    """A model client usable only inside the block that opened it (as an HTTP client is)."""

    def __init__(self, client: ModelClient) -> None:
        self.client = client
        self.open = True

    async def complete(self, request: ModelRequest, **kwargs: Any) -> ModelReply:
        assert self.open, "the model client was used after its block was left"
        OPENED.append("model called")
        return await self.client.complete(request, **kwargs)


@asynccontextmanager
async def agent_in_a_block() -> AsyncIterator[treadle.Agent]:
    """The scenario's agent, yielded by a block that must stay open while it is used."""
    OPENED.append("entered")
    agent = agent_from_environment()
    client = _OpenedClient(agent.model)
    try:
        yield attrs.evolve(agent, model=client)
    finally:
        client.open = False
        OPENED.append("left")


@asynccontextmanager
async def _beside_a_server(make: Callable[[], treadle.Agent]) -> AsyncIterator[treadle.Agent]:
    """``make()`` from a block that runs a task beside it, as a model server's would."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep_forever)
        yield make()
        nursery.cancel_scope.cancel()


def other_agent_beside_a_server() -> AbstractAsyncContextManager[treadle.Agent]:
    return _beside_a_server(other_agent)


def agent_beside_a_server() -> AbstractAsyncContextManager[treadle.Agent]:
    return _beside_a_server(agent_from_environment)


@asynccontextmanager
async def block_failing_on_entry() -> AsyncIterator[treadle.Agent]:
    raise ConnectionRefusedError("no model server")
    yield  # pragma: no cover


@asynccontextmanager
async def block_failing_on_exit() -> AsyncIterator[treadle.Agent]:
    async with trio.open_nursery():
        yield agent_from_environment()
        raise ConnectionResetError("the model server did not stop cleanly")


@asynccontextmanager
async def block_failing_in_a_nursery_on_entry() -> AsyncIterator[treadle.Agent]:
    async with trio.open_nursery():
        raise ConnectionRefusedError("port 8000 is taken")
    yield  # pragma: no cover


@asynccontextmanager
async def block_of_a_string() -> AsyncIterator[str]:
    yield "nope"


def store_path(tmp_path: Path, kind: str) -> Path:
    return tmp_path / ("runs.db" if kind == "sqlite" else "runs")


def prepare(tmp_path: Path, kind: str, crashes: dict[str, int | None]) -> Path:
    """Run the scenario once per run id, crashing after the given write (None: no crash)."""
    path = store_path(tmp_path, kind)
    ledger = tmp_path / "ledger.jsonl"

    async def go() -> None:
        async with open_store(kind, path) as store:  # type: ignore[arg-type]
            for run_id, crash_at in crashes.items():
                target = (
                    store
                    if crash_at is None
                    else CrashingStore(inner=store, crash_at=crash_at, when="after")
                )
                try:
                    await run(make_agent(ledger), RUN_INPUT, store=target, run_id=run_id)
                except (treadle.RunInterrupted, SimulatedCrash):
                    assert crash_at is not None
                else:
                    assert crash_at is None

    trio.run(go)
    return path


def read_logs(tmp_path: Path, kind: str, run_ids: list[str]) -> list[RunLog]:
    async def go() -> list[RunLog]:
        async with open_store(kind, store_path(tmp_path, kind)) as store:  # type: ignore[arg-type]
            return [await store.read_log(run_id) for run_id in run_ids]

    return trio.run(go)


def baseline(tmp_path: Path) -> RunLog:
    async def go() -> RunLog:
        store = treadle.MemoryStore()
        await run(make_agent(tmp_path / "baseline.ledger"), RUN_INPUT, store=store, run_id="b")
        return await store.read_log("b")

    return trio.run(go)


@pytest.mark.parametrize("kind", ["sqlite", "jsonl"])
def test_resume_one_crashed_run(tmp_path: Path, kind: str) -> None:
    path = prepare(tmp_path, kind, {"r1": 9})
    runner = CliRunner(env={LEDGER_ENV: str(tmp_path / "ledger.jsonl")})
    result = runner.invoke(main, ["resume", "r1", "--store", str(path), "--agent", AGENT, "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.output)
    assert (row["run_id"], row["state"], row["stop_reason"]) == (
        "r1",
        "succeeded",
        "task_completed",
    )
    (log,) = read_logs(tmp_path, kind, ["r1"])
    entries = read_ledger(tmp_path / "ledger.jsonl", run_id="r1")
    assert check_recovered_run(log, entries, baseline(tmp_path)) == []
    again = runner.invoke(main, ["resume", "r1", "--store", str(path), "--agent", AGENT])
    assert again.exit_code == 0, again.output
    assert again.output.strip() == "r1: succeeded (task_completed), 4 steps"
    assert read_ledger(tmp_path / "ledger.jsonl", run_id="r1") == entries  # nothing re-ran


@pytest.mark.parametrize("kind", ["sqlite", "jsonl"])
def test_resume_all_unfinished_runs(tmp_path: Path, kind: str) -> None:
    path = prepare(tmp_path, kind, {"done": None, "a": 5, "b": 14})
    runner = CliRunner(env={LEDGER_ENV: str(tmp_path / "ledger.jsonl")})
    result = runner.invoke(
        main, ["resume", "--all", "--store", str(path), "--agent", AGENT, "--max-concurrent", "1"]
    )
    assert result.exit_code == 0, result.output
    assert sorted(result.output.splitlines()) == [
        "a: succeeded (task_completed), 4 steps",
        "b: succeeded (task_completed), 4 steps",
    ]


@pytest.mark.parametrize("all_runs", [False, True])
def test_the_agent_may_come_from_a_block_kept_open_while_it_drives(
    tmp_path: Path, all_runs: bool
) -> None:
    # An agent whose model client must be opened (as the tutorial's) comes from an async
    # context manager: entered before the run is driven, left after it finished.
    path = prepare(tmp_path, "sqlite", {"r1": 9})
    runner = CliRunner(env={LEDGER_ENV: str(tmp_path / "ledger.jsonl")})
    which = ["--all"] if all_runs else ["r1"]
    OPENED.clear()
    result = runner.invoke(
        main,
        ["resume", *which, "--store", str(path), "--agent", "test_cli_resume:agent_in_a_block"],
    )
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "r1: succeeded (task_completed), 4 steps"
    assert OPENED[0] == "entered" and OPENED[-1] == "left"
    assert "model called" in OPENED  # the resumed steps called the model inside the block
    entries = read_ledger(tmp_path / "ledger.jsonl", run_id="r1")
    (log,) = read_logs(tmp_path, "sqlite", ["r1"])
    assert check_recovered_run(log, entries, baseline(tmp_path)) == []


def test_a_block_failing_on_entry_or_exit_is_one_line_and_the_run_is_reported(
    tmp_path: Path,
) -> None:
    path = prepare(tmp_path, "sqlite", {"r1": 9})
    runner = CliRunner(env={LEDGER_ENV: str(tmp_path / "ledger.jsonl")})
    spec = "test_cli_resume:block_failing_in_a_nursery_on_entry"
    entry = runner.invoke(main, ["resume", "r1", "--store", str(path), "--agent", spec])
    assert entry.exit_code == 1 and "Traceback" not in entry.output
    (line,) = entry.output.strip().splitlines()
    assert line.endswith("returned failed: port 8000 is taken")  # not "Exceptions from Trio..."
    spec = "test_cli_resume:block_failing_on_exit"
    done = runner.invoke(main, ["resume", "r1", "--store", str(path), "--agent", spec])
    assert done.exit_code == 0 and "Traceback" not in done.output
    assert done.stdout.strip() == "r1: succeeded (task_completed), 4 steps"
    assert "leaving what" in done.stderr and "did not stop cleanly" in done.stderr


def test_errors_of_a_run_driven_beside_a_server_are_one_line(tmp_path: Path) -> None:
    # The agent's block runs a nursery (the tutorial's model server): every error of the
    # resume came out of it wrapped in exception groups, as a 60-line traceback.
    path = prepare(tmp_path, "sqlite", {"r1": 9})
    runner = CliRunner(env={LEDGER_ENV: str(tmp_path / "ledger.jsonl")})
    changed = runner.invoke(
        main,
        [
            "resume",
            "r1",
            "--store",
            str(path),
            "--agent",
            "test_cli_resume:other_agent_beside_a_server",
        ],
    )
    assert changed.exit_code == 1 and "Traceback" not in changed.output
    assert "differs from the stored parameter snapshot in: system_prompt" in changed.output
    assert "give --accept-changed-definition" in changed.output  # the way on, named

    async def hold() -> None:
        async with treadle.open_sqlite_store(path) as store:
            await store.acquire_lease("r1", owner="a live driver", ttl_s=600)

    trio.run(hold)
    leased = runner.invoke(
        main,
        ["resume", "r1", "--store", str(path), "--agent", "test_cli_resume:agent_beside_a_server"],
    )
    assert leased.exit_code == 1 and "Traceback" not in leased.output
    (line,) = leased.output.strip().splitlines()
    assert "a live driver" in line and "give --wait" in line


def test_snapshot_mismatch_is_refused_naming_the_keys(tmp_path: Path) -> None:
    path = prepare(tmp_path, "jsonl", {"r1": 9})
    runner = CliRunner()
    result = runner.invoke(
        main, ["resume", "r1", "--store", str(path), "--agent", "test_cli_resume:other_agent"]
    )
    assert result.exit_code == 1
    assert "differs from the stored parameter snapshot in: system_prompt" in result.output
    runner = CliRunner(env={LEDGER_ENV: str(tmp_path / "ledger.jsonl")})
    rest = runner.invoke(main, ["resume", "--all", "--store", str(path), "--agent", AGENT])
    assert rest.exit_code == 0, rest.output  # the refused attempt changed nothing


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["r9", "--agent", AGENT], "no run 'r9'"),
        (["--agent", AGENT], "give a RUN_ID or --all"),
        (["r1", "--all", "--agent", AGENT], "give a RUN_ID or --all"),
        (["r1", "--agent", "nocolon"], "is not MODULE:FACTORY"),
        (["r1", "--agent", "no_such_module:x"], "cannot load no_such_module:x"),
        (["r1", "--agent", "test_cli_resume:not_an_agent"], "gave str, not a treadle.Agent"),
        (["r1", "--agent", "treadle.testing.crashes:make_agent"], "make_agent() failed"),
        (
            ["r1", "--agent", "test_cli_resume:block_failing_on_entry"],
            "entering what test_cli_resume:block_failing_on_entry() returned failed: no model",
        ),
        (
            ["r1", "--agent", "test_cli_resume:block_of_a_string"],
            "gave str, not a treadle.Agent",
        ),
    ],
)
def test_bad_arguments_are_clear_errors(tmp_path: Path, arguments: list[str], message: str) -> None:
    # The agent is loaded only when a run needs driving: r1 is unfinished.
    path = prepare(tmp_path, "sqlite", {"r1": 9})
    runner = CliRunner(env={LEDGER_ENV: str(tmp_path / "ledger.jsonl")})
    result = runner.invoke(main, ["resume", *arguments, "--store", str(path)])
    assert result.exit_code != 0
    assert message in result.output


def test_missing_store_and_missing_ledger_variable(tmp_path: Path) -> None:
    runner = CliRunner(env={LEDGER_ENV: "x"})
    missing = runner.invoke(
        main, ["resume", "r", "--store", str(tmp_path / "nope"), "--agent", AGENT]
    )
    assert missing.exit_code == 1 and "no store at" in missing.output
    path = prepare(tmp_path, "sqlite", {"r1": 9})
    unset = CliRunner(env={LEDGER_ENV: ""}).invoke(
        main, ["resume", "r1", "--store", str(path), "--agent", AGENT]
    )
    assert unset.exit_code != 0 and LEDGER_ENV in unset.output


def test_resume_all_reports_a_damaged_run_and_resumes_the_others(tmp_path: Path) -> None:
    path = prepare(tmp_path, "jsonl", {"good": 9, "bad": 9, "newer": 9})
    bad = path / "bad.jsonl"
    data = bytearray(bad.read_bytes())
    second = data.index(b"\n") + 1
    data[second + 30] ^= 0x01  # a flipped bit in the middle of the run-started line
    bad.write_bytes(bytes(data))
    newer = path / "newer.jsonl"
    _, rest = newer.read_bytes().split(b"\n", 1)
    header = {"format": "treadle.jsonl", "version": 99, "run_id": "newer", "created_ns": 1}
    newer.write_bytes(frame(0, "header", json.dumps(header)) + rest)
    runner = CliRunner(env={LEDGER_ENV: str(tmp_path / "ledger.jsonl")})
    listing = runner.invoke(main, ["runs", "--store", str(path), "--json"])
    assert listing.exit_code == 1  # some runs cannot be read: said by the exit status
    rows = {row["run_id"]: row for row in map(json.loads, listing.stdout.splitlines())}
    assert set(rows) == {"good", "bad", "newer"}  # none hidden
    assert rows["bad"]["error"] and rows["bad"]["where"] == str(bad)
    assert "99" in rows["newer"]["error"] and rows["newer"]["where"] == str(newer)
    result = runner.invoke(main, ["resume", "--all", "--store", str(path), "--agent", AGENT])
    assert result.exit_code == 1
    assert "good: succeeded (task_completed), 4 steps" in result.stdout
    assert "'bad'" in result.stderr and str(bad) in result.stderr
    assert "'newer'" in result.stderr and "99" in result.stderr


def test_a_run_whose_lease_file_cannot_be_read_blocks_no_other_run(tmp_path: Path) -> None:
    """One run's lease file made a directory: `treadle runs` and `resume --all` ended with only
    "cannot read .../bad.lease: not a regular file" and exit 1, the other run not resumed."""
    path = prepare(tmp_path, "jsonl", {"good": 9, "bad": 9})
    sidecar = path / ".leases" / "bad.lease"
    sidecar.unlink(missing_ok=True)
    sidecar.mkdir()
    runner = CliRunner(env={LEDGER_ENV: str(tmp_path / "ledger.jsonl")})
    listing = runner.invoke(main, ["runs", "--store", str(path), "--json"])
    assert listing.exit_code == 1  # one run cannot be read: said by the exit status
    rows = {row["run_id"]: row for row in map(json.loads, listing.stdout.splitlines())}
    assert set(rows) == {"good", "bad"}  # none hidden
    assert rows["good"]["error"] is None and rows["good"]["liveness"] == "orphaned"
    assert "bad.lease" in rows["bad"]["error"] and "not a regular file" in rows["bad"]["error"]
    assert rows["bad"]["state"] == "running"  # its log still says where it stands
    result = runner.invoke(main, ["resume", "--all", "--store", str(path), "--agent", AGENT])
    assert result.exit_code == 1
    assert "good: succeeded (task_completed), 4 steps" in result.stdout
    assert "'bad'" in result.stderr and "bad.lease" in result.stderr


@pytest.mark.parametrize("as_json", [False, True])
def test_resume_all_prints_no_result_for_a_run_whose_resume_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, as_json: bool
) -> None:
    """A full disk at one run's lease file: `resume --all` printed a result for it, "r1:
    unfinished (None), 0 steps" (a JSON object with --json), then its error."""
    import errno

    import treadle.stores.jsonl as jsonl_module

    path = prepare(tmp_path, "jsonl", {"r1": 9, "r2": 9})
    written = jsonl_module.write_sidecar

    def full_for_r1(sidecar: str, *args: Any, **kwargs: Any) -> None:
        if Path(sidecar).name == "r1.lease":
            raise OSError(errno.ENOSPC, "No space left on device")
        written(sidecar, *args, **kwargs)

    monkeypatch.setattr(jsonl_module, "write_sidecar", full_for_r1)
    runner = CliRunner(env={LEDGER_ENV: str(tmp_path / "ledger.jsonl")})
    arguments = ["resume", "--all", "--store", str(path), "--agent", AGENT]
    result = runner.invoke(main, [*arguments, *(["--json"] if as_json else [])])
    assert result.exit_code == 1, result.output
    if as_json:
        (row,) = map(json.loads, result.stdout.splitlines())
        assert (row["run_id"], row["state"]) == ("r2", "succeeded")
    else:
        assert result.stdout.splitlines() == ["r2: succeeded (task_completed), 4 steps"]
    assert "while resuming run 'r1'" in result.stderr and "No space left" in result.stderr


@pytest.mark.parametrize(
    ("which", "agent"),
    [
        ("r1", AGENT),
        ("--all", AGENT),
        ("r1", "tests.test_cli_resume:agent_beside_a_server"),
        ("--all", "tests.test_cli_resume:agent_beside_a_server"),
    ],
)
def test_ctrl_c_during_a_resume_says_the_run_is_left_resumable(
    tmp_path: Path, which: str, agent: str
) -> None:
    # Click printed only "Aborted!". Then `resume --all` printed the traceback of an
    # exception group holding the KeyboardInterrupt and exited 1, as did a resume whose
    # agent came from a block with a nursery of its own (a model server's).
    import os
    import signal
    import subprocess
    import sys
    import time

    from treadle.testing.crashes import LATENCY_ENV

    path = prepare(tmp_path, "sqlite", {"r1": 9})
    root = str(Path(__file__).parent.parent)
    python_path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {
        **os.environ,
        LEDGER_ENV: str(tmp_path / "ledger.jsonl"),
        LATENCY_ENV: "30",
        "PYTHONPATH": python_path,
    }
    command = [sys.executable, "-m", "treadle", "resume", which, "--store", str(path)]
    child = subprocess.Popen(
        [*command, "--agent", agent], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )

    async def driven() -> bool:
        async with treadle.open_sqlite_store(path) as store:
            lease = await store.read_lease("r1")
            return lease is not None and bool(lease.owner)

    deadline = time.monotonic() + 60
    while not trio.run(driven):  # the child holds the run's lease: it is driving it
        assert child.poll() is None and time.monotonic() < deadline, child.communicate()
        time.sleep(0.1)
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 130, (out, err)
    named = b"r1" if which == "r1" else b"what was being resumed"
    assert b"interrupted: " + named + b" is left unfinished and resumable" in err
    assert b"Traceback" not in err


def test_resume_all_reports_a_run_whose_index_row_is_damaged_as_it_resumes_it(
    tmp_path: Path,
) -> None:
    """A damaged state in a SQLite index row: the run's log was whole and `resume --all`
    drove it to its end, tool calls and all, yet said "nothing to resume"."""
    path = prepare(tmp_path, "sqlite", {"r": 9})
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("UPDATE runs SET state = 'sunning' WHERE run_id = 'r'")
        conn.commit()
    runner = CliRunner(env={LEDGER_ENV: str(tmp_path / "ledger.jsonl")})
    result = runner.invoke(main, ["resume", "--all", "--store", str(path), "--agent", AGENT])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ["r: succeeded (task_completed), 4 steps"]


def test_a_run_index_row_without_a_run_id_is_damage_not_an_empty_store(tmp_path: Path) -> None:
    """One flipped bit of the runs page left a row whose run id reads as NULL: `treadle runs`
    showed an empty store and `resume --all` said "nothing to resume" (exit 0) while an
    unfinished run with its payments made sat in the log. Both now fail, naming the damage."""
    path = prepare(tmp_path, "sqlite", {"r": 9})
    with contextlib.closing(sqlite3.connect(path)) as conn:  # damage as a bad page reads
        conn.execute("PRAGMA writable_schema = ON")
        conn.execute(
            "UPDATE sqlite_master SET sql = replace(sql, 'run_id TEXT NOT NULL UNIQUE', "
            "'run_id TEXT UNIQUE') WHERE name = 'runs'"
        )
        conn.commit()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("UPDATE runs SET run_id = NULL WHERE run_id = 'r'")
        conn.commit()
    runner = CliRunner(env={LEDGER_ENV: str(tmp_path / "ledger.jsonl")})
    for command in (["runs"], ["resume", "--all", "--agent", AGENT]):
        result = runner.invoke(main, [*command, "--store", str(path)])
        assert result.exit_code == 1, (command, result.output)
        assert "the run index is damaged: a row has no run id" in result.output, command


def test_a_run_id_changed_in_the_run_index_fails_the_listing_and_resume_all(
    tmp_path: Path,
) -> None:
    """One changed byte made the SQLite index row of the unfinished run 'run-1' read
    'run-k': `treadle runs` listed 'run-k', which `treadle show` said does not exist, and
    exited 0; `resume --all` failed on 'run-k' and never named or resumed 'run-1'. Both now
    fail, naming the damage, and resume nothing."""
    path = prepare(tmp_path, "sqlite", {"run-1": 9})
    (before,) = read_logs(tmp_path, "sqlite", ["run-1"])
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'runs'").fetchone()
        (size,) = conn.execute("PRAGMA page_size").fetchone()
    data = bytearray(path.read_bytes())
    at = data.index(b"run-1", (root - 1) * size, root * size)  # the row, as a damaged page
    data[at + 4] = ord("k")
    path.write_bytes(data)
    runner = CliRunner(env={LEDGER_ENV: str(tmp_path / "ledger.jsonl")})
    for command in (["runs"], ["resume", "--all", "--agent", AGENT]):
        result = runner.invoke(main, [*command, "--store", str(path)])
        assert result.exit_code == 1, (command, result.output)
        assert "the run index is damaged: its row 1 reads run id 'run-k'" in result.output
    assert read_logs(tmp_path, "sqlite", ["run-1"]) == [before]  # nothing resumed


def test_a_schema_text_that_is_not_utf8_is_a_damaged_database_not_a_traceback(
    tmp_path: Path,
) -> None:
    path = prepare(tmp_path, "sqlite", {"r": None})
    data = bytearray(path.read_bytes())
    at = data.index(b"CREATE TABLE runs")
    data[at + 7] = 0xF5  # no UTF-8 byte: the schema's text no longer decodes
    path.write_bytes(bytes(data))
    result = CliRunner().invoke(main, ["runs", "--store", str(path)])
    assert result.exit_code == 1
    assert "the database is damaged" in result.output and "Traceback" not in result.output


def _duplicate_a_middle_line(lines: list[bytes]) -> list[bytes]:
    return [*lines[:3], lines[2], *lines[3:]]


def _swap_the_last_two(lines: list[bytes]) -> list[bytes]:
    return [*lines[:-2], lines[-1], lines[-2]]


def _drop_a_middle_line(lines: list[bytes]) -> list[bytes]:
    return [*lines[:3], *lines[4:]]


def _blank_middle_line(lines: list[bytes]) -> list[bytes]:
    return [*lines[:3], b"", *lines[3:]]


def _nul_line_then_more(lines: list[bytes]) -> list[bytes]:
    return [*lines[:3], b"\0" * 20, *lines[3:]]


@pytest.mark.parametrize(
    "damage",
    [
        _duplicate_a_middle_line,
        _swap_the_last_two,
        _drop_a_middle_line,
        _blank_middle_line,
        _nul_line_then_more,
    ],
)
def test_runs_lists_damage_in_a_jsonl_files_last_64_kib(tmp_path: Path, damage: Any) -> None:
    """docs/crash-safety.md: `treadle runs` lists a run damaged in its last 64 KiB with its
    error and exits 1. It checked each line's checksum but not that the seqs follow, nor
    empty lines or NUL bytes a newline ends: these were listed as healthy runs (exit 0)."""
    path = prepare(tmp_path, "jsonl", {"r": 9})
    file = path / "r.jsonl"
    lines = file.read_bytes().split(b"\n")[:-1]
    file.write_bytes(b"".join(line + b"\n" for line in damage(lines)))
    runner = CliRunner()
    listing = runner.invoke(main, ["runs", "--store", str(path), "--json"])
    assert listing.exit_code == 1, listing.output
    (row,) = map(json.loads, listing.stdout.splitlines())
    assert row["run_id"] == "r" and row["error"] and row["where"] == str(file)
    shown = runner.invoke(main, ["show", "r", "--store", str(path)])
    assert shown.exit_code == 1  # the full read refuses it the same way


def test_resume_of_a_queued_run_says_it_is_queued_and_resume_all_counts_them(tmp_path: Path):
    """`resume` of a queued run said there was no such run, and `resume --all` said every run
    was finished or driven while queued runs waited for a worker."""
    path = tmp_path / "runs.db"
    runner = CliRunner()
    for run_id in ("q1", "q2"):
        submitted = runner.invoke(
            main, ["submit", "--store", str(path), "--agent", "nobody", "--run-id", run_id, "hi"]
        )
        assert submitted.exit_code == 0, submitted.output
    one = runner.invoke(
        main, ["resume", "q1", "--store", str(path), "--agent", "test_cli_resume:other_agent"]
    )
    assert one.exit_code == 1
    assert "run 'q1' has no records to resume: it is queued (agent nobody): a worker" in one.output
    every = runner.invoke(
        main, ["resume", "--all", "--store", str(path), "--agent", "test_cli_resume:other_agent"]
    )
    assert every.exit_code == 0, every.output
    assert "is finished or driven (2 runs queued for a worker)" in every.output


CARD = "4111111111111111"


def approval_agent() -> treadle.Agent:
    """An agent whose one call needs approval; each charge is a line of ``$LEDGER_ENV``."""
    import os

    from treadle.testing.scripted import ScriptedModel, call, say

    @treadle.tool(requires_approval=True, secret_arguments=("card",))
    def charge(amount: int, card: str) -> str:
        """Charge a card."""
        with open(os.environ[LEDGER_ENV], "a", encoding="utf-8") as ledger:
            ledger.write(f"{amount}\n")
        return "charged"

    model = ScriptedModel(turns=[call("charge", amount=12, card=CARD, call_id="c1"), say("done")])
    return treadle.Agent(
        model=model, executor=treadle.Toolbox([charge]), parser=treadle.NativeToolCallParser()
    )


@pytest.mark.parametrize("which", ["r", "--all"])
@pytest.mark.parametrize("left", ["at its approval wait", "before its first step"])
def test_a_resume_that_waits_for_an_approval_says_so_and_goes_on_once_approved(
    tmp_path: Path, which: str, left: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The resume waited in silence: nothing said that the run waits for a decision, nor
    # how to give one. A run left at its wait has its request in the log already (no event
    # of the resume announces it); one left before its first step asks while resumed.
    import os
    import queue
    import subprocess
    import sys
    import threading

    db = str(tmp_path / "runs.db")
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "charges"))

    async def leave() -> None:
        async with (
            treadle.open_sqlite_store(db) as store,
            treadle.open_run(approval_agent(), "pay", store=store, run_id="r") as handle,
        ):
            if left == "at its approval wait":
                await handle.wait_state(treadle.RunState.AWAITING_APPROVAL)
            handle.drain()

    trio.run(leave)
    root = str(Path(__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "treadle", "resume", which, "--store", db]
    child = subprocess.Popen(
        [*command, "--agent", "tests.test_cli_resume:approval_agent"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stderr is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in child.stderr], daemon=True).start()
    try:
        said = lines.get(timeout=60)  # bounds a hang; the line comes once the run waits
    except queue.Empty:
        child.kill()
        raise AssertionError(f"the resume said nothing: {child.communicate()}") from None
    assert said.startswith(
        'r: waiting for approval of charge({"amount": 12, "card": "[redacted]"})'
    )
    assert f"treadle approve r --store {db}" in said and CARD not in said
    assert not (tmp_path / "charges").exists()
    approved = CliRunner().invoke(main, ["approve", "r", "--store", db])
    assert approved.exit_code == 0, approved.output
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0, out
    assert out.strip() == "r: succeeded (final_answer), 2 steps"
    assert (tmp_path / "charges").read_text() == "12\n"  # charged once, after the approval


def _left_at_its_approval(db: str, agent: treadle.Agent, **options: Any) -> str:
    """Drive run ``r`` of ``agent`` on ``db`` to its approval wait and leave it there.

    Returns who drives it then, as ``treadle runs`` says (`driver_text` of its summary).
    """
    from treadle._cli_store import driver_text

    async def leave() -> str:
        async with treadle.open_sqlite_store(db) as store:
            async with treadle.open_run(agent, "pay", store=store, run_id="r", **options) as handle:
                await handle.wait_state(treadle.RunState.AWAITING_APPROVAL)
                handle.drain()
            summary = await store.read_summary("r")
        assert summary is not None
        return driver_text(summary)

    return trio.run(leave)


@pytest.mark.parametrize("which", ["r", "--all"])
def test_a_resume_of_a_run_approved_while_nobody_drove_it_does_not_ask_for_approval(
    tmp_path: Path, which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The decision waits in the control stream (`treadle approve` with no driver); the
    # resume applies it without waiting, yet it said "waiting for approval of charge(...)
    # ... treadle approve r ...", read from the log alone.
    db = str(tmp_path / "runs.db")
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "charges"))

    _left_at_its_approval(db, approval_agent())
    approved = CliRunner().invoke(main, ["approve", "r", "--store", db])
    assert approved.exit_code == 0, approved.output
    agent = "tests.test_cli_resume:approval_agent"
    resumed = CliRunner().invoke(main, ["resume", which, "--store", db, "--agent", agent])
    assert resumed.exit_code == 0, resumed.output
    assert "waiting for approval" not in resumed.stderr
    assert resumed.stdout.strip() == "r: succeeded (final_answer), 2 steps"
    assert (tmp_path / "charges").read_text() == "12\n"


def every_call(tool: str, arguments: Any) -> bool:
    """An approval policy: every call waits for a human."""
    return True


def transfer_agent() -> treadle.Agent:
    """Two transfers, gated by no declaration of their tool; each is a line of ``$LEDGER_ENV``."""
    import os

    from treadle.testing.scripted import ScriptedModel, call, say

    @treadle.tool
    def transfer(amount: int) -> str:
        """Transfer money."""
        with open(os.environ[LEDGER_ENV], "a", encoding="utf-8") as ledger:
            ledger.write(f"{amount}\n")
        return "transferred"

    turns = [
        call("transfer", amount=1, call_id="t1"),
        call("transfer", amount=1000, call_id="t2"),
        say("done"),
    ]
    return treadle.Agent(
        model=ScriptedModel(turns=turns),
        executor=treadle.Toolbox([transfer]),
        parser=treadle.NativeToolCallParser(),
    )


@pytest.mark.parametrize("which", ["r", "--all"])
def test_a_resume_without_the_approval_policy_the_run_was_started_with_is_refused(
    tmp_path: Path, which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Started with `approval_policy=`, left at its first approval, approved: `treadle resume`
    # with the agent's factory (which knows nothing of the policy) ran the approved call,
    # then the second transfer without asking anyone.
    db = str(tmp_path / "runs.db")
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "transfers"))

    _left_at_its_approval(db, transfer_agent(), approval_policy=every_call)
    approved = CliRunner().invoke(main, ["approve", "r", "--store", db])
    assert approved.exit_code == 0, approved.output
    agent = "tests.test_cli_resume:transfer_agent"
    resumed = CliRunner().invoke(main, ["resume", which, "--store", db, "--agent", agent])
    assert resumed.exit_code == 1, resumed.output
    assert f"started under the approval policy '{__name__}:every_call'" in resumed.output
    assert "would run without a human" in resumed.output
    assert not (tmp_path / "transfers").exists()


@pytest.mark.parametrize("which", ["r", "--all"])
def test_a_resume_past_the_approval_deadline_says_the_wait_ended_not_how_to_approve(
    tmp_path: Path, which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Left at its approval wait, resumed after the deadline: the resume said "waiting for
    # approval of charge(...) until <an instant past>: treadle approve r ...", a decision it
    # then refused, and expired the call; `treadle runs` said the run waits for a decision.
    import datetime as dt

    db = str(tmp_path / "runs.db")
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path / "charges"))
    long_ago = treadle.FixedStepClock(start=dt.datetime(2020, 1, 1, tzinfo=dt.UTC))
    left = _left_at_its_approval(db, approval_agent(), clock=long_ago)
    assert left == "nobody: parked (its approval deadline passed)"
    agent = "tests.test_cli_resume:approval_agent"
    resumed = CliRunner().invoke(main, ["resume", which, "--store", db, "--agent", agent])
    assert resumed.exit_code == 0, resumed.output
    assert resumed.stderr.startswith('r: the wait for approval of charge({"amount": 12')
    assert "ended at 2020-01-01T00:15:00" in resumed.stderr
    assert "treadle approve" not in resumed.stderr and "waiting for approval" not in resumed.stderr
    assert resumed.stdout.strip() == "r: succeeded (final_answer), 2 steps"
    assert not (tmp_path / "charges").exists()  # the call expired
