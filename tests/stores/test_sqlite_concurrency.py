"""The SQLite store under concurrency: many runs, other processes, never "database is locked".

What tests/stores/test_sqlite.py already covers: 100 concurrent runs in one process share
transactions (group commit); one reader process sees only committed prefixes of ONE run; a
SIGKILLed writer leaves every acknowledged barrier; two store objects conflict at commit.

Here: a reader process walking every run of a database that 100 concurrent runs are writing;
four writer processes plus a reader on one database at the same time; a process that
checkpoints the WAL continuously under a writer; and many concurrent readers in the writing
process. Every reader checks that each log is a committed prefix (whole steps, contiguous
seqs, never shrinking); nothing may fail with "database is locked".
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import trio

from treadle.stores import open_sqlite_store
from treadle.types import ActionResult, RunFinished

# The record pattern every writer here uses, and the prefix check every reader applies.
PRELUDE = """
import json, sys, trio
from treadle.stores import SqliteStore
from treadle.types import *

PATTERN = [ModelIntent, ModelResult, ActionIntent, ActionResult, StepRecord]

def check_prefix(records, steps):
    assert not records or isinstance(records[0], RunStarted), records[:1]
    body = records[1:]
    if body and isinstance(body[-1], RunFinished):
        body = body[:-1]
        assert len(body) == 5 * steps, ("finished early", len(body))
    for i, record in enumerate(body):
        assert type(record) is PATTERN[i % 5], (i, type(record))
        assert record.step == i // 5 + 1, (i, record.step)
    assert not body or not isinstance(body[-1], ActionResult), "half a step write"

async def write_run(store, run_id, steps):
    g = (await store.acquire_lease(run_id, owner="writer", ttl_s=600)).generation
    await store.write_run_started(
        RunStarted(run_id=run_id, ts="t", input=(), snapshot={}), seq=1, generation=g)
    seq = 2
    for step in range(1, steps + 1):
        m, a = f"m{step}", f"a{step}"
        await store.write_intent(
            ModelIntent(run_id=run_id, step=step, intent_id=m, attempt=1, ts="t"), seq=seq,
            generation=g)
        await store.write_model_result(
            ModelResult(run_id=run_id, step=step, intent_id=m, ts="t"), seq=seq + 1,
            generation=g)
        await store.write_intent(ActionIntent(
            run_id=run_id, step=step, intent_id=a, call_id="c", tool="t", arguments={},
            ts="t"), seq=seq + 2, generation=g)
        outcome = ActionOutcome(status=ActionStatus.EXECUTED, observation="o" * 100)
        result = ActionResult(run_id=run_id, step=step, intent_id=a, call_id="c", tool="t",
                              outcome=outcome, ts="t")
        record = StepRecord(run_id=run_id, step=step, ts="t", model_intent_id=m,
                            decision=DecisionKind.ACTIONS)
        await store.write_step([result], record, seq=seq + 3, generation=g)
        seq += 5
    await store.write_run_finished(RunFinished(
        run_id=run_id, ts="t", state=RunState.SUCCEEDED, stop_reason=StopReason.FINAL_ANSWER,
        totals=Totals()), seq=seq, generation=g)
"""

WRITER = (
    PRELUDE
    + """
async def main(path, prefix, runs, steps):
    store = await SqliteStore.open(path)
    try:
        async with trio.open_nursery() as nursery:
            for n in range(int(runs)):
                nursery.start_soon(write_run, store, f"{prefix}-{n:03}", int(steps))
    finally:
        await store.aclose()
    print(json.dumps({"runs": int(runs)}), flush=True)

trio.run(main, *sys.argv[1:])
"""
)

READER = (
    PRELUDE
    + """
async def main(path, runs, steps):
    runs, steps = int(runs), int(steps)
    store = await SqliteStore.open(path)
    lengths, reads, passes, growth = {}, 0, 0, 0
    try:
        with trio.fail_after(120):
            while True:
                passes += 1
                finished = 0
                for run_id in await store.list_runs():
                    records = (await store.read_log(run_id)).records
                    reads += 1
                    check_prefix(records, steps)
                    assert len(records) >= lengths.get(run_id, 0), "a record disappeared"
                    growth += len(records) != lengths.get(run_id, 0)
                    lengths[run_id] = len(records)
                    finished += bool(records) and isinstance(records[-1], RunFinished)
                if finished == runs:
                    break
    finally:
        await store.aclose()
    print(json.dumps({"reads": reads, "passes": passes, "growth": growth}), flush=True)

