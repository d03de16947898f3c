"""SQLite store specifics: WAL, group commit, other processes, leases and fencing, layout 2
(checksummed rows, migration from layout 1, control streams), failures, cancellation."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from treadle._exceptions import (
    ConflictError,
    InvalidRunId,
    LeaseLost,
    LogCorrupted,
    RunLeased,
    SchemaTooNew,
    StoreError,
    TreadleError,
    UsageError,
)
from treadle.stores import SqliteStore, StoreStatistics, _engine, _sql, open_sqlite_store
from treadle.stores import sqlite as sqlite_module
from treadle.stores._codec import KIND_OF, STEP_KINDS, record_crc, record_to_json
from treadle.types import (
    ActionIntent,
    ActionOutcome,
    ActionResult,
    ActionStatus,
    CancelRequested,
    DecisionKind,
    Liveness,
    Message,
    ModelIntent,
    ModelResult,
    Record,
    RunStarted,
    RunState,
    StepRecord,
)

TS = "2025-01-01T00:00:00+00:00"
OWNER = "test-driver"
TTL_S = 600.0
T0 = 1_750_000_000.0  # the injected clocks start here (epoch seconds)

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
class Clock:
    """An injectable store clock (epoch seconds) that only moves when a test moves it."""

    now: float = T0

    def __call__(self) -> float:
        return self.now


async def lease(store: SqliteStore, run_id: str, owner: str = OWNER) -> int:
    """Take the run's lease and return the generation to write with."""
    return (await store.acquire_lease(run_id, owner=owner, ttl_s=TTL_S)).generation


@attrs.define
class Steps:
    """Writes a run as the loop does: per step 2 barriers and 2 non-barrier writes.

    `start` takes the run's lease first (unless a generation is given).
    """

    store: SqliteStore
    run_id: str
    seq: int = 1
    step: int = 0
    body: str = "x"
    generation: int = 0

    async def start(self) -> None:
        if not self.generation:
            self.generation = await lease(self.store, self.run_id)
        await self.store.write_run_started(
            started(self.run_id), seq=self.seq, generation=self.generation
        )
        self.seq += 1

    async def next(self) -> None:
        self.step += 1
        run_id, step, g = self.run_id, self.step, self.generation
        mid, aid = f"m{step}", f"a{step}"
        await self.store.write_intent(
            ModelIntent(run_id=run_id, step=step, intent_id=mid, attempt=1, ts=TS),
            seq=self.seq,
            generation=g,
        )
        await self.store.write_model_result(
            ModelResult(run_id=run_id, step=step, intent_id=mid, ts=TS),
            seq=self.seq + 1,
            generation=g,
        )
        await self.store.write_intent(
            ActionIntent(
                run_id=run_id, step=step, intent_id=aid, call_id="c", tool="t", arguments={}, ts=TS
            ),
            seq=self.seq + 2,
            generation=g,
        )
        outcome = ActionOutcome(status=ActionStatus.EXECUTED, observation=self.body)
        result = ActionResult(
            run_id=run_id, step=step, intent_id=aid, call_id="c", tool="t", outcome=outcome, ts=TS
        )
        record = StepRecord(
            run_id=run_id, step=step, ts=TS, model_intent_id=mid, decision=DecisionKind.ACTIONS
        )
        await self.store.write_step([result], record, seq=self.seq + 3, generation=g)
        self.seq += 5


def intent(run_id: str, intent_id: str, attempt: int = 1) -> ModelIntent:
    return ModelIntent(run_id=run_id, step=1, intent_id=intent_id, attempt=attempt, ts=TS)


# --------------------------------------------------------------------------- settings


async def test_wal_mode_and_full_synchronous(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        run = Steps(store, "r")
        await run.start()
        await run.next()
        writer = store._engine._backend._conn  # idle now: every barrier has returned
        assert writer.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        probe = sqlite3.connect(path)
        try:
            assert probe.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            layout = probe.execute("SELECT value FROM meta WHERE key = 'layout'").fetchone()[0]
            assert int(layout) == _sql.LAYOUT_VERSION == 4
        finally:
            probe.close()


@pytest.mark.parametrize(("pragmas", "cache_size"), [(None, -1024), ({"cache_size": -4096}, -4096)])
async def test_the_writers_page_cache_is_a_mebibyte_unless_the_pragmas_say(
    tmp_path: Path, pragmas: dict[str, int] | None, cache_size: int
) -> None:
    assert sqlite_module.WRITER_PRAGMAS == {"cache_size": -1024}
    async with open_sqlite_store(tmp_path / "s.db", pragmas=pragmas) as store:
        writer = store._engine._backend._conn  # idle: nothing was written
        assert writer.execute("PRAGMA cache_size").fetchone()[0] == cache_size


async def test_lease_writes_skip_their_fsync_and_every_other_write_keeps_it(
    tmp_path: Path,
) -> None:
    """Lease transactions commit with synchronous=NORMAL (docs/decisions/0016): the next FULL
    commit of the log syncs the WAL, their frames with it. The pooled connection is FULL again
    afterwards, so a control append on it (durable on return) still fsyncs."""
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        seen: list[tuple[str, int]] = []
        real = _sql.write_transaction.__enter__

        def enter(self: _sql.write_transaction) -> None:
            real(self)
            seen.append(("in", self._conn.execute("PRAGMA synchronous").fetchone()[0]))

        _sql.write_transaction.__enter__ = enter  # type: ignore[method-assign]
        try:
            lease = await store.acquire_lease("r", owner="o", ttl_s=30)
            await Steps(store, "r", generation=lease.generation).start()
            (lease,) = await store.renew_leases([lease], ttl_s=30)
            await store.release_lease(lease)
            await store.append_control(cancel("r"))
        finally:
            _sql.write_transaction.__enter__ = real  # type: ignore[method-assign]
        assert [level for _, level in seen] == [1, 1, 1, 2]  # NORMAL x3 (leases), FULL
        for conn in store._pool._idle:
            assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2


def columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]


