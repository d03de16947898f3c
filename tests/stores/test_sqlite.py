"""SQLite store specifics: WAL, group commit, other processes, failures, cancellation."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from treadle._exceptions import ConflictError, LogCorrupted, SchemaTooNew, StoreError, UsageError
from treadle.stores import SqliteStore, StoreStatistics, _sqlite_commit, open_sqlite_store
from treadle.stores import sqlite as sqlite_module
from treadle.types import (
    ActionIntent,
    ActionOutcome,
    ActionResult,
    ActionStatus,
    CancelRequested,
    DecisionKind,
    ModelIntent,
    ModelResult,
    RunStarted,
    StepRecord,
)

TS = "2025-01-01T00:00:00+00:00"

# A child process's helpers: the same record pattern as `Steps` below, as source text.
CHILD_PRELUDE = """
import json, sys, trio
from treadle.stores import SqliteStore
from treadle.types import *

PATTERN = [ModelIntent, ModelResult, ActionIntent, ActionResult, StepRecord]

def check_prefix(records):
    assert not records or isinstance(records[0], RunStarted), records[:1]
    for i, record in enumerate(records[1:]):
        assert type(record) is PATTERN[i % 5], (i, type(record))
        assert record.step == i // 5 + 1, (i, record.step)
    assert not records or not isinstance(records[-1], ActionResult), "half a step write"