trio.run(main, *sys.argv[1:])
"""
)

CHECKPOINTER = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=10)
conn.execute("PRAGMA busy_timeout = 10000")
checkpoints = 0
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    checkpoints += 1
print(checkpoints, flush=True)
"""


def start(script: str, *args: object) -> subprocess.Popen[str]:
    command = [sys.executable, "-c", script, *map(str, args)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen[str]) -> dict[str, int]:
    try:
        out, err = process.communicate(timeout=150)
    finally:
        process.kill()
    assert process.returncode == 0, err
    assert "database is locked" not in err
    result: dict[str, int] = json.loads(out.splitlines()[-1])
    return result


async def create(path: Path) -> None:
    async with open_sqlite_store(path):
        pass  # the layout exists before any process races to create it


async def check_all(path: Path, prefixes: list[str], runs: int, steps: int) -> None:
    async with open_sqlite_store(path) as store:
        listed = await store.list_runs()
        assert sorted(listed) == sorted(f"{p}-{n:03}" for p in prefixes for n in range(runs))
        for run_id in listed:
            records = (await store.read_log(run_id)).records
            assert len(records) == 2 + 5 * steps
            assert isinstance(records[-1], RunFinished)


def test_a_reader_process_while_100_runs_write(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    trio.run(create, path)
    reader = start(READER, path, 100, 10)
    writer = start(WRITER, path, "w", 100, 10)
    assert finish(writer) == {"runs": 100}
    stats = finish(reader)
    assert stats["passes"] > 1 and stats["growth"] > 100, stats  # it saw the logs grow
    trio.run(check_all, path, ["w"], 100, 10)


def test_four_writer_processes_and_a_reader_on_one_database(tmp_path: Path) -> None:
    # With busy_timeout = 0 this load fails with "database is locked" in most runs.
    path = tmp_path / "runs.db"
    trio.run(create, path)
    reader = start(READER, path, 240, 12)
    writers = [start(WRITER, path, prefix, 60, 12) for prefix in "abcd"]
    for writer in writers:
        assert finish(writer) == {"runs": 60}
    assert finish(reader)["reads"] >= 240
    trio.run(check_all, path, list("abcd"), 60, 12)


def test_wal_checkpoints_from_another_process_never_lock_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    trio.run(create, path)
    checkpointer = subprocess.Popen(
        [sys.executable, "-c", CHECKPOINTER, str(path), "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    writer = start(WRITER, path, "c", 60, 12)
    assert finish(writer) == {"runs": 60}
    out, err = checkpointer.communicate(timeout=60)
    assert checkpointer.returncode == 0, err
    assert int(out) > 10
    trio.run(check_all, path, ["c"], 60, 12)


async def test_many_concurrent_readers_in_the_writing_process(tmp_path: Path) -> None:
    namespace: dict[str, object] = {}
    exec(PRELUDE, namespace)  # the same writer and prefix check the children use
    write_run = namespace["write_run"]
    check_prefix = namespace["check_prefix"]
    async with open_sqlite_store(tmp_path / "runs.db") as store:
        done = trio.Event()
        reads = 0

        async def read_forever(run_id: str) -> None:
            nonlocal reads
            last = 0
            while not done.is_set():
                records = (await store.read_log(run_id)).records
                check_prefix(records, 6)  # type: ignore[operator]
                assert len(records) >= last
                last = len(records)
                reads += 1
                await trio.sleep(0.001)

        with trio.fail_after(120):
            async with trio.open_nursery() as readers:
                for n in range(50):
                    readers.start_soon(read_forever, f"r-{n:03}")
                async with trio.open_nursery() as writers:
                    for n in range(50):
                        writers.start_soon(write_run, store, f"r-{n:03}", 6)  # type: ignore[arg-type]
                done.set()
        assert reads > 50
        for n in range(50):
            records = (await store.read_log(f"r-{n:03}")).records
            assert len(records) == 32 and not isinstance(records[-2], ActionResult)