async def test_layout_2_tables_and_checksummed_rows(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        run = Steps(store, "r")
        await run.start()
        await run.next()
        await store.list_runs()  # the step write is committed, not just queued
    with contextlib.closing(sqlite3.connect(path)) as conn:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert tables == {"meta", "runs", "records", "control"}
        assert columns(conn, "records") == ["run_id", "seq", "gen", "kind", "body", "crc"]
        assert columns(conn, "control") == ["run_id", "pos", "kind", "body", "crc"]
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        assert set(meta) == {"layout", "created", "store_id"}
        rows = conn.execute(
            "SELECT run_id, seq, gen, kind, body, crc FROM records ORDER BY seq"
        ).fetchall()
        assert [r[1] for r in rows] == [1, 2, 3, 4, 5, 6]
        assert {r[2] for r in rows} == {run.generation} == {1}  # the writer's generation
        for run_id, seq, gen, kind, body, crc in rows:
            assert crc == record_crc(run_id, seq, gen, kind, bytes(body))
        (row,) = conn.execute(
            "SELECT next_seq, state, steps, lease_owner, lease_generation FROM runs"
        ).fetchall()
        assert row == (7, "running", 1, OWNER, 1)


async def test_statistics_is_a_frozen_record(tmp_path: Path) -> None:
    async with open_sqlite_store(tmp_path / "s.db") as store:
        stats = store.statistics()
        assert stats == StoreStatistics()
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            stats.commits = 3  # type: ignore[misc]
        run = Steps(store, "r")
        await run.start()
        await run.next()
        await store.list_runs()  # the step write is committed, not just queued
        stats = store.statistics()
        assert (stats.writes_committed, stats.records_written, stats.pending) == (5, 6, 0)
        assert stats.syncs == stats.commits  # one durable commit per committed transaction


# --------------------------------------------------------------------------- group commit


async def drive_concurrently(store: SqliteStore, count: int, steps: int) -> list[Steps]:
    """``count`` runs at once, each started and written ``steps`` steps."""
    runs = [Steps(store, f"run-{n:03}") for n in range(count)]

    async def drive(run: Steps) -> None:
        await run.start()
        for _ in range(steps):
            await run.next()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for run in runs:
                nursery.start_soon(drive, run)
    return runs


async def test_group_commit_batches_100_concurrent_runs(tmp_path: Path) -> None:
    async with open_sqlite_store(tmp_path / "s.db") as store:
        runs = await drive_concurrently(store, 100, 5)
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


async def test_a_hundred_runs_starting_at_once_load_in_a_bounded_number_of_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each run's first write loads its head in a worker thread on a pooled connection; the
    # loads share the store's bound with its reads (`_engine.MAX_WORKERS`), or a hundred runs
    # starting at once would load in forty threads, each opening a connection.
    lock = threading.Lock()
    busy = [0, 0]  # now, most at once
    load = _sql.load_head

    def slow_load(*args: Any) -> Any:
        with lock:
            busy[0] += 1
            busy[1] = max(busy)
        try:
            time.sleep(0.02)  # long enough for every waiting load to overlap with this one
            return load(*args)
        finally:
            with lock:
                busy[0] -= 1

    monkeypatch.setattr(_sql, "load_head", slow_load)
    async with open_sqlite_store(tmp_path / "s.db") as store:
        runs = await drive_concurrently(store, 100, 1)
        assert sorted(await store.list_runs()) == [run.run_id for run in runs]
    assert 2 <= busy[1] <= _engine.MAX_WORKERS - _engine.SHARED_WORKERS, busy


async def test_connections_keep_a_bounded_statement_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Group commits make an INSERT per batch size; every connection the store opens (the
    # committer's and the readers') keeps only STATEMENT_CACHE of them prepared
    # (docs/decisions/0094-few-statement-shapes.md).
    caches: list[object] = []
    connect = sqlite3.connect

    def recording(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        caches.append(kwargs.get("cached_statements"))
        return connect(*args, **kwargs)

    monkeypatch.setattr(sqlite_module.sqlite3, "connect", recording)
    async with open_sqlite_store(tmp_path / "s.db") as store:
        runs = await drive_concurrently(store, 60, 4)
        await store.list_runs()  # a reader's connection, and waits for the tails to commit
        assert store.statistics().records_written == 60 * (1 + 4 * 5)
        for run in runs:
            assert len((await store.read_log(run.run_id)).records) == 21
    assert len(caches) >= 2, caches
    assert set(caches) == {sqlite_module.STATEMENT_CACHE}, caches
    assert sqlite_module.STATEMENT_CACHE < 128  # Python's default


def test_in_lists_are_padded_to_a_power_of_two() -> None:
    for n in (1, 2, 3, 5, 8, 9, 100, 512):
        ((marks, params),) = _sql.in_lists([f"r{i}" for i in range(n)])
        size = len(params)
        assert size >= n and size & (size - 1) == 0 and size < 2 * n + 1
        assert marks.count("?") == size
        assert params[:n] == [f"r{i}" for i in range(n)]
        assert set(params[n:]) <= {f"r{n - 1}"}
    assert list(_sql.in_lists([])) == []
    lists = list(_sql.in_lists([f"r{i}" for i in range(_sql.IN_LIST_MAX + 3)]))
    assert [len(params) for _, params in lists] == [_sql.IN_LIST_MAX, 4]
    assert lists[1][1] == [f"r{_sql.IN_LIST_MAX + i}" for i in (0, 1, 2, 2)]


async def test_non_barrier_writes_are_committed_by_the_next_barrier(tmp_path: Path) -> None:
    async with open_sqlite_store(tmp_path / "s.db") as store:
        g = await lease(store, "r")
        await store.write_run_started(started("r"), seq=1, generation=g)
        await store.write_model_result(
            ModelResult(run_id="r", step=1, intent_id="m", ts=TS), seq=2, generation=g
        )
        await store.write_intent(intent("r", "m2", attempt=2), seq=3, generation=g)
        stats = store.statistics()
        assert stats.pending == 0
        assert stats.writes_committed == 3
        assert 1 <= stats.commits <= 3


async def test_a_lone_non_barrier_write_commits_after_lingering(tmp_path: Path) -> None:
    async with open_sqlite_store(tmp_path / "s.db") as store:
        g = await lease(store, "r")
        await store.write_run_started(started("r"), seq=1, generation=g)  # no barrier follows
        assert store.statistics().pending == 1
        for _ in range(1000):  # bounded: 1000 x 10 ms
            if store.statistics().pending == 0:
                break
            await trio.sleep(0.01)
        assert store.statistics().writes_committed == 1


async def test_too_many_pending_writes_make_non_barriers_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_engine, "MAX_PENDING_WRITES", 0)
    async with open_sqlite_store(tmp_path / "s.db") as store:
        g = await lease(store, "r")
        await store.write_run_started(started("r"), seq=1, generation=g)
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
        "    g = (await store.acquire_lease('r', owner='child', ttl_s=600)).generation\n"
        "    await store.write_run_started(RunStarted(run_id='r', ts='t', input=(), "
        "snapshot={}), seq=1, generation=g)\n"
        "    seq, step = 2, 0\n"
        "    while True:\n"
        "        step += 1\n"
        "        await store.write_intent(ModelIntent(run_id='r', step=step, intent_id='m', "
        "attempt=1, ts='t'), seq=seq, generation=g)\n"
        "        await store.write_model_result(ModelResult(run_id='r', step=step, "
        "intent_id='m', ts='t'), seq=seq + 1, generation=g)\n"
        "        await store.write_intent(ActionIntent(run_id='r', step=step, intent_id='a', "
        "call_id='c', tool='t', arguments={}, ts='t'), seq=seq + 2, generation=g)\n"
        "        print(seq + 2, flush=True)\n"
        "        outcome = ActionOutcome(status=ActionStatus.EXECUTED, observation='o')\n"
        "        result = ActionResult(run_id='r', step=step, intent_id='a', call_id='c', "
        "tool='t', outcome=outcome, ts='t')\n"
        "        record = StepRecord(run_id='r', step=step, ts='t', model_intent_id='m', "
        "decision=None)\n"
        "        await store.write_step([result], record, seq=seq + 3, generation=g)\n"
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
        # The dead child's lease lives on in the database until it expires ...
        with pytest.raises(RunLeased) as info:
            await lease(store, "r", owner="resumer")
        assert (info.value.holder.owner, info.value.holder.generation) == ("child", 1)
    assert len(records) >= acked
    namespace: dict[str, object] = {}
    exec(CHILD_PRELUDE, namespace)  # the same prefix checker the children use
    namespace["check_prefix"](records)  # type: ignore[operator]
    # ... and once it has (on the store's clock), a new driver takes the run over.
    async with open_sqlite_store(path, clock=lambda: time.time() + 2 * TTL_S) as store:
        g = await lease(store, "r", owner="resumer")
        assert g == 2
        await store.write_control(cancel("r"), seq=len(records) + 1, generation=g)
        assert (await store.read_log("r")).records == (*records, cancel("r"))


# --------------------------------------------------------------------------- leases and fencing


async def test_a_live_lease_refuses_another_owner_and_bad_run_ids(tmp_path: Path) -> None:
    clock = Clock()
    async with open_sqlite_store(tmp_path / "s.db", clock=clock) as store:
        held = await store.acquire_lease("r", owner="a", ttl_s=10)
        assert (held.owner, held.generation, held.expires_at) == ("a", 1, T0 + 10)
        with pytest.raises(RunLeased) as info:
            await store.acquire_lease("r", owner="b", ttl_s=10)
        assert info.value.holder == held
        clock.now += 5
        again = await store.acquire_lease("r", owner="a", ttl_s=10)  # the holder renews
        assert (again.generation, again.expires_at) == (1, T0 + 15)
        (renewed,) = await store.renew_leases([again], ttl_s=10)
        assert renewed.generation == 1 and await store.read_lease("r") == renewed
        for bad in ("", "a b", "r#control", "ünï", "-r", "x" * 201):
            with pytest.raises(InvalidRunId):
                await store.acquire_lease(bad, owner="a", ttl_s=10)
        assert await store.read_lease("never") is None
        with pytest.raises(LeaseLost) as lost:  # a run without any lease takes no write
            await store.write_intent(intent("never", "m"), seq=1, generation=1)
        assert lost.value.current is None
        assert await store.list_runs() == ()


async def test_a_stale_generation_is_fenced_off_and_stores_nothing(tmp_path: Path) -> None:
    """Driver A's lease expires and B takes the run over: A can write nothing more of it."""
    path = tmp_path / "s.db"
    a_clock, b_clock = Clock(), Clock()
    async with (
        open_sqlite_store(path, clock=a_clock) as a,
        open_sqlite_store(path, clock=b_clock) as b,
    ):
        first = Steps(a, "r")
        await first.start()
        await first.next()
        await a.list_runs()  # A's step write is committed, not just queued
        assert first.generation == 1
        other = Steps(a, "other")
        await other.start()
        held = [await a.read_lease("r"), await a.read_lease("other")]
        with pytest.raises(RunLeased):  # while A's lease is live, B cannot take the run
            await lease(b, "r", owner="b")
        b_clock.now += TTL_S + 1  # on B's clock A's lease has expired (A never renewed it)
        g = await lease(b, "r", owner="b")
        assert g == 2
        renewed = await a.renew_leases([h for h in held if h is not None], ttl_s=TTL_S)
        assert [h.run_id for h in renewed] == ["other"]  # A learns it lost r
        with pytest.raises(LeaseLost) as info:
            await a.write_intent(intent("r", "stale"), seq=first.seq, generation=1)
        assert (info.value.generation, info.value.current) == (1, 2)
        with pytest.raises(LeaseLost):  # and every later write of the run in this store
            await a.write_intent(intent("r", "stale"), seq=first.seq + 1, generation=1)
        await other.next()  # A's other runs are unaffected
        log = await b.read_log("r")
        assert len(log.records) == 6  # nothing of A's stale writes was stored
        await b.write_intent(intent("r", "b"), seq=7, generation=g)  # B goes on from seq 7
        with contextlib.closing(sqlite3.connect(path)) as conn:
            gens = conn.execute("SELECT gen FROM records WHERE run_id = 'r' ORDER BY seq")
            assert [row[0] for row in gens] == [1] * 6 + [2]
        await a.list_runs()  # A's last step write of "other" is committed too
        assert len((await b.read_log("other")).records) == 6


class _HeldBackend(sqlite_module.SqliteBackend):
    """Holds the committer before the batch of generation 1's write at seq 2 until ``go``."""

    commits_here = False
    held = threading.Event()
    go = threading.Event()

    def commit(self, batch: list[_engine.Write]) -> _engine.BatchReport:
        if any(write.generation == 1 and write.seq == 2 for write in batch):
            type(self).held.set()
            type(self).go.wait(30)
        return super().commit(batch)


@pytest.mark.parametrize("early", [False, True], ids=["after", "while-in-flight"])
async def test_a_write_refused_under_an_older_lease_does_not_refuse_the_new_leases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, early: bool
) -> None:
    """A lease taken in a store object while a write of the run's older lease was in flight
    there (a fleet worker claiming a run again as its last drive was cut): the older write's
    refusal (`LeaseLost`, generation 1) was kept for the run and refused every write of the
    new lease, so the run failed again and was taken over once more. ``early``: the new
    lease's first write comes while the older write is still in flight; it waits for it."""
    monkeypatch.setattr(sqlite_module, "SqliteBackend", _HeldBackend)
    monkeypatch.setattr(_HeldBackend, "held", threading.Event())
    monkeypatch.setattr(_HeldBackend, "go", threading.Event())
    clock = Clock()
    refused: list[TreadleError] = []

    async def old_write(store: SqliteStore) -> None:
        try:
            await store.write_intent(intent("r", "old"), seq=2, generation=1)
        except TreadleError as exc:
            refused.append(exc)

    async def new_write(store: SqliteStore) -> None:
        await store.write_intent(intent("r", "new"), seq=2, generation=2)

    async with open_sqlite_store(tmp_path / "s.db", clock=clock) as store:
        assert await lease(store, "r", owner="a") == 1
        await store.write_run_started(started("r"), seq=1, generation=1)
        await store.read_log("r")  # committed, not just queued
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(old_write, store)
                assert await trio.to_thread.run_sync(_HeldBackend.held.wait, 30)
                clock.now += TTL_S + 1  # a's lease expired with its write in flight
                assert await lease(store, "r", owner="b") == 2
                if early:
                    nursery.start_soon(new_write, store)
                    await trio.testing.wait_all_tasks_blocked()
                _HeldBackend.go.set()
        assert [type(exc) for exc in refused] == [LeaseLost]
        if not early:
            await new_write(store)
        await store.write_intent(intent("r", "next"), seq=3, generation=2)
        log = await store.read_log("r")
    assert [r.intent_id for r in log.records[1:]] == ["new", "next"]  # type: ignore[attr-defined]


async def test_a_writer_behind_the_stored_seq_conflicts_at_commit(tmp_path: Path) -> None:
    """Two store objects of the same lease holder: the one behind gets `ConflictError`."""
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as a, open_sqlite_store(path) as b:
        g = await lease(b, "r")
        assert await lease(a, "r") == g  # the same owner: the same lease
        await b.write_run_started(started("r"), seq=1, generation=g)
        await b.write_intent(intent("r", "b"), seq=2, generation=g)
        # a learns seq 3 from the database; b still believes 3 is free
        await a.write_intent(intent("r", "a", attempt=2), seq=3, generation=g)
        late = intent("r", "b2", attempt=2)
        with pytest.raises(ConflictError) as info:
            await b.write_intent(late, seq=3, generation=g)
        assert (info.value.expected, info.value.got) == (4, 3)
        with pytest.raises(StoreError, match="refuses further writes"):
            await b.write_intent(late, seq=4, generation=g)
        log = await a.read_log("r")
        assert [r.intent_id for r in log.records[1:]] == ["b", "a"]  # type: ignore[union-attr]
        g_other = await lease(b, "other")
        await b.write_run_started(started("other"), seq=1, generation=g_other)  # unaffected
        with pytest.raises(ConflictError) as ahead:  # the engine's own check, before commit
            await a.write_intent(late, seq=9, generation=g)
        assert (ahead.value.expected, ahead.value.got) == (4, 9)


async def test_a_writer_that_had_more_records_acknowledged_stops(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        run = Steps(store, "r")
        await run.start()
        await run.next()
        await store.list_runs()  # all six records committed
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
            conn.execute("DELETE FROM records WHERE run_id = 'r' AND seq > 2")
            conn.execute("UPDATE runs SET next_seq = 3 WHERE run_id = 'r'")
        with pytest.raises(StoreError, match="lost acknowledged records") as info:
            await store.write_intent(intent("r", "m2"), seq=7, generation=run.generation)
        assert not isinstance(info.value, ConflictError)
        assert len((await store.read_log("r")).records) == 2  # nothing written after the hole


async def test_a_fenced_write_fails_only_its_run_in_a_shared_transaction(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    a_clock = Clock(now=T0 + TTL_S + 1)  # on a's clock, b's leases have already expired
    async with (
        open_sqlite_store(path, clock=a_clock) as a,
        open_sqlite_store(path, clock=Clock()) as b,
    ):
        gens = {run_id: await lease(b, run_id) for run_id in ("r", "x", "o")}
        await b.write_run_started(started("r"), seq=1, generation=gens["r"])
        await b.list_runs()
        assert await lease(a, "r", owner="a") == gens["r"] + 1  # a takes r over
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # b's committer gets stuck on its next batch
        outcomes: dict[str, BaseException | None] = {}

        async def attempt(name: str, write: Callable[[], Awaitable[None]]) -> None:
            try:
                await write()
            except TreadleError as exc:
                outcomes[name] = exc
            else:
                outcomes[name] = None

        stale = intent("r", "b")
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    attempt, "x", lambda: b.write_control(cancel("x"), seq=1, generation=gens["x"])
                )
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(
                    attempt, "r", lambda: b.write_intent(stale, seq=2, generation=gens["r"])
                )
                nursery.start_soon(
                    attempt, "o", lambda: b.write_control(cancel("o"), seq=1, generation=gens["o"])
                )
                for _ in range(1000):  # each first write of a run reads its next seq first
                    if b.statistics().pending == 3:
                        break
                    await trio.sleep(0.005)
                # r and o are queued while the committer is stuck, so they share a transaction
                assert b.statistics().pending == 3
                blocker.execute("COMMIT")
                blocker.close()
        assert outcomes["x"] is None and outcomes["o"] is None
        assert isinstance(outcomes["r"], LeaseLost)
        assert (await a.read_log("o")).records == (cancel("o"),)
        assert (await a.read_log("r")).records == (started("r"),)


def cancel(run_id: str) -> CancelRequested:
    return CancelRequested(run_id=run_id, ts=TS, reason="test")


# --------------------------------------------------------------------------- control streams


async def test_control_streams_are_per_run_and_never_listed(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        with pytest.raises(UsageError, match="no run"):
            await store.append_control(cancel("r"))
        with pytest.raises(InvalidRunId):
            await store.append_control(cancel("r#control"))
        run = Steps(store, "r")
        await run.start()
        await run.next()
        one = await store.append_control(cancel("r"))
        two = await store.append_control(attrs.evolve(cancel("r"), reason="again"))
        assert (one.run_id, one.position, two.position) == ("r", 1, 2)
        assert await store.read_control("r") == (one, two)
        assert await store.read_control("r", after=1) == (two,)
        assert await store.control_heads(["r", "s", "nope"]) == {"r": 2}
        assert await store.list_runs() == ("r",)
        assert len((await store.read_log("r")).records) == 6  # the log is not touched
    async with open_sqlite_store(path) as store:
        assert await store.read_control("r") == (one, two)  # durable
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute(
            "UPDATE control SET body = CAST(? AS BLOB) WHERE pos = 2", [record_to_json(cancel("r"))]
        )
    async with open_sqlite_store(path) as store:
        with pytest.raises(LogCorrupted, match=r"\(at position 2\)$") as info:
            await store.read_control("r")
        assert info.value.offset == 2


# --------------------------------------------------------------------------- layout 1


V1_SCHEMA = (
    "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
    "CREATE TABLE runs(run_id TEXT PRIMARY KEY)",
    "CREATE TABLE records(run_id TEXT NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL, "
    "body TEXT NOT NULL, PRIMARY KEY (run_id, seq)) WITHOUT ROWID",
    "CREATE TRIGGER first_write AFTER INSERT ON records WHEN NEW.seq = 1 "
    "BEGIN INSERT OR IGNORE INTO runs(run_id) VALUES (NEW.run_id); END",
)


def write_v1(path: Path, logs: list[tuple[str, list[Record]]]) -> None:
    """A store as treadle's layout 1 wrote it (control logs as ``<run_id>#control``)."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        for statement in V1_SCHEMA:
            conn.execute(statement)
        conn.execute("INSERT INTO meta VALUES ('layout', '1')")
        for log_id, records in logs:
            for seq, record in enumerate(records, start=1):
                conn.execute(
                    "INSERT INTO records VALUES (?, ?, ?, ?)",
                    (log_id, seq, KIND_OF[type(record)], record_to_json(record)),
                )


async def test_a_layout_1_store_is_migrated_on_open(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    r_log: list[Record] = [started("r"), intent("r", "m")]
    s_log: list[Record] = [started("s")]
    pseudo = [
        attrs.evolve(cancel("r"), run_id="r#control"),
        attrs.evolve(cancel("r"), run_id="r#control", reason="again"),
    ]
    write_v1(path, [("r", r_log), ("s", s_log), ("r#control", list(pseudo))])
    async with open_sqlite_store(path) as store:
        assert await store.list_runs() == ("r", "s")  # the pseudo-run is no run any more
        assert (await store.read_log("r")).records == tuple(r_log)
        assert (await store.read_log("s")).records == tuple(s_log)
        with pytest.raises(InvalidRunId):  # not a run id: nothing is read
            await store.read_log("r#control")
        entries = await store.read_control("r")
        assert [(e.run_id, e.position) for e in entries] == [("r", 1), ("r", 2)]
        assert [e.record for e in entries] == [
            cancel("r"),
            attrs.evolve(cancel("r"), reason="again"),
        ]
        assert await store.control_heads(["r", "s"]) == {"r": 2}
        summary = await store.read_summary("r")
        assert summary is not None and summary.state is RunState.RUNNING
        assert summary.liveness is Liveness.ORPHANED and summary.lease is None
        g = await lease(store, "r")  # the migrated run is driven on with fencing
        assert g == 1
        await store.write_model_result(
            ModelResult(run_id="r", step=1, intent_id="m", ts=TS), seq=3, generation=g
        )
    with contextlib.closing(sqlite3.connect(path)) as conn:
        layout = conn.execute("SELECT value FROM meta WHERE key = 'layout'").fetchone()
        assert layout == (str(_sql.LAYOUT_VERSION),)
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert tables == {"meta", "runs", "records", "control"}
        gens = [
            r[0] for r in conn.execute("SELECT gen FROM records WHERE run_id = 'r' ORDER BY seq")
        ]
        assert gens == [0, 0, 1]  # migrated rows carry generation 0
    async with open_sqlite_store(path) as store:  # opening again migrates nothing more
        assert len((await store.read_log("r")).records) == 3
        assert len(await store.read_control("r")) == 2


async def test_a_damaged_layout_1_record_is_log_corrupted_on_open(tmp_path: Path) -> None:
    """KNOWN BUG (left failing): the migration lets a bare `json.JSONDecodeError` escape.

    `_migrate_run` decodes every layout-1 record without translating a decode failure, so
    `SqliteStore.open` raises `ValueError` instead of the documented `LogCorrupted`.
    """
    path = tmp_path / "s.db"
    write_v1(path, [("r", [started("r")])])
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("INSERT INTO records VALUES ('r', 2, 'model_intent', '{not json')")
    with pytest.raises(LogCorrupted):
        await SqliteStore.open(path)
    with contextlib.closing(sqlite3.connect(path)) as conn:  # nothing was half-migrated
        assert conn.execute("SELECT value FROM meta WHERE key = 'layout'").fetchone() == ("1",)


# --------------------------------------------------------------------------- failures


async def test_open_refuses_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match=r"the folder .*nope does not exist"):
        await SqliteStore.open(tmp_path / "nope" / "s.db")


async def test_open_refuses_a_file_as_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match=r"file is not a directory"):
        await SqliteStore.open(tmp_path / "file" / "s.db")


async def test_open_refuses_a_directory_as_the_store_file(tmp_path: Path) -> None:
    # SQLite itself says only "unable to open database file"
    with pytest.raises(StoreError, match=r"it is a directory; give the path of a file in it"):
        await SqliteStore.open(tmp_path)
    assert os.listdir(tmp_path) == []


async def test_open_refuses_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    path.write_bytes(b"definitely not sqlite " * 100)
    with pytest.raises(StoreError, match="damaged, or the file is not a SQLite database") as info:
        await SqliteStore.open(path)
    assert isinstance(info.value.__cause__, sqlite3.DatabaseError)
    assert path.read_bytes() == b"definitely not sqlite " * 100  # left as it was
    # the file's own damage has no record offset: the message used to end in "(at offset 0)"
    assert isinstance(info.value, LogCorrupted) and info.value.offset is None
    assert "offset" not in str(info.value)


async def test_open_leaves_another_programs_database_as_it_was(tmp_path: Path) -> None:
    # The refusal came after the store had switched the file to WAL mode and written its
    # header: a reading command changed another program's database.
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    with pytest.raises(StoreError, match=r"other\.db: not a treadle store \(it holds tables"):
        await SqliteStore.open(path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["other.db"]


async def test_open_without_create_leaves_a_database_without_tables_as_it_was(
    tmp_path: Path,
) -> None:
    # `treadle runs` (create=False) laid treadle's tables out in another program's database
    # that held no tables yet, and switched it to WAL mode.
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 7")
    conn.close()
    before = path.read_bytes()
    with pytest.raises(StoreError, match="the SQLite database holds no treadle tables"):
        await SqliteStore.open(path, create=False)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["other.db"]
    with pytest.raises(StoreError, match=r"no store at .*missing\.db: no such file"):
        await SqliteStore.open(tmp_path / "missing.db", create=False)
    assert sorted(os.listdir(tmp_path)) == ["other.db"]
    async with open_sqlite_store(path) as store:  # created by default
        assert await store.list_runs() == ()
    async with open_sqlite_store(path, create=False):  # a store now: opened
        pass


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
    with pytest.raises(SchemaTooNew) as info:
        await SqliteStore.open(path)
    assert f"the table layout of {path}" in str(info.value)
    assert "is at version 99, written by a newer treadle" in str(info.value)


async def test_a_layout_3_store_is_marked_4_when_opened_and_read_as_written(
    tmp_path: Path,
) -> None:
    """A layout-3 treadle refuses rows of record schema 3 only as damage (LogCorrupted), so
    opening its store marks it 4, which it refuses as SchemaTooNew (docs/crash-safety.md,
    "Versions"); no row is rewritten."""
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        run = Steps(store, "r")
        await run.start()
        await run.next()
        written = (await store.read_log("r")).records
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("UPDATE meta SET value = '3' WHERE key = 'layout'")
        rows = conn.execute("SELECT * FROM records ORDER BY run_id, seq").fetchall()
    async with open_sqlite_store(path) as store:
        assert (await store.read_log("r")).records == written
    with contextlib.closing(sqlite3.connect(path)) as conn:
        layout = conn.execute("SELECT value FROM meta WHERE key = 'layout'").fetchone()
        assert conn.execute("SELECT * FROM records ORDER BY run_id, seq").fetchall() == rows
    assert layout == (str(_sql.LAYOUT_VERSION),) == ("4",)


# The step-counting trigger of a layout-3 store written before it became two statements.
_EARLIER_ADVANCE = (
    "CREATE TRIGGER records_advance AFTER INSERT ON records BEGIN UPDATE runs SET next_seq = "
    "NEW.seq + 1, steps = CASE WHEN NEW.kind IN ('{0}', '{1}') THEN steps + 1 ELSE steps END, "
    "state = CASE WHEN NEW.kind IN ('{0}', '{1}') AND state = 'awaiting_child' THEN 'running' "
    "ELSE state END, awaiting_until = CASE WHEN NEW.kind IN ('{0}', '{1}') AND "
    "state = 'awaiting_child' THEN NULL ELSE awaiting_until END WHERE run_id = NEW.run_id; END"
).format(*STEP_KINDS)


async def test_an_earlier_trigger_of_the_same_layout_is_replaced_on_open(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        run = Steps(store, "r")
        await run.start()
        await run.next()
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("DROP TRIGGER records_advance")
        conn.execute(_EARLIER_ADVANCE)
    async with open_sqlite_store(path) as store:
        run.store = store
        await run.next()
        await store.list_runs()  # the step write is committed, not just queued
    with contextlib.closing(sqlite3.connect(path)) as conn:
        (sql,) = conn.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'trigger' AND name = 'records_advance'"
        ).fetchone()
        assert sql == sqlite_module._ADVANCE
        layout = conn.execute("SELECT value FROM meta WHERE key = 'layout'").fetchone()
        assert layout == (str(_sql.LAYOUT_VERSION),)
        row = conn.execute("SELECT next_seq, state, steps FROM runs WHERE run_id = 'r'").fetchone()
        assert row == (12, "running", 2)


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
        g, g_other = await lease(store, "r"), await lease(store, "other")
        await store.write_run_started(started("r"), seq=1, generation=g)
        await store.write_run_started(started("other"), seq=1, generation=g_other)
        await store.list_runs()  # both committed: the next transaction holds the big write only
        big = ActionIntent(
            run_id="r", step=1, intent_id="a", call_id="c", tool="t",
            arguments={"blob": "z" * 1_000_000}, ts=TS,
        )  # fmt: skip
        with pytest.raises(StoreError) as info:
            await store.write_intent(big, seq=2, generation=g)
        assert isinstance(info.value.__cause__, sqlite3.OperationalError)
        assert "full" in str(info.value.__cause__)
        small = intent("r", "m")
        with pytest.raises(StoreError, match="refuses further writes"):
            await store.write_intent(small, seq=3, generation=g)
        assert len((await store.read_log("r")).records) == 1  # nothing half-written
        other = intent("other", "m")
        await store.write_intent(other, seq=2, generation=g_other)  # confined to its run
    finally:
        await store.aclose()  # every failure was reported: no error here


async def test_failed_non_barrier_surfaces_from_the_next_write(tmp_path: Path) -> None:
    store = await full_store(tmp_path)
    try:
        g = await lease(store, "r")
        await store.write_run_started(started("r"), seq=1, generation=g)
        await store.write_model_result(big_result("r"), seq=2, generation=g)  # returns, queued
        await store.list_runs()  # waits until the queued write's transaction is over
        small = ModelResult(run_id="r", step=1, intent_id="m", ts=TS)
        with pytest.raises(StoreError, match="refuses further writes") as info:
            await store.write_model_result(small, seq=3, generation=g)
        assert isinstance(info.value.__cause__, StoreError)
        assert isinstance(info.value.__cause__.__cause__, sqlite3.OperationalError)
    finally:
        await store.aclose()


async def test_a_barrier_queued_behind_its_runs_failed_write_names_that_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A full disk fails the batch holding run-started (a write that does not wait); the
    # run's next write, a barrier, is queued before the trio side learns of it. It must be
    # refused with that failure as cause, never reach the database, where the missing seq 1
    # looked like records the store had lost.
    took, release = threading.Event(), threading.Event()
    original = sqlite_module.SqliteBackend.commit
    failure = StoreError("disk I/O error (injected)")

    def commit(this: object, batch: list[_engine.Write]) -> object:
        if any(w.run_id == "r" and w.seq == 1 for w in batch):
            took.set()
            release.wait(10)
            _engine.fail_writes(batch, failure)
            return _engine.NOTHING_COMMITTED
        return original(this, batch)

    monkeypatch.setattr(sqlite_module.SqliteBackend, "commit", commit)
    async with open_sqlite_store(tmp_path / "s.db") as store:
        g = await lease(store, "r")
        await store.write_run_started(started("r"), seq=1, generation=g)  # returns at once
        await trio.to_thread.run_sync(took.wait, 10)  # the committer holds it
        refused: list[BaseException] = []

        async def barrier() -> None:
            try:
                await store.write_intent(intent("r", "m1"), seq=2, generation=g)
            except TreadleError as exc:
                refused.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(barrier)
            await trio.testing.wait_all_tasks_blocked()  # queued behind the failing batch
            release.set()
        assert len(refused) == 1, refused
        assert "an earlier write of this run failed" in str(refused[0]), refused
        assert refused[0].__cause__ is failure
        assert (await store.read_log("r")).records == ()


async def test_unreported_failure_is_raised_by_aclose(tmp_path: Path) -> None:
    store = await full_store(tmp_path)
    g = await lease(store, "r")
    await store.write_run_started(started("r"), seq=1, generation=g)
    await store.write_model_result(big_result("r"), seq=2, generation=g)
    with pytest.raises(StoreError, match=r"failed after returning"):
        await store.aclose()
    await store.aclose()  # reported once; closing again is quiet


async def test_an_unreported_failure_does_not_fail_the_runs_next_drive(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A write failed after its driver stopped waiting (its lease was lost meanwhile, its
    drive cut): the error was kept, so the run's next drive through the same store object
    failed at once ("an earlier write of this run failed"), long after the cause had gone,
    and `aclose` failed after it."""
    store = await full_store(tmp_path)
    held = await store.acquire_lease("r", owner=OWNER, ttl_s=TTL_S)
    g = held.generation
    await store.write_run_started(started("r"), seq=1, generation=g)
    await store.write_model_result(big_result("r"), seq=2, generation=g)  # queued; it fails
    assert (await store.read_log("r")).records == ()  # its batch failed: nothing is there
    await store.release_lease(held)  # the drive ends, told nothing
    assert "failed after its driver stopped waiting" in caplog.text
    again = await lease(store, "r")
    await store.write_run_started(started("r"), seq=1, generation=again)
    await store.write_intent(intent("r", "m1"), seq=2, generation=again)
    assert [type(r).__name__ for r in (await store.read_log("r")).records] == [
        "RunStarted",
        "ModelIntent",
    ]
    await store.aclose()  # nothing is left unreported


async def test_bad_input_is_refused_and_loses_nothing(tmp_path: Path) -> None:
    async with open_sqlite_store(tmp_path / "s.db") as store:
        g = await lease(store, "r")
        await store.write_run_started(started("r"), seq=1, generation=g)
        bad = ActionIntent(
            run_id="r", step=1, intent_id="a", call_id="c", tool="t",
            arguments={"x": object()}, ts=TS,
        )  # fmt: skip
        with pytest.raises(UsageError, match="cannot encode"):
            await store.write_intent(bad, seq=2, generation=g)
        step = StepRecord(run_id="r", step=1, ts=TS, model_intent_id=None, decision=None)
        foreign = ActionResult(
            run_id="elsewhere", step=1, intent_id="a", call_id="c", tool="t", ts=TS,
            outcome=ActionOutcome(status=ActionStatus.EXECUTED, observation=""),
        )  # fmt: skip
        with pytest.raises(UsageError, match="elsewhere"):
            await store.write_step([foreign], step, seq=2, generation=g)
        await store.write_step(None, step, seq=2, generation=g)  # seq 2 is still the next one
        assert len((await store.read_log("r")).records) == 2


Row = tuple[str, int, str, bytes]


def insert_rows(path: Path, rows: list[Row], *, generation: int = 1) -> None:
    """Insert record rows behind the store's back (its triggers off), each with a good checksum."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("DROP TRIGGER records_fence")
        conn.execute("DROP TRIGGER records_advance")
        conn.executemany(
            "INSERT INTO records(run_id, seq, gen, kind, body, crc) VALUES (?, ?, ?, ?, ?, ?)",
            [
                (
                    run_id,
                    seq,
                    generation,
                    kind,
                    body,
                    record_crc(run_id, seq, generation, kind, body),
                )
                for run_id, seq, kind, body in rows
            ],
        )
        for statement in sqlite_module._TRIGGERS:
            conn.execute(statement)


@pytest.mark.parametrize(
    ("row", "offset", "message"),
    [
        (("r", 2, "model_intent", b"{not json"), 2, "does not decode"),
        (("r", 2, "model_intent", b'{"kind":"model_intent","run_id":"r"}'), 2, "does not decode"),
        (
            ("r", 2, "step", b'{"kind":"cancel_requested","run_id":"r","ts":"t"}'),
            2,
            "a cancel_requested record stored as step",
        ),
        (
            (
                "r",
                2,
                "model_intent",
                b'{"kind":"model_intent","run_id":"x","step":1,'
                b'"intent_id":"i","attempt":1,"ts":"t"}',
            ),
            2,
            "a record of run 'x'",
        ),
        (
            ("r", 3, "cancel_requested", b'{"kind":"cancel_requested","run_id":"r","ts":"t"}'),
            2,
            "seq 2 is missing",
        ),
        # the compact encoding (layout 3)
        (("r", 2, "mi", b'["mi",1'), 2, "does not decode"),
        (("r", 2, "mi", b'["mi",1,1]'), 2, "at least length 4"),
        (
            ("r", 2, "mi", b'["mi",1,1,"t",null,false,"more"]'),
            2,
            "Expected `array` of at most length",
        ),
        (("r", 2, "mi", b'["mi","one",1,"t"]'), 2, r"Expected `int`, got `str` - at `\$\[1\]`"),
        (("r", 2, "mi", b'["mi",-1,1,"t"]'), 2, None),  # a decodable record: no damage
        (("r", 2, "st", b'["cr","t"]'), 2, "Invalid value 'cr'"),
        (("r", 2, "zz", b'["zz","t"]'), 2, "'zz' is not a tag of either encoding"),
        (("r", 2, "mr", b'["mr",1,-1,"t"]'), 2, "Expected `int` >= 0"),
        (("r", 2, "mi", b'{"kind":"model_intent"}'), 2, "Expected `array`, got `object`"),
    ],
    ids=[
        "not-json",
        "missing-fields",
        "wrong-kind",
        "another-run",
        "gap",
        "compact-not-json",
        "compact-missing-fields",
        "compact-extra-fields",
        "compact-wrong-type",
        "compact-ok",
        "compact-wrong-tag",
        "compact-unknown-tag",
        "compact-negative-intent-number",
        "compact-tag-with-an-object",
    ],
)
async def test_corrupt_log_names_the_seq(
    tmp_path: Path, row: Row, offset: int, message: str | None
) -> None:
    """A row whose checksum holds but whose body does not decode as its tag says (a writer's
    bug, or a forged row) is refused, naming its seq, in either encoding."""
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        g = await lease(store, "r")
        await store.write_control(cancel("r"), seq=1, generation=g)
        await store.list_runs()
        insert_rows(path, [row])
        if message is None:
            (_, second) = (await store.read_log("r")).records
            assert second == ModelIntent(
                run_id="r", step=-1, intent_id="r/s-1/m1", attempt=1, ts="t"
            )
            return
        with pytest.raises(LogCorrupted, match=message) as info:
            await store.read_log("r")
        assert info.value.offset == offset
        assert info.value.where == store.description == f"SQLite store {path}"
        # a seq, said as one: "offset" is a file's byte offset (the JSONL store's)
        assert info.value.unit == "seq" and str(info.value).endswith(f"(at seq {offset})")


@pytest.mark.parametrize(
    "damage",
    [
        "UPDATE records SET body = CAST(replace(CAST(body AS TEXT), ',1,', ',2,') AS BLOB)",
        "UPDATE records SET gen = gen + 1",
        "UPDATE records SET kind = 'mr'",
        "UPDATE records SET crc = (crc + 1) % 4294967296",
    ],
    ids=["body", "generation", "kind", "crc"],
)
async def test_a_changed_row_fails_its_checksum(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        run = Steps(store, "r")
        await run.start()
        await run.next()
        await store.list_runs()
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
            (changed,) = conn.execute(
                "SELECT seq FROM records WHERE run_id = 'r' AND kind = 'mi'"
            ).fetchone()
            cursor = conn.execute(f"{damage} WHERE run_id = 'r' AND seq = ?", (changed,))
            assert cursor.rowcount == 1
        with pytest.raises(
            LogCorrupted, match=r"record 2 fails its checksum \(at seq 2\)$"
        ) as info:
            await store.read_log("r")
        assert info.value.offset == changed == 2
        with pytest.raises(LogCorrupted):  # another store object sees the same damage
            async with open_sqlite_store(path) as again:
                await again.read_log("r")


async def test_records_the_run_row_counts_must_all_be_there(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        run = Steps(store, "r")
        await run.start()
        await run.next()
        await store.list_runs()
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
            conn.execute("DELETE FROM records WHERE run_id = 'r' AND seq >= 5")
        with pytest.raises(LogCorrupted, match=r"records 5 to 6 are missing \(at seq 5\)$") as info:
            await store.read_log("r")
        assert info.value.offset == 5


@pytest.mark.parametrize("value", ["'x'", "0", "2.5"])
async def test_a_damaged_next_seq_is_log_corrupted_not_a_python_error(
    tmp_path: Path, value: str
) -> None:
    """A damaged page left NULL in a run's next_seq: reading or resuming the run raised
    TypeError from int() (a traceback from `treadle show`), and a write checked it raw."""
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        run = Steps(store, "r")
        await run.start()
        await store.list_runs()
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
            conn.execute(f"UPDATE runs SET next_seq = {value} WHERE run_id = 'r'")
        with pytest.raises(LogCorrupted, match="its index row is damaged"):
            await store.read_log("r")
        with pytest.raises(LogCorrupted, match="its index row is damaged"):
            await run.next()  # the writer's check of the row


def change_in_page(path: Path, name: str, old: bytes, new: bytes) -> None:
    """Change ``old`` to ``new`` (as long) in the page of table or index ``name``, as a damaged
    page reads: no SQL, no constraint or index kept in step.

    ``path`` is a closed database whose WAL is checkpointed first; ``name`` must fit one page,
    holding ``old`` once.
    """
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (root,) = conn.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = ?", (name,)
        ).fetchone()
        (size,) = conn.execute("PRAGMA page_size").fetchone()
    data = bytearray(path.read_bytes())
    page = data[(root - 1) * size : root * size]
    assert page.count(old) == 1 and len(new) == len(old)
    at = (root - 1) * size + page.index(old)
    data[at : at + len(old)] = new
    path.write_bytes(data)


@pytest.mark.parametrize(
    ("name", "old", "new"),
    [
        ("runs", b"run-a1", b"run-a7"),  # a run id no run has
        ("runs", b"run-a1", b"run-b2"),  # another run's
        ("runs", b"run-q3", b"run-q9"),  # a queued run's: no log to hold it
        ("sqlite_autoindex_runs_1", b"run-a1", b"run-a0"),  # the index's copy
    ],
    ids=["row", "row-as-another-run", "queued-row", "index"],
)
async def test_a_changed_byte_in_a_run_id_of_the_index_fails_every_listing(
    tmp_path: Path, name: str, old: bytes, new: bytes
) -> None:
    """One changed byte in a run id of the runs table (a damaged page) went unnoticed: the
    listing showed a run that does not exist (`treadle show` found no such run) in place of
    an unfinished one, which `treadle resume --all` never resumed, and exited 0."""
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        for run_id in ("run-a1", "run-b2"):
            run = Steps(store, run_id)
            await run.start()
            await run.next()
        await store.submit("run-q3", agent="a", input=(Message(role="user", content="hi"),))
        assert len(await store.list_summaries()) == 3
    change_in_page(path, name, old, new)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() != [("ok",)]
    damaged = "the run index is damaged: its row [123] reads run id 'run-"
    async with open_sqlite_store(path) as store:
        listings: list[Callable[[], Awaitable[object]]] = [store.list_summaries, store.count_runs]
        if name != "runs" or old != b"run-q3":  # a queued run has no records to list
            listings.append(store.list_runs)
        for listing in listings:
            with pytest.raises(LogCorrupted, match=damaged):
                await listing()


async def test_a_lease_expiry_no_clock_can_show_still_names_the_holder(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        await Steps(store, "r").start()
        await store.list_runs()
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
            conn.execute(
                "UPDATE runs SET lease_owner = 'other', lease_generation = 9, "
                "lease_expires = 1e300 WHERE run_id = 'r'"
            )
        with pytest.raises(RunLeased, match=r"driven by other .*not a time this machine"):
            await store.acquire_lease("r", owner="me", ttl_s=15)


async def test_newer_schema_version_is_refused_on_read(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        body = b'{"kind":"run_started","run_id":"r","ts":"t","input":[],"snapshot":{},'
        insert_rows(path, [("r", 1, "run_started", body + b'"schema_version":99}')])
        with pytest.raises(SchemaTooNew):
            await store.read_log("r")


async def test_a_new_store_on_a_full_disk_says_the_disk_is_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Laying out a new store on a nearly full disk failed with "cannot rollback - no
    transaction is active": SQLite had rolled back already, and the ROLLBACK made after
    its "database or disk is full" hid it."""

    class FullAtCommit(sqlite3.Connection):
        def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
            if sql == "COMMIT":  # SQLite rolls back on its own when the disk is full
                super().execute("ROLLBACK")
                raise sqlite3.OperationalError("database or disk is full")
            return super().execute(sql, *args)

    def connect(path: str, *, uri: bool = False) -> sqlite3.Connection:
        return sqlite3.connect(
            path, isolation_level=None, check_same_thread=False, uri=uri, factory=FullAtCommit
        )

    monkeypatch.setattr(sqlite_module, "_connect", connect)
    with pytest.raises(StoreError, match="database or disk is full") as info:
        async with open_sqlite_store(tmp_path / "s.db"):
            pass
    assert "no transaction" not in str(info.value)
    assert isinstance(info.value.__cause__, sqlite3.OperationalError)


async def test_a_folder_unreadable_for_a_moment_fails_a_batch_and_the_store_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's folder made unreadable for 2 s stopped the committer with the raw
    PermissionError of its look at the files: every run stopped, and a worker exited 1."""
    monkeypatch.setattr(sqlite_module, "FILE_CHECK_INTERVAL_S", 0.0)  # check before every commit
    path = tmp_path / "s.db"
    unreadable = [False]
    stat = os.stat

    def refusing_stat(name: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if unreadable[0] and str(name).startswith(str(path)):
            raise PermissionError(13, "Permission denied", str(name))
        return stat(name, *args, **kwargs)

    async with open_sqlite_store(path) as store:
        run = Steps(store, "r")
        await run.start()
        monkeypatch.setattr(os, "stat", refusing_stat)
        unreadable[0] = True
        with pytest.raises(StoreError, match="Permission denied") as info:
            await run.next()
        assert isinstance(info.value.__cause__, PermissionError)
        unreadable[0] = False
        held = await store.read_lease("r")
        assert held is not None
        await store.release_lease(held)
        again = Steps(store, "r", generation=await lease(store, "r", owner="next"))
        await again.start()  # the next drive (the failed batch held the run-started record)
        await again.next()
        other = Steps(store, "other")
        await other.start()
        await other.next()
        assert len((await store.read_log("r")).records) == again.seq - 1


@pytest.mark.parametrize("how", ["removed", "replaced", "wal-removed"])
async def test_a_database_removed_or_replaced_while_open_stops_the_writer(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_module, "FILE_CHECK_INTERVAL_S", 0.0)  # check before every commit
    path = tmp_path / "s.db"
    store = await SqliteStore.open(path)
    try:
        run, other = Steps(store, "r"), Steps(store, "other")
        await run.start()
        await run.next()
        await other.start()
        await store.list_runs()
        if how == "removed":
            os.unlink(path)
        elif how == "replaced":
            async with open_sqlite_store(tmp_path / "new.db"):
                pass
            os.replace(tmp_path / "new.db", path)
        else:
            os.unlink(f"{path}-wal")
        with pytest.raises(StoreError, match="removed or replaced") as info:
            await run.next()
        assert not isinstance(info.value, ConflictError | LogCorrupted)
        with pytest.raises(StoreError, match="removed or replaced"):  # every run stops
            await other.next()
    finally:
        await store.aclose()  # both failures were reported


async def test_reads_of_a_removed_database_fail_and_never_make_an_empty_one(
    tmp_path: Path,
) -> None:
    """A console serving a store whose file was deleted answered from new, empty databases
    its reads had made at the store's path (and their errors said "no such table")."""
    path = tmp_path / "s.db"
    store = await SqliteStore.open(path)
    try:
        run = Steps(store, "r")
        await run.start()
        for name in (path, f"{path}-wal", f"{path}-shm"):
            os.unlink(name)
        await store.list_summaries()  # a kept connection still reads the removed file
        dialect = sqlite_module.SqliteDialect(str(path), time.time)
        with pytest.raises(sqlite3.OperationalError, match="unable to open database file"):
            dialect.connect()  # what a read opens when it needs one more connection
        assert not path.exists()
    finally:
        with pytest.raises(StoreError, match="failed after returning"):  # r's last write
            await store.aclose()


async def test_the_files_are_checked_at_most_every_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(sqlite_module, "_monotonic", lambda: now[0])
    path = tmp_path / "s.db"
    store = await SqliteStore.open(path)
    try:
        run = Steps(store, "r")
        await run.start()
        await run.next()  # checked here: the clock has not moved since
        os.unlink(path)
        now[0] += sqlite_module.FILE_CHECK_INTERVAL_S / 2
        await run.next()  # inside the interval: not checked, committed to the removed file
        now[0] += sqlite_module.FILE_CHECK_INTERVAL_S
        with pytest.raises(StoreError, match="removed or replaced"):
            await run.next()
    finally:
        await store.aclose()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
async def test_a_crashed_committer_fails_its_writes_and_refuses_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def bug(self: object, batch: object) -> object:
        raise RuntimeError("a bug in the committer")

    # the run-started write lingers until the barrier takes it along (never alone)
    monkeypatch.setattr(_engine, "LINGER_S", 3600.0)
    store = await SqliteStore.open(tmp_path / "s.db")
    g, g_other = await lease(store, "r"), await lease(store, "other")
    monkeypatch.setattr(sqlite_module.SqliteBackend, "commit", bug)
    with trio.fail_after(10):
        await store.write_run_started(started("r"), seq=1, generation=g)
        with pytest.raises(StoreError) as info:
            await store.write_intent(intent("r", "m"), seq=2, generation=g)
        assert isinstance(info.value.__cause__, RuntimeError)
        assert "a bug in the committer" in str(info.value)
        with pytest.raises(StoreError):  # refused at once, or failed when the thread stops
            await store.write_intent(intent("other", "m"), seq=1, generation=g_other)
        await store.aclose()  # every failure was reported
        await trio.to_thread.run_sync(store._engine._committer._thread.join)  # it stopped
        assert not store._engine._committer._thread.is_alive()


# --------------------------------------------------------------------------- lifecycle


async def test_cancelled_barrier_still_commits(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with open_sqlite_store(path) as store:
        g = await lease(store, "r")
        await store.write_run_started(started("r"), seq=1, generation=g)
        await store.list_runs()  # committed
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # hold the write lock: the commit must wait
        barrier = intent("r", "m")
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:

                async def write() -> None:
                    await store.write_intent(barrier, seq=2, generation=g)
                    raise AssertionError("the barrier returned while the lock was held")

                nursery.start_soon(write)
                await trio.testing.wait_all_tasks_blocked()
                assert store.statistics().pending == 1
                nursery.cancel_scope.cancel(reason="test cancels a waiting barrier")
            blocker.execute("COMMIT")
            blocker.close()
            log = await store.read_log("r")  # waits for the queued barrier
        assert log.records[-1] == barrier
        result = ModelResult(run_id="r", step=1, intent_id="m", ts=TS)
        await store.write_model_result(result, seq=3, generation=g)  # the seq moved on
        assert (await store.read_log("r")).records[-1] == result


async def test_every_operation_but_a_queued_write_is_a_checkpoint(tmp_path: Path) -> None:
    """docs/seams.md, "Run store": a non-barrier write returns without a turn of the
    scheduler; every other operation is a schedule point."""
    store = await SqliteStore.open(tmp_path / "s.db")
    run = Steps(store, "r")
    with trio.testing.assert_checkpoints():
        await run.start()
    await store.list_runs()
    g = run.generation
    held = await store.read_lease("r")
    assert held is not None
    with trio.testing.assert_checkpoints():
        await store.write_intent(intent("r", "m"), seq=2, generation=g)
    task = trio.lowlevel.current_task()
    cancel_points, schedule_points = task._cancel_points, task._schedule_points
    await store.write_model_result(
        ModelResult(run_id="r", step=1, intent_id="m", ts=TS), seq=3, generation=g
    )
    await store.write_step(
        None,
        StepRecord(run_id="r", step=1, ts=TS, model_intent_id="m", decision=None),
        seq=4,
        generation=g,
    )
    # each checked for a cancel, neither yielded
    assert (task._cancel_points - cancel_points, task._schedule_points) == (2, schedule_points)
    for operation in (
        lambda: store.write_control(cancel("r"), seq=5, generation=g),
        lambda: store.read_log("r"),
        store.list_runs,
        store.list_summaries,
        lambda: store.read_summary("r"),
        lambda: store.acquire_lease("r", owner=OWNER, ttl_s=TTL_S),
        lambda: store.renew_leases([held], ttl_s=TTL_S),
        lambda: store.renew_leases([], ttl_s=TTL_S),
        lambda: store.read_lease("r"),
        lambda: store.append_control(cancel("r")),
        lambda: store.read_control("r"),
        lambda: store.control_heads(["r"]),
        lambda: store.control_heads([]),
        lambda: store.release_lease(held),
        store.aclose,
        store.aclose,
    ):
        with trio.testing.assert_checkpoints():
            await operation()


async def test_aclose_flushes_and_later_calls_raise(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = await SqliteStore.open(path)
    g = await lease(store, "r")
    await store.write_run_started(started("r"), seq=1, generation=g)  # not a barrier
    await store.aclose()
    await store.aclose()
    with pytest.raises(StoreError, match="closed"):
        await store.write_intent(intent("r", "m"), seq=2, generation=g)
    with pytest.raises(StoreError, match="closed"):
        await store.read_log("r")
    with pytest.raises(StoreError, match="closed"):
        await store.list_runs()
    with pytest.raises(StoreError, match="closed"):
        await store.acquire_lease("r", owner=OWNER, ttl_s=TTL_S)
    async with open_sqlite_store(path) as again:
        assert (await again.read_log("r")).records == (started("r"),)


def test_a_write_the_database_refuses_for_good_is_store_refused(tmp_path):
    """A read-only database (a file or folder the process may not write, a query-only
    connection) refuses every write the same way: `StoreRefused`, which ends a fleet worker
    instead of having it take its runs over again and again."""
    import sqlite3

    import treadle
    from treadle.stores.sqlite import _translate

    conn = sqlite3.connect(tmp_path / "ro.db")
    conn.execute("CREATE TABLE t (x)")
    conn.execute("PRAGMA query_only = 1")
    with pytest.raises(sqlite3.OperationalError) as info:
        conn.execute("INSERT INTO t VALUES (1)")
    conn.close()
    refused = _translate("ro.db", info.value, "cannot write to")
    assert isinstance(refused, treadle.StoreRefused) and "readonly" in str(refused)
    busy = sqlite3.OperationalError("database is locked")
    busy.sqlite_errorcode = sqlite3.SQLITE_BUSY
    assert type(_translate("ro.db", busy, "cannot write to")) is treadle.StoreError


async def test_a_committer_whose_backend_gives_up_stops_with_a_log_line_not_a_traceback(
    tmp_path: Path, monkeypatch, caplog
):
    """A database out of reach past the reconnect window: the committer thread died with a
    raw "Exception in thread treadle-committer" traceback among the worker's log lines."""
    import treadle
    from treadle.testing.scripted import ScriptedModel, say

    printed: list[object] = []
    monkeypatch.setattr(threading, "excepthook", printed.append)
    monkeypatch.setattr(sqlite_module.SqliteBackend, "commits_here", False)  # in the thread

    def gone(self: object, batch: object) -> object:
        raise StoreError("the database could not be reached again in 60 s")

    monkeypatch.setattr(sqlite_module.SqliteBackend, "commit", gone)
    agent = treadle.Agent(
        model=ScriptedModel(turns=[say("hi")]),
        executor=treadle.Toolbox([]),
        parser=treadle.NativeToolCallParser(),
    )
    async with open_sqlite_store(tmp_path / "runs.db") as store:
        with pytest.raises(StoreError, match="could not be reached again"):
            await treadle.run(agent, "go", store=store, run_id="r")
    assert printed == []
    assert "the committer of the SQLite store" in caplog.text
    assert "could not be reached again in 60 s" in caplog.text