"""


def started(run_id: str) -> RunStarted:
    return RunStarted(run_id=run_id, ts=TS, input=(), snapshot={"k": "v"})


@attrs.define
class Steps:
    """Writes a run as the loop does: per step 2 barriers and 2 non-barrier writes."""

    store: SqliteStore
    run_id: str
    seq: int = 1
    step: int = 0
    body: str = "x"

    async def start(self) -> None:
        await self.store.write_run_started(started(self.run_id), seq=self.seq)
        self.seq += 1

    async def next(self) -> None:
        self.step += 1
        run_id, step = self.run_id, self.step
        mid, aid = f"m{step}", f"a{step}"
        await self.store.write_intent(
            ModelIntent(run_id=run_id, step=step, intent_id=mid, attempt=1, ts=TS), seq=self.seq
        )
        await self.store.write_model_result(
            ModelResult(run_id=run_id, step=step, intent_id=mid, ts=TS), seq=self.seq + 1
        )
        await self.store.write_intent(
            ActionIntent(
                run_id=run_id, step=step, intent_id=aid, call_id="c", tool="t", arguments={}, ts=TS
            ),
            seq=self.seq + 2,
        )
        outcome = ActionOutcome(status=ActionStatus.EXECUTED, observation=self.body)
        result = ActionResult(
            run_id=run_id, step=step, intent_id=aid, call_id="c", tool="t", outcome=outcome, ts=TS
        )
        record = StepRecord(
            run_id=run_id, step=step, ts=TS, model_intent_id=mid, decision=DecisionKind.ACTIONS
        )
        await self.store.write_step([result], record, seq=self.seq + 3)
        self.seq += 5


# --------------------------------------------------------------------------- settings


async def test_wal_mode_and_full_synchronous(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        run = Steps(store, "r")
        await run.start()
        await run.next()
        writer = store._committer._conn  # idle now: every barrier has returned
        assert writer.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        probe = sqlite3.connect(path)
        try:
            assert probe.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            layout = probe.execute("SELECT value FROM meta WHERE key = 'layout'").fetchone()[0]
            assert int(layout) == sqlite_module.LAYOUT_VERSION
        finally:
            probe.close()


async def test_statistics_is_a_frozen_record(tmp_path: Path) -> None:
    async with open_sqlite_store(tmp_path / "s.db") as store:
        stats = store.statistics()
        assert stats == StoreStatistics()
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            stats.commits = 3  # type: ignore[misc]


# --------------------------------------------------------------------------- group commit


async def test_group_commit_batches_100_concurrent_runs(tmp_path: Path) -> None:
    async with open_sqlite_store(tmp_path / "s.db") as store:
        runs = [Steps(store, f"run-{n:03}") for n in range(100)]

        async def drive(run: Steps) -> None:
            await run.start()
            for _ in range(5):
                await run.next()

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for run in runs:
                    nursery.start_soon(drive, run)
        listed = await store.list_runs()  # also waits for the tails to commit
        assert sorted(listed) == [r.run_id for r in runs]
        stats = store.statistics()
        barriers = 100 * 5 * 2
        assert stats.writes_committed == 100 * (1 + 5 * 4)
        assert stats.records_written == 100 * (1 + 5 * 5)
        # One transaction serves many runs: one commit per barrier would be 1000. How many
        # share one depends on scheduling (the committer splits big batches to overlap with
        # trio), so the bound leaves room for a loaded machine.
        assert stats.commits < barriers / 4, stats
        assert stats.max_batch >= 20, stats
        for run in (runs[0], runs[57], runs[-1]):
            log = await store.read_log(run.run_id)
            assert len(log.records) == 26
            assert log.records[-1].step == 5  # type: ignore[union-attr]


async def test_non_barrier_writes_are_committed_by_the_next_barrier(tmp_path: Path) -> None:
    async with open_sqlite_store(tmp_path / "s.db") as store:
        await store.write_run_started(started("r"), seq=1)
        await store.write_model_result(ModelResult(run_id="r", step=1, intent_id="m", ts=TS), seq=2)
        await store.write_intent(
            ModelIntent(run_id="r", step=1, intent_id="m2", attempt=2, ts=TS), seq=3
        )
        stats = store.statistics()
        assert stats.pending == 0
        assert stats.writes_committed == 3
        assert 1 <= stats.commits <= 3


async def test_a_lone_non_barrier_write_commits_after_lingering(tmp_path: Path) -> None:
    async with open_sqlite_store(tmp_path / "s.db") as store:
        await store.write_run_started(started("r"), seq=1)  # no barrier, no reader follows
        assert store.statistics().pending == 1
        for _ in range(1000):  # bounded: 1000 x 10 ms
            if store.statistics().pending == 0:
                break
            await trio.sleep(0.01)
        assert store.statistics().writes_committed == 1


async def test_too_many_pending_writes_make_non_barriers_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_module, "MAX_PENDING_WRITES", 0)
    async with open_sqlite_store(tmp_path / "s.db") as store:
        await store.write_run_started(started("r"), seq=1)
        assert store.statistics().pending == 0  # it waited for its commit
        assert store.statistics().writes_committed == 1


# --------------------------------------------------------------------------- other processes


async def test_another_process_reads_only_committed_prefixes(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    want = 1 + 5 * 300
    script = CHILD_PRELUDE + (
        "async def main(path, want):\n"
        "    store = await SqliteStore.open(path)\n"
        "    print('ready', flush=True)\n"
        "    reads, lengths, last = 0, set(), 0\n"
        "    try:\n"
        "        while last < want:\n"
        "            records = (await store.read_log('r')).records\n"
        "            check_prefix(records)\n"
        "            assert len(records) >= last, 'a committed record disappeared'\n"
        "            last = len(records)\n"
        "            reads += 1\n"
        "            lengths.add(last)\n"
        "    finally:\n"
        "        await store.aclose()\n"
        "    print(json.dumps({'reads': reads, 'lengths': len(lengths)}), flush=True)\n"
        "trio.run(main, sys.argv[1], int(sys.argv[2]))\n"
    )
    async with open_sqlite_store(path) as store:
        run = Steps(store, "r", body="y" * 200)
        await run.start()
        with trio.fail_after(120):
            process, lines = await start_child(script, path, want)
            try:
                assert await lines.next() == "ready"
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(keep_writing, run, nursery.cancel_scope)
                    stats = json.loads(await lines.next())
                    nursery.cancel_scope.cancel(reason="the reader has seen enough")
            finally:
                await process.wait()
                await lines.stream.aclose()
    assert process.returncode == 0
    assert stats["lengths"] > 5, stats  # it read many times while the log grew


async def keep_writing(run: Steps, scope: trio.CancelScope) -> None:
    while not scope.cancel_called:
        await run.next()
        await trio.sleep(0.001)  # pace the writer so the reader sees the log grow


@attrs.define
class Lines:
    """Reads a child's stdout line by line."""

    stream: trio.abc.ReceiveStream
    buffer: bytes = b""

    async def next(self) -> str:
        while b"\n" not in self.buffer:
            chunk = await self.stream.receive_some()
            assert chunk, f"the child closed its stdout; unread: {self.buffer!r}"
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()


async def start_child(script: str, *args: object) -> tuple[trio.Process, Lines]:
    command = [sys.executable, "-c", script, *map(str, args)]
    process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE)
    assert process.stdout is not None
    return process, Lines(process.stdout)


async def test_killed_writer_leaves_every_acknowledged_barrier(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    script = CHILD_PRELUDE + (
        "async def main(path):\n"
        "    store = await SqliteStore.open(path)\n"
        "    await store.write_run_started(RunStarted(run_id='r', ts='t', input=(), "
        "snapshot={}), seq=1)\n"
        "    seq, step = 2, 0\n"
        "    while True:\n"
        "        step += 1\n"
        "        await store.write_intent(ModelIntent(run_id='r', step=step, intent_id='m', "
        "attempt=1, ts='t'), seq=seq)\n"
        "        await store.write_model_result(ModelResult(run_id='r', step=step, "
        "intent_id='m', ts='t'), seq=seq + 1)\n"
        "        await store.write_intent(ActionIntent(run_id='r', step=step, intent_id='a', "
        "call_id='c', tool='t', arguments={}, ts='t'), seq=seq + 2)\n"
        "        print(seq + 2, flush=True)\n"
        "        outcome = ActionOutcome(status=ActionStatus.EXECUTED, observation='o')\n"
        "        result = ActionResult(run_id='r', step=step, intent_id='a', call_id='c', "
        "tool='t', outcome=outcome, ts='t')\n"
        "        record = StepRecord(run_id='r', step=step, ts='t', model_intent_id='m', "
        "decision=None)\n"
        "        await store.write_step([result], record, seq=seq + 3)\n"
        "        seq += 5\n"
        "trio.run(main, sys.argv[1])\n"
    )
    acked = 0
    with trio.fail_after(120):
        process, lines = await start_child(script, path)
        try:
            while acked < 300:
                acked = int(await lines.next())  # this barrier has returned in the child
        finally:
            process.kill()  # SIGKILL: no flush, no close
            await process.wait()
            await lines.stream.aclose()
    assert process.returncode is not None and process.returncode < 0
    async with open_sqlite_store(path) as store:
        records = (await store.read_log("r")).records
    assert len(records) >= acked
    namespace: dict[str, object] = {}
    exec(CHILD_PRELUDE, namespace)  # the same prefix checker the children use
    namespace["check_prefix"](records)  # type: ignore[operator]


async def test_a_second_store_object_conflicts_at_commit(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as a, open_sqlite_store(path) as b:
        await b.write_run_started(started("r"), seq=1)
        await b.write_intent(
            ModelIntent(run_id="r", step=1, intent_id="b", attempt=1, ts=TS), seq=2
        )
        # a learns seq 3 from the database; b still believes 3 is free
        await a.write_intent(
            ModelIntent(run_id="r", step=1, intent_id="a", attempt=2, ts=TS), seq=3
        )
        intent = ModelIntent(run_id="r", step=1, intent_id="b2", attempt=2, ts=TS)
        with pytest.raises(ConflictError) as info:
            await b.write_intent(intent, seq=3)
        assert (info.value.expected, info.value.got) == (4, 3)
        assert isinstance(info.value.__cause__, sqlite3.IntegrityError)
        with pytest.raises(StoreError, match="refuses further writes"):
            await b.write_intent(intent, seq=4)
        log = await a.read_log("r")
        assert [r.intent_id for r in log.records[1:]] == ["b", "a"]  # type: ignore[union-attr]
        await b.write_run_started(started("other"), seq=1)  # other runs are unaffected


async def test_a_conflict_fails_only_its_write_in_a_shared_transaction(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as a, open_sqlite_store(path) as b:
        await b.write_run_started(started("r"), seq=1)
        await b.list_runs()
        await a.write_intent(
            ModelIntent(run_id="r", step=1, intent_id="a", attempt=1, ts=TS), seq=2
        )
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # b's committer gets stuck on its next batch
        outcomes: dict[str, BaseException | None] = {}

        async def attempt(name: str, write: Callable[[], Awaitable[None]]) -> None:
            try:
                await write()
            except StoreError as exc:
                outcomes[name] = exc
            else:
                outcomes[name] = None

        conflicting = ModelIntent(run_id="r", step=1, intent_id="b", attempt=1, ts=TS)
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(attempt, "x", lambda: b.write_control(cancel("x"), seq=1))
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(attempt, "r", lambda: b.write_intent(conflicting, seq=2))
                nursery.start_soon(attempt, "o", lambda: b.write_control(cancel("o"), seq=1))
                for _ in range(1000):  # each first write of a run reads its next seq first
                    if b.statistics().pending == 3:
                        break
                    await trio.sleep(0.005)
                # r and o are queued while the committer is stuck, so they share a transaction
                assert b.statistics().pending == 3
                blocker.execute("COMMIT")
                blocker.close()
        assert outcomes["x"] is None and outcomes["o"] is None
        assert isinstance(outcomes["r"], ConflictError)
        assert (await a.read_log("o")).records == (cancel("o"),)


def cancel(run_id: str) -> CancelRequested:
    return CancelRequested(run_id=run_id, ts=TS, reason="test")


# --------------------------------------------------------------------------- failures


async def test_open_refuses_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="is not a directory"):
        await SqliteStore.open(tmp_path / "nope" / "s.db")


async def test_open_refuses_a_file_as_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError):
        await SqliteStore.open(tmp_path / "file" / "s.db")


async def test_open_refuses_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    path.write_bytes(b"definitely not sqlite " * 100)
    with pytest.raises(StoreError) as info:
        await SqliteStore.open(path)
    assert isinstance(info.value.__cause__, sqlite3.DatabaseError)


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """Make ``directory`` unwritable: mode 0o500, or the immutable flag for root."""
    if os.geteuid() != 0:
        directory.chmod(0o500)
        try:
            yield
        finally:
            directory.chmod(0o700)
        return
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", directory], check=False).returncode:
        pytest.skip("root ignores modes and chattr +i is not available here")
    try:
        yield
    finally:
        subprocess.run([chattr, "-i", directory], check=True)


async def test_open_refuses_a_read_only_directory(tmp_path: Path) -> None:
    directory = tmp_path / "ro"
    directory.mkdir()
    with read_only(directory), pytest.raises(StoreError) as info:
        await SqliteStore.open(directory / "s.db")
    assert isinstance(info.value.__cause__, sqlite3.Error)


async def test_open_refuses_a_newer_layout(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path):
        pass
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'layout'")
    with pytest.raises(SchemaTooNew):
        await SqliteStore.open(path)


@pytest.mark.parametrize(
    "pragmas", [{"synchronous": "OFF"}, {"journal_mode": "DELETE"}, {"x; DROP": 1}, {"a": "1;"}]
)
async def test_forbidden_pragmas(tmp_path: Path, pragmas: dict[str, object]) -> None:
    with pytest.raises(UsageError):
        await SqliteStore.open(tmp_path / "s.db", pragmas=pragmas)  # type: ignore[arg-type]


async def full_store(tmp_path: Path) -> SqliteStore:
    """Opened with at most 100 pages (~400 KB): a 1 MB record makes SQLite's disk full."""
    return await SqliteStore.open(tmp_path / "s.db", pragmas={"max_page_count": 100})


def big_result(run_id: str) -> ModelResult:
    return ModelResult(run_id=run_id, step=1, intent_id="m" * 1_000_000, ts=TS)


async def test_failed_barrier_raises_and_the_run_is_refused(tmp_path: Path) -> None:
    store = await full_store(tmp_path)
    try:
        await store.write_run_started(started("r"), seq=1)
        await store.write_run_started(started("other"), seq=1)
        await store.list_runs()  # both committed: the next transaction holds the big write only
        big = ActionIntent(
            run_id="r", step=1, intent_id="a", call_id="c", tool="t",
            arguments={"blob": "z" * 1_000_000}, ts=TS,
        )  # fmt: skip
        with pytest.raises(StoreError) as info:
            await store.write_intent(big, seq=2)
        assert isinstance(info.value.__cause__, sqlite3.OperationalError)
        assert "full" in str(info.value.__cause__)
        small = ModelIntent(run_id="r", step=1, intent_id="m", attempt=1, ts=TS)
        with pytest.raises(StoreError, match="refuses further writes"):
            await store.write_intent(small, seq=3)
        assert len((await store.read_log("r")).records) == 1  # nothing half-written
        other = ModelIntent(run_id="other", step=1, intent_id="m", attempt=1, ts=TS)
        await store.write_intent(other, seq=2)  # the failure is confined to its run
    finally:
        await store.aclose()  # every failure was reported: no error here


async def test_failed_non_barrier_surfaces_from_the_next_write(tmp_path: Path) -> None:
    store = await full_store(tmp_path)
    try:
        await store.write_run_started(started("r"), seq=1)
        await store.write_model_result(big_result("r"), seq=2)  # returns once queued
        await store.list_runs()  # waits until the queued write's transaction is over
        small = ModelResult(run_id="r", step=1, intent_id="m", ts=TS)
        with pytest.raises(StoreError, match="refuses further writes") as info:
            await store.write_model_result(small, seq=3)
        assert isinstance(info.value.__cause__, StoreError)
        assert isinstance(info.value.__cause__.__cause__, sqlite3.OperationalError)
    finally:
        await store.aclose()


async def test_unreported_failure_is_raised_by_aclose(tmp_path: Path) -> None:
    store = await full_store(tmp_path)
    await store.write_run_started(started("r"), seq=1)
    await store.write_model_result(big_result("r"), seq=2)
    with pytest.raises(StoreError, match=r"failed after returning"):
        await store.aclose()
    await store.aclose()  # reported once; closing again is quiet


async def test_bad_input_is_refused_and_loses_nothing(tmp_path: Path) -> None:
    async with open_sqlite_store(tmp_path / "s.db") as store:
        await store.write_run_started(started("r"), seq=1)
        bad = ActionIntent(
            run_id="r", step=1, intent_id="a", call_id="c", tool="t",
            arguments={"x": object()}, ts=TS,
        )  # fmt: skip
        with pytest.raises(UsageError, match="cannot encode"):
            await store.write_intent(bad, seq=2)
        step = StepRecord(run_id="r", step=1, ts=TS, model_intent_id=None, decision=None)
        foreign = ActionResult(
            run_id="elsewhere", step=1, intent_id="a", call_id="c", tool="t", ts=TS,
            outcome=ActionOutcome(status=ActionStatus.EXECUTED, observation=""),
        )  # fmt: skip
        with pytest.raises(UsageError, match="elsewhere"):
            await store.write_step([foreign], step, seq=2)
        await store.write_step(None, step, seq=2)  # seq 2 is still the next one
        assert len((await store.read_log("r")).records) == 2


def insert_rows(path: Path, rows: list[tuple[str, int, str, str]]) -> None:
    with sqlite3.connect(path) as conn:
        conn.executemany("INSERT INTO records VALUES (?, ?, ?, ?)", rows)


@pytest.mark.parametrize(
    ("row", "offset"),
    [
        (("r", 2, "model_intent", "{not json"), 2),
        (("r", 2, "model_intent", '{"kind":"model_intent","run_id":"r"}'), 2),
        (("r", 2, "step", '{"kind":"cancel_requested","run_id":"r","ts":"t"}'), 2),
        (("r", 3, "cancel_requested", '{"kind":"cancel_requested","run_id":"r","ts":"t"}'), 2),
    ],
    ids=["not-json", "missing-fields", "wrong-kind", "gap"],
)
async def test_corrupt_log_names_the_seq(
    tmp_path: Path, row: tuple[str, int, str, str], offset: int
) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        await store.write_control(CancelRequested(run_id="r", ts=TS), seq=1)
        insert_rows(path, [row])
        with pytest.raises(LogCorrupted) as info:
            await store.read_log("r")
        assert info.value.offset == offset
        assert info.value.where == str(path)


async def test_newer_schema_version_is_refused_on_read(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        body = '{"kind":"run_started","run_id":"r","ts":"t","input":[],"snapshot":{},'
        insert_rows(path, [("r", 1, "run_started", body + '"schema_version":99}')])
        with pytest.raises(SchemaTooNew):
            await store.read_log("r")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
async def test_a_crashed_committer_fails_its_writes_and_refuses_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def bug(self: object, batch: object) -> int:
        raise RuntimeError("a bug in the committer")

    store = await SqliteStore.open(tmp_path / "s.db")
    monkeypatch.setattr(_sqlite_commit.Committer, "_commit", bug)
    with trio.fail_after(10):
        await store.write_run_started(started("r"), seq=1)
        with pytest.raises(StoreError) as info:
            await store.write_intent(
                ModelIntent(run_id="r", step=1, intent_id="m", attempt=1, ts=TS), seq=2
            )
        assert isinstance(info.value.__cause__, RuntimeError)
        with pytest.raises(StoreError):
            await store.write_run_started(started("other"), seq=1)
        await store.aclose()
        await trio.to_thread.run_sync(store._committer._thread.join)  # its error is reported


# --------------------------------------------------------------------------- lifecycle


async def test_cancelled_barrier_still_commits(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        await store.write_run_started(started("r"), seq=1)
        await store.list_runs()  # committed
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # hold the write lock: the commit must wait
        intent = ModelIntent(run_id="r", step=1, intent_id="m", attempt=1, ts=TS)
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:

                async def write() -> None:
                    await store.write_intent(intent, seq=2)
                    raise AssertionError("the barrier returned while the lock was held")

                nursery.start_soon(write)
                await trio.testing.wait_all_tasks_blocked()
                assert store.statistics().pending == 1
                nursery.cancel_scope.cancel(reason="test cancels a waiting barrier")
            blocker.execute("COMMIT")
            blocker.close()
            log = await store.read_log("r")  # waits for the queued barrier
        assert log.records[-1] == intent
        result = ModelResult(run_id="r", step=1, intent_id="m", ts=TS)
        await store.write_model_result(result, seq=3)  # the seq moved on
        assert (await store.read_log("r")).records[-1] == result


async def test_every_operation_is_a_checkpoint(tmp_path: Path) -> None:
    store = await SqliteStore.open(tmp_path / "s.db")
    run = Steps(store, "r")
    with trio.testing.assert_checkpoints():
        await run.start()
    await store.list_runs()
    for write in (
        lambda: store.write_intent(
            ModelIntent(run_id="r", step=1, intent_id="m", attempt=1, ts=TS), seq=2
        ),
        lambda: store.write_model_result(
            ModelResult(run_id="r", step=1, intent_id="m", ts=TS), seq=3
        ),
        lambda: store.write_step(
            None,
            StepRecord(run_id="r", step=1, ts=TS, model_intent_id="m", decision=None),
            seq=4,
        ),
        lambda: store.write_control(cancel("r"), seq=5),
        lambda: store.read_log("r"),
        store.list_runs,
        store.aclose,
        store.aclose,
    ):
        with trio.testing.assert_checkpoints():
            await write()


async def test_aclose_flushes_and_later_calls_raise(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = await SqliteStore.open(path)
    await store.write_run_started(started("r"), seq=1)  # not a barrier
    await store.aclose()
    await store.aclose()
    with pytest.raises(StoreError, match="closed"):
        await store.write_intent(
            ModelIntent(run_id="r", step=1, intent_id="m", attempt=1, ts=TS), seq=2
        )
    with pytest.raises(StoreError, match="closed"):
        await store.read_log("r")
    with pytest.raises(StoreError, match="closed"):
        await store.list_runs()
    async with open_sqlite_store(path) as again:
        assert (await again.read_log("r")).records == (started("r"),)
